// tanh_gate_residual: out = C(residual + tanh(gate) * x)   (Qwen-Image-2.1's FFN residual site)
// C: the identity, or (clip != 0, float16) the block's final clip(-65504, 65504).
// One block per row; each thread handles NV vectors of VEC elements (NV == 0: a strided loop, for
// very wide rows). Gate rows chosen per token by target_token_mask (scale_gate.cuh).
#include "common.cuh"
#include "residual_row.cuh"
#include "scale_gate.cuh"

#define QA_TGR_THREADS 128

struct TanhGateResidualParams {
  const void* residual;
  const void* x;
  const void* gate;
  void* out;
  const unsigned char* mask;  // target_token_mask [L] or null
  qa_i64 gate_rs, B, L;
  int D;
  int clip;
  int vec_flags;  // 1: activations, 8: gate rows vector-aligned
};

template <class T, int VEC, int NV>
__global__ void __launch_bounds__(QA_TGR_THREADS) tanh_gate_residual_kernel(const TanhGateResidualParams p) {
  const qa_i64 row = blockIdx.x;
  const QaResidualRow<T, QA_GATE_TANH, VEC> res(p.residual, p.x, nullptr, p.gate, p.out, row * (qa_i64)p.D,
                                           qa_target_row(row, p.L, p.B, p.mask) * p.gate_rs, p.vec_flags, p.clip);
  qa_for_slots<QA_TGR_THREADS, NV>(p.D / VEC, [&](int rel) { res.step(rel); });
}
