"""lm-eval's command line with the ``kvquant`` model registered and the offline tasks on the include path.

    python -m kvquant.lm_eval --model kvquant \\
        --model_args pretrained=../shared/data/models/stories260K/hf,quantizer=int4,residual_length=0 \\
        --tasks tinystories_lastword,lambada_openai_local --limit 100

lm-eval's own ``lm_eval`` command does not discover models from other packages; this one accepts all of its
flags. Offline copies of the data directory's tasks are named ``<task>_local``.
"""

import sys

from . import _register_with_lm_eval
from .tasks import task_dir


def main() -> None:
    _register_with_lm_eval()
    if "--include_path" not in sys.argv and not {"-h", "--help", "ls", "validate"} & set(sys.argv[1:2]):
        sys.argv += ["--include_path", str(task_dir())]
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
