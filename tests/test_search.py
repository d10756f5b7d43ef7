"""The per-layer search: its pure parts (greedy order, bisection, map -> cache), and a run on stories260K that
calibrates only on the held-apart split, is deterministic, and writes a map that reruns."""

import json

import pytest
import torch
import yaml

import kvquant
from kvquant.scoring import session as measure_module
from kvquant.errors import ConfigError
from kvquant.experiment.config import Candidate, load_config
from kvquant.run import main
from kvquant.runner.search import first_passing, greedy_order, last_within, map_candidate
from tiny_configs import SEARCHED_RUN as CONFIG

LADDER = [Candidate("int2", {"residual_length": 0}, "int2"), Candidate("int4", {"group_size": 8, "residual_length": 0},
                                                                          "int4"),
          Candidate("int8", {"residual_length": 0}, "int8")]


def test_greedy_order_moves_the_layer_that_saves_most_per_bit_first():
    # layer 0 hurts a lot at rung 0, layer 1 little; rung 1 -> 2 costs 4 bits, rung 0 -> 1 costs 1 bit
    sensitivity = {0: [1.0, 0.1, 0.0], 1: [0.2, 0.15, 0.0], 2: [0.5, 0.0, 0.0]}
    maps = greedy_order(sensitivity, [2.0, 3.0, 7.0])
    assert maps[0] == {0: 0, 1: 0, 2: 0} and maps[-1] == {0: 2, 1: 2, 2: 2}
    assert len(maps) == 1 + 3 * 2  # one layer, one rung per step
    steps = [next(layer for layer in maps[i] if maps[i][layer] != maps[i - 1][layer]) for i in range(1, len(maps))]
    # gains per bit: L0 0.9, L2 0.5, L1 0.05 (rung 0->1); then L0 0.025, L1 0.0375, L2 0 (rung 1->2)
    assert steps == [0, 2, 1, 1, 0, 2]
    assert all(sum(maps[i].values()) == i for i in range(len(maps)))


def test_first_passing_finds_the_boundary_with_few_checks():
    for boundary in range(0, 40):
        calls = []

        def passes(m, calls=calls, boundary=boundary):
            calls.append(m)
            return m >= boundary

        assert first_passing(passes, 40) == boundary
        assert len(calls) <= 1 + 6  # the last, then bisection over 40
    assert first_passing(lambda m: False, 10) is None


def test_last_within_takes_the_last_map_at_or_under_the_budget_even_when_bits_do_not_grow():
    # a mixed layout: moving a sliding layer up a rung can save bits (int2 with its residual costs more there)
    bits = [4.5, 4.99, 5.48, 5.43, 5.05, 5.0, 6.0]
    assert last_within(bits, 5.0) == 5  # exactly the budget fits; not 1, where bits first exceed it
    assert last_within(bits, 4.999) == 1
    assert last_within(bits, 5.99) == 5 and last_within(bits, 6.0) == 6
    assert last_within(bits, 100) == 6 and last_within(bits, 4.4) is None


def test_a_map_reaches_the_layers_it_names():
    model = kvquant.load_model if False else None  # noqa: F841 (no model needed: a layout suffices)
    candidate = map_candidate(LADDER, {0: 2, 1: 2, 2: 0, 3: 1, 4: 2}, "m")
    assert set(candidate.options["layers"]) == {"0-1", "3", "4"}
    cache = kvquant.cache.build_cache([None] * 5, candidate.quantizer, head_dim=8, **candidate.options)
    assert [layer.quantizer.name for layer in cache.layers] == ["int8", "int8", "int2", "int4", "int8"]
    assert cache.layers[3].quantizer.group_size == 8 and cache.layers[2].residual_length == 0
    assert all(layer.residual_length == 0 for layer in cache.layers)


LOWBIT = [Candidate("lloyd_max", {"key_bits": 3, "value_bits": 3, "residual_length": 0, "pre_rope": True}, "lm3"),
          Candidate("keys_values", {"keys": {"quantizer": "lloyd_max", "key_bits": 4},
                                    "values": {"quantizer": "lloyd_max", "value_bits": 3},
                                    "residual_length": 0, "pre_rope": True}, "k-lm4-v-lm3"),
          Candidate("int4", {"group_size": 32, "residual_length": 0, "pre_rope": True}, "int4-g32")]


