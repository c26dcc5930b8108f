// Activations as PyTorch computes them in fp32 (the caller rounds to the tensor dtype).
#pragma once

// PyTorch's GELU(tanh) in fp32 (aten ActivationGeluKernel.cu), in the same operation order.
__device__ __forceinline__ float qa_gelu_tanh(float x) {
  const float kBeta = (float)(1.4142135623730951 * 1.1283791670955126 * 0.5);
  const float kKappa = 0.044715f;
  const float x_cube = x * x * x;
  const float inner = kBeta * (x + kKappa * x_cube);
  return 0.5f * x * (1.f + tanhf(inner));
}

// PyTorch's SiLU in fp32 (aten ActivationSiluKernel.cu): x / (1 + exp(-x)).
__device__ __forceinline__ float qa_silu(float x) { return x / (1.f + expf(-x)); }
