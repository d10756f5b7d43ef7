"""llama.cpp itself against kvquant's emulation (``kvquant/integrations/llamacpp_engine.py``,
``experiments/llamacpp_compare.py``).

Bad input is refused in one line (exit 2) before any model loads, with or without llama-cpp-python; the statistics
are checked by value on made-up data; the comparison itself runs on a slice of SmolLM2 wherever ``llama_cpp`` is
importable (``pip install -e ".[llamacpp]"``), asserting the agreement ``reports/llamacpp-compare`` reports there.
"""

import contextlib
import os
import sys

import numpy as np
import pytest
import torch
from llamacpp_reference import F32
from refusals import error_line

import kvquant.scoring.models
from kvquant.integrations import llamacpp_compare as comparison
from kvquant.integrations import llamacpp_engine as engine
from kvquant.formats import llamacpp_matmuls
from kvquant.errors import KVQuantError
from kvquant.integrations.llamacpp_engine import Setting
from kvquant.paths import resolve
from tests.conftest import experiment

STORIES_GGUF = "local:models/stories260K/stories260K.gguf"


def script():
    return experiment("llamacpp_compare")


@pytest.fixture
def nothing_loads(monkeypatch, tmp_path):
    """Loading llama.cpp's model or kvquant's (or its tokenizer) fails the test."""
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))

    def trap(*args, **kwargs):
        raise AssertionError("a model was loaded for an input that should have been refused before")

    monkeypatch.setattr(comparison, "Engine", trap)
    monkeypatch.setattr(kvquant.scoring.models, "load_model", trap)
    monkeypatch.setattr(kvquant.scoring.models, "load_tokenizer", trap)


def refused(capsys, argv) -> str:
    return error_line(script().main(argv), capsys.readouterr().err, prog="llamacpp_compare")


# --- bad input: one line, exit 2, nothing loaded ---------------------------------------------------------------


@pytest.mark.parametrize("types, needle", [
    ("q3_k", "cache type 'q3_k' is not a quantized type llama.cpp allows"),
    ("q8_0,f16", "cache type 'f16' is not a quantized type"),
    ("Q4_0", "cache type 'Q4_0' is not"),
])
def test_a_type_llama_cpp_does_not_allow_is_refused(capsys, nothing_loads, types, needle):
    assert needle in refused(capsys, ["--model", "smollm2", "--types", types])


def test_rotation_at_a_head_size_llama_cpp_cannot_rotate_is_refused(capsys, nothing_loads, monkeypatch):
    monkeypatch.setattr(comparison, "gguf_metadata", lambda path: {"head_dim": 96, "add_bos": False, "bos": 1})
    line = refused(capsys, ["--model", "smollm2", "--types", "q8_0", "--rotation", "on"])
    assert "rotates only head sizes that are multiples of 64" in line and "not head_dim 96" in line
    # the same head size unrotated is what llama.cpp stores: allowed (it goes on to need llama_cpp)
    engine.check_cache_types([Setting("q8_0", False)], 96)


@pytest.mark.parametrize("head_dim, needle", [(96, "not head_dim 96"), (160, "not head_dim 160"),
                                              (8, "not a multiple of llama.cpp's blocks of 32")])
def test_check_settings_refuses_what_llama_cpp_would_not_do(head_dim, needle):
    with pytest.raises(KVQuantError, match=needle):
        engine.check_cache_types([Setting("q4_0", True)], head_dim)
    for d in (64, 128, 192, 256):
        engine.check_cache_types([Setting(kind, rot) for kind in engine.QUANTIZED for rot in (True, False)], d)


def test_a_head_size_that_is_not_a_multiple_of_32_is_refused_from_the_gguf(capsys, nothing_loads):
    line = refused(capsys, ["--model", resolve(STORIES_GGUF), "--types", "q8_0", "--rotation", "off"])
    assert "head_dim 8 is not a multiple of llama.cpp's blocks of 32" in line


