"""The fused ops of both families' sites (Qwen-Image's, then Qwen-Image-2.1's), each run as ``KERNEL``, ``COMPILED``
(its custom op under ``torch.compile``: Qwen-Image-2.1) or ``REFERENCE`` (the diffusers expression bit for bit), named
as ``sites.Site.op``; given ``fp8_amax`` an op also returns its output's e4m3 codes. Only the ops are imported here."""

import torch

from .ops._launch import contiguous_or_none as _c
from .ops._validate import param_rows as _rows
from .ops.bias_gate_residual import bias_gate_residual_reference, launch as bgr_launch
from .ops.bias_residual_layer_norm_scale_shift import bias_residual_layer_norm_scale_shift_reference
from .ops.bias_residual_layer_norm_scale_shift import launch as brln_launch
from .ops.fp8 import quant_args, quantize_fp8_reference
from .ops.layer_norm_scale import launch as ln_scale_launch, layer_norm_scale_reference
from .ops.layer_norm_scale_shift import launch as lnss_launch, layer_norm_scale_shift_reference
from .ops.quantize_fp8 import activation_reference, launch as qf8_launch, split_reference
from .ops.quantize_nvfp4 import launch as q4_launch, quantize_nvfp4_reference
from .ops.swiglu import launch as swiglu_launch, swiglu_reference
from .ops.tanh_gate_residual import launch as tgr_launch, tanh_gate_residual_reference
from .ops.tanh_gate_residual_layer_norm_scale import launch as tgrln_launch
from .ops.tanh_gate_residual_layer_norm_scale import tanh_gate_residual_layer_norm_scale_reference

KERNEL, COMPILED, REFERENCE = 0, 1, 2
MODE_NAMES = {KERNEL: "kernel", COMPILED: "compiled", REFERENCE: "reference", None: "eager"}


def _codes(out: torch.Tensor, amax: torch.Tensor | None, nvfp4_amax: torch.Tensor | None = None):
    """The references' emission beside ``out``, as the kernels write it (None: none asked)."""
    if nvfp4_amax is not None:
        return quantize_nvfp4_reference(out, nvfp4_amax)
    return quantize_fp8_reference(out, amax) if amax is not None else None

def layer_norm_scale_shift(mode, x, shift, scale, eps, index, fp8_amax=None, want_out=True, nq=None, nvfp4_amax=None):
    """norm1 + modulation: ``(out or None, codes / NVFP4 or None)``; ``nq``: the norm-input quantizer (kernels only)."""
    if mode == KERNEL:
        amax, qm = quant_args(nq, x.device)
        return lnss_launch(x.contiguous(), _rows(shift), _rows(scale), eps, _c(index),
                           out=want_out or (fp8_amax is None and nvfp4_amax is None), fp8_amax=fp8_amax, amax=amax,
                           quant_mode=qm, nvfp4_amax=nvfp4_amax)
    out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
    return out, _codes(out, fp8_amax, nvfp4_amax)


def bias_residual_layer_norm_scale_shift(mode, h, y, bias, gate, shift, scale, eps, index, fp8_amax=None,
                                         want_out=True, nq=None, nvfp4_amax=None):
    """``h + gate * (y + bias)``, then norm + modulation: ``(new residual, out or None, second or None)``."""
    if mode == KERNEL:
        amax, qm = quant_args(nq, h.device)
        return brln_launch(h.contiguous(), y.contiguous(), bias, _rows(gate), _rows(shift), _rows(scale), eps,
                           _c(index), amax, qm, out=want_out or (fp8_amax is None and nvfp4_amax is None),
                           fp8_amax=fp8_amax, nvfp4_amax=nvfp4_amax)
    new_h, out = bias_residual_layer_norm_scale_shift_reference(h, y, bias=bias, gate=gate, shift=shift, scale=scale,
                                                                eps=eps, index=index, norm_input_quant=nq)
    return new_h, out, _codes(out, fp8_amax, nvfp4_amax)


