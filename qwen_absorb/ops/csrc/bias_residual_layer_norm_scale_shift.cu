// bias_residual_layer_norm_scale_shift   (the norm2 site, after attention)
//   new_residual = residual + gate * (x + bias)
//   modulated    = LayerNorm(Q(new_residual)) * (1 + scale) + shift
// Q is identity (quant_mode 0) or ModelOpt's FP8 per-tensor fake quantization (1, 2); the residual
// written out is never quantized. Layout and variants as in layer_norm_scale_shift.cu.
#include "common.cuh"
#include "layer_norm.cuh"

template <class T, int CH>
__device__ __forceinline__ void qa_residual_chunk(
    const typename T::storage* r, const typename T::storage* xx, const typename T::storage* b,
    const typename T::storage* g, bool vx, bool vb, bool vg, float (&h)[CH]) {
  float rv[CH], xv[CH], gv[CH];
  qa_load<T, CH>(r, vx, rv);
  qa_load<T, CH>(xx, vx, xv);
  qa_load<T, CH>(g, vg, gv);
  if (b != nullptr) {
    float bv[CH];
    qa_load<T, CH>(b, vb, bv);
#pragma unroll
    for (int i = 0; i < CH; ++i) xv[i] = qa_add<T>(xv[i], bv[i]);
  }
#pragma unroll
  for (int i = 0; i < CH; ++i) h[i] = qa_add<T>(rv[i], qa_mul<T>(gv[i], xv[i]));
}

template <class T, int CH, int NV>
__global__ void __launch_bounds__(QA_LN_THREADS) bias_residual_layer_norm_scale_shift_kernel(
    const typename T::storage* __restrict__ residual, const typename T::storage* __restrict__ x,
    const typename T::storage* __restrict__ bias,
    const typename T::storage* __restrict__ gate, qa_i64 gate_rs,
    const typename T::storage* __restrict__ shift, qa_i64 shift_rs,
    const typename T::storage* __restrict__ scale, qa_i64 scale_rs,
    typename T::storage* __restrict__ new_residual, typename T::storage* __restrict__ out,
    const void* __restrict__ index, int index_kind, qa_i64 B, qa_i64 L, int D, float eps,
    const float* __restrict__ amax, int quant_mode, int vec_flags) {
  typedef typename T::storage S;
  __shared__ float smem[2 * QA_LN_WARPS];
  const qa_i64 row = blockIdx.x;
  const qa_i64 prow = qa_param_row(row, L, B, index, index_kind);
  const qa_i64 off = row * (qa_i64)D;
  const S* rr = residual + off;
  const S* xr = x + off;
  S* hr = new_residual + off;
  S* outr = out + off;
  const S* gr = gate + prow * gate_rs;
  const S* shr = shift + prow * shift_rs;
  const S* scr = scale + prow * scale_rs;
  const bool vx = vec_flags & 1, vsh = vec_flags & 2, vsc = vec_flags & 4, vg = vec_flags & 8,
             vb = vec_flags & 16;
  const int nchunks = D / CH;
  const int tid = threadIdx.x;
  float qscale = 1.f, qinv = 1.f;
  if (quant_mode != 0) qa_fp8_scales(amax, quant_mode, qscale, qinv);

  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];  // Q(new_residual), the LayerNorm input
  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * QA_LN_THREADS;
      if (c < nchunks) {
        qa_residual_chunk<T, CH>(rr + c * CH, xr + c * CH, bias ? bias + c * CH : nullptr,
                                 gr + c * CH, vx, vb, vg, v[k]);
        qa_store<T, CH>(hr + c * CH, vx, v[k]);
        if (quant_mode != 0) {
#pragma unroll
          for (int i = 0; i < CH; ++i) v[k][i] = qa_fp8_fake_quant<T>(v[k][i], qscale, qinv);
        }
      }
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
      float h[CH];
      qa_residual_chunk<T, CH>(rr + c * CH, xr + c * CH, bias ? bias + c * CH : nullptr,
                               gr + c * CH, vx, vb, vg, h);
      qa_store<T, CH>(hr + c * CH, vx, h);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const float q = quant_mode != 0 ? qa_fp8_fake_quant<T>(h[i], qscale, qinv) : h[i];
        w = qa_welford_add(w, q);
      }
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
    // Each thread re-reads the new_residual chunks it wrote itself (program order suffices).
    for (int c = tid; c < nchunks; c += QA_LN_THREADS) {
      float h[CH], sh[CH], sc[CH], o[CH];
      qa_load<T, CH>(hr + c * CH, vx, h);
      qa_load<T, CH>(shr + c * CH, vsh, sh);
      qa_load<T, CH>(scr + c * CH, vsc, sc);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const float q = quant_mode != 0 ? qa_fp8_fake_quant<T>(h[i], qscale, qinv) : h[i];
        o[i] = qa_scale_shift<T>(qa_ln_out<T>(q, mv.x, rstd), sc[i], sh[i]);
      }
      qa_store<T, CH>(outr + c * CH, vx, o);
    }
  }
}
