// layer_norm_scale_shift: out = LayerNorm(Q(x)) * (1 + scale) + shift   (the norm1 site)
//
// One block per row (QaLn<MODE>::THREADS threads, PyTorch's LayerNorm layout, see layer_norm.cuh).
// NV > 0: each thread keeps its NV slots of x in registers between the statistics and the output
// (x is read once). NV == 0: streaming variant for very wide rows, which reads x twice (the second
// read mostly hits L2).
// Q: the identity, or ModelOpt's FP8 per-tensor fake quantization of the norm's input (quant_mode
// 1/2 with amax at `amax`, QuantLayerNorm's input quantizer), applied as x is loaded.
// Outputs: `out` in the tensor dtype (skipped when null) and/or `out_fp8`, the e4m3 codes of that
// same rounded value under the consumer linears' input quantizer (amax at `out_amax`): the FP8
// input of to_q/to_k/to_v when they run as real FP8 GEMMs.
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"

struct LayerNormScaleShiftParams {
  const void* x;
  void* out;
  unsigned char* out_fp8;
  const void* shift;
  const void* scale;
  const void* index;
  const float* out_amax;
  const float* amax;
  qa_i64 shift_rs, scale_rs, B, L;
  int D;
  float eps;
  int index_kind;
  int quant_mode;
  int vec_flags;  // 1: x/out rows vector-aligned, 2: shift rows, 4: scale rows
};

template <class T, int CH>
__device__ __forceinline__ void qa_load_quant(const typename T::storage* p, bool vec, int quant_mode, float qs,
                                              float qi, float (&v)[CH]) {
  qa_load<T, CH>(p, vec, v);
  if (quant_mode != 0) {
#pragma unroll
    for (int i = 0; i < CH; ++i) v[i] = qa_fp8_fake_quant<T>(v[i], qs, qi);
  }
}

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, QaLn<MODE>::MIN_BLOCKS)
layer_norm_scale_shift_kernel(const LayerNormScaleShiftParams p) {
  typedef typename T::storage S;
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  __shared__ float smem[48];
  const int D = p.D;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, p.L, p.B, p.index, p.index_kind);
  const S* xr = reinterpret_cast<const S*>(p.x) + row * (qa_i64)D;
  S* outr = p.out ? reinterpret_cast<S*>(p.out) + row * (qa_i64)D : nullptr;
  unsigned char* f8r = p.out_fp8 ? p.out_fp8 + row * (qa_i64)D : nullptr;
  const S* shr = reinterpret_cast<const S*>(p.shift) + prow * p.shift_rs;
  const S* scr = reinterpret_cast<const S*>(p.scale) + prow * p.scale_rs;
  const bool vx = p.vec_flags & 1, vsh = p.vec_flags & 2, vsc = p.vec_flags & 4;
  float f8scale = 1.f, f8inv = 1.f;
  if (f8r) qa_fp8_scales(p.out_amax, 1, f8scale, f8inv);
  const int qm = p.quant_mode;
  float qs = 1.f, qi = 1.f;
  if (qm != 0) qa_fp8_scales(p.amax, qm, qs, qi);
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) qa_load_quant<T, CH>(xr + c * CH, vx, qm, qs, qi, v[k]);
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
      qa_load_quant<T, CH>(xr + c * CH, vx, qm, qs, qi, t);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, t[i], (float)n, __frcp_rn((float)n));
      }
    }
  }
  const float2 mr = qa_row_mean_rstd<MODE>(w, D, p.eps, smem);

  // NV > 0: slot k once (values from registers); NV == 0: a strided loop re-reading x.
#pragma unroll
  for (int k = 0; k < (NV > 0 ? NV : 1); ++k) {
    for (int c = tid + k * TH; c < nslots; c += (NV > 0 ? nslots : TH)) {
      float t[CH];
      if (NV > 0) {
#pragma unroll
        for (int i = 0; i < CH; ++i) t[i] = v[k][i];
      } else {
        qa_load_quant<T, CH>(xr + c * CH, vx, qm, qs, qi, t);
      }
      const QaVec<S, CH> o = qa_modulated<T, MODE, CH>(t, mr.x, mr.y, qa_load_raw<T, CH>(scr + c * CH, vsc),
                                                       qa_load_raw<T, CH>(shr + c * CH, vsh));
      if (outr) qa_store_raw<T, CH>(outr + c * CH, vx, o);
      if (f8r) qa_store_fp8<T, CH>(f8r + c * CH, vx, o, f8scale);
    }
  }
}
