"""Loading a model and tokenizer from a :class:`ModelConfig` (local directory, hub id or GGUF file).

:func:`check_model` answers, without loading weights, whether a config's model can be loaded (the path, GGUF
file and tokenizer exist, the device is present) and returns its transformers config. A GGUF file is converted
once into ``$KVQUANT_CACHE_DIR/models/<sha256 of the file, 16 hex>/`` (default ``~/.cache/kvquant``): the
GGUF-loaded weights are copied into a fresh model of the same config and saved with ``save_pretrained``, so
later loads read that directory in seconds instead of dequantizing the GGUF again.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from kvquant.experiment.model_config import ModelConfig, mapped_devices
from kvquant.errors import KVQuantError, one_line
from kvquant.fs import cache_dir
from kvquant.packaged import PACKAGE_PREFIX, PackageMissing, file_sha256
from kvquant.paths import resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``org/name`` or ``name`` as the Hugging Face hub spells repository ids.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
#: what transformers' refusal of a model's own Python code (``auto_map``) says, with ``trust_remote_code=False``
REMOTE_CODE = "trust_remote_code"


def refuse_remote_code(err: Exception, what: str) -> None:
    """Raise one :class:`KVQuantError` line where transformers refused to run ``what``'s own Python code (its
    config names classes of its own in ``auto_map``). kvquant passes ``trust_remote_code=False`` to every
    ``from_pretrained``, so a model folder's code never runs, and transformers never asks on the terminal."""
    if REMOTE_CODE in str(err):
        raise KVQuantError(f"{what} needs Python code of its own to load (auto_map in its config); kvquant never "
                           "runs a model folder's code: use a model whose architecture transformers includes") from None


def resolve_model_path(spec: ModelConfig) -> str:
    """``spec.path`` resolved (:func:`kvquant.paths.resolve`), or ``spec.fallback`` where the path is not here:
    no data directory holds a ``local:`` path, or a ``package:`` model's package is not installed (a packaged file
    that is damaged, or a name kvquant does not know, is refused even with a fallback)."""
    try:
        return resolve(spec.path)
    except KVQuantError as err:
        if spec.fallback and (not spec.path.startswith(PACKAGE_PREFIX) or isinstance(err, PackageMissing)):
            return spec.fallback
        raise


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_device_present(device: str, key: str = "model.device") -> None:
    """``device`` (already a valid name) exists on this machine."""
    parsed = torch.device(pick_device(device))
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise KVQuantError(f"{key} is {device!r}, but torch sees no GPU on this machine; use auto or cpu")
        if parsed.index is not None and parsed.index >= count:
            raise KVQuantError(f"{key} is {device!r}, but this machine has {count} GPU(s): cuda:0..cuda:{count - 1}")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise KVQuantError(f"{key} is {device!r}, but MPS is not available here; use auto or cpu")


def _check_reference(ref: str, key: str) -> str:
    """A model or tokenizer reference that is an existing path or looks like a hub id; returns the resolved one."""
    path = resolve(ref)
    if not Path(path).expanduser().exists() and (not HUB_ID.fullmatch(path) or ".." in path):
        raise KVQuantError(f"{key}: {path!r} does not exist (and is not a hub id such as org/name)")
    return str(Path(path).expanduser()) if Path(path).expanduser().exists() else path


