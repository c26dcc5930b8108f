// Shared device code of the LoRA branch kernels (lora_add.cu, lora_add_tiles.cu): the problem record of one
// output, the m16n8k16 tensor-core step, lora_B's staging into shared memory and the column order that gives each
// thread runs of 8 adjacent outputs. Both kernels run the same mma sequence per output element (k steps in order,
// fp32 accumulators), so their sums are bit for bit the same.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "activation.cuh"

#define QA_LA_THREADS 256
#define QA_LA_BM 128
#define QA_LA_SMEM (256 * 72)  // lora_B's staged rows: bnb * (16 KS + 8) elements at most
#define QA_LA_MAXP 6
#ifndef QA_LA_MIN_BLOCKS
#define QA_LA_MIN_BLOCKS 2  // <= 128 registers: KS = 8 holds 32 A registers; 3 (85 registers) spills there
#endif

struct LoraProblem {
  void* y;
  const void* t;
  const void* b;
  qa_i64 ys, ts, bs;  // row strides (elements)
  int M, N, R;
  int tiles_n;     // ceil(N / bnb)
  int tile_begin;  // this problem's first block
  int vec;         // 1: 16-byte B loads are legal (R % 8 == 0, aligned); 2: 16-byte y runs (N % 8 == 0, aligned)
  int bnb;         // columns per block: 256, 128 or 64 (bnb * (16 KS + 8) <= QA_LA_SMEM)
  float alpha;
};

struct LoraAddParams {
  LoraProblem p[QA_LA_MAXP];
  int nprob;
  int units;      // lora_add_tiles: the launch's tiles (all problems), and how many each block walks
  int per_block;
  unsigned char* codes;  // ACT 1: [M, N] e4m3
  void* act_out;         // ACT 1: [M, N] T, the rounded GELU output, or null
  const float* amax;     // ACT 1: the consumer's input amax (one fp32)
};

// D += A B on tensor cores, m16n8k16, fp32 accumulators; TY: the operands' PTX type.
template <class T>
struct QaMma;
#define QA_LA_MMA(TRAITS, TY)                                                                                   \
  template <>                                                                                                   \
  struct QaMma<TRAITS> {                                                                                        \
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) { \
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "      \
                   "{%8,%9}, {%0,%1,%2,%3};"                                                                    \
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                             \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                             \
    }                                                                                                           \
  };
QA_LA_MMA(QaBF16, "bf16")
QA_LA_MMA(QaF16, "f16")

// 16 bytes global -> shared without registers (zero-filled where !valid), and the group bookkeeping: the tiled
// kernels' rings (lora_add_tiles.cu, lora_gelu_fold.cu).
__device__ __forceinline__ void qa_cp_async16(void* dst, const void* src, bool valid) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void qa_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void qa_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// lora_B rows [n0, n0 + rows) x [0, R) into shared memory (pitch ld), zero-filled past N and R. Row r's 16-element
// group k lives at group k ^ ((r / 8) & swm): the fragment loads of a warp read rows {0, 1, 8, 9, 16, 17, 24, 25} +
// const (the column order below), which the pitch alone maps to 2 or 4 banks each; swizzled, they are
// conflict-free for ranks above 32.
__device__ __forceinline__ void qa_la_stage_b(qa_u16* dst, int ld, int swm, const qa_u16* src, qa_i64 bs, int n0,
                                              int rows, int N, int R, int rp, bool vec) {
  if (vec) {  // 8 elements per load; R % 8 == 0, so a vector is wholly inside or outside
    const int per_row = rp / 8;
    for (int i = threadIdx.x; i < rows * per_row; i += QA_LA_THREADS) {
      const int r = i / per_row, c = (i - r * per_row) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (n0 + r < N && c < R) v = *reinterpret_cast<const uint4*>(src + (qa_i64)(n0 + r) * bs + c);
      *reinterpret_cast<uint4*>(dst + r * ld + (c ^ (((r >> 3) & swm) << 4))) = v;
    }
  } else {
    for (int i = threadIdx.x; i < rows * rp; i += QA_LA_THREADS) {
      const int r = i / rp, c = i - r * rp;
      qa_u16 v = 0;
      if (n0 + r < N && c < R) v = src[(qa_i64)(n0 + r) * bs + c];
      dst[r * ld + (c ^ (((r >> 3) & swm) << 4))] = v;
    }
  }
}

// Output columns: the mma's column j of n8 tile ni is the chunk's column (ni / 4) * 32 + (j / 2) * 8 + 2 (ni % 4) +
// j % 2 (lora_B's rows are staged in that order), so that a thread's accumulators for one row are two runs of
// 8 adjacent columns, tq * 8 and 32 + tq * 8: y is read and written in 16-byte vectors, 64 contiguous bytes per
// row and instruction (the mma's own layout gives 4-byte pieces, and the kernel ran at ~1.4 TB/s).
__device__ __forceinline__ int qa_la_col(int ni, int j) { return (ni >> 2) * 32 + (j >> 1) * 8 + 2 * (ni & 3) + (j & 1); }


// One thread's run of 8 adjacent outputs of row h (0: g, 1: g + 8) from its accumulators (the qa_la_col order:
// run `half` holds n8 tiles 4 half .. 4 half + 3): y + alpha * acc, one fp32 fma rounded to T (ACT 0's output,
// and the sum ACT 1 feeds the GELU).
template <class T>
__device__ __forceinline__ QaVec<typename T::storage, 8> qa_la_sum_run(const QaVec<typename T::storage, 8>& yv,
                                                                     const float (*acc)[4], int half, int h,
                                                                     float alpha) {
  float yf[8];
  qa_widen<T, 8>(yv, yf);
  QaVec<typename T::storage, 8> o;
#pragma unroll
  for (int i = 0; i < 8; ++i) o.v[i] = T::store(__fmaf_rn(alpha, acc[half * 4 + (i >> 1)][2 * h + (i & 1)], yf[i]));
  return o;
}

// ACT 1: GELU_tanh of a rounded run, rounded to T (quantize_fp8.cu's ACT 1 before its e4m3 encode).
template <class T>
__device__ __forceinline__ QaVec<typename T::storage, 8> qa_la_gelu_run(const QaVec<typename T::storage, 8>& o) {
  QaVec<typename T::storage, 8> gv;
#pragma unroll
  for (int i = 0; i < 8; ++i) gv.v[i] = T::store(qa_gelu_tanh(T::load(o.v[i])));
  return gv;
}
