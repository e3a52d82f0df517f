#!/usr/bin/env bash
# The GPU check, for a session that is lent the CUDA machine: ONE command that fits one lease (15 minutes of
# device time in all, at most 10 per command, at most 8 files back under $OUT, the image's own python3 with
# torch 2.11 and Triton 3.6, no network). Its stages run in order of value, each under `timeout`, with 540 s
# of stage budget in all (LEASE_BUDGET_S to change it): a stage gets its own budget plus whatever the stages
# before it left unused, never the time the stages after it were budgeted, so a slow stage cannot eat the rest.
#   env         nvidia-smi; the carried wheels (benchmarks/gpu_wheels.sh made .whl) installed into /tmp/site,
#               on PYTHONPATH; versions, and which optional packages import. Then the V3-shaped checkpoint of
#               the v3 stage is built in the background (CPU only) while the GPU stages run.
#   kernels     tests/kernels/* on CUDA against the torch references (block FP8 GEMMs, _scaled_mm, the fused
#               router, grouped experts, paged MLA decode, CUDA-graph capture and replay of each, the backend
#               registry's self-test and fallback), in 4 pytest-xdist workers where xdist is there. The
#               Triton-interpreter cases (CPU checks, CI runs them) are left out, FlashInfer's to its stage.
#   sanitizer   compute-sanitizer memcheck on one small kernel test: the paged MLA decode Triton kernel with
#               an FP8 cache (PyTorch's caching allocator off, so a read past a tensor is past its allocation).
#   flashinfer  FlashInfer's paged MLA decode on CUDA against the reference (its JIT build for sm_90a the first
#               time; FLASHINFER_CUDA_ARCH_LIST and MAX_JOBS set), and the registry's choice. If FlashInfer
#               imports but this stage does not pass, the later stages run with EPSERVE_MLA_BACKEND=triton.
#   capture     the captured decode's tests with the engine on CUDA (EPSERVE_TEST_DEVICE=cuda): start-up
#               capture, the shared expert's side stream inside a graph, MTP drafts and verification rows
#               through CUDA graphs (tokens = plain decoding); the CPU-traced graph tests under torch 2.11.
#   tokens      benchmarks/v3_layer.py --size tiny on CUDA: bf16, FP8 and FP8-KV engines, captured greedy
#               tokens = eager tokens (DeepSeek-V3's layer structure, MLA's 512 + 64, 32 experts top-8).
#   micro       benchmarks/gpu_micro.py: copy bandwidth (4.3 TB/s seen), bf16 matmul, FP8 block GEMM TFLOP/s
#               (Triton vs blockwise _scaled_mm vs bf16) at V3 shapes, M = 1, 16, 128, 4096, the grouped
#               GEMM over 32 experts, paged MLA decode GB/s (Triton vs FlashInfer) at batch 1/16/64, 4k context.
#   v3          benchmarks/v3_layer.py: DeepSeek-V3's dense and MoE layer at full width with one EP8 expert
#               shard, random FP8 weights: decode step time per layer at batch 1, 16, 64, eager and CUDA
#               graphs, graph memory, KV bytes, tokens eager = captured.
#   sampling    penalties, logit_bias, min_tokens, prompt logprobs and structured outputs (xgrammar bitmasks
#               on CUDA logits; needs the xgrammar and jsonschema wheels) with the engine on CUDA.
# $OUT gets 6 files: summary.json (every stage's status, seconds, budget, test counts and failures, key
# figures, the stage JSONs merged in; rewritten after each stage, so a cut-off run still leaves one), and the
# tails of the stages' output: env.txt, kernels.log, capture.log, perf.log, sampling.log.
#
# Usage (device tool):  bash benchmarks/gpu_check.sh                   the lease plan (about 9 minutes)
#                       bash benchmarks/gpu_check.sh --stages v3,micro  some of its stages (a second call)
#                       bash benchmarks/gpu_check.sh --dry-run          here, on the CPU: the plan, checked
#                       bash benchmarks/gpu_check.sh <part>             one of the older, longer checks:
#   engine|kernels|decode|mtp|eplb|recovery|disagg|sampling (each < 10 min, one a call; see old_part below).
# Carry the wheels: run(carry=[".whl"], command="bash benchmarks/gpu_check.sh", timeout_s=600).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-bench_out}
TOTAL=${LEASE_BUDGET_S:-540}
MIN_STAGE_S=15
LEASE_FILES=(summary.json env.txt kernels.log capture.log perf.log sampling.log)

