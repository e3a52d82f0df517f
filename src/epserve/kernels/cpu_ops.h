/* What the small fused ops of a CPU decode step share (cpu_ops.c, cpu_ops_mla.c, cpu_ops_heads.c, cpu_ops_moe.c:
 * one library, x86-64 with AVX2 + FMA; plain C the compiler vectorizes, built with -ffp-contract=off so
 * products and sums round as torch's separate ops do; paged MLA decode, whose sums are not torch's in any
 * case, in AVX2/FMA intrinsics, AVX-512 where the CPU has it).
 *
 * Each op replaces a chain of eager torch ops whose cost at decode sizes is the dispatch of every op, not
 * its arithmetic. Math is fp32 rounded to the dtype where torch's ops round; results equal the references
 * up to the order of a sum. Built and loaded at run time by kernels/cpu.py, each function declared to it in
 * kernels/cpu_abi.py's table; the torch references are the fallback.
 */
#ifndef EPSERVE_CPU_OPS_H
#define EPSERVE_CPU_OPS_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_bf16.h"

/* The row-wise ops (norms, activations, adds, casts, rotary, gathers, the dispatch's copies and the
 * combine) run on every OpenMP thread from this many values (a prefill's rows: torch's threaded ops would
 * otherwise win there), on the calling thread below it (a decode step's few rows: a fork would cost more
 * than the work). Rows never depend on one another, so the results do not depend on the threads. */
#define PARALLEL_MIN ((int64_t)1 << 16)

/* A value as the dtype holds it: rounded to bf16 (is_bf16) or kept (fp32). Rounding after every op
 * as torch's bf16 ops round is what keeps the fused ops equal to their references bit for bit. */
static inline float as_dtype(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float load(const void *p, int64_t i, int is_bf16) {
  return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
  if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
  else ((float *)p)[i] = v;
}


#endif
