"""A perplexity or divergence pass keeps each finished group (batch) of windows: interrupted after k groups and resumed,
it scores only the missing windows and gives the uninterrupted pass's result to the last bit; a tampered group is
set aside and measured again; a group of other windows is never reused."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

import kvquant
from kvquant.experiment.config import PerplexitySet
from kvquant.runner.store import ResultStore
from kvquant.scoring.data import windows
from kvquant.scoring.divergence import divergences
from kvquant.scoring.scorer import Scorer, perplexity_samples
from kvquant.scoring.session import Session
from tiny_configs import TINY

KEY = {"settings": "int4", "split": "evaluation"}


class Stop(Exception):
    pass


@pytest.fixture(scope="module")
def ws(tokenizer, model):
    spec = PerplexitySet(name="tinystories", source="local:text/tinystories/validation-first1000.jsonl", limit=9)
    got = [dataclasses.replace(w, ids=w.ids[: 48 - 3 * (i % 4)]) for i, w in enumerate(windows(spec, tokenizer, 48))]
    lengths = [len(w.ids) for w in got]
    assert len(got) == 9 and lengths != sorted(lengths, reverse=True)  # batched longest first; rows padded
    return got


def scorer(model, name, scored: list, stop_after: int | None = None) -> Scorer:
    """A streaming scorer in batches of 2 whose ``score_many`` notes the requests it scores (``scored``) and raises
    :class:`Stop` once ``stop_after`` calls are done (an interruption between groups)."""
    s = Scorer(model, kvquant.CacheSpec.of(name), "streaming", 16, batch_size=2)
    real = s.score_many

    def counted(requests, *args, **kwargs):
        if stop_after is not None and len(scored) >= stop_after:
            raise Stop
        scored.append(len(requests))
        return real(requests, *args, **kwargs)
    s.score_many = counted
    return s


def kept(store, metric):
    """The session's own keep (its groups in ``store.window_groups()``)."""
    return Session._keep_in_store(SimpleNamespace(store=store), "int4", metric, KEY)


def reference(model, ws, name: str = "int4", mode: str = "streaming", batch_size: int = 2) -> dict:
    """The pass by hand, as before passes were kept by group: all windows scored by one call, per-window sums in
    float64."""
    s = Scorer(model, kvquant.CacheSpec.of(name), mode, 16, batch_size=batch_size)
    scored = s.score_many([(w.ids[: w.score_from], w.ids[w.score_from :]) for w in ws])
    return {"nll": [float(-r.logprobs.double().sum()) for r in scored], "tokens": [len(r.logprobs) for r in scored],
            "reads": s.reads.to_dict(), "lengths": s.lengths}


def test_interrupted_perplexity_resumes_identically(model, ws, tmp_path):
    whole: list[int] = []
    assert perplexity_samples(scorer(model, "int4", whole), ws, None) == reference(model, ws)  # nothing kept
    assert sum(whole) == len(ws) and max(whole) <= 2 and len(whole) > 2  # a batch a group
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, [])
    first: list[int] = []
    with pytest.raises(Stop):
        perplexity_samples(scorer(model, "int4", first, stop_after=2), ws, None, kept(store, "ppl/t"))
    assert first == whole[:2]
    names = sorted(p.name for p in (tmp_path / "windows" / "int4").iterdir())
    assert names == [f"ppl__t@0-{first[0]}.json", f"ppl__t@{first[0]}-{sum(first)}.json"]
    again: list[int] = []
    resumed = perplexity_samples(scorer(model, "int4", again), ws, None, kept(store.__class__(
        tmp_path / "partial", {"code": "v1"}, []), "ppl/t"))
    assert again == whole[2:]  # only the missing windows are scored
    assert resumed == reference(model, ws)


