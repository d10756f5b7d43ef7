"""Issue 36's remaining gaps: make_cache checks the shapes the model writes (A44, A46) and vllm_fp8's per-head
scales against the model's KV heads (A57); passkey task names (G17, G18); a relative ``KVQUANT_CACHE_DIR``
(E40); a shot count set in an lm-eval task YAML; deeply nested task JSON; stray dotfiles in ``partial/``."""

import re

import pytest
import torch
import transformers
import yaml

import kvquant
from kvquant.cache.build import written_shapes
from kvquant.errors import KVQuantError

SMALL = dict(vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
LLAMA = dict(hidden_size=256, num_key_value_heads=2, head_dim=64)


def tiny(config_class: str = "LlamaConfig", **options) -> torch.nn.Module:
    """A small random decoder (a Llama of 2 KV heads of head_dim 64 by default)."""
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SMALL, **(LLAMA if config_class == "LlamaConfig" else {}),
                                                     **options})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def llama():
    return tiny()


# --- A44, A46: a cache made for a model refuses states of another shape at a layer's first update --------------


@pytest.mark.parametrize("shape, what", [((1, 2, 4, 32), "head_dim 32"), ((1, 3, 4, 64), "3 heads"),
                                         ((1, 1, 4, 64), "1 heads")])
@pytest.mark.parametrize("quantizer", ["int4", "llamacpp_q4_0", "fp16"])
def test_first_update_of_another_shape_is_refused(llama, shape, what, quantizer):
    cache = kvquant.make_cache(llama, quantizer)
    states = torch.randn(shape)
    with pytest.raises(KVQuantError, match=rf"update\(layer_idx=1\): keys have shape {re.escape(str(shape))}.*{what}.*"
                                           r"layer 1 of the model .* writes \[batch, 2, tokens, 64\]"):
        cache.update(states, states, 1)
    assert not cache.layers[1].is_initialized  # nothing stored


def test_values_of_another_shape_are_refused_too(llama):
    cache = kvquant.make_cache(llama, "int4")
    with pytest.raises(KVQuantError, match=r"values have shape \(1, 2, 4, 32\)"):
        cache.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 32), 0)


def test_the_model_own_shapes_pass_and_its_forward_runs(llama):
    cache = kvquant.make_cache(llama, "int4", residual_length=0)
    assert [layer.expected for layer in cache.layers] == [((2, 64), (2, 64))] * 2
    with torch.no_grad():
        logits = llama(torch.randint(0, 100, (2, 40)), cache=cache, use_cache=True).logits
    assert torch.isfinite(logits).all() and cache.get_seq_length() == 40
    other = tiny(num_key_value_heads=4)  # a cache made for one model, given to another: refused at its first write
    with pytest.raises(KVQuantError, match=r"layer_idx=0\): keys have shape \(1, 4, 5, 64\)"):
        other(torch.randint(0, 100, (1, 5)), cache=kvquant.make_cache(llama, "int4"), use_cache=True)


def test_layers_of_several_shapes_each_checked_against_their_own():
    """Gemma 4's full-attention layers have a head_dim and KV heads of their own (transformers' per-layer config);
    with attention_k_eq_v they have no v_proj (values are the keys), so only their keys' shape is read."""
    model = tiny("Gemma4TextConfig", num_key_value_heads=2, head_dim=16,
                 global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
                 num_hidden_layers=6, hidden_size_per_layer_input=8, vocab_size_per_layer_input=100)
    shapes = written_shapes(model)
    kinds = model.config.layer_types
    assert {kinds[i]: shapes[i] for i in range(6)} == {"sliding_attention": ((2, 16), (2, 16)),
                                                       "full_attention": ((1, 32), None)}
    with torch.no_grad():  # its own forward passes the checks
        model(torch.randint(0, 100, (1, 12)), cache=kvquant.make_cache(model, "int8"), use_cache=True)
    full = kinds.index("full_attention")
    with pytest.raises(KVQuantError, match=rf"layer {full} of the model .* writes \[batch, 1, tokens, 32\]"):
        kvquant.make_cache(model, "int8").update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), full)


