/* bf16 <-> fp32 as torch converts (round to nearest even, NaN kept quiet), shared by the CPU kernels. */
#ifndef EPSERVE_CPU_BF16_H
#define EPSERVE_CPU_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = ((uint32_t)h) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
  bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
  return (uint16_t)(bits >> 16);
}

/* Every exported kernel also has a "packed" twin taking its arguments as one int64 array (pointers as
 * addresses, floats as their bit patterns), so a recorded sequence of kernel calls (kernels/cpu_graph.py)
 * replays from C without Python: epserve_replay in cpu_ops.c walks it. */
typedef int (*epserve_packed_fn)(const int64_t *);
#define PTR(i) ((void *)(intptr_t)a[i])
static inline float packed_float(int64_t v) {
  const uint32_t bits = (uint32_t)v;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

#endif
