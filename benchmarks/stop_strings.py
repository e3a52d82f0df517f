"""What stop strings cost the router: 15 stop strings of 60k characters against none.

    .venv/bin/python benchmarks/stop_strings.py [--tokens 400] [--src OTHER/src] [--json out.json]
    .venv/bin/python benchmarks/stop_strings.py --url http://127.0.0.1:8000 --pid ROUTER_PID [--api-key KEY]
    .venv/bin/python benchmarks/stop_strings.py --matcher-only

The stop strings are the hard case: the generated text is a prefix of the last one (it never completes,
so the whole text is held back while it grows, and released at the end), and the 14 others are 60k
characters that never match.

1. The matcher alone (``StopStringMatcher``, and the quadratic one it replaced, copied here as it was):
   CPU seconds to feed texts of growing length in 4-character pieces, as the router feeds tokens.
2. A real request (``epserve serve --dp 1`` on the built-in tiny model, started here from ``--src``'s
   tree if given, or ``--url``/``--pid``): a greedy completion of ``--tokens`` tokens without stop
   strings, then the same request with the 15 stop strings built from its text; the router process's
   CPU time (``/proc/PID/stat``) for each, medians over ``--repeats``, and their ratio. The answers must
   be equal (no stop matches). Figures go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from router_abuse import API_KEY, serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STOP_CHARS = 60_000
NUM_STOPS = 15


class QuadraticMatcher:
    """``StopStringMatcher`` before issue 25 (commit e281e59): re-scans the held tail, and slices every
    prefix of every stop, at each feed."""

    def __init__(self, stops: Sequence[str], include_stop_str: bool = False) -> None:
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self._buffer = ""
        self.stopped = False

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._buffer + text
        best = None
        for stop in self.stops:
            i = buf.find(stop)
            if i >= 0 and (best is None or (i, i + len(stop)) < best[:2]):
                best = (i, i + len(stop), stop)
        hold_from = self._partial_start(buf)
        if best is not None and best[0] <= hold_from:
            self.stopped, self._buffer = True, ""
            return buf[: best[1] if self.include_stop_str else best[0]], True
        self._buffer = buf[hold_from:]
        return buf[:hold_from], False

    def _partial_start(self, buf: str) -> int:
        start = len(buf)
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), 0, -1):
                if len(buf) - k >= start:
                    break
                if buf.endswith(stop[:k]):
                    start = len(buf) - k
                    break
        return start

    def flush(self) -> str:
        held, self._buffer = self._buffer, ""
        return "" if self.stopped else held


def hard_stops(text: str) -> list[str]:
    """14 stop strings that never match, then one the text is a proper prefix of (checked last)."""
    junk = [f"<{i}>" + "#" * (STOP_CHARS - 3 - len(str(i))) for i in range(NUM_STOPS - 1)]
    return junk + [text + "#" * max(1, STOP_CHARS - len(text))]


def time_matcher(cls: type, text: str, stops: list[str], piece: int = 4) -> float:
    """CPU seconds to feed ``text`` in ``piece``-character pieces, then flush; checks nothing is lost."""
    start = time.process_time()
    m = cls(stops)
    out = [m.feed(text[i : i + piece])[0] for i in range(0, len(text), piece)]
    out.append(m.flush())
    seconds = time.process_time() - start
    assert "".join(out) == text
    return seconds


def matcher_figures(lengths: list[int], old_up_to: int) -> list[dict]:
    from epserve.router.detokenize import StopStringMatcher

    rng = random.Random(0)
    rows = []
    for n in lengths:
        text = "".join(rng.choice("abcdefgh ") for _ in range(n))
        stops = hard_stops(text)
        row = {"chars": n, "new_s": time_matcher(StopStringMatcher, text, stops),
               "no_stops_s": time_matcher(StopStringMatcher, text, [])}
        row["old_s"] = time_matcher(QuadraticMatcher, text, stops) if n <= old_up_to else None
        rows.append(row)
        old = "-" if row["old_s"] is None else f"{row['old_s']:.3f}"
        print(f"matcher, {n:>6} chars: new {row['new_s']:.4f} s, old {old} s, no stops {row['no_stops_s']:.5f} s",
              flush=True)
    return rows


# ---- a real request --------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    """User + system CPU seconds of the process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def complete(url: str, api_key: str, body: dict) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def request_figures(url: str, pid: int, api_key: str, tokens: int, repeats: int) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    text = complete(url, api_key, body)["choices"][0]["text"]  # (also warms up)
    stops = hard_stops(text)
    with_stops = {**body, "stop": stops}
    complete(url, api_key, with_stops)
    figures: dict[str, list[float]] = {"no_stops_s": [], "stops_s": []}
    for _ in range(repeats):  # alternated, so both see the same machine
        for key, b in (("no_stops_s", body), ("stops_s", with_stops)):
            before = cpu_s(pid)
            answer = complete(url, api_key, b)
            figures[key].append(cpu_s(pid) - before)
            choice = answer["choices"][0]
            assert choice["text"] == text and choice["finish_reason"] == "length", choice
    no_stops, stops_s = statistics.median(figures["no_stops_s"]), statistics.median(figures["stops_s"])
    return {"tokens": tokens, "chars": len(text), "body_bytes": len(json.dumps(with_stops)), **figures,
            "no_stops_median_s": no_stops, "stops_median_s": stops_s, "ratio": stops_s / max(no_stops, 1e-9)}


def main() -> None:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=400, help="tokens generated by the real request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", default="500,1000,2000,4000,60000", help="matcher: text lengths (characters)")
    p.add_argument("--old-up-to", type=int, default=2000, help="matcher: time the old one up to this length")
    p.add_argument("--matcher-only", action="store_true")
    p.add_argument("--url")
    p.add_argument("--pid", type=int)
    p.add_argument("--api-key", default=API_KEY)
    p.add_argument("--src", type=Path, help="another tree's src/ directory to run the server from")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    result: dict = {"matcher": matcher_figures([int(n) for n in args.lengths.split(",")], args.old_up_to)}
    if not args.matcher_only:
        if args.url is not None:
            if args.pid is None:
                p.error("--url needs --pid (the router process, to read its CPU time)")
            result["request"] = request_figures(args.url, args.pid, args.api_key, args.tokens, args.repeats)
        else:
            with tempfile.TemporaryDirectory() as tmp, serve(
                    args.src, Path(tmp) / "serve.log", "--num-blocks", str(max(64, args.tokens // 16 + 8)),
                    "--max-model-len", str(args.tokens + 16)) as (url, pid):
                result["request"] = request_figures(url, pid, API_KEY, args.tokens, args.repeats)
    print(f"{'matcher: chars':>15} {'new s':>9} {'old s':>9} {'no stops s':>11}")
    for row in result["matcher"]:
        old = "-" if row["old_s"] is None else f"{row['old_s']:.3f}"
        print(f"{row['chars']:>15} {row['new_s']:>9.4f} {old:>9} {row['no_stops_s']:>11.5f}")
    if "request" in result:
        r = result["request"]
        print(f"request: {r['tokens']} tokens ({r['chars']} characters), body with stops {r['body_bytes']} bytes")
        print(f"router CPU: {r['no_stops_median_s']:.3f} s without stops, {r['stops_median_s']:.3f} s with "
              f"{NUM_STOPS} x {STOP_CHARS} characters (median of {args.repeats}): ratio {r['ratio']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    try:
        main()
    except urllib.error.HTTPError as e:
        sys.exit(f"HTTP {e.code}: {e.read()[:500]!r}")
