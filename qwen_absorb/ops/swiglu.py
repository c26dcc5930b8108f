"""swiglu: ``silu(a) * b`` (Qwen-Image-2.1's SwiGLU FFN, ``a = gate_layer(x)``, ``b = proj(x)``), one kernel.

Rounding points reproduced, each in the tensor dtype: ``silu(a)`` (PyTorch's CUDA SiLU: ``x / (1 + exp(-x))`` in
fp32) and the product. :func:`swiglu_fp8` also (or only) writes the e4m3 codes of the product (as
:func:`~qwen_absorb.ops.fp8.quantize_fp8_reference`). Any shape, ``a`` and ``b`` of one shape, dtype and device.
"""

from __future__ import annotations

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import codes_or_empty, fake_codes
from ._launch import amax_fp32 as _amax1
from ._validate import SUPPORTED_DTYPES, check_amax, check_same, check_tensor
from .fp8 import quantize_fp8_reference
from .quantize_nvfp4 import check_emit

CU = "swiglu.cu"
THREADS = 256  # QA_SWIGLU_THREADS
UNROLL = 1  # the kernel's UNROLL: 16-byte vectors per thread, all loaded before the first store
MAX_ELEMENTS = ((1 << 31) - 1) * THREADS  # grid.x limit at one element per thread (VEC >= 1)

# SwigluParams in the .cu: a, b, out, out2, out2_amax (pointers); n (int64); vec (int32)
LAYOUT = "5Pqi"


def swiglu_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The diffusers eager expression: ``self.activation_fn(gate) * proj`` with ``nn.SiLU``."""
    return torch.nn.functional.silu(a) * b


def swiglu_fp8_reference(a: torch.Tensor, b: torch.Tensor,
                         fp8_amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, out)``: the eager output and the reference quantizer applied to it."""
    out = swiglu_reference(a, b)
    return quantize_fp8_reference(out, fp8_amax), out


_fns: dict[tuple, object] = rt.register_cache({})