@contextlib.contextmanager
def quiet_transformers():
    """Hold back transformers' warnings (e.g. about a GGUF's padding token) while only checking a model."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def check_model(spec: ModelConfig, keys: dict[str, str] | None = None):
    """Everything about ``spec`` that can be checked without loading weights; returns the model's transformers
    config (read from the converted copy of a GGUF where there is one). ``keys`` renames fields in messages
    (``{"path": "pretrained"}`` for lm-eval's model_args); the default is ``model.<field>``."""
    from transformers import AutoConfig

    def key(name: str) -> str:
        return (keys or {}).get(name, f"model.{name}")

    path = _check_reference(resolve_model_path(spec), key("path"))
    if spec.tokenizer:
        _check_reference(spec.tokenizer, key("tokenizer"))
    check_device_present(spec.device, key("device"))
    for device in mapped_devices(spec.device_map):  # every device a map names must exist here
        check_device_present(device, key("device_map"))
    source, kwargs = path, {}
    if spec.gguf_file:
        gguf = _gguf_path(path, spec.gguf_file, key("path"), key("gguf_file"))
        converted = converted_dir(gguf) if gguf else None
        if converted and (converted / "config.json").is_file():
            source = str(converted)
        else:
            kwargs = {"gguf_file": spec.gguf_file}
        if not spec.tokenizer and not (converted and (converted / "tokenizer_config.json").is_file()):
            with quiet_transformers():
                _gguf_tokenizer(path, spec)  # a GGUF whose tokenizer does not load fails here, before its weights
    elif Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise KVQuantError(f"{key('path')}: {path} holds no config.json (for a GGUF file set {key('gguf_file')})")
    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(source, trust_remote_code=False, **kwargs)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for a config it cannot read
        refuse_remote_code(err, f"{key('path')}: {spec.path!r} ({source})")
        raise KVQuantError(f"{key('path')}: cannot read the config of {spec.path!r} ({source}): "
                           f"{one_line(err)[:300]}") from None


def _gguf_path(path: str, gguf_file: str, path_key: str = "model.path",
               gguf_key: str = "model.gguf_file") -> Path | None:
    """The local GGUF file (None for a hub repository, which transformers fetches itself)."""
    if not Path(path).is_dir():
        if Path(path).exists():
            raise KVQuantError(f"{path_key}: {path} must be the directory holding {gguf_key} {gguf_file!r}")
        return None
    gguf = Path(path) / gguf_file
    if not gguf.is_file():
        found = sorted(p.name for p in Path(path).glob("*.gguf"))
        raise KVQuantError(f"{gguf_key}: {gguf} does not exist (GGUF files there: {', '.join(found) or 'none'})")
    return gguf


def converted_dir(gguf: Path) -> Path:
    """Where the converted copy of ``gguf`` lives: named by the first 16 hex digits of the file's sha256."""
    return cache_dir("models") / file_sha256(gguf)[:16]


def convert_gguf(path: str, spec: ModelConfig, target: Path) -> None:
    """Load the GGUF once, copy its weights into a fresh model of its config and save that (and the GGUF's
    tokenizer, unless ``spec.tokenizer`` replaces it) to ``target``, atomically (a temp dir, then a rename)."""
    from transformers import AutoModelForCausalLM

    tokenizer = None if spec.tokenizer else _gguf_tokenizer(path, spec)
    print(f"kvquant: converting {Path(path) / spec.gguf_file} once into {target} (later loads read the copy)",
          file=sys.stderr)
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(path, gguf_file=spec.gguf_file, pad_token_id=None,
                                                          dtype=torch.float32, trust_remote_code=False)
    except Exception as err:  # the GGUF loader raises many types for a file it cannot read
        refuse_remote_code(err, f"model {spec.path!r} ({Path(path) / spec.gguf_file})")
        raise KVQuantError(f"cannot load model {spec.path!r} ({Path(path) / spec.gguf_file}): "
                           f"{type(err).__name__}: {one_line(err)[:300]}") from None
    fresh = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        fresh.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.rename(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():  # not a concurrent conversion that finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_tokenizer(path: str, spec: ModelConfig):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, gguf_file=spec.gguf_file, trust_remote_code=False)
    except Exception as err:  # transformers' GGUF tokenizer converter raises IndexError, KeyError, ...
        refuse_remote_code(err, f"the tokenizer of {Path(path) / spec.gguf_file}")
        raise KVQuantError(f"cannot load the tokenizer of {Path(path) / spec.gguf_file} ({type(err).__name__}: "
                           f"{one_line(err)[:200]}); set model.tokenizer (tokenizer= in model_args) to a directory "
                           "or hub id holding its tokenizer") from None


def _load_tokenizer(spec: ModelConfig, path: str, converted: Path | None):
    """The configured tokenizer, else the converted GGUF's, else the GGUF's own, else the model directory's."""
    from transformers import AutoTokenizer

    if spec.tokenizer:
        source = resolve(spec.tokenizer)
    elif spec.gguf_file and not (converted and (converted / "tokenizer_config.json").is_file()):
        return _gguf_tokenizer(path, spec)  # not converted (hub GGUF), or converted for a run with another tokenizer
    else:
        source = str(converted or path)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except Exception as err:  # as for models: many types
        refuse_remote_code(err, f"the tokenizer {spec.tokenizer or spec.path!r} ({source})")
        hint = "" if spec.tokenizer else "; set model.tokenizer to a directory or hub id holding its tokenizer"
        raise KVQuantError(f"cannot load the tokenizer {spec.tokenizer or spec.path!r} ({source}): "
                           f"{type(err).__name__}: {one_line(err)[:200]}{hint}") from None


def load_tokenizer(spec: ModelConfig):
    """The tokenizer :func:`load_model` would load, without the weights."""
    path = resolve_model_path(spec)
    gguf = _gguf_path(path, spec.gguf_file) if spec.gguf_file else None
    converted = converted_dir(gguf) if gguf else None
    return _load_tokenizer(spec, path, converted if converted and converted.is_dir() else None)


def load_model(spec: ModelConfig):
    """``(model, tokenizer)``, the model in eval mode on its device(s); a model or tokenizer that cannot be
    loaded is one :class:`KVQuantError`. A local GGUF file is read from its converted copy (made on first use)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec)
    device = pick_device(spec.device)
    kwargs = {"dtype": model_dtype(spec)}
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    gguf = _gguf_path(path, spec.gguf_file) if spec.gguf_file else None
    converted = converted_dir(gguf) if gguf else None
    if converted and not (converted / "config.json").is_file():
        convert_gguf(path, spec, converted)
    if spec.gguf_file and not gguf:  # a GGUF in a hub repository: transformers converts it on every load
        kwargs.update(gguf_file=spec.gguf_file, pad_token_id=None)
    tokenizer = _load_tokenizer(spec, path, converted)
    try:
        model = AutoModelForCausalLM.from_pretrained(converted or path, trust_remote_code=False, **kwargs).eval()
    except (MemoryError, torch.cuda.OutOfMemoryError):  # a machine too small, not a bad model: exit 3, traceback
        raise
    except Exception as err:  # transformers raises many types for weights it cannot read
        refuse_remote_code(err, f"model {spec.path!r} ({converted or path})")
        raise KVQuantError(f"cannot load model {spec.path!r} ({converted or path}): {type(err).__name__}: "
                           f"{one_line(err)[:300]}") from None
    check_finite_weights(model, f"model {spec.path!r} ({converted or path})")
    if not spec.device_map:
        model = model.to(device)
    return model, tokenizer


def skeleton(config, where: str):
    """The modules :func:`load_model` would build from transformers ``config``, on the meta device (no weights read,
    nothing allocated): what can be seen of a model's layers before it loads (a config transformers cannot build a
    model from is one :class:`KVQuantError` naming ``where``)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), quiet_transformers():
            return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as err:  # transformers raises many types for a config it cannot build
        raise KVQuantError(f"{where}: cannot build the model's layers from its config "
                           f"({getattr(config, 'model_type', None)!r}): {one_line(err)[:300]}") from None


