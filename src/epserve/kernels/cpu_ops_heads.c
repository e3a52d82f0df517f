/* The attention side's small ops of a CPU decode step around MLA's decode attention (cpu_ops_mla.c), in plain C
 * (cpu_ops.h): the absorbed per-head projections (W_UK before it, W_UV after), rotary embedding and the latent
 * KV append. */
#include "cpu_ops.h"

#define AVX512 __attribute__((target("avx512f,avx2,fma")))

/* Per-head projection (MLA's absorbed W_UK and W_UV): out[b, h, :] = x[b, h, :] @ w[h] for x [B, H, K]
 * bf16 (is_bf16) or fp32 with strides (ldb, ldh, 1), w fp32 [H, K, N], out [B, H, N] with strides
 * (ldo_b, ldo_h, 1), fp32 or rounded to bf16 (out_bf16). Each output
 * is summed over k in order, a product then a sum (no FMA), so the result does not depend on the blocking:
 * 32 columns of one (b, h) stay in registers over all of k, and the (b, h) items split over
 * ``num_threads`` threads when there is enough work to pay for them. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

typedef float v16f __attribute__((vector_size(64), aligned(4)));

/* head_row's first N - N % 16 columns with AVX-512, 128 at a time: each k reads a whole stretch of w's row k
 * (the weights in one sequential stream; 32 columns a pass read a quarter of each row four times over).
 * Returns the columns it did. */
AVX512 static int64_t head_row16(const void *x, int is_bf16, int64_t at, int64_t K, const float *w, int64_t N,
                                 float *o) {
  int64_t n0 = 0;
  for (; n0 + 16 <= N; n0 += 128) {
    const int64_t chunks = (N - n0) / 16 < 8 ? (N - n0) / 16 : 8;
    v16f a[8] = {0};
    for (int64_t k = 0; k < K; k++) {
      const float xk = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + k]) : ((const float *)x)[at + k];
      const v16f *wr = (const v16f *)(w + k * N + n0);
      if (chunks == 8)
        for (int c = 0; c < 8; c++) a[c] += xk * wr[c];
      else
        for (int64_t c = 0; c < chunks; c++) a[c] += xk * wr[c];
    }
    for (int64_t c = 0; c < chunks; c++) ((v16f *)(o + n0))[c] = a[c];
    if (chunks < 8) return n0 + 16 * chunks;
  }
  return n0;
}

static void head_row(const void *x, int is_bf16, int64_t at, int64_t K, const float *w, int64_t N, float *o,
                     int wide) {
  int64_t n0 = wide ? head_row16(x, is_bf16, at, K, w, N, o) : 0;
  for (; n0 + 32 <= N; n0 += 32) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < K; k++) {
      const float a = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + k]) : ((const float *)x)[at + k];
      const v8f *wr = (const v8f *)(w + k * N + n0);
      a0 += a * wr[0];
      a1 += a * wr[1];
      a2 += a * wr[2];
      a3 += a * wr[3];
    }
    v8f *dst = (v8f *)(o + n0);
    dst[0] = a0;
    dst[1] = a1;
    dst[2] = a2;
    dst[3] = a3;
  }
  for (int64_t n = n0; n < N; n++) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++)
      acc += (is_bf16 ? bf16_to_f32(((const uint16_t *)x)[at + k]) : ((const float *)x)[at + k]) * w[k * N + n];
    o[n] = acc;
  }
}

void epserve_head_matmul(const void *x, int is_bf16, int64_t B, int64_t H, int64_t K, int64_t ldb, int64_t ldh,
                         const float *w, int64_t N, void *out, int64_t ldo_b, int64_t ldo_h, int out_bf16,
                         int num_threads) {
  const int wide = __builtin_cpu_supports("avx512f"); /* head_row16 takes the columns it can */
  #pragma omp parallel for schedule(static) num_threads(num_threads) if (B * H * K * N >= (1 << 15))
  for (int64_t i = 0; i < B * H; i++) {
    const int64_t b = i / H, h = i % H, at = b * ldo_b + h * ldo_h;
    if (out_bf16) { /* the fp32 sums rounded once, as .to(bfloat16) rounds them */
      float row[N];
      head_row(x, is_bf16, b * ldb + h * ldh, K, w + h * K * N, N, row, wide);
      for (int64_t n = 0; n < N; n++) ((uint16_t *)out)[at + n] = f32_to_bf16(row[n]);
    } else {
      head_row(x, is_bf16, b * ldb + h * ldh, K, w + h * K * N, N, (float *)out + at, wide);
    }
  }
}

