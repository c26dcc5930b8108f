// taylor_seer: diffusers' TaylorSeer cache step (hooks/taylorseer_cache.py) on factors held in place, so that
// a CUDA graph can replay it. Coefficients come from device memory (one graph serves every step offset).
//
// D: the module output dtype (features, predictions); F: the factor dtype (taylor_factors_dtype).
//
// update<D, F, NPREV>, in place per element (every read before any write):
//   n0 = x;  n_{j+1} = D(D(n_j - D(f_j)) * inv)   for j < NPREV   (inv = coef[0] = 1 / delta_step: PyTorch's CUDA
//   division by a host scalar multiplies by the fp32 reciprocal);   f_k = F(n_k) for k <= NPREV.
// predict<D, F, NORD>:
//   out = 0;  out = D(out + D(D(f_k) * c_k))   for k < NORD   (c_0 = 1, c_k = coef[k - 1] = offset^k / k!)
// Each line is one eager op of diffusers' expression: one fp32 op, then a rounding (common.cuh).
#include "common.cuh"

#define QA_TS_THREADS 256
#define QA_TS_MAX_ORDERS 5  // order 0 and up to 4 differences (max_order <= 4)

struct TaylorSeerParams {
  const void* x;    // update: the new features [n] (D)
  void* out;        // predict: the prediction [n] (D)
  void* f[QA_TS_MAX_ORDERS];  // factors [n] (F), order k
  const float* coef;          // update: 1 / delta; predict: c_1, c_2, ...
  qa_i64 n;
};

template <class D, class F>
__device__ __forceinline__ float qa_ts_factor(const void* f, qa_i64 i) {
  // D(f): the factor as the module dtype (a no-op rounding when F is D)
  return qa_round<D>(F::load(static_cast<const typename F::storage*>(f)[i]));
}

template <class D, class F, int NPREV>
__global__ void __launch_bounds__(QA_TS_THREADS) taylor_seer_update_kernel(const TaylorSeerParams p) {
  const float inv = NPREV > 0 ? p.coef[0] : 1.0f;
  const qa_i64 stride = (qa_i64)gridDim.x * QA_TS_THREADS;
  for (qa_i64 i = (qa_i64)blockIdx.x * QA_TS_THREADS + threadIdx.x; i < p.n; i += stride) {
    float nk[NPREV + 1];
    nk[0] = D::load(static_cast<const typename D::storage*>(p.x)[i]);
#pragma unroll
    for (int j = 0; j < NPREV; ++j) {
      const float d = qa_add<D>(nk[j], -qa_ts_factor<D, F>(p.f[j], i));
      nk[j + 1] = qa_mul<D>(d, inv);
    }
#pragma unroll
    for (int k = 0; k <= NPREV; ++k) static_cast<typename F::storage*>(p.f[k])[i] = F::store(nk[k]);
  }
}

template <class D, class F, int NORD>
__global__ void __launch_bounds__(QA_TS_THREADS) taylor_seer_predict_kernel(const TaylorSeerParams p) {
  float c[NORD];
  c[0] = 1.0f;
#pragma unroll
  for (int k = 1; k < NORD; ++k) c[k] = p.coef[k - 1];
  const qa_i64 stride = (qa_i64)gridDim.x * QA_TS_THREADS;
  for (qa_i64 i = (qa_i64)blockIdx.x * QA_TS_THREADS + threadIdx.x; i < p.n; i += stride) {
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < NORD; ++k) acc = qa_add<D>(acc, qa_mul<D>(qa_ts_factor<D, F>(p.f[k], i), c[k]));
    static_cast<typename D::storage*>(p.out)[i] = D::store(acc);
  }
}
