/* NVFP4 (W4A16) kernels for the CPU (x86-64 with AVX-512F, BW, VBMI, BF16 and FMA): ModelOpt's four-bit
 * weights run as stored.
 *
 * A weight [N, K] is uint8 [N, K/2] (two e2m1 codes a byte, the even column in the low nibble), e4m3 block
 * scales [N, K/16] and fp32 global scales [S] (the rows split into S equal parts, a fused linear's parts). Its
 * value is e2m1 x (block scale x global scale) in fp32, the dequantized checkpoint's, bit for bit: a kernel
 * never expands a weight in memory but decodes a block of 16 codes at a time in registers (one multishift puts
 * each code in its lane, one permute reads the 16-entry e2m1 table, one multiply applies the block's scale,
 * converted 256 blocks at a time by bit arithmetic) and multiplies them into the fp32 rows of x while they are
 * there. A weight row and its scales are read once per call for up to TILE_M rows of x: one row of x streams
 * the weight rows one after another (one sequential stream per thread, as the bf16/fp32 decode GEMMs read
 * theirs), more rows take four weight rows at a time, decoded a stretch at a time into L1; beyond TILE_M rows
 * of x the next tiles read a block of weight rows again from L2. Activations are fp32 or bf16 (W4A16: never
 * quantized), accumulated in fp32; the result in x's dtype. bf16 rows go through cpu_nvfp4_bf16.c's dot
 * products instead (two weight rows streamed side by side past groups of up to STREAM_M rows, their columns
 * permuted once a call to match the decoding). Built and loaded at run
 * time by kernels/cpu.py (front end: kernels/cpu_nvfp4.py); the torch reference of kernels/nvfp4.py is the
 * fallback.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_nvfp4.h"

#define ROW_BLOCK 32 /* weight rows a thread takes at a time: 32 rows of K = 7168 (115 KB) stay in L2 */

/* One weight row (packed w, block scales s, global scale g) against M rows of x (fp32, leading dimension ldx),
 * M a compile-time constant so the accumulators live in registers: y[m, n] = sum_k x[m, k] * W[n, k]. Up to
 * eight rows two accumulators each (the two blocks of a step), more one (the loads bound those). The row's
 * scales are converted SCHUNK blocks at a time; the packed row is prefetched a few steps ahead. */
#define DEFINE_ROW(M, TWO)                                                                                     \
  static void row_##M(const float *x, int64_t ldx, const uint8_t *w, const uint8_t *s, float g, int64_t K,    \
                      Out o, int64_t n) {                                                                       \
    const __m512 table = e2m1_table();                                                                         \
    const __m512i lanes = nibble_lanes();                                                                      \
    float sb[SCHUNK];                                                                                          \
    __m512 a[M], b[TWO ? M : 1];                                                                               \
    for (int m = 0; m < M; m++) a[m] = _mm512_setzero_ps();                                                    \
    for (int m = 0; m < (TWO ? M : 1); m++) b[m] = _mm512_setzero_ps();                                        \
    for (int64_t c = 0; c < K; c += SCHUNK * GROUP) {                                                          \
      const int64_t kl = K - c < SCHUNK * GROUP ? K - c : SCHUNK * GROUP;                                      \
      block_scales(s + c / GROUP, kl / GROUP, g, sb);                                                          \
      const uint8_t *wc = w + c / 2;                                                                           \
      const float *xc = x + c;                                                                                 \
      int64_t k = 0;                                                                                           \
      for (; k + 32 <= kl; k += 32) {                                                                          \
        _mm_prefetch((const char *)(wc + k / 2 + 512), _MM_HINT_T0);                                           \
        const __m512 w0 = decode16(wc + k / 2, sb[k / GROUP], table, lanes);                                   \
        const __m512 w1 = decode16(wc + k / 2 + 8, sb[k / GROUP + 1], table, lanes);                           \
        for (int m = 0; m < M; m++) {                                                                          \
          a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + m * ldx + k), w0, a[m]);                                 \
          if (TWO) b[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + m * ldx + k + 16), w1, b[m]);                   \
          else a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + m * ldx + k + 16), w1, a[m]);                       \
        }                                                                                                      \
      }                                                                                                        \
      if (k < kl) { /* kl % 32 == 16: the last block */                                                        \
        const __m512 w0 = decode16(wc + k / 2, sb[k / GROUP], table, lanes);                                   \
        for (int m = 0; m < M; m++) a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + m * ldx + k), w0, a[m]);      \
      }                                                                                                        \
    }                                                                                                          \
    for (int m = 0; m < M; m++) put(o, m, n, _mm512_reduce_add_ps(TWO ? _mm512_add_ps(a[m], b[m]) : a[m]));   \
  }
