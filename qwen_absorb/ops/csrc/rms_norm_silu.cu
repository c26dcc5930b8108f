// rms_norm_silu: the Qwen-Image VAE's QwenImageRMS_norm (+ SiLU) over the channels of a channels-last image
//
// out = silu(round(round(round(x / max(||x||_2, eps)) * scale) * gamma))   per pixel row of C channels
//
// Eager's roundings (diffusers: F.normalize(x.float(), dim=1).to(T) * scale * gamma, then F.silu), each an fp32
// operation with an explicit round-to-nearest intrinsic rounded to T: the division, the product with the Python
// scale, the product with gamma, SiLU (PyTorch's CUDA SiLU: x / (1 + exp(-x)) on the widened value). The norm is
// a sum of squares in fp32 in this kernel's order (lanes, then a butterfly), so it may differ from torch's
// reduction in its last bit: the VAE room's fidelity gate covers that (qwen_absorb.vae).
// Layout: one warp per row; a lane holds pairs lane, lane + 32, ... (C even, C <= 64 * QA_RNS_MAXP).
#include "common.cuh"

#define QA_RNS_WARPS 8
#define QA_RNS_MAXP 16

struct RmsNormSiluParams {
  const unsigned* x;      // rows x C/2 pairs of T
  const unsigned* gamma;  // C/2 pairs of T
  unsigned* out;          // rows x C/2 pairs of T
  qa_i64 rows;
  int pairs;
  float scale;
  float eps;
  int silu;
};

__device__ __forceinline__ float qa_rns_silu(float x) { return x / (1.f + expf(-x)); }

template <class T>
__device__ __forceinline__ float qa_rns_one(float x, float d, float scale, float g, int silu) {
  float y = qa_round<T>(__fdiv_rn(x, d));
  y = qa_round<T>(__fmul_rn(y, scale));
  y = qa_round<T>(__fmul_rn(y, g));
  return silu ? qa_rns_silu(y) : y;  // rounded by the packed store
}

template <class T>
__global__ void __launch_bounds__(QA_RNS_WARPS * 32) rms_norm_silu_kernel(const RmsNormSiluParams p) {
  const int lane = threadIdx.x & 31;
  const qa_i64 row = (qa_i64)blockIdx.x * QA_RNS_WARPS + (threadIdx.x >> 5);
  if (row >= p.rows) return;
  const unsigned* x = p.x + row * p.pairs;
  float lo[QA_RNS_MAXP], hi[QA_RNS_MAXP];
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < QA_RNS_MAXP; ++k) {
    const int i = lane + 32 * k;
    lo[k] = 0.f;
    hi[k] = 0.f;
    if (i < p.pairs) {
      T::load2(x[i], lo[k], hi[k]);
      ss = __fadd_rn(ss, __fmul_rn(lo[k], lo[k]));
      ss = __fadd_rn(ss, __fmul_rn(hi[k], hi[k]));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) ss = __fadd_rn(ss, __shfl_xor_sync(0xffffffffu, ss, off));
  const float d = fmaxf(__fsqrt_rn(ss), p.eps);
  unsigned* o = p.out + row * p.pairs;
#pragma unroll
  for (int k = 0; k < QA_RNS_MAXP; ++k) {
    const int i = lane + 32 * k;
    if (i < p.pairs) {
      float glo, ghi;
      T::load2(p.gamma[i], glo, ghi);
      o[i] = T::pack2(qa_rns_one<T>(lo[k], d, p.scale, glo, p.silu), qa_rns_one<T>(hi[k], d, p.scale, ghi, p.silu));
    }
  }
}
