// tanh_gate_residual_layer_norm_scale   (Qwen-Image-2.1's norm2 site, after attention)
//   new_residual = C(residual + tanh(gate) * x)
//   modulated    = LayerNorm(new_residual) * (1 + scale)
// C: the identity, or (clip != 0, float16) the block's final clip(-65504, 65504), so that the op
// also serves the FFN residual followed by the next block's norm1. Layout and variants as in
// layer_norm_scale.cu (qa_ln_row, ln_row.cuh); eager's norm2 sees a fresh tensor, so the caller
// picks the vectorized mode when D % 4 == 0. `out` and `out_fp8` as there.
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "ln_row.cuh"
#include "scale_gate.cuh"

struct TanhGateResidualLayerNormScaleParams {
  const void* residual;
  const void* x;
  const void* gate;
  const void* scale;
  void* new_residual;
  void* out;
  unsigned char* out_fp8;
  const unsigned char* mask;  // target_token_mask [L] or null
  const float* out_amax;
  qa_i64 gate_rs, scale_rs, B, L;
  int D;
  float eps;
  int clip;
  int vec_flags;  // 1: activations, 4: scale rows, 8: gate rows vector-aligned
};

// One slot: writes new_residual and returns it widened in h (the LayerNorm input).
template <class T, int CH>
__device__ __forceinline__ void qa_tanh_residual_slot(
    const typename T::storage* r, const typename T::storage* xx, const typename T::storage* g,
    typename T::storage* hout, bool vx, bool vg, bool clip, float (&h)[CH]) {
  typedef typename T::storage S;
  QaVec<S, CH> hv = qa_tanh_gated_residual<T, CH>(qa_load_raw<T, CH>(r, vx), qa_load_raw<T, CH>(xx, vx),
                                                  qa_load_raw<T, CH>(g, vg));
  if (clip) qa_clip_f16_vec<T, CH>(hv);
#pragma unroll
  for (int i = 0; i < CH; ++i) h[i] = T::load(hv.v[i]);
  qa_store_raw<T, CH>(hout, vx, hv);
}

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, QaLn<MODE>::MIN_BLOCKS)
tanh_gate_residual_layer_norm_scale_kernel(const TanhGateResidualLayerNormScaleParams p) {
  typedef typename T::storage S;
  constexpr int CH = QaLn<MODE>::CH;
  const int D = p.D;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_target_row(row, p.L, p.B, p.mask);
  const qa_i64 off = row * (qa_i64)D;
  const S* rr = reinterpret_cast<const S*>(p.residual) + off;
  const S* xr = reinterpret_cast<const S*>(p.x) + off;
  S* hr = reinterpret_cast<S*>(p.new_residual) + off;
  S* outr = p.out ? reinterpret_cast<S*>(p.out) + off : nullptr;
  unsigned char* f8r = p.out_fp8 ? p.out_fp8 + off : nullptr;
  const S* gr = reinterpret_cast<const S*>(p.gate) + prow * p.gate_rs;
  const S* scr = reinterpret_cast<const S*>(p.scale) + prow * p.scale_rs;
  const bool vx = p.vec_flags & 1, vsc = p.vec_flags & 4, vg = p.vec_flags & 8;
  const bool clip = p.clip != 0;
  float f8scale = 1.f, f8inv = 1.f;
  if (f8r) qa_fp8_scales(p.out_amax, 1, f8scale, f8inv);

  // the LayerNorm input is new_residual: computed (and written) once; the streaming variant
  // re-reads the slots this thread wrote itself (program order makes them visible)
  auto produce = [&](int c, float (&t)[CH]) {
    qa_tanh_residual_slot<T, CH>(rr + c * CH, xr + c * CH, gr + c * CH, hr + c * CH, vx, vg, clip, t);
  };
  auto reread = [&](int c, float (&t)[CH]) { qa_load<T, CH>(hr + c * CH, vx, t); };
  auto emit = [&](int c, const float (&t)[CH], float mean, float rstd) {
    const QaVec<S, CH> o = qa_scaled<T, MODE, CH>(t, mean, rstd, qa_load_raw<T, CH>(scr + c * CH, vsc));
    if (outr) qa_store_raw<T, CH>(outr + c * CH, vx, o);
    if (f8r) qa_store_fp8<T, CH>(f8r + c * CH, vx, o, f8scale);
  };
  qa_ln_row<MODE, NV>(D, p.eps, produce, reread, emit);
}
