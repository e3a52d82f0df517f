"""vLLM's (and SGLang's) flags as their users type them, at the command line's level: each accepted with its
meaning here (the options and configs it makes), or refused in one line naming what to use instead, never
argparse's bare error. (``test_responses_api`` serves the accepted ones, ``test_router_output_flags`` the output
flags.)"""

from __future__ import annotations

import multiprocessing

import pytest

from epserve.cli import build_parser, main
from epserve.engine.args import engine_options
from epserve.engine.options import build_engine_config
from epserve.launcher.args import router_options
from epserve.launcher.vllm_flags import judge_vllm_flags

parse = build_parser().parse_args


def test_engine_flags_mean_what_vllm_users_expect(make_ckpt):
    for command in ("serve", "engine", "generate"):
        vllm = engine_options(parse([command, "--dtype", "auto", "--kv-cache-dtype", "fp8_e4m3",
                                     "--enable-prefix-caching", "--enable-chunked-prefill"]))
        ours = engine_options(parse([command, "--dtype", "auto", "--kv-cache-dtype", "fp8"]))
        assert vllm == ours and ours["kv_cache_dtype"] == "fp8" and ours["enable_prefix_caching"] is True
        assert ours["max_num_batched_tokens"] == engine_options(parse([command]))["max_num_batched_tokens"]
    for dtype in ("float32", "bfloat16"):  # auto: the checkpoint's own
        assert build_engine_config(make_ckpt("tiny", dtype=dtype), dtype="auto").dtype == dtype
    config = build_engine_config(make_ckpt("tiny", dtype="float32"), **engine_options(parse(
        ["serve", "--kv-cache-dtype", "fp8_e4m3"])))
    assert config.cache.kv_cache_dtype == "fp8"


def test_router_flags_mean_what_vllm_users_expect():
    for command in (["serve"], ["router", "--engine", "h:1"]):
        options = router_options(parse([*command, "--tool-call-parser", "deepseekv3", "--uvicorn-log-level", "warning",
                                        "--enable-auto-tool-choice"]))
        assert (options.tool_call_parser, options.log_level) == ("deepseek_v3", "WARNING")
        assert router_options(parse([*command, "--tool-call-parser", "deepseekv31"])).tool_call_parser == "deepseek_v31"
        assert router_options(parse(["--log-level", "debug", *command])).log_level == "DEBUG"  # (the default)
        assert router_options(parse(command)).tool_call_parser is None
        options = router_options(parse([*command, "--max-logprobs", "5", "--response-role", "model",
                                        "--return-tokens-as-token-ids"]))
        assert (options.max_logprobs, options.response_role, options.return_tokens_as_token_ids) == (5, "model", True)
        options = router_options(parse(command))  # vLLM's defaults
        assert (options.max_logprobs, options.response_role, options.return_tokens_as_token_ids) == (
            20, "assistant", False)
    args = parse(["serve", "--seed", "0", "--disable-log-requests", "--max-logprobs", "20", "--response-role",
                  "assistant"])
    assert judge_vllm_flags(args) == ["--seed 0 changes nothing: it is the engine's own",
                                      "--disable-log-requests changes nothing: the router logs no line per request",
                                      "--max-logprobs 20 changes nothing: it is the default"]
    assert judge_vllm_flags(parse(["generate", "--seed", "7"])) == []  # generate's --seed: its sampling seed
    assert judge_vllm_flags(parse(["serve", "--max-logprobs", "0", "--response-role", "model",
                                   "--return-tokens-as-token-ids"])) == []  # (their meaning: test_router_output_flags)


def test_flags_without_a_meaning_here_are_one_line_errors(capsys):
    cases = [
        (["serve", "--seed", "3"], "--seed 3: the engine's random state for unseeded requests always starts at 0"),
        (["engine", "--seed", "1"], "give each request a seed"),
        (["serve", "--max-logprobs", "21"], "--max-logprobs 21: the engine gives at most 20 logprobs a token"),
        (["router", "--engine", "h:1", "--max-logprobs", "-1"], "choose one in [0, 20]"),
        (["router", "--engine", "h:1", "--response-role", " "], "--response-role: give a role"),
        (["serve", "--tool-call-parser", "hermes"], "--tool-call-parser hermes: no such parser here; DeepSeek-V3/R1"),
        (["serve", "--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2: the FP8 latent cache here is e4m3"),
        (["generate", "--kv-cache-dtype", "fp8_ds_mla"], "use --kv-cache-dtype fp8 (or fp8_e4m3"),
        (["serve", "--uvicorn-log-level", "loud"], "--uvicorn-log-level loud: choose from critical, error, warning"),
        (["serve", "--enable-prefix-caching", "--no-prefix-caching"], "contradict each other; give one"),
    ]
    for args, message in cases:  # in this process: refused before anything starts
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2 and message in err, (args, err)
        assert "usage:" not in err and "Traceback" not in err and err.count("\n") == 1, (args, err)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("flag", ["--disable-log-requests", "--max-logprobs", "--uvicorn-log-level",
                                  "--return-tokens-as-token-ids", "--response-role", "--tool-call-parser"])
def test_router_flags_are_on_serve_and_router_only(flag, capsys):
    value = [] if flag in ("--disable-log-requests", "--return-tokens-as-token-ids") else ["x"]
    with pytest.raises(SystemExit):
        parse(["engine", flag, *value])
    assert "unrecognized arguments" in capsys.readouterr().err
