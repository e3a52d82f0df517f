"""Routing policies: which engine instance serves a request.

The router calls ``policy.choose(token_ids, loads)`` for every request, where ``loads`` maps each *healthy*
instance to its number of requests in flight; only those instances may be returned.

* ``round_robin`` -- cycle over the instance indices in sorted order, skipping unhealthy ones.
* ``least_load`` -- the instance with the fewest requests in flight (ties: smallest index).
* ``cache_aware`` -- keep a :class:`~epserve.router.radix_tree.PrefixTree` of the prompts sent to each
  instance. While the load is balanced, send a request to the instance that (probably) has the longest
  prefix of it cached, if that prefix is a large enough fraction of the prompt; otherwise, and whenever the
  load is badly imbalanced, fall back to the least loaded instance. This trades prefix-cache hits against
  load balance (the idea of SGLang's sgl-router cache-aware policy).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from epserve.router.radix_tree import PrefixTree

__all__ = [
    "POLICIES",
    "CacheAwarePolicy",
    "LeastLoadPolicy",
    "NoInstanceError",
    "Policy",
    "RoundRobinPolicy",
    "make_policy",
]

POLICIES = ("cache_aware", "round_robin", "least_load")


class NoInstanceError(RuntimeError):
    """No healthy engine instance to route to."""


class Policy(ABC):
    """Picks an engine instance for each request."""

    name: str

    @abstractmethod
    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int]) -> int:
        """Return one key of ``loads`` (healthy instance -> requests in flight) to serve ``token_ids``.

        Raises :class:`NoInstanceError` when ``loads`` is empty. Deterministic given the same state and inputs.
        """

    def forget(self, instance: int) -> None:  # noqa: B027 -- optional hook, deliberately a no-op
        """``instance`` went unhealthy or restarted: drop what is known about its cache."""


def _least_loaded(loads: Mapping[int, int]) -> int:
    if not loads:
        raise NoInstanceError("no healthy engine instance to route to")
    return min(loads, key=lambda inst: (loads[inst], inst))


class RoundRobinPolicy(Policy):
    """Cycle over the instance indices in sorted order, skipping those not in ``loads``."""

    name = "round_robin"

    def __init__(self) -> None:
        self._last: int | None = None
        self._lock = threading.Lock()

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int]) -> int:
        if not loads:
            raise NoInstanceError("no healthy engine instance to route to")
        with self._lock:
            ordered = sorted(loads)
            last = self._last
            nxt = ordered[0] if last is None else next((i for i in ordered if i > last), ordered[0])
            self._last = nxt
            return nxt


class LeastLoadPolicy(Policy):
    """The instance with the fewest requests in flight; ties go to the smallest index."""

    name = "least_load"

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int]) -> int:
        return _least_loaded(loads)


class CacheAwarePolicy(Policy):
    """Prefer the instance holding the longest cached prefix, unless the load is imbalanced.

    ``choose``:

    1. The load is *imbalanced* when ``max - min > balance_abs_threshold`` **and**
       ``max > balance_rel_threshold * min`` over the healthy instances; then the least loaded one wins.
    2. Otherwise the healthy instance with the longest matched prefix (ties: most recently used, then
       smallest index) wins if ``matched / len(token_ids) > cache_threshold``; else the least loaded one.
    3. The prompt is recorded in the tree for the chosen instance, and that instance's part of the tree is
       evicted (LRU) to 90% of ``max_tree_tokens`` when it grows past it.

    ``last_decision`` is ``"cache_hit"``, ``"least_load"`` or ``"imbalanced"`` after each ``choose``.
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_tree_tokens: int = 1 << 22,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (isinstance(cache_threshold, (int, float)) and 0.0 <= cache_threshold <= 1.0):
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if not (isinstance(balance_abs_threshold, (int, float)) and balance_abs_threshold >= 0):
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold!r}")
        if not (
            isinstance(balance_rel_threshold, (int, float))
            and math.isfinite(balance_rel_threshold)
            and balance_rel_threshold >= 1.0
        ):
            raise ValueError(
                f"balance_rel_threshold must be a finite number >= 1, got {balance_rel_threshold!r}"
            )
        if not (isinstance(max_tree_tokens, int) and max_tree_tokens >= 1):
            raise ValueError(f"max_tree_tokens must be an integer >= 1, got {max_tree_tokens!r}")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_tokens = max_tree_tokens
        self.tree = PrefixTree(clock=clock)
        self.last_decision = ""
        self._lock = threading.Lock()

    def choose(self, token_ids: Sequence[int], loads: Mapping[int, int]) -> int:
        if not loads:
            raise NoInstanceError("no healthy engine instance to route to")
        tokens = tuple(token_ids)
        with self._lock:
            chosen, self.last_decision = self._decide(tokens, loads)
            self.tree.insert(tokens, chosen)
            if self.tree.size(chosen) > self.max_tree_tokens:
                # Evict a tenth below the bound: an eviction walks all of the instance's nodes, so
                # it should happen once in many requests, not on every one at the bound.
                self.tree.evict(chosen, self.max_tree_tokens * 9 // 10)
            return chosen

    def forget(self, instance: int) -> None:
        with self._lock:
            self.tree.remove_instance(instance)

    def _decide(self, tokens: tuple[int, ...], loads: Mapping[int, int]) -> tuple[int, str]:
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return _least_loaded(loads), "imbalanced"
        if tokens:
            # No touch: the chosen instance's path is refreshed by the insert that follows.
            matched, inst = self.tree.match(tokens, instances=loads.keys(), touch=False)
            if inst is not None and matched / len(tokens) > self.cache_threshold:
                return inst, "cache_hit"
        return _least_loaded(loads), "least_load"


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Build the policy called ``name`` (one of :data:`POLICIES`); ``kwargs`` only apply to ``cache_aware``."""
    if name == "cache_aware":
        return CacheAwarePolicy(**kwargs)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_load":
        return LeastLoadPolicy()
    raise ValueError(f"unknown routing policy {name!r}; valid choices: {', '.join(POLICIES)}")
