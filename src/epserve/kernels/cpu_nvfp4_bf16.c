/* NVFP4 weights against bf16 rows of x by AVX512-BF16 dot products (x86-64 with AVX-512F, BW, VBMI and BF16),
 * for kernels/cpu_nvfp4.c.
 *
 * _mm512_dpbf16_ps multiplies 32 bf16 weights into bf16 x at once with exact products and fp32 accumulation:
 * half the arithmetic of the fp32 kernels, which a few rows of x make the bound. Up to STREAM_M rows of x stream
 * one weight row, or two side by side (x read once for both; more rows of x in two groups, the second reading
 * the weight rows from L1), past them 64 packed bytes (eight blocks) at a time: the e2m1 codes decode straight
 * into bf16 lanes (three shifts and four permutes of a 16-entry table, no scale), once for every row of x, x's
 * columns permuted once a call to match (nvfp4_permute_x), and a lane of the dot products sums one block's
 * products, so the eight block scales (e4m3 -> fp16 by bit moves) apply by one multiply-add. The last K % 128
 * columns, and rows with a NaN scale code, decode a block with its block scale (a block's values times its
 * block scale are exact in bf16: one permute of its scale's row of NVFP4_SCALED). The global scale multiplies a
 * row's sum (the reference multiplies each weight by block scale x global scale: the sums agree up to
 * rounding). */
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

/* The e2m1 codes as bf16, twice: a permutexvar_epi16 index reads five bits, the fifth the next code's (any). */
static inline __m512i e2m1_bf16(void) {
  return _mm512_set_epi16(-16192, -16256, -16320, -16384, -16448, -16512, -16640, -32768, 0x40C0, 0x4080, 0x4040,
                          0x4000, 0x3FC0, 0x3F80, 0x3F00, 0, -16192, -16256, -16320, -16384, -16448, -16512, -16640,
                          -32768, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
}

/* x's columns in the order the streaming kernels decode 128 weights (64 packed bytes) in: vector j (0..3) of a
 * stretch holds, in dot-product lane i, columns 8i + j and 8i + 4 + j (word u of the packed bytes holds columns
 * 4u..4u+3, its code j shifted down by 4j is the index of vector j). Columns past the last whole stretch as
 * they are. */
void nvfp4_permute_x(const uint16_t *x, int64_t M, int64_t K, uint16_t *xp) {
  const int64_t K128 = K & ~(int64_t)127;
  for (int64_t m = 0; m < M; m++) {
    const uint16_t *xm = x + m * K;
    uint16_t *pm = xp + m * K;
    for (int64_t c = 0; c < K128; c += 128)
      for (int j = 0; j < 4; j++)
        for (int i = 0; i < 16; i++) {
          pm[c + 32 * j + 2 * i] = xm[c + 8 * i + j];
          pm[c + 32 * j + 2 * i + 1] = xm[c + 8 * i + 4 + j];
        }
    memcpy(pm + K128, xm + K128, sizeof(uint16_t) * (size_t)(K - K128));
  }
}

/* 128 weights (64 packed bytes from w, eight blocks with scale codes s[0..7]) as four vectors of bf16 e2m1
 * values (three shifts, four permutes of the e2m1 table; vector j pairs the columns nvfp4_permute_x puts in
 * its lane i, block i / 2's), and the eight block scales spread to those lanes (lanes 2b, 2b + 1: block b's)
 * as fp32 times 2^-8 (an e4m3 code moved into fp16's sign, exponent and mantissa fields, normal and subnormal
 * alike, is its value times 2^-8). */
static inline void decode128(const uint8_t *w, const uint8_t *s, __m512i table, __m512bh wv[4], __m512 *sc) {
  const __m256i spread = _mm256_set_epi8(7, -1, 7, -1, 6, -1, 6, -1, 5, -1, 5, -1, 4, -1, 4, -1, 3, -1, 3, -1, 2,
                                         -1, 2, -1, 1, -1, 1, -1, 0, -1, 0, -1); /* code b to the high byte */
  const __m512i v = _mm512_loadu_si512(w);
  for (int j = 0; j < 4; j++) wv[j] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4 * j), table);
  int64_t codes;
  memcpy(&codes, s, 8);
  const __m256i h = _mm256_shuffle_epi8(_mm256_set1_epi64x(codes), spread);
  *sc = _mm512_cvtph_ps(_mm256_and_si256(_mm256_srai_epi16(h, 1), _mm256_set1_epi16((short)0xBF80)));
}

