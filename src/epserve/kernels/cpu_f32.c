/* Memory-bound fp32 kernels for CPU decode steps (x86-64 with AVX2 and FMA).
 *
 * The fp32 twin of cpu_bf16.c: a decode step (or a speculative verification, a few rows per request)
 * multiplies a handful of token rows by every weight it touches once, so its time should be the time
 * to stream the weights whatever the number of rows. BLAS's small-M GEMM path does not stream (two
 * rows cost about twice one on a two-core AVX2 machine); these kernels read each weight row exactly
 * once for up to TILE_M token rows and split the work over OpenMP threads. Built and loaded at run
 * time by kernels/cpu.py; the torch path is the fallback.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#include "cpu_bf16.h"

#define TILE_M 16

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, sh);
  sh = _mm_movehl_ps(sh, s);
  return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

/* R weight rows against M <= 2 rows of x, compile-time R and M so the accumulators stay in the
 * sixteen ymm registers: y[m, r] = sum_k x[m, k] * w[r, k], K % 8 == 0. */
#define DEFINE_DOT(R, M)                                                                           \
  static void dot_##R##x##M(const float *x, const float *w, int64_t K, float *y, int64_t ldy) {    \
    __m256 acc[R][M];                                                                              \
    for (int r = 0; r < R; r++)                                                                    \
      for (int m = 0; m < M; m++) acc[r][m] = _mm256_setzero_ps();                                 \
    for (int64_t k = 0; k < K; k += 8) {                                                           \
      __m256 wv[R];                                                                                \
      for (int r = 0; r < R; r++) wv[r] = _mm256_loadu_ps(w + r * K + k);                          \
      for (int m = 0; m < M; m++) {                                                                \
        __m256 xv = _mm256_loadu_ps(x + m * K + k);                                                \
        for (int r = 0; r < R; r++) acc[r][m] = _mm256_fmadd_ps(xv, wv[r], acc[r][m]);             \
      }                                                                                            \
    }                                                                                              \
    for (int m = 0; m < M; m++)                                                                    \
      for (int r = 0; r < R; r++) y[m * ldy + r] = hsum(acc[r][m]);                                \
  }
DEFINE_DOT(4, 1) DEFINE_DOT(4, 2)

/* One weight row against M = 1 or 2 rows of x, k in four (two) interleaved accumulators per row of x: a
 * thread reads its weight rows one after another, a single sequential stream the hardware prefetcher
 * follows across rows and pages (four weight rows in lockstep are four short streams: with one or two rows
 * of x the step is memory-bound, and cpu_bf16.c measured the single stream 1.05-1.5x faster). */
static inline void dot_seq1(const float *x, const float *w, int64_t K, float *y, int64_t ldy) {
  (void)ldy;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_loadu_ps(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_loadu_ps(w + k + 24), a3);
  }
  for (; k < K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
  y[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

static inline void dot_seq2(const float *x, const float *w, int64_t K, float *y, int64_t ldy) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
  const float *x1 = x + K;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), w0, a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), w1, a1);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), w0, b0);
    b1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), w1, b1);
  }
  for (; k < K; k += 8) {
    const __m256 w0 = _mm256_loadu_ps(w + k);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), w0, a0);
    b0 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), w0, b0);
  }
  y[0] = hsum(_mm256_add_ps(a0, a1));
  y[ldy] = hsum(_mm256_add_ps(b0, b1));
}

/* y[m, n] = sum_k x[m, k] * w[n, k] for rows n in [n0, n1); M <= TILE_M. One or two rows of x: each weight
 * row streamed once, one after another (dot_seq1, dot_seq2). More: weight rows are the outer loop so each
 * group of four stays in cache while every 2-row tile of x passes over it; the weights are read from
 * memory once whatever M is. */