def test_a_missing_llama_cpp_package_is_one_line(capsys, nothing_loads, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    line = refused(capsys, ["--model", "smollm2", "--types", "q8_0"])
    assert "llama-cpp-python is not installed" in line and 'pip install -e ".[llamacpp]"' in line


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-70b"], "--model 'llama-70b': a known model (smollm2, gemma3, qwen2.5) or a .gguf file"),
    (["--model", "smollm2", "--rotation", "maybe"], "--rotation 'maybe': on, off or on,off"),
    (["--model", "smollm2", "--windows", "0"], "--windows must be an integer >= 1"),
    (["--model", "smollm2", "--length", "16"], "--length must be an integer >= 32"),
    (["--model", "/nonexistent/x.gguf"], "/nonexistent"),
])
def test_other_bad_arguments_are_one_line(capsys, nothing_loads, argv, needle):
    assert needle in refused(capsys, argv)


@pytest.mark.parametrize("argv, needle", [
    (["--types", "q3_k"], "cache type 'q3_k' is not a quantized type llama.cpp allows"),
    (["--windows", "0"], "--windows must be an integer >= 1"),
    (["--types", ","], "--types ',' names no cache type"),  # probe 56: measured the 16-bit rows alone
    (["--out", "{tmp}/a-file"], "is not a directory"),  # probe 56: refused only after the measurement
])
def test_engine_baselines_refuses_in_one_line_before_anything_loads(capsys, nothing_loads, monkeypatch, tmp_path,
                                                                    argv, needle):
    monkeypatch.setattr(engine, "Engine", lambda *a, **k: pytest.fail("llama.cpp loaded a model"))
    (tmp_path / "a-file").write_text("mine")
    assert experiment("engine_baselines").main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("engine_baselines: error: ") and needle in err[0], err


def test_a_damaged_gguf_is_one_line(capsys, nothing_loads, tmp_path):
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    assert "not a readable GGUF file" in refused(capsys, ["--model", str(bad), "--types", "q8_0"])


# --- the pieces, by value -------------------------------------------------------------------------------------


def test_the_gguf_header_gives_head_size_and_bos():
    meta = engine.gguf_metadata(engine.model_spec("smollm2")[1])
    assert meta == {"architecture": "llama", "head_dim": 64, "add_bos": False, "bos": 1}


def test_qwen_is_a_known_model_read_in_the_models_own_channel_order():
    """``--model qwen2.5``: the packaged GGUF (skipped where make setup has not prepared it); a qwen2 GGUF keeps Q/K
    as the model computes them (llama.cpp's NEOX RoPE: no permutation), so kvquant's K stays in the model's order."""
    from kvquant import packaged
    from kvquant.formats.llamacpp_gguf import rope_layout_of

    try:
        packaged.packaged_file(engine.MODELS["qwen2.5"][0].removeprefix("package:"))
    except packaged.PackageMissing as err:
        pytest.skip(f"the Qwen2.5 GGUF is not prepared here ({err})")
    spec, gguf = engine.model_spec("qwen2.5")
    assert gguf.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" and spec.gguf_file == gguf.name
    assert engine.gguf_metadata(gguf) == {"architecture": "qwen2", "head_dim": 64, "add_bos": False, "bos": 151643}
    import transformers

    assert rope_layout_of(transformers.Qwen2Config()) == "neox"


def test_the_rotation_switch_is_set_only_while_a_context_is_made(monkeypatch):
    monkeypatch.setenv(engine.ROT_ENV, "0")
    with engine.rotation_env(False):
        assert os.environ[engine.ROT_ENV] == "1"
    with engine.rotation_env(True):
        assert engine.ROT_ENV not in os.environ
    assert os.environ[engine.ROT_ENV] == "0"
    monkeypatch.delenv(engine.ROT_ENV)
    with engine.rotation_env(False):
        pass
    assert engine.ROT_ENV not in os.environ


