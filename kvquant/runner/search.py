"""A per-layer bit allocation searched under the gate (``search:`` in a config).

1. **Calibration split**, held apart from evaluation: per gated perplexity set the ``search.windows`` windows
   after its ``limit``, per gated task the ``search.documents`` documents after its limit. Evaluation reads the
   first ``limit`` of each, so no window or document is shared.
2. **Sensitivity** of layer ``l`` at rung ``r`` of the ladder: the calibration loss (NLL per token over the
   calibration windows) when layer ``l`` alone drops to rung ``r`` while every other layer stays at the top rung,
   minus the loss with every layer at the top rung.
3. **Greedy order**: from every layer at the cheapest rung, repeatedly move the one layer one rung up that saves
   the most sensitivity per bit added, until every layer is at the top: maps ``M_0 .. M_K`` with growing bits.
4. **The gate decides**: the first ``M_m`` that passes the gate on the calibration split (baseline measured on
   the same split; ``search.max_perplexity_ratio`` in place of the gate's when set; on the perplexity sets alone
   when ``search.documents`` is 0), found by bisection over ``m`` (a map with more bits is taken to be no worse;
   every map checked is reported). With ``search.max_bits`` (a budget) instead: the last ``M_m`` within the
   budget (every map's bits simulated), measured on the calibration split too. The map is then evaluated, like
   any candidate, on the evaluation split, where the gate decides.

Measurements go through the run's result store (resumable); the choices above are recomputed from them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable

from tqdm.auto import tqdm

from kvquant.cache.build import spec_memory
from kvquant.experiment.config import SEARCH_PREFIX, Candidate, ExperimentConfig
from kvquant.errors import KVQuantError
from kvquant.experiment.metric import divergence_limits
from kvquant.runner.gate import decide, metric_rows
from kvquant.scoring.calibrate import calibration_documents, calibration_windows
from kvquant.scoring.session import BASELINE, Session, Split
from kvquant.experiment.results import Measured, SearchSummary
from kvquant.scoring.tasks import probe_distance, resolve_task, task_manager

CALIBRATION_BASELINE = SEARCH_PREFIX + "baseline"


def check_search(cfg: ExperimentConfig, shape, dtype, tokenizer, maxlen: int, rows: dict, folder) -> None:
    """Before the model loads: the ladder grows in bits, the calibration windows exist, no two task names read
    the same documents, and every gated task has the calibration documents after its limit."""
    bits = ladder_bits(cfg, shape, dtype, min(cfg.eval.memory_probe_tokens, maxlen))
    kinds = {kind for kind in shape.layout if kind != "shared"}
    # where every layer is alike, every map costs at least every layer at the cheapest rung; on a mixed layout
    # (sliding and full layers) a rung can cost fewer bits on one kind than the next rung down, so search() checks
    if cfg.search.max_bits is not None and len(kinds) == 1 and cfg.search.max_bits < bits[0]:
        raise KVQuantError(f"search.max_bits {cfg.search.max_bits:g} is below the cheapest map: every layer at "
                           f"{cfg.search.ladder[0].label} takes {bits[0]:.3f} bits per element")
    calibration_windows(cfg, tokenizer, maxlen, rows)
    if not cfg.search.documents:  # calibration reads no task document: nothing to hold apart
        return
    resolved = {}
    for task in cfg.eval.tasks.names:
        same = resolved.setdefault(resolve_task(task) if probe_distance(task) is None else probe_distance(task), task)
        if same != task:
            raise KVQuantError(f"search: eval.tasks.names {same!r} and {task!r} read the same documents, so one "
                               "could calibrate on what the other evaluates; list it once")
    import datasets

    datasets.disable_progress_bars()  # stderr holds one line on bad input
    manager = task_manager(str(folder) if folder else None)
    for task, docs in calibration_documents(cfg).items():
        name = resolve_task(task)
        size = len(manager.load([name])["tasks"][name].eval_docs)
        if docs.stop > size:
            raise KVQuantError(f"search: task {task!r} has {size} documents; evaluation reads {docs.start} and "
                               f"calibration {len(docs)} more; lower eval.tasks.limit or search.documents")


def layer_setting(rung: Candidate) -> dict:
    """A ladder rung as an explicit ``layers=`` entry (quantizer, every option, residual_length, sink_tokens)."""
    spec = rung.spec
    return {**spec.quantizer.describe(), "residual_length": spec.residual_length, "sink_tokens": spec.sink_tokens}


def map_candidate(ladder: list[Candidate], rungs: dict[int, int], name: str) -> Candidate:
    """The candidate giving layer ``l`` rung ``rungs[l]``: the cheapest rung's settings for the cache, a
    ``layers`` entry for each run of consecutive layers at another rung."""
    base = ladder[0]
    layers, order = {}, sorted(rungs)
    start = 0
    for i, layer in enumerate(order):
        last = i + 1 == len(order) or order[i + 1] != layer + 1 or rungs[order[i + 1]] != rungs[layer]
        if last:
            first = order[start]
            if rungs[layer]:
                layers[f"{first}-{layer}" if layer > first else str(first)] = layer_setting(ladder[rungs[layer]])
            start = i + 1
    return Candidate(base.quantizer, {**base.options, **({"layers": layers} if layers else {})}, name)


def greedy_order(sensitivity: dict[int, list[float]], bits: list[float]) -> list[dict[int, int]]:
    """Maps ``M_0 .. M_K`` (``{layer: rung}``): ``M_0`` every layer at rung 0, each next one a single layer one
    rung up, the step with the most sensitivity saved per bit added (ties: the lower layer); ``M_K`` every layer
    at the top rung. ``sensitivity[l][r]``: loss increase with layer ``l`` alone at rung ``r`` (0 at the top)."""
    top = len(bits) - 1
    state = dict.fromkeys(sensitivity, 0)
    maps = [dict(state)]
    while any(r < top for r in state.values()):
        def gain(layer):
            r = state[layer]
            return (sensitivity[layer][r] - sensitivity[layer][r + 1]) / (bits[r + 1] - bits[r])
        best = max((layer for layer in sorted(state) if state[layer] < top), key=gain)  # max keeps the first
        state[best] += 1
        maps.append(dict(state))
    return maps


def first_passing(passes: Callable[[int], bool], count: int) -> int | None:
    """The smallest ``m`` in ``0..count-1`` with ``passes(m)``, by bisection (``passes`` taken to be monotone);
    None when even the last fails."""
    if not passes(count - 1):
        return None
    low, high = -1, count - 1  # passes(high) holds; passes(low) fails (or low = -1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if passes(mid) else (mid, high)
    return high


def last_within(bits: list[float], budget: float) -> int | None:
    """The last index whose bits are at most ``budget`` (None when none is): maps later in the greedy order are
    predicted to lose less, and on a mixed layout their bits need not grow step by step."""
    return max((m for m, b in enumerate(bits) if b <= budget), default=None)


def candidate_bits(candidate: Candidate, shape, dtype, tokens: int) -> float:
    """Bits per element of ``candidate``'s cache after ``tokens`` tokens, simulated on the model's shape."""
    return spec_memory(candidate.spec, shape, tokens=tokens, dtype=dtype)["bits_per_element"]


def ladder_bits(cfg: ExperimentConfig, shape, dtype, tokens: int) -> list[float]:
    """Bits per element of each rung applied to every layer after ``tokens`` tokens (the candidates' memory
    probe length); they must grow strictly up the ladder."""
    bits = [candidate_bits(rung, shape, dtype, tokens) for rung in cfg.search.ladder]
    for i in range(1, len(bits)):
        if not bits[i] > bits[i - 1]:
            raise KVQuantError(f"search.ladder must grow in bits per element, cheapest first: "
                               f"{cfg.search.ladder[i].label} ({bits[i]:.3f}) is not above "
                               f"{cfg.search.ladder[i - 1].label} ({bits[i - 1]:.3f})")
    return bits


def _label(rungs: dict[int, int]) -> str:
    return SEARCH_PREFIX + hashlib.sha256(json.dumps(sorted(rungs.items())).encode()).hexdigest()[:16]


def _loss(result: Measured) -> float:
    """NLL per token over the perplexity sets of one calibration measurement."""
    ppl = result.perplexity()
    return sum(sum(o.scores) for o in ppl) / sum(sum(o.tokens) for o in ppl)


class _Search:
    """One search's state: the calibration split, the layers' sensitivities, the greedy maps, the maps checked."""

    def __init__(self, session: Session, rows: dict):
        self.session, self.cfg, self.spec = session, session.cfg, session.cfg.search
        self.ladder, self.top = self.spec.ladder, len(self.spec.ladder) - 1
        self.calibration = calibration_windows(self.cfg, session.tokenizer, session.maxlen, rows)
        self.documents = calibration_documents(self.cfg)
        self.split = Split("calibration", {name: ws for name, (_, ws) in self.calibration.items()}, self.documents,
                           progress=False)
        self.tokens = min(self.cfg.eval.memory_probe_tokens, session.maxlen)  # as the candidates' bits are measured
        self.bits = ladder_bits(self.cfg, session.shape, session.model.dtype, self.tokens)
        self.layers = [i for i, w in enumerate(session.shape.layout) if w != "shared"]
        self.gate = self.cfg.gate if self.spec.max_perplexity_ratio is None else dataclasses.replace(
            self.cfg.gate, max_perplexity_ratio=self.spec.max_perplexity_ratio)
        self.results = {CALIBRATION_BASELINE: self.measure(BASELINE, CALIBRATION_BASELINE, tasks=True)}
        self.checked: dict[int, dict] = {}

    def measure(self, candidate: Candidate, label: str, tasks: bool) -> Measured:
        """``candidate`` on the calibration split; a map gated there (``tasks``) is also measured on what the gate
        gates beyond tasks and perplexity: its KL divergence (and top-1 agreement) when the gate limits either."""
        divergence = tasks and bool(divergence_limits(self.gate))
        return self.session.measure(candidate, self.split, label, tasks=tasks, divergence=divergence)

    def sensitivities(self) -> None:
        """Each layer's loss increase at each rung below the top, every other layer at the top; then the maps."""
        all_top = dict.fromkeys(self.layers, self.top)
        self.reference = _loss(self.measure(map_candidate(self.ladder, all_top, "top"), _label(all_top), False))
        self.sensitivity = {}
        with tqdm(total=len(self.layers) * self.top, desc="search: layer sensitivity", disable=False) as bar:
            for layer in self.layers:
                self.sensitivity[layer] = []
                for rung in range(self.top):
                    rungs = {**all_top, layer: rung}
                    probe = self.measure(map_candidate(self.ladder, rungs, "probe"), _label(rungs), tasks=False)
                    self.sensitivity[layer].append(_loss(probe) - self.reference)
                    bar.update()
                self.sensitivity[layer].append(0.0)
        self.maps = greedy_order(self.sensitivity, self.bits)

    @functools.cache  # noqa: B019  (one search object per run)
    def map_bits(self, m: int) -> float:
        shape, dtype = self.session.shape, self.session.model.dtype
        return candidate_bits(map_candidate(self.ladder, self.maps[m], "map"), shape, dtype, self.tokens)

    def passes(self, m: int) -> bool:
        """Map ``m`` measured on the calibration split and gated there (every check is kept for the report)."""
        label = _label(self.maps[m])
        self.results[label] = self.measure(map_candidate(self.ladder, self.maps[m], label), label, tasks=True)
        table = metric_rows(self.cfg, self.results, [label], baseline=CALIBRATION_BASELINE)
        # picks the map, decides nothing (the evaluation split's gate does, held to the counts): not counted
        passed = decide(table, {label: self.map_bits(m)}, self.gate, counted=False).passed[label]
        self.checked[m] = {"step": m, "bits_per_element": self.map_bits(m), "passed": passed,
                           "metrics": {row.metric.name: row.statistic for row in table if row.gated}}
        if self.session.processes.is_main_process:
            print(f"kvquant: search: step {m}/{len(self.maps) - 1} ({self.map_bits(m):.3f} bits/element): "
                  f"{'passes' if passed else 'fails'} on the calibration split")
        return passed

    def choose(self) -> tuple[int, int | None]:
        """``(chosen step, step that passed or None)``: the first passing map, or the last within the budget."""
        if self.spec.max_bits is None:
            found = first_passing(self.passes, len(self.maps))
            return (found if found is not None else len(self.maps) - 1), found
        every = [self.map_bits(m) for m in range(len(self.maps))]
        chosen = last_within(every, self.spec.max_bits)
        if chosen is None:
            raise KVQuantError(f"search.max_bits {self.spec.max_bits:g} is below every map of the greedy order "
                               f"(the cheapest takes {min(every):.3f} bits per element)")
        return chosen, (chosen if self.passes(chosen) else None)

    def summary(self, chosen: int, found: int | None) -> SearchSummary:
        """What the report shows of the search."""
        return SearchSummary(
            name=self.spec.name, max_bits=self.spec.max_bits, found=found is not None, step=chosen,
            steps=len(self.maps) - 1,
            ladder=tuple({"name": r.label, "quantizer": r.quantizer, "options": r.options, "bits_per_element": b}
                         for r, b in zip(self.ladder, self.bits)),
            map={str(layer): self.ladder[rung].label for layer, rung in sorted(self.maps[chosen].items())},
            sensitivity={str(layer): s for layer, s in self.sensitivity.items()},
            reference_loss=self.reference,
            checked=tuple(self.checked[m] for m in sorted(self.checked)),
            calibration={"windows": {name: [start, start + len(ws)] for name, (start, ws) in self.calibration.items()},
                         "documents": {t: [d.start, d.stop] for t, d in self.documents.items()},
                         "max_perplexity_ratio": self.gate.max_perplexity_ratio,
                         "tasks_gated": bool(self.documents),
                         **divergence_limits(self.gate)})


def search(session: Session, rows: dict) -> tuple[Candidate, SearchSummary]:
    """Run the search through ``session`` (the run's model, config and result store, the same measuring code as
    every candidate's); returns the map found (named ``search.name``) and what the report shows of it."""
    state = _Search(session, rows)
    state.sensitivities()
    chosen, found = state.choose()
    return map_candidate(state.ladder, state.maps[chosen], state.spec.name), state.summary(chosen, found)
