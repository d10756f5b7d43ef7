"""Which prefilled chunks requests share beyond one context: a trie of the chunks streaming mode feeds.

In streaming mode a context is fed ``chunk_size`` tokens at a time from its first token, so two contexts that
begin with the same chunks (the same few-shot examples in front of different questions, the same haystack in front
of different needles) store exactly the same K/V for those chunks: each chunk attends to what the cache stored for
the ones before it, and that depends on nothing after. Prefilling such chunks once and forking the cache at the
point where the contexts part therefore changes nothing any request computes, while the chunks are run once.

Only whole chunks fed from the first token are shared, so every request keeps the chunk boundaries it has alone
(a chunk boundary decides which key groups are complete when a query reads them): the fork point of a group of
requests is the end of the last chunk they all feed alike, never a token in the middle of one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def chunks_of(ids: list[int], size: int) -> list[list[int]]:
    """``ids`` cut into chunks of ``size`` tokens (the last may be shorter), as streaming mode feeds them."""
    return [ids[i : i + size] for i in range(0, len(ids), size)]


@dataclass(eq=False)
class Node:
    """The chunks ``chunks[:depth]`` that some contexts feed first (``chunk``: the last of them), and how many of
    the planned contexts feed them (``count``)."""

    parent: Node | None
    chunk: tuple[int, ...]
    depth: int
    count: int = 0
    children: dict[tuple[int, ...], Node] = field(default_factory=dict, repr=False)

    def path(self, stop: Node | None = None) -> list[list[int]]:
        """The chunks from just after ``stop`` (an ancestor; None: the root) down to this node, in feeding order."""
        out, node = [], self
        while node.parent is not None and node is not stop:  # the root holds no chunk
            out.append(list(node.chunk))
            node = node.parent
        return out[::-1]


@dataclass(frozen=True)
class Start:
    """Where one context's prefill starts: from the cache that holds ``node``'s chunks (None: a fresh cache),
    feeding ``rest``, the chunks after them."""

    node: Node | None
    rest: list[list[int]]


def shared_starts(prefixes: list[list[list[int]]]) -> list[Start]:
    """Per prefix (its chunks, ``[chunks][tokens]``), where its prefill starts: after the deepest run of its leading
    chunks that another prefix also begins with, else from nothing. Identical prefixes are one prefix to the caller
    (a group of requests with one context), so a prefix shared with none starts fresh however long it is."""
    root = Node(None, (), 0)
    paths: list[list[Node]] = []
    for chunks in prefixes:
        node, path = root, []
        for chunk in chunks:
            key = tuple(chunk)
            node = node.children.setdefault(key, Node(node, key, node.depth + 1))
            node.count += 1
            path.append(node)
        paths.append(path)
    starts = []
    for chunks, path in zip(prefixes, paths):
        shared = [node for node in path if node.count > 1]
        deepest = shared[-1] if shared else None
        starts.append(Start(deepest, chunks[deepest.depth :] if deepest else list(chunks)))
    return starts


def kept_nodes(starts: list[Start]) -> dict[int, Node]:
    """The nodes whose caches a scorer keeps (by id): every node a context starts from, and every node where the
    paths to two of those part (its chunks are fed once for both, not again for each)."""
    below: dict[int, set[int]] = {}  # node id -> its children that lead to a start
    nodes: dict[int, Node] = {}
    for start in starts:
        node = start.node
        if node is None:
            continue
        nodes[id(node)] = node
        while node.parent is not None and node.parent.parent is not None:
            below.setdefault(id(node.parent), set()).add(id(node))
            nodes.setdefault(id(node.parent), node.parent)
            node = node.parent
    starting = {id(s.node) for s in starts if s.node is not None}
    return {i: n for i, n in nodes.items() if i in starting or len(below.get(i, ())) > 1}


def nested_order(starts: list[Start]) -> list[int]:
    """The indices of ``starts`` reordered so that the contexts that start from a kept node (:func:`kept_nodes`),
    or from the kept nodes below it, come one after another: a scorer drops a node's cache once they have all
    copied it, so the caches alive at once are bounded by how deep kept nodes nest, not by how many documents
    share chunks (WinoGrande: each document's options share its own chunks). Siblings keep the order of their
    first member, so a list sorted longest first stays so among them, and one with no kept node is unchanged."""
    kept = kept_nodes(starts)

    def above(node: Node | None) -> int | None:  # the nearest kept ancestor's id (None: the root)
        while node is not None and id(node) not in kept:
            node = node.parent
        return None if node is None else id(node)

    children: dict[int | None, list[tuple[int, bool, int]]] = {}  # (first member, is a leaf, index or node id)
    first: dict[int, int] = {}
    for i, start in enumerate(starts):  # in order, so a node's first member is the first that reaches it
        key = above(start.node)
        children.setdefault(key, []).append((i, True, i))
        while key is not None and key not in first:
            first[key] = i
            parent = above(kept[key].parent)
            children.setdefault(parent, []).append((i, False, key))
            key = parent
    out: list[int] = []
    stack: list[tuple[int, bool, int | None]] = [(0, False, None)]
    while stack:  # depth first, without recursion (kept nodes may nest as deep as a context has chunks)
        _, leaf, item = stack.pop()
        if leaf:
            out.append(item)
        else:
            stack.extend(sorted(children.get(item, ()), reverse=True))
    return out


def fed_tokens(prefixes: list[list[list[int]]]) -> int:
    """Tokens the prefill of these prefixes feeds when shared chunks are fed once (each distinct node of the trie
    once), against ``sum`` of every prefix's own tokens unshared."""
    seen: set[int] = set()
    total = 0
    for start in shared_starts(prefixes):
        node = start.node
        while node is not None and node.parent is not None and id(node) not in seen:
            seen.add(id(node))
            total += len(node.chunk)
            node = node.parent
        total += sum(map(len, start.rest))
    return total


def model_tokens(requests: list[tuple[list[int], list[int]]], mode: str, chunk_size: int, share: bool,
                 chunks: bool = True) -> int:
    """Tokens a :class:`~kvquant.scoring.scorer.Scorer` of ``mode``, ``chunk_size``, ``share_prefix`` (``share``)
    and ``share_chunks`` (``chunks``) feeds the model for these ``(context, continuation)`` requests in one
    ``score_many`` call of one process (its ``tokens_fed``): each request whole in simulated mode; in streaming mode
    each context less its last token (with ``share``, a context several requests have once, and with ``chunks`` too the
    chunks contexts begin with alike once), then the scored tokens, as many as the continuation's."""
    if mode == "simulated":
        return sum(len(c) + len(t) for c, t in requests)
    contexts = list(dict.fromkeys(tuple(c) for c, _ in requests)) if share else [c for c, _ in requests]
    prefixes = [chunks_of(list(c[:-1]), chunk_size) for c in contexts]
    prefill = fed_tokens(prefixes) if share and chunks else sum(len(c) - 1 for c in contexts)
    return prefill + sum(len(t) for _, t in requests)
