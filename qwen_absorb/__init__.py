"""qwen_absorb: fused CUDA kernels for diffusers' Qwen-Image transformer blocks."""

from . import ops

__all__ = ["ops"]
