"""bias_gate_residual: ``residual + gate * (x + bias)`` (the FFN residual site), one kernel. ``x`` is ``net[2]``'s
output without its bias when the bias is deferred (``bias`` given), or with it (``bias=None``)."""

import torch

from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import Kernels, contiguous_or_none, index_kind, outputs, ptr
from ._target_rows import expand_param
from ._validate import check_bias, check_index, check_param, check_residual, param_rows

# BiasGateResidualParams in the .cu: residual, x, bias, gate, out, index (pointers); gate_rs, B, L (int64); D,
# index_kind, vec_flags (int32). 128 threads: QA_BGR_THREADS.
KERNELS = Kernels("bias_gate_residual.cu", "bias_gate_residual_kernel", "6P3qiii", 128, (1, 2, 3, 4, 5, 6, 8))
all_kernel_expressions = KERNELS.expressions


def bias_gate_residual_reference(residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None,
                                 gate: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers eager expression, op for op (the bias added the way a separate add would)."""
    y = x + bias if bias is not None else x
    return residual + expand_param(gate, index) * y


def launch(residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
           index: torch.Tensor | None) -> torch.Tensor:
    """Checked-once entry; residual, x contiguous [B, L, D] on a usable CUDA device, gate rows with unit last stride,
    index contiguous."""
    out, _ = outputs(x, (x, residual))
    if x.numel() == 0:
        return out
    B, L, D = x.shape
    launcher, a = KERNELS.vec(x, D)
    xp, rp, gp, bp, grs = x.data_ptr(), residual.data_ptr(), gate.data_ptr(), ptr(bias), gate.stride(0)
    flags = ((xp | rp) % a == 0) | (((gp | grs * x.element_size()) % a == 0) << 3) | ((bp % a == 0) << 4)
    launcher(B * L, rp, xp, bp, gp, out.data_ptr(), ptr(index), grs, B, L, D, index_kind(index), flags)
    return out


def _checked(residual, x, bias, gate, index, force_reference) -> list[str]:
    check_residual(residual, x)
    check_index(index, x)
    check_bias(bias, x)
    check_param("gate", gate, x, index)
    return common_reasons([x, residual, bias, gate], force_reference)


def _kernel(residual, x, bias, gate, index):
    return launch(residual.contiguous(), x.contiguous(), bias, param_rows(gate), contiguous_or_none(index))


def bias_gate_residual_not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(residual, x, bias, gate, index, force_reference)


def bias_gate_residual(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None, force_reference: bool = False) -> torch.Tensor:
    """``residual + gate * (x + bias)``, fused on CUDA; bit-identical to the eager expression. residual, x:
    [B, L, D]; bias: [D] or None; gate: [B, D] or [B, 1, D] (2B rows with ``index``)."""
    return dispatch(_checked(residual, x, bias, gate, index, force_reference),
                    lambda: bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index),
                    lambda: torch.ops.qwen_absorb.bias_gate_residual(residual, x, bias, gate, index),
                    lambda: _kernel(residual, x, bias, gate, index))


@torch.library.custom_op("qwen_absorb::bias_gate_residual", mutates_args=())
def _custom_op(residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
               index: torch.Tensor | None) -> torch.Tensor:
    return (_kernel(residual, x, bias, gate, index) if kernel_usable_now(x)
            else bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index))


_custom_op.register_fake(
    lambda residual, x, bias, gate, index: torch.empty_like(x, memory_format=torch.contiguous_format))
