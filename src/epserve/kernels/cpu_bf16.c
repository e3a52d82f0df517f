/* Memory-bound bf16 kernels for CPU decode steps (x86-64 with AVX512-BF16).
 *
 * A decode step multiplies a handful of token rows by every weight it touches once, so its time is
 * the time to stream the weights. These kernels read each weight row exactly once for up to
 * TILE_M token rows (fp32 accumulation with _mm512_dpbf16_ps) and split the work over OpenMP
 * threads. Built and loaded at run time by kernels/cpu.py; the torch path is the fallback.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_bf16.h"

#define TILE_M 16

/* R weight rows (R streams in flight) against M <= 4 rows of x, for compile-time R and M so the
 * R*M accumulators live in registers: y[m, r] = sum_k x[m, k] * w[r, k]. */
#define DEFINE_DOT(R, M)                                                                              \
  static void dot_##R##x##M(const uint16_t *x, const uint16_t *w, int64_t K, float *y, int64_t ldy) { \
    __m512 acc[R][M];                                                                                 \
    for (int r = 0; r < R; r++)                                                                       \
      for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                                    \
    for (int64_t k = 0; k < K; k += 32) {                                                             \
      __m512bh wv[R];                                                                                 \
      for (int r = 0; r < R; r++) wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w + r * K + k)); \
      for (int m = 0; m < M; m++) {                                                                   \
        __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k));                    \
        for (int r = 0; r < R; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);               \
      }                                                                                               \
    }                                                                                                 \
    for (int m = 0; m < M; m++)                                                                       \
      for (int r = 0; r < R; r++) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);                   \
  }
DEFINE_DOT(4, 1) DEFINE_DOT(4, 2) DEFINE_DOT(4, 3) DEFINE_DOT(4, 4)
DEFINE_DOT(1, 1) DEFINE_DOT(1, 2) DEFINE_DOT(1, 3) DEFINE_DOT(1, 4)

typedef void (*dot_fn)(const uint16_t *, const uint16_t *, int64_t, float *, int64_t);
static const dot_fn DOT4[5] = {0, dot_4x1, dot_4x2, dot_4x3, dot_4x4};
static const dot_fn DOT1[5] = {0, dot_1x1, dot_1x2, dot_1x3, dot_1x4};

/* y[m, n] = sum_k x[m, k] * w[n, k] for rows n in [n0, n1); M <= TILE_M; K % 32 == 0. fp32 out.
 * Weight rows are the outer loop so each group of four stays in L1 while every 4-row tile of x
 * passes over it: the weights are read from memory once whatever M is. */
static void rows_dot(const uint16_t *x, int64_t M, const uint16_t *w, int64_t n0, int64_t n1, int64_t K,
                     float *y, int64_t ldy) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4)
    for (int64_t m0 = 0; m0 < M; m0 += 4)
      DOT4[M - m0 < 4 ? M - m0 : 4](x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy);
  for (; n < n1; n++)
    for (int64_t m0 = 0; m0 < M; m0 += 4)
      DOT1[M - m0 < 4 ? M - m0 : 4](x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy);
}

/* out[M, N] (bf16) = x[M, K] @ w[N, K]^T, M <= TILE_M. */
void epserve_linear_bf16(const uint16_t *x, int64_t M, const uint16_t *w, int64_t N, int64_t K, uint16_t *out,
                         int num_threads) {
  float *y = (float *)malloc(sizeof(float) * M * N);
  const int64_t block = 32;
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t nb = 0; nb < N; nb += block) {
    int64_t n1 = nb + block < N ? nb + block : N;
    rows_dot(x, M, w, nb, n1, K, y, N);
  }
  for (int64_t i = 0; i < M * N; i++) out[i] = f32_to_bf16(y[i]);
  free(y);
}

/* Routed experts on rows grouped by expert: for expert e, rows [offsets[e], offsets[e+1]) of x[*, H]
 * go through down(silu(gate(x)) * up(x)) with w13[e] = [gate; up] (2I x H) and w2[e] (H x I).
 * Rounds to bf16 where torch would (after each GEMM and after the activation). Experts with more
 * than TILE_M rows are skipped (their output rows are left untouched for the caller). */
void epserve_moe_swiglu_bf16(const uint16_t *x, const int64_t *offsets, int64_t E, const uint16_t *w13,
                             const uint16_t *w2, int64_t H, int64_t I, uint16_t *out, int num_threads) {
  /* Work items: (expert, half of the rows of its weight) so two threads share a busy expert. */
  #pragma omp parallel num_threads(num_threads)
  {
    float *h = (float *)malloc(sizeof(float) * TILE_M * 2 * I);
    uint16_t *act = (uint16_t *)malloc(sizeof(uint16_t) * TILE_M * I);
    float *y = (float *)malloc(sizeof(float) * TILE_M * H);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
      int64_t r0 = offsets[e], M = offsets[e + 1] - offsets[e];
      if (M == 0 || M > TILE_M) continue;
      rows_dot(x + r0 * H, M, w13 + e * 2 * I * H, 0, 2 * I, H, h, 2 * I);
      for (int64_t m = 0; m < M; m++) {
        for (int64_t j = 0; j < I; j++) {
          float g = bf16_to_f32(f32_to_bf16(h[m * 2 * I + j]));
          float u = bf16_to_f32(f32_to_bf16(h[m * 2 * I + I + j]));
          float s = bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g))));
          act[m * I + j] = f32_to_bf16(s * u);
        }
      }
      rows_dot(act, M, w2 + e * H * I, 0, H, I, y, H);
      for (int64_t i = 0; i < M * H; i++) out[r0 * H + i] = f32_to_bf16(y[i]);
    }
    free(h);
    free(act);
    free(y);
  }
}
