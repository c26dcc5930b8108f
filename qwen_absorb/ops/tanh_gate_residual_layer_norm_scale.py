"""tanh_gate_residual_layer_norm_scale: Qwen-Image-2.1's attention residual, norm2 and its modulation, one kernel.

    new_residual = C(residual + tanh(gate) * x)
    modulated    = LayerNorm(new_residual) * (1 + scale)

``x`` is the attention output (``to_out``). ``C`` is the identity, or with ``clip_fp16=True`` and float16 tensors
the block's final ``clip(-65504, 65504)`` (the op then runs the FFN residual and the next block's norm1). Rounding
points reproduced, each in the tensor dtype: ``tanh(gate)``, the product, the sum (then the clip), the LayerNorm
output (PyTorch's CUDA order), ``1 + scale`` and the product. ``gate``/``scale``: ``[B, D]`` chunks, or
``[B + 1, D]`` with ``target_token_mask`` (:mod:`._target_rows`). The ``_fp8`` variant also (or only) writes the
codes of ``modulated``.
"""

from __future__ import annotations

import torch

from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import Kernels, amax_fp32, codes_or_empty, contiguous_or_none, fake_codes, outputs, ptr
from ._modulation import layer_norm
from ._target_rows import check_clip, check_rows, check_target_token_mask, clip_reference, row_stride, select_rows
from ._validate import check_eps, check_fp8_amax, check_residual
from .fp8 import Fp8PerTensorQuant, quantize_fp8_reference
from .quantize_nvfp4 import check_emit

# TanhGateResidualLayerNormScaleParams in the .cu: residual, x, gate, scale, new_residual, out, out2, mask, out2_amax,
# amax (pointers); gate_rs, scale_rs, B, L (int64); D (int32), eps (float), clip, quant_mode, vec_flags (int32)
KERNELS = Kernels("tanh_gate_residual_layer_norm_scale.cu", "tanh_gate_residual_layer_norm_scale_kernel", "10P4qifiii",
                   nvfp4=True)
all_kernel_expressions = KERNELS.expressions