def test_a_map_of_low_bit_rungs_stores_each_layer_as_its_rung_alone(model, real_kv):
    """Issue 56's per-layer K/V search over the new methods: a map over Lloyd-Max, a keys/values mix and int4, all
    before RoPE, returns at every layer exactly the keys and values the uniform cache of that layer's rung returns,
    and its stored bytes are the rungs' bytes layer by layer (no state shared between layers of different rungs)."""
    rungs = {0: 0, 1: 2, 2: 2, 3: 1, 4: 0}  # not symmetric, with a run: a map read backwards or cut wrong fails
    candidate = map_candidate(LOWBIT, rungs, "m")
    mixed = kvquant.make_cache(model, candidate.quantizer, **candidate.options)
    alone = [kvquant.make_cache(model, rung.quantizer, **rung.options) for rung in LOWBIT]
    positions = torch.arange(real_kv[0][0].shape[2])[None]
    for layer, (keys, values) in enumerate(real_kv):
        got = mixed.update(keys, values, layer, kwargs={"position_ids": positions})
        want = [cache.update(keys, values, layer, kwargs={"position_ids": positions}) for cache in alone]
        assert torch.equal(got[0], want[rungs[layer]][0]) and torch.equal(got[1], want[rungs[layer]][1]), layer
        assert not any(torch.equal(got[0], other[0]) for r, other in enumerate(want) if r != rungs[layer])
    stored = [cache.memory_report()["stored_bytes"] for cache in alone]
    by_layer = [{part["layer"]: part["total_bytes"] for part in cache.memory_report()["per_layer"]} for cache in alone]
    assert mixed.memory_report()["stored_bytes"] == sum(by_layer[r][layer] for layer, r in rungs.items())
    assert stored[0] < stored[1] < stored[2]  # the ladder grows in bytes as in bits





@pytest.mark.slow
def test_search_calibrates_apart_from_evaluation_and_is_deterministic(tmp_path, monkeypatch):
    read_docs, read_windows = [], []
    real_task, real_ppl = measure_module.run_task, measure_module.perplexity_samples

    def spy_task(*args):
        if args[-1] is not None:  # named documents: the calibration split (evaluation reads the first limit)
            read_docs.append(list(args[-1]))
        return real_task(*args)

    def spy_ppl(scorer, windows, desc=None):
        if desc is None:  # the calibration split shows no progress bar; evaluation names candidate and set
            read_windows.extend(tuple(w.ids) for w in windows)
        return real_ppl(scorer, windows, desc=desc)

    monkeypatch.setattr(measure_module, "run_task", spy_task)
    monkeypatch.setattr(measure_module, "perplexity_samples", spy_ppl)
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path / "a"))
    main([str(path)])
    doc = json.loads((tmp_path / "a" / "searched-tiny" / "results.json").read_text())
    found = doc["search"]
    # calibration read documents 20..35 only, and windows that evaluation never reads
    assert read_docs and all(d == list(range(20, 36)) for d in read_docs)
    from kvquant.scoring import data
    from kvquant.scoring.models import load_tokenizer
    cfg = load_config(path)
    tok = load_tokenizer(cfg.model)
    evaluation = {tuple(w.ids) for w in data.windows(cfg.eval.perplexity[0], tok, 2048)}
    assert read_windows and not evaluation & set(read_windows)
    assert len(set(read_windows)) == 4
    assert found["calibration"] == {"windows": {"tinystories": [6, 10]},
                                    "documents": {"tinystories_lastword": [20, 36]},
                                    "max_perplexity_ratio": 1.02, "tasks_gated": True}
    # the map is evaluated like a candidate, and searched.yaml reruns it alone
    assert [c["name"] for c in doc["candidates"]] == ["mixed"]
    rerun = yaml.safe_load((tmp_path / "a" / "searched-tiny" / "searched.yaml").read_text())
    assert rerun["search"] is None and rerun["candidates"][0]["name"] == "mixed"
    layers = doc["candidates"][0]["settings"].get("layers", {})
    rungs = {int(layer): rung for layer, rung in found["map"].items()}
    assert set(rungs) == set(range(5)) and set(rungs.values()) <= {"int2", "int8"}
    from kvquant.cache import build_cache
    built = build_cache([None] * 5, "int2", head_dim=8, residual_length=0, layers=layers)
    assert [layer.quantizer.name for layer in built.layers] == [rungs[i] for i in range(5)]
    # every layer is more sensitive at int2 than at int8 (where the increase is 0 by definition)
    assert all(s[0] > 0 and s[1] == 0 for s in found["sensitivity"].values())
    # the same config into another directory: the same map, the same steps checked
    path.write_text(CONFIG.format(out=tmp_path / "b"))
    main([str(path)])
    again = json.loads((tmp_path / "b" / "searched-tiny" / "results.json").read_text())["search"]
    assert again["map"] == found["map"] and again["checked"] == found["checked"]
    assert again["sensitivity"] == found["sensitivity"]


