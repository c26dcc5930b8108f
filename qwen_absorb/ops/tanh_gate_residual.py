"""tanh_gate_residual: ``residual + tanh(gate) * x`` (Qwen-Image-2.1's FFN residual site, ``x = img_mlp.out``).

Rounding points reproduced, each in the tensor dtype: ``tanh(gate)``, the product, the sum; with ``clip_fp16=True``
and float16 tensors the block's final ``clip(-65504, 65504)``. ``gate``: [B, D], or [B + 1, D] (``_target_rows``)."""

import torch

from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import Kernels, contiguous_or_none, outputs, ptr
from ._target_rows import check_clip, check_rows, check_target_token_mask, clip_reference, row_stride, select_rows
from ._validate import check_residual

# TanhGateResidualParams in the .cu: residual, x, gate, out, mask (pointers); gate_rs, B, L (int64); D, clip,
# vec_flags (int32). 128 threads: QA_TGR_THREADS.
KERNELS = Kernels("tanh_gate_residual.cu", "tanh_gate_residual_kernel", "5P3qiii", 128, (1, 2, 3, 4, 5, 6, 8))
all_kernel_expressions = KERNELS.expressions


def tanh_gate_residual_reference(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, target_token_mask: torch.Tensor | None = None,
    clip_fp16: bool = False) -> torch.Tensor:
    """The diffusers eager expression, op for op."""
    return clip_reference(residual + select_rows(gate, target_token_mask).tanh() * x, clip_fp16)


def launch(residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, target_token_mask: torch.Tensor | None,
           clip_fp16: bool = False) -> torch.Tensor:
    """Checked-once entry; residual and x contiguous [B, L, D] on a usable CUDA device, gate [B (+1), D] rows with
    unit last stride, target_token_mask contiguous bool [L] or None."""
    out, _ = outputs(x, (residual, x, gate))
    if x.numel() == 0:
        return out
    B, L, D = x.shape
    launcher, a = KERNELS.vec(x, D)
    xp, rp, gp, grs = x.data_ptr(), residual.data_ptr(), gate.data_ptr(), row_stride(gate)
    flags = ((xp | rp) % a == 0) | (((gp | grs * x.element_size()) % a == 0) << 3)
    clip = int(bool(clip_fp16) and x.dtype == torch.float16)
    launcher(B * L, rp, xp, gp, out.data_ptr(), ptr(target_token_mask), grs, B, L, D, clip, flags)
    return out


def _checked(residual, x, gate, mask, clip_fp16, force_reference) -> tuple[bool, list[str]]:
    check_residual(residual, x)
    clip_fp16 = check_clip(clip_fp16)
    check_target_token_mask(mask, x)
    check_rows("gate", gate, x, mask)
    return clip_fp16, common_reasons([x, residual, gate], force_reference)


def _kernel(residual, x, gate, mask, clip_fp16):
    return launch(residual.contiguous(), x.contiguous(), gate, contiguous_or_none(mask), clip_fp16)


def tanh_gate_residual_not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, target_token_mask: torch.Tensor | None = None,
    clip_fp16: bool = False, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(residual, x, gate, target_token_mask, clip_fp16, force_reference)[1]


def tanh_gate_residual(
    residual: torch.Tensor, x: torch.Tensor, *, gate: torch.Tensor, target_token_mask: torch.Tensor | None = None,
    clip_fp16: bool = False, force_reference: bool = False) -> torch.Tensor:
    """``residual + tanh(gate) * x`` (then the fp16 clip if asked), fused on CUDA; bit-identical to the eager
    expression. residual, x: [B, L, D]; gate: [B, D], or [B + 1, D] with ``target_token_mask`` (bool [L])."""
    m = target_token_mask
    clip, reasons = _checked(residual, x, gate, m, clip_fp16, force_reference)
    return dispatch(reasons,
                    lambda: tanh_gate_residual_reference(residual, x, gate=gate, target_token_mask=m, clip_fp16=clip),
                    lambda: torch.ops.qwen_absorb.tanh_gate_residual(residual, x, gate, m, clip),
                    lambda: _kernel(residual, x, gate, m, clip))


@torch.library.custom_op("qwen_absorb::tanh_gate_residual", mutates_args=())
def _custom_op(residual: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, target_token_mask: torch.Tensor | None,
               clip_fp16: bool) -> torch.Tensor:
    m = target_token_mask
    return (_kernel(residual, x, gate, m, clip_fp16) if kernel_usable_now(x)
            else tanh_gate_residual_reference(residual, x, gate=gate, target_token_mask=m, clip_fp16=clip_fp16))


_custom_op.register_fake(
    lambda residual, x, gate, target_token_mask, clip_fp16: torch.empty_like(x, memory_format=torch.contiguous_format))
