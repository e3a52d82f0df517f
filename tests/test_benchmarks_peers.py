"""The peer comparisons' own parts, off their peers (llama.cpp's build and vLLM's venv run in the benchmarks,
minutes on 2 cores): epserve's and transformers' sides counted as the peers count, and the tables written
between the document's markers."""

from __future__ import annotations

import json

from tests.bench_harness import bench_module


def test_vs_llamacpp_epserve_side_and_the_table(make_ckpt, tmp_path):
    """The llama.cpp comparison's own parts (the llama.cpp build itself runs in the benchmark, minutes on 2
    cores): llama-batched-bench's JSON lines read, epserve's side counted as they count, the table put
    between the document's markers and replaced on the next run."""
    from epserve import LLM

    v = bench_module("vs_llamacpp")
    lines = ('main: n_kv_max = 512, n_batch = 2048\n'
             '{"n_kv_max": 512, "pp": 64, "tg": 8, "pl": 1, "t_pp": 0.148783, "speed_pp": 430.156677, '
             '"t_tg": 0.096352, "speed_tg": 83.028893}\n'
             '{"n_kv_max": 512, "pp": 64, "tg": 8, "pl": 16, "t_pp": 0.6, "speed_pp": 1706.6, "t_tg": 0.2, '
             '"speed_tg": 640.0}\n')
    rows = v.parse_batched_bench(lines)
    assert set(rows) == {1, 16} and rows[16]["speed_tg"] == 640.0 and rows[1]["speed_pp"] == 430.156677

    llm = LLM(make_ckpt("tiny", dtype="bfloat16"), dtype="bfloat16", num_blocks=64, enable_prefix_caching=False)
    measured = v.epserve_batched(llm, [1, 4, 16], prompt_len=8, steps=3, seed=0)
    assert set(measured) == {1, 4, 16} and all(m["prefill"] > 0 and m["decode"] > 0 for m in measured.values())
    assert not llm.engine.has_unfinished_requests()
    tokens, logprobs = v.epserve_greedy(llm, [5, 6, 7], 4)
    assert len(tokens) == len(logprobs) == 4 and all(lp <= 0 for lp in logprobs)

    table = {"epserve": {"decode_b1": 200.0, "decode_b4": 400.0, "decode_b16": 700.0, "prefill_b16": 2000.0,
                         "served_out_tok_s": 220.0},
             "llama.cpp": {"decode_b1": 250.0, "decode_b4": 400.0, "decode_b16": 560.0, "prefill_b16": 1600.0,
                           "served_out_tok_s": 160.0}}
    result = {"timings": {"table": table}, "machine": "test machine", "llama_cpp_python": "0.3.36",
              "date": "2026-12-04", "agreement": {"equal": 64, "tokens": 64, "max_logprob_diff": 8e-6}}
    text = v.markdown(result, "python benchmarks/vs_llamacpp.py")
    assert "| batch-1 decode (tok/s) | 200 | 250 | **0.80×** |" in text
    assert "| batch-16 decode (tok/s) | 700 | 560 | **1.25×** |" in text and "64/64 greedy tokens equal" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n\n{v.BEGIN}\nold table\n{v.END}\n\nafter\n")
    v.write_docs(text, doc)
    v.write_docs(text, doc)
    written = doc.read_text()
    assert written.count(v.BEGIN) == 1 and "old table" not in written and written.count("batch-1 decode") == 1
    assert written.startswith("# B\n\nbefore\n\n") and written.endswith(f"{v.END}\n\nafter\n")


