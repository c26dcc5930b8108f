// layer_norm_scale_shift: out = LayerNorm(Q(x)) * (1 + scale) + shift   (the norm1 site)
//
// One block per row in PyTorch's LayerNorm layout (layer_norm.cuh), driven by qa_ln_row (ln_row.cuh).
// NV > 0: each thread keeps its NV slots of x in registers between the statistics and the output
// (x is read once). NV == 0: streaming variant for very wide rows, which reads x twice (the second
// read mostly hits L2).
// Q: the identity, or ModelOpt's FP8 per-tensor fake quantization of the norm's input (quant_mode
// 1/2 with amax at `amax`, QuantLayerNorm's input quantizer), applied as x is loaded.
// Outputs: `out` in the tensor dtype (skipped when null) and/or `out2`, computed from that same rounded
// value under the consumer linears' input quantizer (amax at `out2_amax`): its e4m3 codes, the FP8 input of
// to_q/to_k/to_v when they run as real FP8 GEMMs; or (NVFP4 = 1) its NVFP4 fake quantization in the tensor
// dtype, their input when they run as NVFP4 fake-quant linears (QaLnEmit, ln_row.cuh).
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "ln_row.cuh"

struct LayerNormScaleShiftParams {
  const void* x;
  void* out;
  void* out2;  // second output (or null): e4m3 codes, or NVFP4 values in T (NVFP4 instances)
  const void* shift;
  const void* scale;
  const void* index;
  const float* out2_amax;  // the second output's per-tensor amax (FP8 codes or NVFP4)
  const float* amax;
  qa_i64 shift_rs, scale_rs, B, L;
  int D;
  float eps;
  int index_kind;
  int quant_mode;
  int vec_flags;  // 1: x/out rows vector-aligned, 2: shift rows, 4: scale rows
};

template <class T, int MODE, int NV, int NVFP4 = 0>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, qa_ln_min_blocks<MODE, NV>())
layer_norm_scale_shift_kernel(const LayerNormScaleShiftParams p) {
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, p.L, p.B, p.index, p.index_kind);
  const qa_i64 off = row * (qa_i64)p.D;
  qa_ln_dispatch<MODE, NV>(p.D, p.vec_flags, 1 | 2 | 4, [&](auto fast) {
    constexpr bool FAST = decltype(fast)::value;
    const int vf = FAST ? (1 | 2 | 4) : p.vec_flags;
    const QaLnInput<T, QaLn<MODE>::CH> load(p.x, off, vf, p.amax, p.quant_mode);
    const QaLnEmit<T, MODE, true, NVFP4 != 0> emit(p.out, p.out2, p.out2_amax, off, vf, p.scale, prow * p.scale_rs,
                                                     p.shift, prow * p.shift_rs);
    qa_ln_row<MODE, NV, FAST>(p.D, p.eps, load, load, emit);
  });
}
