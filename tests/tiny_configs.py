"""Small run configs on stories260K that tests start from (a config dict, the smallest run's YAML, the weights digest
its results are keyed by), and the ``--set`` arguments of their overrides."""

import functools
from pathlib import Path

import yaml

MODEL = "local:models/stories260K/hf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"


@functools.cache
def tiny_weights() -> str:
    """stories260K's weights digest, as a run on :data:`MODEL` computes it here: what its store keys every result
    with (computed, never written down: it names what the model computes with, and a test that knew it by heart
    would pass on one machine only)."""
    from kvquant.experiment.model_config import ModelConfig
    from kvquant.scoring.models import load_model
    from kvquant.scoring.session import weights_digest

    return weights_digest(*load_model(ModelConfig(path=MODEL)))


def tiny_run(name: str, candidate: str, tasks_limit: int, **gate) -> dict:
    """A run config on stories260K: one int4 candidate named ``candidate`` (no residual window), 4 tinystories
    documents of 64 tokens and ``tasks_limit`` of tinystories_lastword, both gated (``gate``: more of the gate's
    keys)."""
    return {
        "name": name,
        "model": {"path": MODEL},
        "candidates": [{"quantizer": "int4", "name": candidate, "options": {"residual_length": 0}}],
        "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 4, "max_length": 64}],
                 "tasks": {"names": ["tinystories_lastword"], "limit": tasks_limit}},
        "gate": {"tasks": ["tinystories_lastword"], "perplexity": ["tinystories"], **gate},
    }


#: a run on stories260K whose candidate a per-layer search over int2 and int8 finds (YAML; ``out``: its output_dir)
SEARCHED_RUN = """
name: searched-tiny
output_dir: {out}
eval:
  batch_size: 8
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 6, max_length: 128}}
  tasks: {{names: [tinystories_lastword], limit: 20}}
gate: {{bootstrap: 1000, max_perplexity_ratio: 1.02, tasks: [tinystories_lastword]}}
search:
  name: mixed
  windows: 4
  documents: 16
  ladder:
    - {{quantizer: int2, name: int2, options: {{residual_length: 0}}}}
    - {{quantizer: int8, name: int8, options: {{residual_length: 0}}}}
"""

#: one int4 candidate ``q`` on 4 tinystories documents and 4 of tinystories_lastword, both gated
SMALL_GATED = tiny_run("small", "q", tasks_limit=4)


def write_run(folder: Path, name: str = "config.yaml", **changes) -> Path:
    """:data:`SMALL_GATED` with its sections ``changes`` replaced, written to ``folder/name`` (its reports go under
    ``folder/reports``)."""
    path = folder / name
    path.write_text(yaml.safe_dump({**SMALL_GATED, "output_dir": str(folder / "reports"), **changes}))
    return path


def set_args(*overrides: str) -> list[str]:
    """``--set`` before each override, as kvquant.run and kvquant.plan take them."""
    return [a for o in overrides for a in ("--set", o)]


#: the smallest run of the runner's tests (int8 on two tinystories windows), its report folder ``{out}`` to fill in
TINY = """
name: tiny
output_dir: {out}
candidates:
  - {{quantizer: int8, name: int8, options: {{group_size: 32, residual_length: 0}}}}
eval:
  perplexity:
    - {{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 2, max_length: 128}}
gate: {{bootstrap: 1000}}
"""