def test_divergence_is_kl_of_the_softmaxes_and_top1_agreement():
    rng = np.random.default_rng(0)
    p, q = torch.tensor(rng.normal(size=(70, 50))), torch.tensor(rng.normal(size=(70, 50)))
    kl, same = engine.divergence(p.float(), q.float())
    a, b = torch.softmax(p.float().double(), -1).numpy(), torch.softmax(q.float().double(), -1).numpy()
    assert np.allclose(kl, (a * np.log(a / b)).sum(-1), rtol=1e-9, atol=1e-12)
    assert np.array_equal(same, a.argmax(-1) == b.argmax(-1))
    zero, all_same = engine.divergence(p.float(), p.float())
    assert np.all(zero == 0) and all_same.all()


def test_block_sums_cut_each_window_on_its_own():
    sums = comparison.block_sums([np.arange(5.0), np.ones(3)], 2)
    assert sums.tolist() == [[1, 2], [5, 2], [4, 1], [2, 2], [1, 1]]


def made_up(values: dict[str, tuple[float, ...]], positions: int = 256, windows: int = 2) -> dict:
    """Per label: llama.cpp's and kvquant's KL (then llama.cpp's and the verdict's against the model: a tenth of
    them unless given) drawn around the given means (exponential, seeded)."""
    rng = np.random.default_rng(1)
    found = {}
    for label, means in values.items():
        means = means if len(means) == 4 else (*means, means[0] / 10, means[1] / 10)
        found[label] = {side: {"kl": [rng.exponential(m, positions) for _ in range(windows)],
                               "top1": [np.ones(positions, bool)] * windows}
                        for side, m in zip((*engine.SIDES, *engine.MODEL_SIDES), means)}
    found[engine.F16_LABEL] = {side: {"kl": [np.full(positions, m)] * windows, "top1": [np.ones(positions, bool)]}
                               for side, m in (("llamacpp_model", 0.004), ("kvquant_model", 0.0036))}
    return found


def test_the_rows_verdicts_and_checks_by_value():
    settings = [Setting("q8_0", True), Setting("q4_0", True), Setting("q8_0", False), Setting("q4_0", False),
                Setting("q5_0", True), Setting("q5_0", False)]
    found = made_up({"q8_0 rot on": (0.004, 0.0041, 0.0042, 0.0002), "q4_0 rot on": (0.05, 0.03),
                     "q8_0 rot off": (0.005, 0.0002),
                     "q4_0 rot off": (0.15, 0.16), "q5_0 rot on": (0.0005, 0.0001), "q5_0 rot off": (0.04, 0.00005)})
    rows, draws = comparison.rows_with_draws(found, settings)
    by = {r.setting.label: r for r in rows}
    for r in rows:
        both = [np.concatenate(found[r.setting.label][side]["kl"]).mean() for side in engine.SIDES]
        assert r.kl["llamacpp"][0] == pytest.approx(both[0]) and r.kl["kvquant"][0] == pytest.approx(both[1])
        assert r.kl["llamacpp"][1] < r.kl["llamacpp"][0] < r.kl["llamacpp"][2]
        assert r.ratio[0] == pytest.approx(both[1] / both[0]) and r.ratio[1] < r.ratio[0] < r.ratio[2]
    assert by["q8_0 rot on"].within and by["q4_0 rot off"].within
    assert not by["q4_0 rot on"].within and not by["q8_0 rot off"].within  # 0.6x and 0.04x
    assert not by["q5_0 rot on"].gated  # llama.cpp's KL below 1e-3: no target
    checks = comparison.verdicts(rows, draws)
    assert not checks["within"]
    on, off = checks["orders"]["on"], checks["orders"]["off"]
    assert on["orders"] == {"llamacpp": ["q5_0", "q8_0", "q4_0"], "kvquant": ["q5_0", "q8_0", "q4_0"]} and on["same"]
    assert off["orders"] == {"llamacpp": ["q8_0", "q5_0", "q4_0"], "kvquant": ["q5_0", "q8_0", "q4_0"]}
    assert off["swapped"] == [{"pair": ("q8_0", "q5_0"), "llamacpp_separates": True}]
    assert checks["rotation"]["q4_0"]["llamacpp"] < 0 and checks["rotation"]["q4_0"]["kvquant"] < 0
    assert checks["rotation"]["q5_0"]["llamacpp"] < 0 < checks["rotation"]["q5_0"]["kvquant"]
    assert not checks["rotation_same_direction"]
    q8 = by["q8_0 rot on"]
    assert q8.kl["verdict"][0] == pytest.approx(np.concatenate(found["q8_0 rot on"]["verdict"]["kl"]).mean())
    text = comparison.summary_text(rows, checks, comparison.f16_offsets(found))
    assert "| q4_0 | on |" in text and "**missed**" in text and "target: not met" in text
    assert f"| met | {comparison.fmt(q8.kl['llamacpp_model'][0])} [" in text  # beside the target: against the model
    assert f"| {comparison.fmt(q8.kl['verdict'][0])} [" in text
    assert "f16 cache against the model's own computation: llama.cpp 0.0040, kvquant's emulation 0.0036" in text
    doc = comparison.to_json({"rows": rows, "checks": checks, "found": found, "meta": {}}, block=32)
    kept = doc["blocks"][engine.F16_LABEL]["llamacpp_model"]["kl"]  # [sum, positions] per block of 32
    assert len(kept) == 2 * 256 // 32 and kept[0] == pytest.approx([0.004 * 32, 32])
    rows_by = {(row["type"], row["rotation"]): row for row in doc["rows"]}
    assert rows_by["q8_0", True]["kl"]["verdict"][0] == pytest.approx(q8.kl["verdict"][0])