/* One stretch of 128 weights (wv, scales sc) into the sums a of one row of permuted x (its 128 columns in xv):
 * four dot products whose lanes each sum one block's products, scaled by one multiply-add. */
static inline __m512 dot128(const __m512bh xv[4], const __m512bh wv[4], __m512 sc, __m512 a) {
  __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), xv[0], wv[0]);
  for (int j = 1; j < 4; j++) t = _mm512_dpbf16_ps(t, xv[j], wv[j]);
  return _mm512_fmadd_ps(t, sc, a);
}

static inline void load128(const uint16_t *xm, __m512bh xv[4]) {
  for (int j = 0; j < 4; j++) xv[j] = load_x(xm + 32 * j, 0);
}

/* One weight row against M (compile-time, up to STREAM_M) bf16 rows of x permuted by nvfp4_permute_x, streamed
 * 128 weights at a time (decode128, dot128); the last K % 128 columns by scaled-table decoding, two blocks at a
 * time. A row with a NaN scale code takes the scaled-table path throughout. */
#define DEFINE_STREAM(M)                                                                                       \
  static void stream_##M(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint8_t *s, float g, int64_t K, \
                         Out o, int64_t n) {                                                                    \
    const __m512i lanes = nibble_lanes(), table = e2m1_bf16();                                                 \
    __m512 a[M], b[M];                                                                                         \
    for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();                                             \
    int64_t k = 0;                                                                                             \
    if (!nan_scales(s, K / GROUP))                                                                             \
      for (; k + 128 <= K; k += 128) {                                                                         \
        _mm_prefetch((const char *)(w + k / 2 + 512), _MM_HINT_T0);                                            \
        __m512bh wv[4];                                                                                        \
        __m512 sc;                                                                                             \
        decode128(w + k / 2, s + k / GROUP, table, wv, &sc);                                                   \
        for (int m = 0; m < M; m++) {                                                                          \
          __m512bh xv[4];                                                                                      \
          load128(x + m * ldx + k, xv);                                                                        \
          a[m] = dot128(xv, wv, sc, a[m]);                                                                     \
        }                                                                                                      \
      }                                                                                                        \
    for (int m = 0; m < M; m++) a[m] = _mm512_mul_ps(a[m], _mm512_set1_ps(256.0f));                            \
    for (; k + 32 <= K; k += 32) {                                                                             \
      const __m512bh w0 = decode32_bf16(w + k / 2, s + k / GROUP, 0, lanes);                                   \
      for (int m = 0; m < M; m++) b[m] = _mm512_dpbf16_ps(b[m], load_x(x + m * ldx + k, 0), w0);               \
    }                                                                                                          \
    if (k < K) { /* the last block */                                                                          \
      const __m512bh w0 = decode32_bf16(w + k / 2, s + k / GROUP, 1, lanes);                                   \
      for (int m = 0; m < M; m++) b[m] = _mm512_dpbf16_ps(b[m], load_x(x + m * ldx + k, 1), w0);               \
    }                                                                                                          \
    for (int m = 0; m < M; m++) put(o, m, n, g * _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m])));             \
  }
DEFINE_STREAM(1) DEFINE_STREAM(2) DEFINE_STREAM(3) DEFINE_STREAM(4) DEFINE_STREAM(5) DEFINE_STREAM(6)
DEFINE_STREAM(7) DEFINE_STREAM(8)

typedef void (*stream_fn)(const uint16_t *, int64_t, const uint8_t *, const uint8_t *, float, int64_t, Out, int64_t);
static const stream_fn STREAM[STREAM_M + 1] = {0,        stream_1, stream_2, stream_3, stream_4,
                                              stream_5, stream_6, stream_7, stream_8};

void nvfp4_rows_bf16(const uint16_t *xp, int64_t M, const uint8_t *w, const uint8_t *s, float g, int64_t K, Out o,
                     int64_t n) {
  const int64_t h = M > STREAM_M ? (M + 1) / 2 : M; /* past STREAM_M rows: two halves, the second from L1 */
  STREAM[h](xp, K, w, s, g, K, o, n);
  if (M > h) STREAM[M - h](xp + h * K, K, w, s, g, K, (Out){o.yf ? o.yf + h * o.ld : 0, o.yb ? o.yb + h * o.ld : 0,
                                                              o.ld}, n);
}

