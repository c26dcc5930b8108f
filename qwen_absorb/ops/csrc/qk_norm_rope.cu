// qk_norm_rope: diffusers' q/k RMSNorm followed by Qwen-Image's complex RoPE, per (b, l, h) head row
// of DH = 128 elements, for up to QA_QKR_MAX_JOBS tensors in one launch (a block's four: img q/k,
// txt q/k). One warp per row, RPW consecutive rows per warp (their loads all issued before the first
// reduction: more bytes in flight per SM, the rows' arithmetic unchanged); lane u holds elements
// 4u .. 4u+3 (two complex pairs) of each.
//
// The eager chain it reproduces (diffusers 0.42.1, RMSNorm.forward + apply_rotary_emb_qwen):
//   var = x.float().pow(2).mean(-1)          fp32 squares, PyTorch's reduction order (below), * (1/128)
//   n   = x * torch.rsqrt(var + eps)         fp32: rsqrtf, one rounded multiply
//   n   = n.to(w.dtype) * w                  rounding to T, then a T multiply (T = x's = w's dtype)
//   out = (n as complex pairs (a, b)) * (c + di), then rounded to T
//
// Reduction order of `.pow(2).mean(-1)` over a contiguous fp32 last dim of 128: PyTorch's
// Reduce.cuh picks it from its launch configuration (input vectorization or not, vector width,
// block width), which changes between versions. The kernel implements the candidate orders as the
// template parameter ORDER, and qk_norm_rope.py probes which one the running PyTorch uses on the
// device (variance_in_order(), probe_variance_order()); with none matching the op stays off.
//   ORDER 0  vectorized by 4, 32 lanes:  lane u sums elements 4u..4u+3 in sequence
//   ORDER 1  not vectorized, 32 lanes:   lane u sums elements u, u+32, u+64, u+96 in sequence
//   ORDER 2  vectorized by 8, 16 lanes:  lane u sums 8u..8u+7 in sequence
//   ORDER 3  vectorized by 2, 32 lanes:  lane u: (e[2u] + e[2u+64]) + (e[2u+1] + e[2u+65])
//   ORDER 4  vectorized by 16, 8 lanes:  lane u sums 16u..16u+15 in sequence
// then the lanes combine with shfl_down, lane 0's value: ORDER 0-4 at offsets 1, 2, 4, ... (PyTorch
// before 2.10), ORDER 10-14 (the same groupings) at offsets ..., 4, 2, 1 (PyTorch since its
// "offset decreasing, matching Triton" change). MeanOps projects with `sum * (1/128)`, an exact
// power-of-two scaling.
//
// Complex multiply: c10::complex<float>::operator*= as nvcc compiles it for PyTorch's mul kernel
// (read off torch 2.11.0+cu130's sm_90 SASS): re = fma(a, c, -(b*d)), im = fma(a, d, b*c), the
// inner products rounded. QA_QKR_CMUL selects other groupings for probes (1: no contraction,
// 2: the mirrored fma choice).
#include "common.cuh"

#ifndef QA_QKR_WARPS
#define QA_QKR_WARPS 4  // rows (warps) per block; qk_norm_rope.py's WARPS must match
#endif
#ifndef QA_QKR_CMUL
#define QA_QKR_CMUL 0
#endif
#define QA_QKR_MAX_JOBS 4

struct QkNormRopeJob {
  const void* x;         // [B, L, H, 128], unit stride inside a head
  const void* weight;    // [128], same dtype as x
  const float* freqs;    // view_as_real(freqs): [L, 64, 2] fp32, rows freqs_stride floats apart
  void* out;             // contiguous [B, L, H, 128]
  qa_i64 stride_b, stride_l, stride_h;  // x strides, elements
  qa_i64 freqs_stride;                  // floats
  int L, H;
  int rows;              // B * L * H
  int block_start;       // first block of this job in the grid
  float eps;
  int vec_flags;         // 1: x rows, 2: weight, 4: freqs rows are vector-aligned
};

struct QkNormRopeParams {
  QkNormRopeJob job[QA_QKR_MAX_JOBS];
  int njobs;
};