# ---- the plan: stage, budget (s), log file under $OUT, lines of output kept there -----------------------
STAGES=(env kernels sanitizer flashinfer capture tokens micro v3 sampling)
declare -A BUDGET=([env]=20 [kernels]=100 [sanitizer]=50 [flashinfer]=90 [capture]=45 [tokens]=40 [micro]=60
                   [v3]=110 [sampling]=25)
declare -A LOG=([env]=env.txt [kernels]=kernels.log [sanitizer]=kernels.log [flashinfer]=kernels.log
                [capture]=capture.log [tokens]=capture.log [micro]=perf.log [v3]=perf.log [sampling]=sampling.log)
declare -A KEEP=([env]=80 [kernels]=60 [sanitizer]=40 [flashinfer]=40 [capture]=50 [tokens]=30 [micro]=120
                 [v3]=60 [sampling]=50)
# The tests each pytest stage selects (the dry run collects them: a renamed file or test breaks it).
declare -A SELECT=(
  [kernels]="tests/kernels -k 'not under_interpreter and not flashinfer and not whichever_backend'"
  [sanitizer]="tests/kernels/test_mla_decode_kernel.py -k 'test_cuda_matches_ref and fp8'"
  [flashinfer]="tests/kernels/test_backends.py -k 'flashinfer or whichever_backend'"
  [capture]="tests/engine/test_graph_startup.py tests/engine/test_decode_graphs.py tests/engine/test_mtp_engine.py::test_captured_decode_with_mtp -m 'not slow'"
  [sampling]="tests/engine/test_logits_processing.py tests/engine/test_structured.py"
)
SCRIPTS=(benchmarks/v3_layer.py benchmarks/step_timers.py benchmarks/gpu_micro.py benchmarks/fp8_gemm.py benchmarks/common.py)
V3_ARGS="--device cuda --variants fp8 --batches 1 16 64"
TOKENS_ARGS="--size tiny --device cuda --variants bf16 fp8 fp8-kv --batches 1 4 --no-timing --tokens 16"
declare -A DESC=(
  [env]="nvidia-smi; pip install .whl/*.whl --target /tmp/site; versions, optional imports -> env.json"
  [kernels]="pytest ${SELECT[kernels]}"
  [sanitizer]="compute-sanitizer --tool memcheck pytest ${SELECT[sanitizer]}"
  [flashinfer]="pytest ${SELECT[flashinfer]}"
  [capture]="pytest ${SELECT[capture]}"
  [tokens]="python3 benchmarks/v3_layer.py $TOKENS_ARGS"
  [micro]="python3 benchmarks/gpu_micro.py --repeats 10"
  [v3]="python3 benchmarks/v3_layer.py $V3_ARGS (checkpoint built in the background after env)"
  [sampling]="pytest ${SELECT[sampling]} (test_structured.py only where xgrammar and jsonschema import)"
)

wheel_mib() { find .whl -maxdepth 1 -type f -name '*.whl' -printf '%s\n' 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 2^20}'; }