@pytest.mark.parametrize("mode", ["simulated", "streaming"])
def test_a_pass_of_windows_of_differing_lengths_equals_one_call_of_all(model, tokenizer, mode):
    """A documents-layout set (windows of differing lengths) scored through the windowed passes gives, bit for bit,
    what one ``score_many`` of all its windows gives (the passes before they were kept by group): every window is
    batched beside the same rows. Before, a group was a batch of consecutive windows, and 16 of 48 TinyStories
    windows of the tiny sweep moved in their 8th digit."""
    spec = PerplexitySet(name="tinystories", source="local:text/tinystories/validation-first1000.jsonl", limit=16,
                         max_length=300)
    got = windows(spec, tokenizer)
    lengths = [len(w.ids) for w in got]
    assert len(set(lengths)) > 8 and lengths != sorted(lengths, reverse=True)
    one = {name: reference(model, got, name, mode, batch_size=4) for name in ("int4", "int2")}
    assert perplexity_samples(Scorer(model, kvquant.CacheSpec.of("int4"), mode, 16, batch_size=4), got,
                              None) == one["int4"]
    base = Scorer(model, kvquant.CacheSpec.of("fp16"), mode, 16, batch_size=4)
    compared = divergences(base, [Scorer(model, kvquant.CacheSpec.of(n), mode, 16, batch_size=4)
                                  for n in ("int4", "int2")], got, None)
    requests = [(w.ids[: w.score_from], w.ids[w.score_from :]) for w in got]
    scorers = [Scorer(model, kvquant.CacheSpec.of(n), mode, 16, batch_size=4) for n in ("fp16", "int4", "int2")]
    for s in scorers:
        s.distributions = True
    fp16, *candidates = [s.score_many(requests) for s in scorers]
    for result, name, scored in zip(compared, ("int4", "int2"), candidates):
        assert result["nll"] == one[name]["nll"] and result["tokens"] == one[name]["tokens"]
        for w, (ref, cand) in enumerate(zip(fp16, scored)):  # KL(p || q) per position, by hand in float64
            p, q = ref.distribution.double().log_softmax(-1), cand.distribution.double().log_softmax(-1)
            kl = torch.where(torch.isinf(p), 0.0, p.exp() * (p - q)).sum(-1).clamp(min=0).tolist()
            assert result["kl"][w] == kl
            assert result["top1"][w] == int((p.argmax(-1) == q.argmax(-1)).sum())


def sizes(model, ws) -> list[int]:
    """The windows of each group of an uninterrupted pass over ``ws``, in order (a call each)."""
    calls: list[int] = []
    perplexity_samples(scorer(model, "int4", calls), ws, None)
    return calls


def test_tampered_group_is_set_aside_and_measured_again(model, ws, tmp_path):
    warnings: list[str] = []
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, warnings)
    perplexity_samples(scorer(model, "int4", []), ws, None, kept(store, "ppl/t"))
    first, second = sizes(model, ws)[:2]
    path = tmp_path / "windows" / "int4" / f"ppl__t@{first}-{first + second}.json"
    path.write_text(path.read_text().replace('"nll": [', '"nll": [1.5, ', 1))
    again: list[int] = []
    got = perplexity_samples(scorer(model, "int4", again), ws, None,
                             kept(ResultStore(tmp_path / "partial", {"code": "v1"}, warnings), "ppl/t"))
    assert again == [second]
    assert got == reference(model, ws)
    assert any("signature does not verify" in w for w in warnings)
    assert (path.parent / (path.name + ".corrupt")).exists()


def test_group_of_other_windows_is_not_reused(model, ws, tmp_path):
    def names(folder):
        return {p.name for p in (folder / "windows" / "int4").iterdir()}

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    perplexity_samples(scorer(model, "int4", []), ws, None,
                       kept(ResultStore(tmp_path / "a" / "partial", {"code": "v1"}, []), "ppl/t"))
    other = list(reversed(ws))  # another config's windows: the same group names, other tokens
    perplexity_samples(scorer(model, "int4", []), other, None,
                       kept(ResultStore(tmp_path / "b" / "partial", {"code": "v1"}, []), "ppl/t"))
    assert names(tmp_path / "a") & names(tmp_path / "b")
    again: list[int] = []
    got = perplexity_samples(scorer(model, "int4", again), other, None,
                             kept(ResultStore(tmp_path / "a" / "partial", {"code": "v1"}, []), "ppl/t"))
    assert again == sizes(model, other)
    assert got == reference(model, other)
    code: list[int] = []
    perplexity_samples(scorer(model, "int4", code), ws, None,
                       kept(ResultStore(tmp_path / "b" / "partial", {"code": "v2"}, []), "ppl/t"))
    assert code == sizes(model, ws)  # other code: measured again


def test_interrupted_divergence_resumes_identically(model, ws, tmp_path):
    names = ("int4", "int2")
    store = ResultStore(tmp_path / "partial", {"code": "v1"}, [])
    base: list[int] = []
    with pytest.raises(Stop):  # the baseline's third call: after two groups
        divergences(scorer(model, "fp16", base, stop_after=2), [scorer(model, n, []) for n in names], ws, None,
                    kept(store, "kl/t"))
    base, counts = [], [[], []]
    resumed = divergences(scorer(model, "fp16", base), [scorer(model, n, c) for n, c in zip(names, counts)], ws,
                          None, kept(ResultStore(tmp_path / "partial", {"code": "v1"}, []), "kl/t"))
    assert base == counts[0] == counts[1] == sizes(model, ws)[2:]
    whole = divergences(scorer(model, "fp16", []), [scorer(model, n, []) for n in names], ws, None)
    assert resumed == whole
    alone = reference(model, ws)  # int4's nll from the comparison is its own perplexity pass's
    assert resumed[0]["nll"] == alone["nll"] and resumed[0]["tokens"] == alone["tokens"]
    assert all(len(got["kl"]) == len(ws) and all(x >= 0 for k in got["kl"] for x in k) for got in resumed)


