"""epserve beside llama.cpp on the `small` preset, on this machine's CPU, in one run.

    .venv/bin/python benchmarks/vs_llamacpp.py [--repeats 2] [--threads 2] [--write-docs]
    .venv/bin/python benchmarks/vs_llamacpp.py --quant q4_0 --batches 1 16 --served-repeats 0

1. **llama.cpp** is built from the source that the ``llama-cpp-python`` sdist on PyPI carries
   (``--llama-cpp-python``; downloaded with pip, built with CMake, kept in ``--cache`` between runs):
   ``llama-batched-bench``, ``llama-server`` and ``llama-quantize``, and ``vs_llamacpp_greedy.cpp`` linked
   against its libraries.
2. The checkpoint is converted to GGUF (architecture ``deepseek2``, MLA) by the sdist's own
   ``convert_hf_to_gguf.py``: fp32 for the agreement check, bf16 for the timings. Our tiny tokenizer is
   not one the converter knows by hash; it is written with DeepSeek-V3's pre-tokenizer name, and both
   sides are given token ids, so tokenization never enters the comparison.
3. **Agreement** (fp32; llama.cpp's KV cache in fp32, flash attention off): 64 greedy tokens from the
   same prompt, equal, and their logprobs within ``--logprob-atol``.
4. **Timings** (bf16, ``--threads`` threads each, alternated ``--repeats`` times, medians):
   decode at batch 1/4/16 and batch-16 prefill of 64-token prompts, as ``llama-batched-bench`` counts them
   (tokens / time of the phase; epserve: the same decode steps and the same prefill, in one engine);
   served: ``epserve bench serve`` (64 requests, concurrency 16, 256 tokens in, 32 out) against
   ``epserve serve`` and ``llama-server --parallel 16``.

``--quant q4_0``: the timings at four bits, each side in its own format of the same bf16 weights. llama.cpp
runs the bf16 GGUF quantized by the build's ``llama-quantize ... Q4_0`` (its mix for that type: 32-value blocks
with one f16 scale; the tensors it keeps in other types, such as the output matrix, as it chooses); epserve
runs the NVFP4 checkpoint that ``make-checkpoint --quantization nvfp4`` writes from the same weights (routed,
shared and dense MLPs in NVFP4; attention, gates, embedding and lm_head in bf16). The agreement check stays in
fp32: the two four-bit formats round the weights differently, so their outputs are not compared; the table
gives each side's bytes on disk.

Prints the table, writes JSON (``--json``); ``--write-docs`` puts the table into docs/benchmarks.md
between its ``vs_llamacpp`` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from common import bench_serve, serving, small_checkpoint, wait_healthy, wide_vocab_checkpoint
from tqdm import tqdm

from epserve import LLM, SamplingParams
from epserve.parallel.launch import free_port
from epserve.presets import make_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- vs_llamacpp:begin -->", "<!-- vs_llamacpp:end -->"  # the bf16 table's (markers("bf16"))
TARGETS = ("llama-batched-bench", "llama-server", "llama-quantize")
QUANTS = {"bf16": "bf16", "q4_0": "Q4_0"}  # --quant: llama.cpp's type (epserve: bf16, or NVFP4 beside Q4_0)
GREEDY = "vs_llamacpp_greedy"  # our greedy decoder on llama.cpp's C API, linked against the build's libraries
SERVED = ["--num-prompts", "64", "--max-concurrency", "16", "--random-input-len", "256", "--random-output-len", "32"]


# ---- llama.cpp: the source, the build, the GGUF files ---------------------------------------------


def llama_source(version: str, cache: Path) -> Path:
    """The llama.cpp tree inside the ``llama-cpp-python`` sdist of ``version`` (downloaded once)."""
    tree = cache / f"llama_cpp_python-{version}"
    if not (tree / "vendor" / "llama.cpp" / "CMakeLists.txt").exists():
        cache.mkdir(parents=True, exist_ok=True)
        # (pip reads the sdist's metadata in an isolated build environment: its build backend comes from PyPI)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(cache)], check=True)
        with tarfile.open(cache / f"llama_cpp_python-{version}.tar.gz") as tar:
            tar.extractall(cache, filter="data")
    return tree / "vendor" / "llama.cpp"


def build_llamacpp(source: Path, build: Path) -> Path:
    """``TARGETS`` built in Release for this CPU (``GGML_NATIVE``) into ``build``; its bin folder."""
    bin_dir = build / "bin"
    if all((bin_dir / t).exists() for t in (*TARGETS, GREEDY)):
        return bin_dir
    print(f"building llama.cpp ({', '.join(TARGETS)}) in {build}: minutes on 2 cores", flush=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_USE_PREBUILT_UI=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
                   check=True, stdout=subprocess.DEVNULL)
    libs = [build / "src" / "libllama.a",
            *(build / "ggml" / "src" / f"lib{n}.a" for n in ("ggml", "ggml-cpu", "ggml-base"))]
    subprocess.run(["g++", "-O2", "-std=c++17", str(Path(__file__).with_name(f"{GREEDY}.cpp")), "-I",
                    str(source / "include"), "-I", str(source / "ggml" / "include"), *map(str, libs), "-fopenmp",
                    "-lpthread", "-ldl", "-o", str(bin_dir / GREEDY)], check=True)
    return bin_dir


# The converter, run in a child with the sdist's gguf-py first on the path. The preset's tokenizer is
# not in the converter's table of pre-tokenizer hashes; it gets DeepSeek-V3's name (prompts are ids).
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "deepseek-v3"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def to_gguf(source: Path, checkpoint: Path, outtype: str) -> Path:
    """``checkpoint`` as a ``deepseek2`` GGUF file in ``outtype`` (f32, bf16), beside it, made once."""
    out = checkpoint.with_name(f"{checkpoint.name}.{outtype}.gguf")
    if not out.exists():
        tmp = out.with_suffix(".partial")
        subprocess.run([sys.executable, "-c", _CONVERT, str(source), str(checkpoint), "--outtype", outtype,
                        "--outfile", str(tmp)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def quantize_gguf(bin_dir: Path, gguf: Path, qtype: str, threads: int) -> Path:
    """``gguf`` quantized to llama.cpp's ``qtype`` (``Q4_0``) by the build's ``llama-quantize``, beside it,
    made once."""
    out = gguf.with_name(f"{gguf.name.removesuffix('.gguf')}.{qtype.lower()}.gguf")
    if not out.exists():
        tmp = out.with_suffix(".partial")
        subprocess.run([str(bin_dir / "llama-quantize"), str(gguf), str(tmp), qtype, str(threads)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def models(args: argparse.Namespace, source: Path, bin_dir: Path) -> tuple[Path, Path]:
    """The timed pair for ``--quant``: epserve's checkpoint and llama.cpp's GGUF, both of the bf16 `small`
    preset the other CPU benchmarks use (bf16: both as they are; q4_0: NVFP4 beside Q4_0)."""
    bf16 = wide_vocab_checkpoint(0)
    gguf = to_gguf(source, bf16, "bf16")
    if args.quant == "bf16":
        return bf16, gguf
    return small_checkpoint("nvfp4"), quantize_gguf(bin_dir, gguf, QUANTS[args.quant], args.threads)


def model_bytes(path: Path) -> int:
    """Bytes on disk of a GGUF file, or of a checkpoint directory's safetensors files."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


