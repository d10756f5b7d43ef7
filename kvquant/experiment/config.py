"""Experiment configs: YAML validated into frozen dataclasses; the one place that knows which values are valid.

Unknown keys, wrong types (no bool where an int is wanted, no float for an int, no NaN or infinity), values
out of range and names the gate refers to that do not exist are errors naming the key, the value and the
valid choices (and the file). ``--set a.b=value`` overrides a key before validation (``value`` is parsed as
YAML, list items are addressed by index: ``candidates.0.quantizer``). What needs the filesystem, the model or
lm-eval (data files, quantizer options on the model's shapes, task names) is checked by ``kvquant.run``'s
preflight, still before any model loads.

The schema is here (the ``gate:`` section in :mod:`kvquant.experiment.gate_config`, ``model:`` in
:mod:`kvquant.experiment.model_config`, ``eval.long_context`` in :mod:`kvquant.experiment.long_config`); binding a
mapping to it and ``--set`` are :mod:`kvquant.experiment.binding`'s, and the file is read by :mod:`kvquant.yaml_reader`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvquant.errors import ConfigError, is_python_int
from kvquant.experiment.metric import METRICS
from kvquant.paths import MAX_NAME_BYTES, folder_problem
from kvquant.experiment.binding import apply_override, check_at_least, build, require
from kvquant.experiment.gate_config import GateConfig
from kvquant.experiment.long_config import LongContextConfig, check_long_context
from kvquant.experiment.model_config import ModelConfig
from kvquant.yaml_reader import load_yaml, read_text_file

if typing.TYPE_CHECKING:
    from kvquant.cache.spec import CacheSpec

#: Names that become file or directory names (report name, candidate and perplexity set names).
PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]*")
MAX_SEED = 2**32 - 1
MAX_FEWSHOT = 100
MAX_CALIBRATION = 100_000
#: Result labels the search uses for its own measurements.
SEARCH_PREFIX = "search-"
#: What a candidate calibrates (``kvquant.scoring.calibrate.CALIBRATIONS``), each with what it reads: static scales,
#: one per layer and tensor or per layer and KV head; a key offset per layer and KV head (the keys' mean); codebook
#: levels per layer, fitted by a k-means unweighted or weighted by the states' Fisher information: these read the
#: calibration split's ``windows``; a key offset per layer from the model's ``weights`` alone (``key_bias``: each
#: layer's k_proj bias, no forward).
CALIBRATE = {"tensor": "windows", "head": "windows", "key_offset": "windows", "kmeans": "windows",
             "fisher_kmeans": "windows", "key_bias": "weights"}


def check_plain_name(key: str, value: str) -> None:
    """A name used as a file or directory name: letters, digits, ``_ . + = -``; no path separators, no ``..``;
    at most :data:`kvquant.paths.MAX_NAME_BYTES` characters."""
    check_name_length(key, value)
    require(bool(PLAIN_NAME.fullmatch(value)) and ".." not in value,
            f"{key} {value!r} must be a plain name (letters, digits, _ . + = -; no '/' or '..'), since it names "
            "a directory")


def check_name_length(key: str, value: str) -> None:
    """A name kvquant puts into file names fits one (:data:`kvquant.paths.MAX_NAME_BYTES`)."""
    size = len(value.encode("utf-8", "surrogatepass"))
    require(size <= MAX_NAME_BYTES, f"{key} {value[:24]!r}... is {size} bytes long; it becomes part of a file or "
            f"folder name, so at most {MAX_NAME_BYTES}")


@dataclass(frozen=True)
class Candidate:
    #: A registered quantizer (``kvquant.available_quantizers()``).
    quantizer: str
    #: Options of ``make_cache``: the quantizer's own (group_size, key_bits, ...) plus residual_length, sink_tokens.
    options: dict[str, Any] = field(default_factory=dict)
    #: Label in reports (default: derived from quantizer and options).
    name: str | None = None
    #: Per-layer options observed on the calibration split (``calibration:``): static scales (a quantizer's
    #: ``k_scale``/``v_scale``), one per tensor (``tensor``) or per KV head (``head``), as llm-compressor observes
    #: them; a quantizer's ``key_offset`` (``key_offset``: the keys' mean per KV head and channel; ``key_bias``: each
    #: layer's k_proj bias, read from the weights, for keys before RoPE); or its ``key_levels``/``value_levels``
    #: (``kmeans``, ``fisher_kmeans``: per layer, a k-means of the normalized states).
    calibrate: str | None = field(default=None, kw_only=True)

    def __post_init__(self):
        require(bool(self.quantizer), "quantizer must name a quantizer, got ''")
        check_plain_name("name" if self.name else "label (derived from quantizer and options; set name)", self.label)
        require(self.calibrate in (None, *CALIBRATE), f"calibrate must be one of {list(CALIBRATE)} or null, got "
                f"{self.calibrate!r}")

    @property
    def reads_calibration(self) -> bool:
        """It calibrates on the calibration split's windows (a ``calibrate`` that reads the weights alone does not)."""
        return CALIBRATE.get(self.calibrate) == "windows"

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return "-".join([self.quantizer, *(f"{k}{v}" for k, v in sorted(self.options.items()))])

    @functools.cached_property
    def spec(self) -> CacheSpec:
        """The cache setting, typed and validated (:class:`kvquant.cache.CacheSpec`): what every part of a run
        builds, sizes and names this candidate's cache by. Refused in one line on first use (preflight checks every
        candidate's on the model's shapes before the model loads)."""
        from kvquant.cache.spec import CacheSpec

        return CacheSpec.of(self.quantizer, self.options)


