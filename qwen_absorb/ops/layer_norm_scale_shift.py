"""layer_norm_scale_shift: ``LayerNorm(x) * (1 + scale) + shift`` (norm1 + ``_modulate`` of
QwenImageTransformerBlock), one kernel. :func:`layer_norm_scale_shift_fp8` also (or only) writes the e4m3 codes of
that output for the real FP8 GEMMs of to_q/to_k/to_v (:mod:`qwen_absorb.ops.fp8`).
"""

from __future__ import annotations

import torch

from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import Kernels, amax_fp32, codes_or_empty, fake_codes, index_kind, outputs, ptr
from ._launch import contiguous_or_none as _contig
from ._modulation import expand_param, layer_norm
from ._validate import check_activation, check_eps, check_fp8_amax, check_index, check_param
from ._validate import param_rows as _as_rows
from .fp8 import quantize_fp8_reference
from .quantize_nvfp4 import check_emit

# LayerNormScaleShiftParams in the .cu: x, out, out2, shift, scale, index, out2_amax, amax (pointers);
# shift_rs, scale_rs, B, L (int64); D (int32), eps (float), index_kind, quant_mode, vec_flags (int32)
KERNELS = Kernels("layer_norm_scale_shift.cu", "layer_norm_scale_shift_kernel", "8P4qifiii", nvfp4=True)
all_kernel_expressions = KERNELS.expressions


def layer_norm_scale_shift_reference(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                                     index: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers eager expression, op for op."""
    return layer_norm(x, eps) * (1 + expand_param(scale, index)) + expand_param(shift, index)


def layer_norm_scale_shift_fp8_reference(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, out)``: the eager output and the reference quantizer applied to it."""
    out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
    return quantize_fp8_reference(out, fp8_amax), out


def launch(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
    *, out: bool = True, fp8_amax: torch.Tensor | None = None, amax: torch.Tensor | None = None,
    quant_mode: int = 0, nvfp4_amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(out or None, second or None)`` (``second``: :func:`._launch.outputs`; ``nvfp4_amax``
    excludes ``fp8_amax``). x: contiguous [B, L, D] on a usable CUDA device; shift/scale rows with unit last stride;
    index contiguous; amaxes fp32, one element; amax/quant_mode: the norm-input fake quantizer's, or 0."""
    q4 = nvfp4_amax is not None
    if q4:
        check_emit(x, fp8_amax, nvfp4_amax)
    o, f8 = outs = outputs(x, (x,), out=out, codes=fp8_amax is not None, nvfp4=q4)
    if x.numel() == 0:
        return outs
    B, L, D = x.shape
    esize = x.element_size()
    # eager's norm1 sees x (misaligned: PyTorch's rowwise path) or the input quantizer's fresh, aligned output
    xp = x.data_ptr()
    launcher, a = KERNELS.ln(x, D, quant_mode != 0 or xp % (4 * esize) == 0, q4)
    srs, crs = shift.stride(0), scale.stride(0)
    sp, cp = shift.data_ptr(), scale.data_ptr()
    flags = (xp % a == 0) | (((sp | srs * esize) % a == 0) << 1) | (((cp | crs * esize) % a == 0) << 2)
    amax2 = nvfp4_amax if q4 else fp8_amax  # the second output's amax (one struct field: they are exclusive)
    launcher(B * L, xp, ptr(o), ptr(f8), sp, cp, ptr(index), ptr(amax2), ptr(amax), srs, crs, B, L, D, eps,
             index_kind(index), quant_mode, flags)
    return o, f8


def _validate(x, shift, scale, eps, index, fp8_amax=None) -> float:
    check_activation("x", x)
    eps = check_eps(eps)
    check_index(index, x)
    check_param("shift", shift, x, index)
    check_param("scale", scale, x, index)
    check_fp8_amax(fp8_amax, x)
    return eps


def layer_norm_scale_shift_not_supported_reasons(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor,
                                                eps: float = 1e-6, index: torch.Tensor | None = None,
                                                force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(x, shift, scale, eps, index)
    return common_reasons([x, shift, scale], force_reference)


def layer_norm_scale_shift(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                           index: torch.Tensor | None = None, force_reference: bool = False) -> torch.Tensor:
    """``LayerNorm(x, eps, no affine) * (1 + scale) + shift``, fused on CUDA. x: [B, L, D]; shift, scale: [B, D]
    or [B, 1, D] (2B rows with ``index`` [B, L] of 0/1)."""
    eps = _validate(x, shift, scale, eps, index)
    return dispatch(common_reasons([x, shift, scale], force_reference),
                    lambda: layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index),
                    lambda: torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index, None)[0],
                    lambda: launch(x.contiguous(), _as_rows(shift), _as_rows(scale), eps, _contig(index))[0])


def layer_norm_scale_shift_fp8(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, also_output: bool = False, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, out)``: the e4m3 codes of :func:`layer_norm_scale_shift`'s output under ``fp8_amax`` (as the
    reference quantizer's), and the output itself with ``also_output`` (else None: the kernel skips writing it)."""
    eps = _validate(x, shift, scale, eps, index, fp8_amax)

    def reference():
        codes, out = layer_norm_scale_shift_fp8_reference(
            x, shift=shift, scale=scale, fp8_amax=fp8_amax, eps=eps, index=index)
        return codes, (out if also_output else None)

    def compiled():
        out, codes = torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index, fp8_amax)
        return codes, (out if also_output else None)

    def kernel():
        out, codes = launch(x.contiguous(), _as_rows(shift), _as_rows(scale), eps, _contig(index),
                            out=also_output, fp8_amax=amax_fp32(fp8_amax))
        return codes, out

    return dispatch(common_reasons([x, shift, scale], force_reference), reference, compiled, kernel)


@torch.library.custom_op("qwen_absorb::layer_norm_scale_shift", mutates_args=())
def _custom_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
               fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque to the compiler; kernel or reference when it runs. Always ``(out, codes)`` (codes empty without
    ``fp8_amax``: custom ops need fixed output types)."""
    if kernel_usable_now(x):
        out, codes = launch(x.contiguous(), _as_rows(shift), _as_rows(scale), eps, _contig(index),
                            fp8_amax=amax_fp32(fp8_amax))
    else:
        out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
        codes = quantize_fp8_reference(out, fp8_amax) if fp8_amax is not None else None
    return out, codes_or_empty(codes, x)


@_custom_op.register_fake
def _(x, shift, scale, eps, index, fp8_amax):
    return torch.empty_like(x, memory_format=torch.contiguous_format), fake_codes(x, fp8_amax)
