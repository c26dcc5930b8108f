// layer_norm_scale: out = LayerNorm(Q(x)) * (1 + scale)   (Qwen-Image-2.1's norm1 site: no shift)
//
// Q is the identity (quant_mode 0) or ModelOpt's FP8 per-tensor fake quantization of a QuantLayerNorm's
// input quantizer (1: its CUDA extension's formula, 2: its torch formula; fp8.cuh), amax at `amax`.
// One block per row in PyTorch's LayerNorm layout (layer_norm.cuh: the mode eager takes for this
// input, its Welford order), driven by qa_ln_row (ln_row.cuh). NV > 0: x read once and kept in
// registers; NV == 0: streaming variant for very wide rows (x read twice). The scale row of each
// token is chosen by target_token_mask (scale_gate.cuh).
// Outputs: `out` in the tensor dtype (skipped when null) and/or `out2` from that same rounded value under
// the consumer linears' input quantizer (amax at `out2_amax`): its e4m3 codes, or (NVFP4 = 1) its NVFP4
// fake quantization in the tensor dtype (QaLnEmit, ln_row.cuh).
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "ln_row.cuh"
#include "scale_gate.cuh"

struct LayerNormScaleParams {
  const void* x;
  void* out;
  void* out2;  // second output (or null): e4m3 codes, or NVFP4 values in T (NVFP4 instances)
  const void* scale;
  const unsigned char* mask;  // target_token_mask [L] or null
  const float* out2_amax;  // the second output's per-tensor amax (FP8 codes or NVFP4)
  const float* amax;  // norm-input quantizer (quant_mode != 0)
  qa_i64 scale_rs, B, L;
  int D;
  float eps;
  int quant_mode;
  int vec_flags;  // 1: x/out rows vector-aligned, 4: scale rows
};

template <class T, int MODE, int NV, int NVFP4 = 0>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, qa_ln_min_blocks<MODE, NV>())
layer_norm_scale_kernel(const LayerNormScaleParams p) {
  const qa_i64 row = blockIdx.x;
  const qa_i64 off = row * (qa_i64)p.D;
  const qa_i64 soff = qa_target_row(row, p.L, p.B, p.mask) * p.scale_rs;
  qa_ln_dispatch<MODE, NV>(p.D, p.vec_flags, 1 | 4, [&](auto fast) {
    constexpr bool FAST = decltype(fast)::value;
    const int vf = FAST ? (1 | 4) : p.vec_flags;
    const QaLnInput<T, QaLn<MODE>::CH> load(p.x, off, vf, p.amax, p.quant_mode);
    const QaLnEmit<T, MODE, false, NVFP4 != 0> emit(p.out, p.out2, p.out2_amax, off, vf, p.scale, soff);
    qa_ln_row<MODE, NV, FAST>(p.D, p.eps, load, load, emit);
  });
}
