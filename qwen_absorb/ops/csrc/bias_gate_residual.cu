// bias_gate_residual: out = residual + gate * (x + bias)   (the FFN residual site)
// One block per row; each thread handles NV vectors of VEC elements (NV == 0: a strided loop, for
// very wide rows).
#include "common.cuh"

#define QA_BGR_THREADS 128
// Minimum resident blocks per SM (register cap); 1 leaves the compiler free. Tuned on the H200
// by benchmarks/bench_ops.py --sweep.
#ifndef QA_BGR_MIN_BLOCKS
#define QA_BGR_MIN_BLOCKS 1
#endif

template <class T, int VEC>
__device__ __forceinline__ void qa_bias_gate_residual_vec(
    const typename T::storage* r, const typename T::storage* xx, const typename T::storage* b,
    const typename T::storage* g, typename T::storage* o, bool vx, bool vb, bool vg) {
  typedef typename T::storage S;
  QaVec<S, VEC> bv = {};
  if (b != nullptr) bv = qa_load_raw<T, VEC>(b, vb);
  const QaVec<S, VEC> ov = qa_gated_residual<T, VEC>(qa_load_raw<T, VEC>(r, vx), qa_load_raw<T, VEC>(xx, vx),
                                                     qa_load_raw<T, VEC>(g, vg), bv, b != nullptr);
  qa_store_raw<T, VEC>(o, vx, ov);
}

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
  typedef typename T::storage S;
  const int D = p.D;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, p.L, p.B, p.index, p.index_kind);
  const qa_i64 off = row * (qa_i64)D;
  const S* rr = reinterpret_cast<const S*>(p.residual) + off;
  const S* xr = reinterpret_cast<const S*>(p.x) + off;
  const S* bias = reinterpret_cast<const S*>(p.bias);
  S* outr = reinterpret_cast<S*>(p.out) + off;
  const S* gr = reinterpret_cast<const S*>(p.gate) + prow * p.gate_rs;
  const bool vx = p.vec_flags & 1, vg = p.vec_flags & 8, vb = p.vec_flags & 16;
  const int nvec = D / VEC;
  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = threadIdx.x + k * QA_BGR_THREADS;
      if (c < nvec)
        qa_bias_gate_residual_vec<T, VEC>(rr + c * VEC, xr + c * VEC, bias ? bias + c * VEC : nullptr,
                                          gr + c * VEC, outr + c * VEC, vx, vb, vg);
    }
  } else {
    for (int c = threadIdx.x; c < nvec; c += QA_BGR_THREADS)
      qa_bias_gate_residual_vec<T, VEC>(rr + c * VEC, xr + c * VEC, bias ? bias + c * VEC : nullptr,
                                        gr + c * VEC, outr + c * VEC, vx, vb, vg);
  }
}
