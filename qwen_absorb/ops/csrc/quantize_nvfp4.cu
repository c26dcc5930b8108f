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
// One thread per block of 16: the block's max never leaves the thread. The arithmetic is nvfp4.cuh's, shared
// with the kernels that emit NVFP4 values as a second output.
// ACT (the input of the linear, computed first and rounded to T as torch's eager op leaves it; activation.cuh,
// the formulas quantize_fp8.cu uses): 0 x itself, 1 F.gelu(x, approximate="tanh"), 2 F.silu(x).
#include "common.cuh"
#include "fp8.cuh"
#include "activation.cuh"
#include "nvfp4.cuh"

#define QA_NVFP4_THREADS 256

struct QuantizeNvfp4Params {
  const void* x;
  void* y;
  const float* amax;  // one fp32 value: the quantizer's calibrated per-tensor amax
  qa_i64 rows;
  qa_i64 stride_row;  // elements between rows of x (y is contiguous)
  int D;
  int nblk;  // ceil(D / 16)
};

template <int ACT>
__device__ __forceinline__ float qa_nvfp4_act(float v) {
  return ACT == 1 ? qa_gelu_tanh(v) : ACT == 2 ? qa_silu(v) : v;
}

template <class T, int VEC, int ACT = 0>
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
  if constexpr (ACT != 0) {
    // the activation as eager computes it in fp32, rounded to T (the tensor the linear would read); the
    // zero padding of a partial block stays 0 (both activations map 0 to 0 anyway)
#pragma unroll
    for (int k = 0; k < QA_NVFP4_BLOCK; ++k) v[k] = qa_round<T>(qa_nvfp4_act<ACT>(v[k]));
  }
  const QaVec<S, QA_NVFP4_BLOCK> o = qa_nvfp4_quantize<T, QA_NVFP4_BLOCK>(v, qa_nvfp4_global_scale(p.amax));
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
