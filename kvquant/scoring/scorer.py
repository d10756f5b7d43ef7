"""Scoring text through a quantized cache: every log-probability here comes from attention reading the
quantized K/V, in one of two modes (see ``docs/measurement.md``):

- ``simulated``: one forward pass over the whole sequence with a fresh cache; K/V are quantized as they are
  written and attention reads the dequantized states in the same pass (as in KIVI/KVQuant's perplexity: the
  last token is written too, so its key shares its group's scale).
- ``streaming``: the context is fed ``chunk_size`` tokens at a time, then the scored tokens, each chunk
  attending to what the cache stored for the earlier ones (``chunk_size=1`` is token-by-token decoding).

Requests are scored in batches of up to ``batch_size`` rows. Each row is its own sequence: the cache stores rows
apart and is told which positions are padding (``KVQuantCache.set_padding``), so a row in a batch computes what
it computes alone (up to float noise of batched matmuls). In streaming mode, requests that share a context (the
choices of a multiple-choice question) prefill it once; each continuation's row then starts from a copy of the
context's cached row (``stack_rows``), which is exactly what it would have stored after the same context chunks.
Contexts are prefilled in batches of similar context lengths and continuations run in batches of similar
continuation lengths, so little is padded; only the scored positions are projected onto the vocabulary.
Simulated mode writes context and continuation in one pass, so it has nothing to share.

Under several processes (:mod:`kvquant.scoring.parallel`) every process is handed the same requests; each scores every
``world``-th group of them (longest first, so the shares cost alike) and the results are gathered, so each process
returns all of them, as one process would. A request's log-probabilities equal one process's exactly when it is
scored alone (``batch_size`` 1) with the same thread count; in batches, the rows that share its batch differ, which
moves them by float rounding (see ``docs/parallel.md``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from tqdm import tqdm

from kvquant.cache import CacheSpec, KVQuantCache, make_cache, stack_rows
from kvquant.scoring import windowed
from kvquant.scoring.data import Window
from kvquant.errors import KVQuantError, check_int
from kvquant.scoring.parallel import ONE, Processes
from kvquant.scoring.prefixes import Node, Start, chunks_of, kept_nodes, nested_order, shared_starts
from kvquant.cache.reads import Reads

MODES = ("simulated", "streaming")


def check_mode(mode, chunk_size) -> None:
    """One-line errors for an evaluation mode or chunk size that cannot be honoured."""
    if mode not in MODES:
        raise KVQuantError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    check_int("chunk_size", chunk_size, minimum=1)


@dataclass
class Scored:
    """Log-probabilities ``[n]`` of the scored tokens and whether each was the greedy choice; with
    ``Scorer.distributions``, the logits of the whole next-token distribution ``[n, vocab]`` (float32, CPU)."""

    logprobs: torch.Tensor
    greedy: torch.Tensor
    distribution: torch.Tensor | None = None


@dataclass
class _Row:
    """What one batch row feeds after the fork: ``chunks`` of tokens, and from which fed position on (counted
    over the concatenated chunks) the logits predict ``targets``."""

    chunks: list[list[int]]
    score_from: int
    targets: list[int]


#: A forward pass costs about as much as this many padded positions on top of its tokens (it reads every weight
#: once, which dominates short batches on a CPU): the price of one more batch when rows are cut into batches.
FORWARD_COST = 32
#: Rows of up to this many batches are prefilled before their continuations are regrouped by length (see
#: Scorer.score_many); their prefix caches stay alive meanwhile.
POOL_BATCHES = 8
#: Scored positions x vocabulary entries one forward may project at most (float32: 2 GiB): a batch holds fewer rows
#: where its rows score so many positions (a 262,144-entry vocabulary: 4 rows of 511 positions; 49,152: 21).
LOGIT_ELEMENTS = 2**29
#: Positions whose log-probabilities (and divergences) are computed at once, so that no float copy of a whole
#: batch's logits (or a double copy of a window's) is made beside them; per row the same numbers as all at once.
SOFTMAX_ROWS = 64


def _runs(lengths: list[int]) -> list[list[int]]:
    """``lengths`` (sorted) split into runs of equal values."""
    out: list[list[int]] = []
    for length in lengths:
        if out and out[-1][0] == length:
            out[-1].append(length)
        else:
            out.append([length])
    return out


def _cut(lengths: list[int], most: int, forward_cost: int | None = None) -> list[int]:
    """Sizes of the consecutive runs (at most ``most`` rows each) into which ``lengths``, sorted longest first, are
    cut so that padded positions (each run pads to its first row) plus ``forward_cost`` (default
    :data:`FORWARD_COST`) per run are fewest."""
    forward_cost = FORWARD_COST if forward_cost is None else forward_cost
    n = len(lengths)
    best, start = [0] + [math.inf] * n, [0] * (n + 1)
    for stop in range(1, n + 1):
        for first in range(max(0, stop - most), stop):
            cost = best[first] + lengths[first] * (stop - first) + forward_cost
            if cost < best[stop]:
                best[stop], start[stop] = cost, first
    sizes = []
    while n:
        sizes.append(n - start[n])
        n = start[n]
    return sizes[::-1]


class _Batch:
    """Feeds rows of different lengths through one cache, one step at a time, padding what a row does not fill.

    Padding only ever comes before all of a row's real tokens or after them, never between two of them: a
    sliding-window mask counts positions, padding included, so padding inside a row would shrink its window."""

    def __init__(self, model, cache: KVQuantCache, rows: int, fed: list[int] | None = None):
        self.model, self.cache, self.fed = model, cache, fed  # fed[0]: real tokens fed so far
        self.device = model.get_input_embeddings().weight.device
        written = cache.get_seq_length()
        self.mask = cache.padding.real(0, written, rows) if written else torch.ones(rows, 0, dtype=torch.bool)

    def step(self, tokens: list[list[int]], keep: list[list[bool]] | None = None,
             pad_first: bool = False) -> torch.Tensor | None:
        """Feed ``tokens[r]`` to row ``r`` (maybe none), padded after them (before with ``pad_first``). With
        ``keep`` (per row, one flag per token), the logits ``[kept, vocab]`` of the kept positions, row by row:
        padding and positions nobody scores never reach the output layer."""
        width = max(map(len, tokens))
        if width == 0:
            return None
        if self.fed is not None:
            self.fed[0] += sum(map(len, tokens))
        pads = [[0] * (width - len(t)) for t in tokens]
        ids = torch.tensor([p + t if pad_first else t + p for t, p in zip(tokens, pads)])
        real = [[False] * len(p) + [True] * len(t) if pad_first else [True] * len(t) + [False] * len(p)
                for t, p in zip(tokens, pads)]
        self.mask = torch.cat([self.mask, torch.tensor(real)], dim=1)
        padded = not bool(self.mask.all())
        if padded:
            self.cache.set_padding(self.mask)
        positions = (self.mask.cumsum(1) - 1).clamp(min=0)[:, -width:]  # each row counts its own real tokens
        wanted = None
        if keep is not None:
            wanted = torch.tensor([k + [False] * len(p) for k, p in zip(keep, pads)])
        some = wanted is not None and bool(wanted.any())
        # A single row keeps transformers' own projection of all its positions, so that one request scores bit for
        # bit what a plain forward gives (another matmul shape would round differently); batched rows differ from
        # a row alone by such float noise anyway, so they project only what is kept.
        to_keep = (wanted.to(self.device) if len(tokens) > 1 else 0) if some else 1
        out = self.model(ids.to(self.device), cache=self.cache, use_cache=True,
                         attention_mask=self.mask.long().to(self.device) if padded else None,
                         position_ids=positions.to(self.device) if padded else None,
                         logits_to_keep=to_keep)
        if wanted is None:
            return None
        if not some:
            return out.logits.new_empty(0, out.logits.shape[-1])
        # transformers flattens the kept positions to [kept, vocab]; all positions come back as [rows, width, vocab]
        return out.logits if out.logits.dim() == 2 else out.logits[wanted.to(out.logits.device)]


class _Nodes:
    """The caches holding shared chunks (:mod:`kvquant.scoring.prefixes`) of one ``score_many`` call: each kept
    node (``kept``, by id) is prefilled once, when first needed, from the cache of the nearest kept node above it,
    and dropped once every context and node that starts from it has taken its copy (``use`` counts them)."""

    def __init__(self, scorer: Scorer, starts: list[Start]):
        self.scorer, self.kept, self.built = scorer, kept_nodes(starts), {}
        self.users = dict.fromkeys(self.kept, 0)
        for start in starts:
            if start.node is not None:
                self.users[id(start.node)] += 1
        for node in self.kept.values():
            if (above := self._above(node)) is not None:
                self.users[id(above)] += 1

    def _above(self, node: Node) -> Node | None:
        above = node.parent
        while above is not None and id(above) not in self.kept:
            above = above.parent
        return above

    def cache(self, node: Node) -> KVQuantCache:
        """The 1-row cache that holds ``node``'s chunks; never written to afterwards (rows continue in copies)."""
        if id(node) not in self.built:
            above = self._above(node)
            cache = self.scorer._new_cache() if above is None else stack_rows([(self.cache(above), 0)])
            if above is not None:
                self.use(above)
            runner = _Batch(self.scorer.model, cache, 1, self.scorer.tally)
            for chunk in node.path(above):
                runner.step([chunk])
            self.built[id(node)] = cache
        return self.built[id(node)]

    def use(self, node: Node) -> None:
        """One context or node has copied ``node``'s cache: the last one frees it."""
        self.users[id(node)] -= 1
        if not self.users[id(node)]:
            self.built.pop(id(node), None)


