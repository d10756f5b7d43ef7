"""Shared few-shot prefixes: requests whose contexts begin with the same chunks (one few-shot prefix in front of
every document) prefill those chunks once, and every request scores exactly what it scores with nothing shared.

float64 copies of tiny models, as tests/test_evaluate.py: with one row per batch the shared and unshared scores
are equal bit for bit; batched, they differ by the float noise of other matmul shapes (compared to 1e-9)."""

import pytest
import torch
import transformers

import kvquant
from kvquant.scoring import scorer as scoring
from kvquant.scoring.prefixes import chunks_of, fed_tokens, kept_nodes, model_tokens, nested_order, shared_starts
from kvquant.scoring.scorer import Scorer


def test_starts_are_the_deepest_chunks_another_context_also_begins_with():
    a, b, c, d = [1, 2], [3, 4], [5, 6], [7]
    prefixes = [[a, b, c], [a, b, d], [a, c], [b, c], [a, b, c, d], [a, b, c, d]]
    starts = shared_starts(prefixes)
    # [a, b, c] is begun by three contexts (0, 4, 5), [a, b] by four, [a] by five; [b, c] by one only
    assert [(s.node.depth if s.node else 0, s.rest) for s in starts] == [
        (3, []), (2, [d]), (1, [c]), (0, [b, c]), (4, []), (4, [])]
    assert starts[0].node is starts[4].node.parent
    assert starts[1].node is starts[0].node.parent
    assert starts[0].node.path() == [a, b, c] and starts[4].node.path(starts[1].node) == [c, d]
    # each shared chunk is fed once: a, b, c, d (shared), then d (of 1), c (of 2), b, c (of 3)
    assert fed_tokens(prefixes) == 2 + 2 + 2 + 1 + 1 + 2 + 4
    assert fed_tokens([[a]]) == 2 and fed_tokens([]) == 0
    # nothing in common: every context starts fresh and is fed whole
    alone = shared_starts([[a, b], [b, a], []])
    assert [(s.node, s.rest) for s in alone] == [(None, [a, b]), (None, [b, a]), (None, [])]


def test_contexts_sharing_a_kept_node_come_one_after_another():
    a, x, y = [1], [2], [4]
    # 0 and 3 share [a, x], 2 and 4 share [a, y], both pairs share [a] (where their paths part), 1 shares nothing
    prefixes = [[a, x, [3]], [[9]], [a, y, [5]], [a, x, [6]], [a, y, [7]]]
    assert nested_order(shared_starts(prefixes)) == [0, 3, 2, 4, 1]
    assert nested_order(shared_starts([[a], [x], [y]])) == [0, 1, 2]  # no kept node: the order given
    assert nested_order(shared_starts([])) == []


@pytest.mark.parametrize("seed", range(20))
def test_nested_order_keeps_every_kept_nodes_contexts_together(seed):
    gen = torch.Generator().manual_seed(seed)
    prefixes = [[[int(t)] for t in torch.randint(0, 3, (int(torch.randint(0, 6, (1,), generator=gen)),),
                                                  generator=gen)] for _ in range(40)]
    starts = shared_starts(prefixes)
    order = nested_order(starts)
    assert sorted(order) == list(range(len(starts)))
    where = {i: p for p, i in enumerate(order)}
    for key, node in kept_nodes(starts).items():  # the contexts starting at or below a kept node: one run
        below = []
        for i, start in enumerate(starts):
            up = start.node
            while up is not None and id(up) != key:
                up = up.parent
            if up is not None:
                below.append(where[i])
        assert below and max(below) - min(below) == len(below) - 1, (seed, node.path())


def _model(sliding: int | None = None):
    if sliding:
        config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                            num_attention_heads=2, num_key_value_heads=1, sliding_window=sliding)
    else:  # head_dim 24: not a power of two
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().double()