@pytest.mark.slow
def test_documents_0_gates_calibration_on_perplexity_alone_at_the_search_ratio(tmp_path, monkeypatch):
    """No task document is read before evaluation; the search's own perplexity ratio decides: loose enough, the
    cheapest map passes; at 1.0 (no loss allowed) int2 layers cannot, and the search climbs."""
    read_docs = []
    real_task = measure_module.run_task

    def spy_task(*args):
        if args[-1] is not None:  # named documents: the calibration split
            read_docs.append(list(args[-1]))
        return real_task(*args)

    monkeypatch.setattr(measure_module, "run_task", spy_task)
    path = tmp_path / "search.yaml"
    found = {}
    aliases = ["--set", "eval.tasks.names=[tinystories_lastword, arc_easy, arc_easy_local]"]  # no calibration docs
    for ratio in (1000.0, 1.0):
        path.write_text(CONFIG.format(out=tmp_path / str(ratio)))
        code = main([str(path), "--set", "search.documents=0", "--set", f"search.max_perplexity_ratio={ratio}",
                     *(aliases if ratio > 1 else [])])
        assert code in (0, 1, 4)  # the map found passes, fails or is undecided on evaluation; 2 would be an error
        doc = json.loads((tmp_path / str(ratio) / "searched-tiny" / "results.json").read_text())
        found[ratio] = doc["search"]
        assert "acc/tinystories_lastword" in doc["candidates"][0]["metrics"]  # tasks still gate the evaluation
    assert not read_docs  # the search read no task document
    loose, strict = found[1000.0], found[1.0]
    assert loose["calibration"]["tasks_gated"] is False and loose["calibration"]["documents"] == {}
    assert loose["calibration"]["max_perplexity_ratio"] == 1000.0
    assert loose["found"] and loose["step"] == 0 and set(loose["map"].values()) == {"int2"}
    assert all(set(c["metrics"]) == {"ppl/tinystories"} for c in loose["checked"])
    assert strict["step"] > 0 and "int8" in strict["map"].values()
    assert all(c["passed"] == (c["metrics"]["ppl/tinystories"] >= 1.0) for c in strict["checked"])


@pytest.mark.slow
def test_a_budget_takes_the_last_map_within_it_and_measures_it_on_calibration(tmp_path, capsys):
    """search.max_bits: the greedy order's last map at or under the budget; with two rungs and five equal layers
    step m has m layers at int8, so its bits are int2's plus m fifths of the difference."""
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    cfg = load_config(path)
    from kvquant.cache import simulate_memory
    from kvquant.scoring.models import check_model
    from kvquant.planner.shapes import shape_from_config
    shape = shape_from_config(check_model(cfg.model), cfg.model.path)
    low, high = (simulate_memory(shape.layout, {"quantizer": r.quantizer, **r.options}, batch=1,
                                 kv_heads=shape.kv_heads, head_dim=shape.head_dim, tokens=128,
                                 dtype=torch.float32)["bits_per_element"] for r in cfg.search.ladder)
    budget = low + 2.5 * (high - low) / 5  # between step 2 and step 3
    code = main([str(path), "--set", f"search.max_bits={budget}", "--set", "eval.memory_probe_tokens=128"])
    assert code in (0, 1, 4)  # 6 windows decide no pass (kvquant.runner.counts): the search is what is tested
    # the sensitivities show progress in a log too (stderr is not a terminal here), 5 layers x 1 rung
    err = capsys.readouterr().err
    assert "search: layer sensitivity: 100%" in err and "5/5" in err, err[-2000:]
    found = json.loads((tmp_path / "searched-tiny" / "results.json").read_text())["search"]
    assert found["max_bits"] == budget and found["step"] == 2
    assert list(found["map"].values()).count("int8") == 2
    [checked] = found["checked"]  # measured on calibration, once
    assert checked["step"] == 2 and checked["bits_per_element"] == pytest.approx(low + 2 * (high - low) / 5)
    assert found["found"] == checked["passed"]
    outcome = "passes" if checked["passed"] else "fails"
    assert (f"Budget: {budget:g} bits/element; step 2 of 5 is the last map within it, and it {outcome} the gate on "
            "the calibration split") in (tmp_path / "searched-tiny" / "report.md").read_text()


