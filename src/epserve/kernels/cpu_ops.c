/* The row-wise ops of a CPU decode step (cpu_ops.h: threaded over a prefill's rows from PARALLEL_MIN values):
 * RMSNorm (eight torch ops), and the rest of a step, so that a whole step can be one replayed sequence of
 * kernel calls: the embedding and rotary rows, copies and casts, residual adds, SwiGLU's activation; and
 * that replay. */
#include "cpu_ops.h"

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

/* A packed twin: a kernel taking its arguments as one int64 array (pointers as addresses, floats as their
 * bit patterns), generated from kernels/cpu_abi.py's table and built into each library, so that a recorded
 * sequence of kernel calls (kernels/cpu_graph.py) replays from C without Python. */
typedef int (*epserve_packed_fn)(const int64_t *);

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
