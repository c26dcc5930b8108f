// layer_norm_scale_shift: out = LayerNorm(x) * (1 + scale) + shift   (the norm1 site)
//
// One block of QA_LN_THREADS threads per row. NV > 0: each thread keeps its NV chunks of CH
// elements in registers between the statistics and the output (one read of x). NV == 0: streaming
// variant for very wide rows, which reads x twice (the second read mostly hits L2).
#include "common.cuh"
#include "layer_norm.cuh"

template <class T, int CH, int NV>
__global__ void __launch_bounds__(QA_LN_THREADS) layer_norm_scale_shift_kernel(
    const typename T::storage* __restrict__ x, typename T::storage* __restrict__ out,
    const typename T::storage* __restrict__ shift, qa_i64 shift_rs,
    const typename T::storage* __restrict__ scale, qa_i64 scale_rs,
    const void* __restrict__ index, int index_kind, qa_i64 B, qa_i64 L, int D, float eps,
    int vec_flags) {
  typedef typename T::storage S;
  __shared__ float smem[2 * QA_LN_WARPS];
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, L, B, index, index_kind);
  const S* xr = x + row * (qa_i64)D;
  S* outr = out + row * (qa_i64)D;
  const S* shr = shift + prow * shift_rs;
  const S* scr = scale + prow * scale_rs;
  const bool vx = vec_flags & 1, vsh = vec_flags & 2, vsc = vec_flags & 4;
  const int nchunks = D / CH;
  const int tid = threadIdx.x;

  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];
  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * QA_LN_THREADS;
      if (c < nchunks) qa_load<T, CH>(xr + c * CH, vx, v[k]);
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * QA_LN_THREADS;
      if (c < nchunks) {
#pragma unroll
        for (int i = 0; i < CH; ++i) w = qa_welford_add(w, v[k][i]);
      }
    }
  } else {
    for (int c = tid; c < nchunks; c += QA_LN_THREADS) {
      float t[CH];
      qa_load<T, CH>(xr + c * CH, vx, t);
#pragma unroll
      for (int i = 0; i < CH; ++i) w = qa_welford_add(w, t[i]);
    }
  }
  const float2 mv = qa_row_mean_var(w, D, smem);
  const float rstd = rsqrtf(__fadd_rn(mv.y, eps));

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * QA_LN_THREADS;
      if (c < nchunks) {
        float sh[CH], sc[CH], o[CH];
        qa_load<T, CH>(shr + c * CH, vsh, sh);
        qa_load<T, CH>(scr + c * CH, vsc, sc);
#pragma unroll
        for (int i = 0; i < CH; ++i)
          o[i] = qa_scale_shift<T>(qa_ln_out<T>(v[k][i], mv.x, rstd), sc[i], sh[i]);
        qa_store<T, CH>(outr + c * CH, vx, o);
      }
    }
  } else {
    for (int c = tid; c < nchunks; c += QA_LN_THREADS) {
      float t[CH], sh[CH], sc[CH], o[CH];
      qa_load<T, CH>(xr + c * CH, vx, t);
      qa_load<T, CH>(shr + c * CH, vsh, sh);
      qa_load<T, CH>(scr + c * CH, vsc, sc);
#pragma unroll
      for (int i = 0; i < CH; ++i)
        o[i] = qa_scale_shift<T>(qa_ln_out<T>(t[i], mv.x, rstd), sc[i], sh[i]);
      qa_store<T, CH>(outr + c * CH, vx, o);
    }
  }
}
