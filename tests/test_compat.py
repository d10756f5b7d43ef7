"""kvquant/compat: each private symbol of transformers or lm-eval kvquant relies on is still there with the shape
kvquant relies on, each wrapper returns the right value on a real object, and no other kvquant module names them."""

import argparse
import functools
import inspect
import re
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from transformers.cache_utils import DynamicCache, QuantizedCache

from kvquant.cache import stored_bytes
from kvquant.compat import lm_eval as lm_eval_compat
from kvquant.compat.transformers import (attn_implementation, quantized_tensors, recording_attentions,
    tensor_parallel_size)

KVQUANT = Path(__file__).parent.parent / "kvquant"
#: each private name kvquant relies on, as a regex: attributes kvquant also spells for its own functions
#: (``storage._rank``) only as attributes
PRIVATE = [rf"(?<!\w){name}\b" for name in (
    "_attn_implementation", "_active_collector", "output_capturing", "_tp_size", "_quantized_keys",
    "_quantized_values", "_yaml_loader", "_Base", "_cli", "_subparsers", "_actions", "_int_or_none_list_arg_type",
    "get_git_commit_hash", "get_commit_from_path",
    # public, but transformers' modelling internals a pre-RoPE cache reads (kvquant/compat/rope.py)
    "rotary_emb", "rope_parameters")
] + [r"\._rank\b", r"\._world_size\b"]


def tiny_model(attention: str = "eager"):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()


def test_attn_implementation_reads_what_set_attn_implementation_set():
    assert isinstance(inspect.getattr_static(transformers.PretrainedConfig, "_attn_implementation"), property)
    assert attn_implementation(transformers.LlamaConfig()) is None
    model = tiny_model("eager")
    assert attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")
    assert attn_implementation(model.config) == "sdpa"
    assert attn_implementation(object()) is None  # kvquant.cache.fused.is_fused asks any config


def test_recording_attentions_is_true_only_inside_a_forward_that_collects_attentions():
    from transformers.utils.output_capturing import _active_collector

    assert _active_collector.get() is None and recording_attentions() is False
    model, seen = tiny_model("eager"), []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda module, args: seen.append(recording_attentions()))
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        plain = model(ids)
        collected = model(ids, output_attentions=True)
    assert plain.attentions is None and len(collected.attentions) == 2
    assert seen == [False, True]
    assert recording_attentions() is False


def test_tensor_parallel_size_is_what_transformers_reads_as_tp_size():
    model = tiny_model()
    assert model._tp_size is None and model.tp_size is None
    assert tensor_parallel_size(model) == 1
    model._tp_size = 2
    assert model.tp_size == 2 and tensor_parallel_size(model) == 2
    assert tensor_parallel_size(model.config) == 1


def test_quantized_tensors_are_the_codes_a_quantized_cache_holds():
    model = tiny_model()
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 8, 4, 6, 10]])
    quantized, plain = QuantizedCache("fp8", config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=quantized, use_cache=True)
        model(ids, cache=plain, use_cache=True)
    total = 0
    for layer, reference in zip(quantized.layers, plain.layers):
        for (codes, scale), states in zip(quantized_tensors(layer), (reference.keys, reference.values)):
            assert codes.dtype == torch.float8_e4m3fn and codes.shape == (1, 2, 10, 32)
            torch.testing.assert_close(codes.float() * scale, states, atol=0.07 * states.abs().max(), rtol=0)
            total += codes.numel() * codes.element_size() + scale.numel() * scale.element_size()
        assert layer.keys.numel() == 0  # fp8 keeps nothing unquantized: its codes are all it stores
    assert stored_bytes(quantized) == total
    assert quantized_tensors(plain.layers[0]) == (None, None)


def test_yaml_base_loader_is_the_safe_base_of_lm_eval_task_loaders():
    from lm_eval.tasks import _yaml_loader

    base = lm_eval_compat.yaml_base_loader()
    assert issubclass(_yaml_loader._make_loader(Path("."), resolve_funcs=False), base)
    functions = []

    class Recording(base):
        pass

    Recording.add_constructor("!function", lambda loader, node: functions.append(loader.construct_scalar(node)))
    doc = yaml.load("include: base.yaml\ndoc_to_text: !function utils.doc_to_text\n", Loader=Recording)  # noqa: S506
    assert doc == {"include": "base.yaml", "doc_to_text": None} and functions == ["utils.doc_to_text"]
    with pytest.raises(yaml.constructor.ConstructorError):
        yaml.load("!!python/object/apply:os.getcwd []", Loader=Recording)  # noqa: S506