@dataclass(frozen=True)
class Stage(Candidate):
    """One stage of a staged memory loop: a cache setting (quantizer, options with any eviction policy) plus
    whether requests that share a prefix store it once."""

    prefix_sharing: bool = False
    #: Stage 4 of the loop (KV offloaded to host memory): not supported yet (refused with the reason).
    offload: bool = False


@dataclass(frozen=True)
class ServingConfig:
    """The serving shape a staged run measures memory and decode latency on: ``requests`` requests sharing a
    ``prefix``-token prompt prefix, each with ``suffix`` tokens of its own, then ``decode_steps`` decoding steps."""

    requests: int = 8
    prefix: int = 1024
    suffix: int = 256
    decode_steps: int = 32
    #: The memory for KV caches the largest batch must fit, e.g. 1GiB (as the planner's sizes).
    memory_budget: str = "1GiB"
    #: The perplexity set whose text the requests are cut from (default: the first).
    text: str | None = None

    def __post_init__(self):
        for key in ("requests", "prefix", "suffix", "decode_steps"):
            require(1 <= getattr(self, key) <= 1_000_000, f"{key} must be in 1..1000000, got {getattr(self, key)!r}")


@dataclass(frozen=True)
class PerplexitySet:
    name: str
    #: ``local:REL`` or a path to a .txt/.raw (one text), .jsonl/.json or .parquet file (rows with ``text_field``).
    source: str | None = None
    #: A ``datasets`` id used when ``source`` cannot be resolved (or when there is no ``source``).
    hub: str | None = None
    hub_config: str | None = None
    split: str = "test"
    text_field: str = "text"
    #: ``documents``: each row its own sequence ([BOS] + row, cut at max_length);
    #: ``stream``: rows joined by ``separator`` into one token stream, cut into windows.
    layout: Literal["documents", "stream"] = "documents"
    separator: str = "\n\n"
    #: Documents to use (documents layout) or windows to score (stream layout); null = all.
    limit: int | None = None
    max_length: int = 512
    #: Stream layout: tokens between window starts (= max_length: non-overlapping windows).
    stride: int | None = None

    def __post_init__(self):
        check_plain_name("name", self.name)
        require(bool(self.source or self.hub), "source or hub: a perplexity set needs a file or a datasets id")
        check_at_least("limit", self.limit, 1, nullable=True)
        check_at_least("max_length", self.max_length, 2)
        require(self.stride is None or 1 <= self.stride <= self.max_length,
                f"stride must be in 1..max_length ({self.max_length}) or null, got {self.stride!r}")
        require(bool(self.text_field), "text_field must name a field, got ''")