@pytest.mark.parametrize("config_class, options", [
    ("FalconConfig", dict(multi_query=True)),  # fused QKV (and 1 KV head where get_head_shapes reads 4): not read
    ("MiMoV2FlashConfig", dict(num_key_value_heads=2, head_dim=24, v_head_dim=16)),  # keys, values of two sizes
])
def test_models_whose_shapes_are_not_read_are_not_checked(config_class, options):
    """Where the config and the layer's own projections do not both give the shape, nothing is checked (a config
    can say otherwise than the model writes: Falcon's multi_query), so the model's own forward still runs."""
    model = tiny(config_class, **options)
    assert written_shapes(model) == {}
    with torch.no_grad():
        logits = model(torch.randint(0, 100, (1, 9)), cache=kvquant.make_cache(model, "int8"), use_cache=True).logits
    assert torch.isfinite(logits).all()


# --- A57: vllm_fp8's per-head scales of the wrong count are refused by make_cache(model) -----------------------


@pytest.mark.parametrize("options, field, count", [(dict(k_scale=[1.0, 2.0, 3.0]), "k_scale", 3),
                                                   (dict(v_scale=[0.5]), "v_scale", 1),
                                                   (dict(layers={1: {"k_scale": [1.0] * 4}}), "k_scale", 4)])
def test_vllm_fp8_per_head_scales_of_another_count_refused_by_make_cache(llama, options, field, count):
    layer = 1 if "layers" in options else 0
    with pytest.raises(KVQuantError, match=rf"make_cache: layer {layer}: vllm_fp8: {field} has {count} per-head "
                                           r"scales for a layer of 2 KV heads"):
        kvquant.make_cache(llama, "vllm_fp8", **options)


def test_vllm_fp8_per_head_scales_of_the_right_count_store_per_head(llama):
    cache = kvquant.make_cache(llama, "vllm_fp8", k_scale=[1.0, 0.25], v_scale=0.5)
    keys = torch.full((1, 2, 3, 64), 120.0)
    out, _ = cache.update(keys, keys, 0)
    assert (out[0, 0] == 120.0).all() and (out[0, 1] == 112.0).all()  # head 1: 480 saturates at 448, times 0.25


# --- G17, G18: passkey task names -----------------------------------------------------------------------------


@pytest.fixture
def short_filler(monkeypatch):
    """The probe's filler cut to WikiText-2's first 40,000 characters (tokenizing all of it takes seconds)."""
    from kvquant.scoring import passkey as probe

    text = probe._filler_text()[:40_000]
    probe._filler.cache_clear()
    monkeypatch.setattr(probe, "_filler_text", lambda: text)
    yield
    probe._filler.cache_clear()


def test_a_probe_too_short_for_the_tokenizer_names_the_shortest_that_works(tokenizer, short_filler):
    """passkey_32 was documented (any D >= 32) and refused without saying what would work."""
    from kvquant.scoring.passkey import probe_documents

    with pytest.raises(KVQuantError, match=r"probe distance 32 is shorter .*\(46 tokens with this tokenizer.*the "
                                           r"shortest distance this tokenizer allows is 46 \(passkey_46\)$"):
        probe_documents(tokenizer, [32], 50)
    docs = probe_documents(tokenizer, [46], 50)  # the one it names works, for as many documents
    assert len(docs) == 50 and {d["distance"] for d in docs} == {46}
    with pytest.raises(KVQuantError, match=r"allows is 46 \(passkey_46\)"):
        probe_documents(tokenizer, [45], 50)