def test_a_swap_llama_cpp_cannot_separate_is_named_as_noise():
    settings = [Setting("q4_1", True), Setting("iq4_nl", True)]
    found = made_up({"q4_1 rot on": (0.0400, 0.041), "iq4_nl rot on": (0.0401, 0.039)})
    rows, draws = comparison.rows_with_draws(found, settings)
    check = comparison.order_check(rows, draws, True)
    assert not check["same"] and check["swapped"][0]["pair"] == ("q4_1", "iq4_nl")
    assert not check["swapped"][0]["llamacpp_separates"] and check["same_where_llamacpp_separates"]


# --- llama.cpp's matmuls: activations quantized to the weight's dot-product type, by value ----------------------


def activation_rows(d: int, n: int = 4) -> torch.Tensor:
    """``[n, d]`` float32: Gaussian rows with a rounding tie for q8_0 (amax 127, x = 2.5) and q8_K (max -127),
    an all-zero block and one whose largest magnitude appears with both signs."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(d)) * 2
    x[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    x[1, :32] = 0.0
    x[2, :256 if d >= 256 else 32] = 0.0
    x[2, :3] = torch.tensor([5.0, -5.0, 1.5])
    x[3] = x[3] * 1e-3
    x[3, 7] = -127.0 * 1e-3
    return x


def test_q8_0_and_q8_1_activations_are_what_ggml_quantizes():
    from llamacpp_reference import ref_dequantize, ref_q8_0

    x = activation_rows(96)
    for kind in ("q8_0", "q8_1"):  # q8_1's codes and d are q8_0's; its s is not used by value here
        got = llamacpp_matmuls.activations(x, kind).numpy()
        for r, row in enumerate(x.numpy().astype(F32)):
            want = [v for b in range(3) for v in ref_dequantize("q8_0", ref_q8_0(row[b * 32: b * 32 + 32], "x86")[0])]
            assert np.array_equal(got[r], np.array(want, dtype=F32)), (kind, r)


def test_q8_k_activations_are_quantize_row_q8_k_ref():
    from llamacpp_reference import ref_q8_k

    x = activation_rows(512)
    got = llamacpp_matmuls.activations(x, "q8_K").numpy()
    for r, row in enumerate(x.numpy().astype(F32)):
        want = ref_q8_k(row[:256]) + ref_q8_k(row[256:])
        assert np.array_equal(got[r], np.array(want, dtype=F32)), r
    assert np.all(got[2, :256][3:] == 0) and got[2, 0] == 5.0  # max = +5 (first of equal magnitudes): -127 codes


def test_float_weights_read_float_activations():
    x = activation_rows(64).double()
    assert torch.equal(llamacpp_matmuls.activations(x.float(), "f16"), x.float().half().float())
    assert torch.equal(llamacpp_matmuls.activations(x.float(), "bf16"), x.float().bfloat16().float())
    assert torch.equal(llamacpp_matmuls.activations(x.float(), "f32"), x.float())


def test_every_linear_layer_of_smollm2_finds_its_gguf_weight_type():
    import transformers

    gguf = engine.model_spec("smollm2")[1]
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).eval()
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    types = llamacpp_matmuls.weight_types(gguf, linear)
    assert types.pop("lm_head") == "Q8_0"  # tied: token_embd
    assert len(types) == 14 and set(types.values()) == {"Q4_1"}
    handles = llamacpp_matmuls.emulate_matmuls(model, gguf)
    x = activation_rows(64)
    q_proj, down = model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj
    assert torch.equal(q_proj(x), torch.nn.functional.linear(llamacpp_matmuls.activations(x, "q8_1"), q_proj.weight))
    h = torch.randn(4, 96)
    assert torch.equal(down(h), torch.nn.functional.linear(llamacpp_matmuls.activations(h, "q8_1"), down.weight))
    for handle in handles:
        handle.remove()
    assert torch.equal(q_proj(x), torch.nn.functional.linear(x, q_proj.weight))


# --- llama.cpp itself (where llama_cpp is importable: pip install -e ".[llamacpp]") ----------------------------


@contextlib.contextmanager
def smollm2_in_llama_cpp(length: int):
    """llama.cpp's SmolLM2 (2 threads) and the first WikiText-2 window of ``length`` tokens."""
    pytest.importorskip("llama_cpp")
    spec, gguf = engine.model_spec("smollm2")
    run = engine.Engine(gguf, threads=2)
    try:
        tokenizer = kvquant.scoring.models.load_tokenizer(spec)
        yield run, engine.token_windows(tokenizer, engine.gguf_metadata(gguf), 1, length)[0]
    finally:
        run.close()


