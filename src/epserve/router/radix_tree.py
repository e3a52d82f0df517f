"""Approximate radix tree of the token prefixes each engine instance has (probably) cached.

The router never sees the engines' KV caches; it only remembers which prompts it sent where. One tree is
shared by all instances: edges are labelled with runs of token ids (tuples), split when a new sequence
diverges inside an edge, and every node records ``{instance: last_access_time}`` for the instances that
hold the prefix ending at that node.

Invariant: the set of nodes an instance holds is *prefix-closed* -- if it holds a node it holds every
ancestor. ``insert`` touches the whole path, a split copies the holders to the new upper half, and eviction
only ever drops an instance's *leaves* (nodes it holds with no child it holds). Because of that, walking a
prompt down the tree tells at once how far every instance matches, and a node held by nobody has no
children and can be unlinked.

The tree is "approximate" because the engines evict on their own schedule; the router evicts per
instance in LRU order to keep its model of each cache bounded, which is close enough for routing.
All operations are O(len(tokens)) except ``evict`` and ``remove_instance``, which visit the nodes the
instance holds.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Collection, Sequence

__all__ = ["PrefixTree"]


class _Node:
    __slots__ = ("edge", "children", "parent", "access", "uid")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None, uid: int) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}  # keyed by the first token of the child's edge
        self.parent = parent
        self.access: dict[int, float] = {}  # instance -> last access time
        self.uid = uid  # creation order; a deterministic tie-break for eviction


def _common_len(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of ``edge`` and ``tokens[start:]``."""
    m = len(edge)
    if tokens[start : start + m] == edge:  # fast path, compared in C
        return m
    limit = min(m, len(tokens) - start)
    for j in range(limit):
        if edge[j] != tokens[start + j]:
            return j
    return limit


class PrefixTree:
    """Token-id prefixes each engine instance has (probably) cached, with LRU eviction per instance."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._uids = itertools.count()
        self._root = _Node((), None, next(self._uids))
        self._sizes: dict[int, int] = {}  # instance -> tokens held (only instances holding > 0)

    # -- queries -----------------------------------------------------------------------------------------

    @property
    def instances(self) -> set[int]:
        """Instances that hold at least one token."""
        return set(self._sizes)

    def size(self, instance: int) -> int:
        """Tokens held for ``instance``: the sum of the edge lengths of the nodes it holds."""
        return self._sizes.get(instance, 0)

    def match(
        self, token_ids: Sequence[int], instances: Collection[int] | None = None, *, touch: bool = True
    ) -> tuple[int, int | None]:
        """Longest prefix of ``token_ids`` held by any instance: ``(matched_len, instance)``.

        Among the instances holding that longest match, the most recently used one wins (ties: smallest
        index). ``(0, None)`` when nothing matches. ``instances`` restricts the candidates (e.g. to the
        healthy ones). With ``touch`` (the default) the matched path is refreshed for the returned instance.
        """
        tokens = tuple(token_ids)
        allowed = None if instances is None else set(instances)
        matched, path, holders = self._walk(tokens, allowed)
        if not path:
            return 0, None
        last = path[-1]
        best = max(holders, key=lambda inst: (last.access[inst], -inst))
        if touch:
            now = self._clock()
            for node in path:
                node.access[best] = now
        return matched, best

    def match_lengths(self, token_ids: Sequence[int]) -> dict[int, int]:
        """Every instance's longest matched prefix length (instances matching 0 tokens omitted).

        No side effects.
        """
        tokens = tuple(token_ids)
        lengths: dict[int, int] = {}
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_len(child.edge, tokens, i)
            i += k
            for inst in child.access:  # prefix-closed: the deepest holder node gives the final value
                lengths[inst] = i
            if k < len(child.edge):
                break
            node = child
        return lengths

    # -- updates -----------------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], instance: int) -> None:
        """Record that ``instance`` now holds the whole prefix ``token_ids``; refreshes every node on the path."""
        tokens = tuple(token_ids)
        if not tokens:
            return
        now = self._clock()
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tokens[i:], node, next(self._uids))
                node.children[tokens[i]] = leaf
                self._hold(leaf, instance, now)
                return
            k = _common_len(child.edge, tokens, i)
            if k < len(child.edge):
                child = self._split(child, k)
            self._hold(child, instance, now)
            node = child
            i += k

    def evict(self, instance: int, max_tokens: int) -> int:
        """Drop ``instance``'s least recently used leaves until ``size(instance) <= max_tokens``.

        Whole nodes are dropped, so the size may end below the bound. Returns the number of tokens dropped.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        size = self._sizes.get(instance, 0)
        if size <= max_tokens:
            return 0
        root = self._root
        heap: list[tuple[float, int, _Node]] = []
        stack = [root]
        while stack:  # iterative: the tree can be thousands of nodes deep
            node = stack.pop()
            held = [c for c in node.children.values() if instance in c.access]
            if node is not root and not held:
                heap.append((node.access[instance], node.uid, node))
            stack.extend(held)
        heapq.heapify(heap)
        dropped = 0
        while heap and size > max_tokens:
            _, _, node = heapq.heappop(heap)
            del node.access[instance]
            size -= len(node.edge)
            dropped += len(node.edge)
            parent = node.parent
            assert parent is not None
            if not node.access:  # held by nobody -> (prefix-closure) no children either
                del parent.children[node.edge[0]]
                node.parent = None
            if parent is not root and not any(instance in c.access for c in parent.children.values()):
                heapq.heappush(heap, (parent.access[instance], parent.uid, parent))
        self._set_size(instance, size)
        return dropped

    def remove_instance(self, instance: int) -> None:
        """Forget everything held for ``instance`` (e.g. it went down or restarted)."""
        held: list[_Node] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            children = [c for c in node.children.values() if instance in c.access]
            held.extend(children)
            stack.extend(children)
        for node in reversed(held):  # parents were collected before their children
            del node.access[instance]
            if not node.access and node.parent is not None:
                del node.parent.children[node.edge[0]]
                node.parent = None
        self._sizes.pop(instance, None)

    # -- internals ---------------------------------------------------------------------------------------

    def _walk(self, tokens: tuple[int, ...], allowed: set[int] | None) -> tuple[int, list[_Node], set[int]]:
        """Follow ``tokens`` down the tree as far as some allowed instance holds it.

        Returns the matched length, the nodes on the path (the last one possibly only partly matched) and
        the allowed instances that hold the last node.
        """
        path: list[_Node] = []
        holders: set[int] = set()
        node, i, n = self._root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            if allowed is None:
                cand = set(child.access)
            else:  # prefix-closed: holders only shrink going down
                cand = {inst for inst in (holders if path else allowed) if inst in child.access}
            if not cand:
                break
            k = _common_len(child.edge, tokens, i)
            i += k
            path.append(child)
            holders = cand
            if k < len(child.edge):
                break
            node = child
        return i, path, holders

    def _hold(self, node: _Node, instance: int, now: float) -> None:
        if instance not in node.access:
            self._sizes[instance] = self._sizes.get(instance, 0) + len(node.edge)
        node.access[instance] = now

    def _split(self, child: _Node, k: int) -> _Node:
        """Split ``child``'s edge after ``k`` tokens; returns the new upper node (same holders and times)."""
        parent = child.parent
        assert parent is not None and 0 < k < len(child.edge)
        mid = _Node(child.edge[:k], parent, next(self._uids))
        mid.access = dict(child.access)
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        parent.children[mid.edge[0]] = mid
        return mid

    def _set_size(self, instance: int, size: int) -> None:
        if size > 0:
            self._sizes[instance] = size
        else:
            self._sizes.pop(instance, None)
