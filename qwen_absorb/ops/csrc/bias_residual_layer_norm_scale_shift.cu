// bias_residual_layer_norm_scale_shift   (the norm2 site, after attention)
//   new_residual = residual + gate * (x + bias)
//   modulated    = LayerNorm(Q(new_residual)) * (1 + scale) + shift
// Q is identity (quant_mode 0) or ModelOpt's FP8 per-tensor fake quantization (1, 2); the residual
// written out is never quantized. Layout and variants as in layer_norm_scale_shift.cu.
#include "common.cuh"
#include "layer_norm.cuh"

// One slot of new_residual (rounded like eager: x + bias, gate * that, residual + that).
template <class T, int CH>
__device__ __forceinline__ QaVec<typename T::storage, CH> qa_residual_slot(
    const QaVec<typename T::storage, CH>& r, const QaVec<typename T::storage, CH>& xx,
    const QaVec<typename T::storage, CH>& g, const QaVec<typename T::storage, CH>& b, bool has_bias) {
  QaVec<typename T::storage, CH> h;
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    float y = T::load(xx.v[i]);
    if (has_bias) y = qa_add<T>(y, T::load(b.v[i]));
    h.v[i] = T::store(__fadd_rn(T::load(r.v[i]), qa_mul<T>(T::load(g.v[i]), y)));
  }
  return h;
}

template <class T, int CH>
__device__ __forceinline__ QaVec<typename T::storage, CH> qa_quant_slot(
    const QaVec<typename T::storage, CH>& h, int quant_mode, float qscale, float qinv) {
  if (quant_mode == 0) return h;
  QaVec<typename T::storage, CH> q;
#pragma unroll
  for (int i = 0; i < CH; ++i) q.v[i] = T::store(qa_fp8_fake_quant<T>(T::load(h.v[i]), qscale, qinv));
  return q;
}

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(QaLn<MODE>::THREADS, QaLn<MODE>::MIN_BLOCKS) bias_residual_layer_norm_scale_shift_kernel(
    const typename T::storage* __restrict__ residual, const typename T::storage* __restrict__ x,
    const typename T::storage* __restrict__ bias,
    const typename T::storage* __restrict__ gate, qa_i64 gate_rs,
    const typename T::storage* __restrict__ shift, qa_i64 shift_rs,
    const typename T::storage* __restrict__ scale, qa_i64 scale_rs,
    typename T::storage* __restrict__ new_residual, typename T::storage* __restrict__ out,
    const void* __restrict__ index, int index_kind, qa_i64 B, qa_i64 L, int D, float eps,
    const float* __restrict__ amax, int quant_mode, int vec_flags) {
  typedef typename T::storage S;
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  typedef QaVec<S, CH> V;
  __shared__ float smem[48];
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
  const bool has_bias = bias != nullptr;
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  float qscale = 1.f, qinv = 1.f;
  if (quant_mode != 0) qa_fp8_scales(amax, quant_mode, qscale, qinv);
  QaWelford w = {0.f, 0.f, 0.f};
  V zero;
#pragma unroll
  for (int i = 0; i < CH; ++i) zero.v[i] = 0;

  if (NV > 0) {
    V qv[NV > 0 ? NV : 1], shv[NV > 0 ? NV : 1], scv[NV > 0 ? NV : 1];
    {
      V rv[NV > 0 ? NV : 1], xv[NV > 0 ? NV : 1], gv[NV > 0 ? NV : 1], bv[NV > 0 ? NV : 1];
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = tid + k * TH;
        if (c < nslots) {
          rv[k] = qa_load_raw<T, CH>(rr + c * CH, vx);
          xv[k] = qa_load_raw<T, CH>(xr + c * CH, vx);
          gv[k] = qa_load_raw<T, CH>(gr + c * CH, vg);
          bv[k] = has_bias ? qa_load_raw<T, CH>(bias + c * CH, vb) : zero;
        }
      }
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = tid + k * TH;
        if (c < nslots) {
          const V h = qa_residual_slot<T, CH>(rv[k], xv[k], gv[k], bv[k], has_bias);
          qa_store_raw<T, CH>(hr + c * CH, vx, h);
          qv[k] = qa_quant_slot<T, CH>(h, quant_mode, qscale, qinv);
        }
      }
    }
#if QA_LN_PREFETCH
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) {
        shv[k] = qa_load_raw<T, CH>(shr + c * CH, vsh);
        scv[k] = qa_load_raw<T, CH>(scr + c * CH, vsc);
      }
    }
#endif
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (tid + k * TH < nslots) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          const int n = k * CH + i + 1;
          qa_welford_add<MODE>(w, T::load(qv[k].v[i]), (float)n, 1.0f / (float)n);
        }
      }
    }
    const float2 mr = qa_row_mean_rstd<MODE>(w, D, eps, smem);
#if !QA_LN_PREFETCH
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) {
        shv[k] = qa_load_raw<T, CH>(shr + c * CH, vsh);
        scv[k] = qa_load_raw<T, CH>(scr + c * CH, vsc);
      }
    }
#endif
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) {
        V o;
#pragma unroll
        for (int i = 0; i < CH; ++i)
          o.v[i] = qa_scale_shift_store<T>(qa_ln_out<MODE, T>(T::load(qv[k].v[i]), mr.x, mr.y),
                                           T::load(scv[k].v[i]), T::load(shv[k].v[i]));
        qa_store_raw<T, CH>(outr + c * CH, vx, o);
      }
    }
  } else {
    int n = 0;
    for (int c = tid; c < nslots; c += TH) {
      const V h = qa_residual_slot<T, CH>(
          qa_load_raw<T, CH>(rr + c * CH, vx), qa_load_raw<T, CH>(xr + c * CH, vx),
          qa_load_raw<T, CH>(gr + c * CH, vg), has_bias ? qa_load_raw<T, CH>(bias + c * CH, vb) : zero,
          has_bias);
      qa_store_raw<T, CH>(hr + c * CH, vx, h);
      const V q = qa_quant_slot<T, CH>(h, quant_mode, qscale, qinv);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, T::load(q.v[i]), (float)n, __frcp_rn((float)n));
      }
    }
    const float2 mr = qa_row_mean_rstd<MODE>(w, D, eps, smem);
    // Each thread re-reads the new_residual slots it wrote itself (program order suffices).
    for (int c = tid; c < nslots; c += TH) {
      const V q = qa_quant_slot<T, CH>(qa_load_raw<T, CH>(hr + c * CH, vx), quant_mode, qscale, qinv);
      const V sh = qa_load_raw<T, CH>(shr + c * CH, vsh);
      const V sc = qa_load_raw<T, CH>(scr + c * CH, vsc);
      V o;
#pragma unroll
      for (int i = 0; i < CH; ++i)
        o.v[i] = qa_scale_shift_store<T>(qa_ln_out<MODE, T>(T::load(q.v[i]), mr.x, mr.y),
                                         T::load(sc.v[i]), T::load(sh.v[i]));
      qa_store_raw<T, CH>(outr + c * CH, vx, o);
    }
  }
}
