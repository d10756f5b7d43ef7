"""Experiment configs: YAML validated into frozen dataclasses.

Unknown keys and wrong types are errors naming the key and the file; ``--set a.b=value`` overrides a key
before validation (``value`` is parsed as YAML, list items are addressed by index: ``candidates.0.quantizer``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import KVQuantError


class ConfigError(KVQuantError):
    """A config file or override that does not validate."""


@dataclass(frozen=True)
class ModelConfig:
    #: ``local:REL`` (under the data directory), a local directory, or a Hugging Face hub id.
    path: str = "local:models/stories260K/hf"
    #: Used when ``path`` is ``local:...`` and no data directory holds it (e.g. a hub id).
    fallback: str | None = None
    #: A GGUF file inside ``path`` (transformers converts it on load).
    gguf_file: str | None = None
    #: Tokenizer reference when it differs from ``path`` (a GGUF's tokenizer may not load).
    tokenizer: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    #: ``auto``: the GPU when there is one, else the CPU.
    device: str = "auto"
    #: accelerate's device map (e.g. ``auto``) for a model larger than one GPU; overrides ``device``.
    device_map: str | None = None
    #: Longest sequence fed to the model (defaults to the model's ``max_position_embeddings``).
    max_length: int | None = None


@dataclass(frozen=True)
class Candidate:
    #: A registered quantizer (``kvquant.available_quantizers()``).
    quantizer: str
    #: Options of ``make_cache``: the quantizer's own (group_size, key_bits, ...) plus residual_length, sink_tokens.
    options: dict[str, Any] = field(default_factory=dict)
    #: Label in reports (default: derived from quantizer and options).
    name: str | None = None

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return "-".join([self.quantizer, *(f"{k}{v}" for k, v in sorted(self.options.items()))])


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


@dataclass(frozen=True)
class TaskSet:
    #: lm-eval task names; where the data directory holds a task (see ``kvquant.tasks``) the offline copy is used.
    names: list[str] = field(default_factory=list)
    #: Documents per task (null = all).
    limit: int | None = None
    #: Per-task exceptions to ``limit`` (null = all documents of that task).
    limits: dict[str, Any] = field(default_factory=dict)
    num_fewshot: int = 0

    def limit_for(self, task: str) -> int | None:
        return self.limits[task] if task in self.limits else self.limit


@dataclass(frozen=True)
class EvalConfig:
    #: ``simulated``: one forward pass per sequence, K/V quantized on write; ``streaming``: fed through the
    #: cache ``chunk_size`` tokens at a time (1 = token-by-token decoding).
    mode: Literal["simulated", "streaming"] = "simulated"
    chunk_size: int = 64
    seed: int = 1234
    perplexity: list[PerplexitySet] = field(default_factory=list)
    tasks: TaskSet = field(default_factory=TaskSet)
    #: Tokens of perplexity text (windows joined, capped at the model's length) put through each cache to
    #: read ``memory_report()``.
    memory_probe_tokens: int = 512


@dataclass(frozen=True)
class GateConfig:
    #: Minimum candidate/baseline accuracy on every gated task.
    min_relative_accuracy: float = 0.97
    #: Maximum candidate/baseline perplexity on every gated perplexity set.
    max_perplexity_ratio: float = 1.05
    #: ``point``: decide on the measured ratio; ``lower_bound``: on the lower end of its bootstrap interval.
    decide_on: Literal["point", "lower_bound"] = "point"
    confidence: float = 0.95
    bootstrap: int = 1000
    #: Gated tasks and perplexity sets (null = all of them); the others are reported only.
    tasks: list[str] | None = None
    perplexity: list[str] | None = None


@dataclass(frozen=True)
class ExperimentConfig:
    name: str
    candidates: list[Candidate]
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    #: Reports go to ``<output_dir>/<name>/``.
    output_dir: str = "reports"

    def __post_init__(self):
        if not self.candidates:
            raise ConfigError("candidates: at least one cache setting is needed")
        labels = [c.label for c in self.candidates]
        if len(set(labels)) != len(labels) or "baseline" in labels:
            raise ConfigError(f"candidates: names must be unique and not 'baseline', got {labels}")
        if self.eval.chunk_size < 1 or self.eval.memory_probe_tokens < 2:
            raise ConfigError("eval.chunk_size must be >= 1 and eval.memory_probe_tokens >= 2")
        if not self.eval.perplexity and not self.eval.tasks.names:
            raise ConfigError("eval: nothing to measure; list perplexity sets and/or tasks")
        if not 0 < self.gate.confidence < 1 or self.gate.bootstrap < 1:
            raise ConfigError("gate.confidence must be in (0, 1) and gate.bootstrap >= 1")
        if not 0 < self.gate.min_relative_accuracy <= 1 or self.gate.max_perplexity_ratio < 1:
            raise ConfigError("gate.min_relative_accuracy must be in (0, 1] and gate.max_perplexity_ratio >= 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; build nested dataclasses."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {type(value).__name__} {value!r}")
        return [_convert(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{where} must be {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown key {prefix}{unknown[0]} (valid keys: {', '.join(fields)})")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing key {where + '.' if where else ''}{missing[0]}")
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def apply_override(data: dict, assignment: str) -> None:
    """Apply ``a.b.c=value`` to the raw config mapping (value parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"--set {key}: {'.'.join(parts[:i]) or 'list'} has no item {part}")
            node = node[int(part)]
        else:
            node = node.setdefault(part, {})
    last = parts[-1]
    value = yaml.safe_load(raw)
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(f"--set {key}: no list item {last}")
        node[int(last)] = value
    else:
        node[last] = value


def load_config(path: str | Path, overrides: list[str] = ()) -> ExperimentConfig:
    """Read, override and validate an experiment config; errors name the file and the key."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping")
    data.setdefault("name", path.stem)
    try:
        for assignment in overrides:
            apply_override(data, assignment)
        return _build(ExperimentConfig, data, "")
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
