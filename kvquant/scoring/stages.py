"""The staged memory loop (``stages:`` in a config): levers stacked from lossless to lossy, each stage gated.

Every stage is measured like a candidate (perplexity and tasks, the long-range probe per distance, through its
cache) and, here, on a serving shape: ``requests`` requests sharing a ``prefix``-token prompt, each with
``suffix`` tokens of its own, then ``decode_steps`` greedy decoding steps of the whole batch. Measured: KV bytes
per request (``memory_report()``; with prefix sharing the prefix's stored units are counted once), the largest
batch that fits ``memory_budget`` (the shared bytes once plus each request's own bytes, as the planner counts),
and the decode step latency (p50/p99 over the steps, on this machine). The decision: stages are judged in order;
the first one that does not pass the gate ends the loop, and the last stage before it is the answer.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvquant.cache import make_cache, stack_rows
from kvquant.experiment.config import ServingConfig, Stage
from kvquant.errors import KVQuantError
from kvquant.experiment.results import StageServing


def serving_tokens(serving: ServingConfig, ids: list[int]) -> tuple[list[int], list[list[int]]]:
    """The shared prefix and each request's own tokens, cut in order from one token stream (so every request
    continues different text)."""
    need = serving.prefix + serving.requests * serving.suffix
    if len(ids) < need:
        raise KVQuantError(f"serving: {need} tokens are needed (prefix + requests x suffix), the text has {len(ids)}")
    own = ids[serving.prefix : need]
    return ids[: serving.prefix], [own[i * serving.suffix : (i + 1) * serving.suffix] for i in range(serving.requests)]


@torch.inference_mode()
def serve(model, stage: Stage, serving: ServingConfig, prefix: list[int], suffixes: list[list[int]]) -> StageServing:
    """Bytes and decode latency of one stage on the serving shape."""
    device = model.get_input_embeddings().weight.device
    n = len(suffixes)
    if stage.prefix_sharing:  # prefill once, fork the rows
        first = make_cache(model, stage.spec)
        model(torch.tensor([prefix], device=device), cache=first)
        cache = stack_rows([(first, 0)] * n)
        del first
    else:
        cache = make_cache(model, stage.spec)
        model(torch.tensor([prefix] * n, device=device), cache=cache)
    logits = model(torch.tensor(suffixes, device=device), cache=cache).logits[:, -1]
    steps = []
    for _ in range(serving.decode_steps):
        token = logits.argmax(-1, keepdim=True)
        start = time.perf_counter()
        logits = model(token, cache=cache).logits[:, -1]
        if device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(1000 * (time.perf_counter() - start))
    report = cache.memory_report()
    total = report["total_bytes"]
    shared_once = report["shared_bytes"]  # still held by several requests at the end (eviction may free some)
    own = (total - shared_once) / n  # what each further request adds
    return StageServing(requests=n, tokens_per_request=len(prefix) + len(suffixes[0]) + serving.decode_steps,
                        kv_bytes=total, kv_bytes_per_request=total / n, shared_bytes=shared_once,
                        own_bytes_per_request=own, shared_saved_bytes=report["shared_saved_bytes"],
                        fp16_bytes=report["fp16_bytes"], step_ms=tuple(steps),
                        p50_ms=float(np.percentile(steps, 50)), p99_ms=float(np.percentile(steps, 99)))


def staged_decision(stages: list[Stage], passed: dict[str, bool]) -> tuple[str, str | None, str | None, str]:
    """``(decision, chosen, first stage that does not pass, reason)``: the last stage before the first that does
    not pass."""
    chosen = None
    for stage in stages:
        if not passed[stage.label]:
            if chosen is None:
                return "fail", None, stage.label, f"the first stage, {stage.label}, does not pass the gate"
            return "pass", chosen, stage.label, (f"{chosen} is the last stage before the first that does not "
                                                 f"pass ({stage.label})")
        chosen = stage.label
    return "pass", chosen, None, f"every stage passes the gate; {chosen}, the last, is the answer"
