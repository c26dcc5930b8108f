// lora_gelu_fold: lora_add_tiles.cu's ACT 1 (net[0]'s last LoRA branch added inside the GELU(tanh) + e4m3
// quantization that feeds net[2]) with net[2]'s own lora_A product folded in: the GELU output g, which only
// net[2]'s branch needs in 16 bits, is multiplied by net[2]'s lora_A weight (A2, [R2, N]) while it is still in
// registers, so it is never written nor read back (2 x M x N x 2 bytes per block: 200 MB at 4096 x 12288).
//
// The codes are lora_add_tiles.cu's bit for bit: every output element sees the same mma sequence (k steps of
// lora_B in order from zero) and the same rounding, GELU and encode.
//
// The product g @ A2^T needs whole rows of g, so a block walks along a row band: block b takes rows
// [128 (b / S), +128) and the column tiles [b % S * per_block, +per_block) (per_block = tiles_n / S). Each warp
// keeps its 16 rows x R2 partial sums in fp32 registers across the walk. The accumulator fragment of the lora_B
// mma is, after the GELU and its rounding, already the A fragment of the next mma (two n8 column tiles = one k16
// step), so g goes from registers to tensor cores directly. The column order inside a k step is a permutation of
// the tile's columns; A2's slice is read in the same order, so the sum is over the same products.
// At the end the two warps of a row group add their partials (in that order) and the block writes them to
// part[S][M][R2] (fp32); lora_fold_reduce_kernel adds the S partials in order and rounds once to T.
// Summation order differs from a cuBLAS GEMM (fp32 accumulation on tensor cores either way): the rounded product
// can differ from F.linear(g, A2) in its last bit (tests/test_lora_fold_gpu.py bounds it).
//
// Per ring stage (cp.async, QA_LF_STAGES deep): the y tile (128 x 128), lora_B's 128 rows for the tile's
// columns and A2's R2 x 128 slice (both from L2: 1.5 MB each at N = 12288, rank 64). The t fragments of a
// warp's 16 rows do not change along the walk: they are read once from global memory into registers.
//
// Needs (checked on the host): y contiguous, N % 128 == 0, R % 8 == 0 and R <= 64, R2 % 8 == 0 and R2 <= 64,
// rows of t, lora_B and A2 16-byte aligned.
#include "lora_mma.cuh"

#define QA_LF_THREADS 512
#define QA_LF_BM 128               // rows per tile: 8 warps down x 16 rows
#define QA_LF_BN 128               // columns per tile: 2 warps across x 64 columns
#define QA_LF_YP (QA_LF_BN + 32)   // y's shared pitch (lora_add_tiles.cu's)
#define QA_LF_AP (QA_LF_BN + 32)   // A2's shared pitch: rows 16 words apart mod 32, the 8-byte fragment reads of a
                                   // half warp (4 rows x 4 pieces) hit every bank twice (the least: each piece sits
                                   // at the same 8 bytes of a 16-byte cp.async unit)
#ifndef QA_LF_STAGES
#define QA_LF_STAGES 2
#endif

struct LoraFoldParams {
  const void* y;      // [M, N] net[0]'s GEMM output, contiguous
  const void* t;      // [M, R] net[0]'s lora_A product
  const void* b;      // [N, R] net[0]'s lora_B weight
  const void* a2;     // [R2, N] net[2]'s lora_A weight
  float* part;        // [S, M, R2] partial products
  unsigned char* codes;  // [M, N] e4m3
  const float* amax;  // net[2]'s input amax (one fp32)
  qa_i64 ts, bs, a2s;  // row strides (elements)
  int M, N, R, R2;
  int tiles_n, per_block, S;
  float alpha;
};

