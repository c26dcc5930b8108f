// ModelOpt's dynamic NVFP4 fake quantization of an activation, as device functions: the one copy of its
// arithmetic, used by the standalone kernel (quantize_nvfp4.cu) and by every kernel that emits the NVFP4
// input of a linear as a second output (the LayerNorm kernels through QaLnEmit, swiglu), so the paths
// cannot drift. The arithmetic (quantize_nvfp4.cu's header gives it with its sources) per block of 16
// consecutive elements of a row:
//
//   gs = amax * (1 / 2688), or 1e-12 where not > 0      (qa_nvfp4_global_scale)
//   s  = e4m3(min(bmax / (6 gs), 448)) * gs, 1 below 1e-5 (qa_nvfp4_block_scale; bmax: max |x|, NaN skipped)
//   y  = x >= 0 ? e2m1(|x| / s) * s : 0 - e2m1(|x| / s) * s   (qa_nvfp4_value), then rounded to T
//
// A block may be spread over several threads (qa_nvfp4_quantize: N elements a thread, 16 / N adjacent lanes a
// block): the block max is then combined with xor shuffles inside the lane group. fmaxf is exact and order-free
// (a NaN operand gives the other one; all NaN gives NaN), so that max equals one thread's left-to-right max.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

// Variants (NVRTC defines, for the bit-exactness probes): QA_NVFP4_GS 0: amax * (1 / 2688), 1: amax / 2688;
// QA_NVFP4_DIV 0: div.full.f32 (Triton's lowering of an fp32 '/'), 1: IEEE, 2: a * rcp(b), 3: div.approx.
#ifndef QA_NVFP4_GS
#define QA_NVFP4_GS 0
#endif
#ifndef QA_NVFP4_DIV
#define QA_NVFP4_DIV 0
#endif
#ifndef QA_NVFP4_CVT  // 0: fp32 -> e4m3 directly (round to nearest even), 1: through fp16 (two roundings)
#define QA_NVFP4_CVT 0
#endif

#define QA_NVFP4_BLOCK 16

__device__ __forceinline__ float qa_nvfp4_e4m3(float t) {
#if QA_NVFP4_CVT == 1
  unsigned short h;
  float r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(t));
  asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
  return qa_e4m3_rne_satfinite(r);
#else
  return qa_e4m3_rne_satfinite(t);
#endif
}

__device__ __forceinline__ float qa_nvfp4_div(float a, float b) {
#if QA_NVFP4_DIV == 0
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#elif QA_NVFP4_DIV == 1
  return __fdiv_rn(a, b);
#elif QA_NVFP4_DIV == 2
  return __fmul_rn(a, __frcp_rn(b));
#else
  return __fdividef(a, b);
#endif
}

// ModelOpt's fp4_round_magnitude: the e2m1 value of a magnitude (NaN gives 6: every comparison is false).
__device__ __forceinline__ float qa_e2m1_magnitude(float a) {
  return a <= 0.25f ? 0.f : a < 0.75f ? 0.5f : a <= 1.25f ? 1.f : a < 1.75f ? 1.5f
       : a <= 2.5f ? 2.f : a < 3.5f ? 3.f : a <= 5.f ? 4.f : 6.f;
}

// The second-level scale from the calibrated per-tensor amax (one fp32 value).
__device__ __forceinline__ float qa_nvfp4_global_scale(const float* amax) {
#if QA_NVFP4_GS == 0
  const float gs = __fmul_rn(*amax, 1.0f / 2688.0f);
#else
  const float gs = __fdiv_rn(*amax, 2688.f);
#endif
  return gs > 0.f ? gs : 1e-12f;
}

// The dequantization scale of a block whose largest magnitude is bmax.
__device__ __forceinline__ float qa_nvfp4_block_scale(float bmax, float gs) {
  const float t = fminf(qa_nvfp4_div(bmax, __fmul_rn(6.f, gs)), 448.f);  // fminf: a NaN quotient gives 448
  const float s = __fmul_rn(qa_nvfp4_e4m3(t), gs);
  return s >= 1e-5f ? s : 1.f;
}

// One element's fake-quantized value in fp32 (before the rounding to T). Triton's -r is 0 - r: a negative
// element that rounds to zero gives +0, and NaN (which fails x >= 0) gives -6 s.
__device__ __forceinline__ float qa_nvfp4_value(float x, float s) {
  const float r = __fmul_rn(qa_e2m1_magnitude(qa_nvfp4_div(fabsf(x), s)), s);
  return x >= 0.f ? r : __fsub_rn(0.f, r);
}

// The max of m over a group of G adjacent lanes (G a power of two dividing 32, the group starting at a
// multiple of G). The mask names only this group, so groups may diverge from each other (a LayerNorm
// kernel's last slots, a kernel's early exit) as long as a group's lanes stay together, which the callers
// guarantee by D % 16 == 0.
template <int G>
__device__ __forceinline__ float qa_nvfp4_group_max(float m) {
  static_assert(G >= 1 && G <= 32 && (G & (G - 1)) == 0, "a lane group is a power of two within a warp");
  if constexpr (G > 1) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned mask = G == 32 ? 0xffffffffu : ((1u << G) - 1u) << (lane & ~(unsigned)(G - 1));
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(mask, m, off));
  }
  return m;
}

// NVFP4 fake quantization of N consecutive elements of a row held by this thread (f: their values, already
// rounded to T as the consumer linear would read them), N dividing 16: the 16 / N adjacent lanes starting at
// a multiple of 16 / N hold one block between them (every lane of the group must call this together).
template <class T, int N>
__device__ __forceinline__ QaVec<typename T::storage, N> qa_nvfp4_quantize(const float (&f)[N], float gs) {
  static_assert(N >= 1 && QA_NVFP4_BLOCK % N == 0, "a thread holds a whole fraction of a 16-element block");
  float m = fabsf(f[0]);
#pragma unroll
  for (int i = 1; i < N; ++i) m = fmaxf(m, fabsf(f[i]));
  const float s = qa_nvfp4_block_scale(qa_nvfp4_group_max<QA_NVFP4_BLOCK / N>(m), gs);
  QaVec<typename T::storage, N> o;
#pragma unroll
  for (int i = 0; i < N; ++i) o.v[i] = T::store(qa_nvfp4_value(f[i], s));
  return o;
}

// The same for N values in storage form (a fused kernel's rounded output), stored at p (vector store when `vec`).
template <class T, int N>
__device__ __forceinline__ void qa_store_nvfp4(typename T::storage* p, bool vec, const QaVec<typename T::storage, N>& o,
                                               float gs) {
  float f[N];
  qa_widen<T, N>(o, f);
  qa_store_raw<T, N>(p, vec, qa_nvfp4_quantize<T, N>(f, gs));
}