DEFINE_ROW(1, 1) DEFINE_ROW(2, 1) DEFINE_ROW(3, 1) DEFINE_ROW(4, 1) DEFINE_ROW(5, 1) DEFINE_ROW(6, 1)
DEFINE_ROW(7, 1) DEFINE_ROW(8, 1) DEFINE_ROW(9, 0) DEFINE_ROW(10, 0) DEFINE_ROW(11, 0) DEFINE_ROW(12, 0)
DEFINE_ROW(13, 0) DEFINE_ROW(14, 0) DEFINE_ROW(15, 0) DEFINE_ROW(16, 0)

typedef void (*row_fn)(const float *, int64_t, const uint8_t *, const uint8_t *, float, int64_t, Out, int64_t);
static const row_fn ROW[TILE_M + 1] = {0,      row_1,  row_2,  row_3,  row_4,  row_5,  row_6,  row_7, row_8,
                                       row_9, row_10, row_11, row_12, row_13, row_14, row_15, row_16};

/* Two to TILE_M rows of x against four weight rows: a stretch of KC columns of the four rows decoded into wb
 * (L1) once, then every tile of up to four rows of x (its KC columns in L1 too) multiplied into acc[4T] (the
 * tile's sums per weight row, kept across stretches in accv). Decoding once per weight row whatever M is, and
 * reading x from L1 rather than streaming whole rows of x past each weight row, keeps the arithmetic on FMAs. */
#define DEFINE_TILE(T)                                                                                         \
  static void tile_##T(const float *x, int64_t ldx, const float *wb, int64_t kl, __m512 *accv) {              \
    __m512 acc[T][4];                                                                                          \
    for (int t = 0; t < T; t++)                                                                                \
      for (int r = 0; r < 4; r++) acc[t][r] = accv[t * 4 + r];                                                 \
    for (int64_t k = 0; k < kl; k += GROUP) {                                                                  \
      __m512 wv[4];                                                                                            \
      for (int r = 0; r < 4; r++) wv[r] = _mm512_load_ps(wb + r * KC + k);                                     \
      for (int t = 0; t < T; t++) {                                                                            \
        const __m512 xv = _mm512_loadu_ps(x + t * ldx + k);                                                    \
        for (int r = 0; r < 4; r++) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);                         \
      }                                                                                                        \
    }                                                                                                          \
    for (int t = 0; t < T; t++)                                                                                \
      for (int r = 0; r < 4; r++) accv[t * 4 + r] = acc[t][r];                                                 \
  }
DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, __m512 *);
static const tile_fn TILE[5] = {0, tile_1, tile_2, tile_3, tile_4};

/* Weight rows n..n+3 (global scales g[4]) against M <= TILE_M rows of x [M, K]. */
static void panel4(const float *x, int64_t M, const uint8_t *w, const uint8_t *s, const float *g, int64_t K, Out o,
                   int64_t n) {
  __m512 accv[TILE_M * 4];
  float wb[4 * KC] __attribute__((aligned(64)));
  float sb[KC / GROUP];
  const __m512 table = e2m1_table();
  const __m512i lanes = nibble_lanes();
  for (int64_t i = 0; i < M * 4; i++) accv[i] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < K; kc += KC) {
    const int64_t kl = K - kc < KC ? K - kc : KC;
    for (int r = 0; r < 4; r++) {
      const uint8_t *wr = w + (n + r) * (K / 2) + kc / 2;
      _mm_prefetch((const char *)(wr + KC / 2), _MM_HINT_T0);
      block_scales(s + (n + r) * (K / GROUP) + kc / GROUP, kl / GROUP, g[r], sb);
      for (int64_t k = 0; k < kl; k += GROUP)
        _mm512_store_ps(wb + r * KC + k, decode16(wr + k / 2, sb[k / GROUP], table, lanes));
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) TILE[M - m0 < 4 ? M - m0 : 4](x + m0 * K + kc, K, wb, kl, accv + m0 * 4);
  }
  for (int64_t m = 0; m < M; m++)
    for (int r = 0; r < 4; r++) put(o, m, n + r, _mm512_reduce_add_ps(accv[m * 4 + r]));
}

/* Weight rows [n0, n1) against all M rows of x [M, K] (fp32 x; xb: the same rows in bf16, or NULL, and xp
 * those permuted by nvfp4_permute_x), part rows to a global scale: each weight row read from memory once,
 * ROW_BLOCK rows at a time, the tiles of TILE_M rows of x after the first reading the block again from cache.
 * One row of x: each weight row streamed past it (row_1); more: four weight rows at a time (panel4; the last
 * n1 - n0 % 4 rows streamed). bf16 rows go through cpu_nvfp4_bf16.c's dot products: one row of x streams each
 * weight row (two side by side were slower from memory), more stream two at a time (an odd last one alone). */
