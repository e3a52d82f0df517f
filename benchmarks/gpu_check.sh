#!/usr/bin/env bash
# The GPU checks, for a session that is lent a CUDA machine. Results go to $OUT (or ./bench_out).
#   engine: the engine tests and the transformers parity tests with the engine on CUDA (the oracle stays
#           on the CPU), then the offline benchmark on CUDA.
#   kernels: the Triton kernel tests on CUDA against the CPU references (block-scaled FP8: Triton and
#           blockwise torch._scaled_mm where the probe accepts it; the fused router; paged MLA decode; each
#           with a CUDA-graph capture and replay), then the FP8 GEMM benchmark (Triton vs _scaled_mm vs bf16
#           at M = 1, 16, 128, 4096; grouped expert GEMM).
#   decode: the decode step eager vs captured as CUDA graphs at batch 1, 16, 64 (small preset), and the
#           FP8 runtime against the dequantized model in the engine.
#   mtp: MTP speculative decoding with the engine on CUDA (greedy = plain decoding with accepted and
#           rejected drafts, CUDA graphs for the verification rows, sampling, rollback), then acceptance
#           and tokens/s with and without MTP on a briefly trained checkpoint.
#   eplb: expert load balancing with the engine on CUDA: replicas routed inside captured CUDA graphs,
#           rebalances rewriting the expert weights and routing tables in place every few steps (tokens
#           and logprobs = the CPU reference). Moves between ranks (NCCL point-to-point) need two GPUs.
#   recovery: `epserve serve --device cuda` with its one rank SIGKILLed and SIGSTOPped mid-stream: detected,
#           restarted (a fresh CUDA process), served again; SIGTERM exits 0 (benchmarks/recovery.py).
#   disagg: prefill/decode disaggregation with the engine on CUDA: KV blocks copied out of one engine's
#           cache and written into another's (decode inside captured CUDA graphs; MTP layer's KV too; tokens
#           = one engine), then `serve --disaggregate --device cuda` (one prefill, one decode process sharing
#           the GPU) on the mixed workload of benchmarks/disagg_mixed.py.
#   sampling: logits processing (penalties, logit_bias, min_tokens; MTP drafts and verification), prompt
#           logprobs and structured outputs (xgrammar bitmasks applied to CUDA logits) with the engine on CUDA
#           against the references, then the decode step with and without processing at batch 1 and 64, a
#           prefill with and without prompt_logprobs, and the decode step with half the batch constrained.
# Usage (device tool): bash benchmarks/gpu_check.sh [engine|kernels|decode|mtp|eplb|recovery|disagg|sampling|all]   (default all; each < 10 min)
set -uo pipefail
cd "$(dirname "$0")/.."
PART=${1:-all}
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
export EPSERVE_TEST_DEVICE=cuda EPSERVE_CACHE_DIR=${EPSERVE_CACHE_DIR:-$PWD/.gpu-cache} PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"
python3 -c "import triton; print('triton', triton.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
if [ "$PART" = engine ] || [ "$PART" = all ]; then
  # test_overlap: the overlap schedules (incl. two micro-batches) in one process on CUDA. Multi-rank NCCL
  # expert parallelism needs two GPUs (NCCL refuses two ranks on one device): not checkable on one H200.
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/model/test_model_parity.py tests/engine/test_engine.py tests/parallel/test_overlap.py \
    2>&1 | tail -25 | tee "$OUT/tests.txt"
  timeout 180 python3 benchmarks/offline_throughput.py --device cuda --repeats 3 --json "$OUT/offline.json" \
    2>&1 | tail -30 | tee "$OUT/offline.txt"
fi
if [ "$PART" = kernels ] || [ "$PART" = all ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_kernels.py tests/kernels/test_gate_kernel.py \
    tests/kernels/test_mla_decode_kernel.py 2>&1 | tail -25 | tee "$OUT/kernel_tests.txt"
  timeout 150 python3 benchmarks/fp8_gemm.py --json "$OUT/fp8_gemm.json" \
    2>&1 | tail -80 | tee "$OUT/fp8_gemm.txt"
fi
if [ "$PART" = decode ] || [ "$PART" = all ]; then
  (cd benchmarks && timeout 300 python3 decode_capture.py --device cuda --batches 1 16 64 --json "../$OUT/decode_capture.json") \
    2>&1 | tail -20 | tee "$OUT/decode_capture.txt"
  timeout 150 python3 benchmarks/fp8_engine.py --device cuda --memory-budget-gb 4 --json "$OUT/fp8_engine.json" \
    2>&1 | tail -10 | tee "$OUT/fp8_engine.txt"
fi
if [ "$PART" = mtp ] || [ "$PART" = all ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_mtp_engine.py tests/engine/test_spec_decode.py \
    2>&1 | tail -25 | tee "$OUT/mtp_tests.txt"
  timeout 120 python3 -m epserve.cli make-checkpoint "$OUT/trained" --train --train-seconds 90 --dtype bfloat16 \
    2>&1 | tail -3 | tee "$OUT/mtp_train.txt"
  timeout 150 python3 benchmarks/mtp_decode.py --model "$OUT/trained" --dtype bfloat16 --device cuda \
    --json "$OUT/mtp_decode.json" 2>&1 | tail -20 | tee "$OUT/mtp_decode.txt"
fi
if [ "$PART" = eplb ] || [ "$PART" = all ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_eplb.py tests/parallel/test_eplb_policy.py \
    2>&1 | tail -25 | tee "$OUT/eplb_tests.txt"
fi
if [ "$PART" = recovery ] || [ "$PART" = all ]; then
  # One GPU: one rank (dp 1). SIGKILL and SIGSTOP of the CUDA rank with a stream in flight: detected,
  # the group torn down and started again (spawned, CUDA), served again; then SIGTERM exits 0.
  timeout 300 python3 benchmarks/recovery.py --device cuda --dp 1 --step-timeout 5 --repeats 1 \
    --json "$OUT/recovery.json" 2>&1 | tail -10 | tee "$OUT/recovery.txt"
fi
if [ "$PART" = disagg ] || [ "$PART" = all ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_kv_handoff.py \
    2>&1 | tail -25 | tee "$OUT/disagg_tests.txt"
  timeout 300 python3 benchmarks/disagg_mixed.py --device cuda --dtype bfloat16 --deployments disaggregated \
    --json "$OUT/disagg_mixed.json" 2>&1 | tail -10 | tee "$OUT/disagg_mixed.txt"
fi
if [ "$PART" = sampling ] || [ "$PART" = all ]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_logits_processing.py \
    tests/engine/test_structured.py 2>&1 | tail -25 | tee "$OUT/sampling_tests.txt"
  (cd benchmarks && timeout 300 python3 logits_processing.py --device cuda --batches 1 64 --json "../$OUT/logits_processing.json") \
    2>&1 | tail -10 | tee "$OUT/logits_processing.txt"
  (cd benchmarks && timeout 200 python3 structured_outputs.py --device cuda --batches 1 32 --json "../$OUT/structured_outputs.json") \
    2>&1 | tail -10 | tee "$OUT/structured_outputs.txt"
fi