def few_shot_requests(prefix: int = 29, documents: int = 7, seed: int = 11):
    """Like a fixed few-shot prompt: one ``prefix`` of tokens, then per document its own question (3 to 9 tokens)
    and 3 answers; document 0's prompt parts from the others' after 10 tokens (lm-eval's first_n leaves a document
    that is among the examples out of its own prompt), and document 1 is the prefix alone."""
    gen = torch.Generator().manual_seed(seed)
    shots = torch.randint(0, 64, (prefix,), generator=gen).tolist()
    out = []
    for doc in range(documents):
        question = torch.randint(0, 64, (3 + doc % 7,), generator=gen).tolist()
        context = shots[:10] + [(shots[10] + 1) % 64] + shots[11:] + question if doc == 0 else \
            shots if doc == 1 else shots + question
        for answer in range(3):
            out.append((context, torch.randint(0, 64, (1 + answer,), generator=gen).tolist()))
    return out


SETTINGS = {
    "fp16": ("fp16", {}),
    "int4-incomplete-groups": ("int4", {"group_size": 8, "residual_length": 0}),
    "int4-sinks-residual": ("int4", {"group_size": 8, "residual_length": 5, "sink_tokens": 2}),
    "int2": ("int2", {"group_size": 4, "residual_length": 0}),
    "fp8": ("fp8_e4m3", {"residual_length": 3}),
}


def _score(model, setting, requests, **kwargs):
    name, options = SETTINGS[setting]
    return Scorer(model, kvquant.CacheSpec.of(name, options), mode="streaming", **kwargs).score_many(requests)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("chunk", [4, 7])
def test_a_shared_prefix_scores_what_every_document_scores_alone(setting, chunk):
    model, requests = _model(), few_shot_requests()
    unshared = _score(model, setting, requests, chunk_size=chunk, batch_size=1, share_prefix=False)
    shared = _score(model, setting, requests, chunk_size=chunk, batch_size=1, share_prefix=True)
    for a, b in zip(unshared, shared):  # one row per batch: the same arithmetic, bit for bit
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.greedy, b.greedy)
    batched = _score(model, setting, requests, chunk_size=chunk, batch_size=5, share_prefix=True)
    for a, b in zip(unshared, batched):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)
    if setting != "fp16":  # the quantizer is read: these are not the baseline's scores
        baseline = _score(model, "fp16", requests, chunk_size=chunk, batch_size=1, share_prefix=False)
        assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(baseline, shared))


@pytest.mark.parametrize("chunk", [1, 3, 6])
def test_a_shared_prefix_on_a_sliding_window_model_shorter_than_the_prefix(chunk):
    model, requests = _model(sliding=6), few_shot_requests(prefix=17)
    unshared = _score(model, "int4-sinks-residual", requests, chunk_size=chunk, batch_size=1, share_prefix=False)
    batched = _score(model, "int4-sinks-residual", requests, chunk_size=chunk, batch_size=6, share_prefix=True)
    for a, b in zip(unshared, batched):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)


def test_the_shared_chunks_are_fed_once(monkeypatch):
    """The model is fed each shared chunk once: the prefix's whole chunks once for all documents, then each
    document's own tokens (what fed_tokens counts), then the scored tokens of every answer."""
    model, requests, chunk = _model(), few_shot_requests(), 4
    fed = []
    original = scoring._Batch.step
    monkeypatch.setattr(scoring._Batch, "step", lambda self, tokens, *args, **kwargs:
                        fed.append(sum(map(len, tokens))) or original(self, tokens, *args, **kwargs))
    name, options = SETTINGS["int4-incomplete-groups"]
    scorer = Scorer(model, kvquant.CacheSpec.of(name, options), mode="streaming", chunk_size=chunk, batch_size=4)
    scorer.score_many(requests)
    contexts = list(dict.fromkeys(tuple(c) for c, _ in requests))
    chunks = [chunks_of(list(c[:-1]), chunk) for c in contexts]
    scored = sum(len(a) for _, a in requests)  # the context's last token, then the answer less its last
    assert sum(fed) == scorer.tokens_fed == fed_tokens(chunks) + scored
    assert scorer.tokens_fed == model_tokens(requests, "streaming", chunk, True)
    # 28 prefix tokens (the context less its last token) are 7 whole chunks; document 0 shares the first 2 only
    assert fed_tokens(chunks) == sum(len(c) - 1 for c in contexts) - (len(contexts) - 2) * 28 - 8
    # unshared, and in simulated mode, the scorer's count is the plan's too
    for mode, share in (("streaming", False), ("simulated", True)):
        scorer = Scorer(model, kvquant.CacheSpec.of(name, options), mode=mode, chunk_size=chunk, batch_size=4,
                        share_prefix=share)
        scorer.score_many(requests)
        assert scorer.tokens_fed == model_tokens(requests, mode, chunk, share)
    assert model_tokens(requests, "streaming", chunk, False) == sum(len(c) + len(a) - 1 for c, a in requests)