def model_dtype(spec: ModelConfig) -> torch.dtype:
    """The dtype :func:`load_model` loads ``spec`` in (``auto``: bfloat16 on a GPU, float32 on the CPU); preflight
    computes with the same one."""
    if spec.dtype != "auto":
        return DTYPES[spec.dtype]
    return torch.bfloat16 if pick_device(spec.device).startswith("cuda") else torch.float32


def check_finite_weights(model, what: str) -> None:
    """A weight holding NaN or Inf makes every score NaN (or meaningless) whatever the cache does: the model is
    broken, so it is bad input naming the first such weight, not a quantizer's failure."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.device.type != "meta" and not torch.isfinite(tensor).all():
            count = int((~torch.isfinite(tensor)).sum())
            raise KVQuantError(f"{what}: weight {name} holds NaN or Inf ({count} of {tensor.numel()} elements); "
                               "the model itself is broken, so no cache can be measured on it")


def trained_context(config) -> int | None:
    """The longest sequence the model was trained on, as its config states it."""
    return getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)


#: tokens fed at most where neither the config nor the model says
DEFAULT_MAX_LENGTH = 2048


def max_length(model, spec: ModelConfig) -> int:
    """Longest sequence to feed: the config's ``max_length``, else the model's trained context."""
    return spec.max_length or trained_context(model.config) or DEFAULT_MAX_LENGTH
