"""torch.library custom ops wrapping the fused kernels, so torch.compile traces them without graph
breaks (fake implementations give output shapes) and CUDA graphs capture their launches.

The public ops call these only while torch.compile traces; in eager mode they launch directly and
skip the dispatcher's overhead. The bodies run eagerly and pick the kernel or the reference at run
time, on any device (on CPU they are the reference).
"""

from __future__ import annotations

import logging

import torch

from . import _eligibility
from . import bias_gate_residual as _bgr
from . import bias_residual_layer_norm_scale_shift as _brln
from . import layer_norm_scale_shift as _lnss

log = logging.getLogger("qwen_absorb")


def _contig_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _register() -> None:
    from torch.library import custom_op  # noqa: PLC0415

    @custom_op("qwen_absorb::layer_norm_scale_shift", mutates_args=())
    def layer_norm_scale_shift(
        x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None
    ) -> torch.Tensor:
        return _lnss._custom_op_impl(x, shift, scale, eps, index)

    @layer_norm_scale_shift.register_fake
    def _(x, shift, scale, eps, index):
        return _contig_like(x)

    @custom_op("qwen_absorb::bias_residual_layer_norm_scale_shift", mutates_args=())
    def bias_residual_layer_norm_scale_shift(
        residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
        shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
        amax: torch.Tensor | None, quant_mode: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _brln._custom_op_impl(residual, x, bias, gate, shift, scale, eps, index, amax, quant_mode)

    @bias_residual_layer_norm_scale_shift.register_fake
    def _(residual, x, bias, gate, shift, scale, eps, index, amax, quant_mode):
        return _contig_like(x), _contig_like(x)

    @custom_op("qwen_absorb::bias_gate_residual", mutates_args=())
    def bias_gate_residual(
        residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
        index: torch.Tensor | None,
    ) -> torch.Tensor:
        return _bgr._custom_op_impl(residual, x, bias, gate, index)

    @bias_gate_residual.register_fake
    def _(residual, x, bias, gate, index):
        return _contig_like(x)


try:
    _register()
    _eligibility.CUSTOM_OPS["registered"] = True
except Exception as e:  # an old torch without torch.library.custom_op
    log.warning("qwen_absorb: custom ops not registered (%s); torch.compile will use the references", e)
