"""lm-eval model ``kvquant``: every request is scored through a quantized cache.

``lm_eval.simple_evaluate(model="kvquant", model_args="pretrained=DIR,quantizer=int4,group_size=32")``.
Loglikelihood and multiple-choice requests go through :class:`kvquant.evaluate.Scorer` (simulated or
streaming mode); generation builds a fresh quantized cache per request. Options other than the ones named
in ``__init__`` are handed to ``kvquant.make_cache`` (``group_size``, ``residual_length``, ``key_bits``, ...).
"""

from __future__ import annotations

import sys

import torch
import yaml
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from .cache import make_cache
from .config import ModelConfig
from .evaluate import Scorer
from .models import load_model, max_length as model_max_length


def _parse(value):
    """model_args values arrive as strings: '32' -> 32, 'true' -> True."""
    return yaml.safe_load(value) if isinstance(value, str) else value


@register_model("kvquant")
class KVQuantLM(TemplateLM):
    def __init__(
        self,
        pretrained,
        tokenizer=None,
        quantizer: str = "fp16",
        mode: str = "simulated",
        chunk_size: int = 64,
        dtype: str = "float32",
        device: str | None = None,
        device_map: str | None = None,
        max_length: int | None = None,
        gguf_file: str | None = None,
        batch_size=None,
        max_batch_size=None,
        **cache_options,
    ):
        super().__init__()
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            print(f"kvquant: device {device!r} is not available (lm-eval's default); using the CPU", file=sys.stderr)
            device = "cpu"
        if isinstance(pretrained, str):
            spec = ModelConfig(path=pretrained, tokenizer=tokenizer, dtype=dtype, device=device or "auto",
                               device_map=device_map, gguf_file=gguf_file, max_length=_parse(max_length))
            self.model, self.tokenizer = load_model(spec)
        else:  # an already loaded model and tokenizer (the runner reuses one model for every candidate)
            self.model, self.tokenizer = pretrained, tokenizer
            spec = ModelConfig(max_length=_parse(max_length))
        self.max_length = model_max_length(self.model, spec)
        options = {k: _parse(v) for k, v in cache_options.items()}
        self.quantizer = quantizer
        self.cache_options = options
        make_cache(self.model, quantizer, **options)  # validate the settings now, not at the first request
        self.scorer = Scorer(self.model, self.new_cache, mode, int(_parse(chunk_size)))

    def new_cache(self):
        return make_cache(self.model, self.quantizer, **self.cache_options)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer(string, add_special_tokens=True if add_special_tokens is None else add_special_tokens).input_ids

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        ids = (context + continuation)[-(self.max_length + 1) :]
        scored = self.scorer.score(ids, len(ids) - len(continuation))
        return float(scored.logprobs.double().sum()), bool(scored.greedy.all())

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return [self._score(ctx, cont) for _, ctx, cont in tqdm(requests, desc="kvquant loglikelihood", disable=disable_tqdm)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for (string,) in tqdm([r.args for r in requests], desc="kvquant rolling", disable=disable_tqdm):
            tokens = self.tok_encode(string, add_special_tokens=False)
            pairs = map(make_disjoint_window, get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1))
            out.append(sum(self._score(ctx, pred)[0] for ctx, pred in pairs))
        return out

    def generate_until(self, requests, disable_tqdm: bool = False):
        out = []
        for context, gen_kwargs in tqdm([r.args for r in requests], desc="kvquant generate", disable=disable_tqdm):
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
                generated = self.model.generate(inputs, cache=self.new_cache(), max_new_tokens=max_new,
                                                pad_token_id=self.eot_token_id, **kwargs)
            text = self.tokenizer.decode(generated[0, len(ids) :], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            out.append(text)
        return out
