"""swiglu: ``silu(a) * b`` (Qwen-Image-2.1's SwiGLU FFN, ``a = gate_layer(x)``, ``b = proj(x)``), one kernel.

Rounding points reproduced, each in the tensor dtype: ``silu(a)`` (PyTorch's CUDA SiLU: ``x / (1 + exp(-x))`` in
fp32) and the product. :func:`swiglu_fp8` also (or only) writes the e4m3 codes of the product (as
:func:`~qwen_absorb.ops.fp8.quantize_fp8_reference`). Any shape, ``a`` and ``b`` of one shape, dtype and device."""

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, custom_op_result, dispatch, dispatch_fp8, fake_outputs
from ._launch import amax_fp32, check_emit, outputs, ptr
from ._validate import check_dtype, check_fp8_amax, check_same, check_tensor

CU = "swiglu.cu"
THREADS = 256  # QA_SWIGLU_THREADS
UNROLL = 1  # the kernel's UNROLL: 16-byte vectors per thread, all loaded before the first store
MAX_ELEMENTS = ((1 << 31) - 1) * THREADS  # grid.x limit at one element per thread (VEC >= 1)
# SwigluParams in the .cu: a, b, out, out2, out2_amax (pointers); n (int64); vec (int32)
LAYOUT = "5Pqi"
_fns: dict[tuple, object] = rt.register_cache({})


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The diffusers eager expression: ``self.activation_fn(gate) * proj`` with ``nn.SiLU``."""
    return torch.nn.functional.silu(a) * b


def launch(a: torch.Tensor, b: torch.Tensor, *, out: bool = True, fp8_amax: torch.Tensor | None = None,
           nvfp4_amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(out or None, second or None)`` (``second``: :func:`._launch.outputs`; ``nvfp4_amax``
    excludes ``fp8_amax``); a, b contiguous, same shape, dtype and usable CUDA device; amaxes fp32, one element."""
    q4 = nvfp4_amax is not None
    if q4:
        if a.dim() < 1:
            raise ValueError("nvfp4_amax: a needs rows (at least one dimension)")
        check_emit(a, fp8_amax, nvfp4_amax)
    o, f8 = outputs(a, (a, b), out=out, codes=fp8_amax is not None, nvfp4=q4)
    n = a.numel()
    if n == 0:
        return o, f8
    vec, dev, unroll = 16 // a.element_size(), a.get_device(), UNROLL
    key = (a.dtype, dev, unroll, q4)
    launcher = _fns.get(key) or rt.launcher(
        _fns, key, CU, rt.template("swiglu_kernel", rt.TRAITS[a.dtype], vec, unroll, optional=int(q4)), dev, THREADS,
        LAYOUT)
    ap, bp, op, fp = a.data_ptr(), b.data_ptr(), ptr(o), ptr(f8)
    # codes need VEC-byte alignment for their vector stores, NVFP4 values 16 bytes like out
    vectorized = (ap | bp | op) % 16 == 0 and fp % (16 if q4 else vec) == 0
    grid = (n + THREADS * vec * unroll - 1) // (THREADS * vec * unroll)
    amax2 = nvfp4_amax if q4 else fp8_amax  # the second output's amax (one struct field: they are exclusive)
    launcher(grid, ap, bp, op, fp, ptr(amax2), n, int(vectorized))
    return o, f8


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(CU, rt.template("swiglu_kernel", t, 16 // torch.empty(0, dtype=d).element_size(), UNROLL, optional=q4))
            for d, t in rt.TRAITS.items() for q4 in (0, 1)]


def _checked(a, b, force_reference, fp8_amax=None) -> list[str]:
    check_tensor("a", a)
    if a.dim() < 1:
        raise ValueError("a must have at least one dimension")
    check_dtype("a", a)
    check_same("b", b, a, "a")
    if b.shape != a.shape:
        raise ValueError(f"b has shape {tuple(b.shape)} but a has {tuple(a.shape)}")
    check_fp8_amax(fp8_amax, a)
    reasons = common_reasons([a, b], force_reference)
    if a.numel() > MAX_ELEMENTS:
        reasons.append(f"{a.numel()} elements > {MAX_ELEMENTS}")
    return reasons


def swiglu_not_supported_reasons(a: torch.Tensor, b: torch.Tensor, *, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(a, b, force_reference)


def _kernel(a, b, out=True, fp8_amax=None):
    return launch(a.contiguous(), b.contiguous(), out=out, fp8_amax=amax_fp32(fp8_amax))


def swiglu(a: torch.Tensor, b: torch.Tensor, *, force_reference: bool = False) -> torch.Tensor:
    """``silu(a) * b``, fused on CUDA; bit-identical to the eager expression."""
    return dispatch(_checked(a, b, force_reference), lambda: swiglu_reference(a, b),
                    lambda: torch.ops.qwen_absorb.swiglu(a, b, None)[0], lambda: _kernel(a, b)[0])


def swiglu_fp8(a: torch.Tensor, b: torch.Tensor, *, fp8_amax: torch.Tensor, also_output: bool = False,
               force_reference: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, out)``: the e4m3 codes of :func:`swiglu`'s output under a per-tensor ``fp8_amax``, and the output
    itself when ``also_output`` (else None: the kernel skips writing it)."""
    return dispatch_fp8(_checked(a, b, force_reference, fp8_amax), fp8_amax, also_output,
                        lambda: swiglu_reference(a, b), lambda: torch.ops.qwen_absorb.swiglu(a, b, fp8_amax),
                        lambda out: _kernel(a, b, out, fp8_amax))


@torch.library.custom_op("qwen_absorb::swiglu", mutates_args=())
def _custom_op(a: torch.Tensor, b: torch.Tensor, fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return custom_op_result(a, fp8_amax, lambda: _kernel(a, b, fp8_amax=fp8_amax), lambda: swiglu_reference(a, b))


_custom_op.register_fake(lambda a, b, fp8_amax: fake_outputs(a, 1, fp8_amax))
