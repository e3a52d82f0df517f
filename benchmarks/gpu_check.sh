#!/usr/bin/env bash
# The GPU check, for a session that is lent the CUDA machine (H100 80 GB or H200): ONE command that fits one
# lease (15 minutes of device time in all, a fresh machine minutes of it, at most 10 per command, at most 8 files
# back under $OUT, the image's own python3 with torch 2.11 and Triton 3.6, no network). CUDA tests only (CI runs
# the CPU ones): the kernel, dispatch and sampling tests marked `cuda`, and the engine tests that take the `device`
# fixture (EPSERVE_TEST_DEVICE=cuda makes it the GPU). Stages run in order of value, each under `timeout`, with
# 540 s of stage budget in all (LEASE_BUDGET_S to change it): a stage gets its own budget plus whatever the stages
# before it left unused, never the time the stages after it were budgeted, so a slow stage cannot eat the rest.
# MLA decode is pinned to Triton (EPSERVE_MLA_BACKEND=triton) in every stage but the last, so FlashInfer's JIT
# build happens there alone, timed.
#   env         nvidia-smi; the carried wheels (benchmarks/gpu_wheels.sh made .whl) installed into /tmp/site, on
#               PYTHONPATH; versions, which optional packages import. The v3 stage's checkpoint is then built in
#               the background (CPU only) while the GPU stages run.
#   mtp         tests/engine/test_mtp_engine.py::test_captured_decode_with_mtp with the engine on CUDA: the
#               captured decode (CUDA graphs) with MTP drafts and verification rows, tokens = plain decoding's.
#   tokens      benchmarks/gpu_tokens.py --check: the bf16 and FP8 tiny checkpoints rebuilt (their hashes against
#               the reference's), greedy 64 tokens for 5 prompts, captured and eager, against the tokens this
#               project's CPU computed (benchmarks/gpu_reference/tokens.json); equal, or the first difference.
#   kernels     tests/kernels -m cuda (FlashInfer's to its stage): FP8 GEMMs and _scaled_mm, grouped experts, the
#               fused router, paged MLA decode, fused norms/RoPE, CUDA-graph capture and replay of each, against
#               the torch references; the NVFP4 W4A16 kernels' start-up self-test (test_nvfp4_selftest.py: chosen
#               on the GPU, a broken kernel handing the ops and an eager engine to the reference); 4 pytest-xdist
#               workers where xdist imports.
#   dispatch    tests/parallel on CUDA (--on-device): PaddedDispatcher and the TP collectives captured on a one-rank
#               NCCL group, SymmMemDispatcher eager and captured on one-rank NVSHMEM, the overlap schedules.
#   capture     tests/engine and tests/model on CUDA (--on-device; not slow): the engine's start-up capture,
#               parity with transformers, prefix cache, preemption, the KV handoff, EPLB into the captured decode.
#   micro       benchmarks/gpu_micro.py: copy bandwidth and bf16 matmul (the ceilings), the FP8 GEMMs at V3's
#               shapes (o_proj, the dense MLP) against _scaled_mm and cuBLAS, the grouped GEMM, Triton MLA decode
#               at 128 and 16 heads (JSON rewritten after every measurement).
#   v3          benchmarks/v3_layer.py: DeepSeek-V3's dense and MoE layer at full width with one EP8 expert shard,
#               FP8 weights: decode step time per layer at batch 1, 16, 64, eager and captured, per-op times.
#   sampling    logits processing and structured outputs (xgrammar bitmasks on CUDA logits) on CUDA.
#   flashinfer  FlashInfer's paged MLA decode against the reference and the registry's choice (its JIT build for
#               sm_90a; FLASHINFER_CUDA_ARCH_LIST, MAX_JOBS set), then gpu_micro.py --parts mla --flashinfer.
#   sanitizer   (not in the plan: --stages sanitizer) compute-sanitizer memcheck on the MLA decode CUDA tests.
# Each pytest stage writes one JSON line per test as it finishes (benchmarks/gpu_report.py, a pytest plugin), so
# a stage cut off by its timeout still reports what ran and the test it was in; the benchmark stages rewrite
# their JSON after each measurement. After every stage, and every 30 s during one, $OUT gets: summary.json
# (each stage's status, seconds, budget, tests, failures, figures, the stage JSONs merged in, cut-off ones too),
# logs.tar.gz (every stage's complete output, test reports and JSON) and tails.txt (each stage's last lines).
#
# Usage (device tool):  bash benchmarks/gpu_check.sh                   the lease plan (about 9 minutes)
#                       bash benchmarks/gpu_check.sh --stages v3,micro  some of its stages (a second call)
#                       bash benchmarks/gpu_check.sh --dry-run          here, on the CPU: the plan, checked
#                       bash benchmarks/gpu_check.sh <part>             one of the older, longer checks:
#   engine|kernels|decode|mtp|eplb|recovery|disagg|sampling (each < 10 min, one a call; see old_part below).
# First, here: bash benchmarks/gpu_wheels.sh (the wheels, .whl) and python benchmarks/gpu_tokens.py --build .gpu-ref
# (the token stage's checkpoints, built on this CPU); then carry both:
#   run(carry=[".whl", ".gpu-ref"], command="bash benchmarks/gpu_check.sh", timeout_s=600).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT=${OUT:-bench_out}
TOTAL=${LEASE_BUDGET_S:-540}
MIN_STAGE_S=15
SNAPSHOT_S=30
LEASE_FILES=(summary.json logs.tar.gz tails.txt)  # gpu_report.LEASE_FILES

