/* NVFP4 weights against bf16 rows of x by AVX512-BF16 dot products (x86-64 with AVX-512F, BW, VBMI and BF16),
 * for kernels/cpu_nvfp4.c.
 *
 * A block's values times its block scale are exact in bf16 (an e2m1 value has two significant bits, an e4m3
 * scale four), so a block decodes by one permute of its scale's row of NVFP4_SCALED, two blocks convert to
 * bf16 exactly, and _mm512_dpbf16_ps multiplies 32 weights into bf16 x at once with exact products and fp32
 * accumulation: half the arithmetic of the fp32 kernels, which a few rows of x make the bound. The global scale
 * multiplies a row's sum (the reference multiplies each weight by block scale x global scale: the sums agree up
 * to rounding). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_nvfp4.h"

float NVFP4_SCALED[256][16] __attribute__((aligned(64)));

__attribute__((constructor)) static void fill_scaled(void) {
  static const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f,
                                 -3.0f, -4.0f, -6.0f};
  for (int b = 0; b < 256; b++) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + m / 8.0f, e - 7);
    if (e == 15 && m == 7) v = NAN;
    for (int c = 0; c < 16; c++) NVFP4_SCALED[b][c] = (b & 0x80 ? -v : v) * e2m1[c];
  }
}

/* 32 weights (two blocks from p, scale codes s[0], s[1]) as bf16; with one block left (last), the second half 0. */
static inline __m512bh decode32_bf16(const uint8_t *p, const uint8_t *s, int last, __m512i lanes) {
  const __m512 lo = decode_scaled(p, s[0], lanes);
  const __m512 hi = last ? _mm512_setzero_ps() : decode_scaled(p + 8, s[1], lanes);
  return _mm512_cvtne2ps_pbh(hi, lo);
}

/* 32 bf16 values of x from p, or the first 16 (the rest 0) when only one block is left. */
static inline __m512bh load_x(const uint16_t *p, int last) {
  return (__m512bh)(last ? _mm512_maskz_loadu_epi16(0xFFFF, p) : _mm512_loadu_si512(p));
}

/* One weight row against M (compile-time, up to STREAM_M: 2M accumulators and the two decoded vectors fill the
 * registers) bf16 rows of x, streamed: each 32 weights decoded once in registers and multiplied into every row
 * of x, two accumulators a row. Up to eight rows this beats decoding four weight rows into L1 (panel4). */
#define DEFINE_STREAM(M)                                                                                       \
  static void stream_##M(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint8_t *s, float g, int64_t K, \
                         Out o, int64_t n) {                                                                    \
    const __m512i lanes = nibble_lanes();                                                                      \
    __m512 a[M], b[M];                                                                                         \
    for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();                                             \
    int64_t k = 0;                                                                                             \
    for (; k + 64 <= K; k += 64) {                                                                             \
      _mm_prefetch((const char *)(w + k / 2 + 512), _MM_HINT_T0);                                              \
      const __m512bh w0 = decode32_bf16(w + k / 2, s + k / GROUP, 0, lanes);                                   \
      const __m512bh w1 = decode32_bf16(w + k / 2 + 16, s + k / GROUP + 2, 0, lanes);                          \
      for (int m = 0; m < M; m++) {                                                                            \
        a[m] = _mm512_dpbf16_ps(a[m], load_x(x + m * ldx + k, 0), w0);                                         \
        b[m] = _mm512_dpbf16_ps(b[m], load_x(x + m * ldx + k + 32, 0), w1);                                    \
      }                                                                                                        \
    }                                                                                                          \
    for (; k + 32 <= K; k += 32) {                                                                             \
      const __m512bh w0 = decode32_bf16(w + k / 2, s + k / GROUP, 0, lanes);                                   \
      for (int m = 0; m < M; m++) a[m] = _mm512_dpbf16_ps(a[m], load_x(x + m * ldx + k, 0), w0);               \
    }                                                                                                          \
    if (k < K) { /* the last block */                                                                          \
      const __m512bh w0 = decode32_bf16(w + k / 2, s + k / GROUP, 1, lanes);                                   \
      for (int m = 0; m < M; m++) a[m] = _mm512_dpbf16_ps(a[m], load_x(x + m * ldx + k, 1), w0);               \
    }                                                                                                          \
    for (int m = 0; m < M; m++) put(o, m, n, g * _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m])));             \
  }