@dataclass(frozen=True)
class TaskSet:
    #: lm-eval task names; where the data directory holds a task (see ``kvquant.scoring.tasks``) the offline copy is
    #: used.
    names: list[str] = field(default_factory=list)
    #: Documents per task (null = all).
    limit: int | None = None
    #: Per-task exceptions to ``limit`` (null = all documents of that task).
    limits: dict[str, Any] = field(default_factory=dict)
    #: Few-shot examples before each document: one count for every task, or per task (``{arc_easy: 25}``; the
    #: others 0), as lm-eval's ``num_fewshot``.
    num_fewshot: Any = 0
    #: How the examples are drawn: ``default`` (lm-eval's seeded draw per document) or ``first_n`` (the first
    #: examples in front of every document: one shared prefix, prefilled once in streaming mode).
    fewshot_sampler: Literal["default", "first_n"] = "default"

    def __post_init__(self):
        require(all(self.names), "names must be task names, got an empty name")
        for name in self.names:  # partial results are named after the task
            check_name_length("names: task", name)
        if isinstance(self.num_fewshot, dict):
            for task, shots in self.num_fewshot.items():
                require(task in self.names, f"num_fewshot: {task!r} is not among names "
                        f"({', '.join(self.names) or 'none'})")
                require(is_python_int(shots) and 0 <= shots <= MAX_FEWSHOT,
                        f"num_fewshot.{task} must be an integer in 0..{MAX_FEWSHOT}, got {shots!r}")
        else:
            require(is_python_int(self.num_fewshot) and 0 <= self.num_fewshot <= MAX_FEWSHOT,
                    f"num_fewshot must be an integer in 0..{MAX_FEWSHOT} or a mapping of task names to such integers, "
                    f"got {self.num_fewshot!r}")
        require(len(set(self.names)) == len(self.names), f"names must be unique, got {self.names}")
        require(self.fewshot_sampler == "default" or any(map(self.fewshot_for, self.names)),
                f"fewshot_sampler: {self.fewshot_sampler!r} draws few-shot examples, and num_fewshot gives no task any")
        check_at_least("limit", self.limit, 1, nullable=True)
        for task, limit in self.limits.items():
            require(task in self.names, f"limits: {task!r} is not among names ({', '.join(self.names) or 'none'})")
            require(limit is None or (is_python_int(limit) and limit >= 1),
                    f"limits.{task} must be an integer >= 1 or null, got {limit!r}")

    def limit_for(self, task: str) -> int | None:
        return self.limits[task] if task in self.limits else self.limit

    def fewshot_for(self, task: str) -> int:
        shots = self.num_fewshot
        return shots.get(task, 0) if isinstance(shots, dict) else shots


@dataclass(frozen=True)
class EvalConfig:
    #: ``simulated``: one forward pass per sequence, K/V quantized on write; ``streaming``: fed through the
    #: cache ``chunk_size`` tokens at a time (1 = token-by-token decoding).
    mode: Literal["simulated", "streaming"] = "simulated"
    chunk_size: int = 64
    #: Rows (sequences or task requests) per forward pass; rows never share quantization groups.
    batch_size: int = 1
    seed: int = 1234
    perplexity: list[PerplexitySet] = field(default_factory=list)
    tasks: TaskSet = field(default_factory=TaskSet)
    #: Tokens of perplexity text (windows joined, capped at the model's length) put through each cache to
    #: read ``memory_report()``.
    memory_probe_tokens: int = 512
    #: Divergence by position on long documents (null: none), :mod:`kvquant.experiment.long_config`.
    long_context: LongContextConfig | None = None

    def __post_init__(self):
        check_at_least("chunk_size", self.chunk_size, 1)
        check_at_least("batch_size", self.batch_size, 1)
        check_at_least("memory_probe_tokens", self.memory_probe_tokens, 2)
        require(0 <= self.seed <= MAX_SEED, f"seed must be in 0..{MAX_SEED}, got {self.seed!r}")
        names = [p.name for p in self.perplexity]
        require(len(set(names)) == len(names), f"perplexity: set names must be unique, got {names}")


