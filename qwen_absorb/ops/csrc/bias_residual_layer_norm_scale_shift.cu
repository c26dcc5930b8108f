// bias_residual_layer_norm_scale_shift   (the norm2 site, after attention)
//   new_residual = residual + gate * (x + bias)
//   modulated    = LayerNorm(Q(new_residual)) * (1 + scale) + shift
// Q is identity (quant_mode 0) or ModelOpt's FP8 per-tensor fake quantization (1, 2); the residual
// written out is never quantized. Layout and variants as in layer_norm_scale_shift.cu; `out` and
// `out2` as there (out2: the FP8 codes or, NVFP4 = 1, the NVFP4 fake-quantized input of net[0].proj).
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "ln_row.cuh"
#include "residual_row.cuh"

struct BiasResidualLayerNormScaleShiftParams {
  const void* residual;
  const void* x;
  const void* bias;
  const void* gate;
  const void* shift;
  const void* scale;
  void* new_residual;
  void* out;
  void* out2;  // second output (or null): e4m3 codes, or NVFP4 values in T (NVFP4 instances)
  const void* index;
  const float* amax;      // norm-input quantizer (quant_mode != 0)
  const float* out2_amax;  // the second output's per-tensor amax (FP8 codes or NVFP4)
  qa_i64 gate_rs, shift_rs, scale_rs, B, L;
  int D;
  float eps;
  int index_kind;
  int quant_mode;
  int vec_flags;  // 1: activations, 2: shift, 4: scale, 8: gate rows, 16: bias vector-aligned
};

template <class T, int MODE, int NV, int NVFP4 = 0>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, qa_ln_min_blocks<MODE, NV>())
bias_residual_layer_norm_scale_shift_kernel(const BiasResidualLayerNormScaleShiftParams p) {
  constexpr int CH = QaLn<MODE>::CH;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, p.L, p.B, p.index, p.index_kind);
  const qa_i64 off = row * (qa_i64)p.D;
  const int needed = 1 | 2 | 4 | 8 | (p.bias != nullptr ? 16 : 0);
  qa_with_bias(p.bias, [&](auto has_bias) {
    qa_ln_dispatch<MODE, NV>(p.D, p.vec_flags, needed, [&](auto fast) {
      constexpr bool FAST = decltype(fast)::value;
      const int vf = FAST ? needed : p.vec_flags;
      const QaResidualRow<T, QA_GATE_LINEAR, CH, decltype(has_bias)::value> res(
          p.residual, p.x, p.bias, p.gate, p.new_residual, off, prow * p.gate_rs, vf);
      // The LayerNorm input is Q(new_residual): new_residual computed and written once; the streaming
      // variant re-reads the slots this thread wrote itself (program order makes them visible).
      const QaLnInput<T, CH> reread(p.new_residual, off, vf, p.amax, p.quant_mode);
      const QaLnEmit<T, MODE, true, NVFP4 != 0> emit(p.out, p.out2, p.out2_amax, off, vf, p.scale, prow * p.scale_rs,
                                                       p.shift, prow * p.shift_rs);
      auto produce = [&](int rel, float (&t)[CH]) {
        qa_widen<T, CH>(res.step(rel), t);
        qa_fp8_fake_quant_n<T, CH>(t, reread.quant_mode, reread.qscale, reread.qinv);
      };
      qa_ln_row<MODE, NV, FAST>(p.D, p.eps, produce, reread, emit);
    });
  });
}