# ---- the plan: stage, budget (s), test selection -----------------------------------------------------------
ALL_STAGES=(env mtp tokens kernels sanitizer dispatch capture micro v3 sampling flashinfer)
STAGES=(env mtp tokens kernels dispatch capture micro v3 sampling flashinfer)  # the default plan
declare -A BUDGET=([env]=20 [mtp]=40 [tokens]=45 [kernels]=80 [sanitizer]=60 [dispatch]=35 [capture]=50 [micro]=75
                   [v3]=95 [sampling]=25 [flashinfer]=60)
# The tests each pytest stage selects (the dry run collects each: a renamed file or test, or a lost mark, breaks it).
declare -A SELECT=(
  [mtp]="tests/engine/test_mtp_engine.py::test_captured_decode_with_mtp"
  [kernels]="tests/kernels -m cuda -k 'not flashinfer and not whichever_backend'"
  [sanitizer]="tests/kernels/test_mla_decode_kernel.py -m cuda"
  [dispatch]="tests/parallel --on-device"
  [capture]="tests/engine tests/model --on-device -m 'not slow' --deselect tests/engine/test_mtp_engine.py::test_captured_decode_with_mtp
             --ignore=tests/engine/test_logits_processing.py --ignore=tests/engine/test_structured.py
             --ignore=tests/engine/test_structured_failures.py"
  [sampling]="tests/engine/test_logits_processing.py tests/engine/test_structured.py
              tests/engine/test_structured_failures.py --on-device"
  [flashinfer]="tests/kernels/test_backends.py tests/kernels/test_capture_path.py -m cuda
                -k 'flashinfer or whichever_backend'"
)
# The kernel ops' self-tests on the device (kernels.backends: what each op runs on CUDA is decided by them), which
# their stages must keep selecting: the dry run fails where a selection, a rename or a lost mark drops one.
declare -A SELF_TESTS=(
  [kernels]="test_nvfp4_selftest.py::test_cuda_self_test_chooses_the_kernels
             test_nvfp4_selftest.py::test_cuda_broken_kernel_hands_the_ops_to_the_reference
             test_nvfp4_selftest.py::test_cuda_engine_on_the_reference_decodes_eagerly
             test_backends.py::test_scaled_mm_is_used_only_where_it_passes_for_that_output_dtype
             test_backends.py::test_the_timed_self_test_on_cuda_logs_each_backends_time"
  [flashinfer]="test_backends.py::test_flashinfer_or_triton_mla_decode_is_chosen_on_time"
)
SAMPLING_NO_XGRAMMAR="tests/engine/test_logits_processing.py --on-device"
REFERENCE=benchmarks/gpu_reference/tokens.json
MICRO_ARGS="--repeats 10"
V3_ARGS="--device cuda --variants fp8 --batches 1 64"
FI_MICRO_ARGS="--parts mla --mla-heads 128 --flashinfer --repeats 5"
# the benchmark scripts and the flags the plan passes them (the dry run checks each --help names them)
declare -A FLAGS=([benchmarks/gpu_tokens.py]="--check --json --device"
                  [benchmarks/gpu_micro.py]="--repeats --json --parts --mla-heads --flashinfer"
                  [benchmarks/v3_layer.py]="--device --variants --batches --json --build-only --size")
