// quantize_fp8: FP8 e4m3 codes of an activation for the real FP8 GEMM that consumes it.
//
//   ACT 0: codes of x itself                      (the attention output -> to_out[0] / to_add_out)
//   ACT 1: codes of GELU_tanh(x) rounded to T     (net[0].proj output -> net[2]; F.gelu's formula)
//   ACT 2: codes of SiLU(x) rounded to T          (temb -> img_mod[1] / txt_mod[1]; F.silu's formula)
//
// The input is [B, S, H, DH] with arbitrary batch/sequence/head strides and unit stride inside a
// head (e.g. the attention output as dispatch_attention_fn returns it, before flatten), seen as rows
// (b, s) of D = H * DH elements. Rows s < split go to out_a ([B, split, D], amax_a), the others to
// out_b ([B, S - split, D], amax_b): the joint [text, image] attention output is split and
// quantized for both output projections in one launch. One block per row.
#include "common.cuh"
#include "fp8.cuh"
#include "activation.cuh"

#define QA_QF8_THREADS 256

struct QuantizeFp8Params {
  const void* x;
  unsigned char* out_a;
  unsigned char* out_b;
  void* act_out;          // ACT 1 only: the rounded GELU output too (tests, debugging), or null
  const float* amax_a;
  const float* amax_b;
  qa_i64 stride_b, stride_s, stride_h;  // elements
  qa_i64 B, S, split;
  int H, DH;
  int vec;  // 1: VEC-element vector loads are legal
};

template <class T, int ACT, int VEC>
__global__ void __launch_bounds__(QA_QF8_THREADS) quantize_fp8_kernel(const QuantizeFp8Params p) {
  typedef typename T::storage S;
  const qa_i64 row = blockIdx.x;  // b * S + s
  const qa_i64 b = row / p.S, s = row - b * p.S;
  const bool first = s < p.split;
  const qa_i64 orow = first ? b * p.split + s : b * (p.S - p.split) + (s - p.split);
  const int D = p.H * p.DH;
  unsigned char* o = (first ? p.out_a : p.out_b) + orow * (qa_i64)D;
  S* ao = p.act_out ? reinterpret_cast<S*>(p.act_out) + row * (qa_i64)D : nullptr;
  float scale, inv;
  qa_fp8_scales(first ? p.amax_a : p.amax_b, 1, scale, inv);
  const S* xr = reinterpret_cast<const S*>(p.x) + b * p.stride_b + s * p.stride_s;
  const int per_head = p.DH / VEC;
  const int nvec = p.H * per_head;
  const bool heads_packed = p.stride_h == p.DH;  // the row is contiguous: no per-vector head division
  for (int c = threadIdx.x; c < nvec; c += QA_QF8_THREADS) {
    const int h = heads_packed ? 0 : c / per_head, d = (c - h * per_head) * VEC;
    float v[VEC];
    qa_load<T, VEC>(xr + h * p.stride_h + d, p.vec, v);
    QaVec<S, VEC> r;
#pragma unroll
    for (int i = 0; i < VEC; ++i) r.v[i] = T::store(ACT == 1 ? qa_gelu_tanh(v[i]) : ACT == 2 ? qa_silu(v[i]) : v[i]);
    const int e = h * p.DH + d;
    if (ao) qa_store_raw<T, VEC>(ao + e, p.vec, r);
    qa_store_fp8<T, VEC>(o + e, p.vec, r, scale);
  }
}
