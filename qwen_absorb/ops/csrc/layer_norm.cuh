// Row statistics for LayerNorm, reproducing PyTorch's CUDA LayerNorm forward bit for bit.
//
// PyTorch (aten/src/ATen/native/cuda/layer_norm_kernel.cu) has two forward paths, and eager
// diffusers takes one or the other depending on the input:
//
// MODE 0, "vectorized" (D % 4 == 0 and the input 4-element aligned: always the case for the fresh
//   tensors the block's norm2 sees, and for norm1 on an aligned hidden state). One block of 4 warps
//   (num_threads() = 128) per row; thread t folds the 4-element chunks t, t+128, ... into a
//   Welford accumulator element by element (mean += delta * (1/n), nvcc contracting it into an
//   FMA); warps combine with __shfl_down (16..1), then the 4 warp results through shared memory
//   (offsets 2, 1). var = m2 / D, rstd = rsqrtf(var + eps), y = rstd * (x - mean).
// MODE 1, "rowwise" (RowwiseMomentsCUDAKernel + LayerNormForwardCUDAKernel: D % 4 != 0 or a
//   misaligned input). 512 threads per row, element j to thread j % 512, WelfordOps (mean +=
//   delta / n, a true division), cuda_utils::BlockReduce (warp shuffles, 16 warp results through
//   shared memory, a second warp reduction). y = (x - mean) * rstd * 1 + 0.
//
// The same operations in the same order give the same mean and rstd, hence identical outputs
// (checked against torch on the H200: benchmarks/probe_layer_norm_order.py, tests/test_ops_gpu.py).
#pragma once

#ifndef QA_WELFORD_MEAN_ORDER
#define QA_WELFORD_MEAN_ORDER 0  // which product nvcc keeps unrounded in nA*meanA + nB*meanB
#endif

template <int MODE> struct QaLn;
template <> struct QaLn<0> { static constexpr int THREADS = 128, CH = 4; };
template <> struct QaLn<1> { static constexpr int THREADS = 512, CH = 1; };

// Minimum resident blocks per SM in a kernel's __launch_bounds__: it caps registers at
// 65536 / (THREADS * blocks) so enough rows are in flight per SM. Mode 0 with at most 6 slots per
// thread (D <= 3072: Qwen-Image's rows) takes 10 (ptxas: 48 registers, ~90 bytes of spills): the H200 sweep of
// benchmarks/bench_ops.py --sweep measured 113 us against 124 us with the compiler left free (1) for
// bias_residual_layer_norm_scale_shift at [1, 16384, 3072], and 54.6 against 55.6 for
// layer_norm_scale_shift. Wider rows keep 1 (their registers hold more slots). QA_LN_MIN_BLOCKS > 0
// forces one value for every mode-0 kernel (the sweep).
#ifndef QA_LN_MIN_BLOCKS
#define QA_LN_MIN_BLOCKS 0
#endif
template <int MODE, int NV>
__host__ __device__ constexpr int qa_ln_min_blocks() {
  return MODE == 1 ? 2 : QA_LN_MIN_BLOCKS > 0 ? QA_LN_MIN_BLOCKS : (NV >= 1 && NV <= 6 ? 10 : 1);
}

struct QaWelford {
  float mean, m2, count;
};

// Fold element number n (1-based) into a thread's accumulator. rn = 1/n, a compile-time constant
// when the caller's loop is unrolled (the value of PyTorch's `1.f/new_count`, correctly rounded).
template <int MODE>
__device__ __forceinline__ void qa_welford_add(QaWelford& w, float v, float n, float rn) {
  const float delta = __fsub_rn(v, w.mean);
  const float mean = MODE == 0 ? __fmaf_rn(delta, rn, w.mean) : __fadd_rn(w.mean, __fdiv_rn(delta, n));
  w.m2 = __fmaf_rn(delta, __fsub_rn(v, mean), w.m2);
  w.mean = mean;
  w.count = n;
}

