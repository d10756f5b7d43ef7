"""lm-eval model ``kvquant``: every request is scored through a quantized cache.

``lm_eval.simple_evaluate(model="kvquant", model_args="pretrained=DIR,quantizer=int4,group_size=32")``.
Loglikelihood and multiple-choice requests go through :class:`kvquant.scoring.scorer.Scorer` (simulated or
streaming mode) in batches of ``batch_size`` rows; in streaming mode the choices of one question prefill their
shared context once (``share_prefix``). Generation builds a fresh quantized cache per request. Options other
than the ones named in ``__init__`` are handed to ``kvquant.make_cache`` (``group_size``, ``residual_length``,
``key_bits``, ...). Importing this module registers the model with lm-eval (``import kvquant`` alone does not
import lm-eval).

Under several processes (``torchrun`` / ``accelerate launch``) the work is shared out in one of two ways
(``share_out``): ``documents``, lm-eval's own protocol (each rank builds and scores its share of every task's
documents, and lm-eval gathers them on rank 0), or ``requests``, the runner's way (every rank builds every request,
with the same few-shot draws as one process, and the scorer shares out its requests; every rank gets all scores).
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401  (before registering: lm-eval fills its built-in models only into an empty registry)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from kvquant.cache import CacheSpec, make_cache
from kvquant.compat.lm_eval import set_rank
from kvquant.experiment.model_config import ModelConfig, check_device
from kvquant.yaml_reader import load_yaml
from kvquant.errors import ConfigError, KVQuantError, check_int, is_int
from kvquant.scoring.scorer import Scorer, check_mode
from kvquant.scoring.models import check_device_present, load_model, max_length as model_max_length
from kvquant.scoring import fewshot
from kvquant.scoring import parallel


#: rows per batch for lm-eval's ``batch_size=auto`` (kvquant does not probe memory)
DEFAULT_AUTO_BATCH = 16
#: How several processes share the work (the module docstring).
SHARE_OUT = ("documents", "requests")


def parse_value(value):
    """A model_args value as lm-eval and the kvquant model read it: non-strings as they are, ``None`` -> None,
    else YAML (``'32'`` -> 32, ``'true'`` -> True) through kvquant's bounded loader, else the string itself."""
    if not isinstance(value, str):
        return value
    if value in ("None", "none"):
        return None
    try:
        return load_yaml(value, "--model_args")
    except ConfigError as err:
        if "not valid YAML" in str(err):
            return value  # a plain string
        raise


#: digits of the largest count a command line may give (Python reads at most 4,300 digits of text as an integer)
MAX_DIGITS = 18


def whole_number(value, name: str, minimum: int = 1, what: str | None = None) -> int:
    """``value`` (an int, or its text of at most :data:`MAX_DIGITS` digits) as an integer >= ``minimum``; else one
    line naming ``name``."""
    text = value.strip() if isinstance(value, str) else None
    digits = text.lstrip("-").lstrip("0") if text is not None else ""
    if len(digits) > MAX_DIGITS and digits.isdigit():
        raise KVQuantError(f"{name} must be {what or f'an integer >= {minimum}'}, got a {len(digits)}-digit number")
    ok = is_int(value) or (text is not None and text.lstrip("-").isdigit())
    if not ok or int(value) < minimum:
        shown = value if isinstance(value, str) else repr(value)
        raise KVQuantError(f"{name} must be {what or f'an integer >= {minimum}'}, got {shown!r}")
    return int(value)


def batch_rows(batch_size, max_batch_size=None, names: tuple[str, str] = ("batch_size", "max_batch_size")) -> int:
    """Rows per forward for lm-eval's ``batch_size`` (an integer >= 1, ``auto`` or ``auto:N``; None is 1) and
    ``max_batch_size`` (caps ``auto``). kvquant does not probe memory: ``auto`` is :data:`DEFAULT_AUTO_BATCH`.
    ``names``: how messages name the two (``--batch_size`` on the command line)."""
    what = "an integer >= 1, 'auto' or 'auto:N' (N >= 1)"
    cap = None if max_batch_size is None else whole_number(max_batch_size, names[1])
    if batch_size is None:
        return 1
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        if batch_size != "auto":
            head, _, tries = batch_size.partition(":")
            if head != "auto" or not tries.isdigit() or int(tries) < 1:
                raise KVQuantError(f"{names[0]} must be {what}, got {batch_size!r}")
        return min(DEFAULT_AUTO_BATCH, cap) if cap else DEFAULT_AUTO_BATCH
    return whole_number(batch_size, names[0], what=what)


def check_sharing(share_prefix, share_out: str, prefix: str = "") -> bool:
    """The model's ``share_prefix`` (true or false, or its text) as a bool, and ``share_out`` checked to be one of
    :data:`SHARE_OUT`; else one line (names prefixed with ``prefix``, e.g. ``model_args.``)."""
    share_prefix = parse_value(share_prefix)
    if not isinstance(share_prefix, bool):
        raise KVQuantError(f"{prefix}share_prefix must be true or false, got {share_prefix!r}")
    if share_out not in SHARE_OUT:
        raise KVQuantError(f"{prefix}share_out must be one of {', '.join(SHARE_OUT)}, got {share_out!r}")
    return share_prefix


