// layer_norm_scale: out = LayerNorm(x) * (1 + scale)   (Qwen-Image-2.1's norm1 site: no shift)
//
// One block per row in PyTorch's LayerNorm layout (layer_norm.cuh: the mode eager takes for this
// input, its Welford order). NV > 0: each thread keeps its NV slots of x in registers between the
// statistics and the output (x read once); NV == 0: streaming variant for very wide rows (x read
// twice). The scale row of each token is chosen by target_token_mask (scale_gate.cuh).
// Outputs: `out` in the tensor dtype (skipped when null) and/or `out_fp8`, the e4m3 codes of that
// same rounded value under the consumer linears' input quantizer (amax at `out_amax`).
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "scale_gate.cuh"

struct LayerNormScaleParams {
  const void* x;
  void* out;
  unsigned char* out_fp8;
  const void* scale;
  const unsigned char* mask;  // target_token_mask [L] or null
  const float* out_amax;
  qa_i64 scale_rs, B, L;
  int D;
  float eps;
  int vec_flags;  // 1: x/out rows vector-aligned, 4: scale rows
};

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, QaLn<MODE>::MIN_BLOCKS)
layer_norm_scale_kernel(const LayerNormScaleParams p) {
  typedef typename T::storage S;
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  __shared__ float smem[48];
  const int D = p.D;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_target_row(row, p.L, p.B, p.mask);
  const S* xr = reinterpret_cast<const S*>(p.x) + row * (qa_i64)D;
  S* outr = p.out ? reinterpret_cast<S*>(p.out) + row * (qa_i64)D : nullptr;
  unsigned char* f8r = p.out_fp8 ? p.out_fp8 + row * (qa_i64)D : nullptr;
  const S* scr = reinterpret_cast<const S*>(p.scale) + prow * p.scale_rs;
  const bool vx = p.vec_flags & 1, vsc = p.vec_flags & 4;
  float f8scale = 1.f, f8inv = 1.f;
  if (f8r) qa_fp8_scales(p.out_amax, 1, f8scale, f8inv);
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) qa_load<T, CH>(xr + c * CH, vx, v[k]);
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (tid + k * TH < nslots) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          const int n = k * CH + i + 1;  // slots are filled in order: the count is a constant
          qa_welford_add<MODE>(w, v[k][i], (float)n, 1.0f / (float)n);
        }
      }
    }
  } else {
    int n = 0;
    for (int c = tid; c < nslots; c += TH) {
      float t[CH];
      qa_load<T, CH>(xr + c * CH, vx, t);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, t[i], (float)n, __frcp_rn((float)n));
      }
    }
  }
  const float2 mr = qa_row_mean_rstd<MODE>(w, D, p.eps, smem);

#pragma unroll
  for (int k = 0; k < (NV > 0 ? NV : 1); ++k) {
    for (int c = tid + k * TH; c < nslots; c += (NV > 0 ? nslots : TH)) {
      float t[CH];
      if (NV > 0) {
#pragma unroll
        for (int i = 0; i < CH; ++i) t[i] = v[k][i];
      } else {
        qa_load<T, CH>(xr + c * CH, vx, t);
      }
      const QaVec<S, CH> o = qa_scaled<T, MODE, CH>(t, mr.x, mr.y, qa_load_raw<T, CH>(scr + c * CH, vsc));
      if (outr) qa_store_raw<T, CH>(outr + c * CH, vx, o);
      if (f8r) qa_store_fp8<T, CH>(f8r + c * CH, vx, o, f8scale);
    }
  }
}
