// Shared device code for qwen_absorb's fused ops (compiled by NVRTC through CuPy).
//
// Numerics rule: every op the diffusers eager expression performs in the tensor dtype is done here
// as one fp32 operation with an explicit round-to-nearest intrinsic (__fadd_rn/__fmul_rn, never
// contracted into an FMA), followed by a rounding to the tensor dtype. That reproduces PyTorch's
// elementwise kernels, which compute bf16/fp16 ops in fp32 and round the result.
#pragma once

typedef unsigned short qa_u16;
typedef long long qa_i64;

// ---- dtypes: storage type, widening load, rounding store -------------------------------------
// QA_LN_PACKED 1 (default): the eager-rounded bf16/fp16 adds and multiplies of the residual and
// modulation math run on packed pairs (see qa_gated_residual below); 0: one fp32 op + rounding per
// element. Both are bit-identical (H200: all GPU op tests pass either way); packed is faster
// (benchmarks/results/ops/fusion.md).
#ifndef QA_LN_PACKED
#define QA_LN_PACKED 1
#endif

struct QaF32 {
  typedef float storage;
  static constexpr bool kPacked = false;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

// The packed-pair operations of a 16-bit type whose PTX name is TY ("bf16", "f16") and whose pair
// (1, 1) is ONE2 (element 2p in the low half). One rounding each: a * 1 + b is a + b, and
// a * b + (-0) is a * b (the -0 keeps the sign of a zero product). store rounds to nearest even
// (bf16: NaN -> canonical NaN), the same instruction PyTorch's CUDA float -> 16-bit conversion uses
// on sm_80+.
#define QA_PACKED16_OPS(TY, ONE2)                                                        \
  typedef qa_u16 storage;                                                                \
  static constexpr bool kPacked = true;                                                  \
  static constexpr unsigned kOne2 = ONE2;                                                \
  static __device__ __forceinline__ unsigned pack2(float lo, float hi) {                 \
    unsigned r;                                                                          \
    asm("cvt.rn." TY "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));                 \
    return r;                                                                            \
  }                                                                                      \
  static __device__ __forceinline__ unsigned add2(unsigned a, unsigned b) {              \
    unsigned r;                                                                          \
    asm("fma.rn." TY "x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(kOne2), "r"(b));       \
    return r;                                                                            \
  }                                                                                      \
  static __device__ __forceinline__ unsigned mul2(unsigned a, unsigned b) {              \
    unsigned r;                                                                          \
    asm("fma.rn." TY "x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(0x80008000u)); \
    return r;                                                                            \
  }                                                                                      \
  static __device__ __forceinline__ qa_u16 store(float v) {                              \
    qa_u16 r;                                                                            \
    asm("cvt.rn." TY ".f32 %0, %1;" : "=h"(r) : "f"(v));                                 \
    return r;                                                                            \
  }

// load2: both halves of a packed pair widened (element 2p, the low half, into lo).
struct QaBF16 {
  QA_PACKED16_OPS("bf16", 0x3F803F80u)
  static __device__ __forceinline__ float load(qa_u16 v) {
    return __uint_as_float(((unsigned int)v) << 16);
  }
  static __device__ __forceinline__ void load2(unsigned w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
};

struct QaF16 {
  QA_PACKED16_OPS("f16", 0x3C003C00u)
  static __device__ __forceinline__ float load(qa_u16 v) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v));
    return r;
  }
  static __device__ __forceinline__ void load2(unsigned w, float& lo, float& hi) {
    asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(w));
  }
};

// Value of v after rounding to T (what an eager op writing a T tensor leaves behind).
template <class T>
__device__ __forceinline__ float qa_round(float v) { return T::load(T::store(v)); }

// One eager elementwise op each: fp32 op, then rounding to T.
template <class T>
__device__ __forceinline__ float qa_add(float a, float b) { return qa_round<T>(__fadd_rn(a, b)); }
template <class T>
__device__ __forceinline__ float qa_mul(float a, float b) { return qa_round<T>(__fmul_rn(a, b)); }

// A compile-time flag passed to a generic lambda (f(QaBool<true>{}) / f(QaBool<false>{})): the
// kernels branch once per block on a uniform condition and get straight-line code in each branch.
template <bool B>
struct QaBool {
  static constexpr bool value = B;
};

// ---- vector access ---------------------------------------------------------------------------
template <class S, int N>
struct __align__(sizeof(S) * N) QaVec { S v[N]; };

// Pair p of a vector of 16-bit values as one 32-bit register (element 2p in the low half). As
// memcpy of the bytes: the compiler then keeps the register a vector load filled as it is (splitting
// it into halves and joining them again cost two instructions per pair).
template <int N>
__device__ __forceinline__ unsigned qa_pair(const QaVec<qa_u16, N>& v, int p) {
  unsigned r;
  memcpy(&r, &v.v[2 * p], sizeof(r));
  return r;
}
template <int N>
__device__ __forceinline__ void qa_set_pair(QaVec<qa_u16, N>& v, int p, unsigned r) {
  memcpy(&v.v[2 * p], &r, sizeof(r));
}