@pytest.mark.slow
def test_llama_cpp_reads_an_f32_cache_as_f16_and_repeats_itself_exactly():
    """llama.cpp's f16 cache twice, and its f32 cache (cast to f16 for flash attention), give the same logits bit
    for bit: the reference every KL is measured against is exact, and kvquant's llamacpp_f32 reads as f16."""
    with smollm2_in_llama_cpp(128) as (run, ids):
        f16 = run.logits(ids)
        assert torch.equal(run.logits(ids), f16)
        assert torch.equal(run.logits(ids, Setting("f32", True)), f16)
        assert not torch.equal(run.logits(ids, Setting("bf16", True)), f16)


def test_the_ubatch_and_flash_attention_reach_llama_cpp():
    """An f16 cache read in ubatches of 32 query rows, or without flash attention, gives other logits than the
    whole window in one ubatch (other arithmetic: docs/quantizers.md, what an engine format's KL means), each the
    same when repeated."""
    with smollm2_in_llama_cpp(96) as (run, ids):
        whole = run.logits(ids)
        for options in ({"ubatch": 32}, {"flash": False}):
            got = run.logits(ids, **options)
            assert torch.equal(run.logits(ids, **options), got) and not torch.equal(got, whole), options


@pytest.mark.slow
def test_llama_cpp_and_kvquant_agree_on_a_smollm2_window():
    """One 256-token WikiText-2 window, q8_0 and q4_0 rotated (llama.cpp's default) and q4_0 unrotated: each kvquant
    KL within +-20% of llama.cpp's or their 95% intervals overlapping, top-1 agreement within 0.05, the same order
    and rotation's effect in the same direction (reports/llamacpp-compare)."""
    pytest.importorskip("llama_cpp")
    settings = [Setting("q8_0", True), Setting("q4_0", True), Setting("q4_0", False)]
    result = comparison.compare("smollm2", 1, 256, settings, threads=2)
    assert result["meta"]["same_tokenization"]
    for row in result["rows"]:
        assert row.gated and row.within, row
        assert abs(row.top1["llamacpp"] - row.top1["kvquant"]) <= 0.05, row
    checks = result["checks"]
    assert checks["orders"]["on"]["same"] and checks["rotation_same_direction"]
    assert result["rows"][0].kl["llamacpp"][0] > 2e-3  # what llama.cpp's quantized matmuls make of a q8_0 cache


