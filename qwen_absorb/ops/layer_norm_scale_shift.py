"""layer_norm_scale_shift: ``LayerNorm(x) * (1 + scale) + shift`` (norm1 + ``_modulate`` of
QwenImageTransformerBlock), one kernel; the ``_fp8`` variant also (or only) writes the e4m3 codes of that output."""

import torch

from ._eligibility import common_reasons, custom_op_result, dispatch, dispatch_fp8, fake_outputs
from ._launch import Kernels, amax_fp32, contiguous_or_none, index_kind, ptr
from ._target_rows import expand_param, layer_norm
from ._validate import check_activation, check_eps, check_fp8_amax, check_index, check_param, param_rows

# LayerNormScaleShiftParams in the .cu: x, out, out2, shift, scale, index, out2_amax, amax (pointers);
# shift_rs, scale_rs, B, L (int64); D (int32), eps (float), index_kind, quant_mode, vec_flags (int32)
KERNELS = Kernels("layer_norm_scale_shift.cu", "layer_norm_scale_shift_kernel", "8P4qifiii", nvfp4=True)
all_kernel_expressions = KERNELS.expressions


def layer_norm_scale_shift_reference(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                                     index: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers eager expression, op for op."""
    return layer_norm(x, eps) * (1 + expand_param(scale, index)) + expand_param(shift, index)


def launch(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
    *, out: bool = True, fp8_amax: torch.Tensor | None = None, amax: torch.Tensor | None = None,
    quant_mode: int = 0, nvfp4_amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(out or None, second or None)`` (``second``: :func:`._launch.outputs`; ``nvfp4_amax``
    excludes ``fp8_amax``). x: contiguous [B, L, D] on a usable CUDA device; shift/scale rows with unit last stride;
    index contiguous; amaxes fp32, one element; amax/quant_mode: the norm-input fake quantizer's, or 0."""
    # eager's norm1 sees x, or the input quantizer's fresh output
    (o, f8), run = KERNELS.start(x, (x,), out, fp8_amax, nvfp4_amax, quant_mode != 0)
    if run is None:
        return o, f8
    launcher, a, amax2 = run
    B, L, D = x.shape
    esize = x.element_size()
    xp, sp, cp, srs, crs = x.data_ptr(), shift.data_ptr(), scale.data_ptr(), shift.stride(0), scale.stride(0)
    flags = (xp % a == 0) | (((sp | srs * esize) % a == 0) << 1) | (((cp | crs * esize) % a == 0) << 2)
    launcher(B * L, xp, ptr(o), ptr(f8), sp, cp, ptr(index), ptr(amax2), ptr(amax), srs, crs, B, L, D, eps,
             index_kind(index), quant_mode, flags)
    return o, f8


def _checked(x, shift, scale, eps, index, force_reference, fp8_amax=None) -> tuple[float, list[str]]:
    check_activation("x", x)
    eps = check_eps(eps)
    check_index(index, x)
    check_param("shift", shift, x, index)
    check_param("scale", scale, x, index)
    check_fp8_amax(fp8_amax, x)
    return eps, common_reasons([x, shift, scale], force_reference)


def layer_norm_scale_shift_not_supported_reasons(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor,
                                                eps: float = 1e-6, index: torch.Tensor | None = None,
                                                force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(x, shift, scale, eps, index, force_reference)[1]


def _kernel(x, shift, scale, eps, index, out=True, fp8_amax=None):
    return launch(x.contiguous(), param_rows(shift), param_rows(scale), eps, contiguous_or_none(index), out=out,
                  fp8_amax=amax_fp32(fp8_amax))


def layer_norm_scale_shift(x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
                           index: torch.Tensor | None = None, force_reference: bool = False) -> torch.Tensor:
    """``LayerNorm(x, eps, no affine) * (1 + scale) + shift``, fused on CUDA. x: [B, L, D]; shift, scale: [B, D]
    or [B, 1, D] (2B rows with ``index`` [B, L] of 0/1)."""
    eps, reasons = _checked(x, shift, scale, eps, index, force_reference)
    return dispatch(reasons,
                    lambda: layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index),
                    lambda: torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index, None)[0],
                    lambda: _kernel(x, shift, scale, eps, index)[0])


def layer_norm_scale_shift_fp8(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, also_output: bool = False, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, out)``: the e4m3 codes of :func:`layer_norm_scale_shift`'s output under ``fp8_amax`` (as the
    reference quantizer's), and the output itself with ``also_output`` (else None: the kernel skips writing it)."""
    eps, reasons = _checked(x, shift, scale, eps, index, force_reference, fp8_amax)
    return dispatch_fp8(reasons, fp8_amax, also_output,
                        lambda: layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index),
                        lambda: torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index, fp8_amax),
                        lambda out: _kernel(x, shift, scale, eps, index, out, fp8_amax))


@torch.library.custom_op("qwen_absorb::layer_norm_scale_shift", mutates_args=())
def _custom_op(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
               fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return custom_op_result(x, fp8_amax, lambda: _kernel(x, shift, scale, eps, index, fp8_amax=fp8_amax),
                            lambda: layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index))


_custom_op.register_fake(lambda x, shift, scale, eps, index, fp8_amax: fake_outputs(x, 1, fp8_amax))
