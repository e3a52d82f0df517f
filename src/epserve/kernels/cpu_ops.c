/* The small fused ops of a CPU decode step (x86-64 with AVX2 + FMA; plain C the compiler vectorizes,
 * built with -ffp-contract=off so products and sums round as torch's separate ops do; paged MLA decode,
 * whose sums are not torch's in any case, in AVX2/FMA intrinsics).
 *
 * Each replaces a chain of eager torch ops whose cost at decode sizes is the dispatch of every op,
 * not its arithmetic: paged MLA decode attention (the torch reference gathers, pads, masks and runs
 * two bmm per layer), DeepSeek's grouped top-k gate (about twenty ops per layer), RMSNorm (eight),
 * rotary embedding, MLA's latent KV append, its absorbed per-head projections, the dispatchers'
 * grouping by expert and the weighted combine. Math is fp32 rounded to the dtype where torch's ops
 * round; results equal the references up to the order of a sum. Built and loaded at run time by
 * kernels/cpu.py; the torch references are the fallback.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "cpu_bf16.h"

/* The row-wise ops below (norms, activations, adds, casts, rotary, gathers, the dispatch's copies and the
 * combine) run on every OpenMP thread from this many values (a prefill's rows: torch's threaded ops would
 * otherwise win there), on the calling thread below it (a decode step's few rows: a fork would cost more
 * than the work). Rows never depend on one another, so the results do not depend on the threads. */
#define PARALLEL_MIN ((int64_t)1 << 16)

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
 * (AVX-512, when D and R allow and the CPU has it: the same sums, fewer instructions). */
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