// (a + bi) * (c + di) with the rounding of PyTorch's CUDA complex<float> multiply.
__device__ __forceinline__ void qa_qkr_cmul(float a, float b, float c, float d, float& re, float& im) {
#if QA_QKR_CMUL == 0
  re = __fmaf_rn(a, c, -__fmul_rn(b, d));
  im = __fmaf_rn(a, d, __fmul_rn(b, c));
#elif QA_QKR_CMUL == 1
  re = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, d));
  im = __fadd_rn(__fmul_rn(a, d), __fmul_rn(b, c));
#else
  re = __fmaf_rn(-b, d, __fmul_rn(a, c));
  im = __fmaf_rn(b, c, __fmul_rn(a, d));
#endif
}

// One lane's partial sum of the squares sq[0..127] in reduction order ORDER (see the header), and
// the number of lanes the tree then combines.
template <int G>
__device__ __forceinline__ float qa_qkr_lane_partial(const float* sq, int u) {
  if (G == 0) {
    const float* q = sq + 4 * u;
    return __fadd_rn(__fadd_rn(__fadd_rn(q[0], q[1]), q[2]), q[3]);
  } else if (G == 1) {
    return __fadd_rn(__fadd_rn(__fadd_rn(sq[u], sq[u + 32]), sq[u + 64]), sq[u + 96]);
  } else if (G == 3) {
    return __fadd_rn(__fadd_rn(sq[2 * u], sq[2 * u + 64]), __fadd_rn(sq[2 * u + 1], sq[2 * u + 65]));
  } else {
    const int V = G == 2 ? 8 : 16;
    if (u * V >= 128) return 0.f;
    const float* q = sq + V * u;
    float a = q[0];
#pragma unroll
    for (int i = 1; i < V; ++i) a = __fadd_rn(a, q[i]);
    return a;
  }
}
template <int G>
__device__ __forceinline__ constexpr int qa_qkr_lanes() { return G == 2 ? 16 : (G == 4 ? 8 : 32); }

// The job of this block (block-uniform): its index first, then its parameters by constant-index selects (a
// dynamically indexed kernel parameter would be copied to local memory).
__device__ __forceinline__ QkNormRopeJob qa_qkr_job(const QkNormRopeParams& p) {
  int j = 0;
#pragma unroll
  for (int k = 1; k < QA_QKR_MAX_JOBS; ++k)
    if (k < p.njobs && (int)blockIdx.x >= p.job[k].block_start) j = k;
  QkNormRopeJob J = p.job[0];
#pragma unroll
  for (int k = 1; k < QA_QKR_MAX_JOBS; ++k)
    if (j == k) J = p.job[k];
  return J;
}

// (b, l, h) of a row of the [B, L, H] row space, by division; the next row's by counting on (a warp's rows are
// consecutive, so only its first pays the divisions).
struct QaQkrRow {
  int b, l, h;
  __device__ __forceinline__ QaQkrRow(const QkNormRopeJob& J, int row) {
    b = row / (J.L * J.H);
    l = (row - b * J.L * J.H) / J.H;
    h = row - (b * J.L + l) * J.H;
  }
  __device__ __forceinline__ void next(const QkNormRopeJob& J) {
    if (++h == J.H) {
      h = 0;
      if (++l == J.L) {
        l = 0;
        ++b;
      }
    }
  }
  __device__ __forceinline__ qa_i64 x_offset(const QkNormRopeJob& J) const {
    return b * J.stride_b + l * J.stride_l + h * J.stride_h;
  }
};

