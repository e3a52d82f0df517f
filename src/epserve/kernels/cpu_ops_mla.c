/* MLA's paged decode attention in a CPU decode step (cpu_ops.h; the torch reference gathers, pads, masks and
 * runs two bmm per layer). The per-head projections around it, rotary embedding and the latent KV append:
 * cpu_ops_heads.c. */
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

/* Scores of rows t0..L, one row at a time. */
AVX512 static inline __attribute__((always_inline)) void scores16_n(const float *qb, const int64_t nh, int64_t D,
                                                                     const char *const *rows, int64_t t0, int64_t L,
                                                                     int is_bf16, float scale, float *p, float *m) {
  for (int64_t t = t0; t < L; t++) {
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
  scores16_n(qb, 4, D, rows, t, L, is_bf16, scale, p, m); /* the last L % 4 rows */
}

AVX512 static void mla_scores16(const float *qb, int64_t nh, int64_t D, const char *const *rows, int64_t L,
                                int is_bf16, float scale, float *p, float *m) {
  if (nh == MLA_HEADS && is_bf16) scores16_4x4(qb, D, rows, L, 1, scale, p, m);
  else if (nh == MLA_HEADS) scores16_4x4(qb, D, rows, L, 0, scale, p, m);
  else scores16_n(qb, nh, D, rows, 0, L, is_bf16, scale, p, m);
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