/* Weight rows n and n + 1 (w, s: row n's, row n + 1's next to them; global scales g0, g1) against M (up to
 * STREAM_M) rows of permuted x, K a multiple of 128 and no NaN scale code: each stretch of 128 weights of both
 * rows decoded once into registers (decode128) for every row of x, x read once for both (2 x M sums, eight
 * decoded vectors, two scale vectors: within the 32 registers). */
#define DEFINE_PAIR(M)                                                                                         \
  static void pair_##M(const uint16_t *x, int64_t ldx, const uint8_t *w, const uint8_t *s, float g0, float g1,  \
                       int64_t K, Out o, int64_t n) {                                                           \
    const __m512i table = e2m1_bf16();                                                                         \
    __m512 a[M], b[M];                                                                                         \
    for (int m = 0; m < M; m++) a[m] = b[m] = _mm512_setzero_ps();                                             \
    for (int64_t k = 0; k < K; k += 128) {                                                                     \
      _mm_prefetch((const char *)(w + k / 2 + 512), _MM_HINT_T0);                                              \
      _mm_prefetch((const char *)(w + K / 2 + k / 2 + 512), _MM_HINT_T0);                                      \
      __m512bh wv[4], wu[4];                                                                                   \
      __m512 sc, su;                                                                                           \
      decode128(w + k / 2, s + k / GROUP, table, wv, &sc);                                                     \
      decode128(w + K / 2 + k / 2, s + K / GROUP + k / GROUP, table, wu, &su);                                 \
      for (int m = 0; m < M; m++) {                                                                            \
        const uint16_t *xm = x + m * ldx + k;                                                                  \
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), wv[0], load_x(xm, 0));                                \
        __m512 u = _mm512_dpbf16_ps(_mm512_setzero_ps(), wu[0], load_x(xm, 0));                                \
        for (int j = 1; j < 4; j++) {                                                                          \
          t = _mm512_dpbf16_ps(t, wv[j], load_x(xm + 32 * j, 0));                                              \
          u = _mm512_dpbf16_ps(u, wu[j], load_x(xm + 32 * j, 0));                                              \
        }                                                                                                      \
        a[m] = _mm512_fmadd_ps(t, sc, a[m]);                                                                   \
        b[m] = _mm512_fmadd_ps(u, su, b[m]);                                                                   \
      }                                                                                                        \
    }                                                                                                          \
    for (int m = 0; m < M; m++) {                                                                              \
      put(o, m, n, g0 * 256.0f * _mm512_reduce_add_ps(a[m]));                                                  \
      put(o, m, n + 1, g1 * 256.0f * _mm512_reduce_add_ps(b[m]));                                              \
    }                                                                                                          \
  }
DEFINE_PAIR(1) DEFINE_PAIR(2) DEFINE_PAIR(3) DEFINE_PAIR(4) DEFINE_PAIR(5) DEFINE_PAIR(6) DEFINE_PAIR(7)
DEFINE_PAIR(8)

typedef void (*pair_fn)(const uint16_t *, int64_t, const uint8_t *, const uint8_t *, float, float, int64_t, Out,
                        int64_t);
static const pair_fn PAIR[STREAM_M + 1] = {0, pair_1, pair_2, pair_3, pair_4, pair_5, pair_6, pair_7, pair_8};

/* Weight rows n and n + 1 against M <= TILE_M rows of permuted x: in groups of at most STREAM_M rows (past it,
 * two halves, the second reading the two weight rows from L1), each paired (pair_M) where K is a multiple of 128
 * and no scale code is NaN, else each weight row streamed alone. */
void nvfp4_pair_bf16(const uint16_t *xp, int64_t M, const uint8_t *w, const uint8_t *s, float g0, float g1,
                     int64_t K, Out o, int64_t n) {
  const int paired = K % 128 == 0 && !nan_scales(s, 2 * (K / GROUP));
  const int64_t h = M > STREAM_M ? (M + 1) / 2 : M;
  for (int64_t m0 = 0; m0 < M; m0 += h) {
    const int64_t T = M - m0 < h ? M - m0 : h;
    const Out ot = {o.yf ? o.yf + m0 * o.ld : 0, o.yb ? o.yb + m0 * o.ld : 0, o.ld};
    if (paired) PAIR[T](xp + m0 * K, K, w, s, g0, g1, K, ot, n);
    else {
      STREAM[T](xp + m0 * K, K, w, s, g0, K, ot, n);
      STREAM[T](xp + m0 * K, K, w + K / 2, s + K / GROUP, g1, K, ot, n + 1);
    }
  }
}