@pytest.mark.slow
def test_the_cache_alone_does_not_predict_llama_cpp():
    """The same window with kvquant's cache-only emulation (float32 matmuls, K in the model's order): q8_0 predicted
    at under a fifth of llama.cpp's KL, what emulating llama.cpp's quantized matmuls fixes."""
    pytest.importorskip("llama_cpp")
    (q8,) = comparison.compare("smollm2", 1, 256, [Setting("q8_0", True)], threads=2, matmul="float32",
                               rope_layout="neox")["rows"]
    assert q8.ratio[2] < 0.2 and not q8.within


def test_an_interrupted_comparison_resumes_at_the_next_window(tmp_path, monkeypatch):
    """Each finished window is kept under a key of its tokens, settings and inputs: a rerun reads it back (no
    model called, the same numbers), other inputs measure it again, and an interruption keeps what was done."""
    from kvquant.integrations import llamacpp_engine as engine_module

    calls = []

    def logits(ids, setting):  # [n, vocab]: the f16 reference, and a setting's logits off it by its rotation
        calls.append((tuple(ids), setting))
        base = torch.arange(len(ids) * 5, dtype=torch.float64).reshape(len(ids), 5).sin()
        return base if setting is None else base + 0.1 * (1 + setting.rotation) * base.cos()

    class FakeEngine:
        def logits(self, ids, setting):
            return logits(ids, setting)

    monkeypatch.setattr(engine_module, "kvquant_logits", lambda model, ids, s, **options: logits(ids, s))
    settings = [Setting("q8_0", True), Setting("q4_0", False)]
    windows = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    first = engine_module.measure_engines(FakeEngine(), None, windows, settings, saved=tmp_path, inputs="a")
    # per window: llama.cpp's f16 and two settings; kvquant's fp16 (the model's own), two verdicts, f16, two
    assert len(calls) == 3 * 9 and len(list(tmp_path.glob("window-*.npz"))) == 3
    calls.clear()
    again = engine_module.measure_engines(FakeEngine(), None, windows, settings, saved=tmp_path, inputs="a")
    assert calls == []
    for label in first:
        for side in first[label]:
            for what in ("kl", "top1"):
                assert all(np.array_equal(x, y) for x, y in zip(first[label][side][what], again[label][side][what]))
    engine_module.measure_engines(FakeEngine(), None, windows, settings, saved=tmp_path, inputs="another model")
    assert len(calls) == 27  # other inputs: every window measured again
    calls.clear()
    window_2 = tmp_path / "window-0002.npz"
    window_2.unlink()  # as if interrupted during window 2
    engine_module.measure_engines(FakeEngine(), None, windows, settings, saved=tmp_path, inputs="another model")
    assert {ids for ids, _ in calls} == {tuple(windows[1])}
