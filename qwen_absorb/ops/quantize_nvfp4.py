"""quantize_nvfp4: ModelOpt's dynamic NVFP4 fake quantization of an activation (W4A4's input quantizer).

:func:`quantize_nvfp4`: ``x`` (or its GELU-tanh / SiLU) fake-quantized as ModelOpt's NVFP4 input quantizer does on
CUDA (e2m1 values, dynamic e4m3 scales per 16 elements, second-level scale ``amax / (6 * 448)``; csrc/quantize_nvfp4.cu
gives the arithmetic). Fused kernels emit the same as a second output (``nvfp4_amax``, csrc/nvfp4.cuh):
:func:`emit_reasons` says when they can.

The target is ModelOpt 0.47's Triton kernel ``fp4_fake_quant_block``: its fp32 divisions are PTX ``div.full.f32``,
not correctly rounded; the CUDA kernel issues the same instruction and is bit-identical. The reference divides with
IEEE rounding: equal except where a quotient lies within 2 ulp of a rounding boundary (a few elements per million).
NaN / inf policy (ModelOpt's): a block's max skips NaN; inf saturates the block scale to 448 * gs; a NaN element
becomes ``-6 * scale``, an inf ``+-6 * scale``; zero is always ``+0`` (Triton negates as ``0 - v``)."""

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import NVFP4_BLOCK as BLOCK
from ._launch import amax_fp32, emit_reasons, require_plain  # noqa: F401  (emit_reasons: re-exported)
from ._validate import check_amax, check_dtype, is_dtensor
from .quantize_fp8 import ACTIVATIONS, activation_reference  # the kernel's ACT: quantize_fp8.cu's numbering

CU = "quantize_nvfp4.cu"
THREADS = 256  # QA_NVFP4_THREADS
GLOBAL_DIVISOR = 6.0 * 448.0  # e2m1 max x e4m3 max
# torch on CUDA divides by a Python scalar as a product with its float32 reciprocal; ModelOpt's scale is the CUDA one
INV_GLOBAL_DIVISOR = float(torch.tensor(1.0 / GLOBAL_DIVISOR, dtype=torch.float32))  # exact in float32
# QuantizeNvfp4Params in the .cu: x, y, amax (pointers); rows, stride_row (int64); D, nblk (int32)
LAYOUT = "3P2qii"
_fns: dict[tuple, object] = rt.register_cache({})

# e2m1 rounding of |x| / scale (ModelOpt's fp4_round_magnitude): (bound, inclusive, value below it)
_E2M1_STEPS = ((0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5),
               (2.5, True, 2.0), (3.5, False, 3.0), (5.0, True, 4.0))


