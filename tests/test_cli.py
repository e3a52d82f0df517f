"""The `epserve` command line: the README's main job on a small checkpoint, and make-checkpoint."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epserve.cli import main


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "epserve.cli", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )


def test_make_checkpoint_then_generate(tmp_path):
    ckpt = tmp_path / "ck"
    made = run_cli("make-checkpoint", str(ckpt), "--preset", "tiny", "--fp8", "--seed", "3")
    assert made.returncode == 0, made.stderr
    config = json.loads((ckpt / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert (ckpt / "model.safetensors.index.json").is_file() and (ckpt / "tokenizer.json").is_file()

    gen = run_cli("generate", str(ckpt), "--prompt", "hello there", "--max-tokens", "5", "--ignore-eos",
                  "--dtype", "float32")
    assert gen.returncode == 0, gen.stderr
    assert "prompt: 'hello there'" in gen.stdout and "(length)" in gen.stdout
    chat = run_cli("generate", str(ckpt), "--prompt", "hi", "--chat", "--max-tokens", "3", "--dtype", "float32")
    assert chat.returncode == 0, chat.stderr
    assert "<｜User｜>" in chat.stdout


def test_default_model_is_built_once(tmp_path):
    env = {"EPSERVE_CACHE_DIR": str(tmp_path)}
    first = run_cli("generate", "--max-tokens", "4", env=env)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "tiny-v1" / "config.json").is_file()
    stamp = (tmp_path / "tiny-v1" / "config.json").stat().st_mtime_ns
    again = run_cli("generate", "--max-tokens", "4", env=env)
    assert again.returncode == 0 and (tmp_path / "tiny-v1" / "config.json").stat().st_mtime_ns == stamp


def test_bad_option_values_are_one_line_errors(tmp_path):
    out = run_cli("generate", "--max-tokens", "-1", env={"EPSERVE_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 2 and "max_tokens" in out.stderr and "Traceback" not in out.stderr
    out = run_cli("make-checkpoint", str(tmp_path / "x"), "--preset", "huge")
    assert out.returncode == 2 and "invalid choice" in out.stderr


def test_generate_across_ranks_matches_one_process(make_ckpt):
    ckpt = str(make_ckpt("tiny", dtype="float32"))
    args = ["generate", ckpt, "--prompt", "hello there", "--prompt", "abc", "--max-tokens", "6", "--dtype", "float32"]
    one = run_cli(*args)
    ep = run_cli(*args, "--dp", "2", "--dispatch", "padded", "--overlap", "microbatch")  # (TP: test_parallel)
    assert one.returncode == 0 and ep.returncode == 0, ep.stderr
    tokens = [line for line in one.stdout.splitlines() if line.startswith("tokens:")]
    assert len(tokens) == 2 and tokens == [line for line in ep.stdout.splitlines() if line.startswith("tokens:")]


def test_bad_layouts_are_one_line_errors(make_ckpt, capsys):
    ckpt = str(make_ckpt("tiny", dtype="float32"))
    assert main(["generate", ckpt, "--tp", "3"]) == 2  # in this process: refused before any rank starts
    err = capsys.readouterr().err
    assert "tp=3 does not divide" in err and "Traceback" not in err
    assert main(["generate", ckpt, "--dp", "2", "--nnodes", "2"]) == 2
    assert "master_port" in capsys.readouterr().err
    assert multiprocessing.active_children() == []


def test_serving_commands_refuse_bad_options_before_starting(tmp_path, capsys):
    import socket

    threads = len(threading.enumerate())
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        in_use = f"cannot listen on 127.0.0.1:{port}: Address already in use"
        cases = [
            (["serve", "--port", str(port)], in_use),
            (["router", "--engine", "127.0.0.1:1", "--port", str(port)], in_use),
            (["router", "--engine", "nonsense"], "engine address 'nonsense' is not HOST:PORT"),
            (["router", "--engine", "h:1", "--cache-threshold", "2"], "cache_threshold"),
            (["router", str(tmp_path / "missing"), "--engine", "h:1"], "does not exist"),
            (["serve", "--engine-port", "70000"], "--engine-port"),
            (["serve", "--nnodes", "2"], "serve runs on one host"),
            (["serve", "--prefill-dp", "2"], "--prefill-dp need --disaggregate"),
            (["serve", "--disaggregate", "--dp", "2"], "give each side's layout"),
            (["serve", "--disaggregate", "--decode-tp", "0"], "--decode-tp must be >= 1"),
            (["serve", "--kv-transfer-timeout", "0"], "--kv-transfer-timeout must be > 0"),
            (["router", "--port", "0", "--prefill", "h:1"], "needs both --prefill and --decode"),
            (["router", "--port", "0", "--engine", "h:1", "--prefill", "h:2", "--decode", "h:3"], "cannot be mixed"),
            (["router", "--port", "0"], "at least one engine address"),
        ]
        results = []
        for args, _ in cases:  # in this process: each refusal comes before anything starts
            code = main(args)
            results.append((code, capsys.readouterr().err))
    for (args, message), (code, err) in zip(cases, results):
        assert code == 2, (args, err)
        assert message in err and "Traceback" not in err, (args, err)
    assert len(threading.enumerate()) == threads and multiprocessing.active_children() == []  # nothing started


def test_make_checkpoint_train_then_generate_with_mtp(tmp_path):
    """``make-checkpoint --train`` (the very small ``test`` shape, three steps) writes a checkpoint with an
    MTP layer that ``generate --speculative mtp`` serves; a shape it cannot train is one clear line."""
    ckpt = tmp_path / "trained"
    made = run_cli("make-checkpoint", str(ckpt), "--preset", "test", "--train", "--train-steps", "3",
                   "--dtype", "float32", env={"EPSERVE_NO_PROGRESS": "1"})
    assert made.returncode == 0, made.stderr
    assert json.loads((ckpt / "training.json").read_text())["steps"] == 3
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with ThreadPoolExecutor(2) as pool:
        gen, out = pool.map(lambda args: run_cli(*args), [
            ["generate", str(ckpt), "--prompt", "The value of", "--max-tokens", "6", "--ignore-eos", "--dtype",
             "float32", "--speculative", "mtp", "--num-speculative-tokens", "2"],
            ["make-checkpoint", str(tmp_path / "x"), "--preset", "small", "--train"],
        ])
    assert gen.returncode == 0, gen.stderr
    assert "(length)" in gen.stdout
    assert out.returncode == 2 and "--train trains" in out.stderr and "Traceback" not in out.stderr


def test_engine_defaults_are_the_config_dataclasses(tmp_path, monkeypatch):
    """The engine's defaults are declared once, in config/engine.py: the engine commands' options,
    ``build_engine_config``'s (and so ``LLM``'s) keywords and the config they build all agree with it."""
    import inspect

    from epserve.cli import build_parser
    from epserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
    from epserve.engine.args import engine_options
    from epserve.engine.llm import LLM
    from epserve.engine.options import build_engine_config

    keywords = {k: p.default for k, p in inspect.signature(build_engine_config).parameters.items() if k != "model"}
    for command in ("generate", "serve", "engine"):
        options = engine_options(build_parser().parse_args([command]))
        assert options == {k: keywords[k] for k in options}, command
    assert set(keywords) - set(options) == {"memory_utilization"}  # no option for it (--gpu-memory-utilization
    # is memory_fraction: a share of the device's total memory, not of what the weights leave free)
    llm_init = inspect.signature(LLM.__init__).parameters
    assert (llm_init["dtype"].default, llm_init["device"].default) == (keywords["dtype"], keywords["device"])

    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path))
    config = build_engine_config()  # the built-in tiny model
    assert (config.cache, config.scheduler, config.parallel) == (CacheConfig(), SchedulerConfig(), ParallelConfig())
    assert config == EngineConfig(config.model, config.model_path)


def test_disaggregated_serving_keeps_mtp_off_unless_asked():
    """Prefill and decode instances must agree on the MTP layer's KV: the default (each engine probing whether MTP
    pays) is off there; --speculative mtp (or an explicit 0) is kept as given."""
    from epserve.cli import _disaggregated_speculation, build_parser

    parse = build_parser().parse_args
    off = {"speculative": None, "num_speculative_tokens": 0}
    assert _disaggregated_speculation(parse(["serve", "--disaggregate"])) == off
    assert _disaggregated_speculation(parse(["serve", "--disaggregate", "--speculative", "auto"])) == off
    assert _disaggregated_speculation(parse(["serve", "--disaggregate", "--speculative", "mtp"])) == {}
    assert _disaggregated_speculation(parse(["serve", "--disaggregate", "--num-speculative-tokens", "0"])) == {}


def test_vllm_and_sglang_flag_names_are_aliases_of_ours():
    from epserve.cli import build_parser
    from epserve.engine.args import apply_model_path, engine_options
    from epserve.engine.options import build_engine_config

    parse = build_parser().parse_args
    common = ["--max-model-len", "512", "--no-prefix-caching", "--no-cuda-graph"]
    ours = engine_options(parse(["serve", "--tp", "2", "--dp", "4", "--max-num-seqs", "8", *common,
                                 "--speculative", "mtp", "--num-speculative-tokens", "2"]))
    assert (ours["tp"], ours["dp"], ours["speculative"], ours["num_speculative_tokens"]) == (2, 4, "mtp", 2)
    vllm = ["--max-num-seqs", "8", "--max-model-len", "512", "--no-enable-prefix-caching", "--enforce-eager",
            "--enable-expert-parallel", "--speculative-config",
            '{"method": "deepseek_mtp", "num_speculative_tokens": 2}']
    sglang = ["--tp-size", "2", "--dp-size", "4", "--max-running-requests", "8", "--context-length", "512",
              "--disable-radix-cache", "--disable-cuda-graph", "--speculative-config",
              '{"method": "mtp", "num_speculative_tokens": 2}']
    for argv in (["--tensor-parallel-size", "2", "--data-parallel-size", "4", *vllm], ["-tp", "2", "-dp", "4", *vllm],
                 sglang):
        for command in ("serve", "engine"):
            assert engine_options(parse([command, *argv])) == ours, (command, argv)
    assert engine_options(parse(["serve", "--speculative-config", '{"method": "mtp"}']))["num_speculative_tokens"] == 1
    off = engine_options(parse(["serve", "--speculative", "mtp", "--num-speculative-tokens", "0"]))
    assert off["num_speculative_tokens"] == 0 and build_engine_config(**off).num_spec_tokens == 0  # 0: off
    for flag in ("--gpu-memory-utilization", "--mem-fraction-static"):
        options = engine_options(parse(["serve", flag, "0.85"]))
        assert (options["memory_fraction"], options["memory_budget_bytes"]) == (0.85, None)
    args = parse(["serve", "--model-path", "/ckpt"])
    apply_model_path(args)
    assert args.model == "/ckpt"


def test_bad_alias_values_are_one_line_errors(tmp_path, capsys):
    cases = [
        (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
        (["engine", "--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be in (0, 1]"),
        (["serve", "--speculative-config", "mtp"], "--speculative-config is not JSON"),
        (["serve", "--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
        (["serve", "--speculative-config", '{"method": "eagle"}'], "method 'eagle' is not supported"),
        (["serve", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'],
         "must be an integer >= 1"),
        (["serve", "--speculative-config", '{"method": "mtp", "model": "x"}'], "'model' not supported"),
        (["serve", "--speculative", "mtp", "--speculative-config", '{"method": "mtp"}'], "give one or the other"),
        (["serve", "/a", "--model-path", "/b"], "name different checkpoints"),
        (["serve", "--chat-template", "{% if %}"],
         "--chat-template (given as text): the chat template does not compile"),
        (["router", "--engine", "h:1", "--chat-template", str(tmp_path / "none.jinja")], "looks like a file path"),
    ]
    for args, message in cases:  # in this process: refused before anything starts
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (args, err)
    assert multiprocessing.active_children() == []
    with pytest.raises(SystemExit) as info:  # argparse's own one-line error
        main(["serve", "--memory-budget-gb", "8", "--gpu-memory-utilization", "0.5"])
    assert info.value.code == 2 and "not allowed with argument --memory-budget-gb" in capsys.readouterr().err


def test_vllm_and_sglang_flags_without_an_equivalent(capsys):
    """Flags vLLM and SGLang users pass that mean nothing here: a one-line error naming the flag, why, and
    where the table is (not argparse's "unrecognized arguments"); the harmless ones are accepted."""
    from epserve.cli import build_parser
    from epserve.engine.args import FOREIGN_FLAGS, engine_options, foreign_flags

    cases = [
        (["serve", "--pipeline-parallel-size", "2"],
         "--pipeline-parallel-size 2: no equivalent in epserve: no pipeline"),
        (["engine", "--pp-size", "4"], "give --dp and --tp"),
        (["serve", "--dp", "2", "--ep-size", "4"], "--ep-size 4: no equivalent in epserve: expert parallelism always"),
        (["serve", "--tokenizer", "/tok"], "the checkpoint's own tokenizer"),
        (["generate", "--cuda-graph-sizes", "1", "2", "4"], "--cuda-graph-sizes 1 2 4: no equivalent"),
        (["serve", "--chunked-prefill-size", "4096"], "--max-num-batched-tokens"),
        (["serve", "--headless"], "--headless: no equivalent in epserve: a world over several hosts is --nnodes"),
        (["serve", "--speculative-algorithm", "NEXTN"], "--speculative mtp"),
    ]
    for args, message in cases:  # in this process: refused before anything starts
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "docs/serving.md" in err, (args, err)
        assert "unrecognized" not in err and "Traceback" not in err and err.count("\n") == 1, (args, err)
    parse = build_parser().parse_args
    args = parse(["serve", "--trust-remote-code", "--enable-ep-moe", "-pp", "1", "--dp", "2", "--ep-size", "2"])
    assert foreign_flags(args) == ["--trust-remote-code changes nothing: epserve runs no code from the checkpoint",
                                   "--enable-ep-moe changes nothing: the MoE layers always run expert-parallel over "
                                   "all dp x tp ranks", "-pp 1 changes nothing", "--ep-size 2 changes nothing"]
    assert engine_options(args) == engine_options(parse(["serve", "--dp", "2"]))
    table = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    assert [name for names, *_ in FOREIGN_FLAGS for name in names
            if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", table)] == []  # (the table names each)
