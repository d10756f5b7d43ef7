"""The calibration split, and static KV scales observed on it as llm-compressor observes the scales a checkpoint ships.

The split is what calibration reads, here so that the code version's hash covers it: the perplexity windows after
those that evaluation reads of the same text (:func:`calibration_windows`) and, for the per-layer search, the task
documents after each gated task's evaluation limit (:func:`calibration_documents`).

Per layer, every calibration window is one forward; each forward's minimum and maximum of the post-RoPE keys
(and values) are taken over all tokens, heads and channels (``tensor``) or per KV head (``head``), and a running
minimum and maximum move from the first forward's by ``averaging`` per forward (llm-compressor's minmax observer,
constant 0.01: ``llmcompressor/observers/min_max.py:44-74``). The range is widened to hold 0 and its absolute
maximum ``amax`` divided by the format's divisor (``compressed_tensors/quantization/utils/helpers.py:52-127``:
448 for fp8 e4m3, so ``x / scale`` spans e4m3's range; ModelOpt's nvfp4 global scale: 6 x 448). float32 here;
llm-compressor computes in the model's dtype (bf16 on a GPU).

A moving average sits below the largest value seen, so some calibration values can lie beyond the format's range at
the scale chosen: each layer's largest ``|x| / scale`` is kept and the runner warns where it passes the divisor
(they saturate). Under several processes, process 0 observes and hands the result to the others.

A key offset (``calibrate: key_offset``, a quantizer with the ``key_offset`` option) is, per layer, KV head and
channel, the mean of the post-RoPE keys over every calibration token, summed in float64 (:func:`key_means`): what
:class:`kvquant.formats.lowbit.OffsetCodec` subtracts before quantizing and adds back on read. ``calibrate: key_bias``
sets the same option from the weights alone (:func:`key_biases`: each layer's ``k_proj`` bias, no windows, no
forward), for a ``pre_rope`` cache only: before RoPE every key is ``W x + b``, so ``b`` is the constant removed exactly;
a model without the bias is refused before it loads (:meth:`Calibration.check_model`, on its layers built on the meta
device).

Each ``calibrate:`` value is a :class:`Calibration` of :data:`CALIBRATIONS`: what it observes, the quantizer options
it sets per layer (through ``layers``) from that, what keys the stored observation and what the report shows.
"""

from __future__ import annotations

import dataclasses

import torch

from kvquant.cache import ObservingCache
from kvquant.cache.build import written_shapes
from kvquant.experiment.config import Candidate, ExperimentConfig
from kvquant.errors import KVQuantError
from kvquant.formats.quantizers import QUANTIZERS
from kvquant.scoring import data
from kvquant.scoring.level_fit import fitted_levels
from kvquant.scoring.models import skeleton


def calibration_documents(cfg: ExperimentConfig) -> dict[str, range]:
    """Per gated task: the document indices after its evaluation limit (none when ``search.documents`` is 0)."""
    if not cfg.search.documents:
        return {}
    return {task: range(cfg.eval.tasks.limit_for(task), cfg.eval.tasks.limit_for(task) + cfg.search.documents)
            for task in cfg.gated_tasks()}


def _same_data(pset) -> tuple:
    """What decides a perplexity set's windows, its name and limit aside."""
    return tuple(v for k, v in dataclasses.asdict(pset).items() if k not in ("name", "limit"))


def calibration_windows(cfg: ExperimentConfig, tokenizer, maxlen: int, rows: dict, count: int | None = None,
                        what: str = "search") -> dict[str, tuple[int, list[data.Window]]]:
    """Per gated perplexity set: the index of its first calibration window and the ``count`` (default
    ``search.windows``) windows after what evaluation reads of the same text (the largest ``limit`` among sets cut
    alike from it), cut as evaluation cuts them; errors name ``what`` asks for them."""
    count = cfg.search.windows if count is None else count
    out = {}
    for pset in cfg.gated_perplexity():
        alike = [p for p in cfg.eval.perplexity if _same_data(p) == _same_data(pset)]
        if any(p.limit is None for p in alike):
            raise KVQuantError(f"{what}: perplexity set {pset.name!r} reads text that another set reads whole, so "
                               "no windows are left to calibrate on apart from evaluation")
        start = max(p.limit for p in alike)
        longer = dataclasses.replace(pset, limit=start + count)
        windows = data.windows(longer, tokenizer, maxlen, rows[pset.name])[start:]
        if not windows:
            raise KVQuantError(f"{what}: perplexity set {pset.name!r} has no windows after the {start} evaluation "
                               "reads to calibrate on; lower eval.perplexity[].limit or use a longer text")
        out[pset.name] = start, windows
    return out


