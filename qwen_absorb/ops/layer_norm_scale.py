"""layer_norm_scale: ``LayerNorm(x) * (1 + scale)`` (Qwen-Image-2.1's norm1 + ``_modulate``, no shift), one kernel.

Rounding points reproduced, each in the tensor dtype: the LayerNorm output (PyTorch's CUDA order), ``1 + scale``, the
product. ``scale``: [B, D], or [B + 1, D] with ``target_token_mask`` (:mod:`._target_rows`). The ``_fp8`` variant
also (or only) writes the e4m3 codes of that output for the FP8 GEMMs of to_q/to_k/to_v (:mod:`.fp8`)."""

import torch

from ._eligibility import common_reasons, custom_op_result, dispatch, dispatch_fp8, fake_outputs
from ._launch import Kernels, amax_fp32, contiguous_or_none, ptr
from ._target_rows import check_rows, check_target_token_mask, layer_norm, row_stride, select_rows
from ._validate import check_activation, check_eps, check_fp8_amax
from .fp8 import Fp8PerTensorQuant, quant_args

# LayerNormScaleParams in the .cu: x, out, out2, scale, mask, out2_amax, amax (pointers); scale_rs, B, L (int64);
# D (int32), eps (float), quant_mode, vec_flags (int32)
KERNELS = Kernels("layer_norm_scale.cu", "layer_norm_scale_kernel", "7P3qifii", nvfp4=True)
all_kernel_expressions = KERNELS.expressions


def layer_norm_scale_reference(x: torch.Tensor, *, scale: torch.Tensor, eps: float = 1e-6,
                               target_token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers eager expression, op for op: ``norm(x) * (1 + _select_modulation_rows(scale))``."""
    return layer_norm(x, eps) * (1 + select_rows(scale, target_token_mask))


def launch(
    x: torch.Tensor, scale: torch.Tensor, eps: float, target_token_mask: torch.Tensor | None,
    *, out: bool = True, fp8_amax: torch.Tensor | None = None, norm_input_quant: Fp8PerTensorQuant | None = None,
    nvfp4_amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(out or None, second or None)`` (as :func:`.layer_norm_scale_shift.launch`'s); scale
    rows with unit last stride, mask contiguous or None; a QuantLayerNorm's ``norm_input_quant``: LayerNorm(Q(x))."""
    # eager's norm1 sees x, or the input quantizer's fresh output
    (o, f8), run = KERNELS.start(x, (x, scale), out, fp8_amax, nvfp4_amax, norm_input_quant is not None)
    if run is None:
        return o, f8
    launcher, a, amax2 = run
    B, L, D = x.shape
    xp, cp, crs = x.data_ptr(), scale.data_ptr(), row_stride(scale)
    flags = (xp % a == 0) | (((cp | crs * x.element_size()) % a == 0) << 2)
    amax, mode = quant_args(norm_input_quant, x.device)
    launcher(B * L, xp, ptr(o), ptr(f8), cp, ptr(target_token_mask), ptr(amax2), ptr(amax), crs, B, L, D, eps,
             mode, flags)
    return o, f8


def _checked(x, scale, eps, mask, force_reference, fp8_amax=None) -> tuple[float, list[str]]:
    check_activation("x", x)
    eps = check_eps(eps)
    check_target_token_mask(mask, x)
    check_rows("scale", scale, x, mask)
    check_fp8_amax(fp8_amax, x)
    return eps, common_reasons([x, scale], force_reference)


def layer_norm_scale_not_supported_reasons(x: torch.Tensor, *, scale: torch.Tensor, eps: float = 1e-6,
                                          target_token_mask: torch.Tensor | None = None,
                                          force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(x, scale, eps, target_token_mask, force_reference)[1]


def _kernel(x, scale, eps, mask, out=True, fp8_amax=None):
    return launch(x.contiguous(), scale, eps, contiguous_or_none(mask), out=out, fp8_amax=amax_fp32(fp8_amax))


def layer_norm_scale(x: torch.Tensor, *, scale: torch.Tensor, eps: float = 1e-6,
                     target_token_mask: torch.Tensor | None = None, force_reference: bool = False) -> torch.Tensor:
    """``LayerNorm(x, eps, no affine) * (1 + scale)``, fused on CUDA; bit-identical to the eager expression.
    x: [B, L, D]; scale: [B, D], or [B + 1, D] with ``target_token_mask`` (bool [L])."""
    m = target_token_mask
    eps, reasons = _checked(x, scale, eps, m, force_reference)
    return dispatch(reasons, lambda: layer_norm_scale_reference(x, scale=scale, eps=eps, target_token_mask=m),
                    lambda: torch.ops.qwen_absorb.layer_norm_scale(x, scale, eps, m, None)[0],
                    lambda: _kernel(x, scale, eps, m)[0])


def layer_norm_scale_fp8(
    x: torch.Tensor, *, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    target_token_mask: torch.Tensor | None = None, also_output: bool = False, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, out)``: the e4m3 codes of :func:`layer_norm_scale`'s output under ``fp8_amax`` (as the reference
    quantizer's), and the output itself with ``also_output`` (else None: the kernel skips writing it)."""
    m = target_token_mask
    eps, reasons = _checked(x, scale, eps, m, force_reference, fp8_amax)
    return dispatch_fp8(reasons, fp8_amax, also_output,
                        lambda: layer_norm_scale_reference(x, scale=scale, eps=eps, target_token_mask=m),
                        lambda: torch.ops.qwen_absorb.layer_norm_scale(x, scale, eps, m, fp8_amax),
                        lambda out: _kernel(x, scale, eps, m, out, fp8_amax))


@torch.library.custom_op("qwen_absorb::layer_norm_scale", mutates_args=())
def _custom_op(x: torch.Tensor, scale: torch.Tensor, eps: float, target_token_mask: torch.Tensor | None,
               fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    m = target_token_mask
    return custom_op_result(x, fp8_amax, lambda: _kernel(x, scale, eps, m, fp8_amax=fp8_amax),
                            lambda: layer_norm_scale_reference(x, scale=scale, eps=eps, target_token_mask=m))


_custom_op.register_fake(lambda x, scale, eps, target_token_mask, fp8_amax: fake_outputs(x, 1, fp8_amax))
