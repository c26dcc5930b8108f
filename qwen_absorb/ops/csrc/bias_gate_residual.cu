// bias_gate_residual: out = residual + gate * (x + bias)   (the FFN residual site)
// Each block handles R consecutive rows; each thread NV vectors of VEC elements per row, all of a
// thread's loads issued before the first use (NV == 0: a loop, for very wide rows).
#include "common.cuh"

#define QA_BGR_THREADS 128

template <class T, int VEC>
__device__ __forceinline__ QaVec<typename T::storage, VEC> qa_bias_gate_residual_vec(
    const QaVec<typename T::storage, VEC>& r, const QaVec<typename T::storage, VEC>& xx,
    const QaVec<typename T::storage, VEC>& g, const QaVec<typename T::storage, VEC>& b, bool has_bias) {
  QaVec<typename T::storage, VEC> o;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    float y = T::load(xx.v[i]);
    if (has_bias) y = qa_add<T>(y, T::load(b.v[i]));
    o.v[i] = T::store(__fadd_rn(T::load(r.v[i]), qa_mul<T>(T::load(g.v[i]), y)));
  }
  return o;
}

template <class T, int VEC, int NV, int R>
__global__ void __launch_bounds__(QA_BGR_THREADS) bias_gate_residual_kernel(
    const typename T::storage* __restrict__ residual, const typename T::storage* __restrict__ x,
    const typename T::storage* __restrict__ bias,
    const typename T::storage* __restrict__ gate, qa_i64 gate_rs,
    typename T::storage* __restrict__ out,
    const void* __restrict__ index, int index_kind, qa_i64 B, qa_i64 L, int D, int vec_flags) {
  typedef typename T::storage S;
  typedef QaVec<S, VEC> V;
  const qa_i64 rows = B * L;
  const bool vx = vec_flags & 1, vg = vec_flags & 8, vb = vec_flags & 16;
  const bool has_bias = bias != nullptr;
  const int nvec = D / VEC;
  const int tid = threadIdx.x;
  V zero;
#pragma unroll
  for (int i = 0; i < VEC; ++i) zero.v[i] = 0;

  if (NV > 0) {
    V rv[R][NV > 0 ? NV : 1], xv[R][NV > 0 ? NV : 1], gv[R][NV > 0 ? NV : 1], bv[NV > 0 ? NV : 1];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * QA_BGR_THREADS;
      bv[k] = (has_bias && c < nvec) ? qa_load_raw<T, VEC>(bias + c * VEC, vb) : zero;
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const qa_i64 row = (qa_i64)blockIdx.x * R + j;
      if (row < rows) {
        const qa_i64 prow = qa_param_row(row, L, B, index, index_kind);
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int c = tid + k * QA_BGR_THREADS;
          if (c < nvec) {
            rv[j][k] = qa_load_raw<T, VEC>(residual + row * D + c * VEC, vx);
            xv[j][k] = qa_load_raw<T, VEC>(x + row * D + c * VEC, vx);
            gv[j][k] = qa_load_raw<T, VEC>(gate + prow * gate_rs + c * VEC, vg);
          }
        }
      }
    }
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const qa_i64 row = (qa_i64)blockIdx.x * R + j;
      if (row < rows) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
          const int c = tid + k * QA_BGR_THREADS;
          if (c < nvec)
            qa_store_raw<T, VEC>(out + row * D + c * VEC, vx,
                                 qa_bias_gate_residual_vec<T, VEC>(rv[j][k], xv[j][k], gv[j][k], bv[k], has_bias));
        }
      }
    }
  } else {
    for (int j = 0; j < R; ++j) {
      const qa_i64 row = (qa_i64)blockIdx.x * R + j;
      if (row >= rows) break;
      const qa_i64 prow = qa_param_row(row, L, B, index, index_kind);
      for (int c = tid; c < nvec; c += QA_BGR_THREADS) {
        const V b = has_bias ? qa_load_raw<T, VEC>(bias + c * VEC, vb) : zero;
        qa_store_raw<T, VEC>(out + row * D + c * VEC, vx,
                             qa_bias_gate_residual_vec<T, VEC>(
                                 qa_load_raw<T, VEC>(residual + row * D + c * VEC, vx),
                                 qa_load_raw<T, VEC>(x + row * D + c * VEC, vx),
                                 qa_load_raw<T, VEC>(gate + prow * gate_rs + c * VEC, vg), b, has_bias));
      }
    }
  }
}
