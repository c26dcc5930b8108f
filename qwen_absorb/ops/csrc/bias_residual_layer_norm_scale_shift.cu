// bias_residual_layer_norm_scale_shift   (the norm2 site, after attention)
//   new_residual = residual + gate * (x + bias)
//   modulated    = LayerNorm(Q(new_residual)) * (1 + scale) + shift
// Q is identity (quant_mode 0) or ModelOpt's FP8 per-tensor fake quantization (1, 2); the residual
// written out is never quantized. Layout and variants as in layer_norm_scale_shift.cu; `out` and
// `out_fp8` as there (out_fp8: the FP8 input of net[0].proj when it runs as a real FP8 GEMM).
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"

struct BiasResidualLayerNormScaleShiftParams {
  const void* residual;
  const void* x;
  const void* bias;
  const void* gate;
  const void* shift;
  const void* scale;
  void* new_residual;
  void* out;
  unsigned char* out_fp8;
  const void* index;
  const float* amax;      // norm-input quantizer (quant_mode != 0)
  const float* out_amax;  // consumer input quantizer (out_fp8 != null)
  qa_i64 gate_rs, shift_rs, scale_rs, B, L;
  int D;
  float eps;
  int index_kind;
  int quant_mode;
  int vec_flags;  // 1: activations, 2: shift, 4: scale, 8: gate rows, 16: bias vector-aligned
};

// One slot: writes new_residual (rounded like eager: x + bias, gate * that, residual + that) and
// returns the LayerNorm input Q(new_residual) in q.
template <class T, int CH>
__device__ __forceinline__ void qa_residual_slot(
    const typename T::storage* r, const typename T::storage* xx, const typename T::storage* b,
    const typename T::storage* g, typename T::storage* h, bool vx, bool vb, bool vg,
    int quant_mode, float qscale, float qinv, float (&q)[CH]) {
  typedef typename T::storage S;
  QaVec<S, CH> bv = {};
  if (b != nullptr) bv = qa_load_raw<T, CH>(b, vb);
  const QaVec<S, CH> hv = qa_gated_residual<T, CH>(qa_load_raw<T, CH>(r, vx), qa_load_raw<T, CH>(xx, vx),
                                                   qa_load_raw<T, CH>(g, vg), bv, b != nullptr);
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const float hf = T::load(hv.v[i]);
    q[i] = quant_mode != 0 ? qa_fp8_fake_quant<T>(hf, qscale, qinv) : hf;
  }
  qa_store_raw<T, CH>(h, vx, hv);
}

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, QaLn<MODE>::MIN_BLOCKS)
bias_residual_layer_norm_scale_shift_kernel(const BiasResidualLayerNormScaleShiftParams p) {
  typedef typename T::storage S;
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  __shared__ float smem[48];
  const int D = p.D;
  const int quant_mode = p.quant_mode;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, p.L, p.B, p.index, p.index_kind);
  const qa_i64 off = row * (qa_i64)D;
  const S* rr = reinterpret_cast<const S*>(p.residual) + off;
  const S* xr = reinterpret_cast<const S*>(p.x) + off;
  const S* bias = reinterpret_cast<const S*>(p.bias);
  S* hr = reinterpret_cast<S*>(p.new_residual) + off;
  S* outr = p.out ? reinterpret_cast<S*>(p.out) + off : nullptr;
  unsigned char* f8r = p.out_fp8 ? p.out_fp8 + off : nullptr;
  const S* gr = reinterpret_cast<const S*>(p.gate) + prow * p.gate_rs;
  const S* shr = reinterpret_cast<const S*>(p.shift) + prow * p.shift_rs;
  const S* scr = reinterpret_cast<const S*>(p.scale) + prow * p.scale_rs;
  const bool vx = p.vec_flags & 1, vsh = p.vec_flags & 2, vsc = p.vec_flags & 4, vg = p.vec_flags & 8,
             vb = p.vec_flags & 16;
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  float qscale = 1.f, qinv = 1.f;
  if (quant_mode != 0) qa_fp8_scales(p.amax, quant_mode, qscale, qinv);
  float f8scale = 1.f, f8inv = 1.f;
  if (f8r) qa_fp8_scales(p.out_amax, 1, f8scale, f8inv);
  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];  // Q(new_residual), the LayerNorm input

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots)
        qa_residual_slot<T, CH>(rr + c * CH, xr + c * CH, bias ? bias + c * CH : nullptr, gr + c * CH,
                                hr + c * CH, vx, vb, vg, quant_mode, qscale, qinv, v[k]);
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
      float q[CH];
      qa_residual_slot<T, CH>(rr + c * CH, xr + c * CH, bias ? bias + c * CH : nullptr, gr + c * CH,
                              hr + c * CH, vx, vb, vg, quant_mode, qscale, qinv, q);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, q[i], (float)n, __frcp_rn((float)n));
      }
    }
  }
  const float2 mr = qa_row_mean_rstd<MODE>(w, D, p.eps, smem);

  // NV > 0: slot k once (values from registers); NV == 0: a strided loop that re-reads the
  // new_residual slots this thread wrote itself (program order makes them visible).
#pragma unroll
  for (int k = 0; k < (NV > 0 ? NV : 1); ++k) {
    for (int c = tid + k * TH; c < nslots; c += (NV > 0 ? nslots : TH)) {
      float t[CH];
      if (NV > 0) {
#pragma unroll
        for (int i = 0; i < CH; ++i) t[i] = v[k][i];
      } else {
        qa_load<T, CH>(hr + c * CH, vx, t);
        if (quant_mode != 0) {
#pragma unroll
          for (int i = 0; i < CH; ++i) t[i] = qa_fp8_fake_quant<T>(t[i], qscale, qinv);
        }
      }
      const QaVec<S, CH> o = qa_modulated<T, MODE, CH>(t, mr.x, mr.y, qa_load_raw<T, CH>(scr + c * CH, vsc),
                                                       qa_load_raw<T, CH>(shr + c * CH, vsh));
      if (outr) qa_store_raw<T, CH>(outr + c * CH, vx, o);
      if (f8r) qa_store_fp8<T, CH>(f8r + c * CH, vx, o, f8scale);
    }
  }
}
