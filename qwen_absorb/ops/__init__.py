"""qwen_absorb.ops: fused CUDA kernels (CuPy/NVRTC) for Qwen-Image block chains, with exact torch
references. Each op dispatches to its kernel when ``not_supported_reasons`` is empty, else to its
reference, which is the diffusers eager expression itself.

- :func:`layer_norm_scale_shift`                 LayerNorm(x) * (1 + scale) + shift
- :func:`bias_residual_layer_norm_scale_shift`   r + gate * (x + bias), then LayerNorm(Q(.)) * (1 + scale) + shift
- :func:`bias_gate_residual`                     r + gate * (x + bias)

Force the references with ``force_reference=True`` or ``QWEN_ABSORB_FORCE_REFERENCE=1``.
"""

from . import _custom_ops  # noqa: F401  (registers torch.ops.qwen_absorb.*)
from ._eligibility import FORCE_REFERENCE_ENV, kernel_runtime_reasons
from .bias_gate_residual import bias_gate_residual, bias_gate_residual_reference
from .bias_gate_residual import not_supported_reasons as bias_gate_residual_not_supported_reasons
from .bias_residual_layer_norm_scale_shift import (
    bias_residual_layer_norm_scale_shift,
    bias_residual_layer_norm_scale_shift_reference,
)
from .bias_residual_layer_norm_scale_shift import (
    not_supported_reasons as bias_residual_layer_norm_scale_shift_not_supported_reasons,
)
from .fp8 import Fp8PerTensorQuant
from .layer_norm_scale_shift import layer_norm_scale_shift, layer_norm_scale_shift_reference
from .layer_norm_scale_shift import not_supported_reasons as layer_norm_scale_shift_not_supported_reasons

__all__ = [
    "FORCE_REFERENCE_ENV",
    "Fp8PerTensorQuant",
    "bias_gate_residual",
    "bias_gate_residual_not_supported_reasons",
    "bias_gate_residual_reference",
    "bias_residual_layer_norm_scale_shift",
    "bias_residual_layer_norm_scale_shift_not_supported_reasons",
    "bias_residual_layer_norm_scale_shift_reference",
    "kernel_runtime_reasons",
    "layer_norm_scale_shift",
    "layer_norm_scale_shift_not_supported_reasons",
    "layer_norm_scale_shift_reference",
]
