"""Issue 45 (6): the router's options carry the API key, whether given by flag, file or ``EPSERVE_API_KEY``,
and take it out of the environment, so no process ``epserve serve`` starts inherits it
(``tests/serve/test_router_abuse.py`` reads their environments); the key is apart from the engine token
(``tests/serve/test_router_budget.py``: a router given only the key calls its engines in plaintext)."""

from __future__ import annotations

import os

import pytest

from epserve import env
from epserve.cli import build_parser
from epserve.launcher.args import router_options, set_api_key

API_KEY = "sk-issue-45-key"


@pytest.mark.parametrize("given", ["flag", "file", "environment"])
def test_router_options_carry_the_key_and_take_it_out_of_the_environment(given, tmp_path, monkeypatch):
    (tmp_path / "key").write_text(API_KEY + "\n")
    argv = {"flag": ["--api-key", API_KEY], "file": ["--api-key-file", str(tmp_path / "key")], "environment": []}
    monkeypatch.setenv(env.API_KEY, API_KEY if given == "environment" else "another-key")
    monkeypatch.delenv(env.ENGINE_TOKEN, raising=False)
    args = build_parser().parse_args(["router", "--engine", "127.0.0.1:1", *argv[given]])
    assert set_api_key(args) == API_KEY and env.API_KEY not in os.environ
    options = router_options(args, ("127.0.0.1:1",))
    assert options.api_key == API_KEY and options.engine_token is None
    assert API_KEY not in repr(options)
