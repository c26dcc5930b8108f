"""The fused sites of Qwen-Image-2.1 (:data:`qwen_absorb.sites.SITE21_TABLE`), each op run one of three ways, chosen
once per block call (:mod:`qwen_absorb.qwenimage21`): ``KERNEL`` (the op's checked-once launch), ``COMPILED`` (its
custom op, under ``torch.compile``) or ``REFERENCE`` (its torch reference, the diffusers expression bit for bit).
Where the site's real-FP8 consumers are given (``fwds``), the op also returns the e4m3 codes of its output."""

from __future__ import annotations

import torch

from .ops.fp8 import quantize_fp8_reference
from .ops.layer_norm_scale import launch as ln_scale_launch
from .ops.layer_norm_scale import layer_norm_scale_reference
from .ops.swiglu import launch as swiglu_launch
from .ops.swiglu import swiglu_reference
from .ops.tanh_gate_residual import launch as tgr_launch
from .ops.tanh_gate_residual import tanh_gate_residual_reference
from .ops.tanh_gate_residual_layer_norm_scale import launch as tgrln_launch
from .ops.tanh_gate_residual_layer_norm_scale import tanh_gate_residual_layer_norm_scale_reference

KERNEL, COMPILED, REFERENCE = 0, 1, 2


def _emits(fwds, mode):
    """The fp32 one-element amax of the consumers (None: no FP8 emission)."""
    return fwds[0].weight.input_amax if fwds is not None and mode != COMPILED else None


def layer_norm_scale(mode, x, scale, eps, mask, fwds=None, want_out=True, nq=None):
    """``(out or None, codes or None)``: codes when ``fwds`` (the real-FP8 consumers) is given; ``nq``
    (kernels only): the norm-input fake quantizer, applied in the kernel."""
    amax = _emits(fwds, mode)
    if mode == KERNEL:
        return ln_scale_launch(x, scale, eps, mask, out=want_out or amax is None, fp8_amax=amax, norm_input_quant=nq)
    if mode == COMPILED:
        return torch.ops.qwen_absorb.layer_norm_scale(x, scale, eps, mask, None)[0], None
    out = layer_norm_scale_reference(x, scale=scale, eps=eps, target_token_mask=mask)
    return out, (quantize_fp8_reference(out, amax) if amax is not None else None)


def residual_norm(mode, h, y, gate, scale, eps, mask, fwds=None, want_out=True, nq=None):
    """``(new residual, modulated or None, codes or None)``; ``nq`` as for :func:`layer_norm_scale`."""
    amax = _emits(fwds, mode)
    if mode == KERNEL:
        return tgrln_launch(h.contiguous(), y.contiguous(), gate, scale, eps, mask, False,
                            out=want_out or amax is None, fp8_amax=amax, norm_input_quant=nq)
    if mode == COMPILED:
        out = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale(h, y, gate, scale, eps, mask, False, None)
        return out[0], out[1], None
    nh, m = tanh_gate_residual_layer_norm_scale_reference(h, y, gate=gate, scale=scale, eps=eps,
                                                          target_token_mask=mask)
    return nh, m, (quantize_fp8_reference(m, amax) if amax is not None else None)


def residual(mode, h, y, gate, mask, clip_fp16):
    if mode == KERNEL:
        return tgr_launch(h.contiguous(), y.contiguous(), gate, mask, clip_fp16)
    if mode == COMPILED:
        return torch.ops.qwen_absorb.tanh_gate_residual(h, y, gate, mask, clip_fp16)
    return tanh_gate_residual_reference(h, y, gate=gate, target_token_mask=mask, clip_fp16=clip_fp16)


def swiglu(mode, a, b, fwds=None, want_out=True):
    """``(out or None, codes or None)``."""
    amax = _emits(fwds, mode)
    if mode == KERNEL:
        return swiglu_launch(a.contiguous(), b.contiguous(), out=want_out or amax is None, fp8_amax=amax)
    if mode == COMPILED:
        return torch.ops.qwen_absorb.swiglu(a, b, None)[0], None
    out = swiglu_reference(a, b)
    return out, (quantize_fp8_reference(out, amax) if amax is not None else None)


__all__ = ["COMPILED", "KERNEL", "REFERENCE", "layer_norm_scale", "residual", "residual_norm", "swiglu"]