def bias_gate_residual(mode, h, y, bias, gate, index):
    """``h + gate * (y + bias)``."""
    if mode == KERNEL:
        return bgr_launch(h.contiguous(), y.contiguous(), bias, _rows(gate), _c(index))
    return bias_gate_residual_reference(h, y, bias=bias, gate=gate, index=index)


def quantize_fp8(mode, x, amax, act=None, act_out=False, eager_act=None):
    """``(codes of act(x), act(x) or None)``; ``eager_act``: the module method the reference calls for ``act``."""
    if mode == KERNEL:
        return qf8_launch(x, 0, None, amax, act, act_out=act_out)[1:]
    a = eager_act(x) if eager_act is not None else activation_reference(x, act)
    return quantize_fp8_reference(a, amax), a


def quantize_nvfp4(mode, x, amax, act=None, eager_act=None):
    """The NVFP4 fake quantization of ``act(x)`` for an NVFP4 linear (``act``, ``eager_act``: :func:`quantize_fp8`)."""
    if mode == KERNEL:
        return q4_launch(x, amax, act)
    return quantize_nvfp4_reference(eager_act(x) if eager_act is not None else activation_reference(x, act), amax)


def quantize_fp8_split(mode, x, split, amax_a, amax_b):
    """The codes of ``x[:, :split]`` and ``x[:, split:]`` ([B, S, H, D] -> [B, n, H * D]) under two amaxes."""
    if mode == KERNEL:
        return qf8_launch(x, split, amax_a, amax_b)[:2]
    return split_reference(x.flatten(2, 3), split, amax_a, amax_b)

def layer_norm_scale(mode, x, scale, eps, mask, fp8_amax=None, want_out=True, nq=None):
    """``(out or None, codes or None)``; ``nq`` (kernels only): the norm-input fake quantizer, applied in the kernel."""
    if mode == KERNEL:
        return ln_scale_launch(x, scale, eps, mask, out=want_out or fp8_amax is None, fp8_amax=fp8_amax,
                               norm_input_quant=nq)
    if mode == COMPILED:
        return torch.ops.qwen_absorb.layer_norm_scale(x, scale, eps, mask, None)[0], None
    out = layer_norm_scale_reference(x, scale=scale, eps=eps, target_token_mask=mask)
    return out, _codes(out, fp8_amax)


def tanh_gate_residual_layer_norm_scale(mode, h, y, gate, scale, eps, mask, fp8_amax=None, want_out=True, nq=None):
    """``(new residual, modulated or None, codes or None)``; ``nq`` as for :func:`layer_norm_scale`."""
    if mode == KERNEL:
        return tgrln_launch(h.contiguous(), y.contiguous(), gate, scale, eps, mask, False,
                            out=want_out or fp8_amax is None, fp8_amax=fp8_amax, norm_input_quant=nq)
    if mode == COMPILED:
        out = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale(h, y, gate, scale, eps, mask, False, None)
        return out[0], out[1], None
    nh, m = tanh_gate_residual_layer_norm_scale_reference(h, y, gate=gate, scale=scale, eps=eps, target_token_mask=mask)
    return nh, m, _codes(m, fp8_amax)


def tanh_gate_residual(mode, h, y, gate, mask, clip_fp16):
    if mode == KERNEL:
        return tgr_launch(h.contiguous(), y.contiguous(), gate, mask, clip_fp16)
    if mode == COMPILED:
        return torch.ops.qwen_absorb.tanh_gate_residual(h, y, gate, mask, clip_fp16)
    return tanh_gate_residual_reference(h, y, gate=gate, target_token_mask=mask, clip_fp16=clip_fp16)


def swiglu(mode, a, b, fp8_amax=None, want_out=True):
    """``(out or None, codes or None)``."""
    if mode == KERNEL:
        return swiglu_launch(a.contiguous(), b.contiguous(), out=want_out or fp8_amax is None, fp8_amax=fp8_amax)
    if mode == COMPILED:
        return torch.ops.qwen_absorb.swiglu(a, b, None)[0], None
    out = swiglu_reference(a, b)
    return out, _codes(out, fp8_amax)