@torch.inference_mode()
def observe(model, windows: list[list[int]], per_head: bool, averaging: float) -> dict[int, dict[str, list[float]]]:
    """Per layer: ``k_amax``/``v_amax`` (the averaged range's absolute maximum, one value or one per KV head) and
    ``k_peak``/``v_peak`` (the largest ``|x|`` seen), over one forward per window of token ids."""
    running: dict[tuple[int, str], list[torch.Tensor]] = {}

    def track_ranges(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        for role, x in (("k", keys), ("v", values)):
            x = x.detach().float()
            dims = (0, 2, 3) if per_head else (0, 1, 2, 3)
            low, high, peak = x.amin(dims), x.amax(dims), x.abs().amax(dims)
            if (layer, role) not in running:
                running[layer, role] = [low, high, peak]
                continue
            old_low, old_high, old_peak = running[layer, role]
            running[layer, role] = [old_low * (1 - averaging) + low * averaging,
                                    old_high * (1 - averaging) + high * averaging, torch.maximum(old_peak, peak)]

    device = model.get_input_embeddings().weight.device
    for ids in windows:
        model(torch.tensor([ids], device=device), cache=ObservingCache(model, track_ranges), use_cache=True)
    out: dict[int, dict[str, list[float]]] = {}
    for (layer, role), (low, high, peak) in sorted(running.items()):
        amax = torch.maximum(low.clamp(max=0).abs(), high.clamp(min=0))
        out.setdefault(layer, {})[f"{role}_amax"] = amax.reshape(-1).tolist()
        out[layer][f"{role}_peak"] = peak.reshape(-1).tolist()
    return out


def scales(observed: dict, divisor: float, per_head: bool) -> dict[str, dict[str, float | list[float]]]:
    """The ``layers`` option of a calibrated candidate: per layer ``k_scale``/``v_scale`` = amax / divisor (a zero
    range: float32's eps), one number per tensor or a list per KV head (one KV head: a list of one)."""
    eps = torch.finfo(torch.float32).eps

    def scale(amax: list[float]) -> float | list[float]:
        values = [a / divisor if a > 0 else eps for a in amax]
        return values if per_head else values[0]

    return {layer: {"k_scale": scale(entry["k_amax"]), "v_scale": scale(entry["v_amax"])}
            for layer, entry in _by_layer(observed)}


def saturating(observed: dict, layers: dict, divisor: float) -> list[str]:
    """Per layer and stream whose calibration values reach past the format's range at the chosen scale: beyond
    ``divisor`` times it (fp8: 448; nvfp4's global scale: 6 x 448, where a block scale saturates)."""
    out = []
    for layer, entry in _by_layer(observed):
        for role, name in (("k", "keys"), ("v", "values")):
            chosen = layers[layer][f"{role}_scale"]
            chosen = chosen if isinstance(chosen, list) else [chosen] * len(entry[f"{role}_peak"])
            worst = max(p / s for p, s in zip(entry[f"{role}_peak"], chosen))
            if worst > divisor:
                out.append(f"layer {layer} {name} reach {apart(worst, divisor)}x their scale on the calibration "
                           f"split, beyond the {divisor:.0f}x the format holds: they saturate")
    return out


def apart(value: float, limit: float) -> str:
    """``value`` (> ``limit``) with the fewest decimals, none at best, at which it does not read as ``limit`` does
    (448.3 beside 448: ``448.3``, not ``448``)."""
    digits = 0
    while f"{value:.{digits}f}" == f"{limit:.{digits}f}":
        digits += 1
    return f"{value:.{digits}f}"


def check_calibration(cfg, tokenizer, maxlen: int, rows: dict) -> None:
    """Before the model loads: every gated perplexity set holds ``calibration.windows`` windows after what
    evaluation reads (asking for more would calibrate, for as long as it takes, on whatever text is left)."""
    asked = cfg.calibration.windows
    for name, (start, windows) in calibration_windows(cfg, tokenizer, maxlen, rows, asked, "calibrate").items():
        if len(windows) < asked:
            raise KVQuantError(f"calibration.windows: {asked:,} asked, but perplexity set {name!r} holds only "
                               f"{len(windows):,} windows after the {start:,} evaluation reads; set "
                               f"calibration.windows to at most {len(windows):,} or use a longer text")


def calibration_split(cfg: ExperimentConfig, candidate: Candidate, tokenizer, maxlen: int,
                      rows: dict) -> list[data.Window]:
    """The calibration windows ``candidate`` calibrates on, every gated perplexity set's in turn; none for a
    ``calibrate`` that reads the weights alone (:attr:`kvquant.experiment.config.Candidate.reads_calibration`)."""
    if not candidate.reads_calibration:
        return []
    found = calibration_windows(cfg, tokenizer, maxlen, rows, cfg.calibration.windows, f"{candidate.label}: calibrate")
    return [w for _, ws in found.values() for w in ws]


def calibration_key(cfg: ExperimentConfig, candidate: Candidate, windows: list[data.Window], weights) -> dict:
    """What a candidate's observation is kept under in the result store: the model and its weights, its
    ``calibrate`` value, what else decides it (``averaging`` for scales, the quantizer's options for levels) and the
    calibration windows (a digest; none for a ``calibrate`` that reads the weights alone)."""
    return {"model": dataclasses.asdict(cfg.model), "weights": weights, "calibrate": candidate.calibrate,
            **CALIBRATIONS[candidate.calibrate].decided_by(cfg, candidate),
            **({"windows": data.windows_digest(windows, long=True)} if candidate.reads_calibration else {})}


def with_calibration(session, candidate: Candidate, rows: dict) -> tuple[Candidate, dict]:
    """``candidate`` with the per-layer options its ``calibrate`` observes on the calibration split (or reads from
    the weights; the observation kept in the result store like any measurement), and what the report shows of
    them."""
    cfg, calibration = session.cfg, CALIBRATIONS[candidate.calibrate]
    found = calibration_split(cfg, candidate, session.tokenizer, session.maxlen, rows)
    windows = [w.ids for w in found]
    key, processes = calibration_key(cfg, candidate, found, session.weights), session.processes
    observed = session.store.get_or_compute(candidate.label, "calibration", key, lambda: processes.broadcast(
        calibration.observe(session.model, windows, cfg, candidate) if processes.is_main_process else None))
    layers = calibration.layers(observed, candidate.quantizer)
    summary = {"granularity": candidate.calibrate, "windows": len(windows), "tokens": sum(map(len, windows)),
               **calibration.summary(observed, layers, candidate.quantizer, cfg), "layers": layers}
    return with_layers(candidate, layers), summary


def with_layers(candidate: Candidate, layers: dict) -> Candidate:
    """``candidate`` measured with these per-layer options (calibrated), under its own label (an unnamed
    candidate's label is derived from its options, which these would change)."""
    return dataclasses.replace(candidate, name=candidate.label, options={**candidate.options, "layers": layers},
                               calibrate=None)


@torch.inference_mode()
def key_means(model, windows: list[list[int]]) -> dict[int, torch.Tensor]:
    """Per layer ``[kv_heads, head_dim]`` float64: the post-RoPE keys' mean per KV head and channel over every token
    of ``windows`` (one forward each), summed in float64."""
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}

    def seen(layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:  # keys [B, H, T, D]
        sums[layer] = sums.get(layer, 0) + keys.double().sum((0, 2))
        counts[layer] = counts.get(layer, 0) + keys.shape[0] * keys.shape[2]

    device = model.get_input_embeddings().weight.device
    for ids in windows:
        model(torch.tensor([ids], device=device), cache=ObservingCache(model, seen), use_cache=True)
    return {layer: (sums[layer] / counts[layer]).cpu() for layer in sorted(sums)}


def key_biases(model, where: str) -> dict[int, torch.Tensor]:
    """Per decoder layer ``[kv_heads, head_dim]`` float32: its ``k_proj`` bias (``[kv_heads * head_dim]`` in the
    module), read from ``model``'s modules, a loaded model's or a skeleton's on the meta device
    (:func:`kvquant.scoring.models.skeleton`: checked, nothing read). A layer without one, or whose keys' shape is
    not known (:func:`kvquant.cache.build.written_shapes`: a fused projection), is refused in one line naming
    ``where`` and the model type."""
    shapes = written_shapes(model)
    found = {}
    for module in model.modules():
        layer, bias = getattr(module, "layer_idx", None), getattr(getattr(module, "k_proj", None), "bias", None)
        if layer in shapes and shapes[layer][0] and isinstance(bias, torch.Tensor):
            found[layer] = bias.detach().float().reshape(shapes[layer][0])
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    missing = [layer for layer in range(layers) if layer not in found]
    if missing:
        raise KVQuantError(f"{where}: key_bias reads each layer's k_proj bias, and this {model.config.model_type!r} "
                           f"model has none in layer {missing[0]} ({len(missing)} of {layers} layers without one); "
                           "use calibrate: key_offset (the keys' mean after RoPE) instead")
    return dict(sorted(found.items()))


def _by_layer(observed: dict) -> list[tuple[str, dict | list]]:
    """An observation's layers in order, named as ``layers`` names them (the store hands them back as strings)."""
    return [(str(layer), entry) for layer, entry in sorted(observed.items(), key=lambda item: int(item[0]))]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """One ``calibrate:`` value: ``options``, the quantizer options it sets per layer (a quantizer it applies to has
    them all); ``what`` they are, for messages; ``before_rope``: the keys it describes are those before RoPE (what a
    ``pre_rope`` cache quantizes), else those after it (as an engine's cache receives them)."""

    options: tuple[str, ...]
    what: str
    before_rope: bool = False

    def decided_by(self, cfg: ExperimentConfig, candidate: Candidate) -> dict:
        """What, besides the model and the windows, decides the observation (a key of the stored one)."""
        return {}

    def observe(self, model, windows: list[list[int]], cfg: ExperimentConfig,
                candidate: Candidate) -> dict:  # pragma: no cover - interface
        """Per layer, what is observed over one forward per window (JSON: the result store keeps it)."""
        raise NotImplementedError

    def refusal(self, candidate: Candidate) -> str | None:
        """Why ``candidate``'s other options rule this calibration out (preflight says it in one line), or None."""
        return None

    def check_model(self, model_config, where: str) -> None:
        """Refuse, before the model loads (``model_config``: its transformers config), a model this calibration
        cannot read (one line naming ``where``)."""

    def layers(self, observed: dict, quantizer: str) -> dict[str, dict]:  # pragma: no cover - interface
        """The ``layers`` option that sets :attr:`options` per layer from ``observed``."""
        raise NotImplementedError

    def summary(self, observed: dict, layers: dict, quantizer: str, cfg: ExperimentConfig) -> dict:
        """What the report shows besides the layers and the window count."""
        return {}

    def placeholder(self, shape) -> dict:  # pragma: no cover - interface
        """Options of the right shape for preflight to check the quantizer with before anything is observed."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class StaticScales(Calibration):
    """``tensor`` / ``head``: fp8 and nvfp4 scales, one per layer and tensor or per KV head (module docstring)."""

    per_head: bool = False

    def decided_by(self, cfg, candidate):
        return {"averaging": cfg.calibration.averaging}

    def observe(self, model, windows, cfg, candidate):
        return observe(model, windows, self.per_head, cfg.calibration.averaging)

    def layers(self, observed, quantizer):
        return scales(observed, QUANTIZERS.get(quantizer).calibration_divisor, self.per_head)

    def summary(self, observed, layers, quantizer, cfg):
        divisor = QUANTIZERS.get(quantizer).calibration_divisor
        return {"divisor": divisor, "averaging": cfg.calibration.averaging,
                "saturating": saturating(observed, layers, divisor)}

    def placeholder(self, shape):
        one = [1.0] * shape.kv_heads if self.per_head else 1.0
        return {"k_scale": one, "v_scale": one}


@dataclasses.dataclass(frozen=True)
class KeyOffsets(Calibration):
    """``key_offset``: per layer ``[kv_heads, head_dim]``, the post-RoPE keys' mean over the calibration tokens."""

    def observe(self, model, windows, cfg, candidate):
        return {layer: mean.tolist() for layer, mean in key_means(model, windows).items()}

    def layers(self, observed, quantizer):
        return {layer: {"key_offset": mean} for layer, mean in _by_layer(observed)}

    def placeholder(self, shape):
        return {"key_offset": [[0.0] * shape.head_dim] * shape.kv_heads}


@dataclasses.dataclass(frozen=True)
class KeyBias(KeyOffsets):
    """``key_bias``: per layer ``[kv_heads, head_dim]``, the layer's k_proj bias, read from the weights (no windows, no
    forward). Before RoPE every key is ``W x + b``: ``b`` is a constant there, which a ``pre_rope`` cache removes
    exactly (after RoPE it is ``R_p b``, a different vector at each position)."""

    def check_model(self, model_config, where):
        key_biases(skeleton(model_config, where), where)

    def observe(self, model, windows, cfg, candidate):
        biases = key_biases(model, f"{candidate.label}: calibrate")
        return {layer: bias.cpu().tolist() for layer, bias in biases.items()}

    def refusal(self, candidate):
        if candidate.options.get("pre_rope") is True:
            return None
        return ("calibrate: key_bias removes each layer's k_proj bias, a constant on the keys only before RoPE (after "
                "it, RoPE turns the bias by each token's position); set options.pre_rope: true")


@dataclasses.dataclass(frozen=True)
class Levels(Calibration):
    """``kmeans`` / ``fisher_kmeans``: per layer, a codebook's key and value levels fitted on the calibration states,
    weighted by their Fisher information where ``fisher`` (:mod:`kvquant.scoring.level_fit`)."""

    fisher: bool = False

    def decided_by(self, cfg, candidate):
        return {"quantizer": candidate.spec.quantizer.describe()}

    def observe(self, model, windows, cfg, candidate):
        return fitted_levels(model, windows, candidate.spec.quantizer, self.fisher)

    def layers(self, observed, quantizer):
        return {layer: {"key_levels": entry["key_levels"], "value_levels": entry["value_levels"]}
                for layer, entry in _by_layer(observed)}

    def placeholder(self, shape):
        return {}  # the quantizer's own levels until fitted

    def refusal(self, candidate):
        given = [k for k in ("outliers", "key_offset") if candidate.spec.quantizer.describe().get(k)]
        if not given:
            return None
        return (f"calibrate: {candidate.calibrate} fits levels to the states a codebook codes, and options.{given[0]} "
                "changes them (not supported yet); drop it")


#: Each ``calibrate:`` value (:data:`kvquant.experiment.config.CALIBRATE` names them for the config's check).
CALIBRATIONS: dict[str, Calibration] = {
    "tensor": StaticScales(("k_scale", "v_scale"), "static scales", per_head=False),
    "head": StaticScales(("k_scale", "v_scale"), "static scales", per_head=True),
    "key_offset": KeyOffsets(("key_offset",), "key offset"),
    "key_bias": KeyBias(("key_offset",), "key offset", before_rope=True),
    "kmeans": Levels(("key_levels", "value_levels"), "fitted levels", fisher=False),
    "fisher_kmeans": Levels(("key_levels", "value_levels"), "fitted levels", fisher=True),
}
