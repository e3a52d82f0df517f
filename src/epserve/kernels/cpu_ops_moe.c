/* The MoE side of a CPU decode step (cpu_ops.h): DeepSeek's grouped top-k gate (about twenty torch ops per
 * layer), the dispatchers' grouping by expert, the local dispatch's permutation, the weighted combine and
 * the experts' load counters. */
#include "cpu_ops.h"

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

/* Token copies grouped by expert, as a stable argsort of the flat ids [N] would order them:
 * order[j] the flat (token, k) index of the j-th copy, counts[e] the copies of expert e. Returns -1,
 * writing nothing, when an id lies outside [0, E); else 0. */
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
  int64_t *first = (int64_t *)calloc((size_t)(T + 1), sizeof(int64_t));
  int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (N + 1));
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
            _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_loadu_ps(o + j),
                                                  round_bf16_8(_mm256_mul_ps(load_bf16_8(yr + j), w8))));
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
