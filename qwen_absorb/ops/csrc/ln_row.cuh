// The per-row driver of a LayerNorm-family kernel: one block per row in PyTorch's layout
// (layer_norm.cuh: QaLn<MODE> threads, CH elements per slot, its Welford order), with the op's own
// input and output steps passed in. Written once for the Qwen-Image-2.1 kernels; the two older
// LayerNorm kernels spell out the same loop.
//
//   produce(c, v): slot c's LayerNorm input (CH floats) into v; may write side outputs (a residual)
//   reread(c, v):  the same input again (NV == 0 only: the streaming variant keeps nothing)
//   emit(c, v, mean, rstd): slot c's outputs from its input and the row statistics
//
// NV > 0: each thread keeps its NV slots in registers between the statistics and the outputs
// (slots are filled in order, so the Welford count of each element is a compile-time constant);
// NV == 0: a strided loop for very wide rows that obtains every input twice.
#pragma once
#include "common.cuh"
#include "layer_norm.cuh"

template <int MODE, int NV, class Produce, class Reread, class Emit>
__device__ __forceinline__ void qa_ln_row(int D, float eps, Produce&& produce, Reread&& reread, Emit&& emit) {
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  __shared__ float smem[48];
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV > 0 ? NV : 1][CH];

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) produce(c, v[k]);
    }
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (tid + k * TH < nslots) {
#pragma unroll
        for (int i = 0; i < CH; ++i) {
          const int n = k * CH + i + 1;
          qa_welford_add<MODE>(w, v[k][i], (float)n, 1.0f / (float)n);
        }
      }
    }
  } else {
    int n = 0;
    for (int c = tid; c < nslots; c += TH) {
      float t[CH];
      produce(c, t);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, t[i], (float)n, __frcp_rn((float)n));
      }
    }
  }
  const float2 mr = qa_row_mean_rstd<MODE>(w, D, eps, smem);

  if (NV > 0) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = tid + k * TH;
      if (c < nslots) emit(c, v[k], mr.x, mr.y);
    }
  } else {
    for (int c = tid; c < nslots; c += TH) {
      float t[CH];
      reread(c, t);
      emit(c, t, mr.x, mr.y);
    }
  }
}