class Scorer:
    """Scores token sequences with ``model``, reading K/V through a fresh cache of ``spec`` per batch.

    ``reads`` counts what attention read from every cache the scorer used (:mod:`kvquant.cache.reads`), ``lengths``
    holds every scored request's length (context + continuation tokens), in scoring order, and ``tokens_fed`` counts the
    tokens this process fed the model (fewer where contexts are shared). With
    ``distributions`` set, results carry whole next-token distributions (for divergence from a baseline).
    ``processes``: the run's processes, which share every call's requests (``reads`` then counts all of theirs)."""

    #: with ``share_prefix``: contexts that begin with the same chunks also prefill those once
    #: (:mod:`kvquant.scoring.prefixes`); off, only requests with one context share it (benchmarks compare the two)
    share_chunks = True

    def __init__(self, model, spec: CacheSpec, mode: str = "simulated", chunk_size: int = 64,
                 batch_size: int = 1, share_prefix: bool = True, processes: Processes = ONE):
        check_mode(mode, chunk_size)
        check_int("batch_size", batch_size, minimum=1)
        self.model, self.spec, self.mode, self.chunk_size = model, CacheSpec.of(spec), mode, chunk_size
        self.batch_size, self.share_prefix, self.processes = batch_size, share_prefix, processes
        self.reads, self.lengths, self.distributions = Reads(), [], False
        self.tally = [0]  # real tokens fed to the model (kvquant.scoring.prefixes.model_tokens plans them)
        if mode == "simulated" and self.evicts:
            raise KVQuantError("eviction acts between forwards, and simulated mode scores each sequence in one "
                               "forward, which reads every token; use streaming mode")

    @functools.cached_property
    def evicts(self) -> bool:
        """Whether the caches evict tokens (an eviction policy)."""
        return make_cache(self.model, self.spec).eviction is not None

    @property
    def tokens_fed(self) -> int:
        return self.tally[0]

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @functools.cached_property
    def vocab(self) -> int:
        """Entries of the model's next-token distribution."""
        return vocabulary(self.model)

    def rows_per_batch(self, scored: int) -> int:
        """Rows one forward takes when its longest row scores ``scored`` positions: ``batch_size``, fewer where
        their logits would pass :data:`LOGIT_ELEMENTS`, at least one."""
        return max(1, min(self.batch_size, LOGIT_ELEMENTS // max(1, scored * self.vocab)))

    def _new_cache(self) -> KVQuantCache:
        cache = make_cache(self.model, self.spec)
        cache.reads = self.reads
        return cache

    def score(self, ids: list[int], score_from: int) -> Scored:
        """Score ``ids[score_from:]`` given everything before them (``1 <= score_from < len(ids)``)."""
        return self.score_many([(ids[:score_from], ids[score_from:])])[0]

    def _plan(self, context: list[int], continuation: list[int]) -> tuple[list[list[int]], _Row]:
        """(prefix chunks shared by requests with this context, the request's own row)."""
        if self.mode == "simulated":
            ids = context + continuation
            return [], _Row([ids], len(context) - 1, continuation)
        scored = context[-1:] + continuation[:-1]
        return chunks_of(context[:-1], self.chunk_size), _Row(chunks_of(scored, self.chunk_size), 0, continuation)

    @torch.inference_mode()
    def score_many(self, requests: list[tuple[list[int], list[int]]], desc: str | None = None,
                   local: bool = False) -> list[Scored | None]:
        """Score each ``(context, continuation)`` (both non-empty token lists); results in request order. Under
        several processes with ``local``, only this process's share is returned (None for the others' requests).

        Requests are taken in pools of groups (the requests sharing a context, or each request alone). In a pool,
        the contexts are prefilled in batches of similar lengths (a context longer than one chunk alone, chunk by
        chunk); then every request's row continues from its context's cached row (:func:`stack_rows`) in batches
        of similar continuation lengths. So padding stays small in both steps, although context and continuation
        lengths hardly go together (LAMBADA: long contexts, one-token continuations; PIQA: the reverse)."""
        for context, continuation in requests:
            if not context or not continuation:
                raise KVQuantError("every scored request needs at least one context and one continuation token")
        self.lengths += [len(context) + len(continuation) for context, continuation in requests]
        starts, pools = self._schedule(requests, self.processes.share)
        nodes = _Nodes(self, list(starts.values()))
        before = self.reads.to_dict()
        results: list[Scored | None] = [None] * len(requests)
        mine = sum(len(members) for pool in pools for members in pool)
        quiet = desc is None or not self.processes.is_main_process
        with tqdm(total=mine, desc=desc, leave=False, disable=quiet) as bar:
            for pool in pools:
                for i, scored in self._score_pool(requests, pool, [starts[id(m)] for m in pool], nodes):
                    results[i] = scored
                bar.update(sum(map(len, pool)))
        return self._gather(results, before, local)

    def batches(self, requests: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """The requests (indices into ``requests``) of each batch of rows that :meth:`score_many` of ``requests``
        runs in one process, in the order it runs them. Scored one call per batch, every request is batched beside
        the same rows as in the one call (the same bits where no context is prefilled: simulated mode, or
        one-token contexts)."""
        _, pools = self._schedule(requests)
        return [[i for i, _, _ in run] for pool in pools for run in self._batch_rows(requests, pool)]

    def _schedule(self, requests, share_out=lambda order: order) -> tuple[dict[int, Start], list[list[list[int]]]]:
        """How :meth:`score_many` takes ``requests``: where each group's prefill starts (by the id of its list of
        request indices) and the pools of groups, in order; ``share_out``: this process's share of the groups."""
        share = self.share_prefix and self.mode == "streaming"
        groups: dict[tuple, list[int]] = {}
        for i, (context, _) in enumerate(requests):
            groups.setdefault(tuple(context) if share else (i,), []).append(i)
        # longest first: the first pool shows the memory peak at once; similar lengths share pools
        order = sorted(groups.values(), key=lambda idx: -len(requests[idx[0]][0]) - len(requests[idx[0]][1]))
        if share and self.share_chunks:  # then the contexts sharing chunks together: their caches go soon
            order = [order[i] for i in nested_order(shared_starts([self._plan(*requests[m[0]])[0] for m in order]))]
        order = share_out(order)
        prefixes = [self._plan(*requests[members[0]])[0] for members in order]
        fresh = map(functools.partial(Start, None), prefixes)
        starts = dict(zip(map(id, order), shared_starts(prefixes) if share and self.share_chunks else fresh))
        # A pool holds at most POOL_BATCHES batches of rows and batch_size chunks of context (what one batch of
        # contexts could hold), or a single group whose own context chunks (after what it shares) are more than one.
        pools, current, rows, tokens = [], [], 0, 0
        for members in order:
            prefix = sum(map(len, starts[id(members)].rest))
            alone = len(starts[id(members)].rest) > 1
            if current and (alone or rows + len(members) > POOL_BATCHES * self.batch_size
                            or tokens + prefix > self.batch_size * self.chunk_size):
                pools.append(current)
                current, rows, tokens = [], 0, 0
            current.append(members)
            rows, tokens = rows + len(members), tokens + prefix
            if alone:
                pools.append(current)
                current, rows, tokens = [], 0, 0
        if current:
            pools.append(current)
        return starts, pools

    def _gather(self, results: list[Scored | None], before: dict[str, int], local: bool) -> list[Scored | None]:
        """Under several processes: ``reads`` summed over all of them, and (unless ``local``) every process's
        results in place of the None of the requests it scored."""
        if self.processes.world == 1:
            return results
        own = {k: v - before[k] for k, v in self.reads.to_dict().items()}
        parts = self.processes.gather((own, [] if local else [(i, s) for i, s in enumerate(results) if s is not None]))
        for name in before:
            setattr(self.reads, name, before[name] + sum(own[name] for own, _ in parts))
        for _, scored in parts:
            for i, s in scored:
                results[i] = s
        return results

    def _prefill(self, starts: list[Start], nodes: _Nodes) -> list[tuple[KVQuantCache, int]]:
        """Feed each context's chunks (after what it shares with others: ``Start``) through a cache; per context, the
        cache and row that now hold it. One-chunk contexts starting fresh are batched by length (padded in front);
        one-chunk rests after shared chunks are batched only with rests of their own length (padding between a
        row's shared chunks and its own would shrink a sliding window; see _Batch); longer ones go alone (chunk by
        chunk); a context with nothing of its own is the cache of its shared chunks."""
        fresh = self._new_cache()
        where: list[tuple[KVQuantCache, int]] = [(fresh, 0)] * len(starts)
        for after in (False, True):
            short = sorted((g for g, s in enumerate(starts) if len(s.rest) == 1 and (s.node is not None) == after),
                           key=lambda g: -len(starts[g].rest[0]))
            lengths = [len(starts[g].rest[0]) for g in short]
            start = 0
            for size in [n for same in _runs(lengths) for n in _cut(same, self.batch_size)] if after else \
                    _cut(lengths, self.batch_size):
                run = short[start : start + size]
                start += size
                cache = stack_rows([(nodes.cache(starts[g].node), 0) for g in run]) if after else self._new_cache()
                for g in run if after else ():
                    nodes.use(starts[g].node)
                _Batch(self.model, cache, len(run), self.tally).step([starts[g].rest[0] for g in run], pad_first=True)
                for row, g in enumerate(run):
                    where[g] = (cache, row)
        for g, start in enumerate(starts):
            if len(start.rest) > 1 or (not start.rest and start.node is not None):
                cache = self._new_cache() if start.node is None else stack_rows([(nodes.cache(start.node), 0)])
                if start.node is not None:
                    nodes.use(start.node)
                runner = _Batch(self.model, cache, 1, self.tally)
                for chunk in start.rest:
                    runner.step([chunk])
                where[g] = (cache, 0)
        return where

    def _score_pool(self, requests, pool: list[list[int]], starts: list[Start],
                    nodes: _Nodes) -> list[tuple[int, Scored]]:
        """Score the requests of a pool of groups (requests sharing a context; ``starts``: where each group's
        prefill starts): (request index, result) pairs."""
        where = self._prefill(starts, nodes)
        out = []
        for run in self._batch_rows(requests, pool):
            runner = _Batch(self.model, stack_rows([where[g] for _, _, g in run]), len(run), self.tally)
            out += zip([i for i, _, _ in run], self._continue(runner, [row for _, row, _ in run]))
        return out

    def _batch_rows(self, requests, pool: list[list[int]]) -> list[list[tuple[int, _Row, int]]]:
        """The batches of rows of a pool of groups, in the order they run: per row, its request's index, the row,
        and its group's place in the pool; rows of similar lengths together."""
        rows = sorted(((i, self._plan(*requests[i])[1], g) for g, members in enumerate(pool) for i in members),
                      key=lambda item: -sum(map(len, item[1].chunks)))
        lengths = [sum(map(len, row.chunks)) for _, row, _ in rows]
        most = self.rows_per_batch(max(len(row.targets) for _, row, _ in rows))
        # an evicting cache reads a row's kept tokens right-aligned before each chunk, which padding after a row's
        # tokens would break: its rows run in batches of one length
        sizes = [size for same in _runs(lengths) for size in _cut(same, most)] if self.evicts else \
            _cut(lengths, most)
        runs, start = [], 0
        for size in sizes:
            runs.append(rows[start : start + size])
            start += size
        return runs

    def _continue(self, runner: _Batch, rows: list[_Row]) -> list[Scored]:
        """Feed each row's chunks, step by step, and score its targets from the logits of its scored positions."""
        logprobs: list[list[torch.Tensor]] = [[] for _ in rows]
        greedy: list[list[torch.Tensor]] = [[] for _ in rows]
        whole: list[list[torch.Tensor]] = [[] for _ in rows]
        fed = [0] * len(rows)
        for step in range(max(len(r.chunks) for r in rows)):
            tokens = [r.chunks[step] if step < len(r.chunks) else [] for r in rows]
            keep, targets, counts = [], [], []
            for r, (row, chunk) in enumerate(zip(rows, tokens)):
                first, stop = row.score_from - fed[r], row.score_from + len(row.targets) - fed[r]
                keep.append([first <= j < stop for j in range(len(chunk))])
                taken = range(max(first, 0), min(stop, len(chunk)))
                targets += [row.targets[fed[r] + j - row.score_from] for j in taken]
                counts.append(len(taken))
                fed[r] += len(chunk)
            logits = runner.step(tokens, keep)
            if logits is None or not targets:
                continue
            logits = logits.float()
            wanted = torch.tensor(targets, device=logits.device)
            lp = torch.cat([part.log_softmax(-1).gather(1, w[:, None])[:, 0] for part, w in
                            zip(logits.split(SOFTMAX_ROWS), wanted.split(SOFTMAX_ROWS))]).cpu()
            hit = (logits.argmax(-1) == wanted).cpu()
            for r, (a, b) in enumerate(zip(lp.split(counts), hit.split(counts))):
                logprobs[r].append(a)
                greedy[r].append(b)
            if self.distributions:
                for r, d in enumerate(logits.cpu().split(counts)):
                    whole[r].append(d)
        return [Scored(torch.cat(lp), torch.cat(hit), torch.cat(d) if self.distributions else None)
                for lp, hit, d in zip(logprobs, greedy, whole)]


def perplexity_samples(scorer: Scorer, windows: list[Window], desc: str | None = "perplexity",
                       keep: windowed.Keep | None = None) -> dict:
    """Per-window summed negative log-likelihood and predicted-token count, what attention read and the lengths
    scored: a batch of windows at a time (:func:`~kvquant.scoring.windowed.pass_groups`), each group through ``keep``
    (:func:`~kvquant.scoring.windowed.in_groups`: a group kept from an interrupted pass is not scored again)."""
    def group(ws: list[Window]) -> dict:
        since = windowed.tallies(scorer)
        scored = scorer.score_many(windowed.requests(ws))
        return {"nll": [float(-s.logprobs.double().sum()) for s in scored],
                "tokens": [len(s.logprobs) for s in scored], **windowed.tallies_since(scorer, since)}

    groups = windowed.pass_groups(scorer, windows)
    parts = windowed.in_groups(windows, groups, group, keep, desc, scorer.processes.is_main_process)
    return windowed.join_groups(parts, groups, ("nll", "tokens"))


def vocabulary(model) -> int:
    """Entries of ``model``'s next-token distribution (its output layer's rows, else its config's vocabulary)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.get_text_config().vocab_size


@torch.inference_mode()
def memory_probe(model, spec: CacheSpec, ids: list[int]) -> dict[str, float]:
    """``memory_report()`` of a cache of ``spec`` after ``ids`` went through it."""
    cache = make_cache(model, spec)
    device = model.get_input_embeddings().weight.device
    model(torch.tensor([ids], device=device), cache=cache, use_cache=True, logits_to_keep=1)  # the last position only
    return cache.memory_report()