static void rows(const float *x, const uint16_t *xb, const uint16_t *xp, int64_t M, const uint8_t *w, const uint8_t *s,
                 const float *gs, int64_t part, int64_t n0, int64_t n1, int64_t K, Out o) {
  for (int64_t nb = n0; nb < n1; nb += ROW_BLOCK) {
    const int64_t nend = nb + ROW_BLOCK < n1 ? nb + ROW_BLOCK : n1;
    for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
      const int64_t T = M - m0 < TILE_M ? M - m0 : TILE_M;
      const Out ot = {o.yf ? o.yf + m0 * o.ld : 0, o.yb ? o.yb + m0 * o.ld : 0, o.ld};
      int64_t n = nb;
      if (xb) {
        for (; T > 1 && n + 2 <= nend; n += 2)
          nvfp4_pair_bf16(xp + m0 * K, T, w + n * (K / 2), s + n * (K / GROUP), gs[n / part], gs[(n + 1) / part],
                          K, ot, n);
        for (; n < nend; n++)
          nvfp4_rows_bf16(xp + m0 * K, T, w + n * (K / 2), s + n * (K / GROUP), gs[n / part], K, ot, n);
      }
      for (; T > 1 && n + 4 <= nend; n += 4) {
        const float g[4] = {gs[n / part], gs[(n + 1) / part], gs[(n + 2) / part], gs[(n + 3) / part]};
        panel4(x + m0 * K, T, w, s, g, K, ot, n);
      }
      for (; n < nend; n++) ROW[T](x + m0 * K, K, w + n * (K / 2), s + n * (K / GROUP), gs[n / part], K, ot, n);
    }
  }
}

/* x [M, K] as fp32: x itself (fp32), or a malloc'd copy of bf16 rows (*copy set, for the caller to free). */
static const float *as_f32(const void *x, int bf16, int64_t M, int64_t K, float **copy) {
  *copy = 0;
  if (!bf16) return (const float *)x;
  float *f = (float *)malloc(sizeof(float) * M * K);
  const uint16_t *xb = (const uint16_t *)x;
  for (int64_t i = 0; i < M * K; i++) f[i] = bf16_to_f32(xb[i]);
  *copy = f;
  return f;
}

/* out [M, N] (x's dtype: bf16 when bf16 != 0, else fp32) = x [M, K] @ W^T, W NVFP4 (w uint8 [N, K/2], s e4m3
 * [N, K/16], gs fp32 [S], S dividing N); K % 16 == 0; any M (tiles of TILE_M rows over each block of weight
 * rows). Threads split the weight rows. */
void epserve_nvfp4_linear(const void *x, int bf16, int64_t M, const uint8_t *w, const uint8_t *s, const float *gs,
                          int64_t S, int64_t N, int64_t K, void *out, int num_threads) {
  float *copy;
  const float *xf = as_f32(x, bf16, M, K, &copy);
  const Out o = {bf16 ? 0 : (float *)out, bf16 ? (uint16_t *)out : 0, N};
  uint16_t *xp = bf16 ? (uint16_t *)malloc(sizeof(uint16_t) * M * K) : 0;
  if (xp) nvfp4_permute_x((const uint16_t *)x, M, K, xp);
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t nb = 0; nb < N; nb += ROW_BLOCK)
    rows(xf, bf16 ? (const uint16_t *)x : 0, xp, M, w, s, gs, N / S, nb, nb + ROW_BLOCK < N ? nb + ROW_BLOCK : N, K, o);
  free(copy);
  free(xp);
}

/* Rows [lo, hi) of W as fp32 [hi - lo, K] (the values kernels/nvfp4.py's dequantize_rows gives): for a GEMM
 * of many rows of x (prefill), a bounded chunk of rows at a time. */
void epserve_nvfp4_dequantize(const uint8_t *w, const uint8_t *s, const float *gs, int64_t S, int64_t N, int64_t K,
                              int64_t lo, int64_t hi, float *out, int num_threads) {
  #pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t n = lo; n < hi; n++) {
    const __m512 table = e2m1_table();
    const __m512i lanes = nibble_lanes();
    float sb[SCHUNK];
    const float g = gs[n / (N / S)];
    const uint8_t *wn = w + n * (K / 2), *sn = s + n * (K / GROUP);
    float *on = out + (n - lo) * K;
    for (int64_t c = 0; c < K; c += SCHUNK * GROUP) {
      const int64_t kl = K - c < SCHUNK * GROUP ? K - c : SCHUNK * GROUP;
      block_scales(sn + c / GROUP, kl / GROUP, g, sb);
      for (int64_t k = 0; k < kl; k += GROUP)
        _mm512_storeu_ps(on + c + k, decode16(wn + (c + k) / 2, sb[k / GROUP], table, lanes));
    }
  }
}

