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

/* The sums of four vectors' lanes, [sum a, sum b, sum c, sum d]: one transposing tree (7 shuffles, 5 adds)
 * in place of four separate reductions. */
static inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  /* each 128-bit lane of s now holds one row's sum in all four places: take element 0 of each */
  const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(lanes, s));
}

/* Four weight rows (four streams in flight) against M <= 4 rows of x, for compile-time M so the 4*M
 * accumulators live in registers: y[m, r] = sum_k x[m, k] * w[r, k]. Each x vector loaded serves four
 * weight rows, which keeps a tile of five or more rows (M = 4 here, several times over) on the
 * arithmetic rather than the loads; each weight load also prefetches the next group's row at the same
 * offset (four rows on; past the end it is a harmless hint). Four rows' sums come out of one transposing
 * reduction (the short rows of a down projection, K = 256, spent as much in four separate reductions as in
 * their dot products). Fewer than five rows of x do not come here: dot_seq below. */
#define DEFINE_DOT(M)                                                                                 \
  static void dot_4x##M(const uint16_t *x, const uint16_t *w, int64_t K, float *y, int64_t ldy) {     \
    __m512 acc[4][M];                                                                                 \
    for (int r = 0; r < 4; r++)                                                                       \
      for (int m = 0; m < M; m++) acc[r][m] = _mm512_setzero_ps();                                    \
    int64_t k = 0;                                                                                    \
    for (; k + 32 <= K; k += 32) {                                                                    \
      __m512bh wv[4];                                                                                 \
      for (int r = 0; r < 4; r++) {                                                                   \
        _mm_prefetch((const char *)(w + (4 + r) * K + k), _MM_HINT_T0);                               \
        wv[r] = (__m512bh)_mm512_loadu_si512((const void *)(w + r * K + k));                          \
      }                                                                                               \
      for (int m = 0; m < M; m++) {                                                                   \
        __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * K + k));                    \
        for (int r = 0; r < 4; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);               \
      }                                                                                               \
    }                                                                                                 \
    if (k < K) { /* the last K % 32 columns, zero-filled */                                           \
      const __mmask32 tail = (__mmask32)((1u << (K - k)) - 1u);                                       \
      __m512bh wv[4];                                                                                 \
      for (int r = 0; r < 4; r++) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * K + k);     \
      for (int m = 0; m < M; m++) {                                                                   \
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k);                         \
        for (int r = 0; r < 4; r++) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], xv, wv[r]);               \
      }                                                                                               \
    }                                                                                                 \
    for (int m = 0; m < M; m++) _mm_storeu_ps(y + m * ldy, reduce4(acc[0][m], acc[1][m], acc[2][m], acc[3][m])); \
  }
DEFINE_DOT(1) DEFINE_DOT(2) DEFINE_DOT(3) DEFINE_DOT(4)

/* One weight row against one row of x, k in four interleaved accumulators. A thread reads its weight rows
 * one after another, a single sequential stream the hardware prefetcher follows across rows and pages
 * (four rows in lockstep are four short streams: 5-7 % slower with one row of x). */
static inline float dot_seq(const uint16_t *x, const uint16_t *w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(x + k + 32), (__m512bh)_mm512_loadu_si512(w + k + 32));
    a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(x + k + 64), (__m512bh)_mm512_loadu_si512(w + k + 64));
    a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(x + k + 96), (__m512bh)_mm512_loadu_si512(w + k + 96));
  }
  for (; k + 32 <= K; k += 32)
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w + k));
  if (k < K) { /* the last K % 32 columns, zero-filled */
    const __mmask32 tail = (__mmask32)((1u << (K - k)) - 1u);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

/* One weight row against M = 2..4 rows of x, k in two interleaved accumulators per row of x: the same one
 * sequential stream of weight rows as dot_seq. With a few rows of x a step is memory-bound, and this
 * streams the routed experts of a batch-16 step (one to four rows each) 1.3-1.5x faster than four
 * weight rows in lockstep (dot_4xM), 0.9x a pure read of the same bytes. */
#define DEFINE_SEQ(M)                                                                                       \
  static void dot_seq##M(const uint16_t *x, const uint16_t *w, int64_t K, float *y, int64_t ldy) {         \
    __m512 a[M], b[M];                                                                                      \
    for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();                                          \
    int64_t k = 0;                                                                                          \
    for (; k + 64 <= K; k += 64) {                                                                          \
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k), w1 = (__m512bh)_mm512_loadu_si512(w + k + 32); \
      for (int m = 0; m < M; m++) {                                                                         \
        a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), w0);                     \
        b[m] = _mm512_dpbf16_ps(b[m], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32), w1);                \
      }                                                                                                     \
    }                                                                                                       \
    for (; k + 32 <= K; k += 32) {                                                                          \
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);                                              \
      for (int m = 0; m < M; m++) a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_loadu_si512(x + m * K + k), w0); \
    }                                                                                                       \
    if (k < K) { /* the last K % 32 columns, zero-filled */                                                 \
      const __mmask32 tail = (__mmask32)((1u << (K - k)) - 1u);                                             \
      const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, w + k);                                 \
      for (int m = 0; m < M; m++)                                                                           \
        a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k), w0);         \
    }                                                                                                       \
    for (int m = 0; m < M; m++) y[m * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));              \
  }
DEFINE_SEQ(2) DEFINE_SEQ(3) DEFINE_SEQ(4)

typedef void (*dot_fn)(const uint16_t *, const uint16_t *, int64_t, float *, int64_t);
static const dot_fn DOT4[5] = {0, dot_4x1, dot_4x2, dot_4x3, dot_4x4};
static const dot_fn SEQ[5] = {0, 0, dot_seq2, dot_seq3, dot_seq4};