declare -A DESC=(
  [env]="nvidia-smi; pip install .whl/*.whl --target /tmp/site; versions, optional imports -> env.json"
  [mtp]="pytest ${SELECT[mtp]}"
  [tokens]="python3 benchmarks/gpu_tokens.py --check $REFERENCE"
  [kernels]="pytest ${SELECT[kernels]}"
  [sanitizer]="compute-sanitizer --tool memcheck pytest ${SELECT[sanitizer]}"
  [dispatch]="pytest ${SELECT[dispatch]}"
  [capture]="pytest tests/engine tests/model --on-device -m 'not slow' (not mtp's test, not sampling's files)"
  [micro]="python3 benchmarks/gpu_micro.py $MICRO_ARGS"
  [v3]="python3 benchmarks/v3_layer.py $V3_ARGS (checkpoint built in the background after env)"
  [sampling]="pytest tests/engine/test_logits_processing.py test_structured*.py --on-device (structured where xgrammar imports)"
  [flashinfer]="pytest ${SELECT[flashinfer]} (MLA auto); gpu_micro.py $FI_MICRO_ARGS"
)

wheel_mib() { find .whl -maxdepth 1 -type f -name '*.whl' -printf '%s\n' 2>/dev/null | awk '{s += $1} END {printf "%.1f", s / 2^20}'; }

summary() {  # summary [RUNNING_STAGE]: summary.json, logs.tar.gz, tails.txt rewritten from $WORK
  "$PY" benchmarks/gpu_report.py summary "$WORK" "$OUT" "$TOTAL" ${1:+--running "$1"} 2>>"$WORK/summary.err"
}

record() {  # record NAME STATUS SECONDS TIMEOUT RC REPORT JSON NOTE
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${BUDGET[$1]}" "$4" "$5" "$1.out" "$6" "$7" \
    "${8//$'\t'/ }" >>"$WORK/stages.tsv"
}

later_budget() {  # the budgets of the planned stages after $1
  local s seen=0 sum=0
  for s in "${PLAN[@]}"; do
    if [ $seen = 1 ]; then sum=$((sum + BUDGET[$s])); fi
    if [ "$s" = "$1" ]; then seen=1; fi
  done
  echo $sum
}

# run_stage NAME REPORT JSON COMMAND...: under timeout, its whole output to $WORK/NAME.out, the records merged
# into $OUT every SNAPSHOT_S seconds while it runs and once more when it ends
run_stage() {
  local name=$1 report=$2 js=$3
  shift 3
  local left=$((TOTAL - (SECONDS - T0) - $(later_budget "$name")))
  local output="$WORK/$name.out"
  if [ $left -lt $MIN_STAGE_S ]; then
    echo "== $name: skipped, ${left}s left of its budget" | tee -a "$output"
    record "$name" "skipped: no budget left" 0 "$left" - - - ""
    summary
    return 1
  fi
  echo "== $name (up to ${left}s): $*"
  echo "== $name (up to ${left}s; budget ${BUDGET[$name]}s): $*" >"$output"
  (while sleep "$SNAPSHOT_S"; do summary "$name"; done) &
  local snap=$! t0=$EPOCHREALTIME
  timeout -k 5 "$left" "$@" >>"$output" 2>&1
  local rc=$?
  kill "$snap" 2>/dev/null
  wait "$snap" 2>/dev/null
  local secs status=ok
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}')
  case $rc in
    0) status=ok ;;
    124|137) status="timeout after ${left}s" ;;
    5) [ "$report" != - ] && status="no tests selected" || status="failed (exit 5)" ;;
    *) status="failed (exit $rc)" ;;
  esac
  if [ "$name" = sanitizer ] && grep -q "Device not supported" "$output"; then status="unsupported: compute-sanitizer refused the device"; fi
  echo "== $name: $status in ${secs}s" >>"$output"
  echo "   $name: $status in ${secs}s"
  record "$name" "$status" "$secs" "$left" "$rc" "$report" "$js" "${NOTE:-}"
  NOTE=
  summary
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
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
except Exception as e:  # noqa: BLE001
    out["torch_error"] = f"{type(e).__name__}: {e}"[:300]