// Why packed pairs are exact for bf16 and fp16: eager computes a + b or a * b of two 16-bit values
// in fp32 and rounds to the 16-bit type. A product of two p-bit significands is exact in fp32
// (2p <= 24); a sum fp32 may round, but an fp32 (24-bit) rounding followed by a rounding to p bits
// equals the direct rounding whenever 24 >= 2p + 2 (bf16: p = 8, fp16: p = 11; double rounding is
// innocuous there). So one rounded bf16x2 / f16x2 fma gives eager's bits for two elements at once.

// residual + gate * (x + bias) for N elements, eager's roundings (both residual ops).
template <class T, int N>
__device__ __forceinline__ QaVec<typename T::storage, N> qa_gated_residual(
    const QaVec<typename T::storage, N>& r, const QaVec<typename T::storage, N>& x,
    const QaVec<typename T::storage, N>& g, const QaVec<typename T::storage, N>& b, bool has_bias) {
  QaVec<typename T::storage, N> o;
  if constexpr (QA_LN_PACKED && T::kPacked && N % 2 == 0) {
#pragma unroll
    for (int p = 0; p < N / 2; ++p) {
      unsigned y = qa_pair(x, p);
      if (has_bias) y = T::add2(y, qa_pair(b, p));
      qa_set_pair(o, p, T::add2(qa_pair(r, p), T::mul2(qa_pair(g, p), y)));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float y = T::load(x.v[i]);
      if (has_bias) y = qa_round<T>(__fadd_rn(y, T::load(b.v[i])));
      o.v[i] = T::store(__fadd_rn(T::load(r.v[i]), qa_round<T>(__fmul_rn(T::load(g.v[i]), y))));
    }
  }
  return o;
}

// Load N consecutive elements in storage form; one vector load when `vec` (alignment checked on
// the host). Kept raw in registers (bf16/fp16: two per register) and widened where used.
template <class T, int N>
__device__ __forceinline__ QaVec<typename T::storage, N> qa_load_raw(const typename T::storage* p, bool vec) {
  typedef typename T::storage S;
  if (vec) return *reinterpret_cast<const QaVec<S, N>*>(p);
  QaVec<S, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r.v[i] = p[i];
  return r;
}

template <class T, int N>
__device__ __forceinline__ void qa_store_raw(typename T::storage* p, bool vec, const QaVec<typename T::storage, N>& r) {
  if (vec) {
    *reinterpret_cast<QaVec<typename T::storage, N>*>(p) = r;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) p[i] = r.v[i];
  }
}

// N elements in storage form widened to float.
template <class T, int N>
__device__ __forceinline__ void qa_widen(const QaVec<typename T::storage, N>& r, float (&out)[N]) {
  if constexpr (T::kPacked && N % 2 == 0) {
#pragma unroll
    for (int p = 0; p < N / 2; ++p) T::load2(qa_pair(r, p), out[2 * p], out[2 * p + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = T::load(r.v[i]);
  }
}

// Load N consecutive elements widened to float (one vector load when `vec`).
template <class T, int N>
__device__ __forceinline__ void qa_load(const typename T::storage* p, bool vec, float (&out)[N]) {
  qa_widen<T, N>(qa_load_raw<T, N>(p, vec), out);
}

// ---- a thread's slots of a row ---------------------------------------------------------------
// f(rel) for each slot of this thread in a row of nslots slots spread over TH threads, rel being
// the slot's distance from the thread's first slot threadIdx.x (the callers address slots from a
// per-thread pointer, so unrolled addresses are that pointer plus a constant). NV > 0: the slots
// threadIdx.x + k * TH for k < NV (unrolled; the launcher picks NV large enough); NV == 0, a
// strided loop (very wide rows).
template <int TH, int NV, class F>
__device__ __forceinline__ void qa_for_slots(int nslots, F&& f) {
  const int tid = threadIdx.x;
  if (NV > 0) {
    if (NV * TH == nslots) {
#pragma unroll
      for (int k = 0; k < NV; ++k) f(k * TH);
    } else {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        if (tid + k * TH < nslots) f(k * TH);
      }
    }
  } else {
    for (int rel = 0; tid + rel < nslots; rel += TH) f(rel);
  }
}

// ---- per-sample / per-token modulation rows --------------------------------------------------
// Parameters have B rows (or 2B with a 0/1 token index, diffusers' modulate_index): token (b, l)
// uses row b where index[b, l] == 0 and row B + b otherwise, like torch.where(index == 0, ...).
__device__ __forceinline__ qa_i64 qa_param_row(qa_i64 row, qa_i64 L, qa_i64 B,
                                               const void* index, int index_kind) {
  const qa_i64 b = row / L;
  if (index_kind == 0) return b;
  bool second;
  if (index_kind == 8) second = reinterpret_cast<const long long*>(index)[row] != 0;
  else if (index_kind == 4) second = reinterpret_cast<const int*>(index)[row] != 0;
  else if (index_kind == 2) second = reinterpret_cast<const short*>(index)[row] != 0;
  else second = reinterpret_cast<const unsigned char*>(index)[row] != 0;
  return second ? B + b : b;
}
