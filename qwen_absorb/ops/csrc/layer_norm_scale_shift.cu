// layer_norm_scale_shift: out = LayerNorm(x) * (1 + scale) + shift   (the norm1 site)
//
// One block per row (QaLn<MODE>::THREADS threads, PyTorch's LayerNorm layout, see layer_norm.cuh).
// NV > 0: each thread keeps its NV slots of x in registers between the statistics and the output
// (x is read once). NV == 0: streaming variant for very wide rows, which reads x twice (the second
// read mostly hits L2).
#include "common.cuh"
#include "layer_norm.cuh"

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, QaLn<MODE>::MIN_BLOCKS) layer_norm_scale_shift_kernel(
    const typename T::storage* __restrict__ x, typename T::storage* __restrict__ out,
    const typename T::storage* __restrict__ shift, qa_i64 shift_rs,
    const typename T::storage* __restrict__ scale, qa_i64 scale_rs,
    const void* __restrict__ index, int index_kind, qa_i64 B, qa_i64 L, int D, float eps,
    int vec_flags) {
  typedef typename T::storage S;
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  __shared__ float smem[48];
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, L, B, index, index_kind);
  const S* xr = x + row * (qa_i64)D;
  S* outr = out + row * (qa_i64)D;
  const S* shr = shift + prow * shift_rs;
  const S* scr = scale + prow * scale_rs;
  const bool vx = vec_flags & 1, vsh = vec_flags & 2, vsc = vec_flags & 4;
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) qa_load<T, CH>(xr + c * CH, vx, v[k]);
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (tid + k * TH < nslots) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          const int n = k * CH + i + 1;  // slots are filled in order: the count is a constant
          qa_welford_add<MODE>(w, v[k][i], (float)n, 1.0f / (float)n);
        }
      }
    }
  } else {
    int n = 0;
    for (int c = tid; c < nslots; c += TH) {
      float t[CH];
      qa_load<T, CH>(xr + c * CH, vx, t);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, t[i], (float)n, __frcp_rn((float)n));
      }
    }
  }
  const float2 mr = qa_row_mean_rstd<MODE>(w, D, eps, smem);

  // NV > 0: slot k once (values from registers); NV == 0: a strided loop re-reading x.
#pragma unroll
  for (int k = 0; k < (NV > 0 ? NV : 1); ++k) {
    for (int c = tid + k * TH; c < nslots; c += (NV > 0 ? nslots : TH)) {
      float t[CH], sh[CH], sc[CH];
      if (NV > 0) {
#pragma unroll
        for (int i = 0; i < CH; ++i) t[i] = v[k][i];
      } else {
        qa_load<T, CH>(xr + c * CH, vx, t);
      }
      qa_load<T, CH>(shr + c * CH, vsh, sh);
      qa_load<T, CH>(scr + c * CH, vsc, sc);
      QaVec<S, CH> o;
#pragma unroll
      for (int i = 0; i < CH; ++i)
        o.v[i] = qa_scale_shift_store<T>(qa_ln_out<MODE, T>(t[i], mr.x, mr.y), sc[i], sh[i]);
      qa_store_raw<T, CH>(outr + c * CH, vx, o);
    }
  }
}