import importlib.metadata as metadata
dists = {"triton": "triton", "transformers": "transformers", "xdist": "pytest-xdist", "xgrammar": "xgrammar",
         "jsonschema": "jsonschema", "pydantic": "pydantic", "tvm_ffi": "apache-tvm-ffi", "flashinfer": "flashinfer-python",
         "nvshmem": "nvidia-nvshmem-cu13"}
for name, dist in dists.items():
    try:
        if name == "nvshmem":
            out[name] = metadata.version(dist)
            continue
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

plugin_path() {  # the pytest plugin (-p gpu_report) alone in a folder of $WORK, for PYTHONPATH (no other module
  mkdir -p "$WORK/plugin" && cp benchmarks/gpu_report.py "$WORK/plugin/"  # of benchmarks/ shadows an installed one)
}

has() {  # has STAGE: whether the plan runs it
  local s
  for s in "${PLAN[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
}

pytest_args() {  # pytest_args NAME [SELECTION]: the stage's pytest command line, its report into $WORK/NAME.jsonl
  local sel=()
  eval "sel=(${2:-${SELECT[$1]}})"  # the selection's quoting (-k '...') as the shell reads it
  ARGS=("$PY" -m pytest -q -p no:cacheprovider -p gpu_report --gpu-report "$WORK/$1.jsonl" "${sel[@]}")
}

pytest_stage() {  # pytest_stage NAME [extra pytest args]
  local name=$1
  shift
  pytest_args "$name"
  run_stage "$name" "$WORK/$name.jsonl" - "${ARGS[@]}" "$@"
}

