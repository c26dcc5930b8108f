// bias_gate_residual: out = residual + gate * (x + bias)   (the FFN residual site)
// One block per row; each thread handles NV vectors of VEC elements (NV == 0: a strided loop, for
// very wide rows).
#include "common.cuh"
#include "residual_row.cuh"

#define QA_BGR_THREADS 128
// Minimum resident blocks per SM (register cap); 1 leaves the compiler free. Tuned on the H200
// by benchmarks/bench_ops.py --sweep.
#ifndef QA_BGR_MIN_BLOCKS
#define QA_BGR_MIN_BLOCKS 1
#endif

struct BiasGateResidualParams {
  const void* residual;
  const void* x;
  const void* bias;
  const void* gate;
  void* out;
  const void* index;
  qa_i64 gate_rs, B, L;
  int D;
  int index_kind;
  int vec_flags;  // 1: activations, 8: gate rows, 16: bias vector-aligned
};

template <class T, int VEC, int NV>
__global__ void __launch_bounds__(QA_BGR_THREADS, QA_BGR_MIN_BLOCKS)
bias_gate_residual_kernel(const BiasGateResidualParams p) {
  const qa_i64 row = blockIdx.x;
  const qa_i64 goff = qa_param_row(row, p.L, p.B, p.index, p.index_kind) * p.gate_rs;
  qa_with_bias(p.bias, [&](auto has_bias) {
    const QaResidualRow<T, QA_GATE_LINEAR, VEC, decltype(has_bias)::value> res(p.residual, p.x, p.bias, p.gate, p.out,
                                                                               row * (qa_i64)p.D, goff, p.vec_flags);
    qa_for_slots<QA_BGR_THREADS, NV>(p.D / VEC, [&](int rel) { res.step(rel); });
  });
}