static void rows_dot(const float *x, int64_t M, const float *w, int64_t n0, int64_t n1, int64_t K, float *y,
                     int64_t ldy) {
  int64_t n = n0;
  if (M <= 2) {
    for (; n < n1; n++) (M == 2 ? dot_seq2 : dot_seq1)(x, w + n * K, K, y + n, ldy);
    return;
  }
  for (; n + 4 <= n1; n += 4)
    for (int64_t m0 = 0; m0 < M; m0 += 2)
      (M - m0 >= 2 ? dot_4x2 : dot_4x1)(x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy);
  for (; n < n1; n++)
    for (int64_t m0 = 0; m0 < M; m0 += 2)
      (M - m0 >= 2 ? dot_seq2 : dot_seq1)(x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy);
}

/* out[M, N] = x[M, K] @ w[N, K]^T, M <= TILE_M, K % 8 == 0. */
void epserve_linear_f32(const float *x, int64_t M, const float *w, int64_t N, int64_t K, float *out,
                        int num_threads) {
  const int64_t block = 32;
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t nb = 0; nb < N; nb += block) rows_dot(x, M, w, nb, nb + block < N ? nb + block : N, K, out, N);
}

/* Routed experts on rows grouped by expert: for expert e, rows [offsets[e], offsets[e+1]) of x[*, H]
 * go through down(silu(gate(x)) * up(x)) with w13[e] = [gate; up] (2I x H) and w2[e] (H x I), in tiles
 * of TILE_M rows. Experts with more than max_rows rows are skipped (their output rows are left untouched
 * for the caller). */
static void moe_swiglu(const float *x, const int64_t *offsets, int64_t E, const float *w13, const float *w2,
                       int64_t H, int64_t I, float *out, int num_threads, int64_t max_rows) {
  #pragma omp parallel num_threads(num_threads)
  {
    float *h = (float *)malloc(sizeof(float) * TILE_M * 2 * I);
    float *act = (float *)malloc(sizeof(float) * TILE_M * I);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
      int64_t r0 = offsets[e], rows = offsets[e + 1] - offsets[e];
      if (rows == 0 || rows > max_rows) continue;
      for (int64_t m0 = 0; m0 < rows; m0 += TILE_M) {
        const int64_t M = rows - m0 < TILE_M ? rows - m0 : TILE_M;
        rows_dot(x + (r0 + m0) * H, M, w13 + e * 2 * I * H, 0, 2 * I, H, h, 2 * I);
        for (int64_t m = 0; m < M; m++)
          for (int64_t j = 0; j < I; j++) {
            float g = h[m * 2 * I + j], u = h[m * 2 * I + I + j];
            act[m * I + j] = g / (1.0f + expf(-g)) * u;
          }
        rows_dot(act, M, w2 + e * H * I, 0, H, I, out + (r0 + m0) * H, H);
      }
    }
    free(h);
    free(act);
  }
}

/* Experts of at most TILE_M rows (the others are the caller's), offsets [E + 1] on the host. */
void epserve_moe_swiglu_f32(const float *x, const int64_t *offsets, int64_t E, const float *w13, const float *w2,
                            int64_t H, int64_t I, float *out, int num_threads) {
  moe_swiglu(x, offsets, E, w13, w2, H, I, out, num_threads, TILE_M);
}

/* Every expert, from the row counts [E] read at call time (a replayed step's), larger ones in tiles; rows
 * of x [N, H] past the counts' sum come out zero. Returns -1, computing nothing, when the counts add up to
 * more than N rows; else 0. */
int epserve_moe_swiglu_counts_f32(const float *x, int64_t N, const int64_t *counts, int64_t E, const float *w13,
                                  const float *w2, int64_t H, int64_t I, float *out, int num_threads) {
  int64_t *offsets = expert_offsets(counts, E, N);
  if (!offsets) return -1;
  moe_swiglu(x, offsets, E, w13, w2, H, I, out, num_threads, INT64_MAX);
  memset(out + offsets[E] * H, 0, sizeof(float) * (N - offsets[E]) * H); /* rows past the counts: zero */
  free(offsets);
  return 0;
}
