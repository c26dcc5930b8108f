// swiglu: out = silu(a) * b   (Qwen-Image-2.1's FFN: a = gate_layer(x), b = proj(x); out feeds `out`)
//
// Eager's roundings: silu(a) in fp32 (PyTorch's CUDA SiLU: x / (1 + exp(-x)) on the widened value)
// rounded to T, then the product rounded to T. Optionally (out2) a second output from that rounded
// product under the `out` linear's input quantizer (amax at out2_amax): its e4m3 codes (fp8.cuh's
// formula), for a real FP8 GEMM; or (NVFP4 = 1) its NVFP4 fake quantization in T (nvfp4.cuh), for an
// NVFP4 fake-quant linear: a 16-element block is 16 / VEC adjacent threads' vectors (the host requires the
// row length to be a multiple of 16, so n is, every vector is whole and a block's threads run together).
// Elementwise over n elements: each thread one vector of VEC elements (one
// vector load when `vec`: every pointer 16-byte aligned), the tail element by element.
#include "common.cuh"
#include "fp8.cuh"
#include "nvfp4.cuh"

#define QA_SWIGLU_THREADS 256

struct SwigluParams {
  const void* a;
  const void* b;
  void* out;
  void* out2;  // the second output (or null): e4m3 codes, or NVFP4 values in T (NVFP4 instances)
  const float* out2_amax;
  qa_i64 n;
  int vec;
};

__device__ __forceinline__ float qa_swiglu_silu(float x) { return x / (1.f + expf(-x)); }

template <class T>
__device__ __forceinline__ typename T::storage qa_swiglu_one(typename T::storage a, typename T::storage b) {
  return T::store(__fmul_rn(qa_round<T>(qa_swiglu_silu(T::load(a))), T::load(b)));
}

// UNROLL vectors per thread, THREADS * VEC elements apart (each load instruction of the block stays
// coalesced): all of a thread's loads are issued before its first store, so more bytes are in flight
// per SM (a streaming kernel needs ~30 KB per SM on the H200 to approach the copy rate). UNROLL
// changes which thread computes an element, never how.
template <class T, int VEC, int UNROLL, int NVFP4 = 0>
__global__ void __launch_bounds__(QA_SWIGLU_THREADS) swiglu_kernel(const SwigluParams p) {
  typedef typename T::storage S;
  const qa_i64 base = (qa_i64)blockIdx.x * QA_SWIGLU_THREADS * VEC * UNROLL + (qa_i64)threadIdx.x * VEC;
  if (base >= p.n) return;
  float f8scale = 1.f, f8inv = 1.f;  // NVFP4: f8scale is the second-level scale
  if (NVFP4) f8scale = qa_nvfp4_global_scale(p.out2_amax);
  else if (p.out2) qa_fp8_scales(p.out2_amax, 1, f8scale, f8inv);
  const bool vec = p.vec != 0;
  QaVec<S, VEC> av[UNROLL], bv[UNROLL];
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) {
    const qa_i64 e = base + (qa_i64)k * QA_SWIGLU_THREADS * VEC;
    if (e + VEC <= p.n) {
      av[k] = qa_load_raw<T, VEC>(reinterpret_cast<const S*>(p.a) + e, vec);
      bv[k] = qa_load_raw<T, VEC>(reinterpret_cast<const S*>(p.b) + e, vec);
    }
  }
#pragma unroll
  for (int k = 0; k < UNROLL; ++k) {
    const qa_i64 e = base + (qa_i64)k * QA_SWIGLU_THREADS * VEC;
    if (e >= p.n) break;
    S* o = p.out ? reinterpret_cast<S*>(p.out) + e : nullptr;
    unsigned char* f8 = !NVFP4 && p.out2 ? reinterpret_cast<unsigned char*>(p.out2) + e : nullptr;
    S* q = NVFP4 ? reinterpret_cast<S*>(p.out2) + e : nullptr;
    if (e + VEC <= p.n) {
      QaVec<S, VEC> ov;
#pragma unroll
      for (int i = 0; i < VEC; ++i) ov.v[i] = qa_swiglu_one<T>(av[k].v[i], bv[k].v[i]);
      if (o) qa_store_raw<T, VEC>(o, vec, ov);
      if constexpr (NVFP4 != 0) {
        qa_store_nvfp4<T, VEC>(q, vec, ov, f8scale);
      } else {
        if (f8) qa_store_fp8<T, VEC>(f8, vec, ov, f8scale);
      }
    } else {  // the tail: element by element (never in an NVFP4 launch: n is a multiple of 16)
      const S* a = reinterpret_cast<const S*>(p.a) + e;
      const S* b = reinterpret_cast<const S*>(p.b) + e;
      for (int i = 0; e + i < p.n; ++i) {
        const S r = qa_swiglu_one<T>(a[i], b[i]);
        if (o) o[i] = r;
        if (f8) f8[i] = qa_fp8_encode(T::load(r), f8scale);
      }
    }
  }
}
