"""bias_residual_layer_norm_scale_shift: the attention residual, norm2 and its modulation, fused.

    new_residual = residual + gate * (x + bias)
    modulated    = LayerNorm(Q(new_residual)) * (1 + scale) + shift

``x`` is the attention output projection (``to_out[0]`` / ``to_add_out``) computed without its bias
when the bias is deferred (``bias`` given), or with it (``bias=None``). ``Q`` is the identity, or the
FP8 per-tensor fake quantization ModelOpt's ``QuantLayerNorm.input_quantizer`` applies before the
norm (``norm_input_quant``, see :mod:`qwen_absorb.ops.fp8`). ``new_residual`` is never quantized.
"""

from __future__ import annotations

import torch

from . import _cuda
from ._eligibility import common_reasons, force_reference_requested
from ._modulation import expand_param, layer_norm
from ._validate import check_activation, check_bias, check_eps, check_index, check_param, check_same
from .fp8 import QUANT_MODE, Fp8PerTensorQuant, as_fp8_quant


def bias_residual_layer_norm_scale_shift_reference(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, index: torch.Tensor | None = None,
    norm_input_quant=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The diffusers eager expressions, op for op (the bias added the way a separate add would)."""
    quant = as_fp8_quant(norm_input_quant)
    y = x + bias if bias is not None else x
    new_residual = residual + expand_param(gate, index) * y
    normed_in = quant.reference(new_residual) if quant is not None else new_residual
    modulated = layer_norm(normed_in, eps) * (1 + expand_param(scale, index)) + expand_param(shift, index)
    return new_residual, modulated


def _validate(residual, x, bias, gate, shift, scale, eps, index, norm_input_quant):
    check_activation("x", x)
    check_activation("residual", residual)
    check_same("residual", residual, x, "x")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
    eps = check_eps(eps)
    check_index(index, x)
    check_bias(bias, x)
    check_param("gate", gate, x, index)
    check_param("shift", shift, x, index)
    check_param("scale", scale, x, index)
    quant = as_fp8_quant(norm_input_quant)
    if quant is not None and quant.amax.device != x.device:
        raise ValueError(f"norm_input_quant.amax is on {quant.amax.device} but x is on {x.device}")
    return eps, quant


def not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, index: torch.Tensor | None = None,
    norm_input_quant=None, force_reference: bool = False,
) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(residual, x, bias, gate, shift, scale, eps, index, norm_input_quant)
    return common_reasons([x, residual, bias, gate, shift, scale], force_reference)


def bias_residual_layer_norm_scale_shift(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, index: torch.Tensor | None = None,
    norm_input_quant: Fp8PerTensorQuant | object | None = None, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(new_residual, modulated)``; see the module docstring.

    residual, x: [B, L, D]; bias: [D] or None; gate, shift, scale: [B, D] or [B, 1, D]
    (2B rows with ``index`` [B, L] of 0/1); norm_input_quant: None, an
    :class:`~qwen_absorb.ops.fp8.Fp8PerTensorQuant` or a ModelOpt FP8 per-tensor TensorQuantizer.
    """
    eps, quant = _validate(residual, x, bias, gate, shift, scale, eps, index, norm_input_quant)
    if common_reasons([x, residual, bias, gate, shift, scale], force_reference):
        return bias_residual_layer_norm_scale_shift_reference(
            residual, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=eps, index=index,
            norm_input_quant=quant,
        )
    amax, mode = _quant_args(quant, x.device)
    if torch.compiler.is_compiling():
        return torch.ops.qwen_absorb.bias_residual_layer_norm_scale_shift(
            residual, x, bias, gate, shift, scale, eps, index, amax, mode
        )
    return _cuda.bias_residual_layer_norm_scale_shift(
        residual.contiguous(), x.contiguous(), bias, gate, shift, scale, eps, index, amax, mode
    )


def _quant_args(quant: Fp8PerTensorQuant | None, device: torch.device):
    if quant is None:
        return None, 0
    return quant.amax_fp32(device), QUANT_MODE[quant.formula_for(device)]


def _custom_op_impl(residual, x, bias, gate, shift, scale, eps, index, amax, mode):
    """Body of the registered custom op (eager, opaque to the compiler)."""
    if x.device.type != "cuda" or force_reference_requested() or common_reasons([x]):
        quant = None
        if mode:
            quant = Fp8PerTensorQuant(amax, formula={1: "cuda_ext", 2: "eager"}[mode])
        return bias_residual_layer_norm_scale_shift_reference(
            residual, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=eps, index=index,
            norm_input_quant=quant,
        )
    return _cuda.bias_residual_layer_norm_scale_shift(
        residual.contiguous(), x.contiguous(), bias, gate, shift, scale, eps, index, amax, mode
    )