DEFINE_STREAM(1) DEFINE_STREAM(2) DEFINE_STREAM(3) DEFINE_STREAM(4) DEFINE_STREAM(5) DEFINE_STREAM(6)
DEFINE_STREAM(7) DEFINE_STREAM(8)

typedef void (*stream_fn)(const uint16_t *, int64_t, const uint8_t *, const uint8_t *, float, int64_t, Out, int64_t);
static const stream_fn STREAM[STREAM_M + 1] = {0,        stream_1, stream_2, stream_3, stream_4,
                                              stream_5, stream_6, stream_7, stream_8};

void nvfp4_rows_bf16(const uint16_t *x, int64_t M, const uint8_t *w, const uint8_t *s, float g, int64_t K, Out o,
                     int64_t n) {
  STREAM[M](x, K, w, s, g, K, o, n);
}

/* T (compile-time) rows of x against the four decoded weight rows in wb (bf16, KC a row), kl columns (a
 * multiple of 16: the rows of wb are zero past it), sums kept in accv across stretches. */
#define TILE_STEP(T, LAST)                                                                                     \
  {                                                                                                            \
    __m512bh wv[4];                                                                                            \
    for (int r = 0; r < 4; r++) wv[r] = (__m512bh)_mm512_load_si512(wb + r * KC + k);                          \
    for (int t = 0; t < T; t++) {                                                                              \
      const __m512bh xv = load_x(x + t * ldx + k, LAST);                                                       \
      for (int r = 0; r < 4; r++) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv, wv[r]);                          \
    }                                                                                                          \
  }
#define DEFINE_TILE(T)                                                                                         \
  static void tile_##T(const uint16_t *x, int64_t ldx, const uint16_t *wb, int64_t kl, __m512 *accv) {       \
    __m512 acc[T][4];                                                                                          \
    for (int t = 0; t < T; t++)                                                                                \
      for (int r = 0; r < 4; r++) acc[t][r] = accv[t * 4 + r];                                                 \
    int64_t k = 0;                                                                                             \
    for (; k + 32 <= kl; k += 32) TILE_STEP(T, 0)                                                              \
    if (k < kl) TILE_STEP(T, 1) /* the last block */                                                           \
    for (int t = 0; t < T; t++)                                                                                \
      for (int r = 0; r < 4; r++) accv[t * 4 + r] = acc[t][r];                                                 \
  }
DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4)

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, __m512 *);
static const tile_fn TILE[5] = {0, tile_1, tile_2, tile_3, tile_4};

/* Weight rows n..n+3 against M <= TILE_M bf16 rows of x [M, K]: as cpu_nvfp4.c's panel4, the stretch decoded
 * to bf16 (zero past K), the x tiles multiplied by dot products. */
void nvfp4_panel4_bf16(const uint16_t *x, int64_t M, const uint8_t *w, const uint8_t *s, const float *g, int64_t K,
                       Out o, int64_t n) {
  __m512 accv[TILE_M * 4];
  uint16_t wb[4 * KC] __attribute__((aligned(64)));
  const __m512i lanes = nibble_lanes();
  for (int64_t i = 0; i < M * 4; i++) accv[i] = _mm512_setzero_ps();
  for (int64_t kc = 0; kc < K; kc += KC) {
    const int64_t kl = K - kc < KC ? K - kc : KC;
    for (int r = 0; r < 4; r++) {
      const uint8_t *wr = w + (n + r) * (K / 2) + kc / 2, *sr = s + (n + r) * (K / GROUP) + kc / GROUP;
      _mm_prefetch((const char *)(wr + KC / 2), _MM_HINT_T0);
      for (int64_t k = 0; k < kl; k += 32)
        _mm512_store_si512(wb + r * KC + k, (__m512i)decode32_bf16(wr + k / 2, sr + k / GROUP, kl - k == GROUP,
                                                                     lanes));
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) TILE[M - m0 < 4 ? M - m0 : 4](x + m0 * K + kc, K, wb, kl, accv + m0 * 4);
  }
  for (int64_t m = 0; m < M; m++)
    for (int r = 0; r < 4; r++) put(o, m, n + r, g[r] * _mm512_reduce_add_ps(accv[m * 4 + r]));
}