# ---- the summary: stage records (TSV) and stage JSONs merged into one JSON --------------------------------
write_summary() {  # write_summary WORK_DIR OUT_DIR
  "$PY" - "$1" "$2" "$TOTAL" <<'EOF'
import json, re, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

work, out, total = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
fields = ["stage", "status", "seconds", "budget_s", "timeout_s", "rc", "log", "junit", "json", "output", "note"]
stages, order = {}, []
for line in (work / "stages.tsv").read_text().splitlines() if (work / "stages.tsv").exists() else []:
    rec = dict(zip(fields, line.split("\t")))
    name = rec.pop("stage")
    for key in ("seconds", "budget_s", "timeout_s"):
        rec[key] = float(rec[key]) if rec.get(key) not in (None, "", "-") else None
    rec["rc"] = int(rec["rc"]) if rec.get("rc", "-").lstrip("-").isdigit() else None
    junit, js, output = rec.pop("junit", "-"), rec.pop("json", "-"), rec.pop("output", "-")
    if junit not in ("-", "") and Path(junit).exists():
        try:
            root = ET.parse(junit).getroot()
            suites = [root] if root.tag == "testsuite" else list(root)
            counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
            counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
            failed = []
            for case in root.iter("testcase"):
                for bad in list(case.findall("failure")) + list(case.findall("error")):
                    message = (bad.get("message") or bad.text or "").strip().splitlines()
                    failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                                   "message": (message[0] if message else "")[:300]})
            counts["failed_tests"] = failed[:25]
            rec["tests"] = counts
        except ET.ParseError as e:
            rec["tests"] = {"error": f"junit unreadable: {e}"}
    if js not in ("-", "") and Path(js).exists():
        try:
            result = json.loads(Path(js).read_text())
            rec["figures"] = result.pop("key_figures", None) if isinstance(result, dict) else None
            rec["result"] = result
        except json.JSONDecodeError as e:
            rec["result"] = {"error": f"unreadable: {e}"}
    if output not in ("-", "") and Path(output).exists():
        text = Path(output).read_text(errors="replace")
        m = re.search(r"ERROR SUMMARY: (\d+) error", text)
        if m:
            rec.setdefault("figures", {})["memcheck_errors"] = int(m[1])
    stages[name] = rec
    order.append(name)
env = {}
if (work / "env.json").exists():
    try:
        env = json.loads((work / "env.json").read_text())
    except json.JSONDecodeError:
        env = {"error": "env.json unreadable"}
summary = {
    "plan": {"budget_s": total, "stages": order, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "files": sorted(p.name for p in out.iterdir() if p.is_file()) if out.exists() else []},
    "env": env,
    "stages": stages,
    "not_ok": [n for n in order if stages[n]["status"] not in ("ok", "planned")],
}
build = work / "v3_build.out"  # the v3 stage's checkpoint, built in the background
if build.exists():
    summary["v3_checkpoint_build"] = [line for line in build.read_text(errors="replace").splitlines() if line][-3:]
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
EOF
}

record() {  # record NAME STATUS SECONDS TIMEOUT RC JUNIT JSON OUTPUT NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${BUDGET[$1]}" "$4" "$5" "${LOG[$1]}" \
    "$6" "$7" "$8" "${9//$'\t'/ }" >>"$WORK/stages.tsv"
}

later_budget() {  # the budgets of the planned stages after $1
  local s seen=0 sum=0
  for s in "${PLAN[@]}"; do
    if [ $seen = 1 ]; then sum=$((sum + BUDGET[$s])); fi
    if [ "$s" = "$1" ]; then seen=1; fi
  done
  echo $sum
}

# run_stage NAME JUNIT JSON COMMAND...: under timeout; its output's tail into its log; recorded; summary rewritten
run_stage() {
  local name=$1 junit=$2 js=$3
  shift 3
  local left=$((TOTAL - (SECONDS - T0) - $(later_budget "$name")))
  local log="$OUT/${LOG[$name]}" output="$WORK/$name.out"
  if [ $left -lt $MIN_STAGE_S ]; then
    echo "== $name: skipped, ${left}s left of its budget" | tee -a "$log"
    record "$name" "skipped: no budget left" 0 "$left" - - - - ""
    write_summary "$WORK" "$OUT"
    return 1
  fi
  echo "== $name (up to ${left}s): $*"
  local t0=$EPOCHREALTIME
  timeout -k 5 "$left" "$@" >"$output" 2>&1
  local rc=$?
  local secs
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}')
  local status=ok
  case $rc in
    0) status=ok ;;
    124|137) status="timeout after ${left}s" ;;
    5) [ "$junit" != - ] && status="no tests selected" || status="failed (exit 5)" ;;
    *) status="failed (exit $rc)" ;;
  esac
  if [ "$name" = sanitizer ] && grep -q "Device not supported" "$output"; then status="unsupported: compute-sanitizer refused the device"; fi
  { echo "== $name: $status in ${secs}s (up to ${left}s; budget ${BUDGET[$name]}s): $*"
    tail -n "${KEEP[$name]}" "$output"; } >>"$log"
  echo "   $name: $status in ${secs}s"
  record "$name" "$status" "$secs" "$left" "$rc" "$junit" "$js" "$output" "${NOTE:-}"
  NOTE=
  write_summary "$WORK" "$OUT"
  [ "$status" = ok ]
}