/* Rotary embedding of 2 * half values v (read first, so src may be dst), in the dtype's rounding:
 * pairs (v[2i], v[2i+1]) when interleaved, else (v[i], v[half + i]); the output de-interleaved,
 * dst[i] = x1 cos - x2 sin, dst[half + i] = x2 cos + x1 sin (model/layers.py's RopeTable.apply). */
static void rope_values(const float *v, const void *cos, const void *sin, int64_t half, int interleave,
                        int is_bf16, float *dst) {
  for (int64_t i = 0; i < half; i++) {
    const float x1 = interleave ? v[2 * i] : v[i], x2 = interleave ? v[2 * i + 1] : v[half + i];
    const float c = load(cos, i, is_bf16), s = load(sin, i, is_bf16);
    dst[i] = as_dtype(as_dtype(x1 * c, is_bf16) - as_dtype(x2 * s, is_bf16), is_bf16);
    dst[half + i] = as_dtype(as_dtype(x2 * c, is_bf16) + as_dtype(x1 * s, is_bf16), is_bf16);
  }
}

/* In place: the last 2 * half columns of each of the H heads of x [T, H, D] (contiguous) rotated by
 * row t's cos/sin [T, half] (x's dtype). */
void epserve_rope_heads(void *x, int64_t T, int64_t H, int64_t D, const void *cos, const void *sin, int64_t half,
                        int interleave, int is_bf16) {
  const int64_t rope = 2 * half, elem = is_bf16 ? 2 : 4;
  #pragma omp parallel for schedule(static) if (T * H * rope >= PARALLEL_MIN)
  for (int64_t t = 0; t < T; t++) {
    float v[512], out[512];
    const char *c = (const char *)cos + t * half * elem, *s = (const char *)sin + t * half * elem;
    for (int64_t h = 0; h < H; h++) {
      const int64_t base = (t * H + h) * D + D - rope;
      for (int64_t i = 0; i < rope; i++) v[i] = load(x, base + i, is_bf16);
      rope_values(v, c, s, half, interleave, is_bf16, out);
      for (int64_t i = 0; i < rope; i++) store(x, base + i, out[i], is_bf16);
    }
  }
}

/* MLA's latent KV append: row t of latent [T, R + 2 * half] (row stride ld, x's dtype) becomes
 * [RMSNorm(c_kv) | rope(k_pe)] computed in x's dtype, written in the cache's dtype to cache row
 * slots[t] (cache [rows, R + 2 * half], bf16 or fp32). Returns -1, writing nothing, when a slot lies
 * outside the cache's rows; else 0. */
int epserve_append_latent(const void *latent, int64_t T, int64_t ld, int64_t R, int64_t half, const void *norm_w,
                          float eps, const void *cos, const void *sin, int interleave, int is_bf16,
                          const int64_t *slots, void *cache, int64_t rows, int cache_bf16) {
  const int64_t rope = 2 * half, D = R + rope, elem = is_bf16 ? 2 : 4;
  for (int64_t t = 0; t < T; t++)
    if (slots[t] < 0 || slots[t] >= rows) return -1;
  /* a prefill's slots are distinct rows (a repeated slot would be written by whichever thread comes last) */
  #pragma omp parallel for schedule(static) if (T * D >= PARALLEL_MIN)
  for (int64_t t = 0; t < T; t++) {
    float v[512], out[512];
    const int64_t row = t * ld, dst = slots[t] * D;
    float ss = 0.0f; /* summed as epserve_rms_norm (cpu_ops.c) sums */
    #pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < R; j++) {
      const float x = load(latent, row + j, is_bf16);
      ss += x * x;
    }
    const float inv = 1.0f / sqrtf(ss / (float)R + eps);
    for (int64_t j = 0; j < R; j++) {
      const float h = as_dtype(load(latent, row + j, is_bf16) * inv, is_bf16);
      store(cache, dst + j, as_dtype(load(norm_w, j, is_bf16) * h, is_bf16), cache_bf16);
    }
    for (int64_t i = 0; i < rope; i++) v[i] = load(latent, row + R + i, is_bf16);
    rope_values(v, (const char *)cos + t * half * elem, (const char *)sin + t * half * elem, half, interleave,
                is_bf16, out);
    for (int64_t i = 0; i < rope; i++) store(cache, dst + R + i, out[i], cache_bf16);
  }
  return 0;
}
