"""layer_norm_scale_shift: ``LayerNorm(x) * (1 + scale) + shift`` (norm1 + modulation).

Replaces ``img_norm1``/``txt_norm1`` followed by ``_modulate`` in QwenImageTransformerBlock.
"""

from __future__ import annotations

import torch

from . import _cuda
from ._eligibility import common_reasons, force_reference_requested
from ._modulation import expand_param, layer_norm
from ._validate import check_activation, check_eps, check_index, check_param


def layer_norm_scale_shift_reference(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The diffusers eager expression, op for op."""
    return layer_norm(x, eps) * (1 + expand_param(scale, index)) + expand_param(shift, index)


def _validate(x, shift, scale, eps, index) -> float:
    check_activation("x", x)
    eps = check_eps(eps)
    check_index(index, x)
    check_param("shift", shift, x, index)
    check_param("scale", scale, x, index)
    return eps


def not_supported_reasons(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(x, shift, scale, eps, index)
    return common_reasons([x, shift, scale], force_reference)


def layer_norm_scale_shift(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> torch.Tensor:
    """``LayerNorm(x, eps, no affine) * (1 + scale) + shift``, fused on CUDA.

    x: [B, L, D]; shift, scale: [B, D] or [B, 1, D] (2B rows with ``index`` [B, L] of 0/1).
    """
    eps = _validate(x, shift, scale, eps, index)
    if common_reasons([x, shift, scale], force_reference):
        return layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
    if torch.compiler.is_compiling():
        return torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index)
    return _cuda.layer_norm_scale_shift(x.contiguous(), shift, scale, eps, index)


def _custom_op_impl(x, shift, scale, eps, index):
    """Body of the registered custom op (eager, opaque to the compiler)."""
    if x.device.type != "cuda" or force_reference_requested() or common_reasons([x]):
        return layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
    return _cuda.layer_norm_scale_shift(x.contiguous(), shift, scale, eps, index)