def launch(a: torch.Tensor, b: torch.Tensor, *, out: bool = True, fp8_amax: torch.Tensor | None = None,
           nvfp4_amax: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(out or None, second or None)`` (``second``: :func:`._launch.outputs`; ``nvfp4_amax``
    excludes ``fp8_amax``); a, b contiguous, same shape, dtype and usable CUDA device; amaxes fp32, one element."""
    if type(a) is not torch.Tensor or type(b) is not torch.Tensor:  # a DTensor: its data_ptr is not the data
        raise TypeError("qwen_absorb kernels take plain tensors; got " + ", ".join(type(t).__name__ for t in (a, b)))
    q4 = nvfp4_amax is not None
    if q4:
        if a.dim() < 1:
            raise ValueError("nvfp4_amax: a needs rows (at least one dimension)")
        check_emit(a, fp8_amax, nvfp4_amax)
    o = torch.empty_like(a, memory_format=torch.contiguous_format) if out else None
    if q4:
        f8 = torch.empty_like(a, memory_format=torch.contiguous_format)
    else:
        f8 = torch.empty(a.shape, dtype=torch.float8_e4m3fn, device=a.device) if fp8_amax is not None else None
    n = a.numel()
    if n == 0:
        return o, f8
    esize = a.element_size()
    vec = 16 // esize
    dev = a.get_device()
    unroll = UNROLL
    key = (a.dtype, dev, unroll, q4)
    launcher = _fns.get(key)
    if launcher is None:
        fn = rt.function(CU, _expression(rt.TRAITS[a.dtype], vec, unroll, q4), dev)
        launcher = _fns[key] = rt.Launcher(fn, THREADS, LAYOUT, dev)
    ap, bp = a.data_ptr(), b.data_ptr()
    op = o.data_ptr() if o is not None else 0
    fp = f8.data_ptr() if f8 is not None else 0
    # codes need VEC-byte alignment for their vector stores, NVFP4 values 16 bytes like out
    vectorized = (ap | bp | op) % 16 == 0 and fp % (16 if q4 else vec) == 0
    grid = (n + THREADS * vec * unroll - 1) // (THREADS * vec * unroll)
    amax2 = nvfp4_amax if q4 else fp8_amax  # the second output's amax (one struct field: they are exclusive)
    launcher(grid, ap, bp, op, fp, amax2.data_ptr() if amax2 is not None else 0, n, int(vectorized))
    return o, f8


def _expression(traits: str, vec: int, unroll: int, nvfp4: bool = False) -> str:
    # the plain instance keeps the three-argument name (the template's default NVFP4 = 0)
    return f"swiglu_kernel<{traits}, {vec}, {unroll}, 1>" if nvfp4 else f"swiglu_kernel<{traits}, {vec}, {unroll}>"


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(CU, _expression(t, 16 // torch.empty(0, dtype=d).element_size(), UNROLL, q4))
            for d, t in rt.TRAITS.items() for q4 in (False, True)]


def _validate(a, b, fp8_amax=None) -> None:
    check_tensor("a", a)
    if a.dim() < 1:
        raise ValueError("a must have at least one dimension")
    if a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"a has dtype {a.dtype}; supported: bfloat16, float16, float32")
    check_same("b", b, a, "a")
    if b.shape != a.shape:
        raise ValueError(f"b has shape {tuple(b.shape)} but a has {tuple(a.shape)}")
    if fp8_amax is not None:
        check_amax("fp8_amax", fp8_amax, a)


def _reasons(a, b, force_reference) -> list[str]:
    reasons = common_reasons([a, b], force_reference)
    if a.numel() > MAX_ELEMENTS:
        reasons.append(f"{a.numel()} elements > {MAX_ELEMENTS}")
    return reasons


def swiglu_not_supported_reasons(a: torch.Tensor, b: torch.Tensor, *, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(a, b)
    return _reasons(a, b, force_reference)


def swiglu(a: torch.Tensor, b: torch.Tensor, *, force_reference: bool = False) -> torch.Tensor:
    """``silu(a) * b``, fused on CUDA; bit-identical to the eager expression."""
    _validate(a, b)
    return dispatch(_reasons(a, b, force_reference),
                    lambda: swiglu_reference(a, b),
                    lambda: torch.ops.qwen_absorb.swiglu(a, b, None)[0],
                    lambda: launch(a.contiguous(), b.contiguous())[0])


def swiglu_fp8(a: torch.Tensor, b: torch.Tensor, *, fp8_amax: torch.Tensor, also_output: bool = False,
               force_reference: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, out)``: the e4m3 codes of :func:`swiglu`'s output under a per-tensor ``fp8_amax``, and the output
    itself when ``also_output`` (else None: the kernel skips writing it)."""
    _validate(a, b, fp8_amax)

    def reference():
        codes, out = swiglu_fp8_reference(a, b, fp8_amax)
        return codes, (out if also_output else None)

    def compiled():
        out, codes = torch.ops.qwen_absorb.swiglu(a, b, fp8_amax)
        return codes, (out if also_output else None)

    def kernel():
        out, codes = launch(a.contiguous(), b.contiguous(), out=also_output, fp8_amax=_amax1(fp8_amax))
        return codes, out

    return dispatch(_reasons(a, b, force_reference), reference, compiled, kernel)


@torch.library.custom_op("qwen_absorb::swiglu", mutates_args=())
def _custom_op(a: torch.Tensor, b: torch.Tensor, fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque to the compiler; kernel or reference when it runs. Always ``(out, codes or empty)``."""
    if kernel_usable_now(a):
        out, codes = launch(a.contiguous(), b.contiguous(), fp8_amax=_amax1(fp8_amax))
    else:
        out = swiglu_reference(a, b)
        codes = quantize_fp8_reference(out, fp8_amax) if fp8_amax is not None else None
    return out, codes_or_empty(codes, a)


@_custom_op.register_fake
def _(a, b, fp8_amax):
    return torch.empty_like(a, memory_format=torch.contiguous_format), fake_codes(a, fp8_amax)