@register_model("kvquant")
class KVQuantLM(TemplateLM):
    def __init__(
        self,
        pretrained,
        tokenizer=None,
        quantizer: str | CacheSpec = "fp16",
        mode: str = "simulated",
        chunk_size: int = 64,
        dtype: str = "float32",
        device: str | None = None,
        device_map: str | None = None,
        max_length: int | None = None,
        gguf_file: str | None = None,
        batch_size=1,
        max_batch_size=None,
        share_prefix=True,
        share_out: str = "documents",
        **cache_options,
    ):
        super().__init__()
        chunk_size, max_length = map(parse_value, (chunk_size, max_length))
        share_prefix = check_sharing(share_prefix, share_out)
        batch_size = batch_rows(batch_size, max_batch_size)
        check_mode(mode, chunk_size)
        if max_length is not None:
            check_int("max_length", max_length, minimum=2)
        if device:  # kvquant.lm_eval passes auto where its --device is not given (lm-eval's own default: cuda:0)
            check_device("device", device)
            check_device_present(device, "device")
        group = parallel.current()
        if group.world > 1:  # launched with several processes: this one scores its share
            if device_map:
                raise KVQuantError("device_map shards one model over devices; it cannot be combined with several "
                                   "data-parallel processes (launch one process, or drop device_map)")
            device = parallel.process_gpu() or device  # one GPU per process
            if share_out == "documents":
                set_rank(self, group.rank, group.world)
        if isinstance(pretrained, str):
            spec = ModelConfig(path=pretrained, tokenizer=tokenizer, dtype=dtype, device=device or "auto",
                               device_map=device_map, gguf_file=gguf_file, max_length=max_length)
            self.model, self.tokenizer = load_model(spec)
        else:  # an already loaded model and tokenizer (the runner reuses one model for every candidate)
            self.model, self.tokenizer = pretrained, tokenizer
            spec = ModelConfig(max_length=max_length)
        self.max_length = model_max_length(self.model, spec)
        self.shots = fewshot.expected_shots()  # kvquant.lm_eval's --num_fewshot: requests are checked to fit, never cut
        options = {k: parse_value(v) for k, v in cache_options.items()}
        self.spec = CacheSpec.of(quantizer, options)
        make_cache(self.model, self.spec)  # validate the settings on this model now, not at the first request
        self.processes = group if share_out == "requests" else parallel.ONE
        self.scorer = Scorer(self.model, self.spec, mode, chunk_size, batch_size, share_prefix, self.processes)

    # lm-eval's data-parallel protocol (lm_eval.api.model.LM): with world_size > 1 its evaluator gives each rank
    # its share of every task's documents, then gathers the scored samples on rank 0
    def all_gather(self, tensor):
        from accelerate.utils import gather

        return gather(tensor) if self.world_size > 1 else tensor

    def gather_object(self, obj, dst=0):
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = True if add_special_tokens is None else add_special_tokens
        return self.tokenizer(string, add_special_tokens=special).input_ids

    def _score(self, pairs: list[tuple[list[int], list[int]]], desc: str | None) -> list[tuple[float, bool]]:
        """Log-likelihood and greedy match of each continuation, keeping the last max_length + 1 tokens."""
        cut = []
        for context, continuation in pairs:
            ids = (context + continuation)[-(self.max_length + 1) :]
            cut.append((ids[: len(ids) - len(continuation)], ids[len(ids) - len(continuation) :]))
        return [(float(s.logprobs.double().sum()), bool(s.greedy.all())) for s in self.scorer.score_many(cut, desc)]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        """lm-eval's log-likelihood requests (all of them at once), checked before any is scored: few-shot contexts
        longer than the model's are refused (:func:`kvquant.scoring.fewshot.check_requests`), not cut."""
        fewshot.check_requests(requests, fewshot.counter(self.tokenizer), self.shots, self.max_length)
        return super().loglikelihood(requests, disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self._score([(ctx, cont) for _, ctx, cont in requests],
                           None if disable_tqdm else "kvquant loglikelihood")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for (string,) in tqdm([r.args for r in requests], desc="kvquant rolling", disable=disable_tqdm):
            tokens = self.tok_encode(string, add_special_tokens=False)
            windows = get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            pairs = map(make_disjoint_window, windows)
            out.append(sum(logprob for logprob, _ in self._score(list(pairs), None)))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        """Each request's greedy (or sampled) continuation through a fresh quantized cache; with ``share_out``
        ``requests``, each process generates every ``world``-th one and all are gathered. Few-shot contexts are
        checked first, as in :meth:`loglikelihood`."""
        fewshot.check_requests(requests, fewshot.counter(self.tokenizer), self.shots, self.max_length)
        args = [r.args for r in requests]
        mine = self.processes.share(list(range(len(args))))
        texts = self._generate([args[i] for i in mine], disable_tqdm or not self.processes.is_main_process)
        out: list[str | None] = [None] * len(args)
        for part in self.processes.gather(list(zip(mine, texts))):
            for i, text in part:
                out[i] = text
        return out

    def _generate(self, args: list, disable_tqdm: bool) -> list[str]:
        out = []
        for context, gen_kwargs in tqdm(args, desc="kvquant generate", disable=disable_tqdm):
            kwargs = dict(gen_kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.pop("max_gen_toks", 256))
            kwargs.setdefault("do_sample", False)
            if not kwargs["do_sample"]:
                kwargs.pop("temperature", None)
            ids = self.tok_encode(context)[-max(self.max_length - max_new, 1) :]
            inputs = torch.tensor([ids], device=self.scorer.device)
            with torch.inference_mode():
                generated = self.model.generate(inputs, cache=make_cache(self.model, self.spec), max_new_tokens=max_new,
                                                pad_token_id=self.eot_token_id, **kwargs)
            text = self.tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            out.append(text)
        return out
