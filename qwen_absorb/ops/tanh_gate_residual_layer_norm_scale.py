"""tanh_gate_residual_layer_norm_scale: Qwen-Image-2.1's attention residual, norm2 and its modulation, one kernel.

    new_residual = C(residual + tanh(gate) * x)
    modulated    = LayerNorm(new_residual) * (1 + scale)

``x`` is the attention output (``to_out``). ``C`` is the identity, or with ``clip_fp16=True`` and float16 tensors
the block's final ``clip(-65504, 65504)`` (the op then runs the FFN residual and the next block's norm1). Rounding
points reproduced, each in the tensor dtype: ``tanh(gate)``, the product, the sum (then the clip), the LayerNorm
output, ``1 + scale`` and the product. The ``_fp8`` variant also (or only) writes the codes of ``modulated``."""

import torch

from ._eligibility import common_reasons, custom_op_result, dispatch, dispatch_fp8, fake_outputs
from ._launch import Kernels, amax_fp32, contiguous_or_none, ptr
from ._target_rows import (check_clip, check_rows, check_target_token_mask, clip_reference, layer_norm, row_stride,
                           select_rows)
from ._validate import check_eps, check_fp8_amax, check_residual
from .fp8 import Fp8PerTensorQuant, quant_args

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
    # eager's norm2 sees a freshly allocated tensor
    (h, o, f8), run = KERNELS.start(x, (residual, x, gate, scale), out, fp8_amax, nvfp4_amax, True, new_residual=True)
    if run is None:
        return h, o, f8
    launcher, a, amax2 = run
    B, L, D = x.shape
    esize, grs, crs = x.element_size(), row_stride(gate), row_stride(scale)
    xp, rp, gp, cp = x.data_ptr(), residual.data_ptr(), gate.data_ptr(), scale.data_ptr()
    flags = ((xp | rp) % a == 0) | (((cp | crs * esize) % a == 0) << 2) | (((gp | grs * esize) % a == 0) << 3)
    clip = int(bool(clip_fp16) and x.dtype == torch.float16)
    amax, mode = quant_args(norm_input_quant, x.device)
    launcher(B * L, rp, xp, gp, cp, h.data_ptr(), ptr(o), ptr(f8), ptr(target_token_mask), ptr(amax2), ptr(amax),
             grs, crs, B, L, D, eps, clip, mode, flags)
    return h, o, f8


def _checked(residual, x, gate, scale, eps, mask, clip_fp16, force_reference, fp8_amax=None):
    check_residual(residual, x)
    eps = check_eps(eps)
    clip_fp16 = check_clip(clip_fp16)
    check_target_token_mask(mask, x)
    check_rows("gate", gate, x, mask)
    check_rows("scale", scale, x, mask)
    check_fp8_amax(fp8_amax, x)
    return eps, clip_fp16, common_reasons([x, residual, gate, scale], force_reference)


def _kernel(residual, x, gate, scale, eps, mask, clip_fp16, out=True, fp8_amax=None):
    return launch(residual.contiguous(), x.contiguous(), gate, scale, eps, contiguous_or_none(mask), clip_fp16, out=out,
                  fp8_amax=amax_fp32(fp8_amax))


def tanh_gate_residual_layer_norm_scale_not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(residual, x, gate, scale, eps, target_token_mask, clip_fp16, force_reference)[2]


def tanh_gate_residual_layer_norm_scale(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new_residual, modulated)`` (module docstring). residual, x: [B, L, D]; gate, scale: [B, D], or
    [B + 1, D] with ``target_token_mask`` (bool [L])."""
    return _dispatch(False, residual, x, gate, scale, eps, target_token_mask, clip_fp16, force_reference)


def tanh_gate_residual_layer_norm_scale_fp8(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor,
    eps: float = 1e-6, target_token_mask: torch.Tensor | None = None, clip_fp16: bool = False,
    also_output: bool = False, force_reference: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(new_residual, codes, modulated or None)``: :func:`tanh_gate_residual_layer_norm_scale` plus the e4m3
    codes of ``modulated`` under ``fp8_amax`` (as the reference quantizer's); ``modulated`` with ``also_output``."""
    return _dispatch(True, residual, x, gate, scale, eps, target_token_mask, clip_fp16, force_reference, fp8_amax,
                     also_output)


def _dispatch(fp8, residual, x, gate, scale, eps, m, clip_fp16, force_reference, fp8_amax=None, also_output=False):
    eps, clip_fp16, reasons = _checked(residual, x, gate, scale, eps, m, clip_fp16, force_reference, fp8_amax)
    op, args = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale, (residual, x, gate, scale, eps, m, clip_fp16)

    def reference():
        return tanh_gate_residual_layer_norm_scale_reference(
            residual, x, gate=gate, scale=scale, eps=eps, target_token_mask=m, clip_fp16=clip_fp16)

    if not fp8:
        return dispatch(reasons, reference, lambda: op(*args, None)[:2], lambda: _kernel(*args)[:2])
    return dispatch_fp8(reasons, fp8_amax, also_output, reference, lambda: op(*args, fp8_amax),
                        lambda out: _kernel(*args, out, fp8_amax))


@torch.library.custom_op("qwen_absorb::tanh_gate_residual_layer_norm_scale", mutates_args=())
def _custom_op(residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, scale: torch.Tensor, eps: float,
               target_token_mask: torch.Tensor | None, clip_fp16: bool,
               fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m = target_token_mask
    return custom_op_result(
        x, fp8_amax, lambda: _kernel(residual, x, gate, scale, eps, m, clip_fp16, fp8_amax=fp8_amax),
        lambda: tanh_gate_residual_layer_norm_scale_reference(
            residual, x, gate=gate, scale=scale, eps=eps, target_token_mask=m, clip_fp16=clip_fp16))


_custom_op.register_fake(lambda residual, x, gate, scale, eps, target_token_mask, clip_fp16, fp8_amax:
                         fake_outputs(x, 2, fp8_amax))
