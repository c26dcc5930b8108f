// tanh_gate_residual_layer_norm_scale   (Qwen-Image-2.1's norm2 site, after attention)
//   new_residual = C(residual + tanh(gate) * x)
//   modulated    = LayerNorm(Q(new_residual)) * (1 + scale)
// Q: the identity (quant_mode 0) or a QuantLayerNorm's FP8 input fake quantization (1, 2; amax at
// `amax`), as in bias_residual_layer_norm_scale_shift.cu; new_residual itself is never quantized.
// C: the identity, or (clip != 0, float16) the block's final clip(-65504, 65504), so that the op
// also serves the FFN residual followed by the next block's norm1. Layout and variants as in
// layer_norm_scale.cu (qa_ln_row, ln_row.cuh); eager's norm2 sees a fresh tensor, so the caller
// picks the vectorized mode when D % 4 == 0. `out` and `out2` (e4m3 codes, or NVFP4 values
// when NVFP4 = 1) as there.
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "ln_row.cuh"
#include "residual_row.cuh"
#include "scale_gate.cuh"

struct TanhGateResidualLayerNormScaleParams {
  const void* residual;
  const void* x;
  const void* gate;
  const void* scale;
  void* new_residual;
  void* out;
  void* out2;  // second output (or null): e4m3 codes, or NVFP4 values in T (NVFP4 instances)
  const unsigned char* mask;  // target_token_mask [L] or null
  const float* out2_amax;  // the second output's per-tensor amax (FP8 codes or NVFP4)
  const float* amax;  // norm-input quantizer (quant_mode != 0)
  qa_i64 gate_rs, scale_rs, B, L;
  int D;
  float eps;
  int clip;
  int quant_mode;
  int vec_flags;  // 1: activations, 4: scale rows, 8: gate rows vector-aligned
};

template <class T, int MODE, int NV, int NVFP4 = 0>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, qa_ln_min_blocks<MODE, NV>())
tanh_gate_residual_layer_norm_scale_kernel(const TanhGateResidualLayerNormScaleParams p) {
  constexpr int CH = QaLn<MODE>::CH;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_target_row(row, p.L, p.B, p.mask);
  const qa_i64 off = row * (qa_i64)p.D;
  qa_ln_dispatch<MODE, NV>(p.D, p.vec_flags, 1 | 4 | 8, [&](auto fast) {
    constexpr bool FAST = decltype(fast)::value;
    const int vf = FAST ? (1 | 4 | 8) : p.vec_flags;
    const QaResidualRow<T, QA_GATE_TANH, CH> res(p.residual, p.x, nullptr, p.gate, p.new_residual, off,
                                                 prow * p.gate_rs, vf, p.clip);
    // the LayerNorm input is new_residual: computed (and written) once; the streaming variant
    // re-reads the slots this thread wrote itself (program order makes them visible)
    const QaLnInput<T, CH> reread(p.new_residual, off, vf, p.amax, p.quant_mode);
    auto produce = [&](int rel, float (&t)[CH]) {
      qa_widen<T, CH>(res.step(rel), t);
      qa_fp8_fake_quant_n<T, CH>(t, reread.quant_mode, reread.qscale, reread.qinv);
    };
    const QaLnEmit<T, MODE, false, NVFP4 != 0> emit(p.out, p.out2, p.out2_amax, off, vf, p.scale, prow * p.scale_rs);
    qa_ln_row<MODE, NV, FAST>(p.D, p.eps, produce, reread, emit);
  });
}
