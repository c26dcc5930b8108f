// Row statistics for LayerNorm, reproducing PyTorch's CUDA LayerNorm forward bit for bit.
//
// PyTorch (aten/src/ATen/native/cuda/layer_norm_kernel.cu, vectorized path, taken when D % 4 == 0
// and the buffers are 4-element aligned, which holds for the freshly allocated tensors eager feeds
// to the block LayerNorms) gives each row one block of 4 warps (num_threads() = 128). Thread t folds
// the 4-element chunks t, t + 128, t + 256, ... into a Welford accumulator, element by element; the
// warps then combine with __shfl_down (offsets 16..1) and the 4 warp results combine through shared
// memory (offsets 2, 1). The same operations in the same order, with the same fused multiply-adds
// (nvcc contracts `a + b * c` there), give the same mean and rstd, hence identical LayerNorm
// outputs. Everything here is that arithmetic; QA_LN_THREADS must stay 128.
#pragma once

#define QA_LN_THREADS 128
#define QA_LN_WARPS 4

#ifndef QA_WELFORD_MEAN_ORDER
#define QA_WELFORD_MEAN_ORDER 0
#endif

struct QaWelford {
  float mean, m2, count;
};

__device__ __forceinline__ QaWelford qa_welford_add(QaWelford w, float v) {
  const float delta = __fsub_rn(v, w.mean);
  const float n = __fadd_rn(w.count, 1.f);
  const float mean = __fmaf_rn(delta, __frcp_rn(n), w.mean);
  const float m2 = __fmaf_rn(delta, __fsub_rn(v, mean), w.m2);
  QaWelford r = {mean, m2, n};
  return r;
}

// PyTorch's cuWelfordCombine(dataB = own, dataA = other).
__device__ __forceinline__ QaWelford qa_welford_combine(QaWelford b, QaWelford a) {
  const float delta = __fsub_rn(b.mean, a.mean);
  const float count = __fadd_rn(a.count, b.count);
  QaWelford r = {0.f, 0.f, count};
  if (count > 0.f) {
    const float coef = __frcp_rn(count);
    const float na = __fmul_rn(a.count, coef);
    const float nb = __fmul_rn(b.count, coef);
#if QA_WELFORD_MEAN_ORDER == 0
    r.mean = __fmaf_rn(na, a.mean, __fmul_rn(nb, b.mean));
#else
    r.mean = __fmaf_rn(nb, b.mean, __fmul_rn(na, a.mean));
#endif
    r.m2 = __fmaf_rn(__fmul_rn(__fmul_rn(delta, delta), a.count), nb, __fadd_rn(a.m2, b.m2));
  }
  return r;
}

// Block-wide combine; returns (mean, biased variance) to every thread. smem: 6 floats.
__device__ __forceinline__ float2 qa_row_mean_var(QaWelford w, int D, float* smem) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    QaWelford o;
    o.mean = __shfl_down_sync(0xffffffffu, w.mean, off);
    o.m2 = __shfl_down_sync(0xffffffffu, w.m2, off);
    o.count = __shfl_down_sync(0xffffffffu, w.count, off);
    w = qa_welford_combine(w, o);
  }
#pragma unroll
  for (int off = QA_LN_WARPS / 2; off > 0; off /= 2) {
    if (lane == 0 && warp >= off && warp < 2 * off) {
      smem[2 * (warp - off)] = w.mean;
      smem[2 * (warp - off) + 1] = w.m2;
      smem[QA_LN_WARPS + (warp - off)] = w.count;
    }
    __syncthreads();
    if (lane == 0 && warp < off) {
      QaWelford o = {smem[2 * warp], smem[2 * warp + 1], smem[QA_LN_WARPS + warp]};
      w = qa_welford_combine(w, o);
    }
    __syncthreads();
  }
  if (tid == 0) {
    smem[0] = w.mean;
    smem[1] = __fdiv_rn(w.m2, (float)D);
  }
  __syncthreads();
  return make_float2(smem[0], smem[1]);
}

// LayerNorm output (no affine) rounded to T, as PyTorch writes it.
template <class T>
__device__ __forceinline__ float qa_ln_out(float v, float mean, float rstd) {
  return qa_round<T>(__fmul_rn(rstd, __fsub_rn(v, mean)));
}

// x * (1 + scale) + shift, each op rounded to T (diffusers' _modulate).
template <class T>
__device__ __forceinline__ float qa_scale_shift(float y, float scale, float shift) {
  return qa_add<T>(qa_mul<T>(y, qa_add<T>(1.f, scale)), shift);
}