template <class T, int KS, int NA>
__global__ void __launch_bounds__(QA_LF_THREADS, 1) lora_gelu_fold_kernel(const LoraFoldParams p) {
  typedef typename T::storage S;
  extern __shared__ __align__(16) unsigned char qa_lf_smem[];
  constexpr int RP = 16 * KS;  // net[0]'s rank padded to the mma's k steps
  constexpr int LD = RP + 8;   // lora_B's shared pitch (lora_add_tiles.cu's, with its swizzle)
  constexpr int SWM = KS >= 4 ? 3 : KS - 1;
  constexpr int RA = 8 * NA;   // net[2]'s rank padded to n8 tiles
  constexpr int STAGE = QA_LF_BM * QA_LF_YP + QA_LF_BN * LD + RA * QA_LF_AP;  // elements: y, lora_B, A2
  qa_u16* ring = reinterpret_cast<qa_u16*>(qa_lf_smem);

  const int band = (int)blockIdx.x / p.S, seg = (int)blockIdx.x - band * p.S;
  const int m0 = band * QA_LF_BM;
  const int c_begin = seg * p.per_block, c_end = min(c_begin + p.per_block, p.tiles_n);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int mt = warp & 7, nh = warp >> 3;  // the warp's 16 rows and 64 columns of a tile
  const qa_u16* y = static_cast<const qa_u16*>(p.y);
  const qa_u16* bw = static_cast<const qa_u16*>(p.b);
  const qa_u16* a2 = static_cast<const qa_u16*>(p.a2);

  // column tile ct's y tile, lora_B rows and A2 slice into ring slot `slot` (zero past M and R2; lora_B's rows
  // past R are zero-filled as qa_la_stage_b does); one commit group per call, empty or not
  auto issue = [&](int ct, int slot) {
    if (ct < c_end) {
      const int n0 = ct * QA_LF_BN;
      qa_u16* ys = ring + slot * STAGE;
      qa_u16* bsm = ys + QA_LF_BM * QA_LF_YP;
      qa_u16* asm_ = bsm + QA_LF_BN * LD;
      constexpr int YPIECES = QA_LF_BM * (QA_LF_BN / 8), BPIECES = QA_LF_BN * (RP / 8),
                    APIECES = RA * (QA_LF_BN / 8);
#pragma unroll
      for (int it = 0; it < YPIECES / QA_LF_THREADS; ++it) {
        const int c = (int)threadIdx.x + it * QA_LF_THREADS;
        const int r = c / (QA_LF_BN / 8), k = (c % (QA_LF_BN / 8)) * 8;
        const bool ok = m0 + r < p.M;
        qa_cp_async16(ys + r * QA_LF_YP + k, ok ? y + (qa_i64)(m0 + r) * p.N + n0 + k : y, ok);
      }
#pragma unroll
      for (int it = 0; it < (BPIECES + QA_LF_THREADS - 1) / QA_LF_THREADS; ++it) {
        const int c = (int)threadIdx.x + it * QA_LF_THREADS;
        if (c >= BPIECES) break;
        const int r = c / (RP / 8), k = (c % (RP / 8)) * 8;
        const bool ok = k < p.R;
        qa_cp_async16(bsm + r * LD + (k ^ (((r >> 3) & SWM) << 4)), ok ? bw + (qa_i64)(n0 + r) * p.bs + k : bw, ok);
      }
#pragma unroll
      for (int it = 0; it < (APIECES + QA_LF_THREADS - 1) / QA_LF_THREADS; ++it) {
        const int c = (int)threadIdx.x + it * QA_LF_THREADS;
        if (c >= APIECES) break;
        const int r = c / (QA_LF_BN / 8), k = (c % (QA_LF_BN / 8)) * 8;
        const bool ok = r < p.R2;
        qa_cp_async16(asm_ + r * QA_LF_AP + k, ok ? a2 + (qa_i64)r * p.a2s + n0 + k : a2, ok);
      }
    }
    qa_cp_async_commit();
  };

#pragma unroll
  for (int s = 0; s < QA_LF_STAGES - 1; ++s) issue(c_begin + s, s);

  // t's fragments for the warp's rows (lora_add_tiles.cu's, read from global memory once)
  const qa_u16* t = static_cast<const qa_u16*>(p.t);
  unsigned a[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int m = m0 + mt * 16 + g + (j & 1) * 8, k = ks * 16 + 2 * tq + (j >> 1) * 8;
      a[ks][j] = (m < p.M && k < p.R) ? *reinterpret_cast<const unsigned*>(t + (qa_i64)m * p.ts + k) : 0u;
    }
  }
  float scale = 0.f, inv = 0.f;
  qa_fp8_scales(p.amax, 1, scale, inv);
  float accA[NA][4];
