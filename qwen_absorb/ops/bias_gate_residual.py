"""bias_gate_residual: ``residual + gate * (x + bias)`` (the FFN residual site).

``x`` is the FFN output projection (``net[2]``) computed without its bias when the bias is deferred
(``bias`` given) or with it (``bias=None``: then ``residual + gate * x``).
"""

from __future__ import annotations

import torch

from . import _cuda
from ._eligibility import common_reasons, force_reference_requested
from ._modulation import expand_param
from ._validate import check_activation, check_bias, check_index, check_param, check_same


def bias_gate_residual_reference(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The diffusers eager expression, op for op (the bias added the way a separate add would)."""
    y = x + bias if bias is not None else x
    return residual + expand_param(gate, index) * y


def _validate(residual, x, bias, gate, index) -> None:
    check_activation("x", x)
    check_activation("residual", residual)
    check_same("residual", residual, x, "x")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
    check_index(index, x)
    check_bias(bias, x)
    check_param("gate", gate, x, index)


def not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(residual, x, bias, gate, index)
    return common_reasons([x, residual, bias, gate], force_reference)


def bias_gate_residual(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> torch.Tensor:
    """``residual + gate * (x + bias)``, fused on CUDA; bit-identical to the eager expression.

    residual, x: [B, L, D]; bias: [D] or None; gate: [B, D] or [B, 1, D] (2B rows with ``index``).
    """
    _validate(residual, x, bias, gate, index)
    if common_reasons([x, residual, bias, gate], force_reference):
        return bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index)
    if torch.compiler.is_compiling():
        return torch.ops.qwen_absorb.bias_gate_residual(residual, x, bias, gate, index)
    return _cuda.bias_gate_residual(residual.contiguous(), x.contiguous(), bias, gate, index)


def _custom_op_impl(residual, x, bias, gate, index):
    """Body of the registered custom op (eager, opaque to the compiler)."""
    if x.device.type != "cuda" or force_reference_requested() or common_reasons([x]):
        return bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index)
    return _cuda.bias_gate_residual(residual.contiguous(), x.contiguous(), bias, gate, index)
