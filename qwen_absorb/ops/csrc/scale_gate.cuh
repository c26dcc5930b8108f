// Qwen-Image-2.1 modulation, shared by its fused ops: tanh-gated residuals and the per-token choice
// of a modulation row (its scale-only LayerNorm modulation is qa_modulated<..., SHIFT = false>,
// layer_norm.cuh).
//
// diffusers' QwenImage21TransformerBlock computes, each op in the tensor dtype T (a rounding each):
//   modulated = LayerNorm(x) * (1 + scale)           (no shift)
//   residual  = residual + tanh(gate) * out
// with scale/gate rows chosen per token by _select_modulation_rows. The helpers below perform the
// same operations with the same roundings (numerics rule of common.cuh; packed pairs are exact by the
// argument given there: a product of two 16-bit values and a sum each rounded once).
#pragma once
#include "common.cuh"

// ---- per-token modulation row --------------------------------------------------------------
// Without a mask the parameters have B rows and token (b, l) uses row b. With diffusers'
// target_token_mask ([L] bool, one for the whole batch) they have B + 1 rows: a target-image token
// (mask[l] true) uses its sample's row b, every other token the trailing row B (t = 0), as
// torch.where(mask.view(1, -1, 1), params[:-1, None], params[-1:][None]) selects them.
__device__ __forceinline__ qa_i64 qa_target_row(qa_i64 row, qa_i64 L, qa_i64 B, const unsigned char* mask) {
  const qa_i64 b = row / L;
  if (mask == nullptr) return b;
  return mask[row - b * L] != 0 ? b : B;
}

// ---- fp16 clip ------------------------------------------------------------------------------
// hidden_states.clip(-65504, 65504) of a float16 block output (torch.clamp: NaN stays NaN).
__device__ __forceinline__ float qa_clip_f16(float v) {
  if (v != v) return v;
  return fminf(fmaxf(v, -65504.f), 65504.f);
}

template <class T, int N>
__device__ __forceinline__ void qa_clip_f16_vec(QaVec<typename T::storage, N>& o) {
#pragma unroll
  for (int i = 0; i < N; ++i) o.v[i] = T::store(qa_clip_f16(T::load(o.v[i])));
}

// ---- residual + tanh(gate) * x ----------------------------------------------------------------
// tanh in fp32 (tanhf: PyTorch's CUDA tanh computes ::tanh(float) of the widened value), rounded to
// T; the product rounded to T; the sum rounded to T.
// For |x| < 2^-30, tanh(x) rounds to x in any correct implementation (x^3/3 is 2^-60 of x). CuPy
// compiles with -ftz=true, so fp32 subnormal inputs and results flush to zero in every kernel (seen on
// the H200; PyTorch keeps them): a documented limitation, not reproduced here.
__device__ __forceinline__ float qa_tanhf(float x) { return fabsf(x) < 0x1p-30f ? x : tanhf(x); }

template <class T, int N>
__device__ __forceinline__ QaVec<typename T::storage, N> qa_tanh_gated_residual(
    const QaVec<typename T::storage, N>& r, const QaVec<typename T::storage, N>& x,
    const QaVec<typename T::storage, N>& g) {
  QaVec<typename T::storage, N> o;
  if constexpr (QA_LN_PACKED && T::kPacked && N % 2 == 0) {
#pragma unroll
    for (int p = 0; p < N / 2; ++p) {
      const unsigned tg = T::pack2(qa_tanhf(T::load(g.v[2 * p])), qa_tanhf(T::load(g.v[2 * p + 1])));
      qa_set_pair(o, p, T::add2(qa_pair(r, p), T::mul2(tg, qa_pair(x, p))));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float tg = qa_round<T>(qa_tanhf(T::load(g.v[i])));
      o.v[i] = T::store(__fadd_rn(T::load(r.v[i]), qa_round<T>(__fmul_rn(tg, T::load(x.v[i])))));
    }
  }
  return o;
}
