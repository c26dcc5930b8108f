// lora_add_tiles: lora_add.cu's two forms (ACT 0: y += alpha * t @ B^T in place; ACT 1: net[0]'s branch inside the
// GELU(tanh) + e4m3 quantization), the same mma sequence per element (bit for bit the same sums and outputs),
// laid out to keep DRAM busy: lora_add_kernel reads y straight into registers one 64-column chunk ahead, at most
// ~32 KB in flight per SM, and ran at half the copy rate (benchmarks/NOTES.md, Little's law).
//
// Here y and t tiles come in through cp.async into a ring of QA_LT_STAGES shared-memory stages (two tiles in
// flight per block while it works on a third); each block walks a contiguous run of
// tiles (column range outer, 64-row tiles inner), so lora_B's 128 rows are staged once per column range, not once
// per tile, and every SM gets the same share (the grid is what stays resident: ~2 blocks per SM at rank 64).
//
// Needs (checked on the host): y rows and t rows 16-byte aligned, N % 8 == 0 and R % 8 == 0 (a 16-byte piece is
// wholly inside or outside), lora_B rows 16-byte aligned; ACT 1 a contiguous y. Elsewhere lora_add_kernel runs.
#include "lora_mma.cuh"

#ifndef QA_LT_BM
#define QA_LT_BM 64                // rows per tile (32 or 64): BM / 16 warps down the tile, 8 / (BM / 16) across
#endif
#define QA_LT_BN 128               // columns per tile
#define QA_LT_YP (QA_LT_BN + 32)   // y's shared pitch: rows 64 bytes apart modulo 128, so the 16-byte reads of a
                                   // quarter warp (2 rows x 64 bytes) hit distinct banks
#ifndef QA_LT_STAGES
#define QA_LT_STAGES 3
#endif
#ifndef QA_LT_MIN_BLOCKS
#define QA_LT_MIN_BLOCKS 2  // blocks per SM the registers must allow (the host sizes the grid by it)
#endif
#define QA_LT_WM (QA_LT_BM / 16)               // warps down a tile
#define QA_LT_CW (QA_LT_BN * QA_LT_WM / 8)     // columns per warp: 64 (BM 64) or 32 (BM 32)
#define QA_LT_NT (QA_LT_CW / 8)                // n8 tiles per warp

// The problem holding tile u (problems in launch order, each from its tile_begin), its tile's first row and column.
__device__ __forceinline__ LoraProblem qa_lt_locate(const LoraAddParams& p, int u, int& pi, int& m0, int& n0) {
  LoraProblem q = p.p[0];
  pi = 0;
#pragma unroll
  for (int i = 1; i < QA_LA_MAXP; ++i) {
    if (i < p.nprob && u >= p.p[i].tile_begin) {
      q = p.p[i];
      pi = i;
    }
  }
  const int tiles_m = (q.M + QA_LT_BM - 1) / QA_LT_BM;
  const int local = u - q.tile_begin, ct = local / tiles_m;
  m0 = (local - ct * tiles_m) * QA_LT_BM;
  n0 = ct * QA_LT_BN;
  return q;
}