// MODE 0: PyTorch's cuWelfordCombine(dataB = own, dataA = other).
__device__ __forceinline__ QaWelford qa_combine_vectorized(QaWelford b, QaWelford a) {
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

// MODE 1: PyTorch's WelfordOps::combine(a = own, b = other).
__device__ __forceinline__ QaWelford qa_combine_rowwise(QaWelford a, QaWelford b) {
  if (a.count == 0.f) return b;
  if (b.count == 0.f) return a;
  const float delta = __fsub_rn(b.mean, a.mean);
  const float count = __fadd_rn(a.count, b.count);
  const float nb_over_n = __fdiv_rn(b.count, count);
  QaWelford r;
  r.mean = __fmaf_rn(delta, nb_over_n, a.mean);
  r.m2 = __fmaf_rn(__fmul_rn(__fmul_rn(delta, delta), a.count), nb_over_n, __fadd_rn(a.m2, b.m2));
  r.count = count;
  return r;
}

__device__ __forceinline__ QaWelford qa_shfl_down(QaWelford w, int off) {
  QaWelford o;
  o.mean = __shfl_down_sync(0xffffffffu, w.mean, off);
  o.m2 = __shfl_down_sync(0xffffffffu, w.m2, off);
  o.count = __shfl_down_sync(0xffffffffu, w.count, off);
  return o;
}

// Block-wide combine; returns (mean, rstd) to every thread. smem: at least 48 floats.
template <int MODE>
__device__ __forceinline__ float2 qa_row_mean_rstd(QaWelford w, int D, float eps, float* smem) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (MODE == 0) {
    constexpr int WARPS = QaLn<0>::THREADS / 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) w = qa_combine_vectorized(w, qa_shfl_down(w, off));
#pragma unroll
    for (int off = WARPS / 2; off > 0; off /= 2) {
      if (lane == 0 && warp >= off && warp < 2 * off) {
        smem[2 * (warp - off)] = w.mean;
        smem[2 * (warp - off) + 1] = w.m2;
        smem[WARPS + (warp - off)] = w.count;
      }
      __syncthreads();
      if (lane == 0 && warp < off) {
        QaWelford o = {smem[2 * warp], smem[2 * warp + 1], smem[WARPS + warp]};
        w = qa_combine_vectorized(w, o);
      }
      __syncthreads();
    }
    if (tid == 0) {
      smem[0] = w.mean;
      smem[1] = rsqrtf(__fadd_rn(__fdiv_rn(w.m2, (float)D), eps));
    }
  } else {
    constexpr int WARPS = QaLn<1>::THREADS / 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) w = qa_combine_rowwise(w, qa_shfl_down(w, off));
    if (lane == 0) {
      smem[warp] = w.mean;
      smem[WARPS + warp] = w.m2;
      smem[2 * WARPS + warp] = w.count;
    }
    __syncthreads();
    if (warp == 0) {
      QaWelford o = {0.f, 0.f, 0.f};
      if (lane < WARPS) o = {smem[lane], smem[WARPS + lane], smem[2 * WARPS + lane]};
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) o = qa_combine_rowwise(o, qa_shfl_down(o, off));
      w = o;
    }
    __syncthreads();
    if (tid == 0) {
      smem[0] = w.mean;
      smem[1] = rsqrtf(__fadd_rn(__fdiv_rn(w.m2, w.count), eps));
    }
  }
  __syncthreads();
  return make_float2(smem[0], smem[1]);
}

// MODE 0 on a full row (every thread holds N0 elements, D = 128 * N0): the same combine tree as
// qa_row_mean_rstd<0>, but every count in it is known at compile time. Both sides of each combine
// hold C = N0 * 2^level elements, so PyTorch's count, 1/count (__frcp_rn, correctly rounded) and
// a.count * coef are the constexpr values below (constant folding in fp32 rounds the same way), the
// count > 0 test is always true and the counts need not be shuffled.
template <int C>
__device__ __forceinline__ QaWelford qa_combine_equal(QaWelford b, float a_mean, float a_m2) {
  constexpr float coef = 1.0f / (2.0f * (float)C);
  constexpr float n = (float)C * coef;  // na == nb
  const float delta = __fsub_rn(b.mean, a_mean);
  QaWelford r;
#if QA_WELFORD_MEAN_ORDER == 0
  r.mean = __fmaf_rn(n, a_mean, __fmul_rn(n, b.mean));
#else
  r.mean = __fmaf_rn(n, b.mean, __fmul_rn(n, a_mean));
#endif
  r.m2 = __fmaf_rn(__fmul_rn(__fmul_rn(delta, delta), (float)C), n, __fadd_rn(a_m2, b.m2));
  r.count = 2.0f * (float)C;
  return r;
}

