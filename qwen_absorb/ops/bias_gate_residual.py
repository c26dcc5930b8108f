"""bias_gate_residual: ``residual + gate * (x + bias)`` (the FFN residual site), one kernel.

``x`` is the FFN output projection (``net[2]``) computed without its bias when the bias is deferred
(``bias`` given) or with it (``bias=None``: then ``residual + gate * x``). Layers as in
:mod:`qwen_absorb.ops.layer_norm_scale_shift`.
"""

from __future__ import annotations

import math

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._layer_norm import pick_nv
from ._modulation import expand_param
from ._validate import check_activation, check_bias, check_index, check_param, check_same, param_rows

CU = "bias_gate_residual.cu"
THREADS = 128  # QA_BGR_THREADS
_NV = (1, 2, 3, 4, 5, 6, 8)


# BiasGateResidualParams in the .cu: residual, x, bias, gate, out, index (pointers);
# gate_rs, B, L (int64); D, index_kind, vec_flags (int32)
LAYOUT = "6P3qiii"


def bias_gate_residual_reference(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The diffusers eager expression, op for op (the bias added the way a separate add would)."""
    y = x + bias if bias is not None else x
    return residual + expand_param(gate, index) * y


_fns: dict[tuple, object] = rt.register_cache({})


def launch(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None,
) -> torch.Tensor:
    """Checked-once entry; residual and x contiguous [B, L, D] on a usable CUDA device, gate rows
    with unit last stride, index contiguous."""
    if type(x) is not torch.Tensor or type(residual) is not torch.Tensor:  # a DTensor / AsyncCollectiveTensor: its data_ptr is not the data
        raise TypeError("qwen_absorb kernels take plain tensors; got " + ", ".join(type(t).__name__ for t in (x, residual,)))
    B, L, D = x.shape
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    esize = x.element_size()
    dev = x.get_device()
    key = (x.dtype, D, dev)
    hit = _fns.get(key)
    if hit is None:
        vec = 16 // esize
        if D % vec:
            vec = 1
        nv = pick_nv(math.ceil((D // vec) / THREADS), _NV)
        fn = rt.function(CU, f"bias_gate_residual_kernel<{rt.TRAITS[x.dtype]}, {vec}, {nv}>", dev)
        hit = _fns[key] = (rt.Launcher(fn, THREADS, LAYOUT, dev), vec * esize)
    launcher, a = hit
    grs = gate.stride(0)
    xp, rp, gp = x.data_ptr(), residual.data_ptr(), gate.data_ptr()
    bp = bias.data_ptr() if bias is not None else 0
    flags = (((xp | rp) % a == 0) | (((gp | grs * esize) % a == 0) << 3) | ((bp % a == 0) << 4))
    launcher(B * L, rp, xp, bp, gp, out.data_ptr(), index.data_ptr() if index is not None else 0,
             grs, B, L, D, index.element_size() if index is not None else 0, flags)
    return out


def all_kernel_expressions() -> list[tuple[str, str]]:
    out = []
    for dtype, t in rt.TRAITS.items():
        for v in (1, 16 // torch.empty(0, dtype=dtype).element_size()):
            out += [(CU, f"bias_gate_residual_kernel<{t}, {v}, {nv}>") for nv in (*_NV, 0)]
    return out


def _validate(residual, x, bias, gate, index) -> None:
    check_activation("x", x)
    check_activation("residual", residual)
    check_same("residual", residual, x, "x")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
    check_index(index, x)
    check_bias(bias, x)
    check_param("gate", gate, x, index)


def _kernel(residual, x, bias, gate, index):
    return launch(residual.contiguous(), x.contiguous(), bias, param_rows(gate),
                  index.contiguous() if index is not None else None)


def bias_gate_residual_not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(residual, x, bias, gate, index)
    return common_reasons([x, residual, bias, gate], force_reference)


def bias_gate_residual(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> torch.Tensor:
    """``residual + gate * (x + bias)``, fused on CUDA; bit-identical to the eager expression.

    residual, x: [B, L, D]; bias: [D] or None; gate: [B, D] or [B, 1, D] (2B rows with ``index``).
    """
    _validate(residual, x, bias, gate, index)
    return dispatch(
        common_reasons([x, residual, bias, gate], force_reference),
        lambda: bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index),
        lambda: torch.ops.qwen_absorb.bias_gate_residual(residual, x, bias, gate, index),
        lambda: _kernel(residual, x, bias, gate, index),
    )


@torch.library.custom_op("qwen_absorb::bias_gate_residual", mutates_args=())
def _custom_op(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor,
    index: torch.Tensor | None,
) -> torch.Tensor:
    if kernel_usable_now(x):
        return _kernel(residual, x, bias, gate, index)
    return bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index)


@_custom_op.register_fake
def _(residual, x, bias, gate, index):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