lease_plan() {
  PLAN=("$@")
  PY=${PYTHON:-python3}
  case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # stages cd into benchmarks/
  WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
  mkdir -p "$OUT"
  rm -f "$OUT"/{summary.json,logs.tar.gz,tails.txt}
  T0=$SECONDS
  NOTE=
  local mla_pin=${EPSERVE_MLA_BACKEND:-triton}
  export PYTHONUNBUFFERED=1 EPSERVE_TEST_DEVICE=cuda EPSERVE_NO_PROGRESS=1 EPSERVE_MLA_BACKEND=$mla_pin
  export EPSERVE_CACHE_DIR=${EPSERVE_CACHE_DIR:-$ROOT/.gpu-cache}
  plugin_path
  export PYTHONPATH=$ROOT/src:$WORK/plugin${PYTHONPATH:+:$PYTHONPATH}
  if compgen -G ".whl/*.whl" >/dev/null; then export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
  export -f env_probe wheel_mib
  export PY
  echo "lease plan: ${PLAN[*]}; ${TOTAL}s of stage budget; MLA pinned to $mla_pin before flashinfer; work in $WORK, results in $OUT"
  BUILD_PID=
  if has env; then
    run_stage env - - bash -c 'env_probe "$1"' _ "$WORK/env.json"
  else
    env_probe "$WORK/env.json" >"$WORK/env.out" 2>&1
  fi
  local xdist=() sanitizer cap
  [ -n "$(envget xdist)" ] && xdist=(-n 4 --dist loadfile)
  sanitizer=$(envget compute_sanitizer)
  cap=$(envget capability)
  if has v3; then  # the checkpoint, on the CPU, while the GPU stages run (v3_layer.py waits for it)
    nice -n 10 timeout 400 "$PY" benchmarks/v3_layer.py --build-only --size v3 --device cpu \
      >"$WORK/v3_build.out" 2>&1 &
    BUILD_PID=$!
  fi
  if has mtp; then pytest_stage mtp; fi
  if has tokens; then
    local carried=()  # the checkpoints built on the CPU (gpu_tokens.py --build .gpu-ref), where the lease carried them
    [ -f .gpu-ref/bf16/config.json ] && carried=(--workdir .gpu-ref)
    run_stage tokens - "$WORK/tokens.json" "$PY" benchmarks/gpu_tokens.py --check "$REFERENCE" --json "$WORK/tokens.json" \
      "${carried[@]}"
  fi
  if has kernels; then pytest_stage kernels "${xdist[@]}"; fi
  if has sanitizer; then
    if [ -n "$sanitizer" ]; then
      pytest_args sanitizer
      run_stage sanitizer "$WORK/sanitizer.jsonl" - env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool memcheck \
        --error-exitcode 3 --print-limit 20 "${ARGS[@]}"
    else
      echo "== sanitizer: skipped (no compute-sanitizer on PATH or in /usr/local/cuda)" >"$WORK/sanitizer.out"
      record sanitizer "skipped: no compute-sanitizer on PATH" 0 0 - - - ""
      summary
    fi
  fi
  if has dispatch; then pytest_stage dispatch; fi
  if has capture; then pytest_stage capture; fi
  if has micro; then
    run_stage micro - "$WORK/micro.json" bash -c "cd benchmarks && \"\$PY\" gpu_micro.py $MICRO_ARGS --json $WORK/micro.json"
  fi
  if has v3; then
    run_stage v3 - "$WORK/v3.json" bash -c "cd benchmarks && \"\$PY\" v3_layer.py $V3_ARGS --json $WORK/v3.json"
  fi
  if [ -n "$BUILD_PID" ] && kill -0 "$BUILD_PID" 2>/dev/null; then kill "$BUILD_PID" 2>/dev/null; fi
  if has sampling; then
    if [ -n "$(envget xgrammar)" ] && [ -n "$(envget jsonschema)" ]; then
      pytest_stage sampling
    else
      NOTE="xgrammar or jsonschema does not import: the structured-output tests left out"
      pytest_args sampling "$SAMPLING_NO_XGRAMMAR"
      run_stage sampling "$WORK/sampling.jsonl" - "${ARGS[@]}"
    fi
  fi
  if has flashinfer; then  # last: FlashInfer's JIT build, MLA decode on auto (its self-test decides), timed
    if [ -n "$(envget flashinfer)" ]; then
      export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-${cap}$([ "${cap%%.*}" -ge 9 ] 2>/dev/null && echo a)}
      export MAX_JOBS=${MAX_JOBS:-$(nproc)}
      NOTE="FLASHINFER_CUDA_ARCH_LIST=$FLASHINFER_CUDA_ARCH_LIST"
    else
      NOTE="flashinfer does not import: the fallback to Triton is what runs"
    fi
    pytest_args flashinfer
    run_stage flashinfer "$WORK/flashinfer.jsonl" "$WORK/flashinfer.json" env -u EPSERVE_MLA_BACKEND bash -c \
      '"$@"; rc=$?; cd benchmarks && "$PY" gpu_micro.py '"$FI_MICRO_ARGS --json $WORK/flashinfer.json"'; m=$?
       [ $rc = 0 ] && rc=$m; exit $rc' _ "${ARGS[@]}"
  fi
  summary
  echo "done in $((SECONDS - T0))s; $OUT: $(ls "$OUT" | tr '\n' ' ')"
  "$PY" benchmarks/gpu_report.py table "$OUT"
  rm -rf "$WORK"  # all of it is in logs.tar.gz
}

