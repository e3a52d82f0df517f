/* MLA's attention side of a CPU decode step (cpu_ops.h): paged MLA decode attention (the torch reference
 * gathers, pads, masks and runs two bmm per layer), the absorbed per-head projections, rotary embedding
 * and the latent KV append. */
#include "cpu_ops.h"

/* ---- paged MLA decode (AVX2 + FMA intrinsics: its sums are not torch's bit for bit in any case) ---- */

/* Eight values of a cache row as fp32: bf16 widened (is_bf16) or fp32 loaded. */
static inline __m256 load8(const void *row, int64_t j, int is_bf16) {
  if (is_bf16) {
    __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + j));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
  return _mm256_loadu_ps((const float *)row + j);
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#define MLA_HEADS 4 /* heads of one sequence per work item: each cache row is read once for all of them */

/* The two passes of a work item (nh <= MLA_HEADS heads of one sequence over its L cached rows): the scores
 * p[h * L + t] = q_h . row_t * scale with each head's max raised into m, and the outputs out[h, :R] =
 * sum_t p[h, t] row_t[:R], the accumulators in registers; eight columns at a time (AVX2), or sixteen
 * (AVX-512, when D and R allow and the CPU has it: the same sums, fewer instructions). The AVX-512 passes
 * are compiled for a whole group of heads (nh a constant, so the accumulators stay in registers: with nh
 * known only at run time they lived on the stack) and for the cache's dtype. */
static void mla_scores8(const float *qb, int64_t nh, int64_t D, const char *const *rows, int64_t L, int is_bf16,
                        float scale, float *p, float *m) {
  for (int64_t t = 0; t < L; t++) {
    __m256 acc[MLA_HEADS];
    for (int64_t h = 0; h < MLA_HEADS; h++) acc[h] = _mm256_setzero_ps();
    for (int64_t j = 0; j < D; j += 8) {
      const __m256 v = load8(rows[t], j, is_bf16);
      for (int64_t h = 0; h < nh; h++) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + h * D + j), v, acc[h]);
    }
    for (int64_t h = 0; h < nh; h++) {
      const float sc = hsum8(acc[h]) * scale;
      p[h * L + t] = sc;
      if (sc > m[h]) m[h] = sc;
    }
  }
}

static void mla_values8(const float *p, int64_t nh, const char *const *rows, int64_t L, int64_t R, int is_bf16,
                        float *out) {
  for (int64_t j = 0; j < R; j += 8) {
    __m256 acc[MLA_HEADS];
    for (int64_t h = 0; h < MLA_HEADS; h++) acc[h] = _mm256_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
      const __m256 v = load8(rows[t], j, is_bf16);
      for (int64_t h = 0; h < nh; h++) acc[h] = _mm256_fmadd_ps(_mm256_set1_ps(p[h * L + t]), v, acc[h]);
    }
    for (int64_t h = 0; h < nh; h++) _mm256_storeu_ps(out + h * R + j, acc[h]);
  }
}

#define AVX512 __attribute__((target("avx512f,avx2,fma")))

AVX512 static inline __attribute__((always_inline)) __m512 load16(const void *row, int64_t j, int is_bf16) {
  if (is_bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float *)row + j);
}

AVX512 static inline __attribute__((always_inline)) void scores16_n(const float *qb, const int64_t nh, int64_t D,
                                                                     const char *const *rows, int64_t L, int is_bf16,
                                                                     float scale, float *p, float *m) {
  for (int64_t t = 0; t < L; t++) {
    __m512 acc[MLA_HEADS];
    for (int64_t h = 0; h < MLA_HEADS; h++) acc[h] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) {
      const __m512 v = load16(rows[t], j, is_bf16);
      for (int64_t h = 0; h < nh; h++) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(qb + h * D + j), v, acc[h]);
    }
    for (int64_t h = 0; h < nh; h++) {
      const float sc = _mm512_reduce_add_ps(acc[h]) * scale;
      p[h * L + t] = sc;
      if (sc > m[h]) m[h] = sc;
    }
  }
}

/* The sixteen sums of a[0..15]'s lanes, sum i in lane i: one transposing tree (30 shuffles, 15 adds) in place of
 * sixteen separate reductions. */
AVX512 static inline __m512 reduce16(const __m512 *a) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; i++)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; i++)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

#define PREFETCH_ROWS 16 /* how far ahead the scores pass asks for cache rows (in a decode step the KV cache is
                           * cold: the weights streamed since evict it; 1.3x on a batch-16 step's MLA) */

/* Scores of MLA_HEADS (4) heads over four rows at a time: sixteen sums in flight, reduced by one tree; the rows
 * past the last four one at a time (scores16_n). */