template <class T, int ORDER, int RPW>
__global__ void __launch_bounds__(QA_QKR_WARPS * 32) qk_norm_rope_kernel(const QkNormRopeParams p) {
  typedef typename T::storage S;
  const QkNormRopeJob J = qa_qkr_job(p);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row0 = (((int)blockIdx.x - J.block_start) * QA_QKR_WARPS + warp) * RPW;
  if (row0 >= J.rows) return;  // whole warps only: the shuffles below need all 32 lanes
  const int e = lane * 4;

  // every load of the warp's rows first (row0 + r < rows is warp-uniform). The warp's rows are
  // consecutive: (b, l, h) of the first by division, of the next ones by counting on.
  float v[RPW][4], f[RPW][4];
  QaQkrRow at(J, row0);
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    if (row0 + r < J.rows) {
      qa_load<T, 4>(reinterpret_cast<const S*>(J.x) + at.x_offset(J) + e, J.vec_flags & 1, v[r]);
      qa_load<QaF32, 4>(J.freqs + at.l * J.freqs_stride + e, J.vec_flags & 4, f[r]);  // (c, d) of pairs e/2, e/2+1
      at.next(J);
    }
  }
  float w[4];
  qa_load<T, 4>(reinterpret_cast<const S*>(J.weight) + e, J.vec_flags & 2, w);

  // variance: each lane sums the squares of the elements it owns in PyTorch's order (ORDER, see the
  // header), then a shfl_down tree over the lanes. ORDER 0 / 10 sums exactly the lane's own four
  // elements, from registers; the other orders pass the squares through shared memory.
  __shared__ float sq_all[QA_QKR_WARPS][128];
  float* sq = sq_all[warp];
  constexpr int G = ORDER % 10, LANES = qa_qkr_lanes<G>();
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int row = row0 + r;
    if (row >= J.rows) break;
    float s;
    if constexpr (G == 0) {
      float q[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) q[i] = __fmul_rn(v[r][i], v[r][i]);
      s = __fadd_rn(__fadd_rn(__fadd_rn(q[0], q[1]), q[2]), q[3]);
    } else {
      __syncwarp();  // the previous row's reads of sq are done
#pragma unroll
      for (int i = 0; i < 4; ++i) sq[e + i] = __fmul_rn(v[r][i], v[r][i]);
      __syncwarp();
      s = qa_qkr_lane_partial<G>(sq, lane);
    }
    if (ORDER >= 10) {
#pragma unroll
      for (int off = LANES / 2; off > 0; off >>= 1) s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, off));
    } else {
#pragma unroll
      for (int off = 1; off < LANES; off <<= 1) s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, off));
    }
    const float var = __fmul_rn(__shfl_sync(0xffffffffu, s, 0), 0.0078125f);
    const float rs = rsqrtf(__fadd_rn(var, J.eps));  // torch.rsqrt: ::rsqrt(float), same libdevice call
    float y[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) y[i] = qa_mul<T>(qa_round<T>(__fmul_rn(v[r][i], rs)), w[i]);
    float o[4];
    qa_qkr_cmul(y[0], y[1], f[r][0], f[r][1], o[0], o[1]);
    qa_qkr_cmul(y[2], y[3], f[r][2], f[r][3], o[2], o[3]);
    QaVec<S, 4> ov;
#pragma unroll
    for (int i = 0; i < 4; ++i) ov.v[i] = T::store(o[i]);
    qa_store_raw<T, 4>(reinterpret_cast<S*>(J.out) + (qa_i64)row * 128 + e, true, ov);
  }
}