def test_the_runner_names_the_shortest_probe_before_loading(no_model_load, short_filler, tmp_path, capsys):
    import kvquant.run

    cfg = tmp_path / "probe.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "probe", "output_dir": str(tmp_path / "reports"), "model": {"path": "local:models/stories260K/hf"},
        "candidates": [{"quantizer": "int8"}], "eval": {"tasks": {"names": ["passkey_32"], "limit": 2}},
        "gate": {"tasks": ["passkey_32"]}}))
    assert kvquant.run.main([str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvquant: error: eval.tasks.names: probe distance 32 is shorter") and "\n" not in err
    assert err.endswith("the shortest distance this tokenizer allows is 46 (passkey_46)")
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("names, needle", [
    (["passkey_64", "passkey_0064"], "'passkey_0064': write passkey_64 (a distance without leading zeros"),
    (["passkey_064"], "'passkey_064': write passkey_64"),
])
def test_a_probe_has_one_spelling(names, needle):
    """passkey_64 and passkey_0064 were both accepted: one probe measured and gated twice under two names."""
    from kvquant.scoring.tasks import check_tasks

    with pytest.raises(KVQuantError, match=re.escape(f"eval.tasks.names: {needle}")):
        check_tasks(names, "eval.tasks.names")
    check_tasks(["passkey_64", "passkey_100"], "eval.tasks.names")  # the canonical names pass


def test_lm_eval_refuses_a_second_spelling_of_a_probe_before_loading(no_model_load, capsys, monkeypatch):
    import sys

    from kvquant import lm_eval as lm_eval_cli
    from kvquant.paths import resolve

    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    model = resolve("local:models/stories260K/hf")
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args", f"pretrained={model}", "--tasks",
                             "passkey_64,passkey_0064", "--limit", "2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("kvquant: error: --tasks: 'passkey_0064': write passkey_64 (a distance "
                                 "without leading zeros: one spelling per probe, so none is measured and gated twice)")


# --- E40: a relative KVQUANT_CACHE_DIR (or task or kernel folder) is refused, and nothing is created --------------


def tiny_config(tmp_path, tasks=("tinystories_lastword",)) -> str:
    """A runner config of the toy model scoring ``tasks``; its reports go under ``tmp_path/reports``."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({
        "name": "gaps", "output_dir": str(tmp_path / "reports"), "model": {"path": "local:models/stories260K/hf"},
        "candidates": [{"quantizer": "int8"}], "eval": {"tasks": {"names": list(tasks), "limit": 2}},
        "gate": {"tasks": list(tasks)}}))
    return str(cfg)


@pytest.mark.parametrize("variable", ["KVQUANT_CACHE_DIR", "KVQUANT_TASK_DIR"])
def test_a_relative_private_folder_is_refused_and_nothing_created(no_model_load, tmp_path, monkeypatch, capsys,
                                                                  variable):
    """Was: ``KVQUANT_CACHE_DIR=relative/dir`` created relative/dir/... under the working directory on exit 2."""
    import kvquant.run

    cfg = tiny_config(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv(variable, "relative/dir")
    assert kvquant.run.main([cfg]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"kvquant: error: ${variable}: 'relative/dir' is a relative path; set an absolute one (a private "
                   "folder of kvquant must not depend on the folder you run from)")
    assert list(work.iterdir()) == []


def test_a_relative_kernel_folder_is_refused_where_it_is_read(tmp_path, monkeypatch):
    from kvquant.fs import cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVQUANT_KERNEL_DIR", "kernels")
    with pytest.raises(KVQuantError, match=r"^\$KVQUANT_KERNEL_DIR: 'kernels' is a relative path"):
        cache_dir("kernels", env="KVQUANT_KERNEL_DIR")
    monkeypatch.setenv("KVQUANT_KERNEL_DIR", str(tmp_path / "absolute"))  # absolute (and ~/...) are used as given
    assert cache_dir("kernels", env="KVQUANT_KERNEL_DIR") == tmp_path / "absolute"
    assert [p.name for p in tmp_path.iterdir()] == ["absolute"]


# --- a shot count a task's own YAML sets (lm-eval without --num_fewshot) ---------------------------------------


def task_yaml(folder, shots, text: str = "Once upon a time there was a cat who liked to nap in the sun. " * 3):
    """A user task (``mytask``) of 8 stories that sets ``num_fewshot: shots`` in its own YAML."""
    import json

    data = folder / "mytask.jsonl"
    data.write_text("".join(json.dumps({"context": f"{text} Story {i}.", "target": " end"}) + "\n" for i in range(8)))
    (folder / "mytask.yaml").write_text(yaml.safe_dump({
        "task": "mytask", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "fewshot_split": "test", "output_type": "loglikelihood", "doc_to_text": "{{context}}",
        "doc_to_target": "{{target}}", "num_fewshot": shots,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    return folder / "mytask.yaml"


def run_lm_eval(monkeypatch, capsys, *args) -> tuple[int, list[str], str]:
    """kvquant.lm_eval with the toy model, in process: its exit code, its own lines and all of stderr and stdout."""
    import logging
    import sys

    from kvquant import lm_eval as lm_eval_cli
    from kvquant.paths import resolve

    monkeypatch.setattr(sys, "argv", ["kvquant.lm_eval"])
    monkeypatch.setattr(logging, "raiseExceptions", False)  # lm-eval's handler may hold an earlier closed stderr
    code = lm_eval_cli.main(["--model", "kvquant", "--model_args",
                             f"pretrained={resolve('local:models/stories260K/hf')},max_length=64", *args])
    captured = capsys.readouterr()
    ours = [line for line in captured.err.splitlines() if line.startswith("kvquant: ")]
    return code, ours, captured.err + captured.out


class FakeTask:
    """What :func:`kvquant.scoring.fewshot.note_tasks` reads of an lm-eval task."""

    def __init__(self, name, shots):
        self.config, self.shots = type("Config", (), {"task": name})(), shots

    def get_config(self, key):
        return self.shots if key == "num_fewshot" else None


@pytest.mark.parametrize("shots", [101, 10**6, "5", True, -1])
def test_a_task_file_shot_count_beyond_the_bound_is_refused(shots):
    from kvquant.scoring import fewshot

    try:
        said = re.escape(repr(shots))
        with pytest.raises(KVQuantError, match=rf"^task 'mytask': its task file sets num_fewshot: {said}; kvquant's "
                                               r"bound is a whole number in 0\.\.100"):
            fewshot.note_tasks({"mytask": FakeTask("mytask", shots)})
        fewshot.note_tasks({"a": FakeTask("a", 3), "b": FakeTask("b", None), "c": FakeTask("c", 100)})
        assert fewshot._task_shots == {"a": 3, "c": 100}
    finally:
        fewshot.expect(None)
    assert fewshot._task_shots == {}


@pytest.mark.slow
def test_shots_a_task_file_sets_must_fit_the_model_before_any_request_is_scored(tmp_path, monkeypatch, capsys):
    """Was: lm-eval ran the task file's 5 shots unchecked, the contexts cut to the model's 64 tokens while its
    results said 5-shot."""
    monkeypatch.setattr("kvquant.scoring.scorer.Scorer.score_many", lambda *a, **k: pytest.fail("a request was scored"))
    code, ours, text = run_lm_eval(monkeypatch, capsys, "--tasks", str(task_yaml(tmp_path, 5)), "--limit", "2")
    assert code == 2 and len(ours) == 1 and "Traceback" not in text, text[-3000:]
    assert ours[0].startswith("kvquant: error: num_fewshot (its task file's): task 'mytask' with 5 few-shot "
                              "examples needs contexts of up to") and "the model's context is 64" in ours[0], ours


@pytest.mark.slow
def test_the_flag_still_overrides_a_task_file(tmp_path, monkeypatch, capsys):
    from kvquant.scoring import fewshot

    yaml_path = str(task_yaml(tmp_path, 5))
    code, ours, text = run_lm_eval(monkeypatch, capsys, "--tasks", yaml_path, "--limit", "2", "--num_fewshot", "0")
    assert code == 0 and ours == [] and "|mytask|" in text.replace(" ", ""), text[-3000:]
    assert fewshot._task_shots == {}  # forgotten after the command


def test_the_model_checks_each_task_with_the_shots_its_file_set(tokenizer):
    """:func:`kvquant.scoring.fewshot.check_requests` reads each task's own count (as lm-eval settled it), not one
    for all."""
    from lm_eval.api.instance import Instance

    from kvquant.scoring import fewshot

    story = "Once upon a time there was a little girl who liked to play in the park with her dog. " * 4
    requests = [Instance("loglikelihood", {}, (story, " end"), 0, (task, 0, 1)) for task in ("zero", "some")]
    encode = fewshot.counter(tokenizer)
    try:
        fewshot.note_tasks({"zero": FakeTask("zero", 0), "some": FakeTask("some", 1)})
        fewshot.check_requests(requests[:1], encode, 0, 64)  # zero-shot: cut to the context as lm-eval's models do
        fewshot.check_requests(requests[1:], encode, 0, 512)  # fits
        with pytest.raises(KVQuantError, match=r"^num_fewshot \(its task file's\): task 'some' with 1 few-shot"):
            fewshot.check_requests(requests, encode, 0, 64)
    finally:
        fewshot.expect(None)


# --- JSON nested too deeply in the stories the last-word task is written from ----------------------------------


@pytest.mark.parametrize("line, needle", [
    ('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 1: JSON nested too deeply to read"),
    ('{"text": "cut', "line 1: not valid JSON"),
    ('{"story": "a"}', "line 1: "),
])
def test_stories_python_cannot_read_are_one_line(tmp_path, monkeypatch, line, needle):
    """Was: tasks.py read these with a bare json.loads (RecursionError, KeyError: exit 3), for any task list."""
    from kvquant.scoring import tasks

    source = tmp_path / "data" / tasks.LASTWORD_SOURCE
    source.parent.mkdir(parents=True)
    source.write_text(line + "\n")
    monkeypatch.setenv("KVQUANT_DATA", str(tmp_path / "data"))
    with pytest.raises(KVQuantError, match=re.escape(f"{source}, {needle}")):
        tasks.write_task_dir(tmp_path / "tasks")


# --- stray dotfiles in a report's partial/ ---------------------------------------------------------------------


def test_stray_dotfiles_in_partial_are_left_alone_but_kvquant_names_are_still_checked(tmp_path):
    """Was: a ``.DS_Store`` in ``partial/`` refused every rerun ("holds one folder per candidate")."""
    import os

    from kvquant.runner.store import check_partial

    partial = tmp_path / "partial"
    (partial / "int8").mkdir(parents=True)
    (partial / "int8" / "ppl__tinystories.json").write_text("{}")
    (partial / ".DS_Store").write_bytes(b"\0")
    (partial / ".nfs0000123").write_text("x")
    (partial / ".trash").mkdir()
    os.mkfifo(partial / ".fifo")
    (partial / ".link").symlink_to(tmp_path)
    (partial / "int8" / ".ppl__tinystories.json.swp").write_text("x")
    (partial / "int8" / ".editor.json").mkdir()
    check_partial(partial)  # none of them is a name kvquant writes
    (partial / "int8" / "memory.json").mkdir()
    with pytest.raises(KVQuantError, match="int8/memory.json is a folder, not a result kvquant wrote"):
        check_partial(partial)
    (partial / "int8" / "memory.json").rmdir()
    (partial / "int4").symlink_to(tmp_path)
    with pytest.raises(KVQuantError, match="partial/int4 is a symlink"):
        check_partial(partial)