AVX512 static inline __m512 load16(const void *row, int64_t j, int is_bf16) {
  if (is_bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  return _mm512_loadu_ps((const float *)row + j);
}

AVX512 static void mla_scores16(const float *qb, int64_t nh, int64_t D, const char *const *rows, int64_t L,
                                int is_bf16, float scale, float *p, float *m) {
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

AVX512 static void mla_values16(const float *p, int64_t nh, const char *const *rows, int64_t L, int64_t R,
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

/* The index of the largest value among v[0..n) not yet taken (first one on ties); marks it taken. */
static inline int64_t take_max(const float *v, unsigned char *taken, int64_t n) {
  int64_t best = -1;
  for (int64_t i = 0; i < n; i++)
    if (!taken[i] && (best < 0 || v[i] > v[best])) best = i;
  if (best < 0) return 0; /* n values all taken: the caller never asks for more than n */
  taken[best] = 1;
  return best;
}

/* DeepSeek's grouped top-k gate on fp32 logits [T, E] (kernels/gate.py's reference, step for step):
 * scores by sigmoid (scoring 0) or softmax (1); selection scores plus bias (may be NULL); grouped
 * (grouped != 0): groups ranked by the sum of their top-2 (method 0, noaux_tc) or their best (1),
 * all but the best topk_group masked; the top_k best left; weights the unbiased scores, normalized
 * (norm) and scaled; ids mapped through l2p (may be NULL; entries l2p_stride apart). ids int64 [T, K],
 * weights fp32 [T, K]. */
void epserve_grouped_topk(const float *logits, int64_t T, int64_t E, int64_t K, int64_t G, int64_t topk_group,
                          int method, int scoring, int grouped, int norm, float scaling, const float *bias,
                          const int64_t *l2p, int64_t l2p_stride, int64_t *ids, float *weights) {
  float *scores = (float *)malloc(sizeof(float) * E);
  float *choice = (float *)malloc(sizeof(float) * E);
  float *group_scores = (float *)malloc(sizeof(float) * (G > 0 ? G : 1));
  unsigned char *taken = (unsigned char *)malloc((size_t)(E > G ? E : G));
  const int64_t size = G > 0 ? E / G : E;
  for (int64_t t = 0; t < T; t++) {
    const float *l = logits + t * E;
    if (scoring == 0) {
      for (int64_t e = 0; e < E; e++) scores[e] = 1.0f / (1.0f + expf(-l[e]));
    } else {
      float m = -INFINITY, sum = 0.0f;
      for (int64_t e = 0; e < E; e++) m = l[e] > m ? l[e] : m;
      for (int64_t e = 0; e < E; e++) sum += (scores[e] = expf(l[e] - m));
      for (int64_t e = 0; e < E; e++) scores[e] /= sum;
    }
    for (int64_t e = 0; e < E; e++) choice[e] = bias ? scores[e] + bias[e] : scores[e];
    if (grouped) {
      for (int64_t g = 0; g < G; g++) {
        const float *c = choice + g * size;
        float a = -INFINITY, b = -INFINITY; /* the group's best and second best */
        for (int64_t i = 0; i < size; i++) {
          if (c[i] > a) { b = a; a = c[i]; } else if (c[i] > b) b = c[i];
        }
        group_scores[g] = method == 0 ? a + b : a;
      }
      for (int64_t g = 0; g < G; g++) taken[g] = 0;
      for (int64_t i = 0; i < topk_group; i++) take_max(group_scores, taken, G);
      for (int64_t g = 0; g < G; g++)
        if (!taken[g])
          for (int64_t i = 0; i < size; i++) choice[g * size + i] = -INFINITY;
    }
    memset(taken, 0, (size_t)E);
    int64_t *row_ids = ids + t * K;
    float *row_w = weights + t * K;
    float sum = 0.0f;
    for (int64_t k = 0; k < K; k++) {
      row_ids[k] = take_max(choice, taken, E);
      row_w[k] = scores[row_ids[k]];
      sum += row_w[k];
    }
    for (int64_t k = 0; k < K; k++) {
      if (norm) row_w[k] = row_w[k] / (sum + 1e-20f);
      row_w[k] *= scaling;
      if (l2p) row_ids[k] = l2p[row_ids[k] * l2p_stride];
    }
  }
  free(scores);
  free(choice);
  free(group_scores);
  free(taken);
}

/* RMSNorm as kernels.rms_norm_ref: h = x * rsqrt(mean(x^2) + eps) in fp32, rounded to the dtype, then
 * times the weight (rounded again). x, w, out bf16 (is_bf16) or fp32; x [T, D] with row stride ldx,
 * w [D], out [T, D] contiguous. */
void epserve_rms_norm(const void *x, const void *w, int64_t T, int64_t D, int64_t ldx, float eps, int is_bf16,
                      void *out) {
  #pragma omp parallel for schedule(static) if (T * D >= PARALLEL_MIN)
  for (int64_t t = 0; t < T; t++) {
    if (is_bf16) {
      const uint16_t *xr = (const uint16_t *)x + t * ldx, *wr = (const uint16_t *)w;
      uint16_t *o = (uint16_t *)out + t * D;
      float ss = 0.0f;
      #pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < D; j++) {
        const float v = bf16_to_f32(xr[j]);
        ss += v * v;
      }
      const float inv = 1.0f / sqrtf(ss / (float)D + eps);
      for (int64_t j = 0; j < D; j++)
        o[j] = f32_to_bf16(bf16_to_f32(wr[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[j]) * inv)));
    } else {
      const float *xr = (const float *)x + t * ldx, *wr = (const float *)w;
      float *o = (float *)out + t * D;
      float ss = 0.0f;
      #pragma omp simd reduction(+ : ss)
      for (int64_t j = 0; j < D; j++) ss += xr[j] * xr[j];
      const float inv = 1.0f / sqrtf(ss / (float)D + eps);
      for (int64_t j = 0; j < D; j++) o[j] = wr[j] * (xr[j] * inv);
    }
  }
}

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

/* A value as the dtype holds it: rounded to bf16 (is_bf16) or kept (fp32). Rounding after every op
 * as torch's bf16 ops round is what keeps the fused ops equal to their references bit for bit. */
static inline float as_dtype(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline float load(const void *p, int64_t i, int is_bf16) {
  return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
  if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
  else ((float *)p)[i] = v;
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
    float ss = 0.0f; /* summed as epserve_rms_norm sums */
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

/* Token copies grouped by expert, as a stable argsort of the flat ids [N] would order them:
 * order[j] the flat (token, k) index of the j-th copy, counts[e] the copies of expert e. Returns -1,
 * writing nothing, when an id lies outside [0, E); else 0. */
/* The counting sort's first half: counts [E] of ids [N] and each expert's first place (calloc'd), or NULL,
 * writing nothing, when an id lies outside [0, E). */
static int64_t *count_by_expert(const int64_t *ids, int64_t N, int64_t E, int64_t *counts) {
  for (int64_t i = 0; i < N; i++)
    if (ids[i] < 0 || ids[i] >= E) return NULL;
  int64_t *next = (int64_t *)calloc((size_t)E, sizeof(int64_t));
  memset(counts, 0, sizeof(int64_t) * E);
  for (int64_t i = 0; i < N; i++) counts[ids[i]]++;
  for (int64_t e = 1; e < E; e++) next[e] = next[e - 1] + counts[e - 1];
  return next;
}

int epserve_group_by_expert(const int64_t *ids, int64_t N, int64_t E, int64_t *order, int64_t *counts) {
  int64_t *next = count_by_expert(ids, N, E, counts);
  if (!next) return -1;
  for (int64_t i = 0; i < N; i++) order[next[ids[i]]++] = i;
  free(next);
  return 0;
}

/* The weighted combine: out[T, H] = sum over rows n of token[n] of y[n] * w[n], with the weight and
 * each product rounded to y's dtype and the sums kept in fp32 in row order, rounded once at the end
 * (what index_add_ does on the CPU). y, out bf16 (is_bf16) or fp32; w fp32. Returns -1, writing
 * nothing, when a token lies outside [0, T); else 0. */
int epserve_weighted_combine(const void *y, int64_t N, int64_t H, const int64_t *token, const float *w, int64_t T,
                             int is_bf16, void *out) {
  for (int64_t n = 0; n < N; n++)
    if (token[n] < 0 || token[n] >= T) return -1;
  /* each token's rows in row order (a counting sort by token), so that threads can take whole tokens and
   * still add every token's products in the order index_add_ adds them */
  int64_t *first = (int64_t *)calloc((size_t)(T + 1), sizeof(int64_t)), *rows = (int64_t *)malloc(sizeof(int64_t) * (N + 1));
  for (int64_t n = 0; n < N; n++) first[token[n] + 1]++;
  for (int64_t t = 0; t < T; t++) first[t + 1] += first[t];
  int64_t *next = (int64_t *)malloc(sizeof(int64_t) * (T + 1));
  memcpy(next, first, sizeof(int64_t) * (T + 1));
  for (int64_t n = 0; n < N; n++) rows[next[token[n]]++] = n;
  free(next);
  #pragma omp parallel if (N * H >= PARALLEL_MIN)
  {
    float *acc = is_bf16 ? (float *)malloc(sizeof(float) * H) : NULL;
    #pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      float *o = is_bf16 ? acc : (float *)out + t * H;
      memset(o, 0, sizeof(float) * H);
      for (int64_t i = first[t]; i < first[t + 1]; i++) {
        const int64_t n = rows[i];
        const float wn = as_dtype(w[n], is_bf16);
        if (is_bf16) {
          const uint16_t *yr = (const uint16_t *)y + n * H;
          const __m256 w8 = _mm256_set1_ps(wn);
          int64_t j = 0;
          for (; j + 8 <= H; j += 8) /* the loop below, eight at a time: the same roundings in the same order */
            _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j), round_bf16_8(_mm256_mul_ps(load_bf16_8(yr + j), w8))));
          for (; j < H; j++) o[j] += as_dtype(bf16_to_f32(yr[j]) * wn, 1);
        } else {
          const float *yr = (const float *)y + n * H;
          for (int64_t j = 0; j < H; j++) o[j] += yr[j] * wn;
        }
      }
      if (is_bf16) {
        uint16_t *ob = (uint16_t *)out + t * H;
        int64_t j = 0;
        for (; j + 8 <= H; j += 8) store_bf16_8(ob + j, _mm256_loadu_ps(acc + j));
        for (; j < H; j++) ob[j] = f32_to_bf16(acc[j]);
      }
    }
    free(acc);
  }
  free(first);
  free(rows);
  return 0;
}