def test_vs_peers_epserve_and_transformers_sides_and_the_tables(make_ckpt, tmp_path):
    """The peers comparison's own parts (vLLM's install and llama.cpp's build run in the benchmark, minutes on 2
    cores): epserve's offline side, transformers' greedy tokens equal to epserve's in fp32 and its batches
    counted, the vLLM environment for MLA widths it does and does not take, medians, ratios (times reversed),
    and the section added at the end of the document, then replaced."""
    from epserve import LLM

    v = bench_module("vs_peers")
    report = bench_module("peers_report")
    ckpt = make_ckpt("tiny")
    llm = LLM(ckpt, dtype="float32", num_blocks=128, enable_prefix_caching=False)
    prompt = [5, 6, 7, 8, 9]
    ours = v.lc.epserve_greedy(llm, prompt, 6)
    assert v.epserve_offline(llm, v.offline_prompts(vocab=500)[:4]) > 0
    model = v.load_transformers(ckpt, v.torch.float32)
    agree = v.compare(ours, v.transformers_greedy(model, prompt, 6))
    assert agree["equal"] == agree["tokens"] == 6 and agree["first_difference"] is None, agree
    assert agree["max_logprob_diff"] < 1e-4
    measured = v.transformers_batched(model, [1, 4], prompt_len=6, steps=2, vocab=500, seed=0)
    assert set(measured) == {1, 4} and all(m["prefill"] > 0 and m["decode"] > 0 for m in measured.values())
    off = v.compare(([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), ([1, 2, 9, 4], [-0.1, -0.25, -2.0, -0.4]))
    assert off["equal"] == 3 and off["first_difference"] == 2 and abs(off["max_logprob_diff"] - 0.05) < 1e-9

    assert v.peer_vllm.vllm_env(ckpt, 2)["VLLM_MLA_DISABLE"] == "1"
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({"kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    e = v.peer_vllm.vllm_env(wide, 2)
    assert "VLLM_MLA_DISABLE" not in e and e["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and e["VLLM_USE_AOT_COMPILE"] == "0"

    def rnd(offline: float, decode: float) -> dict:
        return {"offline": offline, **{b: {"prefill": 10 * decode, "decode": decode * b} for b in (1, 4, 16)}}

    def srv(tok_s: float, ttft: float, tpot: float) -> dict:
        return {"output_token_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": tpot}

    unmeasured = {**rnd(200, 50), 1: {"prefill": 500.0, "decode": float("nan")}}  # left out of the median
    runs = {"epserve": [rnd(300, 100), rnd(310, 90), rnd(900, 110)], "vLLM": [rnd(200, 50), unmeasured, rnd(200, 60)],
            "transformers": [rnd(100, 25)] * 3}
    served = {"epserve": [srv(200, 100, 20)], "vLLM": [srv(160, 150, 25)], "llama.cpp": [srv(250, 80, 10)]}
    rows = report.table(runs, served, [1, 4, 16])
    assert rows["epserve"]["offline_out_tok_s"] == 310 and rows["epserve"]["decode_b16"] == 1600
    assert "served_out_tok_s" not in rows["transformers"] and "decode_b1" not in rows["llama.cpp"]
    result = {"table": rows, "agreement": {"vLLM": {"equal": 128, "tokens": 128, "max_logprob_diff": 2e-5}},
              "vllm": {"attention": "CPU_ATTN", "mla_disabled": True}, "load": [9.5, 2.0, 3.0]}
    text = report.markdown("small-mla", result)
    assert "vLLM's attention: CPU_ATTN (`VLLM_MLA_DISABLE=1`)" in text
    assert "behind on " in text and "served TTFT vs llama.cpp (0.80×)" in text and "vs vLLM (" not in text
    assert "short of served output vs vLLM: 1.25× (goal ≥ 1.3×)" in text and "decode vs vLLM:" not in text
    assert "| | epserve | vLLM | llama.cpp | transformers | epserve / vLLM |" in text
    assert "| batch-1 decode (tok/s) | 100 | 55 | – | 25 | **1.82×** | – | **4.00×** |" in text
    assert "| served: median TTFT (ms) | 100 | 150 | 80 | – | **1.50×** | **0.80×** | – |" in text
    assert "MLA widths" in text and "vLLM 128/128" in text and "load average through the timings: 2.0–9.5" in text
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# B\n\nbefore\n")
    report.write_docs(text, doc)
    report.write_docs(text.replace("100", "101"), doc)
    written = doc.read_text()
    assert written.startswith("# B\n\nbefore\n\n" + report.HEADING) and written.endswith(f"{report.END}\n")
    assert written.count(report.HEADING) == 1 and "| 101 |" in written and "| 100 |" not in written
