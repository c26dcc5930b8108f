// layer_norm_scale: out = LayerNorm(x) * (1 + scale)   (Qwen-Image-2.1's norm1 site: no shift)
//
// One block per row in PyTorch's LayerNorm layout (layer_norm.cuh: the mode eager takes for this
// input, its Welford order), driven by qa_ln_row (ln_row.cuh). NV > 0: x read once and kept in
// registers; NV == 0: streaming variant for very wide rows (x read twice). The scale row of each
// token is chosen by target_token_mask (scale_gate.cuh).
// Outputs: `out` in the tensor dtype (skipped when null) and/or `out_fp8`, the e4m3 codes of that
// same rounded value under the consumer linears' input quantizer (amax at `out_amax`).
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "ln_row.cuh"
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
  constexpr int CH = QaLn<MODE>::CH;
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

  auto load = [&](int c, float (&t)[CH]) { qa_load<T, CH>(xr + c * CH, vx, t); };
  auto emit = [&](int c, const float (&t)[CH], float mean, float rstd) {
    const QaVec<S, CH> o = qa_scaled<T, MODE, CH>(t, mean, rstd, qa_load_raw<T, CH>(scr + c * CH, vsc));
    if (outr) qa_store_raw<T, CH>(outr + c * CH, vx, o);
    if (f8r) qa_store_fp8<T, CH>(f8r + c * CH, vx, o, f8scale);
  };
  qa_ln_row<MODE, NV>(D, p.eps, load, load, emit);
}
