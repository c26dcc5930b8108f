// lora_add: the LoRA branch of a linear added to its output in place, y += alpha * t @ B^T, on tensor cores.
//
//   t: [M, R] the lora_A product (x @ A^T, in T), B: [N, R] lora_B's weight (T), y: [M, N] the base output (T).
//   ACT 0: y[m, n] = T(fma(alpha, acc[m, n], y[m, n]))  with acc = sum_r t[m, r] * B[n, r] in fp32
//          (torch.addmm_(y, t, B.T, alpha=alpha)'s expression: the product accumulated in fp32, scaled and added
//          to y, one rounding; the accumulation order is the tensor cores', not cuBLAS's);
//   ACT 1: h = that sum rounded to T (not stored), then GELU_tanh(h) rounded to T and its e4m3 codes under
//          amax (quantize_fp8.cu's ACT 1 on h, bit for bit): net[0].proj's branch fused into the quantization
//          that feeds net[2]; the rounded GELU output goes to act_out where net[2]'s own LoRA branch reads it.
//
// Why: the branch is rank-small, so the work is memory traffic. The ACT 1 form saves the sum's write and the GELU
// kernel's read of it. This kernel takes any layout but reaches only ~1.8-2.1 TB/s (152 against 158 us for addmm_ +
// the quantization at 4096 x 12288, H200); lora_add_tiles.cu computes the same sums bit for bit at ~3 TB/s where
// rows are 16-byte aligned and widths and ranks multiples of 8 (the launcher picks it there). Up to QA_LA_MAXP
// problems with distinct outputs share one launch (ACT 0, which only the GPU tests run: it lost to addmm_ in the call).
//
// Tiles: a block is 8 warps of 16 rows each (128 rows) over a range of bnb columns (256 for ranks <= 64, 128 up to
// 128; 64 for short problems, which need blocks more than reuse). KS = rank / 16 rounded up (1, 2, 4 or 8): each
// warp holds the A fragments of its rows for the whole rank in registers, lora_B's rows for the range are staged in
// shared memory once (zero-filled past R and N: zeros add nothing to the fp32 sums), and the warp walks the range in
// chunks of 64 columns, mma.sync m16n8k16 with fp32 accumulators, the next chunk's y loaded before this chunk's
// products. All first loads are issued before anything waits (a loop of dependent global loads cost 15 us a call).
#include "lora_mma.cuh"

// y's 8-element run of row m from column c (zeros past M and N): one 16-byte load where `vec` and whole.
template <class S>
__device__ __forceinline__ QaVec<S, 8> qa_la_load_run(const S* y, qa_i64 ys, int m, int M, int c, int N, bool vec) {
  QaVec<S, 8> v;
  if (m < M && vec && c + 8 <= N) return *reinterpret_cast<const QaVec<S, 8>*>(y + (qa_i64)m * ys + c);
#pragma unroll
  for (int i = 0; i < 8; ++i) v.v[i] = (m < M && c + i < N) ? y[(qa_i64)m * ys + c + i] : (S)0;
  return v;
}

template <class S>
__device__ __forceinline__ void qa_la_load_y(QaVec<S, 8> (&yr)[2][2], const S* y, qa_i64 ys, const int (&mrow)[2],
                                             int M, int N, int nbase, int tq, bool vec) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int half = 0; half < 2; ++half) yr[h][half] = qa_la_load_run<S>(y, ys, mrow[h], M, nbase + half * 32 + tq * 8, N, vec);
  }
}