#pragma unroll
  for (int nt = 0; nt < NA; ++nt) accA[nt][0] = accA[nt][1] = accA[nt][2] = accA[nt][3] = 0.f;

  for (int ct = c_begin, i = 0; ct < c_end; ++ct, ++i) {
    qa_cp_async_wait<QA_LF_STAGES - 2>();  // tile ct has landed (this thread's pieces) ...
    __syncthreads();                       // ... everyone's; and the slot refilled below is free
    issue(ct + QA_LF_STAGES - 1, (i + QA_LF_STAGES - 1) % QA_LF_STAGES);
    const int n0 = ct * QA_LF_BN;
    const qa_u16* ys = ring + (i % QA_LF_STAGES) * STAGE;
    const qa_u16* bsm = ys + QA_LF_BM * QA_LF_YP;
    const qa_u16* asm_ = bsm + QA_LF_BN * LD;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // the warp's columns as two runs of 32 (n8 tiles 4 half .. 4 half + 3)
      float acc[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int row = nh * 64 + qa_la_col(half * 4 + j, g);
          const qa_u16* br = bsm + row * LD + ((ks ^ ((row >> 3) & SWM)) << 4) + 2 * tq;
          QaMma<T>::run(acc[j], a[ks], *reinterpret_cast<const unsigned*>(br),
                        *reinterpret_cast<const unsigned*>(br + 8));
        }
      }
      const int cl = nh * 64 + half * 32 + tq * 8;  // this thread's run of 8 columns in the tile
      QaVec<S, 8> gv[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = mt * 16 + g + h * 8, m = m0 + r;
        const QaVec<S, 8> yv = *reinterpret_cast<const QaVec<S, 8>*>(ys + r * QA_LF_YP + cl);
        gv[h] = qa_la_gelu_run<T>(qa_la_sum_run<T>(yv, acc, 0, h, p.alpha));
        if (m < p.M) qa_store_fp8<T, 8>(p.codes + (qa_i64)m * p.N + n0 + cl, true, gv[h], scale);
      }
      // g @ A2^T: k step q takes the run's elements 4q .. 4q + 3 (positions 2 tq, 2 tq + 1, 2 tq + 8, 2 tq + 9 of
      // the mma's k16), rows g and g + 8; A2's matching columns cl + 4q .. cl + 4q + 3, one 8-byte read per n8 tile
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const unsigned af[4] = {qa_pair(gv[0], 2 * q), qa_pair(gv[1], 2 * q), qa_pair(gv[0], 2 * q + 1),
                                qa_pair(gv[1], 2 * q + 1)};
#pragma unroll
        for (int nt = 0; nt < NA; ++nt) {
          const uint2 bf = *reinterpret_cast<const uint2*>(asm_ + (nt * 8 + g) * QA_LF_AP + cl + 4 * q);
          QaMma<T>::run(accA[nt], af, bf.x, bf.y);
        }
      }
    }
  }
  qa_cp_async_wait<0>();
  __syncthreads();  // every warp is past its last reads of the ring: it holds the exchange below

  // the two warps of a row group: nh 1's partials through shared memory, added to nh 0's (in that order)
  float* xch = reinterpret_cast<float*>(qa_lf_smem);  // [8][NA][4][32]
  if (nh == 1) {
#pragma unroll
    for (int nt = 0; nt < NA; ++nt)
#pragma unroll
      for (int j = 0; j < 4; ++j) xch[((mt * NA + nt) * 4 + j) * 32 + lane] = accA[nt][j];
  }
  __syncthreads();
  if (nh == 0) {
    float* part = p.part + (qa_i64)seg * p.M * p.R2;
#pragma unroll
    for (int nt = 0; nt < NA; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // c0, c1: row g, columns 2 tq, 2 tq + 1; c2, c3: row g + 8
        const int m = m0 + mt * 16 + g + h * 8, col = nt * 8 + 2 * tq;
        if (m >= p.M || col >= p.R2) continue;  // R2 % 8 == 0: both columns or neither
        float2 v;
        v.x = accA[nt][2 * h] + xch[((mt * NA + nt) * 4 + 2 * h) * 32 + lane];
        v.y = accA[nt][2 * h + 1] + xch[((mt * NA + nt) * 4 + 2 * h + 1) * 32 + lane];
        *reinterpret_cast<float2*>(part + (qa_i64)m * p.R2 + col) = v;
      }
    }
  }
}

struct LoraFoldReduceParams {
  const float* part;  // [S, n]
  void* out;          // [n] T
  qa_i64 n;
  int S;
};

// out = T(part[0] + part[1] + ... + part[S - 1]), summed in that order in fp32 and rounded once
template <class T>
__global__ void lora_fold_reduce_kernel(const LoraFoldReduceParams p) {
  const qa_i64 i = (qa_i64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  float s = p.part[i];
  for (int k = 1; k < p.S; ++k) s += p.part[(qa_i64)k * p.n + i];
  static_cast<typename T::storage*>(p.out)[i] = T::store(s);
}
