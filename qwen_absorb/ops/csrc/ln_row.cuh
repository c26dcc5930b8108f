// The per-row driver of a LayerNorm-family kernel: one block per row in PyTorch's layout
// (layer_norm.cuh: QaLn<MODE> threads, CH elements per slot, its Welford order), with the op's own
// input and output steps passed in; every LayerNorm kernel runs on it, and QaLnEmit (below) is the
// emit step of all of them.
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
#include "fp8.cuh"
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

// A LayerNorm input read from memory (qa_ln_row's `produce` or `reread`): slot c of the row at
// element offset `off`, widened, then Q: the identity (quant_mode 0), or ModelOpt's FP8 per-tensor
// fake quantization of the norm's input (quant_mode 1/2 with the amax at `amax`, QuantLayerNorm's
// input quantizer). vec_flags bit 1: the rows are vector-aligned.
template <class T>
struct QaLnInput {
  typedef typename T::storage S;
  const S* in;
  bool vec;
  int quant_mode;
  float qscale = 1.f, qinv = 1.f;

  __device__ __forceinline__ QaLnInput(const void* base, qa_i64 off, int vec_flags, const float* amax = nullptr,
                                       int quant_mode_ = 0)
      : in(reinterpret_cast<const S*>(base) + off), vec(vec_flags & 1), quant_mode(quant_mode_) {
    if (quant_mode != 0) qa_fp8_scales(amax, quant_mode, qscale, qinv);
  }

  template <int CH>
  __device__ __forceinline__ void operator()(int c, float (&v)[CH]) const {
    qa_load_quant<T, CH>(in + c * CH, vec, quant_mode, qscale, qinv, v);
  }
};

// The emit step of every LayerNorm kernel (qa_ln_row's `emit`): slot c's modulated output
// LayerNorm(v) * (1 + scale) [+ shift] (qa_modulated, diffusers' roundings), written to `out` in the
// tensor dtype (skipped when null) and/or to `out_fp8` as the e4m3 codes of the same rounded values
// under the per-tensor amax at `out_amax` (the FP8 input of the consumer linears when they run as
// real FP8 GEMMs). Output rows at element offset `off`; the scale (and shift) row at its offset.
// vec_flags (checked on the host): 1 activation rows vector-aligned, 2 the shift row, 4 the scale row.
template <class T, int MODE, bool SHIFT>
struct QaLnEmit {
  typedef typename T::storage S;
  S* out;
  unsigned char* f8;
  const S* sc;
  const S* sh;
  bool vx, vsc, vsh;
  float f8scale = 1.f;

  __device__ __forceinline__ QaLnEmit(void* out_base, unsigned char* f8_base, const float* out_amax, qa_i64 off,
                                      int vec_flags, const void* scale, qa_i64 scale_off,
                                      const void* shift = nullptr, qa_i64 shift_off = 0)
      : out(out_base ? reinterpret_cast<S*>(out_base) + off : nullptr), f8(f8_base ? f8_base + off : nullptr),
        sc(reinterpret_cast<const S*>(scale) + scale_off),
        sh(SHIFT ? reinterpret_cast<const S*>(shift) + shift_off : nullptr), vx(vec_flags & 1),
        vsc(vec_flags & 4), vsh(vec_flags & 2) {
    float f8inv = 1.f;
    if (f8) qa_fp8_scales(out_amax, 1, f8scale, f8inv);
  }

  template <int CH>
  __device__ __forceinline__ void operator()(int c, const float (&v)[CH], float mean, float rstd) const {
    const QaVec<S, CH> scv = qa_load_raw<T, CH>(sc + c * CH, vsc);
    QaVec<S, CH> shv = {};
    if constexpr (SHIFT) shv = qa_load_raw<T, CH>(sh + c * CH, vsh);
    const QaVec<S, CH> o = qa_modulated<T, MODE, CH, SHIFT>(v, mean, rstd, scv, shv);
    if (out) qa_store_raw<T, CH>(out + c * CH, vx, o);
    if (f8) qa_store_fp8<T, CH>(f8 + c * CH, vx, o, f8scale);
  }
};