def test_run_interrupted_mid_pass_resumes_from_its_groups(tmp_path, monkeypatch):
    """``python -m kvquant.run`` interrupted inside the candidates' divergence pass (after the baseline's two groups
    of it) resumes there: the kept groups are not measured again and the report's numbers are an uninterrupted
    run's."""
    from kvquant.run import main

    real = Scorer.score_many
    scored: list[int] = []
    stop = [True]

    def counted(self, requests, *args, **kwargs):
        if self.spec.name == "fp16" and self.distributions and stop[0] and len(scored) == 2:
            raise KeyboardInterrupt  # the sitting ends: a third group of the divergence pass was starting
        if self.spec.name == "fp16" and self.distributions:
            scored.append(len(requests))
        return real(self, requests, *args, **kwargs)

    def run(folder) -> dict:
        folder.mkdir(exist_ok=True)
        path = folder / "tiny.yaml"
        path.write_text(TINY.format(out=folder / "reports"))
        assert main([str(path), "--set", "eval.perplexity.0.limit=10", "--set", "eval.perplexity.0.max_length=64"]
                    ) in (4, 130)  # inconclusive (10 windows), or interrupted
        report = folder / "reports" / "tiny"
        return json.loads((report / "results.json").read_text()) if (report / "results.json").exists() else {}

    monkeypatch.setattr(Scorer, "score_many", counted)
    assert run(tmp_path / "a") == {} and scored == [1, 1]  # batch_size 1: a window a group
    groups = tmp_path / "a" / "reports" / "tiny" / "windows" / "int8"
    kept = {p.name: p.stat().st_mtime_ns for p in groups.iterdir()}
    assert sorted(kept) == ["kl__tinystories@0-1.json", "kl__tinystories@1-2.json"]
    scored.clear()
    stop[0] = False  # no further interruption: the resumed run's baseline scores the last group only
    resumed = run(tmp_path / "a")
    assert scored == [1] * 8
    assert all(p.stat().st_mtime_ns == kept[p.name] for p in groups.iterdir() if p.name in kept)
    scored.clear()
    fresh = run(tmp_path / "b")
    assert scored == [1] * 10
    assert [c["metrics"] for c in resumed["candidates"]] == [c["metrics"] for c in fresh["candidates"]]


def test_run_interrupted_after_a_shared_divergence_pass_keeps_every_candidate_compared_in_it(tmp_path, monkeypatch):
    """Two candidates share the baseline's divergence pass; a run interrupted right after the first one's result is
    stored has stored the second one's too (computed in the same pass), so the resumed run scores no divergence pass
    again and reports what an uninterrupted run reports. Before, the second one's result waited in memory and the
    resumed run scored the whole pass again for it."""
    from kvquant.run import main

    real_score, real_store = Scorer.score_many, ResultStore.get_or_compute
    passes: list[int] = []
    stop = [True]

    def counted(self, requests, *args, **kwargs):
        if self.spec.name == "fp16" and self.distributions:
            passes.append(len(requests))
        return real_score(self, requests, *args, **kwargs)

    def stored(self, candidate, metric, *args, **kwargs):
        got = real_store(self, candidate, metric, *args, **kwargs)
        if stop[0] and candidate == "int8" and metric.startswith("kl/") and "@" not in metric:  # not a group
            raise KeyboardInterrupt  # the sitting ends as the first candidate's divergence is stored
        return got

    two = TINY.replace("residual_length: 0}}}}\n", "residual_length: 0}}}}\n  - {{quantizer: int4, name: int4}}\n")
    assert two != TINY

    def run(folder) -> dict:
        folder.mkdir(exist_ok=True)
        path = folder / "tiny.yaml"
        path.write_text(two.format(out=folder / "reports"))
        assert main([str(path), "--set", "eval.perplexity.0.limit=4"]) in (0, 1, 4, 130)
        report = folder / "reports" / "tiny"
        return json.loads((report / "results.json").read_text()) if (report / "results.json").exists() else {}

    monkeypatch.setattr(Scorer, "score_many", counted)
    monkeypatch.setattr(ResultStore, "get_or_compute", stored)
    assert run(tmp_path / "a") == {} and passes  # interrupted after one shared pass
    passes.clear()
    stop[0] = False
    resumed = run(tmp_path / "a")
    assert passes == []  # both candidates' divergences were kept
    fresh = run(tmp_path / "b")
    assert passes  # an uninterrupted run scores the pass
    assert [c["metrics"] for c in resumed["candidates"]] == [c["metrics"] for c in fresh["candidates"]]


def test_a_folder_in_place_of_a_group_is_refused_before_the_model_loads(tmp_path):
    from kvquant.errors import KVQuantError
    from kvquant.runner.preflight import check_report_dir

    (tmp_path / "windows" / "int8" / "ppl__t@0-1.json").mkdir(parents=True)
    with pytest.raises(KVQuantError, match=r"windows/int8/ppl__t@0-1.json is a folder"):
        check_report_dir(tmp_path)
