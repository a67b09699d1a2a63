"""The prompt cache's memory: one radix tree of token segments, each holding the keys and
values of its own positions, so that branches that share a prefix (an agent and its
subagents under one system prompt, a conversation and its rewinds) hold that prefix once.

Why it is exact: a causal model's keys and values at position i depend on tokens[: i + 1]
alone, so the rows of any cached sequence that starts with a prompt's first m tokens are
that prefix's rows. A served cache is those rows concatenated, a new cache object (the
tree's arrays are never handed out), so a request's own tokens never reach the tree.

Layers other than mlx-lm's plain `KVCache` (linear attention's state, sliding windows,
lists of caches) keep no row per token: they are kept as snapshots at the ends of the
sequences inserted (a prompt's boundary, an answer's end, a long prefill's checkpoints),
and a model with such layers reuses a prefix only up to a snapshot on its path, or, where
those layers can be trimmed (a window not yet full), from a deeper snapshot trimmed back.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

# The rows kept for one layer of one segment: (keys, values), each [1, heads, tokens, dim].
Rows = tuple[mx.array, mx.array]


def sequence_bytes(cache: Sequence[Any], tokens: int) -> int:
    """Bytes `cache`'s first `tokens` positions take once kept (rows, and the other
    layers whole)."""
    total = 0
    for c in cache:
        if type(c) is KVCache:
            if c.keys is not None:
                total += (c.keys.nbytes // c.keys.shape[2] + c.values.nbytes // c.values.shape[2]) * tokens
        else:
            total += _bytes(c.state)
    return total


def _bytes(tree: Any) -> int:
    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def _rows(rows: Rows | None, start: int, stop: int | None) -> Rows | None:
    # A copy, not a view: a view would keep the request's whole buffer alive.
    if rows is None:
        return None
    return mx.contiguous(rows[0][..., start:stop, :]), mx.contiguous(rows[1][..., start:stop, :])


@dataclass(eq=False)
class Snapshot:
    """The layers kept whole at a node's end (None at the chunked layers)."""

    layers: list[Any]
    trimmable: bool
    nbytes: int


class Node:
    __slots__ = ("tokens", "start", "rows", "children", "parent", "snapshot", "end", "used", "nbytes")

    def __init__(self, tokens: tuple[int, ...], start: int, rows: list[Rows | None], parent: Node | None) -> None:
        self.tokens = tokens  # this segment's tokens, at positions start .. start + len
        self.start = start
        self.rows = rows
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.snapshot: Snapshot | None = None
        # An inserted sequence ends here (an entry: bounded in number).
        self.end = False
        self.used = 0
        self.nbytes = sum(k.nbytes + v.nbytes for r in rows if r is not None for k, v in (r,))

    @property
    def stop(self) -> int:
        return self.start + len(self.tokens)


