/* What the NVFP4 kernels (cpu_nvfp4.c: fp32 arithmetic; cpu_nvfp4_bf16.c: bf16 rows of x by AVX512-BF16 dot
 * products) share: a block's decoding, its scales, where results go. */
#ifndef EPSERVE_CPU_NVFP4_H
#define EPSERVE_CPU_NVFP4_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#define TILE_M 16
#define GROUP 16

#define SCHUNK 256 /* blocks whose scales are converted at a time (a row's stretch of 4096 values) */

/* The scales of nb <= SCHUNK blocks as fp32, each e4m3 block scale times the global scale g (the reference's
 * one rounding). An e4m3 code's bits moved into fp32's exponent and mantissa fields are its value times 2^-120,
 * normal and subnormal alike (so times 2^120, exactly, gives the value); the codes 0x7F/0xFF are NaN. */
static inline void block_scales(const uint8_t *s, int64_t nb, float g, float *out) {
  const __m512 two120 = _mm512_set1_ps(0x1p120f), gv = _mm512_set1_ps(g), nan = _mm512_set1_ps(NAN);
  const __m512i magnitude = _mm512_set1_epi32(0x7F), sign = _mm512_set1_epi32(0x80);
  for (int64_t j = 0; j < nb; j += 16) {
    uint8_t bytes[16] = {0};
    if (nb - j < 16) memcpy(bytes, s + j, (size_t)(nb - j));
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nb - j < 16 ? bytes : s + j)));
    const __m512i m = _mm512_and_si512(v, magnitude);
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(m, 20), _mm512_slli_epi32(_mm512_and_si512(v, sign), 24));
    const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), two120), gv);
    _mm512_storeu_ps(out + j, _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(m, magnitude), f, nan));
  }
}

/* e2m1 code -> value: bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6 (code 8 is -0). */
static inline __m512 e2m1_table(void) {
  return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f,
                        -4.0f, -6.0f);
}

/* The multishift control that puts code i of a block (bits 4i..4i+3 of its 8 bytes, broadcast to every
 * quadword) in the low bits of lane i: the permute's index reads only those four bits. */
static inline __m512i nibble_lanes(void) {
  return _mm512_set_epi32(60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
}

/* The 16 values of one block (8 packed bytes) times its scale: a broadcast, a multishift, a permute, a mul. */
static inline __m512 decode16(const uint8_t *p, float scale, __m512 table, __m512i lanes) {
  uint64_t q;
  memcpy(&q, p, 8);
  const __m512i codes = _mm512_multishift_epi64_epi8(lanes, _mm512_set1_epi64((long long)q));
  return _mm512_mul_ps(_mm512_permutexvar_ps(codes, table), _mm512_set1_ps(scale));
}

/* Where a row's results go: fp32 (yf) or bf16 (yb), row-major with leading dimension ld. */
typedef struct {
  float *yf;
  uint16_t *yb;
  int64_t ld;
} Out;

static inline void put(Out o, int64_t m, int64_t n, float v) {
  if (o.yb) o.yb[m * o.ld + n] = f32_to_bf16(v);
  else o.yf[m * o.ld + n] = v;
}

#define KC 256 /* columns of a stretch of weight rows decoded into L1 at a time (cpu_nvfp4.c's panels of four rows) */

/* NVFP4_SCALED[b][c] = e4m3 code b's value x e2m1 code c's: exact in fp32 (at most six significant bits, so in
 * bf16 too; NaN for the NaN codes). The bf16 kernels decode a block by a permute of its scale's row, apply the
 * global scale to a row's sums, and so multiply the rows of x by exact bf16 weights. */
extern float NVFP4_SCALED[256][16];

/* The 16 values of one block (8 packed bytes) times its block scale (code sc), without the global scale. */
static inline __m512 decode_scaled(const uint8_t *p, uint8_t sc, __m512i lanes) {
  uint64_t q;
  memcpy(&q, p, 8);
  const __m512i codes = _mm512_multishift_epi64_epi8(lanes, _mm512_set1_epi64((long long)q));
  return _mm512_permutexvar_ps(codes, _mm512_load_ps(NVFP4_SCALED[sc]));
}

/* Whether any of nb e4m3 codes is NaN (0x7F or 0xFF). */
static inline int nan_scales(const uint8_t *s, int64_t nb) {
  const __m512i magnitude = _mm512_set1_epi8(0x7F);
  int64_t j = 0;
  for (; j + 64 <= nb; j += 64)
    if (_mm512_cmpeq_epi8_mask(_mm512_and_si512(_mm512_loadu_si512(s + j), magnitude), magnitude)) return 1;
  for (; j < nb; j++)
    if ((s[j] & 0x7F) == 0x7F) return 1;
  return 0;
}

/* cpu_nvfp4_bf16.c: bf16 rows of x [M, K] (M <= TILE_M; permuted by nvfp4_permute_x, once a call) against one
 * weight row streamed (row n, global scale g) or two side by side (rows n, n + 1, global scales g0, g1), in
 * groups of at most STREAM_M rows of x. */
#define STREAM_M 8
void nvfp4_permute_x(const uint16_t *x, int64_t M, int64_t K, uint16_t *xp);
void nvfp4_rows_bf16(const uint16_t *x, int64_t M, const uint8_t *w, const uint8_t *s, float g, int64_t K, Out o,
                     int64_t n);
void nvfp4_pair_bf16(const uint16_t *x, int64_t M, const uint8_t *w, const uint8_t *s, float g0, float g1,
                     int64_t K, Out o, int64_t n);

#endif