AVX512 static inline __attribute__((always_inline)) void scores16_4x4(const float *qb, int64_t D,
                                                                       const char *const *rows, int64_t L, int is_bf16,
                                                                       float scale, float *p, float *m) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    if (t + PREFETCH_ROWS + 4 <= L) /* the rows a few groups on: a cold cache is read at its latency otherwise */
      for (int r = 0; r < 4; r++)
        for (int64_t c = 0; c < D * (is_bf16 ? 2 : 4); c += 64)
          _mm_prefetch(rows[t + PREFETCH_ROWS + r] + c, _MM_HINT_T0);
    for (int64_t j = 0; j < D; j += 16) {
      __m512 v[4];
      for (int r = 0; r < 4; r++) v[r] = load16(rows[t + r], j, is_bf16);
      for (int h = 0; h < 4; h++) {
        const __m512 qv = _mm512_loadu_ps(qb + h * D + j);
        for (int r = 0; r < 4; r++) acc[4 * h + r] = _mm512_fmadd_ps(qv, v[r], acc[4 * h + r]);
      }
    }
    const __m512 sc = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale)); /* lane 4h + r: head h, row t + r */
    mx = _mm512_max_ps(mx, sc);
    for (int h = 0; h < 4; h++) _mm_storeu_ps(p + h * L + t, _mm512_extractf32x4_ps(sc, h));
  }
  float lanes[16];
  _mm512_storeu_ps(lanes, mx);
  for (int h = 0; h < 4; h++)
    for (int r = 0; r < 4; r++)
      if (lanes[4 * h + r] > m[h]) m[h] = lanes[4 * h + r];
  for (; t < L; t++) { /* the last L % 4 rows */
    for (int h = 0; h < 4; h++) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < D; j += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qb + h * D + j), load16(rows[t], j, is_bf16), acc);
      const float sc = _mm512_reduce_add_ps(acc) * scale;
      p[h * L + t] = sc;
      if (sc > m[h]) m[h] = sc;
    }
  }
}

AVX512 static void mla_scores16(const float *qb, int64_t nh, int64_t D, const char *const *rows, int64_t L,
                                int is_bf16, float scale, float *p, float *m) {
  if (nh == MLA_HEADS && is_bf16) scores16_4x4(qb, D, rows, L, 1, scale, p, m);
  else if (nh == MLA_HEADS) scores16_4x4(qb, D, rows, L, 0, scale, p, m);
  else scores16_n(qb, nh, D, rows, L, is_bf16, scale, p, m);
}

AVX512 static inline __attribute__((always_inline)) void values16_n(const float *p, const int64_t nh,
                                                                     const char *const *rows, int64_t L, int64_t R,
                                                                     int is_bf16, float *out) {
  for (int64_t j = 0; j < R; j += 16) {
    __m512 acc[MLA_HEADS];
    for (int64_t h = 0; h < MLA_HEADS; h++) acc[h] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t++) {
      const __m512 v = load16(rows[t], j, is_bf16);
      for (int64_t h = 0; h < nh; h++) acc[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * L + t]), v, acc[h]);
    }
    for (int64_t h = 0; h < nh; h++) _mm512_storeu_ps(out + h * R + j, acc[h]);
  }
}

AVX512 static void mla_values16(const float *p, int64_t nh, const char *const *rows, int64_t L, int64_t R,
                                int is_bf16, float *out) {
  if (nh == MLA_HEADS && is_bf16) values16_n(p, MLA_HEADS, rows, L, R, 1, out);
  else if (nh == MLA_HEADS) values16_n(p, MLA_HEADS, rows, L, R, 0, out);
  else values16_n(p, nh, rows, L, R, is_bf16, out);
}

/* Absorbed MLA decode: out[b, h, :R] = softmax_t(q[b, h] . kv_t * scale) @ kv_t[:R] over the lens[b]
 * cached rows of sequence b, row t in block tables[b, t / block_size] at t % block_size. q fp32
 * [B, H, D]; cache [blocks, block_size, D] bf16 or fp32; tables int64 [B, max_blocks]; lens int64 [B]
 * (checked by the caller to fit the tables). Empty sequences come out zero. A work item is up to
 * MLA_HEADS heads of one sequence: each cache row's scores for them in one pass over the row, then 8
 * output columns at a time for all of them over every row, the accumulators in registers. D and R are
 * multiples of 8 (the caller checks). Returns -2, computing nothing, when a length lies outside
 * [0, max_blocks * block_size], -1 when a block the lengths reach lies outside the cache's num_blocks;
 * else 0. */