def test_a_budget_below_the_cheapest_map_is_refused_before_the_model_loads(tmp_path, capsys):
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    assert main([str(path), "--set", "search.max_bits=1.5"]) == 2
    err = capsys.readouterr().err
    assert "search.max_bits 1.5 is below the cheapest map: every layer at int2 takes" in err, err
    assert "Loading weights" not in err


@pytest.mark.parametrize("change", ["eval.tasks.limit=null", "eval.tasks.num_fewshot=2"])
def test_documents_0_allows_what_only_task_calibration_forbids(tmp_path, change):
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    with pytest.raises(ConfigError):
        load_config(path, [change])
    assert load_config(path, [change, "search.documents=0"]).search.documents == 0


@pytest.mark.parametrize("change, message", [
    ("eval.tasks.limit=null", "task 'tinystories_lastword' has no limit"),
    ("eval.perplexity.0.limit=null", "perplexity set 'tinystories' has no limit"),
    ("search.ladder=[{quantizer: int8}]", "ladder needs at least two settings"),
    ("search.name=baseline", "names must be unique and not 'baseline'"),
    ("search.ladder.0.options={layers: {0: {}}}", "'layers' is what the search decides"),
    ("search.ladder.1.options={pre_rope: true}", "pre_rope is for the whole cache"),
    ("eval.tasks.num_fewshot=2", "num_fewshot must be 0"),
    # calibration documents start at the limit, where the first sequential look would evaluate them
    ("gate.max_documents=400", "sequential looks would evaluate; drop one of them"),
    ("search.documents=1000000000", r"documents must be in 0\.\.100000"),
    ("search.documents=-1", r"documents must be in 0\.\.100000"),
    ("search.max_perplexity_ratio=0.9", "max_perplexity_ratio must be a finite number of at least 1.0"),
    ("search.name=search-1", "names starting with 'search-' are the search's own"),
    ("search.max_bits=0", "max_bits must be a finite number above 0"),
    ("search.max_bits=.nan", "max_bits must be a finite number"),
    ("search={ladder: [{quantizer: int2}, {quantizer: int8}], max_bits: 4.0, max_perplexity_ratio: 1.02}",
     "max_bits and max_perplexity_ratio choose the map two ways; set one"),
])
def test_bad_search_configs_are_one_line_errors(tmp_path, change, message):
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    with pytest.raises(ConfigError, match=message):
        load_config(path, [change])


def test_a_ladder_that_does_not_grow_in_bits_is_refused_before_the_model_loads(tmp_path, capsys):
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    code = main([str(path), "--set", "search.ladder=[{quantizer: int8, name: a}, {quantizer: int2, name: b}]"])
    assert code == 2
    assert "must grow in bits per element" in capsys.readouterr().err
    assert torch.is_tensor(torch.zeros(1))


@pytest.mark.parametrize("change, message", [
    ("eval.tasks.limit=495", "task 'tinystories_lastword' has 498 documents; evaluation reads 495 and calibration 16"),
    ("eval.perplexity.0.limit=1000", "no windows after the 1000 evaluation reads"),
    ("eval.tasks.names=[tinystories_lastword, arc_easy, arc_easy_local]", "'arc_easy' and 'arc_easy_local' read the "
     "same documents"),
    ("eval.tasks.names=[tinystories_lastword, passkey_64, passkey_064]",
     "'passkey_064': write passkey_64"),  # one spelling per probe: refused by name before the pair is compared
])
def test_a_split_that_cannot_be_held_apart_is_refused_before_the_model_loads(tmp_path, capsys, change, message):
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    code = main([str(path), "--set", change])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Loading weights" not in err