/* ---- the rest of a decode step, so that a whole step can be one replayed sequence of these calls ---- */

/* out[i] = table[ids[i]] for rows of cols values (the embedding lookup, and the rotary tables' rows of the
 * step's positions), converted from the table's dtype to out's (bf16 rounded to nearest even, as .to()
 * rounds). Returns -1, writing nothing, when an id lies outside [0, rows); else 0. */
int epserve_gather_rows(const int64_t *ids, int64_t N, const void *table, int64_t rows, int64_t cols, int table_bf16,
                        void *out, int out_bf16) {
  for (int64_t i = 0; i < N; i++)
    if (ids[i] < 0 || ids[i] >= rows) return -1;
  const int64_t elem = table_bf16 ? 2 : 4;
  #pragma omp parallel for schedule(static) if (N * cols >= PARALLEL_MIN)
  for (int64_t i = 0; i < N; i++) {
    const char *src = (const char *)table + ids[i] * cols * elem;
    if (table_bf16 == out_bf16) {
      memcpy((char *)out + i * cols * elem, src, (size_t)(cols * elem));
    } else {
      for (int64_t j = 0; j < cols; j++) store(out, i * cols + j, load(src, j, table_bf16), out_bf16);
    }
  }
  return 0;
}

/* dst[i, j, :] = src[i, j, :] for i < n0, j < n1 and cols values each (the last dim contiguous on both
 * sides, the others strided), converted between bf16 and fp32 as .to() converts. */
