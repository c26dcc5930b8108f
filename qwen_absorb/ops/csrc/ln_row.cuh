// The per-row driver of a LayerNorm-family kernel: one block per row in PyTorch's layout
// (layer_norm.cuh: QaLn<MODE> threads, CH elements per slot, its Welford order), with the op's own
// input and output steps passed in; every LayerNorm kernel runs on it, and QaLnEmit (below) is the
// emit step of all of them.
//
// Thread t owns the slots t, t + TH, t + 2 TH, ... of the row. The steps address a slot by `rel`, its
// distance in slots from the thread's first slot (k * TH for its k-th slot): they keep pointers to
// the thread's first slot, so in the unrolled loops every address is that pointer plus a constant
// (the LayerNorm kernels are bound by instruction issue, not by memory; per-slot 64-bit address
// arithmetic was a third of their instructions).
//   produce(rel, v): that slot's LayerNorm input (CH floats) into v; may write side outputs (a residual)
//   reread(rel, v):  the same input again (NV == 0 only: the streaming variant keeps nothing)
//   emit(rel, v, mean, rstd): the slot's outputs from its input and the row statistics
//
// NV > 0: each thread keeps its NV slots in registers between the statistics and the outputs
// (slots are filled in order, so the Welford count of each element is a compile-time constant).
// A full row (MODE 0, D == NV * TH * CH: every thread holds NV slots; Qwen-Image's 3072 and 2.1's
// 4096) also has compile-time counts in the reduction (qa_row_mean_rstd_full). NV == 0: a strided
// loop for very wide rows that obtains every input twice.
#pragma once
#include "common.cuh"
#include "fp8.cuh"
#include "layer_norm.cuh"
#include "nvfp4.cuh"

// The reduction's shared memory: one array per kernel, however many variants of the row code the
// kernel holds (a __shared__ declared in each template instance would be one array each).
__device__ __forceinline__ float* qa_ln_smem() {
  __shared__ float smem[48];
  return smem;
}

template <int MODE, int NV, bool FULL, class Produce, class Emit>
__device__ __forceinline__ void qa_ln_row_registers(int D, float eps, Produce& produce, Emit& emit) {
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  float* smem = qa_ln_smem();
  const int nslots = D / CH;
  const int tid = threadIdx.x;
  QaWelford w = {0.f, 0.f, 0.f};
  float v[NV][CH];
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (FULL || tid + k * TH < nslots) produce(k * TH, v[k]);
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (FULL || tid + k * TH < nslots) {
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        const int n = k * CH + i + 1;
        qa_welford_add<MODE>(w, v[k][i], (float)n, 1.0f / (float)n);
      }
    }
  }
  float2 mr;
  if constexpr (FULL) {
    mr = qa_row_mean_rstd_full<NV * CH>(w, eps, smem);
  } else {
    mr = qa_row_mean_rstd<MODE>(w, D, eps, smem);
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    if (FULL || tid + k * TH < nslots) emit(k * TH, v[k], mr.x, mr.y);
  }
}

// f(QaBool<FAST>{}), FAST: a full row in MODE 0 whose vec_flags include every bit of `needed` (the
// kernels then build their steps with constant flags, so the scalar fallbacks drop out, and run
// qa_ln_row<MODE, NV, true>). The common case in Qwen-Image: D = 3072, fresh aligned tensors.
template <int MODE, int NV, class F>
__device__ __forceinline__ void qa_ln_dispatch(int D, int vec_flags, int needed, F&& f) {
  if constexpr (MODE == 0 && NV > 0) {
    if (D == NV * QaLn<MODE>::THREADS * QaLn<MODE>::CH && (vec_flags & needed) == needed) {
      f(QaBool<true>{});
      return;
    }
  }
  f(QaBool<false>{});
}

// FULL: the caller has checked D == NV * TH * CH (qa_ln_dispatch).
template <int MODE, int NV, bool FULL = false, class Produce, class Reread, class Emit>
__device__ __forceinline__ void qa_ln_row(int D, float eps, Produce&& produce, Reread&& reread, Emit&& emit) {
  constexpr int TH = QaLn<MODE>::THREADS, CH = QaLn<MODE>::CH;
  if constexpr (NV > 0) {
    qa_ln_row_registers<MODE, NV, FULL && MODE == 0>(D, eps, produce, emit);
  } else {
    float* smem = qa_ln_smem();
    const int nslots = D / CH;
    const int tid = threadIdx.x;
    QaWelford w = {0.f, 0.f, 0.f};
    int n = 0;
    for (int rel = 0; tid + rel < nslots; rel += TH) {
      float t[CH];
      produce(rel, t);
#pragma unroll
      for (int i = 0; i < CH; ++i) {
        ++n;
        qa_welford_add<MODE>(w, t[i], (float)n, __frcp_rn((float)n));
      }
    }
    const float2 mr = qa_row_mean_rstd<MODE>(w, D, eps, smem);
    for (int rel = 0; tid + rel < nslots; rel += TH) {
      float t[CH];
      reread(rel, t);
      emit(rel, t, mr.x, mr.y);
    }
  }
}

