"""A decided llama.cpp cache type as llama.cpp, Ollama and llama-cpp-python are started with
(:mod:`kvquant.integrations.deploy`
writes it into ``DEPLOY.md``).

Read from the llama.cpp that llama-cpp-python 0.3.36 vendors (``vendor/llama.cpp``) and from Ollama's repository
(snapshot fb30760, 2026-08-21, v0.33.0-rc2; ``v0.30.0``'s parent ``9db4bdbad^`` for earlier versions):

- **llama.cpp**: ``-ctk``/``--cache-type-k`` and ``-ctv``/``--cache-type-v`` take f32, f16, bf16, q8_0, q4_0, q4_1,
  iq4_nl, q5_0, q5_1, default f16 (``common/arg.cpp:304-314, 2436-2461``, ``common/common.h:343-344``); ``-fa`` /
  ``--flash-attn`` takes ``on``, ``off`` or ``auto`` (``arg.cpp:1754-1768``; ``on`` is also ``enabled``, ``true``,
  ``1``: ``arg.cpp:1334-1336``). A quantized V needs flash attention (``src/llama-context.cpp:3840-3849``: ``auto``
  turns it on, ``off`` fails). A quantized K or V is rotated by a Hadamard matrix when the head size is a multiple of
  64 unless ``LLAMA_ATTN_ROT_DISABLE`` is a nonzero integer (``src/llama-kv-cache.cpp:315-339``), which the log says
  (``attn_rot_k = 1``, ``:341-342``).
- **llama-cpp-python 0.3.36**: ``Llama(..., flash_attn: bool = False, type_k: Optional[int] = None,
  type_v: Optional[int] = None)`` (``llama_cpp/llama.py:95, 115-116``); ``flash_attn=False`` is
  ``LLAMA_FLASH_ATTN_TYPE_DISABLED`` (``:354-358``), so a quantized V needs ``flash_attn=True``. The types are ggml's
  numbers, ``llama_cpp.GGML_TYPE_*`` (``llama_cpp/llama_cpp.py:95-113``), which has no ``GGML_TYPE_BF16``: bf16 is
  30 (``ggml/include/ggml.h:420``).
- **Ollama**: one ``OLLAMA_KV_CACHE_TYPE`` for K and V and every model, documented values f16, q8_0 and q4_0, and a
  quantized cache only with flash attention (``docs/faq.mdx:348-365``). From 0.30.0 Ollama runs llama.cpp's own
  ``llama-server`` with ``--cache-type-k T --cache-type-v T`` (``llm/llama_server.go:394-396``), ``--flash-attn on``
  when ``OLLAMA_FLASH_ATTENTION=1`` (``:596-621``), and its own environment (``:446``), at the llama.cpp build named
  in ``LLAMA_CPP_VERSION`` (b10488 in the snapshot). Before 0.30.0 it ignored any other value with a warning and ran
  f16, and ignored a quantized type without ``OLLAMA_FLASH_ATTENTION=1`` (``llm/server.go:225-253`` at
  ``9db4bdbad^``, ``fs/ggml/ggml.go:898-905``), with a llama.cpp copy (ec98e2002) that has no rotation.

Which options of a ``llamacpp_*`` setting are deployable: ``key_type``, ``value_type`` and ``attn_rot`` are the
engine's own (``-ctk``, ``-ctv``, ``LLAMA_ATTN_ROT_DISABLE``); ``cpu`` only chooses which CPU build's q8_0 rounding
kvquant emulated, so it is deployed as a statement of where the measurement holds. kvquant's own cache options
(residual tokens, sinks, windows, eviction, its own rotation) and per-layer maps are research settings: llama.cpp
has one cache type for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvquant.integrations.deploy_read import CandidateRecord, need, quote
from kvquant.formats.llamacpp import CACHE_TYPES, CPU_PATHS, FLOAT_TYPES, LlamaCppQuantizer
from kvquant.formats.quantizers import QUANTIZERS

#: llama-cpp-python 0.3.36's constant for each cache type (``llama_cpp/llama_cpp.py:95-113``); bf16 has none (30)
PYTHON_TYPES = {"f32": "llama_cpp.GGML_TYPE_F32", "f16": "llama_cpp.GGML_TYPE_F16", "bf16": "30",
                "q8_0": "llama_cpp.GGML_TYPE_Q8_0", "q4_0": "llama_cpp.GGML_TYPE_Q4_0",
                "q4_1": "llama_cpp.GGML_TYPE_Q4_1", "iq4_nl": "llama_cpp.GGML_TYPE_IQ4_NL",
                "q5_0": "llama_cpp.GGML_TYPE_Q5_0", "q5_1": "llama_cpp.GGML_TYPE_Q5_1"}
#: the values of ``OLLAMA_KV_CACHE_TYPE`` Ollama documents (``docs/faq.mdx:361-365``)
OLLAMA_TYPES = ("f16", "q8_0", "q4_0")
#: which build of ggml-cpu's q8_0/q8_1 quantizer the option ``cpu`` emulates
CPU_BUILDS = {"x86": "x86 with AVX/AVX2", "arm": "ARM with NEON",
              "scalar": "a build without SIMD (the scalar reference)"}
#: Hadamard block sizes a results.json may record (powers of two from 64; llama.cpp's largest dividing the head size)
BLOCKS = tuple(2 ** i for i in range(6, 17))
SETTINGS = ("key_type", "value_type", "attn_rot", "cpu", "key_rotation_block", "value_rotation_block")


@dataclass(frozen=True)
class CacheTypes:
    """A measured llama.cpp cache: the (K, V) types, ``attn_rot`` as set (None: llama.cpp's default), the CPU build
    emulated, and the Hadamard blocks kvquant rotated K and V in (None: not rotated)."""

    key: str
    value: str
    attn_rot: bool | None
    cpu: str
    key_block: int | None
    value_block: int | None

    @property
    def quantized(self) -> bool:
        return any(t not in FLOAT_TYPES for t in (self.key, self.value))

    @property
    def rotation_off(self) -> bool:
        """``LLAMA_ATTN_ROT_DISABLE=1`` was measured (a float-only cache is never rotated: nothing to turn off)."""
        return self.attn_rot is False and self.quantized

    def flags(self) -> str:
        """``llama-server``/``llama-cli``'s cache flags."""
        return f"-ctk {self.key} -ctv {self.value} -fa on"

    def command(self, program: str) -> str:
        return ("LLAMA_ATTN_ROT_DISABLE=1 " if self.rotation_off else "") + f"{program} -m MODEL.gguf {self.flags()}"

    def python(self) -> str:
        """llama-cpp-python's keyword arguments (with the environment variable set first when rotation is off)."""
        call = (f"llama_cpp.Llama(model_path=\"MODEL.gguf\", flash_attn=True, type_k={PYTHON_TYPES[self.key]}, "
                f"type_v={PYTHON_TYPES[self.value]})")
        return (["import os", "os.environ[\"LLAMA_ATTN_ROT_DISABLE\"] = \"1\"  # before the context is created"]
                if self.rotation_off else []) + ["import llama_cpp", f"llm = {call}"]

    def ollama_refusal(self) -> str | None:
        """Why Ollama cannot run exactly this cache, or None."""
        if self.key != self.value:
            return (f"K is {self.key} and V {self.value}, and `OLLAMA_KV_CACHE_TYPE` sets both to one type (0.30.0 "
                    "and later pass it as `--cache-type-k` and `--cache-type-v` alike, `llm/llama_server.go:394-396`;"
                    " ollama/ollama#8332 asks for separate types)")
        if self.key not in OLLAMA_TYPES:
            return (f"Ollama documents `OLLAMA_KV_CACHE_TYPE` {', '.join(OLLAMA_TYPES)} only (`docs/faq.mdx:361-365`),"
                    f" not {self.key}; before 0.30.0 it ran f16 instead, with a warning (`llm/server.go:237-253`), and "
                    "0.30.0 and later pass it on unchecked, which kvquant has not tried")
        if self.rotation_off:
            return ("it was measured with llama.cpp's rotation off, and Ollama documents no switch for "
                    "`LLAMA_ATTN_ROT_DISABLE`: what Ollama runs is rotated")
        return None

    def ollama(self) -> str:
        return f"OLLAMA_FLASH_ATTENTION=1 OLLAMA_KV_CACHE_TYPE={self.key} ollama serve"


def is_llamacpp(setting: CandidateRecord) -> bool:
    """Whether a setting's quantizer is one of llama.cpp's cache types (``llamacpp_*``)."""
    cls = QUANTIZERS.classes.get(setting.quantizer)
    return isinstance(cls, type) and issubclass(cls, LlamaCppQuantizer)


def read(setting: CandidateRecord, path: Path) -> CacheTypes:
    """The llama.cpp cache a ``llamacpp_*`` setting measured, every value checked as the runner writes it (``path``:
    the results.json it is in, for the messages)."""
    settings = setting.settings
    own = {k: settings.get(k) for k in SETTINGS}
    default = QUANTIZERS.classes[setting.quantizer].cache_type
    at = f"{quote(setting.name)}'s settings"
    for key in ("key_type", "value_type"):
        own[key] = own[key] if key in settings else default
        need(isinstance(own[key], str) and own[key] in CACHE_TYPES, path, f"{at}.{key}",
             f"one of llama.cpp's cache types ({', '.join(CACHE_TYPES)})", own[key])
    need(own["attn_rot"] is None or isinstance(own["attn_rot"], bool), path, f"{at}.attn_rot", "true, false or null",
         own["attn_rot"])
    own["cpu"] = own["cpu"] if "cpu" in settings else "x86"
    need(isinstance(own["cpu"], str) and own["cpu"] in CPU_PATHS, path, f"{at}.cpu", f"one of {', '.join(CPU_PATHS)}",
         own["cpu"])
    check_blocks(own, settings, path, at)
    check_no_scales(settings, path, at)
    return CacheTypes(own["key_type"], own["value_type"], own["attn_rot"], own["cpu"], own["key_rotation_block"],
                      own["value_rotation_block"])


def check_blocks(own: dict, settings: dict, path: Path, at: str) -> None:
    """The Hadamard blocks recorded are the ones llama.cpp rotates with (``LlamaCppQuantizer.rotations``): K's an
    int of :data:`BLOCKS`, V's 64 (``build_input_v_rot``), each only for a quantized type with rotation not off;
    with ``attn_rot: true`` every quantized side's present (the runner refuses it where nothing rotates); by
    default both quantized sides rotated or neither (one head size decides both)."""
    sides = (("key_rotation_block", own["key_type"], BLOCKS, "a power of two from 64"),
             ("value_rotation_block", own["value_type"], (64,), "64, llama.cpp's V block"))
    for key, kind, allowed, wanted in sides:
        need(key in settings, path, f"{at}.{key}", "recorded (the runner writes the Hadamard block it measured, or "
             "null)", "missing")
        block, rotatable = own[key], kind not in FLOAT_TYPES and own["attn_rot"] is not False
        need(block is None or (rotatable and type(block) is int and block in allowed), path, f"{at}.{key}",
             f"null or {wanted} (only a quantized type, rotation not off)", block)
    rotated = {own[key] is not None for key, kind, _, _ in sides if kind not in FLOAT_TYPES}
    if own["attn_rot"] is True:
        need(rotated == {True}, path, f"{at}'s rotation blocks", "present for every quantized type (attn_rot: true "
             "is refused by the runner where llama.cpp rotates nothing)", [own[key] for key, *_ in sides])
    need(len(rotated) <= 1, path, f"{at}'s rotation blocks", "present for both quantized types or neither "
         "(llama.cpp rotates K and V at the same head sizes)", [own[key] for key, *_ in sides])


def check_no_scales(settings: dict, path: Path, at: str) -> None:
    """No ``k_scale``/``v_scale``, at the top or in a layer: llama.cpp's cache types have no static scales (each
    block of 32 carries its own), so the runner never records one for a ``llamacpp_*`` setting."""
    owners = [("", settings), *((f".layers[{quote(k)}]", v) for k, v in (settings.get("layers") or {}).items())]
    for where, own_settings in owners:
        for key in ("k_scale", "v_scale"):
            need(key not in own_settings, path, f"{at}{where}.{key}", "absent (llama.cpp's cache types take no "
                 "static scales)", own_settings.get(key))


def rotation_text(types: CacheTypes) -> str:
    """What ``DEPLOY.md`` says of llama.cpp's rotation for this cache."""
    if types.rotation_off:
        return ("Measured with llama.cpp's rotation **off** (`attn_rot: false`): `LLAMA_ATTN_ROT_DISABLE=1` must be in "
                "the engine's environment, because llama.cpp rotates a quantized K and V by default "
                "(`src/llama-kv-cache.cpp:315-339`); its log then says `attention rotation force disabled`.")
    if not types.quantized:
        return "llama.cpp never rotates an f32, f16 or bf16 cache; nothing was rotated here."
    rotated = [f"{role} ({kind}) in Hadamard blocks of {block}" for role, kind, block in
               (("K", types.key, types.key_block), ("V", types.value, types.value_block)) if block]
    if not rotated:
        return ("Not rotated: llama.cpp rotates only head sizes that are multiples of 64 "
                "(`src/llama-kv-cache.cpp:321-339`), and kvquant measured this cache unrotated, as it runs.")
    return (f"llama.cpp rotates this cache by default, and kvquant measured it so: {' and '.join(rotated)} "
            "(ggml-org/llama.cpp#21038, merged 2026-04-01). A llama.cpp from before it stores the cache unrotated, "
            "which is not what was measured: the log says which (`attn_rot_k = 1`, `attn_rot_v = 1`, "
            "`src/llama-kv-cache.cpp:341-342`).")


def ollama_text(types: CacheTypes) -> str:
    """``DEPLOY.md``'s Ollama paragraph: the line, or why there is none."""
    why = types.ollama_refusal()
    if why is not None:
        return f"**Ollama**: no line, because Ollama cannot run exactly this cache: {why}."
    return (f"**Ollama** 0.30.0 or later: `{types.ollama()}`. It runs llama.cpp's `llama-server` with "
            f"`--cache-type-k {types.key} --cache-type-v {types.key}` and, with `OLLAMA_FLASH_ATTENTION=1`, "
            "`--flash-attn on` (`llm/llama_server.go:394-398, 596-621`); the type applies to every model the server "
            "runs (`docs/faq.mdx:356-359`). Earlier versions ran a llama.cpp copy without the rotation (ec98e2002) "
            "or Ollama's own engine, which kvquant did not emulate, and dropped a quantized type without "
            "`OLLAMA_FLASH_ATTENTION=1` (`llm/server.go:237-242`).")


def cpu_text(types: CacheTypes) -> str:
    """Where the emulated arithmetic holds (the option ``cpu``)."""
    if not types.quantized:
        return ""
    return (f" kvquant emulated llama.cpp's CPU backend built for {CPU_BUILDS[types.cpu]} (`cpu: {types.cpu}`), "
            "whose q8_0/q8_1 quantizer rounds the query converted for the K dot product (and a q8_0 cache); "
            "another CPU build may round a tie differently, and GPU backends (CUDA, Metal, Vulkan, ...) compute "
            "attention with kernels kvquant does not emulate.")


def run_text(types: CacheTypes) -> str:
    """``DEPLOY.md``'s part on what to run: llama.cpp's flags, Ollama's line (or why none), llama-cpp-python's
    keyword arguments (fixed words and checked type names only: nothing from the report)."""
    default = (" f16 is llama.cpp's default for both (`common/common.h:343-344`): the flags only make it explicit."
               if types.key == types.value == "f16" else "")
    bf16 = (["llama-cpp-python 0.3.36 has no `GGML_TYPE_BF16` constant: 30 is ggml's number for bf16 "
             "(`ggml/include/ggml.h:420`)."] if "bf16" in (types.key, types.value) else [])
    commands = "\n".join(types.command(program) for program in ("llama-server", "llama-cli"))
    python = "\n".join(types.python())
    return "\n\n".join([
        f"**llama.cpp** (`llama-server`, `llama-cli`):\n\n```bash\n{commands}\n```",
        "`-fa on`: kvquant measured flash attention's arithmetic, which a quantized V needs "
        "(`src/llama-context.cpp:3840-3849`); the default `-fa auto` uses it only where the device supports it "
        f"(`:557-560`).{default}",
        rotation_text(types), ollama_text(types),
        "**llama-cpp-python** 0.3.36 (`flash_attn` defaults to False, which a quantized V cannot run with):\n\n"
        f"```python\n{python}\n```", *bf16])