void epserve_copy_cast(const void *src, int src_bf16, int64_t n0, int64_t n1, int64_t cols, int64_t ss0,
                       int64_t ss1, void *dst, int dst_bf16, int64_t ds0, int64_t ds1) {
  #pragma omp parallel for schedule(static) if (n0 * n1 * cols >= PARALLEL_MIN)
  for (int64_t i = 0; i < n0; i++)
    for (int64_t j = 0; j < n1; j++) {
      const int64_t s = i * ss0 + j * ss1, d = i * ds0 + j * ds1;
      for (int64_t c = 0; c < cols; c++) store(dst, d + c, load(src, s + c, src_bf16), dst_bf16);
    }
}

/* out = a + b over n contiguous values, bf16 (rounded once, as torch's bf16 add rounds) or fp32. */
void epserve_add(const void *a, const void *b, int64_t n, int is_bf16, void *out) {
  if (is_bf16) {
    const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
    uint16_t *o = (uint16_t *)out;
    #pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
  } else {
    const float *x = (const float *)a, *y = (const float *)b;
    float *o = (float *)out;
    #pragma omp parallel for schedule(static) if (n >= PARALLEL_MIN)
    for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
  }
}

/* SwiGLU's activation: x [T, 2I] (gate then up, rows ldx apart) -> out [T, I] = silu(gate) * up, each op
 * rounded to the dtype as torch's F.silu(gate) * up rounds (bf16), or in fp32. */
void epserve_silu_mul(const void *x, int64_t T, int64_t I, int64_t ldx, int is_bf16, void *out) {
  #pragma omp parallel for schedule(static) if (T * I >= PARALLEL_MIN)
  for (int64_t t = 0; t < T; t++) {
    int64_t j = 0;
    for (; j + 8 <= I; j += 8) { /* the scalar loop below, eight at a time (e^-g by exp8) */
      if (is_bf16) {
        const uint16_t *row = (const uint16_t *)x + t * ldx;
        const __m256 g = load_bf16_8(row + j), u = load_bf16_8(row + I + j);
        store_bf16_8((uint16_t *)out + t * I + j, _mm256_mul_ps(round_bf16_8(silu8(g)), u));
      } else {
        const float *row = (const float *)x + t * ldx;
        const __m256 g = _mm256_loadu_ps(row + j), u = _mm256_loadu_ps(row + I + j);
        _mm256_storeu_ps((float *)out + t * I + j, _mm256_mul_ps(silu8(g), u));
      }
    }
    for (; j < I; j++) {
      const float g = load(x, t * ldx + j, is_bf16), u = load(x, t * ldx + I + j, is_bf16);
      const float s = as_dtype(g / (1.0f + expf(-g)), is_bf16);
      store(out, t * I + j, s * u, is_bf16);
    }
  }
}

/* The local dispatcher's permutation in one pass: the T * K token copies of ids [T, K] grouped by expert
 * as a stable sort orders them (counts [E] per expert), each copy's source token, routing weight (of
 * topk_w [T, K]) and row of x [T, H] (elem bytes a value) in that order. Returns -1, writing nothing, when
 * an id lies outside [0, E); else 0. */
int epserve_local_dispatch(const void *x, int64_t T, int64_t H, int64_t elem, const int64_t *ids, int64_t K,
                           const float *topk_w, int64_t E, void *rows, int64_t *counts, int64_t *token_idx,
                           float *weights) {
  const int64_t N = T * K;
  int64_t *next = count_by_expert(ids, N, E, counts);
  if (!next) return -1;
  for (int64_t i = 0; i < N; i++) {
    const int64_t j = next[ids[i]]++;
    token_idx[j] = i / K;
    weights[j] = topk_w[i];
  }
  #pragma omp parallel for schedule(static) if (N * H >= PARALLEL_MIN)
  for (int64_t j = 0; j < N; j++)
    memcpy((char *)rows + j * H * elem, (const char *)x + token_idx[j] * H * elem, (size_t)(H * elem));
  free(next);
  return 0;
}

/* dst[idx[i]] += src[i] for i < n (int64; the experts' load counters). Returns -1, adding nothing, when an
 * index lies outside [0, n_dst); else 0. */