envget() {  # envget KEY: a field of env.json ("" when absent or null)
  "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); v = d.get(sys.argv[2]); print('' if v in (None, False) else v)" \
    "$WORK/env.json" "$1" 2>/dev/null
}

env_probe() {  # env_probe JSON: nvidia-smi, the wheels installed, what imports
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "wheels: $(ls .whl/*.whl | wc -l) files, $(wheel_mib) MiB -> /tmp/site"
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -5
  else
    echo "no wheel bundle (.whl): flashinfer and the structured-output tests will be skipped"
  fi
  "$PY" - "$1" <<'EOF'
import importlib, json, os, shutil, sys
out = {"python": sys.version.split()[0], "nproc": os.cpu_count(), "pythonpath": os.environ.get("PYTHONPATH", "")}
try:
    import torch
    out |= {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out |= {"device": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                "memory_GiB": round(p.total_memory / 2**30, 1)}
except Exception as e:  # noqa: BLE001
    out["torch_error"] = f"{type(e).__name__}: {e}"[:300]
import importlib.metadata as metadata
dists = {"triton": "triton", "transformers": "transformers", "xdist": "pytest-xdist", "xgrammar": "xgrammar",
         "jsonschema": "jsonschema", "pydantic": "pydantic", "tvm_ffi": "apache-tvm-ffi", "flashinfer": "flashinfer-python"}
for name, dist in dists.items():
    try:
        importlib.import_module(name)
        try:
            out[name] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[name] = "present"
    except Exception as e:  # noqa: BLE001 - a missing or broken optional package
        out[name] = None
        out.setdefault("import_errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
found = shutil.which("compute-sanitizer")
for path in ("/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
    found = found or (path if os.path.exists(path) else None)
out["compute_sanitizer"] = found
out["nvcc"] = shutil.which("nvcc")
json.dump(out, open(sys.argv[1], "w"), indent=2)
print(json.dumps(out, indent=2))
EOF
}

has() {  # has STAGE: whether the plan runs it
  local s
  for s in "${PLAN[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

pytest_stage() {  # pytest_stage NAME [extra args]: the stage's selection, junit XML into the work folder
  local name=$1
  shift
  local sel=()
  eval "sel=(${SELECT[$name]})"  # the selection's quoting (-k '...') as the shell reads it
  run_stage "$name" "$WORK/$name.xml" - "$PY" -m pytest -q -p no:cacheprovider "$@" "${sel[@]}" \
    --junitxml="$WORK/$name.xml"
}

lease_plan() {
  PLAN=("$@")
  PY=${PYTHON:-python3}
  case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # stages cd into benchmarks/
  WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
  mkdir -p "$OUT"
  rm -f "$OUT"/{summary.json,env.txt,kernels.log,capture.log,perf.log,sampling.log}
  T0=$SECONDS
  NOTE=
  export PYTHONUNBUFFERED=1 EPSERVE_TEST_DEVICE=cuda EPSERVE_NO_PROGRESS=1
  export EPSERVE_CACHE_DIR=${EPSERVE_CACHE_DIR:-$ROOT/.gpu-cache}
  export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH}
  if compgen -G ".whl/*.whl" >/dev/null; then export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
  export -f env_probe wheel_mib
  export PY
  echo "lease plan: ${PLAN[*]}; ${TOTAL}s of stage budget; work in $WORK, results in $OUT"
  BUILD_PID=
  if has env; then
    run_stage env - - bash -c 'env_probe "$1"' _ "$WORK/env.json"
  else
    env_probe "$WORK/env.json" >"$WORK/env.out" 2>&1
  fi
  local xdist=() sanitizer cap fi_ok=1 micro_flags=()
  [ -n "$(envget xdist)" ] && xdist=(-n 4 --dist loadfile)
  sanitizer=$(envget compute_sanitizer)
  cap=$(envget capability)
  if has v3; then  # the checkpoint, on the CPU, while the GPU stages run (v3_layer.py waits for it)
    nice -n 10 timeout 400 "$PY" benchmarks/v3_layer.py --build-only --size v3 --device cpu \
      >"$WORK/v3_build.out" 2>&1 &
    BUILD_PID=$!
  fi
  if has kernels; then pytest_stage kernels "${xdist[@]}"; fi
  if has sanitizer; then
    if [ -n "$sanitizer" ]; then
      local sel=()
      eval "sel=(${SELECT[sanitizer]})"
      run_stage sanitizer "$WORK/sanitizer.xml" - env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck \
        --error-exitcode 3 --print-limit 20 "$PY" -m pytest -q -p no:cacheprovider "${sel[@]}" \
        --junitxml="$WORK/sanitizer.xml"
    else
      echo "== sanitizer: skipped (no compute-sanitizer on PATH or in /usr/local/cuda)" >>"$OUT/kernels.log"
      record sanitizer "skipped: no compute-sanitizer on PATH" 0 0 - - - - ""
    fi
  fi
  if ! has flashinfer; then
    fi_ok=0  # not checked in this call: no JIT build inside the other stages (EPSERVE_MLA_BACKEND=auto to allow it)
  else
    if [ -n "$(envget flashinfer)" ]; then
      export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-${cap}$([ "${cap%%.*}" -ge 9 ] 2>/dev/null && echo a)}
      export MAX_JOBS=${MAX_JOBS:-$(nproc)}
      NOTE="FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST"
      pytest_stage flashinfer || fi_ok=0
    else
      NOTE="flashinfer does not import: the fallback to Triton is what runs"
      pytest_stage flashinfer
      fi_ok=0
    fi
  fi
  if [ $fi_ok = 0 ]; then
    micro_flags=(--no-flashinfer)
    if [ -n "$(envget flashinfer)" ] && [ -z "${EPSERVE_MLA_BACKEND:-}" ]; then
      export EPSERVE_MLA_BACKEND=triton  # imports, but did not pass here (or ran out of time): no JIT build later
      echo "   flashinfer imports but did not pass in this call: EPSERVE_MLA_BACKEND=triton from here on"
    fi
  fi
  if has capture; then pytest_stage capture; fi
  if has tokens; then
    # shellcheck disable=SC2086
    run_stage tokens - "$WORK/tokens.json" bash -c "cd benchmarks && \"\$PY\" v3_layer.py $TOKENS_ARGS --json $WORK/tokens.json"
  fi
  if has micro; then
    run_stage micro - "$WORK/micro.json" bash -c "cd benchmarks && \"\$PY\" gpu_micro.py --repeats 10 ${micro_flags[*]} --json $WORK/micro.json"
  fi
  if has v3; then
    run_stage v3 - "$WORK/v3.json" bash -c "cd benchmarks && \"\$PY\" v3_layer.py $V3_ARGS --json $WORK/v3.json"
  fi
  if [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; then kill "$BUILD_PID" 2>/dev/null; fi
  [ -f "$WORK/v3_build.out" ] && { echo "== v3 checkpoint build (background)"; tail -n 5 "$WORK/v3_build.out"; } >>"$OUT/perf.log"
  if has sampling; then
    if [ -n "$(envget xgrammar)" ] && [ -n "$(envget jsonschema)" ]; then
      pytest_stage sampling
    else
      NOTE="xgrammar or jsonschema does not import: test_structured.py left out"
      run_stage sampling "$WORK/sampling.xml" - "$PY" -m pytest -q -p no:cacheprovider \
        tests/engine/test_logits_processing.py --junitxml="$WORK/sampling.xml"
    fi
  fi
  write_summary "$WORK" "$OUT"
  echo "done in $((SECONDS - T0))s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
  "$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); [print(f'  {n:11s} {r[\"status\"]:32s} {r[\"seconds\"] or 0:6.1f}s') for n, r in s['stages'].items()]" "$OUT/summary.json"
}

# ---- the dry run: the plan printed and checked on a machine without a GPU ----------------------------------
dry_run() {
  PY=${PYTHON:-}
  if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi; fi
  local bad=0 sum=0 s files=${#LEASE_FILES[@]}
  echo "lease plan: one command, ${#STAGES[@]} stages, each under timeout with the budget below plus what earlier stages left"
  for s in "${STAGES[@]}"; do
    sum=$((sum + BUDGET[$s]))
    printf '  %-10s %4ss  -> %-12s %s\n' "$s" "${BUDGET[$s]}" "${LOG[$s]}" "${DESC[$s]}"
  done
  echo "  total      ${sum}s of ${TOTAL}s (LEASE_BUDGET_S); files under \$OUT: ${LEASE_FILES[*]}"
  [ "$sum" -le "$TOTAL" ] || { echo "  FAIL: the stage budgets add up to ${sum}s, over ${TOTAL}s"; bad=1; }
  [ "$files" -le 8 ] || { echo "  FAIL: $files files, over 8"; bad=1; }
  # the wheel bundle
  local wheels
  wheels=$(wheel_mib)
  wheels=${wheels:-0.0}
  if compgen -G ".whl/*.whl" >/dev/null; then
    local tree room
    tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -b 2>/dev/null | awk '{s += $1} END {print s + 0}')
    room=$(awk -v t="$tree" 'BEGIN {printf "%.1f", (64 * 2^20 - t) / 2^20}')
    echo "wheel bundle .whl: $(ls .whl/*.whl | wc -l) wheels, $wheels MiB (room beside the working tree: $room MiB):"
    ls .whl/*.whl | sed 's|.whl/||; s|-py3-none-any.whl||; s|-cp312-.*||; s|^|  |'
    local dups
    dups=$(ls .whl/*.whl | sed 's|.whl/||' | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
    [ -z "$dups" ] || { echo "  FAIL: more than one version of: $dups (pip refuses the install)"; bad=1; }
    awk -v w="$wheels" -v r="$room" 'BEGIN {exit !(w <= r)}' || { echo "  FAIL: the wheels do not fit"; bad=1; }
    local pkg
    for pkg in xgrammar pydantic pydantic_core flashinfer_python jsonschema apache_tvm_ffi; do
      compgen -G ".whl/${pkg}-*.whl" >/dev/null || echo "  missing: $pkg (bash benchmarks/gpu_wheels.sh)"
    done
  else
    echo "wheel bundle .whl: absent (bash benchmarks/gpu_wheels.sh makes it). Without it: the flashinfer stage runs"
    echo "  only the fallback tests, micro times Triton's MLA decode alone, sampling leaves test_structured.py out"
  fi
  # every path the plan names, and every test selection non-empty
  local missing=0 f
  for f in "${SCRIPTS[@]}" benchmarks/gpu_wheels.sh; do [ -f "$f" ] || { echo "  FAIL: $f is missing"; missing=1; }; done
  [ $missing = 0 ] || bad=1
  local sels=()
  for s in kernels sanitizer flashinfer capture sampling; do sels+=("$s=${SELECT[$s]}"); done
  "$PY" - "${sels[@]}" <<'EOF' || bad=1
import re, shlex, subprocess, sys
from pathlib import Path
stages = dict(arg.split("=", 1) for arg in sys.argv[1:])
parsed, files = {}, []
for name, sel in stages.items():
    words, ids, keyword, i = shlex.split(sel), [], None, 0
    while i < len(words):
        if words[i] in ("-k", "-m"):
            keyword = words[i + 1] if words[i] == "-k" else keyword
            i += 2
            continue
        ids.append(words[i])
        i += 1
    parsed[name] = (ids, keyword)
    for node in ids:
        path = node.split("::")[0]
        if not Path(path).exists():
            print(f"  FAIL: {name}: {path} is missing")
            sys.exit(1)
        files.append(path)
proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *dict.fromkeys(files)],
                      capture_output=True, text=True, timeout=300)
collected = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
if proc.returncode != 0:
    print(f"  FAIL: collecting the stages' tests: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    sys.exit(1)

def matches(expr: str, node: str) -> bool:
    """pytest's -k on the words of the node id (its file, test name and parameters), case-insensitive."""
    words = node.lower()
    py = re.sub(r"\b(?!and\b|or\b|not\b)([A-Za-z_][\w\-\[\]]*)", lambda m: repr(m[1].lower()) + " in w", expr)
    return bool(eval(py, {}, {"w": words}))  # noqa: S307 - our own selections

counts = []
for name, (ids, keyword) in parsed.items():
    chosen = [n for n in collected if any(n == i or n.startswith(i.rstrip("/") + ("" if "::" in i else "/")) or
                                          n.startswith(i + "::") or n.startswith(i + "[") for i in ids)]
    if keyword:
        chosen = [n for n in chosen if matches(keyword, n)]
    if not chosen:
        print(f"  FAIL: {name}: the selection {stages[name]!r} selects no test")
        sys.exit(1)
    counts.append(f"{name} {len(chosen)}")
print("test selections (collected here): " + ", ".join(counts))
EOF
  # the summary merge, on planned records
  WORK=$(mktemp -d /tmp/gpu_check_dry.XXXXXX)
  local dry_out="$WORK/out"
  mkdir -p "$dry_out"
  for s in "${STAGES[@]}"; do record "$s" planned - "${BUDGET[$s]}" - - - - "dry run"; done
  if write_summary "$WORK" "$dry_out" && "$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); assert len(s['stages']) == int(sys.argv[2])" \
      "$dry_out/summary.json" "${#STAGES[@]}"; then
    echo "summary: the merge writes a valid summary.json ($(wc -c <"$dry_out/summary.json") bytes for the planned stages)"
  else
    echo "  FAIL: the summary merge"
    bad=1
  fi
  rm -rf "$WORK"
  [ $bad = 0 ] || echo "dry run: FAILED (above)"
  echo "budget $sum s, $files files, wheels $wheels MiB"
  return $bad
}

# ---- the older named parts (each < 10 min, one a call; not fitted to the 8 files of a lease) ---------------
old_part() {
  local PART=$1
  mkdir -p "$OUT"
  export EPSERVE_TEST_DEVICE=cuda EPSERVE_CACHE_DIR=${EPSERVE_CACHE_DIR:-$PWD/.gpu-cache} PYTHONPATH=$PWD/src
  if compgen -G ".whl/*.whl" >/dev/null; then
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$OUT/gpu.txt"
  python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
  case $PART in
    engine)
      # test_overlap: the overlap schedules (incl. two micro-batches) in one process on CUDA. Multi-rank NCCL
      # expert parallelism needs two GPUs (NCCL refuses two ranks on one device): not checkable on one H200.
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/model/test_model_parity.py tests/engine/test_engine.py tests/parallel/test_overlap.py \
        2>&1 | tail -25 | tee "$OUT/tests.txt"
      timeout 180 python3 benchmarks/offline_throughput.py --device cuda --repeats 3 --json "$OUT/offline.json" \
        2>&1 | tail -30 | tee "$OUT/offline.txt" ;;
    kernels)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py tests/kernels/test_gate_kernel.py \
        tests/kernels/test_mla_decode_kernel.py 2>&1 | tail -25 | tee "$OUT/kernel_tests.txt"
      timeout 150 python3 benchmarks/fp8_gemm.py --json "$OUT/fp8_gemm.json" \
        2>&1 | tail -80 | tee "$OUT/fp8_gemm.txt" ;;
    decode)
      (cd benchmarks && timeout 300 python3 decode_capture.py --device cuda --batches 1 16 64 --json "../$OUT/decode_capture.json") \
        2>&1 | tail -20 | tee "$OUT/decode_capture.txt"
      timeout 150 python3 benchmarks/fp8_engine.py --device cuda --memory-budget-gb 4 --json "$OUT/fp8_engine.json" \
        2>&1 | tail -10 | tee "$OUT/fp8_engine.txt" ;;
    mtp)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_mtp_engine.py tests/engine/test_spec_decode.py \
        2>&1 | tail -25 | tee "$OUT/mtp_tests.txt"
      timeout 120 python3 -m epserve.cli make-checkpoint "$OUT/trained" --train --train-seconds 90 --dtype bfloat16 \
        2>&1 | tail -3 | tee "$OUT/mtp_train.txt"
      timeout 150 python3 benchmarks/mtp_decode.py --model "$OUT/trained" --dtype bfloat16 --device cuda \
        --json "$OUT/mtp_decode.json" 2>&1 | tail -20 | tee "$OUT/mtp_decode.txt" ;;
    eplb)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_eplb.py tests/parallel/test_eplb_policy.py \
        2>&1 | tail -25 | tee "$OUT/eplb_tests.txt" ;;
    recovery)
      # One GPU: one rank (dp 1). SIGKILL and SIGSTOP of the CUDA rank with a stream in flight: detected,
      # the group torn down and started again (spawned, CUDA), served again; then SIGTERM exits 0.
      timeout 300 python3 benchmarks/recovery.py --device cuda --dp 1 --step-timeout 5 --repeats 1 \
        --json "$OUT/recovery.json" 2>&1 | tail -10 | tee "$OUT/recovery.txt" ;;
    disagg)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kv_handoff.py \
        2>&1 | tail -25 | tee "$OUT/disagg_tests.txt"
      timeout 300 python3 benchmarks/disagg_mixed.py --device cuda --dtype bfloat16 --deployments disaggregated \
        --json "$OUT/disagg_mixed.json" 2>&1 | tail -10 | tee "$OUT/disagg_mixed.txt" ;;
    sampling)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_logits_processing.py \
        tests/engine/test_structured.py 2>&1 | tail -25 | tee "$OUT/sampling_tests.txt"
      (cd benchmarks && timeout 300 python3 logits_processing.py --device cuda --batches 1 64 --json "../$OUT/logits_processing.json") \
        2>&1 | tail -10 | tee "$OUT/logits_processing.txt"
      (cd benchmarks && timeout 200 python3 structured_outputs.py --device cuda --batches 1 32 --json "../$OUT/structured_outputs.json") \
        2>&1 | tail -10 | tee "$OUT/structured_outputs.txt" ;;
  esac
}

case ${1:-} in
  ""|lease) lease_plan "${STAGES[@]}" ;;
  --dry-run) dry_run ;;
  --stages)
    IFS=, read -r -a chosen <<<"${2:?--stages needs a comma-separated list of: ${STAGES[*]}}"
    for s in "${chosen[@]}"; do
      [ -n "${BUDGET[$s]:-}" ] || { echo "unknown stage $s; the stages: ${STAGES[*]}"; exit 2; }
    done
    ordered=()
    for s in "${STAGES[@]}"; do for c in "${chosen[@]}"; do [ "$s" = "$c" ] && ordered+=("$s"); done; done
    lease_plan "${ordered[@]}" ;;
  engine|kernels|decode|mtp|eplb|recovery|disagg|sampling) old_part "$1" ;;
  all) for p in engine kernels decode mtp eplb recovery disagg sampling; do old_part "$p"; done ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run | --stages a,b | <part>]  (see the header)"; exit 2 ;;
esac