# ---- the dry run: the plan printed and checked on a machine without a GPU ----------------------------------
dry_run() {
  PY=${PYTHON:-}
  if [ -z "$PY" ]; then if [ -x .venv/bin/python ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi; fi
  case $PY in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac  # the --help checks cd
  local bad=0 sum=0 s files=${#LEASE_FILES[@]}
  echo "lease plan: one command, ${#STAGES[@]} stages, each under timeout with the budget below plus what earlier stages left"
  for s in "${ALL_STAGES[@]}"; do
    if has_default "$s"; then sum=$((sum + BUDGET[$s])); fi
    printf '  %-10s %4ss  %s%s\n' "$s" "${BUDGET[$s]}" "$(has_default "$s" || echo '(--stages only) ')" "${DESC[$s]}"
  done
  echo "  total      ${sum}s of ${TOTAL}s (LEASE_BUDGET_S); files under \$OUT: ${LEASE_FILES[*]}"
  [ "$sum" -le "$TOTAL" ] || { echo "  FAIL: the stage budgets add up to ${sum}s, over ${TOTAL}s"; bad=1; }
  [ "$files" -le 8 ] || { echo "  FAIL: $files files, over 8"; bad=1; }
  local n
  n=$("$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); import gpu_report; print(len(gpu_report.LEASE_FILES))")
  [ "$n" = "$files" ] || { echo "  FAIL: gpu_report.py writes $n files, the plan says $files"; bad=1; }
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
    echo "  only the fallback tests and Triton's MLA timings, sampling leaves the structured-output tests out"
  fi
  if [ -f .gpu-ref/bf16/config.json ] && [ -f .gpu-ref/fp8/config.json ]; then
    echo "token checkpoints .gpu-ref: present ($(du -sm .gpu-ref | cut -f1) MiB; carry it with the wheels)"
  else
    echo "token checkpoints .gpu-ref: absent (python benchmarks/gpu_tokens.py --build .gpu-ref; else the GPU machine"
    echo "  builds them, and its torch must draw the same random weights for the reference to apply)"
  fi
  # every script the plan runs, with the flags it passes
  local f flag help i=0
  for f in "${!FLAGS[@]}" benchmarks/gpu_report.py benchmarks/gpu_wheels.sh "$REFERENCE"; do
    [ -f "$f" ] || { echo "  FAIL: $f is missing"; bad=1; }
  done
  # each script's --help and each stage's collection in the background, read back in order (the checks are
  # independent; together they cost a minute one after another)
  local pending
  pending=$(mktemp -d /tmp/gpu_check_help.XXXXXX)
  for f in "${!FLAGS[@]}"; do
    i=$((i + 1))
    (cd "$(dirname "$f")" && PYTHONPATH=$ROOT/src "$PY" "$(basename "$f")" --help >"$pending/$i.out" 2>&1; echo $? >"$pending/$i.rc") &
  done
  wait
  i=0
  for f in "${!FLAGS[@]}"; do
    i=$((i + 1))
    help=$(cat "$pending/$i.out")
    [ "$(cat "$pending/$i.rc")" = 0 ] || { echo "  FAIL: $f --help: ${help: -300}"; bad=1; continue; }
    for flag in ${FLAGS[$f]}; do
      grep -q -- "$flag\b" <<<"$help" || { echo "  FAIL: $f takes no $flag (the plan passes it)"; bad=1; }
    done
  done
  rm -rf "$pending"
  # the token reference: shipped, for the generator gpu_tokens.py has now
  PYTHONPATH=$ROOT/src "$PY" - "$REFERENCE" <<'EOF' || bad=1
import json, sys
sys.path.insert(0, "benchmarks")
import gpu_tokens as g
ref = json.load(open(sys.argv[1]))
gen = ref.get("generator", {})
now = {"seed": g.SEED, "logit_margin": g.LOGIT_MARGIN, "tokens": g.TOKENS, "variants": g.VARIANTS, "engine": g.ENGINE}
stale = [k for k, v in now.items() if gen.get(k) != v] + (["prompts"] if ref.get("prompts") != g.PROMPTS else [])
if stale or set(ref.get("variants", {})) != set(g.VARIANTS):
    print(f"  FAIL: {sys.argv[1]} is for another generator ({', '.join(stale) or 'variants'}): "
          "python benchmarks/gpu_tokens.py --write-reference " + sys.argv[1])
    sys.exit(1)
shapes = ", ".join(f"{v} {len(r['tokens'])}x{g.TOKENS}" for v, r in ref["variants"].items())
print(f"token reference: {sys.argv[1]}: {shapes} tokens, written with torch {ref['written_with']['torch']}")
EOF
  # every test selection collected as the stage runs it (the plugin's --on-device included): at least one test
  WORK=$(mktemp -d /tmp/gpu_check_dry.XXXXXX)
  plugin_path
  local PYTHONPATH=$WORK/plugin${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONPATH
  local counts=() line
  for s in "${ALL_STAGES[@]}"; do
    [ -n "${SELECT[$s]:-}" ] || continue
    pytest_args "$s"
    ("${ARGS[@]}" --collect-only >"$WORK/$s.collect" 2>&1) &
  done
  wait
  for s in "${ALL_STAGES[@]}"; do
    [ -n "${SELECT[$s]:-}" ] || continue
    line=$(grep -E "tests? collected|no tests collected|error" "$WORK/$s.collect" | tail -1)
    n=$(sed -nE 's/^([0-9]+)(\/[0-9]+)? tests? collected.*/\1/p' <<<"$line")
    if grep -q error <<<"$line" || [ -z "$line" ]; then
      echo "  FAIL: $s: collecting ${SELECT[$s]} fails here (${line:-no output})"
      bad=1
    elif [ -z "$n" ] || [ "$n" -lt 1 ]; then
      echo "  FAIL: $s: the selection ${SELECT[$s]} collects no test here ($line)"
      bad=1
    else
      counts+=("$s $n")
    fi
  done
  line=$(printf '%s, ' "${counts[@]}")
  echo "test selections (collected here): ${line%, }"
  local t found=()
  for s in "${!SELF_TESTS[@]}"; do
    for t in ${SELF_TESTS[$s]}; do
      if grep -qE "/$t(\[|\$)" "$WORK/$s.collect"; then
        found+=("$t")
      else
        echo "  FAIL: $s: its selection no longer collects $t (a kernel op's self-test on the device)"
        bad=1
      fi
    done
  done
  echo "kernel self-tests on the device (collected): ${#found[@]}"
  # the summary merge, on planned records
  local dry_out="$WORK/out"
  mkdir -p "$dry_out"
  for s in "${STAGES[@]}"; do record "$s" planned - "${BUDGET[$s]}" - - - "dry run"; done
  if "$PY" benchmarks/gpu_report.py summary "$WORK" "$dry_out" "$TOTAL" && "$PY" -c "import json, sys; s = json.load(open(sys.argv[1])); assert len(s['stages']) == int(sys.argv[2])" \
      "$dry_out/summary.json" "${#STAGES[@]}" && [ "$(ls "$dry_out" | wc -l)" -le 8 ]; then
    echo "summary: the merge writes a valid summary.json ($(wc -c <"$dry_out/summary.json") bytes for the planned stages), $(ls "$dry_out" | tr '\n' ' ')"
  else
    echo "  FAIL: the summary merge"
    bad=1
  fi
  rm -rf "$WORK"
  [ $bad = 0 ] || echo "dry run: FAILED (above)"
  echo "budget $sum s, $files files, wheels $wheels MiB"
  return $bad
}

has_default() {  # has_default STAGE: whether the default plan runs it
  local s
  for s in "${STAGES[@]}"; do [ "$s" = "$1" ] && return 0; done
  return 1
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
    IFS=, read -r -a chosen <<<"${2:?--stages needs a comma-separated list of: ${ALL_STAGES[*]}}"
    for s in "${chosen[@]}"; do
      [ -n "${BUDGET[$s]:-}" ] || { echo "unknown stage $s; the stages: ${ALL_STAGES[*]}"; exit 2; }
    done
    ordered=()
    for s in "${ALL_STAGES[@]}"; do for c in "${chosen[@]}"; do [ "$s" = "$c" ] && ordered+=("$s"); done; done
    lease_plan "${ordered[@]}" ;;
  engine|kernels|decode|mtp|eplb|recovery|disagg|sampling) old_part "$1" ;;
  all) for p in engine kernels decode mtp eplb recovery disagg sampling; do old_part "$p"; done ;;
  *) echo "usage: bash benchmarks/gpu_check.sh [--dry-run | --stages a,b | <part>]  (see the header)"; exit 2 ;;
esac