def tanh_gate_residual_layer_norm_scale_reference(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The diffusers eager expressions, op for op."""
    h = clip_reference(residual + select_rows(gate, target_token_mask).tanh() * x, clip_fp16)
    return h, layer_norm(h, eps) * (1 + select_rows(scale, target_token_mask))


def launch(
    residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float,
    target_token_mask: torch.Tensor | None, clip_fp16: bool = False,
    *, out: bool = True, fp8_amax: torch.Tensor | None = None, norm_input_quant: Fp8PerTensorQuant | None = None,
    nvfp4_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(new_residual, modulated or None, second or None)`` (as in
    :func:`.layer_norm_scale.launch`); residual, x: contiguous [B, L, D]. norm_input_quant:
    ``modulated = LayerNorm(Q(new_residual)) * (1 + scale)`` (new_residual itself not quantized)."""
    q4 = nvfp4_amax is not None
    if q4:
        check_emit(x, fp8_amax, nvfp4_amax)
    h, o, f8 = outs = outputs(x, (residual, x, gate, scale), new_residual=True, out=out, codes=fp8_amax is not None,
                              nvfp4=q4)
    if x.numel() == 0:
        return outs
    B, L, D = x.shape
    esize = x.element_size()
    # eager's norm2 sees a freshly allocated (aligned) tensor: PyTorch's vectorized path
    launcher, a = KERNELS.ln(x, D, True, q4)
    grs, crs = row_stride(gate), row_stride(scale)
    xp, rp, gp, cp = x.data_ptr(), residual.data_ptr(), gate.data_ptr(), scale.data_ptr()
    flags = ((xp | rp) % a == 0) | (((cp | crs * esize) % a == 0) << 2) | (((gp | grs * esize) % a == 0) << 3)
    clip = int(bool(clip_fp16) and x.dtype == torch.float16)
    nq = norm_input_quant
    amax, mode = (nq.amax_fp32(x.device), nq.mode_for(x.device)) if nq is not None else (None, 0)
    amax2 = nvfp4_amax if q4 else fp8_amax  # the second output's amax (one struct field: they are exclusive)
    launcher(B * L, rp, xp, gp, cp, h.data_ptr(), ptr(o), ptr(f8), ptr(target_token_mask), ptr(amax2), ptr(amax),
             grs, crs, B, L, D, eps, clip, mode, flags)
    return h, o, f8


def _validate(residual, x, gate, scale, eps, mask, clip_fp16, fp8_amax=None) -> tuple[float, bool]:
    check_residual(residual, x)
    eps = check_eps(eps)
    clip_fp16 = check_clip(clip_fp16)
    check_target_token_mask(mask, x)
    check_rows("gate", gate, x, mask)
    check_rows("scale", scale, x, mask)
    check_fp8_amax(fp8_amax, x)
    return eps, clip_fp16


def _kernel(residual, x, gate, scale, eps, mask, clip_fp16, *, out=True, fp8_amax=None):
    return launch(residual.contiguous(), x.contiguous(), gate, scale, eps, contiguous_or_none(mask), clip_fp16, out=out,
                  fp8_amax=amax_fp32(fp8_amax))


def tanh_gate_residual_layer_norm_scale_not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(residual, x, gate, scale, eps, target_token_mask, clip_fp16)
    return common_reasons([x, residual, gate, scale], force_reference)


def tanh_gate_residual_layer_norm_scale(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new_residual, modulated)`` (module docstring). residual, x: [B, L, D]; gate, scale: [B, D], or
    [B + 1, D] with ``target_token_mask`` (bool [L])."""
    eps, clip_fp16 = _validate(residual, x, gate, scale, eps, target_token_mask, clip_fp16)
    m = target_token_mask

    def compiled():
        h, o, _ = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale(
            residual, x, gate, scale, eps, m, clip_fp16, None)
        return h, o

    return dispatch(
        common_reasons([x, residual, gate, scale], force_reference),
        lambda: tanh_gate_residual_layer_norm_scale_reference(
            residual, x, gate=gate, scale=scale, eps=eps, target_token_mask=m, clip_fp16=clip_fp16),
        compiled,
        lambda: _kernel(residual, x, gate, scale, eps, m, clip_fp16)[:2],
    )


def tanh_gate_residual_layer_norm_scale_fp8(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor,
    eps: float = 1e-6, target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False,
    also_output: bool = False, force_reference: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(new_residual, codes, modulated or None)``: :func:`tanh_gate_residual_layer_norm_scale` plus the e4m3
    codes of ``modulated`` under ``fp8_amax`` (as the reference quantizer's); ``modulated`` with ``also_output``."""
    eps, clip_fp16 = _validate(residual, x, gate, scale, eps, target_token_mask, clip_fp16, fp8_amax)
    m = target_token_mask

    def reference():
        h, o = tanh_gate_residual_layer_norm_scale_reference(
            residual, x, gate=gate, scale=scale, eps=eps, target_token_mask=m, clip_fp16=clip_fp16)
        return h, quantize_fp8_reference(o, fp8_amax), (o if also_output else None)

    def compiled():
        h, o, codes = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale(
            residual, x, gate, scale, eps, m, clip_fp16, fp8_amax)
        return h, codes, (o if also_output else None)

    def kernel():
        h, o, codes = _kernel(residual, x, gate, scale, eps, m, clip_fp16, out=also_output, fp8_amax=fp8_amax)
        return h, codes, o

    return dispatch(common_reasons([x, residual, gate, scale], force_reference), reference, compiled, kernel)


@torch.library.custom_op("qwen_absorb::tanh_gate_residual_layer_norm_scale", mutates_args=())
def _custom_op(residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float,
               target_token_mask: torch.Tensor | None, clip_fp16: bool,
               fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Opaque to the compiler; kernel or reference when it runs. Always ``(h, modulated, codes or empty)``."""
    if kernel_usable_now(x):
        h, o, codes = _kernel(residual, x, gate, scale, eps, target_token_mask, clip_fp16, fp8_amax=fp8_amax)
    else:
        h, o = tanh_gate_residual_layer_norm_scale_reference(
            residual, x, gate=gate, scale=scale, eps=eps, target_token_mask=target_token_mask, clip_fp16=clip_fp16)
        codes = quantize_fp8_reference(o, fp8_amax) if fp8_amax is not None else None
    return h, o, codes_or_empty(codes, x)


@_custom_op.register_fake
def _(residual, x, gate, scale, eps, target_token_mask, clip_fp16, fp8_amax):
    like = torch.empty_like(x, memory_format=torch.contiguous_format)
    return like, torch.empty_like(like), fake_codes(x, fp8_amax)