def _documents(model, tokenizer, quantizer, share, shots=2, limit=8):
    """lm-eval's ARC-Easy (offline copy) with the first ``shots`` examples in front of every document, through
    the kvquant model in streaming mode: per document, its choices' log-likelihoods; and the scorer."""
    import lm_eval

    from kvquant.scoring.lm_eval_model import KVQuantLM
    from kvquant.scoring.task_setup import lm_eval_task
    from kvquant.scoring.tasks import task_dir

    options = {"group_size": 8, "residual_length": 0} if quantizer == "int4" else {}
    lm = KVQuantLM(model, tokenizer=tokenizer, quantizer=quantizer, mode="streaming", chunk_size=16, batch_size=1,
                   share_prefix=share, **options)
    task = lm_eval_task("arc_easy", task_dir(), "first_n")
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=shots, limit=limit, log_samples=True,
                                  bootstrap_iters=0, verbosity="ERROR", fewshot_random_seed=1234)
    samples = sorted(next(iter(out["samples"].values())), key=lambda s: s["doc_id"])
    return [[r[0] for r in s["resps"]] for s in samples], samples, lm.scorer


@pytest.mark.parametrize("quantizer", ["fp16", "int4"])
def test_lm_eval_first_n_examples_shared_score_what_each_document_scores_alone(model, tokenizer, quantizer):
    """A real task and tokenizer: lm-eval's ``first_n`` examples tokenize alike in front of every document, the
    shared prefill feeds far fewer tokens, and every choice's log-likelihood is the one scored with nothing shared
    (one row per batch: bit for bit)."""
    shared, samples, scorer = _documents(model, tokenizer, quantizer, True)
    alone, _, unshared = _documents(model, tokenizer, quantizer, False)
    assert shared == alone
    assert scorer.lengths == unshared.lengths and scorer.tokens_fed < unshared.tokens_fed / 2
    # the two examples are documents 0 and 1 of the test split (E0, E1), each left out of its own prompt (E2 in
    # its place); the others all begin E0, E1
    parts = [p.split("\n\n") for p in [s["arguments"][0][0] for s in samples]]
    e0, e1 = parts[2][:2]
    assert parts[0][0] == e1 and parts[1][0] == e0 and parts[0][1] == parts[1][1] not in (e0, e1)
    assert all(p[:2] == [e0, e1] for p in parts[2:]) and len({p[-1] for p in parts}) == len(parts)
    assert parts[0][-1].split("\nAnswer:")[0] == e0.split("\nAnswer:")[0]  # document 0 asks E0's question


def test_chunks_above_a_branch_are_fed_once(monkeypatch):
    """Contexts part after [1, 2], then each pair again after [3, 4] or [5, 6]: [1, 2] is nobody's start but the
    branch both pairs start below, so it is fed once (was: once per branch, and fed != model_tokens)."""
    model = _model()
    requests = [([1, 2, 3, 4, 9], [7]), ([1, 2, 3, 4, 10], [7]), ([1, 2, 5, 6, 9], [7]), ([1, 2, 5, 6, 10], [7])]
    steps = []
    original = scoring._Batch.step
    monkeypatch.setattr(scoring._Batch, "step", lambda self, tokens, *args, **kwargs:
                        steps.append(tokens) or original(self, tokens, *args, **kwargs))
    scorer = Scorer(model, kvquant.CacheSpec.of("int4", {"group_size": 2, "residual_length": 0}),
                    mode="streaming", chunk_size=2, batch_size=1)
    shared = scorer.score_many(requests)
    assert scorer.tokens_fed == model_tokens(requests, "streaming", 2, True) == 2 + 2 + 2 + 4
    assert steps[:3] == [[[1, 2]], [[3, 4]], [[5, 6]]] or steps[:3] == [[[1, 2]], [[5, 6]], [[3, 4]]]
    monkeypatch.undo()
    alone = Scorer(model, kvquant.CacheSpec.of("int4", {"group_size": 2, "residual_length": 0}), mode="streaming",
                   chunk_size=2, batch_size=1, share_prefix=False).score_many(requests)
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(shared, alone))


