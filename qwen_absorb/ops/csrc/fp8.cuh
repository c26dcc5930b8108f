// FP8 e4m3 (fn) helpers: ModelOpt's per-tensor fake quantization and FP8 output emission.
//
// Scales follow ModelOpt's CUDA extension (fake_e4m3fy): scale = 448 / amax (fp32 division,
// amax <= 2^-24 counts as 1), codes = e4m3(x * scale) rounded to nearest even and saturated to
// +-448. An FP8-emitting op writes exactly those codes, so they equal the codes inside ModelOpt's
// fake quantization of the same bf16 value; the GEMM dequantizes them with amax / 448.
#pragma once
#include "common.cuh"

// ---- FP8 e4m3 per-tensor fake quantization (ModelOpt's QuantLayerNorm input quantizer) --------
// Round a float to the nearest e4m3fn value (ties to even), saturating to +-448; NaN stays NaN.
// Exact in fp32: every step is a clamp, a multiplication by a power of two, or rintf.
__device__ __forceinline__ float qa_pow2(int k) { return __int_as_float((k + 127) << 23); }

// Hopper/Ada (sm_89+) convert in hardware: cvt.rn.satfinite rounds to nearest even and saturates
// to +-448 exactly like the arithmetic below (one instruction for two values instead of ~15 each;
// the LayerNorm kernels are bound by instruction issue). QA_FP8_HW_CVT=0 forces the arithmetic.
#ifndef QA_FP8_HW_CVT
#define QA_FP8_HW_CVT 1
#endif
#if QA_FP8_HW_CVT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define QA_HW_E4M3 1
__device__ __forceinline__ unsigned char qa_hw_e4m3(float v) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(0.f), "f"(v));  // v -> low byte
  return (unsigned char)(r & 0xff);
}
__device__ __forceinline__ float qa_hw_e4m3_value(unsigned char b) {
  unsigned int h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)b));  // low byte -> low half
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h2 & 0xffffu)));
  return f;
}
#else
#define QA_HW_E4M3 0
#endif

__device__ __forceinline__ float qa_e4m3_rne_satfinite(float v) {
#if QA_HW_E4M3
  return qa_hw_e4m3_value(qa_hw_e4m3(v));
#endif
  if (v != v) return v;
  v = fminf(fmaxf(v, -448.f), 448.f);
  const float a = fabsf(v);
  if (a == 0.f) return v;
  int ex = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;  // fp32 subnormals give -127
  if (ex < -6) ex = -6;       // e4m3 subnormals: spacing 2^-9
  const float r = __fmul_rn(rintf(__fmul_rn(a, qa_pow2(3 - ex))), qa_pow2(ex - 3));
  return copysignf(r, v);
}

// quant_mode 1: ModelOpt's CUDA extension (scale = 448 / amax, inv = 1 / scale, true divisions)
// quant_mode 2: ModelOpt's eager fallback (Python's 448 / t is t.reciprocal() * 448)
// Both: amax <= 2^-24 counts as 1; q = e4m3(x * scale) * inv, then rounded to T by the caller.
__device__ __forceinline__ void qa_fp8_scales(const float* amax_ptr, int quant_mode,
                                              float& scale, float& inv) {
  float amax = *amax_ptr;
  if (amax <= 1.0f / 16777216.0f) amax = 1.0f;
  if (quant_mode == 1) {
    scale = __fdiv_rn(448.f, amax);
    inv = __fdiv_rn(1.f, scale);
  } else {
    scale = __fmul_rn(__frcp_rn(amax), 448.f);
    inv = __frcp_rn(scale);
  }
}

template <class T>
__device__ __forceinline__ float qa_fp8_fake_quant(float x, float scale, float inv) {
  return qa_round<T>(__fmul_rn(qa_e4m3_rne_satfinite(__fmul_rn(x, scale)), inv));
}

// The norm-input fake quantization of N widened values in place (quant_mode 0: the identity).
template <class T, int N>
__device__ __forceinline__ void qa_fp8_fake_quant_n(float (&v)[N], int quant_mode, float scale, float inv) {
  if (quant_mode != 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = qa_fp8_fake_quant<T>(v[i], scale, inv);
  }
}

// Load N consecutive elements widened to float, then the norm-input fake quantization.
template <class T, int N>
__device__ __forceinline__ void qa_load_quant(const typename T::storage* p, bool vec, int quant_mode, float scale,
                                              float inv, float (&v)[N]) {
  qa_load<T, N>(p, vec, v);
  qa_fp8_fake_quant_n<T, N>(v, quant_mode, scale, inv);
}

// The e4m3fn byte of a value that is already an e4m3 value (qa_e4m3_rne_satfinite's output) or
// NaN: sign | NaN pattern 0x7f for NaN (as PyTorch's float -> float8_e4m3fn conversion).
__device__ __forceinline__ unsigned char qa_e4m3_bits(float r) {
  const unsigned int u = __float_as_uint(r);
  const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
  if (r != r) return sign | 0x7f;
  const float a = fabsf(r);
  if (a == 0.f) return sign;
  const int ex = (int)((u >> 23) & 0xff) - 127;
  if (ex < -6) return sign | (unsigned char)__float2int_rn(__fmul_rn(a, 512.f));  // subnormal: m * 2^-9
  const unsigned int mant = (u >> 20) & 0x7u;
  return sign | (unsigned char)(((ex + 7) << 3) | mant);
}

// The FP8 byte ModelOpt's input quantizer would produce for v (already rounded to the tensor dtype).
__device__ __forceinline__ unsigned char qa_fp8_encode(float v, float scale) {
#if QA_HW_E4M3
  return qa_hw_e4m3(__fmul_rn(v, scale));
#else
  return qa_e4m3_bits(qa_e4m3_rne_satfinite(__fmul_rn(v, scale)));
#endif
}

#if QA_HW_E4M3
// The codes of two values (qa_fp8_encode of each) in one conversion: lo in the low byte.
__device__ __forceinline__ unsigned short qa_fp8_encode2(float lo, float hi, float scale) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(__fmul_rn(hi, scale)), "f"(__fmul_rn(lo, scale)));
  return r;
}
#endif

// Store the e4m3 codes of CH values held in storage form (CH-byte vector store when `vec`).
template <class T, int CH>
__device__ __forceinline__ void qa_store_fp8(unsigned char* p, bool vec, const QaVec<typename T::storage, CH>& o,
                                             float scale) {
  QaVec<unsigned char, CH> b;
#if QA_HW_E4M3
  if constexpr (CH % 2 == 0) {
    float f[CH];
    qa_widen<T, CH>(o, f);
#pragma unroll
    for (int i = 0; i < CH; i += 2) {
      const unsigned short two = qa_fp8_encode2(f[i], f[i + 1], scale);
      memcpy(&b.v[i], &two, sizeof(two));
    }
  } else
#endif
  {
#pragma unroll
    for (int i = 0; i < CH; ++i) b.v[i] = qa_fp8_encode(T::load(o.v[i]), scale);
  }
  if (vec) {
    *reinterpret_cast<QaVec<unsigned char, CH>*>(p) = b;
  } else {
#pragma unroll
    for (int i = 0; i < CH; ++i) p[i] = b.v[i];
  }
}