/* SwiGLU of one expert's rows: act[m, j] = silu(gate) * up from h [M, 2I] = [gate | up], rounded where the
 * reference rounds (bf16: gate and up come out of the first linear in bf16, the product is cast to bf16). */
static void swiglu(const float *h, int64_t M, int64_t I, int bf16, float *act) {
  for (int64_t m = 0; m < M; m++) {
    const float *hg = h + m * 2 * I, *hu = hg + I;
    float *am = act + m * I;
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) {
      __m256 g = _mm256_loadu_ps(hg + j), u = _mm256_loadu_ps(hu + j);
      if (bf16) g = round_bf16_8(g), u = round_bf16_8(u);
      const __m256 a = _mm256_mul_ps(silu8(g), u);
      _mm256_storeu_ps(am + j, bf16 ? round_bf16_8(a) : a);
    }
    for (; j < I; j++) {
      float g = hg[j], u = hu[j];
      if (bf16) g = bf16_to_f32(f32_to_bf16(g)), u = bf16_to_f32(f32_to_bf16(u));
      const float a = g / (1.0f + expf(-g)) * u;
      am[j] = bf16 ? bf16_to_f32(f32_to_bf16(a)) : a;
    }
  }
}

/* Routed experts on rows of x [N, H] (x's dtype: bf16 when bf16 != 0, else fp32) grouped by expert, the row
 * counts [E] read here, at call time (a replayed step's): expert e's rows go through w2[e] @ (silu(gate) * up),
 * [gate; up] = w13[e] @ x, NVFP4 weights: w13 uint8 [E, 2I, H/2], s13 e4m3 [E, 2I, H/16], g13 fp32 [E, S13]; w2
 * [E, H, I/2], s2 [E, H, I/16], g2 [E, S2]. Threads take an expert at a time; an expert's weights are read once
 * for all its rows (rows). Rows past the counts' sum come out zero. Returns -1, computing nothing, when the
 * counts add up to more than N rows; else 0. */
int epserve_nvfp4_moe_swiglu(const void *x, int bf16, int64_t N, const int64_t *counts, int64_t E,
                             const uint8_t *w13, const uint8_t *s13, const float *g13, int64_t S13, const uint8_t *w2,
                             const uint8_t *s2, const float *g2, int64_t S2, int64_t H, int64_t I, void *out,
                             int num_threads) {
  int64_t *offsets = expert_offsets(counts, E, N);
  if (!offsets) return -1;
  float *copy;
  const float *xf = as_f32(x, bf16, offsets[E], H, &copy); /* the real rows only */
  uint16_t *xp = bf16 ? (uint16_t *)malloc(sizeof(uint16_t) * (offsets[E] ? offsets[E] : 1) * H) : 0;
  if (xp) nvfp4_permute_x((const uint16_t *)x, offsets[E], H, xp);
  #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
  for (int64_t e = 0; e < E; e++) {
    const int64_t r0 = offsets[e], M = offsets[e + 1] - offsets[e];
    if (M == 0) continue;
    float *h = (float *)malloc(sizeof(float) * M * 3 * I), *act = h + M * 2 * I;
    uint16_t *act_bf16 = bf16 ? (uint16_t *)malloc(sizeof(uint16_t) * M * I * 2) : 0; /* and permuted */
    const Out oh = {h, 0, 2 * I};
    rows(xf + r0 * H, bf16 ? (const uint16_t *)x + r0 * H : 0, xp ? xp + r0 * H : 0, M, w13 + e * 2 * I * (H / 2),
         s13 + e * 2 * I * (H / GROUP), g13 + e * S13, 2 * I / S13, 0, 2 * I, H, oh);
    swiglu(h, M, I, bf16, act);
    for (int64_t i = 0; bf16 && i < M * I; i++) act_bf16[i] = f32_to_bf16(act[i]); /* exact: rounded already */
    const Out oo = {bf16 ? 0 : (float *)out + r0 * H, bf16 ? (uint16_t *)out + r0 * H : 0, H};
    if (bf16) nvfp4_permute_x(act_bf16, M, I, act_bf16 + M * I);
    rows(act, act_bf16, bf16 ? act_bf16 + M * I : 0, M, w2 + e * H * (I / 2), s2 + e * H * (I / GROUP), g2 + e * S2,
         H / S2, 0, H, I, oo);
    free(act_bf16);
    free(h);
  }
  const size_t elem = bf16 ? 2 : 4;
  memset((char *)out + offsets[E] * H * elem, 0, elem * (N - offsets[E]) * H); /* rows past the counts: zero */
  free(copy);
  free(xp);
  free(offsets);
  return 0;
}
