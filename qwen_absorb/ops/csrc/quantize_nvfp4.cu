// quantize_nvfp4: ModelOpt's dynamic NVFP4 fake quantization of an activation, bit for bit.
//
// The target is the path ModelOpt takes on CUDA for a bf16/fp16/fp32 input of a dynamic NVFP4 quantizer
// (tensor_quant._dynamic_block_quantize_impl -> Triton kernel fp4_fake_quant_block of
// modelopt/torch/kernels/quantization/gemm/fp4_kernel_hopper.py, sm_89+), per row of D elements, per
// block of 16 (a last partial block padded with zeros, as its zero-padded tile load does):
//
//   gs    = amax * (1 / 2688)                 (torch on CUDA divides by a Python scalar as a multiplication by
//                                              its float reciprocal; 2688 = 6 * 448)
//   gs    = gs > 0 ? gs : 1e-12
//   bmax  = max |x| over the block            (max.f32: a NaN element is skipped)
//   t     = min(bmax / (6 * gs), 448)         (Triton's fp32 '/' is div.full.f32, not IEEE: used here too)
//   s     = e4m3(t) * gs                      (round to nearest even; 0 if t is below e4m3's range)
//   s     = s >= 1e-5 ? s : 1
//   q     = e2m1 magnitude of |x| / s         (div.full.f32; <=0.25: 0, <0.75: 0.5, <=1.25: 1, <1.75: 1.5,
//                                              <=2.5: 2, <3.5: 3, <=5: 4, else 6 -- NaN too)
//   y     = x >= 0 ? q * s : 0 - q * s        (Triton's unary minus is a subtraction from 0: a negative x that
//                                              rounds to 0 gives +0; NaN -> -6 s; -0 -> +0), rounded to T
//
// One thread per block of 16: the block's max never leaves the thread.
#include "common.cuh"
#include "fp8.cuh"

#define QA_NVFP4_THREADS 256
#define QA_NVFP4_BLOCK 16

struct QuantizeNvfp4Params {
  const void* x;
  void* y;
  const float* amax;  // one fp32 value: the quantizer's calibrated per-tensor amax
  qa_i64 rows;
  qa_i64 stride_row;  // elements between rows of x (y is contiguous)
  int D;
  int nblk;  // ceil(D / 16)
};

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

__device__ __forceinline__ float qa_div_full(float a, float b) {
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

__device__ __forceinline__ float qa_e2m1_magnitude(float a) {
  return a <= 0.25f ? 0.f : a < 0.75f ? 0.5f : a <= 1.25f ? 1.f : a < 1.75f ? 1.5f
       : a <= 2.5f ? 2.f : a < 3.5f ? 3.f : a <= 5.f ? 4.f : 6.f;
}

template <class T, int VEC>
__global__ void __launch_bounds__(QA_NVFP4_THREADS) quantize_nvfp4_kernel(const QuantizeNvfp4Params p) {
  typedef typename T::storage S;
  const qa_i64 i = (qa_i64)blockIdx.x * QA_NVFP4_THREADS + threadIdx.x;
  if (i >= p.rows * p.nblk) return;
  const qa_i64 row = i / p.nblk;
  const int c0 = (int)(i - row * p.nblk) * QA_NVFP4_BLOCK;
  const S* xr = reinterpret_cast<const S*>(p.x) + row * p.stride_row + c0;
  S* yr = reinterpret_cast<S*>(p.y) + row * (qa_i64)p.D + c0;
  const bool full = c0 + QA_NVFP4_BLOCK <= p.D;
  float v[QA_NVFP4_BLOCK];
  if (VEC > 1 && full) {
#pragma unroll
    for (int k = 0; k < QA_NVFP4_BLOCK; k += VEC) {
      const QaVec<S, VEC> w = *reinterpret_cast<const QaVec<S, VEC>*>(xr + k);
#pragma unroll
      for (int j = 0; j < VEC; ++j) v[k + j] = T::load(w.v[j]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < QA_NVFP4_BLOCK; ++k) v[k] = c0 + k < p.D ? T::load(xr[k]) : 0.f;
  }
#if QA_NVFP4_GS == 0
  float gs = __fmul_rn(*p.amax, 1.0f / 2688.0f);
#else
  float gs = __fdiv_rn(*p.amax, 2688.f);
#endif
  gs = gs > 0.f ? gs : 1e-12f;
  float bmax = fabsf(v[0]);
#pragma unroll
  for (int k = 1; k < QA_NVFP4_BLOCK; ++k) bmax = fmaxf(bmax, fabsf(v[k]));
  const float t = fminf(qa_div_full(bmax, __fmul_rn(6.f, gs)), 448.f);
  float s = __fmul_rn(qa_nvfp4_e4m3(t), gs);
  s = s >= 1e-5f ? s : 1.f;
  QaVec<S, QA_NVFP4_BLOCK> o;
#pragma unroll
  for (int k = 0; k < QA_NVFP4_BLOCK; ++k) {
    const float r = __fmul_rn(qa_e2m1_magnitude(qa_div_full(fabsf(v[k]), s)), s);
    o.v[k] = T::store(v[k] >= 0.f ? r : __fsub_rn(0.f, r));  // Triton's -r is 0 - r: +0, not -0
  }
  if (VEC > 1 && full) {
#pragma unroll
    for (int k = 0; k < QA_NVFP4_BLOCK; k += VEC) {
      QaVec<S, VEC> w;
#pragma unroll
      for (int j = 0; j < VEC; ++j) w.v[j] = o.v[k + j];
      *reinterpret_cast<QaVec<S, VEC>*>(yr + k) = w;
    }
  } else {
    for (int k = 0; k < QA_NVFP4_BLOCK && c0 + k < p.D; ++k) yr[k] = o.v[k];
  }
}