@pytest.mark.parametrize("documents", [10, 60])
def test_shared_caches_are_freed_once_their_last_context_has_copied_them(monkeypatch, documents):
    """Like WinoGrande with fixed examples: every document's two contexts share the examples and then the document's
    own chunks, and end in options of 2 and 5 tokens. The caches of shared chunks are dropped as soon as nothing
    still starts from them, and a document's contexts are scored together, so the caches alive at once do not grow
    with the documents (were all kept until the call returned; then, with contexts ordered by length alone, each
    document's cache lived until its other option came up: one per document)."""
    gen = torch.Generator().manual_seed(4)
    shots = torch.randint(0, 64, (12,), generator=gen).tolist()
    requests = []
    for _ in range(documents):
        own = torch.randint(0, 64, (8,), generator=gen).tolist()
        requests += [(shots + own + [0, 60], [5, 6]), (shots + own + [1, 61, 62, 63, 60], [5, 6])]
    alive, made = [], []

    class Counted(scoring._Nodes):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(self)

        def cache(self, node):
            out = super().cache(node)
            alive.append(len(self.built))
            return out

    monkeypatch.setattr(scoring, "_Nodes", Counted)
    spec = kvquant.CacheSpec.of("int4", {"group_size": 4, "residual_length": 0})
    scorer = Scorer(_model(), spec, mode="streaming", chunk_size=4, batch_size=4)
    shared = scorer.score_many(requests)
    assert len(made[0].kept) == documents + 1  # the examples' last chunk, then each document's own
    assert made[0].built == {} and max(alive) <= 4
    assert scorer.tokens_fed == model_tokens(requests, "streaming", 4, True)
    alone = Scorer(_model(), spec, mode="streaming", chunk_size=4, batch_size=1, share_prefix=False)
    for a, b in zip(alone.score_many(requests), shared):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-9)


def test_the_sampler_is_part_of_a_task_results_key(tiny_config, model):
    """A first_n result is never reused for a run with lm-eval's per-document draws, or the other way round (was:
    the key held the shots only)."""
    from kvquant.runner.expected import Expected

    keys = []
    for sampler in ("default", "first_n"):
        cfg = tiny_config("keys", candidates=[{"quantizer": "int8"}],
                          eval={"mode": "streaming", "tasks": {"names": ["arc_easy"], "limit": 4, "num_fewshot": 2,
                                                               "fewshot_sampler": sampler}})
        keys.append(Expected(cfg, model.config, 512).inputs("baseline", "task/arc_easy"))
    assert "fewshot_sampler" not in keys[0] and keys[1]["fewshot_sampler"] == "first_n"
    assert {k: v for k, v in keys[1].items() if k != "fewshot_sampler"} == keys[0]


@pytest.mark.parametrize("task", ["arc_easy", "hellaswag", "piqa"])
def test_first_n_leaves_a_document_out_of_its_own_examples(task):
    """The offline copies draw their examples from the evaluated split: the first documents are among the first
    examples, and each is left out of its own prompt (its question appears once, as the question), so every
    document's prompt asks it with the answer nowhere before."""
    from kvquant.scoring.task_setup import lm_eval_task
    from kvquant.scoring.tasks import task_dir

    found = lm_eval_task(task, task_dir(), "first_n")
    found.set_config(key="num_fewshot", value=3)
    found.set_fewshot_seed(seed=1234)
    found.build_all_requests(limit=6, rank=0, world_size=1)
    prompts = {i.doc_id: i.args[0] for i in found.instances}
    docs = list(found.eval_docs)
    assert len(prompts) == 6
    for doc_id, prompt in prompts.items():
        own = found.doc_to_text(docs[doc_id])
        assert prompt.count(own) == 1 and prompt.endswith(own), (task, doc_id)
    later = [p[: len(p) - len(found.doc_to_text(docs[d]))] for d, p in prompts.items() if d > 3]
    assert len(set(later)) == 1  # past the examples' pool, one prefix
