// tanh_gate_residual: out = C(residual + tanh(gate) * x)   (Qwen-Image-2.1's FFN residual site)
// C: the identity, or (clip != 0, float16) the block's final clip(-65504, 65504).
// One block per row; each thread handles NV vectors of VEC elements (NV == 0: a strided loop, for
// very wide rows). Gate rows chosen per token by target_token_mask (scale_gate.cuh).
#include "common.cuh"
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

template <class T, int VEC>
__device__ __forceinline__ void qa_tanh_gate_residual_vec(
    const typename T::storage* r, const typename T::storage* xx, const typename T::storage* g,
    typename T::storage* o, bool vx, bool vg, bool clip) {
  typedef typename T::storage S;
  QaVec<S, VEC> ov = qa_tanh_gated_residual<T, VEC>(qa_load_raw<T, VEC>(r, vx), qa_load_raw<T, VEC>(xx, vx),
                                                    qa_load_raw<T, VEC>(g, vg));
  if (clip) qa_clip_f16_vec<T, VEC>(ov);
  qa_store_raw<T, VEC>(o, vx, ov);
}

template <class T, int VEC, int NV>
__global__ void __launch_bounds__(QA_TGR_THREADS) tanh_gate_residual_kernel(const TanhGateResidualParams p) {
  typedef typename T::storage S;
  const int D = p.D;
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_target_row(row, p.L, p.B, p.mask);
  const qa_i64 off = row * (qa_i64)D;
  const S* rr = reinterpret_cast<const S*>(p.residual) + off;
  const S* xr = reinterpret_cast<const S*>(p.x) + off;
  S* outr = reinterpret_cast<S*>(p.out) + off;
  const S* gr = reinterpret_cast<const S*>(p.gate) + prow * p.gate_rs;
  const bool vx = p.vec_flags & 1, vg = p.vec_flags & 8;
  const bool clip = p.clip != 0;
  const int nvec = D / VEC;
  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = threadIdx.x + k * QA_TGR_THREADS;
      if (c < nvec)
        qa_tanh_gate_residual_vec<T, VEC>(rr + c * VEC, xr + c * VEC, gr + c * VEC, outr + c * VEC, vx, vg, clip);
    }
  } else {
    for (int c = threadIdx.x; c < nvec; c += QA_TGR_THREADS)
      qa_tanh_gate_residual_vec<T, VEC>(rr + c * VEC, xr + c * VEC, gr + c * VEC, outr + c * VEC, vx, vg, clip);
  }
}