class PromptTree:
    """Cached sequences by token, their shared prefixes held once. Not thread-safe (the
    engine thread's)."""

    def __init__(self, chunked: list[bool]) -> None:
        self.chunked = chunked
        self.all_rows = all(chunked)
        self.root = Node((), 0, [None] * len(chunked), None)
        self.nbytes = 0
        self.entries = 0

    # ---- finding ----------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]) -> tuple[list[Node], int]:
        """The nodes the prompt enters (root first) and how many of its tokens match; the
        last node may be matched only in part."""
        path, node, m = [self.root], self.root, 0
        while m < len(tokens):
            child = node.children.get(tokens[m])
            if child is None:
                break
            path.append(child)
            k = 0
            while k < len(child.tokens) and m < len(tokens) and child.tokens[k] == tokens[m]:
                k, m = k + 1, m + 1
            if k < len(child.tokens):
                break
            node = child
        return path, m

    def best(self, tokens: Sequence[int], limit: int) -> tuple[int, Node | None, int]:
        """(tokens reused, the node whose snapshot serves them or None, tokens to trim
        from that snapshot): the most of `tokens[:limit]` this tree can serve."""
        path, m = self._walk(tokens)
        m = min(m, limit)
        if self.all_rows:
            return m, None, 0
        # The deepest snapshot at or above m, as it is.
        best: tuple[int, Node | None, int] = (0, None, 0)
        for node in path:
            if node.snapshot is not None and node.stop <= m and node.stop > best[0]:
                best = (node.stop, node, 0)
        # Or a deeper one whose layers can be trimmed back to m: the nearest below.
        if m > best[0]:
            at = next((n for n in path if n.start < m <= n.stop), None)
            deeper = self._nearest_trimmable(at) if at is not None else None
            if deeper is not None:
                best = (m, deeper, deeper.stop - m)
        return best

    @staticmethod
    def _nearest_trimmable(node: Node) -> Node | None:
        level = [node]
        while level:
            for n in level:
                if n.snapshot is not None and n.snapshot.trimmable:
                    return n
            level = [c for n in level for c in n.children.values()]
        return None

    def serve(self, tokens: Sequence[int], m: int, snap: Node | None, trim: int, used: int) -> list[Any]:
        """A new cache holding `tokens[:m]`: the rows on its path, and the snapshot's
        other layers (copied, trimmed by `trim`); the nodes it reads are marked `used`."""
        path, matched = self._walk(tokens)
        if matched < m or tuple(tokens[:m]) != self._tokens(path)[:m]:  # what the walk promises, checked
            raise AssertionError("prompt cache: an entry does not match the prompt it was found for")
        for n in path:
            n.used = used
        if snap is not None:
            self._touch_up(snap, used)
        cache: list[Any] = []
        for i, rows in enumerate(self.chunked):
            if rows:
                parts = [
                    (n.rows[i][0][..., : m - n.start, :], n.rows[i][1][..., : m - n.start, :])
                    for n in path[1:]
                    if n.start < m
                ]
                c = KVCache()
                if parts:
                    keys = mx.concatenate([k for k, _ in parts], axis=2) if len(parts) > 1 else mx.array(parts[0][0])
                    values = mx.concatenate([v for _, v in parts], axis=2) if len(parts) > 1 else mx.array(parts[0][1])
                    c.state = (keys, values, m)
                cache.append(c)
            else:
                assert snap is not None and snap.snapshot is not None
                layer = copy.deepcopy(snap.snapshot.layers[i])
                if trim:
                    layer.trim(trim)
                cache.append(layer)
        mx.eval([c.state for c in cache if not (isinstance(c, KVCache) and c.keys is None)])
        return cache

    # ---- inserting --------------------------------------------------------------------

    def insert(self, tokens: tuple[int, ...], cache: Sequence[Any], used: int) -> tuple[Node, int]:
        """Keep `cache` (holding exactly `tokens`) as an entry: only the rows of positions
        no kept sequence holds yet are copied; a snapshot of the other layers at its end.
        Returns the end node and the bytes added."""
        added = 0
        path, m = self._walk(tokens)
        node = path[-1]
        if node.stop > m:  # the sequence leaves the segment, or ends inside it: cut it there
            node = path[-1] = self._split(node, m - node.start)
        if m < len(tokens):
            rows = [_rows((c.keys, c.values), m, len(tokens)) if r else None for c, r in zip(cache, self.chunked)]
            mx.eval([r for r in rows if r is not None])
            node = Node(tokens[m:], m, rows, node)
            node.parent.children[tokens[m]] = node
            added += node.nbytes
            path.append(node)
        for n in path:
            n.used = used
        if not node.end:
            node.end = True
            self.entries += 1
        if self.all_rows:
            # Rows serve every prefix of a sequence: an entry inside this one is no longer one.
            up = node.parent
            while up is not None:
                if up.end:
                    up.end = False
                    self.entries -= 1
                up = up.parent
        if not self.all_rows and node.snapshot is None:
            layers = [None if r else copy.deepcopy(c) for c, r in zip(cache, self.chunked)]
            kept = [c for c in layers if c is not None]
            node.snapshot = Snapshot(layers, all(c.is_trimmable() for c in kept), _bytes([c.state for c in kept]))
            node.nbytes += node.snapshot.nbytes
            added += node.snapshot.nbytes
        self.nbytes += added
        return node, added

    def _split(self, node: Node, k: int) -> Node:
        """Cut `node`'s segment after its first k tokens; the new upper node is returned."""
        upper_rows = [_rows(r, 0, k) for r in node.rows]
        lower_rows = [_rows(r, k, None) for r in node.rows]
        mx.eval([r for r in upper_rows + lower_rows if r is not None])
        parent = node.parent
        assert parent is not None
        upper = Node(node.tokens[:k], node.start, upper_rows, parent)
        upper.used = node.used
        parent.children[node.tokens[0]] = upper
        before = node.nbytes
        node.tokens, node.start, node.rows, node.parent = node.tokens[k:], node.start + k, lower_rows, upper
        node.nbytes = sum(a.nbytes + b.nbytes for r in lower_rows if r is not None for a, b in (r,))
        node.nbytes += node.snapshot.nbytes if node.snapshot is not None else 0
        upper.children[node.tokens[0]] = node
        self.nbytes += upper.nbytes + node.nbytes - before
        return upper

    # ---- bounding ---------------------------------------------------------------------

    def oldest_leaf(self) -> Node | None:
        leaves = [n for n in self._nodes() if not n.children and n is not self.root]
        return min(leaves, key=lambda n: n.used, default=None)

    def drop(self, node: Node) -> int:
        """Remove a leaf, and the ancestors it leaves useless (no entry, no child);
        returns the bytes freed."""
        assert not node.children
        freed = 0
        while node is not self.root and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[0]]
            freed += node.nbytes
            if node.end:
                self.entries -= 1
            node = parent
            if node.end:
                break
        self.nbytes -= freed
        return freed

    def leaves(self) -> int:
        return sum(1 for n in self._nodes() if not n.children and n is not self.root)

    def _nodes(self) -> Iterator[Node]:
        stack = [self.root]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def find(self, tokens: Sequence[int]) -> Node | None:
        """The entry that ends exactly at `tokens`, if one does."""
        path, m = self._walk(tokens)
        node = path[-1]
        return node if m == len(tokens) and node.stop == m and node.end else None

    @staticmethod
    def _tokens(path: list[Node]) -> tuple[int, ...]:
        return tuple(t for n in path for t in n.tokens)

    @staticmethod
    def _touch_up(node: Node | None, used: int) -> None:
        while node is not None:
            node.used = max(node.used, used)
            node = node.parent