def test_run_parser_is_a_fresh_lm_eval_run_parser_with_the_flags_kvquant_reads():
    parser = lm_eval_compat.run_parser()
    assert isinstance(parser, argparse.ArgumentParser) and lm_eval_compat.run_parser() is not parser
    flags = parser.parse_args(["--model", "hf", "--tasks", "a,b", "--lim", "3", "--num_fewshot", "2",
                               "--max_batch_size", "8", "--seed", "5", "--config", "c.yaml"])
    assert (flags.model, flags.tasks, flags.limit, flags.num_fewshot, flags.max_batch_size, flags.seed,
            flags.config) == ("hf", ["a", "b"], 3.0, 2, 8, [5, 5, 5, 5], "c.yaml")


def test_parser_actions_are_the_actions_the_parser_reads_its_flags_with():
    parser = lm_eval_compat.run_parser()
    actions = {action.dest: action for action in lm_eval_compat.parser_actions(parser)}
    assert {"limit", "num_fewshot", "max_batch_size", "seed", "config"} <= set(actions)
    actions["limit"].type = None  # as kvquant.lm_eval does: the flag's text is kept
    assert parser.parse_args(["--model", "hf", "--limit", "0.5x"]).limit == "0.5x"


def test_int_or_none_list_reads_seeds_as_lm_evals_seed_flag_does():
    read = lm_eval_compat.int_or_none_list
    assert read(3, 4, "0,1234,1234,1234", "1,None,3,4") == [1, None, 3, 4]
    assert read(3, 4, "0,1234,1234,1234", "7") == [7, 7, 7, 7]
    assert read(3, 4, "0,1234,1234,1234", "1,2,3") == [1, 2, 3, 1234]
    with pytest.raises(ValueError, match="x is not an integer or None"):
        read(3, 4, "0,1234,1234,1234", "1,x,3,4")
    seed = next(a for a in lm_eval_compat.parser_actions(lm_eval_compat.run_parser()) if a.dest == "seed")
    from lm_eval._cli.utils import _int_or_none_list_arg_type
    assert isinstance(seed.type, functools.partial) and seed.type.func is _int_or_none_list_arg_type
    assert seed.type.args == (3, 4, "0,1234,1234,1234")  # the arguments kvquant.lm_eval.check_seed passes


def test_set_rank_makes_an_lm_eval_model_one_of_several_processes():
    from lm_eval.models.dummy import DummyLM

    lm = DummyLM()
    assert (lm.rank, lm.world_size) == (0, 1) and {"_rank", "_world_size"} <= set(vars(lm))
    lm_eval_compat.set_rank(lm, 2, 4)
    assert (lm.rank, lm.world_size) == (2, 4)


def test_kvquant_lm_implements_the_abstract_loglikelihood_tokens_of_template_lm():
    from lm_eval.api.model import TemplateLM

    from kvquant.scoring.lm_eval_model import KVQuantLM

    assert "_loglikelihood_tokens" in TemplateLM.__abstractmethods__
    assert not KVQuantLM.__abstractmethods__


def test_no_module_outside_compat_names_a_private_symbol():
    compat = sorted((KVQUANT / "compat").glob("*.py"))
    others = [p for p in sorted(KVQUANT.rglob("*.py")) if (KVQUANT / "compat") not in p.parents]
    assert len(compat) == 4 and len(others) > 50
    compat_text = "\n".join(p.read_text() for p in compat)
    for pattern in PRIVATE:  # each pattern finds its use in compat, so a miss elsewhere means something
        assert re.search(pattern, compat_text), pattern
    found = [f"{path.relative_to(KVQUANT.parent)}:{number}: {line.strip()}"
             for path in others for number, line in enumerate(path.read_text().splitlines(), 1)
             if any(re.search(pattern, line) for pattern in PRIVATE)]  # kvquant's own _kvquant_* never match
    assert not found, "private transformers / lm-eval names outside kvquant/compat:\n" + "\n".join(found)