int epserve_index_add_i64(int64_t *dst, int64_t n_dst, const int64_t *idx, const int64_t *src, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (idx[i] < 0 || idx[i] >= n_dst) return -1;
  for (int64_t i = 0; i < n; i++) dst[idx[i]] += src[i];
  return 0;
}

/* ---- packed twins (cpu_bf16.h) and the replay ---- */

int epserve_mla_decode_packed(const int64_t *a) {
  return epserve_mla_decode(PTR(0), a[1], a[2], a[3], PTR(4), (int)a[5], a[6], a[7], PTR(8), a[9], PTR(10),
                            packed_float(a[11]), a[12], PTR(13), (int)a[14]);
}

int epserve_grouped_topk_packed(const int64_t *a) {
  epserve_grouped_topk(PTR(0), a[1], a[2], a[3], a[4], a[5], (int)a[6], (int)a[7], (int)a[8], (int)a[9],
                       packed_float(a[10]), PTR(11), PTR(12), a[13], PTR(14), PTR(15));
  return 0;
}

int epserve_rms_norm_packed(const int64_t *a) {
  epserve_rms_norm(PTR(0), PTR(1), a[2], a[3], a[4], packed_float(a[5]), (int)a[6], PTR(7));
  return 0;
}

int epserve_head_matmul_packed(const int64_t *a) {
  epserve_head_matmul(PTR(0), (int)a[1], a[2], a[3], a[4], a[5], a[6], PTR(7), a[8], PTR(9), a[10], a[11], (int)a[12],
                      (int)a[13]);
  return 0;
}

int epserve_rope_heads_packed(const int64_t *a) {
  epserve_rope_heads(PTR(0), a[1], a[2], a[3], PTR(4), PTR(5), a[6], (int)a[7], (int)a[8]);
  return 0;
}

int epserve_append_latent_packed(const int64_t *a) {
  return epserve_append_latent(PTR(0), a[1], a[2], a[3], a[4], PTR(5), packed_float(a[6]), PTR(7), PTR(8), (int)a[9],
                               (int)a[10], PTR(11), PTR(12), a[13], (int)a[14]);
}

int epserve_group_by_expert_packed(const int64_t *a) {
  return epserve_group_by_expert(PTR(0), a[1], a[2], PTR(3), PTR(4));
}

int epserve_weighted_combine_packed(const int64_t *a) {
  return epserve_weighted_combine(PTR(0), a[1], a[2], PTR(3), PTR(4), a[5], (int)a[6], PTR(7));
}

int epserve_gather_rows_packed(const int64_t *a) {
  return epserve_gather_rows(PTR(0), a[1], PTR(2), a[3], a[4], (int)a[5], PTR(6), (int)a[7]);
}

int epserve_copy_cast_packed(const int64_t *a) {
  epserve_copy_cast(PTR(0), (int)a[1], a[2], a[3], a[4], a[5], a[6], PTR(7), (int)a[8], a[9], a[10]);
  return 0;
}

int epserve_add_packed(const int64_t *a) {
  epserve_add(PTR(0), PTR(1), a[2], (int)a[3], PTR(4));
  return 0;
}

int epserve_silu_mul_packed(const int64_t *a) {
  epserve_silu_mul(PTR(0), a[1], a[2], a[3], (int)a[4], PTR(5));
  return 0;
}

int epserve_local_dispatch_packed(const int64_t *a) {
  return epserve_local_dispatch(PTR(0), a[1], a[2], a[3], PTR(4), a[5], PTR(6), a[7], PTR(8), PTR(9), PTR(10),
                                PTR(11));
}

int epserve_index_add_i64_packed(const int64_t *a) {
  return epserve_index_add_i64(PTR(0), a[1], PTR(2), PTR(3), a[4]);
}

/* Runs n recorded calls in order: fns[i] a packed kernel, args[i] the address of its argument array; with
 * seconds (may be NULL) each call's wall time added to seconds[i]. Stops at the first call returning
 * nonzero: returns its index (its code in *rc), or -1 when all ran. */
int64_t epserve_replay(const int64_t *fns, const int64_t *args, int64_t n, int *rc, double *seconds) {
  for (int64_t i = 0; i < n; i++) {
    const double t0 = seconds ? omp_get_wtime() : 0.0;
    const int code = ((epserve_packed_fn)(intptr_t)fns[i])((const int64_t *)(intptr_t)args[i]);
    if (seconds) seconds[i] += omp_get_wtime() - t0;
    if (code) {
      *rc = code;
      return i;
    }
  }
  *rc = 0;
  return -1;
}