def _e2m1_magnitude(a: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(a, 6.0)  # above 5, and NaN (every comparison false)
    for bound, inclusive, value in reversed(_E2M1_STEPS):
        below = a <= bound if inclusive else a < bound
        out = torch.where(below, torch.full_like(a, value), out)
    return out


def quantize_nvfp4_reference(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 dynamic fake quantization of ``x`` [..., D] under the per-tensor ``amax`` (its CUDA
    Triton kernel's arithmetic with IEEE divisions), second-level scale ``amax * fl32(1 / 2688)``."""
    shape, dtype, D = x.shape, x.dtype, x.shape[-1]
    if x.numel() == 0:
        return x.clone()
    xf = x.reshape(-1, D).to(torch.float32)
    pad = (-D) % BLOCK
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    blocks = xf.view(xf.shape[0], -1, BLOCK)
    gs = amax.detach().to(device=x.device, dtype=torch.float32).reshape(()) * INV_GLOBAL_DIVISOR
    gs = torch.where(gs > 0, gs, torch.full_like(gs, 1e-12))
    mag = blocks.abs()
    nan = mag.isnan()
    bmax = torch.where(nan, torch.zeros_like(mag), mag).amax(-1, keepdim=True)  # max.f32 skips NaN ...
    bmax = torch.where(nan.all(-1, keepdim=True), torch.full_like(bmax, float("nan")), bmax)  # ... all-NaN: NaN
    t = torch.fmin(bmax / (6.0 * gs), torch.full_like(bmax, 448.0))  # fmin: a NaN quotient gives 448
    s = t.to(torch.float8_e4m3fn).to(torch.float32) * gs
    s = torch.where(s >= 1e-5, s, torch.ones_like(s))
    r = _e2m1_magnitude(mag / s) * s
    y = torch.where(blocks >= 0, r, 0.0 - r).view(xf.shape)  # Triton's -r is 0 - r: never -0
    return y[:, :D].to(dtype).reshape(shape)


def launch(x: torch.Tensor, amax: torch.Tensor, act: str | None = None) -> torch.Tensor:
    """Checked-once entry: ``x`` [..., D] with unit last stride and one row stride on a usable CUDA device;
    ``amax`` a one-element fp32 tensor there. Returns the fake quantization of ``act(x)`` (None, ``"gelu_tanh"`` or
    ``"silu"``, in x's dtype), contiguous."""
    require_plain(x)
    a = ACTIVATIONS.get(act)
    if a is None:
        raise ValueError(f"act must be one of {list(ACTIVATIONS)}, got {act!r}")
    D = x.shape[-1]
    x2 = x.reshape(-1, D) if x.dim() != 2 else x
    rows = x2.shape[0]
    y = torch.empty((rows, D), dtype=x.dtype, device=x.device)
    if rows * D == 0:
        return y.view(x.shape)
    esize, stride = x.element_size(), x2.stride(0)
    vec = 1 if (x2.data_ptr() | stride * esize | D * esize) % 16 else 16 // esize
    dev = x.get_device()
    key = (x.dtype, vec, a, dev)
    launcher = _fns.get(key) or rt.launcher(
        _fns, key, CU, rt.template("quantize_nvfp4_kernel", rt.TRAITS[x.dtype], vec, optional=a), dev, THREADS, LAYOUT)
    nblk = (D + BLOCK - 1) // BLOCK
    launcher((rows * nblk + THREADS - 1) // THREADS, x2.data_ptr(), y.data_ptr(), amax.data_ptr(),
             rows, stride, D, nblk)
    return y.view(x.shape)


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(CU, rt.template("quantize_nvfp4_kernel", t, v, optional=a)) for dtype, t in rt.TRAITS.items()
            for v in (1, 16 // torch.empty(0, dtype=dtype).element_size()) for a in ACTIVATIONS.values()]


def quantize_nvfp4_not_supported_reasons(x: torch.Tensor, amax: torch.Tensor,
                                         force_reference: bool = False) -> list[str]:
    """Why :func:`quantize_nvfp4` would run its reference rather than its kernel (empty: the kernel)."""
    reasons = common_reasons([x], force_reference)
    if x.dim() >= 2 and x.shape[-1] > 1 and x.stride(-1) != 1:
        reasons.append(f"x has stride {x.stride(-1)} in its last dimension (the kernel needs 1)")
    elif x.dim() > 2 and not _rows_uniform(x):
        reasons.append("x's rows are not one stride apart (the kernel reads [rows, D] with one row stride)")
    return reasons


def _rows_uniform(x: torch.Tensor) -> bool:
    try:
        x.view(-1, x.shape[-1])
        return True
    except RuntimeError:
        return False


def quantize_nvfp4(x: torch.Tensor, amax: torch.Tensor, *, activation: str | None = None,
                   force_reference: bool = False) -> torch.Tensor:
    """``x`` [..., D] fake-quantized to NVFP4 as ModelOpt's dynamic input quantizer does on CUDA, under the
    per-tensor ``amax`` (its calibrated ``input_quantizer.amax``); same shape and dtype. With ``activation``
    (``"gelu_tanh"`` or ``"silu"``) the input is that activation of x in x's dtype (computed in the same launch)."""
    if not isinstance(x, torch.Tensor) or is_dtensor(x):
        raise TypeError(f"x must be a (local) torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension")
    check_dtype("x", x)
    check_amax("amax", amax, x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    return dispatch(quantize_nvfp4_not_supported_reasons(x, amax, force_reference),
                    lambda: quantize_nvfp4_reference(activation_reference(x, activation), amax),
                    # the custom op quantizes only; under compile the activation stays a traced torch op
                    lambda: torch.ops.qwen_absorb.quantize_nvfp4(activation_reference(x, activation), amax),
                    lambda: launch(x, amax_fp32(amax), activation))


@torch.library.custom_op("qwen_absorb::quantize_nvfp4", mutates_args=())
def _custom_op(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    usable = kernel_usable_now(x) and x.stride(-1) == 1 and _rows_uniform(x)
    return launch(x, amax_fp32(amax)) if usable else quantize_nvfp4_reference(x, amax)


_custom_op.register_fake(lambda x, amax: torch.empty_like(x, memory_format=torch.contiguous_format))