template <int C, int OFF>
__device__ __forceinline__ QaWelford qa_warp_combine_equal(QaWelford w) {
  if constexpr (OFF == 0) {
    return w;
  } else {
    const float om = __shfl_down_sync(0xffffffffu, w.mean, OFF);
    const float om2 = __shfl_down_sync(0xffffffffu, w.m2, OFF);
    return qa_warp_combine_equal<2 * C, OFF / 2>(qa_combine_equal<C>(w, om, om2));
  }
}

// The 4 warp results go through shared memory once, and every thread combines them itself in
// PyTorch's order ((W0 + W2) + (W1 + W3), own value first), which needs one barrier instead of
// five. smem: at least 8 floats.
template <int N0>
__device__ __forceinline__ float2 qa_row_mean_rstd_full(QaWelford w, float eps, float* smem) {
  static_assert(QaLn<0>::THREADS == 128, "the tree below is PyTorch's for 4 warps");
  constexpr int CW = N0 * 32;  // elements per warp
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  w = qa_warp_combine_equal<N0, 16>(w);
  if (lane == 0) {
    smem[2 * warp] = w.mean;
    smem[2 * warp + 1] = w.m2;
  }
  __syncthreads();
  const QaWelford w0 = {smem[0], smem[1], 0.f}, w1 = {smem[2], smem[3], 0.f};
  const QaWelford a = qa_combine_equal<CW>(w0, smem[4], smem[5]);
  const QaWelford b = qa_combine_equal<CW>(w1, smem[6], smem[7]);
  const QaWelford r = qa_combine_equal<2 * CW>(a, b.mean, b.m2);
  return make_float2(r.mean, rsqrtf(__fadd_rn(__fdiv_rn(r.m2, (float)(4 * CW)), eps)));
}

// LayerNorm output (no affine) in fp32, before PyTorch rounds it to the tensor dtype.
template <int MODE>
__device__ __forceinline__ float qa_ln_value(float v, float mean, float rstd) {
  return MODE == 0 ? __fmul_rn(rstd, __fsub_rn(v, mean)) : __fadd_rn(__fmul_rn(__fsub_rn(v, mean), rstd), 0.f);
}

// LayerNorm output (no affine) rounded to T, as PyTorch writes it.
template <int MODE, class T>
__device__ __forceinline__ float qa_ln_out(float v, float mean, float rstd) {
  return qa_round<T>(qa_ln_value<MODE>(v, mean, rstd));
}

// The modulated output of CH LayerNorm inputs with diffusers' roundings, each in T:
//   SHIFT:  round(round(round(y) * round(1 + scale)) + shift)
//   !SHIFT: round(round(y) * round(1 + scale))          (Qwen-Image-2.1: no shift; sh unused)
// on packed pairs when QA_LN_PACKED (exact, see common.cuh).
template <class T, int MODE, int CH, bool SHIFT = true>
__device__ __forceinline__ QaVec<typename T::storage, CH> qa_modulated(
    const float (&v)[CH], float mean, float rstd, const QaVec<typename T::storage, CH>& sc,
    const QaVec<typename T::storage, CH>& sh) {
  QaVec<typename T::storage, CH> o;
  if constexpr (QA_LN_PACKED && T::kPacked && CH % 2 == 0) {
#pragma unroll
    for (int p = 0; p < CH / 2; ++p) {
      const float y0 = qa_ln_value<MODE>(v[2 * p], mean, rstd);
      const float y1 = qa_ln_value<MODE>(v[2 * p + 1], mean, rstd);
      const unsigned t = T::add2(T::kOne2, qa_pair(sc, p));
      unsigned m = T::mul2(T::pack2(y0, y1), t);
      if (SHIFT) m = T::add2(m, qa_pair(sh, p));
      qa_set_pair(o, p, m);
    }
  } else {
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const float m = __fmul_rn(qa_ln_out<MODE, T>(v[i], mean, rstd), qa_add<T>(1.f, T::load(sc.v[i])));
      o.v[i] = SHIFT ? T::store(__fadd_rn(qa_round<T>(m), T::load(sh.v[i]))) : T::store(m);
    }
  }
  return o;
}
