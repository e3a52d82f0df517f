#!/usr/bin/env bash
# Before/after on this CPU, alternated: another checkout (BASE, e.g. `git worktree add /tmp/base <rev>`) and
# this tree, same venv, ROUNDS rounds of: offline_throughput.py (epserve alone, 3 repeats: tokens/s and the
# batch-1/16 decode step), then `epserve serve` on the `small` preset with 64 requests at concurrency 16
# through `epserve bench serve` (TTFT, TPOT). Prints each round's figures; the JSON stays in OUT.
#   bash benchmarks/ab_cpu.sh /tmp/base [ROUNDS=2] [OUT=bench_out/ab]
set -u
BASE=${1:?usage: bash benchmarks/ab_cpu.sh BASE_CHECKOUT [ROUNDS] [OUT]}
ROUNDS=${2:-2}
NEW=$(cd "$(dirname "$0")/.." && pwd)
OUT=${3:-$NEW/bench_out/ab}
mkdir -p "$OUT"
PY=${PYTHON:-$NEW/.venv/bin/python}
CKPT=${CKPT:-$HOME/.cache/epserve/bench-small}  # offline_throughput.py builds it on its first run
for r in $(seq 1 "$ROUNDS"); do
  for t in base new; do
    if [ $t = base ]; then TREE=$BASE; else TREE=$NEW; fi
    export PYTHONPATH=$TREE/src
    (cd "$TREE/benchmarks" && "$PY" offline_throughput.py --skip-transformers --repeats 3 \
      --json "$OUT/$t-$r-offline.json" >"$OUT/$t-$r-offline.log" 2>&1)
    PORT=$((8300 + r))
    "$PY" -m epserve.cli serve "$CKPT" --dtype bfloat16 --port $PORT --num-blocks 1024 >"$OUT/$t-$r-serve.log" 2>&1 &
    SPID=$!
    for _ in $(seq 1 240); do curl -sf http://127.0.0.1:$PORT/health >/dev/null && break; sleep 1; done
    bench=(-m epserve.cli bench serve --base-url http://127.0.0.1:$PORT --random-input-len 256 --random-output-len 32
           --max-concurrency 16 --disable-tqdm)
    "$PY" "${bench[@]}" --num-prompts 16 --json "$OUT/$t-$r-warm.json" >/dev/null 2>&1
    "$PY" "${bench[@]}" --num-prompts 64 --json "$OUT/$t-$r-serve.json" >"$OUT/$t-$r-bench.log" 2>&1
    kill -INT $SPID
    wait $SPID 2>/dev/null
    unset PYTHONPATH
  done
done
"$PY" - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for t in ("base", "new"):
    for r in range(1, rounds + 1):
        o = json.load(open(f"{out}/{t}-{r}-offline.json"))
        s = json.load(open(f"{out}/{t}-{r}-serve.json"))
        steps = {p["batch"]: round(p["step_ms_median"], 2) for p in o["decode"]}
        summary = s.get("summary", s)
        served = {k: round(summary[k], 1) for k in ("median_ttft_ms", "median_tpot_ms") if k in summary}
        print(f"{t} {r}: offline {o['epserve_tok_per_s']:.1f} tok/s, decode step ms {steps}, served {served}")
PY