def test_the_task_size_check_calls_no_deprecated_lm_eval_loader(tmp_path, capsys):
    """Was: lm-eval's ``get_task_dict`` (deprecated for ``TaskManager.load``), a DeprecationWarning each run."""
    import warnings

    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([str(path), "--set", "eval.tasks.limit=495"]) == 2
    assert "task 'tinystories_lastword' has 498 documents" in capsys.readouterr().err
    assert not [w for w in caught if "TaskManager.load" in str(w.message)], [str(w.message) for w in caught]


def test_calibration_starts_after_what_any_set_of_the_same_text_evaluates(tmp_path):
    from kvquant.scoring.calibrate import calibration_windows
    from kvquant.scoring.models import load_tokenizer
    from kvquant.scoring import data
    text = CONFIG.replace("  tasks: {{names: [tinystories_lastword], limit: 20}}",
                          "    - {{name: longer, source: local:text/tinystories/validation-first1000.jsonl, limit: 12, "
                          "max_length: 128}}\n  tasks: {{names: [tinystories_lastword], limit: 20}}")
    path = tmp_path / "search.yaml"
    path.write_text(text.format(out=tmp_path))
    cfg = load_config(path, ["gate.perplexity=[tinystories]"])
    tok = load_tokenizer(cfg.model)
    rows = {p.name: data.load_rows(p) for p in cfg.eval.perplexity}
    start, windows = calibration_windows(cfg, tok, 2048, rows)["tinystories"]
    evaluated = {tuple(w.ids) for p in cfg.eval.perplexity for w in data.windows(p, tok, 2048, rows[p.name])}
    assert start == 12 and len(windows) == 4 and not evaluated & {tuple(w.ids) for w in windows}


@pytest.mark.slow
def test_a_gate_on_kl_divergence_gates_the_search_on_it_too(tmp_path):
    """With gate.max_kl_divergence the maps checked on the calibration split are measured and gated on KL too
    (before, the search gated them on perplexity alone and took the cheapest map at a loose ratio)."""
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path))
    code = main([str(path), "--set", "search.documents=0", "--set", "search.max_perplexity_ratio=1000",
                 "--set", "gate.max_kl_divergence=0.001"])
    assert code in (0, 1, 4)
    found = json.loads((tmp_path / "searched-tiny" / "results.json").read_text())["search"]
    assert all(set(c["metrics"]) == {"ppl/tinystories", "kl/tinystories"} for c in found["checked"])
    assert all(not c["passed"] for c in found["checked"] if c["metrics"]["kl/tinystories"] > 0.001)
    # at a ratio of 1000 every map passes on perplexity: a map below the one chosen failed on KL alone
    below = [c for c in found["checked"] if c["step"] < found["step"]]
    assert below and all(c["metrics"]["kl/tinystories"] > 0.001 and not c["passed"] for c in below)
    assert found["step"] > 0 and "int8" in found["map"].values()


@pytest.mark.parametrize("change, message", [
    # the long documents are cut from the rows whose windows after the limit the search calibrates on
    (["eval.long_context={text: tinystories, lengths: [64, 128], documents: 40}"],
     "search.windows: the calibration windows of perplexity set 'tinystories' (rows 7-10 of "),
    # the task's calibration documents (stories ~520-540) are evaluated by a perplexity set of 600 stories
    (["eval.perplexity=[{name: tinystories, source: local:text/tinystories/validation-first1000.jsonl, limit: 600, "
      "max_length: 64}, {name: wiki, source: local:text/wikitext-2-raw-v1/test-00000-of-00001.parquet, limit: 2, "
      "max_length: 64}]", "gate.perplexity=[wiki]"],
     "search.documents: task 'tinystories_lastword' documents 20-35 (rows "),
])
def test_a_search_split_that_is_evaluated_is_refused_before_the_model_loads(tmp_path, no_model_load, capsys,
                                                                            change, message):
    """Issue 58: the search's windows or task documents were evaluated by a long context or a perplexity set reading
    the same text (the map judged on the data it was chosen on); the run went ahead."""
    path = tmp_path / "search.yaml"
    path.write_text(CONFIG.format(out=tmp_path / "reports"))
    code = main([str(path), *[a for c in change for a in ("--set", c)]])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], (code, lines)
    assert "are evaluated too" in lines[0]
    assert not (tmp_path / "reports").exists()