@dataclass(frozen=True)
class SearchConfig:
    """A per-layer bit allocation searched under the gate (:mod:`kvquant.runner.search`); the map found is evaluated as
    one more candidate, named ``name``, on the evaluation split."""

    #: Per-layer settings, cheapest first (strictly more bits per element each); every layer gets one of them.
    ladder: list[Candidate]
    name: str = "searched"
    #: The calibration split, held apart from evaluation: per gated perplexity set, this many windows after its
    #: ``limit``; per gated task, this many documents after its limit. ``documents: 0`` gates the calibration on
    #: the perplexity sets alone (tasks decide on the evaluation split only): at a few dozen documents one
    #: document moves a task's relative score by several percent, more than the bits being searched change it.
    windows: int = 8
    documents: int = 50
    #: The perplexity ratio a map must meet on the calibration split (default: ``gate.max_perplexity_ratio``); a
    #: tighter one leaves a margin for what the evaluation split's tasks lose.
    max_perplexity_ratio: float | None = None
    #: A budget in bits per element instead of a calibration target: the map is the last of the greedy order
    #: within it (the least loss predicted at that size); it is still measured on the calibration split
    #: (reported), and the gate decides on the evaluation split as for any candidate.
    max_bits: float | None = None

    def __post_init__(self):
        check_plain_name("name", self.name)
        require(len(self.ladder) >= 2, f"ladder needs at least two settings to choose between, got {len(self.ladder)}")
        labels = [rung.label for rung in self.ladder]
        require(len(set(labels)) == len(labels), f"ladder: names must be unique, got {labels}")
        for i, rung in enumerate(self.ladder):
            require("layers" not in rung.options, f"ladder[{i}].options: 'layers' is what the search decides")
        pre_rope = [rung.options.get("pre_rope") is True for rung in self.ladder]
        require(all(pre_rope) or not any(pre_rope),
                "ladder: pre_rope is for the whole cache (no per-layer setting holds it): set it alike on every rung")
        require(1 <= self.windows <= MAX_CALIBRATION, f"windows must be in 1..{MAX_CALIBRATION}, got {self.windows!r}")
        require(0 <= self.documents <= MAX_CALIBRATION,
                f"documents must be in 0..{MAX_CALIBRATION}, got {self.documents!r}")
        require(self.max_perplexity_ratio is None or (math.isfinite(self.max_perplexity_ratio)
                                                        and self.max_perplexity_ratio >= 1.0),
                 f"max_perplexity_ratio must be a finite number of at least 1.0, got {self.max_perplexity_ratio!r}")
        require(self.max_bits is None or (math.isfinite(self.max_bits) and self.max_bits > 0),
                f"max_bits must be a finite number above 0, got {self.max_bits!r}")
        require(self.max_bits is None or self.max_perplexity_ratio is None,
                "max_bits and max_perplexity_ratio choose the map two ways; set one")


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration split static scales are observed on: per gated perplexity set, ``windows`` windows after
    its evaluation ``limit`` (held apart from evaluation), each one forward; the running minimum and maximum of the
    keys and values move by ``averaging`` per forward (llm-compressor's minmax observer)."""

    windows: int = 8
    averaging: float = 0.01

    def __post_init__(self):
        check_at_least("windows", self.windows, 1)
        require(self.windows <= MAX_CALIBRATION, f"windows must be in 1..{MAX_CALIBRATION}, got {self.windows!r}")
        require(0 < self.averaging <= 1, f"averaging must be in (0, 1], got {self.averaging!r}")


@dataclass(frozen=True)
class ExperimentConfig:
    name: str
    candidates: list[Candidate] = field(default_factory=list)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    #: Search a per-layer map under the gate before evaluating (null: evaluate the candidates only).
    search: SearchConfig | None = None
    #: A staged memory loop instead of candidates: levers stacked in order, each stage gated (see
    #: kvquant.scoring.stages).
    stages: list[Stage] = field(default_factory=list)
    serving: ServingConfig | None = None
    #: The calibration split of candidates with ``calibrate`` (null: none calibrates).
    calibration: CalibrationConfig | None = None
    #: Reports go to ``<output_dir>/<name>/``.
    output_dir: str = "reports"

    def __post_init__(self):
        check_plain_name("name", self.name)
        require(bool(self.output_dir), "output_dir must name a directory, got ''")
        problem = folder_problem(self.output_dir)
        require(problem is None, f"output_dir: {problem}")
        self.gate.check_is_a_gate()
        if self.stages:
            require(not self.candidates and not self.search, "stages: a staged run measures its stages only; remove "
                    "candidates and search")
            object.__setattr__(self, "serving", self.serving or ServingConfig())
            if self.serving.text is not None:
                require(self.serving.text in [p.name for p in self.eval.perplexity], f"serving.text: "
                        f"{self.serving.text!r} is not among eval.perplexity")
            else:
                require(bool(self.eval.perplexity), "serving: the requests are cut from a perplexity set's text; "
                        "list one under eval.perplexity")
        else:
            require(self.serving is None, "serving: only a staged run (stages:) measures serving")
        require(bool(self.candidates or self.search or self.stages),
                "candidates: at least one cache setting (or a search) is needed")
        labels = [c.label for c in [*self.candidates, *self.stages]] + ([self.search.name] if self.search else [])
        if len(set(labels)) != len(labels) or "baseline" in labels:
            raise ConfigError(f"candidates: names must be unique and not 'baseline', got {labels}"
                              + (" (search.name included)" if self.search else ""))
        reserved = [label for label in labels if label.startswith(SEARCH_PREFIX)]
        if reserved:
            raise ConfigError(f"candidates: names starting with {SEARCH_PREFIX!r} are the search's own, got "
                              f"{reserved[0]!r}")
        require(bool(self.eval.perplexity or self.eval.tasks.names),
                "eval: nothing to measure; list perplexity sets and/or tasks")
        gated = [*self._gated_names("tasks", self.eval.tasks.names), *self._gated_names("perplexity",
                                                                              [p.name for p in self.eval.perplexity])]
        require(bool(gated) or self.gate.min_context is not None, "gate: nothing is gated (gate.tasks and "
                "gate.perplexity select no task and no perplexity set), so every candidate would pass; gate at least "
                "one")
        for key in (m.threshold_key for m in METRICS if m.reference is not None):
            require(getattr(self.gate, key) is None or bool(self.gated_perplexity()) or bool(self.eval.long_context),
                    f"gate.{key}: divergence from the baseline is measured on perplexity sets (or long documents), "
                    "and none is gated; add one to eval.perplexity (and gate.perplexity) or eval.long_context")
        check_long_context(self)
        self.gate.check_gated_tasks(self.gated_tasks())
        if self.gate.max_documents is not None:
            for task in self.gated_tasks():
                limit = self.eval.tasks.limit_for(task)
                require(limit is not None and limit <= self.gate.max_documents,
                        f"gate.max_documents {self.gate.max_documents} is where sequential documents stop, and "
                        f"task {task!r} starts at {limit if limit is not None else 'all its documents'}; set "
                        "eval.tasks.limit (where each task starts) at or below it")
        if self.search:
            self._check_split()
            check_name_length("name and search.name (searched.yaml reruns the map as <name>-<search.name>)",
                              f"{self.name}-{self.search.name}")
        self._check_calibration()

    def _check_calibration(self) -> None:
        """Candidates that calibrate on windows have a calibration split: windows after each gated perplexity set's
        limit (one whose ``calibrate`` reads the weights alone needs none)."""
        calibrating = [f"{where}[{i}] ({c.label})" for where, listed in (("candidates", self.candidates),
                                                                          ("stages", self.stages))
                       for i, c in enumerate(listed) if c.reads_calibration]
        if not calibrating:
            return
        require(self.calibration is not None, f"{calibrating[0]}: calibrate needs a calibration split held apart "
                "from evaluation; add calibration: {windows: 8} (windows after each gated perplexity set's limit)")
        sets = self.gated_perplexity()
        require(bool(sets), f"{calibrating[0]}: calibration windows come from the gated perplexity sets, and none "
                "is gated; add one to eval.perplexity (and gate.perplexity)")
        for pset in sets:
            require(pset.limit is not None, f"calibration: perplexity set {pset.name!r} has no limit, so no windows "
                    "are left to calibrate on apart from evaluation; set eval.perplexity[].limit")

    def _check_split(self) -> None:
        """A search calibrates on data held apart from evaluation: after each gated set's and task's limit."""
        sets = self.gated_perplexity()
        require(bool(sets), "search: its layer sensitivities are perplexity increases; gate at least one "
                "perplexity set (gate.perplexity)")
        for pset in sets:
            require(pset.limit is not None, f"search: perplexity set {pset.name!r} has no limit, so no windows are "
                    "left to calibrate on apart from evaluation; set eval.perplexity[].limit")
        if not self.search.documents:  # calibration reads no task document
            return
        require(self.gate.max_documents is None,
                f"search.documents {self.search.documents} calibrates on the documents after each gated task's "
                f"limit, which gate.max_documents {self.gate.max_documents}'s sequential looks would evaluate; "
                "drop one of them (search.documents=0 calibrates on perplexity windows alone)")
        for task in self.gated_tasks():
            require(self.eval.tasks.limit_for(task) is not None, f"search: task {task!r} has no limit, so no "
                    "documents are left to calibrate on apart from evaluation; set eval.tasks.limit")
        require(not any(map(self.eval.tasks.fewshot_for, self.eval.tasks.names)),
                "search: num_fewshot must be 0, since few-shot examples may be drawn from the documents evaluation "
                "reads, and calibration would see them")

    def gated_perplexity(self) -> list[PerplexitySet]:
        names = self._gated_names("perplexity", [p.name for p in self.eval.perplexity])
        return [p for p in self.eval.perplexity if p.name in names]

    def gated_tasks(self) -> list[str]:
        return self._gated_names("tasks", self.eval.tasks.names)

    def _gated_names(self, kind: str, measured: list[str]) -> list[str]:
        """The gated names of one kind; a gated name that is not measured is an error naming the measured ones."""
        listed = getattr(self.gate, kind)
        if listed is None:
            return measured
        where = "eval.tasks.names" if kind == "tasks" else "eval.perplexity"
        for name in listed:
            require(name in measured, f"gate.{kind}: {name!r} is not measured, so it would never be gated; "
                    f"{where} has: {', '.join(measured) or 'nothing'}")
        return list(listed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def load_config(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Read, override and validate an experiment config; errors name the file and the key."""
    path = Path(path)
    data = load_yaml(read_text_file(path, "config file"), str(path))
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, got {type(data).__name__}")
    data.setdefault("name", path.stem)
    try:
        for assignment in overrides:
            apply_override(data, assignment)
        return build(ExperimentConfig, data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
