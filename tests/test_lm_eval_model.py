"""The lm-eval model ``kvquant`` scores requests through the quantized cache."""

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

from kvquant.scoring.lm_eval_model import KVQuantLM  # importing it registers the lm-eval model "kvquant"
from kvquant.paths import resolve
from kvquant.scoring.tasks import LASTWORD, task_manager


def request(context, continuation, kind="loglikelihood"):
    return Instance(request_type=kind, doc={}, arguments=(context, continuation), idx=0)


@pytest.fixture(scope="module")
def make_lm(model, tokenizer):
    return lambda quantizer, **kw: KVQuantLM(model, tokenizer=tokenizer, quantizer=quantizer, **kw)


@pytest.fixture(scope="module")
def req(stories):
    text = stories[3]
    cut = text.rfind(" ")
    return request(text[:cut], text[cut:])


def test_registered_by_import():
    assert get_model("kvquant") is KVQuantLM
    assert get_model("hf").__name__ == "HFLM"  # lm-eval's own models are still found


def test_fp16_matches_plain_transformers(make_lm, req, model, tokenizer):
    (logprob, greedy), = make_lm("fp16").loglikelihood([req])
    context, continuation = req.args
    whole = tokenizer(context + continuation).input_ids
    n_ctx = len(tokenizer(context).input_ids)
    with torch.no_grad():  # simulated mode writes the whole request, as a plain forward over it does
        logits = model(torch.tensor([whole])).logits[0, n_ctx - 1 : -1]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(whole[n_ctx:])[:, None]).double().sum()
    assert logprob == float(expected)
    assert greedy == bool((logits.argmax(-1) == torch.tensor(whole[n_ctx:])).all())


@pytest.mark.parametrize("mode", ["simulated", "streaming"])
def test_int2_differs_from_fp16(make_lm, req, mode):
    fp16 = make_lm("fp16", mode=mode).loglikelihood([req])[0][0]
    int8 = make_lm("int8", mode=mode, residual_length=0, group_size=32).loglikelihood([req])[0][0]
    int2 = make_lm("int2", mode=mode, residual_length=0).loglikelihood([req])[0][0]
    assert int2 != fp16
    assert abs(int2 - fp16) > abs(int8 - fp16)


def test_streaming_fp16_equals_simulated_fp16(make_lm, req):
    sim = make_lm("fp16").loglikelihood([req])[0][0]
    streamed = make_lm("fp16", mode="streaming", chunk_size=5).loglikelihood([req])[0][0]
    assert streamed == pytest.approx(sim, abs=1e-4)


def test_rolling_and_generation(make_lm, stories):
    lm = make_lm("int4", residual_length=0)
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (stories[0][:300],), 0)])
    assert total < 0
    request = Instance("generate_until", {}, ("Once upon a time", {"until": ["."], "max_gen_toks": 30}), 0)
    (text,) = lm.generate_until([request])
    assert text and "." not in text


def test_simple_evaluate_by_name():
    path = resolve("local:models/stories260K/hf")
    out = lm_eval.simple_evaluate(model="kvquant", model_args=f"pretrained={path},quantizer=int4,residual_length=0",
                                  tasks=[LASTWORD], limit=8, task_manager=task_manager(), bootstrap_iters=0,
                                  verbosity="ERROR")
    assert 0 <= out["results"][LASTWORD]["acc,none"] <= 1
    assert len(out["samples"][LASTWORD]) == 8


def test_import_kvquant_does_not_import_lm_eval():
    """The library is usable without lm-eval's import cost (seconds) or its side effects; the lm-eval model is
    registered where lm-eval is used (importing kvquant.scoring.lm_eval_model), with lm-eval's own models kept."""
    import subprocess
    import sys

    code = ("import sys, kvquant; assert 'lm_eval' not in sys.modules, 'lm_eval imported'; "
            "import kvquant.scoring.lm_eval_model; from lm_eval.api.registry import model_registry; "
            "assert {'kvquant', 'hf', 'dummy'} <= set(model_registry), sorted(model_registry)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
