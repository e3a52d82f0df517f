"""Shared helpers of the radix-tree and router-policy tests: a manual clock, the tree's structural invariants
and a token-range shorthand; of the in-process HTTP tests: the router with a scripted engine behind it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from epserve.messages.engine import GeneratedTokens
from epserve.router.instances import Router
from epserve.router.radix_tree import PrefixTree
from epserve.router.server import RouterOptions, build_router
from epserve.rpc.proto import engine_pb2 as pb
from epserve.tokenizer import Tokenizer, write_tokenizer_files


class ScriptedRouter(Router):
    """The router with a scripted engine instance behind it (the HTTP layer's tests): model info as an
    engine gives it, every request answered with ``tokens`` one per message (the last finishing with
    ``finish_reason``), each request's prompt and params recorded. Subclass it to set the class fields."""

    max_model_len = 1024
    tokens: list[int] = [5]
    finish_reason = "stop"
    prompts: list[list[int]] = []
    params: list[Any] = []

    @property
    def info(self) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(max_model_len=self.max_model_len, vocab_size=512)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def refresh(self) -> None:
        pass

    async def generate(self, request_id, token_ids, params):
        self.prompts.append(list(token_ids))
        self.params.append(params)
        n = len(self.tokens)
        for i, t in enumerate(self.tokens, start=1):
            yield GeneratedTokens(request_id, (t,), (), len(token_ids), 0, i, self.finish_reason if i == n else None)


def build_over(router_class: type[Router], options: RouterOptions, api_key: str | None = None):
    """The HTTP server ``epserve router`` builds from ``options``, over ``router_class``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("epserve.router.instances.Router", router_class)
        server = build_router(options, api_key=api_key)
    assert isinstance(server.router, router_class)
    return server


def scripted_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Tokenizer]:
    """A small byte-level tokenizer's folder (the router's --model) and the tokenizer."""
    tok_dir = write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=512, model_max_length=2048)
    return tok_dir, Tokenizer.from_dir(tok_dir)


@contextlib.contextmanager
def openai_over(router_class: type[Router], options: RouterOptions) -> Iterator[openai.OpenAI]:
    """The ``openai`` client talking to ``build_over(router_class, options)`` in process."""
    server = build_over(router_class, options)
    with TestClient(server.app) as http:
        yield openai.OpenAI(base_url=f"{http.base_url}/v1", api_key="none", http_client=http, max_retries=0)


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