def fp32_checkpoint(cache: Path) -> Path:
    """The `small` preset in fp32, for the agreement check (the bf16 one is ``common``'s)."""
    path = cache / "small-float32"
    if not (path / "config.json").exists():
        make_checkpoint(path, preset="small", dtype="float32", seed=0)
    return path


# ---- llama.cpp's side of each measurement -------------------------------------------------------


@contextlib.contextmanager
def llama_serving(bin_dir: Path, model: Path, log: Path, threads: int, parallel: int, ctx: int) -> Iterator[str]:
    """``llama-server`` on a free port until ``/health`` answers 200; its base URL; stopped afterwards."""
    port = free_port()
    cmd = [str(bin_dir / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-np", str(parallel), "-c", str(ctx), "--alias", "small",
           "--no-webui"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, 300, "llama-server")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def llama_greedy(bin_dir: Path, model: Path, threads: int, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after ``prompt`` through llama.cpp's C API (``vs_llamacpp_greedy.cpp``: one decode
    call a token, KV cache in fp32, flash attention off) and each one's logprob."""
    out = subprocess.run([str(bin_dir / GREEDY), str(model), str(threads), str(n), *map(str, prompt)], check=True,
                         capture_output=True, text=True, errors="replace").stdout.split()
    return [int(t) for t in out[0::2]], [float(x) for x in out[1::2]]


def parse_batched_bench(text: str) -> dict[int, dict]:
    """``llama-batched-bench --output-format jsonl`` lines -> {parallel sequences: that row}."""
    rows = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            rows[int(row["pl"])] = row
    return rows


def llama_batched(bin_dir: Path, model: Path, threads: int, batches: list[int], prompt_len: int,
                  steps: int, raw: bool = False) -> dict[int, dict]:
    """One ``llama-batched-bench`` run: for each batch, ``prompt_len`` tokens of prefill per sequence,
    then ``steps`` decode steps; {batch: {"prefill": tok/s, "decode": tok/s}} (``raw``: its JSON rows)."""
    ctx = max(batches) * (prompt_len + steps) + 64
    out = subprocess.run([str(bin_dir / "llama-batched-bench"), "-m", str(model), "-t", str(threads), "-tb",
                          str(threads), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt_len),
                          "-ntg", str(steps), "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"],
                         check=True, capture_output=True, text=True, errors="replace")
    rows = parse_batched_bench(out.stdout)
    if raw:
        return {b: rows[b] for b in batches}
    return {b: {"prefill": rows[b]["speed_pp"], "decode": rows[b]["speed_tg"]} for b in batches}