int epserve_mla_decode(const float *q, int64_t B, int64_t H, int64_t D, const void *cache, int is_bf16,
                       int64_t num_blocks, int64_t block_size, const int64_t *tables, int64_t max_blocks,
                       const int64_t *lens, float scale, int64_t R, float *out, int num_threads) {
  const int64_t elem = is_bf16 ? 2 : 4;
  int64_t work = 0, max_len = 0;
  for (int64_t b = 0; b < B; b++)
    if (lens[b] < 0 || lens[b] > max_blocks * block_size) return -2;
  for (int64_t b = 0; b < B; b++) {
    for (int64_t i = 0; i * block_size < lens[b]; i++)
      if (tables[b * max_blocks + i] < 0 || tables[b * max_blocks + i] >= num_blocks) return -1;
    work += lens[b];
    if (lens[b] > max_len) max_len = lens[b];
  }
  const int64_t blocks_per_seq = (H + MLA_HEADS - 1) / MLA_HEADS;
  const int threads = work * H * D > (1 << 16) ? num_threads : 1; /* small steps: no thread hand-off */
  const int wide = D % 16 == 0 && R % 16 == 0 && __builtin_cpu_supports("avx512f"); /* sixteen at a time */
  #pragma omp parallel num_threads(threads)
  {
    float *p = (float *)malloc(sizeof(float) * (max_len > 0 ? max_len : 1) * MLA_HEADS);
    const char **rows = (const char **)malloc(sizeof(char *) * (max_len > 0 ? max_len : 1));
    #pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * blocks_per_seq; item++) {
      const int64_t b = item / blocks_per_seq, h0 = (item % blocks_per_seq) * MLA_HEADS, L = lens[b];
      const int64_t nh = H - h0 < MLA_HEADS ? H - h0 : MLA_HEADS;
      for (int64_t h = 0; h < nh; h++) memset(out + (b * H + h0 + h) * R, 0, sizeof(float) * R);
      if (L <= 0) continue;
      const int64_t *table = tables + b * max_blocks;
      for (int64_t t = 0; t < L; t++)
        rows[t] = (const char *)cache + ((table[t / block_size] * block_size + t % block_size) * D) * elem;
      const float *qb = q + (b * H + h0) * D;
      /* scores p[h * L + t] and each head's max */
      float m[MLA_HEADS];
      for (int64_t h = 0; h < MLA_HEADS; h++) m[h] = -INFINITY;
      (wide ? mla_scores16 : mla_scores8)(qb, nh, D, rows, L, is_bf16, scale, p, m);
      /* softmax weights, normalized */
      for (int64_t h = 0; h < nh; h++) {
        float *ph = p + h * L;
        const __m256 mh = _mm256_set1_ps(m[h]);
        __m256 sum8 = _mm256_setzero_ps();
        int64_t t = 0;
        for (; t + 8 <= L; t += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(ph + t), mh));
          _mm256_storeu_ps(ph + t, e);
          sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum8(sum8);
        for (; t < L; t++) {
          ph[t] = expf(ph[t] - m[h]);
          sum += ph[t];
        }
        const float inv = 1.0f / sum;
        for (t = 0; t < L; t++) ph[t] *= inv;
      }
      (wide ? mla_values16 : mla_values8)(p, nh, rows, L, R, is_bf16, out + (b * H + h0) * R);
    }
    free(p);
    free((void *)rows);
  }
  return 0;
}

/* ---- the absorbed per-head projections, rotary embedding and the latent append (plain C) ---- */

/* Per-head projection (MLA's absorbed W_UK and W_UV): out[b, h, :] = x[b, h, :] @ w[h] for x [B, H, K]
 * bf16 (is_bf16) or fp32 with strides (ldb, ldh, 1), w fp32 [H, K, N], out [B, H, N] with strides
 * (ldo_b, ldo_h, 1), fp32 or rounded to bf16 (out_bf16). Each output
 * is summed over k in order, a product then a sum (no FMA), so the result does not depend on the blocking:
 * 32 columns of one (b, h) stay in registers over all of k, and the (b, h) items split over
 * ``num_threads`` threads when there is enough work to pay for them. */
typedef float v8f __attribute__((vector_size(32), aligned(4)));

static void head_row(const void *x, int is_bf16, int64_t at, int64_t K, const float *w, int64_t N, float *o) {
  int64_t n0 = 0;
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
  #pragma omp parallel for schedule(static) num_threads(num_threads) if (B * H * K * N >= (1 << 15))
  for (int64_t i = 0; i < B * H; i++) {
    const int64_t b = i / H, h = i % H, at = b * ldo_b + h * ldo_h;
    if (out_bf16) { /* the fp32 sums rounded once, as .to(bfloat16) rounds them */
      float row[N];
      head_row(x, is_bf16, b * ldb + h * ldh, K, w + h * K * N, N, row);
      for (int64_t n = 0; n < N; n++) ((uint16_t *)out)[at + n] = f32_to_bf16(row[n]);
    } else {
      head_row(x, is_bf16, b * ldb + h * ldh, K, w + h * K * N, N, (float *)out + at);
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