// ---- the wide form: 8 elements per lane, a row per half-warp -----------------------------------
// The same arithmetic for the two orders PyTorch uses on the devices we know (ORDER 0 and 10: lane
// groups of 4 consecutive elements), with one 16-byte load of x per lane (bf16/fp16) and two rows
// per warp instruction: lane u of half-warp hw holds elements 8u .. 8u+7 of row row0 + 2r + hw,
// i.e. PyTorch's groups 2u and 2u+1. The shfl tree over 32 groups maps onto 16 lanes exactly:
//   ORDER 10 (offsets 16, 8, 4, 2, 1): groups g and g+16 are lanes u and u+8 (same slot), ... g+2
//     is lane u+1, and the last step (g0 + g1) is lane 0's two slots: both slots go through the
//     shfl steps 8, 4, 2, 1, then slot0 + slot1.
//   ORDER 0 (offsets 1, 2, 4, ...): the first step (g + g+1) is each lane's slot0 + slot1, the rest
//     (g+2, g+4, g+8, g+16) are lanes u+1, u+2, u+4, u+8. Lane 0's value is all that is read.
// Shuffles of width 16 keep the halves apart; both halves shuffle on every row pair (a half past
// the last row computes on zeros and stores nothing), so the full-mask shuffles stay warp-uniform.
template <class T, int ORDER, int RPW>
__global__ void __launch_bounds__(QA_QKR_WARPS * 32) qk_norm_rope_wide_kernel(const QkNormRopeParams p) {
  static_assert(ORDER == 0 || ORDER == 10, "the wide form implements groups of 4 only");
  static_assert(RPW % 2 == 0, "rows come in pairs (one per half-warp)");
  typedef typename T::storage S;
  constexpr int PAIRS = RPW / 2;
  const QkNormRopeJob J = qa_qkr_job(p);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane >> 4, u = lane & 15;
  const int row0 = (((int)blockIdx.x - J.block_start) * QA_QKR_WARPS + warp) * RPW;
  if (row0 >= J.rows) return;  // whole warps only
  const int e = u * 8;

  float v[PAIRS][8], f[PAIRS][8];
  QaQkrRow at(J, row0 + half);
#pragma unroll
  for (int r = 0; r < PAIRS; ++r) {
    if (row0 + 2 * r + half < J.rows) {
      qa_load<T, 8>(reinterpret_cast<const S*>(J.x) + at.x_offset(J) + e, J.vec_flags & 1, v[r]);
      const float* fr = J.freqs + at.l * J.freqs_stride + e;
      float f0[4], f1[4];
      qa_load<QaF32, 4>(fr, J.vec_flags & 4, f0);
      qa_load<QaF32, 4>(fr + 4, J.vec_flags & 4, f1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[r][i] = f0[i];
        f[r][4 + i] = f1[i];
      }
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[r][i] = f[r][i] = 0.f;
    }
    at.next(J);  // the next row of this half: two rows on
    at.next(J);
  }
  float w[8];
  qa_load<T, 8>(reinterpret_cast<const S*>(J.weight) + e, J.vec_flags & 2, w);

#pragma unroll
  for (int r = 0; r < PAIRS; ++r) {
    if (row0 + 2 * r >= J.rows) break;  // warp-uniform: the first half's row
    const int row = row0 + 2 * r + half;
    float q[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = __fmul_rn(v[r][i], v[r][i]);
    const float s0 = __fadd_rn(__fadd_rn(__fadd_rn(q[0], q[1]), q[2]), q[3]);  // group 2u
    const float s1 = __fadd_rn(__fadd_rn(__fadd_rn(q[4], q[5]), q[6]), q[7]);  // group 2u + 1
    float s;
    if constexpr (ORDER == 10) {
      float a0 = s0, a1 = s1;
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) {
        a0 = __fadd_rn(a0, __shfl_down_sync(0xffffffffu, a0, off, 16));
        a1 = __fadd_rn(a1, __shfl_down_sync(0xffffffffu, a1, off, 16));
      }
      s = __fadd_rn(a0, a1);
    } else {
      s = __fadd_rn(s0, s1);
#pragma unroll
      for (int off = 1; off < 16; off <<= 1) s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, off, 16));
    }
    const float var = __fmul_rn(__shfl_sync(0xffffffffu, s, 0, 16), 0.0078125f);
    const float rs = rsqrtf(__fadd_rn(var, J.eps));
    float y[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) y[i] = qa_mul<T>(qa_round<T>(__fmul_rn(v[r][i], rs)), w[i]);
    float o[8];
#pragma unroll
    for (int c = 0; c < 4; ++c) qa_qkr_cmul(y[2 * c], y[2 * c + 1], f[r][2 * c], f[r][2 * c + 1], o[2 * c], o[2 * c + 1]);
    if (row < J.rows) {
      QaVec<S, 8> ov;
#pragma unroll
      for (int i = 0; i < 8; ++i) ov.v[i] = T::store(o[i]);
      qa_store_raw<T, 8>(reinterpret_cast<S*>(J.out) + (qa_i64)row * 128 + e, true, ov);
    }
  }
}