// A LayerNorm input read from memory (qa_ln_row's `produce` or `reread`): this thread's slot `rel`
// (CH elements) of the row at element offset `off`, widened, then Q: the identity (quant_mode 0), or ModelOpt's FP8 per-tensor
// fake quantization of the norm's input (quant_mode 1/2 with the amax at `amax`, QuantLayerNorm's
// input quantizer). vec_flags bit 1: the rows are vector-aligned.
template <class T, int CH>
struct QaLnInput {
  typedef typename T::storage S;
  const S* in;
  bool vec;
  int quant_mode;
  float qscale = 1.f, qinv = 1.f;

  __device__ __forceinline__ QaLnInput(const void* base, qa_i64 off, int vec_flags, const float* amax = nullptr,
                                       int quant_mode_ = 0)
      : in(reinterpret_cast<const S*>(base) + off + threadIdx.x * CH), vec(vec_flags & 1), quant_mode(quant_mode_) {
    if (quant_mode != 0) qa_fp8_scales(amax, quant_mode, qscale, qinv);
  }

  __device__ __forceinline__ void operator()(int rel, float (&v)[CH]) const {
    qa_load_quant<T, CH>(in + rel * CH, vec, quant_mode, qscale, qinv, v);
  }
};

// The emit step of every LayerNorm kernel (qa_ln_row's `emit`): slot rel's modulated output
// LayerNorm(v) * (1 + scale) [+ shift] (qa_modulated, diffusers' roundings), written to `out` in the
// tensor dtype (skipped when null) and to the second output `out2` (skipped when null), computed from the
// same rounded values with the amax at `out2_amax`:
//   NVFP4 false: the e4m3 codes under that per-tensor amax (the FP8 input of the consumer linears when they
//                run as real FP8 GEMMs; bytes);
//   NVFP4 true:  ModelOpt's NVFP4 fake quantization in the tensor dtype (nvfp4.cuh; the consumer linears'
//                input when they run as NVFP4 fake-quant linears), bit for bit quantize_nvfp4 of `out`. A
//                16-element block is 4 adjacent lanes' slots in MODE 0 and 16 adjacent lanes' in MODE 1;
//                the host requires D % 16 == 0, so a lane group is always emitted together.
// Output rows at element offset `off`; the scale (and shift) row at its offset.
// vec_flags (checked on the host): 1 activation rows vector-aligned, 2 the shift row, 4 the scale row.
template <class T, int MODE, bool SHIFT, bool NVFP4 = false>
struct QaLnEmit {
  typedef typename T::storage S;
  static constexpr int CH_ = QaLn<MODE>::CH;
  S* out;
  unsigned char* f8;  // !NVFP4: the e4m3 codes
  S* q;               // NVFP4: the fake-quantized values
  const S* sc;
  const S* sh;
  bool vx, vsc, vsh;
  float qscale = 1.f;  // !NVFP4: 448 / amax; NVFP4: the second-level scale

  __device__ __forceinline__ QaLnEmit(void* out_base, void* out2_base, const float* out2_amax, qa_i64 off,
                                      int vec_flags, const void* scale, qa_i64 scale_off,
                                      const void* shift = nullptr, qa_i64 shift_off = 0)
      : out(out_base ? reinterpret_cast<S*>(out_base) + off + threadIdx.x * CH_ : nullptr),
        f8(!NVFP4 && out2_base ? reinterpret_cast<unsigned char*>(out2_base) + off + threadIdx.x * CH_ : nullptr),
        q(NVFP4 && out2_base ? reinterpret_cast<S*>(out2_base) + off + threadIdx.x * CH_ : nullptr),
        sc(reinterpret_cast<const S*>(scale) + scale_off + threadIdx.x * CH_),
        sh(SHIFT ? reinterpret_cast<const S*>(shift) + shift_off + threadIdx.x * CH_ : nullptr), vx(vec_flags & 1),
        vsc(vec_flags & 4), vsh(vec_flags & 2) {
    if constexpr (NVFP4) {
      qscale = qa_nvfp4_global_scale(out2_amax);
    } else {
      float f8inv = 1.f;
      if (f8) qa_fp8_scales(out2_amax, 1, qscale, f8inv);
    }
  }

  template <int CH>
  __device__ __forceinline__ void operator()(int rel, const float (&v)[CH], float mean, float rstd) const {
    const int e = rel * CH;
    const QaVec<S, CH> scv = qa_load_raw<T, CH>(sc + e, vsc);
    QaVec<S, CH> shv = {};
    if constexpr (SHIFT) shv = qa_load_raw<T, CH>(sh + e, vsh);
    const QaVec<S, CH> o = qa_modulated<T, MODE, CH, SHIFT>(v, mean, rstd, scv, shv);
    if (out) qa_store_raw<T, CH>(out + e, vx, o);
    if constexpr (NVFP4) {
      qa_store_nvfp4<T, CH>(q + e, vx, o, qscale);  // every lane of a block's group reaches this together
    } else {
      if (f8) qa_store_fp8<T, CH>(f8 + e, vx, o, qscale);
    }
  }
};