# ---- epserve's side -----------------------------------------------------------------------------


def epserve_greedy(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0))[0]
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def epserve_batched(llm: LLM, batches: list[int], prompt_len: int, steps: int, seed: int) -> dict[int, dict]:
    """As ``llama_batched`` counts: prefill tok/s of ``batch`` prompts in one step, and decode tok/s over
    ``steps`` steps of ``batch`` sequences (tokens over the steps' total time)."""
    engine = llm.engine
    vocab = engine.config.model.vocab_size
    result = {}
    for batch in batches:
        g = torch.Generator().manual_seed(seed + batch)
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 2)
        start = time.perf_counter()
        for i in range(batch):
            engine.add_request(f"p{seed}-{batch}-{i}", torch.randint(10, vocab, (prompt_len,), generator=g).tolist(),
                               params)
        while engine.scheduler.num_waiting or any(
                r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            engine.step()
        prefill = batch * prompt_len / (time.perf_counter() - start)
        engine.step()  # the first decode step (llama.cpp's prefill samples the first token)
        start = time.perf_counter()
        for _ in range(steps - 1):
            engine.step()
        decode = batch * (steps - 1) / (time.perf_counter() - start)
        while engine.has_unfinished_requests():
            engine.step()
        result[batch] = {"prefill": prefill, "decode": decode}
    return result


# ---- the run --------------------------------------------------------------------------------------


def agreement(args: argparse.Namespace, source: Path, bin_dir: Path, work: Path) -> dict:
    ckpt = fp32_checkpoint(Path(args.cache))
    gguf = to_gguf(source, ckpt, "f32")
    prompt = torch.randint(10, 8192, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(ckpt, dtype="float32", num_blocks=64, enable_prefix_caching=False)
    ours, our_lp = epserve_greedy(llm, prompt, args.agree_tokens)
    del llm
    theirs, their_lp = llama_greedy(bin_dir, gguf, args.threads, prompt, args.agree_tokens)
    equal = sum(a == b for a, b in zip(ours, theirs))
    diff = max(abs(a - b) for a, b in zip(our_lp, their_lp))
    print(f"fp32 agreement: {equal}/{len(ours)} greedy tokens equal, logprobs within {diff:.2e}")
    return {"tokens": len(ours), "equal": equal, "first_difference": next(
        (i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None), "max_logprob_diff": diff,
        "ok": equal == len(ours) and diff <= args.logprob_atol}


def timings(args: argparse.Namespace, source: Path, bin_dir: Path, work: Path) -> dict:
    ckpt, gguf = models(args, source, bin_dir)  # the `small` preset the other CPU benchmarks use, made once
    runs: dict[str, list] = {"epserve": [], "llama.cpp": []}
    llm = LLM(ckpt, dtype="bfloat16", num_blocks=1024, enable_prefix_caching=False)
    # warm: every shape once (as llama-batched-bench warms)
    epserve_batched(llm, args.batches, args.prompt_len, 4, seed=999)
    for r in tqdm(range(args.repeats), desc="offline, alternated"):
        runs["epserve"].append(epserve_batched(llm, args.batches, args.prompt_len, args.steps, seed=r))
        runs["llama.cpp"].append(llama_batched(bin_dir, gguf, args.threads, args.batches, args.prompt_len,
                                               args.steps))
    del llm
    served: dict[str, list] = {"epserve": [], "llama.cpp": []}
    bench = [*SERVED, "--vocab-size", "8192"]
    for r in tqdm(range(args.served_repeats), desc="served, alternated"):
        with serving(["--model", str(ckpt), "--dtype", "bfloat16"], work / "epserve-serve.log") as (_, url):
            bench_serve(url, [*bench, "--num-prompts", "16"], work / "warm.json")
            served["epserve"].append(bench_serve(url, bench, work / f"epserve-{r}.json"))
        with llama_serving(bin_dir, gguf, work / "llama-server.log", args.threads, 16, 16 * 320) as url:
            bench_serve(url, [*bench, "--num-prompts", "16", "--model", "small"], work / "warm.json")
            served["llama.cpp"].append(bench_serve(url, [*bench, "--model", "small"], work / f"llama-{r}.json"))
    med = statistics.median
    table = {}
    for name in runs:
        row = {f"decode_b{b}": med(run[b]["decode"] for run in runs[name]) for b in args.batches}
        row["prefill_b16"] = med(run[16]["prefill"] for run in runs[name]) if 16 in args.batches else None
        row["served_out_tok_s"] = med(s["output_token_throughput"] for s in served[name]) if served[name] else None
        row["served_median_itl_ms"] = med(s["median_itl_ms"] for s in served[name]) if served[name] else None
        table[name] = row
    return {"table": table, "runs": runs, "served": served, "models": {"epserve": str(ckpt), "llama.cpp": str(gguf)},
            "model_bytes": {"epserve": model_bytes(ckpt), "llama.cpp": model_bytes(gguf)}}


def markdown(result: dict, command: str) -> str:
    ours, theirs = result["timings"]["table"]["epserve"], result["timings"]["table"]["llama.cpp"]
    labels = {f"decode_b{b}": f"batch-{b} decode (tok/s)" for b in (1, 4, 16)}
    labels.update(prefill_b16="batch-16 prefill, 64 tokens (tok/s)",
                  served_out_tok_s="served: 64 requests, concurrency 16, 256 in / 32 out (output tok/s)")
    quant = result.get("quant", "bf16")
    head = "| | epserve | llama.cpp |" if quant == "bf16" else "| | epserve (NVFP4) | llama.cpp (Q4_0) |"
    lines = [f"{head} epserve / llama.cpp |", "|---|---|---|---|"]
    for key, label in labels.items():
        a, b = ours.get(key), theirs.get(key)
        if a is not None and b is not None:
            lines.append(f"| {label} | {a:.0f} | {b:.0f} | **{a / b:.2f}×** |")
    agree = result["agreement"]
    lines += ["", f"fp32 agreement: {agree['equal']}/{agree['tokens']} greedy tokens equal, logprobs within "
              f"{agree['max_logprob_diff']:.1e} (llama.cpp's KV cache in fp32, flash attention off). "
              f"{four_bits(result)}{result['machine']}; "
              f"llama.cpp from llama-cpp-python {result['llama_cpp_python']} (its defaults for the timings: "
              f"KV cache f16, flash attention as it chooses). `{command}`, {result['date']}."]
    return "\n".join(lines)


def four_bits(result: dict) -> str:
    """The q4_0 table's formats and bytes ('' for bf16)."""
    if result.get("quant", "bf16") == "bf16":
        return ""
    size = {k: v / 1e6 for k, v in result["timings"]["model_bytes"].items()}
    return (f"Timings at four bits: epserve on the NVFP4 checkpoint of the same bf16 weights ({size['epserve']:.0f} "
            f"MB; MLPs in NVFP4, attention and lm_head bf16), llama.cpp on the bf16 GGUF quantized by llama-quantize "
            f"to Q4_0 ({size['llama.cpp']:.0f} MB, its mix for that type); outputs not compared (the formats round "
            "differently). ")


def markers(quant: str) -> tuple[str, str]:
    """The document's markers of ``--quant``'s table: ``vs_llamacpp`` (bf16), ``vs_llamacpp_q4_0``."""
    tag = "vs_llamacpp" if quant == "bf16" else f"vs_llamacpp_{quant}"
    return f"<!-- {tag}:begin -->", f"<!-- {tag}:end -->"


def write_docs(text: str, path: Path = DOCS, quant: str = "bf16") -> None:
    """``text`` in place of what ``path`` holds between its markers for ``quant`` (``markers``)."""
    begin, end = markers(quant)
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} ... {end} section to fill")
    head, rest = doc.split(begin, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="the sdist whose llama.cpp is built (0.3.36)")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "epserve" / "vs-llamacpp"),
                    help="sdist, build, the fp32 checkpoint and GGUF files, kept between runs")
    ap.add_argument("--work", default="/tmp/epserve-vs-llamacpp", help="server logs and bench JSON")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 2))
    ap.add_argument("--quant", choices=sorted(QUANTS), default="bf16",
                    help="the timings' weights: bf16 both, or q4_0 (llama.cpp Q4_0 beside epserve NVFP4)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per batch")
    ap.add_argument("--repeats", type=int, default=3, help="alternated rounds of the offline timings")
    ap.add_argument("--served-repeats", type=int, default=1, help="alternated rounds of the served workload")
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--logprob-atol", type=float, default=3e-5)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--write-docs", action="store_true", help="put the table into docs/benchmarks.md")
    args = ap.parse_args()
    if shutil.which("cmake") is None:
        raise SystemExit("vs_llamacpp.py needs cmake and a C++ compiler to build llama.cpp")
    torch.set_num_threads(args.threads)
    cache, work = Path(args.cache), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    source = llama_source(args.llama_cpp_python, cache)
    bin_dir = build_llamacpp(source, cache / f"build-{args.llama_cpp_python}")
    result = {"machine": f"{platform.processor() or platform.machine()}, {args.threads} threads, torch "
                         f"{torch.__version__}", "llama_cpp_python": args.llama_cpp_python,
              "date": time.strftime("%Y-%m-%d"), "quant": args.quant}
    result["agreement"] = agreement(args, source, bin_dir, work)
    result["timings"] = timings(args, source, bin_dir, work)
    text = markdown(result, "python benchmarks/vs_llamacpp.py " + " ".join(sys.argv[1:]))
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.write_docs:
        write_docs(text, quant=args.quant)


if __name__ == "__main__":
    main()
