// The residual step of one block's row, shared by the residual kernels and the first step of the
// norm2 kernels, for both gates of the diffusers blocks:
//   QA_GATE_LINEAR (Qwen-Image):     new_residual = residual + gate * (x + bias)  (qa_gated_residual;
//                                    BIAS false: no bias)
//   QA_GATE_TANH   (Qwen-Image-2.1): new_residual = C(residual + tanh(gate) * x)  (qa_tanh_gated_residual;
//                                    C: the fp16 clip when `clip`)
// each op rounded like eager, written to `out`. Rows at element offset `off`, the gate row at `goff`.
// vec_flags (checked on the host): 1 residual/x/out rows vector-aligned, 8 the gate row, 16 the bias.
#pragma once
#include "common.cuh"
#include "scale_gate.cuh"

#define QA_GATE_LINEAR 0
#define QA_GATE_TANH 1

template <class T, int GATE, int N, bool BIAS = false>
struct QaResidualRow {
  typedef typename T::storage S;
  const S* r;
  const S* x;
  const S* b;
  const S* g;
  S* out;
  bool vx, vg, vb, clip;

  // Pointers to this thread's first slot (N elements at threadIdx.x * N of the row).
  __device__ __forceinline__ QaResidualRow(const void* residual, const void* x_, const void* bias, const void* gate,
                                           void* out_, qa_i64 off, qa_i64 goff, int vec_flags, int clip_ = 0)
      : r(reinterpret_cast<const S*>(residual) + off + threadIdx.x * N),
        x(reinterpret_cast<const S*>(x_) + off + threadIdx.x * N),
        b(BIAS ? reinterpret_cast<const S*>(bias) + threadIdx.x * N : nullptr),
        g(reinterpret_cast<const S*>(gate) + goff + threadIdx.x * N),
        out(reinterpret_cast<S*>(out_) + off + threadIdx.x * N), vx(vec_flags & 1), vg(vec_flags & 8),
        vb(vec_flags & 16), clip(clip_ != 0) {}

  // The thread's slot `rel` (its distance in slots from the first): computes, writes and returns it.
  __device__ __forceinline__ QaVec<S, N> step(int rel) const {
    const int e = rel * N;
    QaVec<S, N> o;
    if constexpr (GATE == QA_GATE_TANH) {
      o = qa_tanh_gated_residual<T, N>(qa_load_raw<T, N>(r + e, vx), qa_load_raw<T, N>(x + e, vx),
                                       qa_load_raw<T, N>(g + e, vg));
      if (clip) qa_clip_f16_vec<T, N>(o);
    } else {
      QaVec<S, N> bv = {};
      if constexpr (BIAS) bv = qa_load_raw<T, N>(b + e, vb);
      o = qa_gated_residual<T, N>(qa_load_raw<T, N>(r + e, vx), qa_load_raw<T, N>(x + e, vx),
                                  qa_load_raw<T, N>(g + e, vg), bv, BIAS);
    }
    qa_store_raw<T, N>(out + e, vx, o);
    return o;
  }
};

// f(QaBool<bias != null>{}): the kernels' one branch on the bias, taken once per block so that the
// per-slot code is compiled without it.
template <class F>
__device__ __forceinline__ void qa_with_bias(const void* bias, F&& f) {
  if (bias != nullptr) {
    f(QaBool<true>{});
  } else {
    f(QaBool<false>{});
  }
}