/* y[m, n] = sum_k x[m, k] * w[n, k] for rows n in [n0, n1); M <= TILE_M; any K. fp32 out.
 * Up to four rows of x: each weight row streamed once, one after another (dot_seq, SEQ). More: weight rows
 * are the outer loop so each group of four stays in L1 while every 4-row tile of x passes over it; the
 * weights are read from memory once whatever M is. */
static void rows_dot(const uint16_t *x, int64_t M, const uint16_t *w, int64_t n0, int64_t n1, int64_t K,
                     float *y, int64_t ldy) {
  int64_t n = n0;
  if (M == 1) {
    for (; n < n1; n++) y[n] = dot_seq(x, w + n * K, K);
    return;
  }
  if (M <= 4) {
    for (; n < n1; n++) SEQ[M](x, w + n * K, K, y + n, ldy);
    return;
  }
  for (; n + 4 <= n1; n += 4)
    for (int64_t m0 = 0; m0 < M; m0 += 4)
      DOT4[M - m0 < 4 ? M - m0 : 4](x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy);
  for (; n < n1; n++) /* the last n % 4 rows */
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t T = M - m0 < 4 ? M - m0 : 4;
      if (T == 1) y[m0 * ldy + n] = dot_seq(x + m0 * K, w + n * K, K);
      else SEQ[T](x + m0 * K, w + n * K, K, y + m0 * ldy + n, ldy);
    }
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

/* One expert's rows x[M, H] through down(silu(gate(x)) * up(x)) in tiles of TILE_M rows, rounding to bf16
 * where torch would (after each GEMM and after the activation); h, act, y: one tile's scratch. */
static void expert_rows(const uint16_t *x, int64_t M, const uint16_t *w13, const uint16_t *w2, int64_t H, int64_t I,
                        uint16_t *out, float *h, uint16_t *act, float *y) {
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
    const int64_t T = M - m0 < TILE_M ? M - m0 : TILE_M;
    rows_dot(x + m0 * H, T, w13, 0, 2 * I, H, h, 2 * I);
    for (int64_t m = 0; m < T; m++) {
      const float *hg = h + m * 2 * I, *hu = hg + I;
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) { /* the scalar loop below, eight at a time */
        const __m256 g = round_bf16_8(_mm256_loadu_ps(hg + j)), u = round_bf16_8(_mm256_loadu_ps(hu + j));
        store_bf16_8(act + m * I + j, _mm256_mul_ps(round_bf16_8(silu8(g)), u));
      }
      for (; j < I; j++) {
        float g = bf16_to_f32(f32_to_bf16(hg[j]));
        float u = bf16_to_f32(f32_to_bf16(hu[j]));
        float s = bf16_to_f32(f32_to_bf16(g / (1.0f + expf(-g))));
        act[m * I + j] = f32_to_bf16(s * u);
      }
    }
    rows_dot(act, T, w2, 0, H, I, y, H);
    for (int64_t i = 0; i < T * H; i++) out[m0 * H + i] = f32_to_bf16(y[i]);
  }
}

/* Routed experts on rows grouped by expert: for expert e, rows [offsets[e], offsets[e+1]) of x[*, H]
 * go through down(silu(gate(x)) * up(x)) with w13[e] = [gate; up] (2I x H) and w2[e] (H x I).
 * Experts with more than max_rows rows are skipped (their output rows are left untouched for the
 * caller). */
static void moe_swiglu(const uint16_t *x, const int64_t *offsets, int64_t E, const uint16_t *w13, const uint16_t *w2,
                       int64_t H, int64_t I, uint16_t *out, int num_threads, int64_t max_rows) {
  #pragma omp parallel num_threads(num_threads)
  {
    float *h = (float *)malloc(sizeof(float) * TILE_M * 2 * I);
    uint16_t *act = (uint16_t *)malloc(sizeof(uint16_t) * TILE_M * I);
    float *y = (float *)malloc(sizeof(float) * TILE_M * H);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < E; e++) {
      int64_t r0 = offsets[e], M = offsets[e + 1] - offsets[e];
      if (M == 0 || M > max_rows) continue;
      expert_rows(x + r0 * H, M, w13 + e * 2 * I * H, w2 + e * H * I, H, I, out + r0 * H, h, act, y);
    }
    free(h);
    free(act);
    free(y);
  }
}

/* Experts of at most TILE_M rows (the others are the caller's), offsets [E + 1] on the host. */
void epserve_moe_swiglu_bf16(const uint16_t *x, const int64_t *offsets, int64_t E, const uint16_t *w13,
                             const uint16_t *w2, int64_t H, int64_t I, uint16_t *out, int num_threads) {
  moe_swiglu(x, offsets, E, w13, w2, H, I, out, num_threads, TILE_M);
}

/* Every expert, from the row counts [E] as the dispatcher left them (read here, at call time: a replayed
 * step's counts), larger experts in tiles of TILE_M rows; rows of x [N, H] past the counts' sum come out
 * zero. Returns -1, computing nothing, when the counts add up to more than N rows; else 0. */
int epserve_moe_swiglu_counts_bf16(const uint16_t *x, int64_t N, const int64_t *counts, int64_t E, const uint16_t *w13,
                                   const uint16_t *w2, int64_t H, int64_t I, uint16_t *out, int num_threads) {
  int64_t *offsets = expert_offsets(counts, E, N);
  if (!offsets) return -1;
  moe_swiglu(x, offsets, E, w13, w2, H, I, out, num_threads, INT64_MAX);
  memset(out + offsets[E] * H, 0, sizeof(uint16_t) * (N - offsets[E]) * H); /* rows past the counts: zero */
  free(offsets);
  return 0;
}