template <class T, int ACT, int KS>
__global__ void __launch_bounds__(QA_LA_THREADS, QA_LT_MIN_BLOCKS) lora_add_tiles_kernel(const LoraAddParams p) {
  typedef typename T::storage S;
  extern __shared__ __align__(16) unsigned char qa_lt_smem[];
  constexpr int RP = 16 * KS;  // the rank padded to the mma's k steps
  constexpr int LD = RP + 8;   // t's and lora_B's shared pitch: conflict-free fragment loads
  constexpr int SWM = KS >= 4 ? 3 : KS - 1;
  constexpr int STAGE = QA_LT_BM * (QA_LT_YP + LD);  // elements: y tile, then t tile
  qa_u16* bsm = reinterpret_cast<qa_u16*>(qa_lt_smem);  // [BN][LD]
  qa_u16* ring = bsm + QA_LT_BN * LD;                    // QA_LT_STAGES x STAGE

  const int u_begin = (int)blockIdx.x * p.per_block, u_end = min(u_begin + p.per_block, p.units);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int mt = warp % QA_LT_WM, nh = warp / QA_LT_WM;  // the warp's 16 rows and CW columns of a tile

  // tile u's y and t into ring slot `slot` (zero-filled past M, N and R); one commit group per call, empty or not,
  // so that group i is always tile u_begin + i
  auto issue = [&](int u, int slot) {
    if (u < u_end) {
      int pi, m0, n0;
      const LoraProblem q = qa_lt_locate(p, u, pi, m0, n0);
      qa_u16* ys = ring + slot * STAGE;
      qa_u16* ts = ys + QA_LT_BM * QA_LT_YP;
      const qa_u16* y = static_cast<const qa_u16*>(q.y);
      const qa_u16* t = static_cast<const qa_u16*>(q.t);
      constexpr int YPIECES = QA_LT_BM * (QA_LT_BN / 8), TPIECES = QA_LT_BM * (RP / 8);
#pragma unroll
      for (int it = 0; it < YPIECES / QA_LA_THREADS; ++it) {
        const int c = (int)threadIdx.x + it * QA_LA_THREADS;
        const int r = c / (QA_LT_BN / 8), k = (c % (QA_LT_BN / 8)) * 8;
        const bool ok = m0 + r < q.M && n0 + k < q.N;
        qa_cp_async16(ys + r * QA_LT_YP + k, ok ? y + (qa_i64)(m0 + r) * q.ys + n0 + k : y, ok);
      }
#pragma unroll
      for (int it = 0; it < (TPIECES + QA_LA_THREADS - 1) / QA_LA_THREADS; ++it) {
        const int c = (int)threadIdx.x + it * QA_LA_THREADS;
        if (c >= TPIECES) break;
        const int r = c / (RP / 8), k = (c % (RP / 8)) * 8;
        const bool ok = m0 + r < q.M && k < q.R;
        qa_cp_async16(ts + r * LD + k, ok ? t + (qa_i64)(m0 + r) * q.ts + k : t, ok);
      }
    }
    qa_cp_async_commit();
  };

  float scale = 0.f, inv = 0.f;
  if constexpr (ACT == 1) qa_fp8_scales(p.amax, 1, scale, inv);
  S* ao = static_cast<S*>(p.act_out);

#pragma unroll
  for (int s = 0; s < QA_LT_STAGES - 1; ++s) issue(u_begin + s, s);
  int staged = -1;  // (problem, column range) whose lora_B rows are in bsm
  for (int u = u_begin, i = 0; u < u_end; ++u, ++i) {
    qa_cp_async_wait<QA_LT_STAGES - 2>();  // tile u has landed (this thread's pieces) ...
    __syncthreads();                       // ... everyone's; and the slot refilled below is free
    issue(u + QA_LT_STAGES - 1, (i + QA_LT_STAGES - 1) % QA_LT_STAGES);
    int pi, m0, n0;
    const LoraProblem q = qa_lt_locate(p, u, pi, m0, n0);
    const int key = pi * (1 << 24) + n0 / QA_LT_BN;
    if (key != staged) {  // uniform over the block; everyone is past the last tile's reads of bsm
      qa_la_stage_b(bsm, LD, SWM, static_cast<const qa_u16*>(q.b), q.bs, n0, QA_LT_BN, q.N, q.R, RP, true);
      __syncthreads();
      staged = key;
    }
    const qa_u16* ys = ring + (i % QA_LT_STAGES) * STAGE;
    const qa_u16* ts = ys + QA_LT_BM * QA_LT_YP;

    unsigned a[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // a0: (g, k), a1: (g + 8, k), a2/a3: k + 8 (lora_add_kernel's fragments)
        const int r = mt * 16 + g + (j & 1) * 8, k = ks * 16 + 2 * tq + (j >> 1) * 8;
        a[ks][j] = *reinterpret_cast<const unsigned*>(ts + r * LD + k);
      }
    }
    float acc[QA_LT_NT][4];
#pragma unroll
    for (int ni = 0; ni < QA_LT_NT; ++ni) acc[ni][0] = acc[ni][1] = acc[ni][2] = acc[ni][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int ni = 0; ni < QA_LT_NT; ++ni) {
        const int row = nh * QA_LT_CW + qa_la_col(ni, g);
        const qa_u16* br = bsm + row * LD + ((ks ^ ((row >> 3) & SWM)) << 4) + 2 * tq;
        QaMma<T>::run(acc[ni], a[ks], *reinterpret_cast<const unsigned*>(br),
                      *reinterpret_cast<const unsigned*>(br + 8));
      }
    }
    S* y = static_cast<S*>(q.y);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = mt * 16 + g + h * 8, m = m0 + r;
      if (m >= q.M) continue;
#pragma unroll
      for (int half = 0; half < QA_LT_CW / 32; ++half) {
        const int cl = nh * QA_LT_CW + half * 32 + tq * 8, c = n0 + cl;  // this run's first column
        if (c >= q.N) continue;                                     // N % 8 == 0: a run is whole or absent
        const QaVec<S, 8> yv = *reinterpret_cast<const QaVec<S, 8>*>(ys + r * QA_LT_YP + cl);
        const QaVec<S, 8> o = qa_la_sum_run<T>(yv, acc, half, h, q.alpha);
        const qa_i64 at = (qa_i64)m * q.ys + c;
        if constexpr (ACT == 0) {
          *reinterpret_cast<QaVec<S, 8>*>(y + at) = o;
        } else {  // contiguous y: q.ys == q.N
          const QaVec<S, 8> gv = qa_la_gelu_run<T>(o);
          qa_store_fp8<T, 8>(p.codes + at, true, gv, scale);
          if (ao) *reinterpret_cast<QaVec<S, 8>*>(ao + at) = gv;
        }
      }
    }
  }
  qa_cp_async_wait<0>();  // nothing left in flight at exit (the groups past u_end are empty)
}