template <class T, int ACT, int KS>
__global__ void __launch_bounds__(QA_LA_THREADS, QA_LA_MIN_BLOCKS) lora_add_kernel(const LoraAddParams p) {
  typedef typename T::storage S;
  __shared__ __align__(16) qa_u16 bsm[QA_LA_SMEM];
  constexpr int RP = 16 * KS;  // the rank padded to the mma's k steps
  constexpr int LD = RP + 8;   // shared pitch (elements)
  constexpr int SWM = KS >= 4 ? 3 : KS - 1;  // the swizzle's group mask (qa_la_stage_b)

  int pi = 0;
#pragma unroll
  for (int i = 1; i < QA_LA_MAXP; ++i) {
    if (i < p.nprob && (int)blockIdx.x >= p.p[i].tile_begin) pi = i;
  }
  const LoraProblem q = p.p[pi];
  const int bnb = q.bnb;  // columns per block: a multiple of 64, bnb * LD <= QA_LA_SMEM
  const int tile = (int)blockIdx.x - q.tile_begin;
  const int tm = tile / q.tiles_n;
  const int m0 = tm * QA_LA_BM, n0 = (tile - tm * q.tiles_n) * bnb;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const bool vec = (q.vec & 2) != 0;  // y rows 16-byte aligned, N % 8 == 0 (and codes 8-byte aligned)
  const int mrow[2] = {m0 + warp * 16 + g, m0 + warp * 16 + g + 8};
  S* y = static_cast<S*>(q.y);

  // every load this warp needs first is issued before anything waits: y of the first chunk, the A fragments
  // of its 16 rows (registers for the whole block: t is read once), lora_B's rows for the block's columns
  QaVec<S, 8> ycur[2][2];
  qa_la_load_y<S>(ycur, y, q.ys, mrow, q.M, q.N, n0, tq, vec);
  unsigned a[KS][4];
  {
    const qa_u16* t = static_cast<const qa_u16*>(q.t);
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int m = mrow[j & 1], k = ks * 16 + 2 * tq + (j >> 1) * 8;  // a0: (g, k), a1: (g + 8, k), a2/a3: k + 8
        // R even and rows 4-byte aligned (checked on the host): a pair is wholly inside or outside
        a[ks][j] = (m < q.M && k < q.R) ? *reinterpret_cast<const unsigned*>(t + (qa_i64)m * q.ts + k) : 0u;
      }
    }
  }
  qa_la_stage_b(bsm, LD, SWM, static_cast<const qa_u16*>(q.b), q.bs, n0, bnb, q.N, q.R, RP, (q.vec & 1) != 0);
  __syncthreads();

  float scale = 0.f, inv = 0.f;
  if constexpr (ACT == 1) qa_fp8_scales(p.amax, 1, scale, inv);
  S* ao = static_cast<S*>(p.act_out);

  const int nchunks = min(bnb, q.N - n0 + 63) / 64;  // chunks holding at least one column < N
  for (int ch = 0; ch < nchunks; ++ch) {
    const int nbase = n0 + ch * 64;
    QaVec<S, 8> ynext[2][2];
    if (ch + 1 < nchunks) qa_la_load_y<S>(ynext, y, q.ys, mrow, q.M, q.N, nbase + 64, tq, vec);
    float acc[8][4];
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) acc[ni][0] = acc[ni][1] = acc[ni][2] = acc[ni][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const int row = ch * 64 + qa_la_col(ni, g);
        const qa_u16* br = bsm + row * LD + ((ks ^ ((row >> 3) & SWM)) << 4) + 2 * tq;
        QaMma<T>::run(acc[ni], a[ks], *reinterpret_cast<const unsigned*>(br),
                      *reinterpret_cast<const unsigned*>(br + 8));
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (mrow[h] >= q.M) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int c = nbase + half * 32 + tq * 8;  // this run's first column
        if (c >= q.N) continue;
        const bool whole = vec && c + 8 <= q.N;
        const qa_i64 e = (qa_i64)mrow[h] * q.ys + c;
        const QaVec<S, 8> o = qa_la_sum_run<T>(ycur[h][half], acc, half, h, q.alpha);
        if constexpr (ACT == 0) {
          if (whole) {
            *reinterpret_cast<QaVec<S, 8>*>(y + e) = o;
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              if (c + i < q.N) y[e + i] = o.v[i];
            }
          }
        } else {
          // codes / act_out are contiguous [M, N]: q.ys == q.N for ACT 1 (the host passes a contiguous y)
          const QaVec<S, 8> gv = qa_la_gelu_run<T>(o);
          if (whole) {
            qa_store_fp8<T, 8>(p.codes + e, true, gv, scale);
            if (ao) *reinterpret_cast<QaVec<S, 8>*>(ao + e) = gv;
          } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              if (c + i < q.N) {
                p.codes[e + i] = qa_fp8_encode(T::load(gv.v[i]), scale);
                if (ao) ao[e + i] = gv.v[i];
              }
            }
          }
        }
      }
    }
    if (ch + 1 < nchunks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ycur[h][0] = ynext[h][0];
        ycur[h][1] = ynext[h][1];
      }
    }
  }
}
