"""Shared helpers of the radix-tree and router-policy tests: a manual clock, the tree's structural invariants
and a token-range shorthand."""

from __future__ import annotations

from epserve.router.radix_tree import PrefixTree


class FakeClock:
    """Returns ``t``; tests move it explicitly so LRU order is deterministic."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def tick(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t


def check_invariants(tree: PrefixTree) -> None:
    """Structural invariants, via the tree's internals: sizes, prefix-closure, no orphan or empty nodes."""
    sizes: dict[int, int] = {}
    stack = [tree._root]
    while stack:
        node = stack.pop()
        for first, child in node.children.items():
            assert child.edge and child.edge[0] == first
            assert child.parent is node
            assert child.access, "a node held by nobody must have been removed"
            if node is not tree._root:
                assert set(child.access) <= set(node.access), "holders must be prefix-closed"
            for inst in child.access:
                sizes[inst] = sizes.get(inst, 0) + len(child.edge)
            stack.append(child)
    assert {i: tree.size(i) for i in tree.instances} == sizes
    assert tree.instances == set(sizes)


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))
