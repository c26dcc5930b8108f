"""quantize_fp8: the FP8 e4m3 codes of an activation, or of its GELU(tanh) (net[2]'s input) or SiLU (the modulation
linears' input) rounded to x's dtype, for the real FP8 GEMM that consumes it. :func:`quantize_fp8_split` codes the
joint attention output's two row ranges (the inputs of ``to_add_out`` and ``to_out[0]``) under two scales in one
launch, from the [B, S, H, DH] tensor the attention returns (no flatten copy). Codes are bit-identical to
:func:`~.fp8.quantize_fp8_reference` of the (activated, rounded) value."""

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._launch import amax_fp32, ptr, require_plain
from ._validate import check_amax, check_dtype, is_dtensor
from .fp8 import quantize_fp8_reference

CU = "quantize_fp8.cu"
THREADS = 256  # QA_QF8_THREADS
ACTIVATIONS = {None: 0, "gelu_tanh": 1, "silu": 2}
# QuantizeFp8Params in the .cu: x, out_a, out_b, act_out, amax_a, amax_b (pointers); stride_b, stride_s, stride_h,
# B, S, split (int64); H, DH, vec (int32)
LAYOUT = "6P6qiii"
_fns: dict[tuple, object] = rt.register_cache({})


def activation_reference(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    return torch.nn.functional.silu(x) if activation == "silu" else torch.nn.functional.gelu(x, approximate="tanh")


def launch(
    x: torch.Tensor, split: int, amax_a: torch.Tensor | None, amax_b: torch.Tensor, activation: str | None = None,
    act_out: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checked-once entry. ``x``: [B, S, H, DH] (unit last stride) or [B, S, D] on a usable CUDA device; amax fp32
    one-element tensors. Returns ``(codes[:, :split], codes[:, split:], act or None)``, codes contiguous [B, n, D]."""
    require_plain(x)
    B, S, H, DH = x.shape if x.dim() == 4 else (*x.shape[:2], 1, x.shape[2])  # [B, S, D]: one head of D
    D = H * DH
    sb, ss, sh = x.stride(0), x.stride(1), x.stride(2) if x.dim() == 4 else D
    dev, e4m3 = x.get_device(), torch.float8_e4m3fn
    out_a = torch.empty((B, split, D), dtype=e4m3, device=x.device) if split else None
    out_b = torch.empty((B, S - split, D), dtype=e4m3, device=x.device)
    out_a = out_b[:, :0] if out_a is None else out_a  # no rows: its pointer is out_b's
    act = torch.empty((B, S, D), dtype=x.dtype, device=x.device) if act_out else None
    if B * S * D == 0:
        return out_a, out_b, act
    esize, xp = x.element_size(), x.data_ptr()
    vec = 1 if DH % (16 // esize) or (xp | sb * esize | ss * esize | sh * esize) % 16 else 16 // esize
    key = (x.dtype, ACTIVATIONS[activation], vec, dev)
    launcher = _fns.get(key) or rt.launcher(
        _fns, key, CU, f"quantize_fp8_kernel<{rt.TRAITS[x.dtype]}, {key[1]}, {vec}>", dev, THREADS, LAYOUT)
    launcher(B * S, xp, out_a.data_ptr(), out_b.data_ptr(), ptr(act), (amax_a if split else amax_b).data_ptr(),
             amax_b.data_ptr(), sb, ss, sh, B, S, split, H, DH, int(vec > 1))
    return out_a, out_b, act


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(CU, f"quantize_fp8_kernel<{t}, {a}, {v}>") for dtype, t in rt.TRAITS.items() for a in ACTIVATIONS.values()
            for v in (1, 16 // torch.empty(0, dtype=dtype).element_size())]


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or is_dtensor(x):
        raise TypeError(f"x must be a (local) torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x must be [B, S, D] or [B, S, H, DH], got shape {tuple(x.shape)}")
    check_dtype("x", x)
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x must have unit stride in its last dimension, got strides {x.stride()}")


def quantize_fp8(x: torch.Tensor, amax: torch.Tensor, *, activation: str | None = None,
                 force_reference: bool = False) -> torch.Tensor:
    """e4m3 codes of ``activation(x)`` under a per-tensor ``amax``; x [B, S, D] -> codes [B, S, D] (a
    [B, S, H, DH] input gives [B, S, H * DH])."""
    _check_x(x)
    check_amax("amax", amax, x)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    flat = x if x.dim() == 3 else x.flatten(2)
    return dispatch(common_reasons([flat], force_reference),
                    lambda: quantize_fp8_reference(activation_reference(flat, activation), amax),
                    lambda: torch.ops.qwen_absorb.quantize_fp8(x, 0, amax, amax, activation or "")[1],
                    lambda: launch(x, 0, None, amax_fp32(amax), activation)[1])


def quantize_fp8_split(x: torch.Tensor, split: int, amax_a: torch.Tensor, amax_b: torch.Tensor, *,
                       force_reference: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes of x[:, :split] under amax_a, codes of x[:, split:] under amax_b)``, each contiguous."""
    _check_x(x)
    check_amax("amax_a", amax_a, x)
    check_amax("amax_b", amax_b, x)
    if isinstance(split, bool) or not isinstance(split, int) or not 0 <= split <= x.shape[1]:
        raise ValueError(f"split must be an int in [0, {x.shape[1]}], got {split!r}")
    flat = x if x.dim() == 3 else x.flatten(2)
    return dispatch(common_reasons([flat], force_reference), lambda: split_reference(flat, split, amax_a, amax_b),
                    lambda: torch.ops.qwen_absorb.quantize_fp8(x, split, amax_a, amax_b, ""),
                    lambda: launch(x, split, amax_fp32(amax_a), amax_fp32(amax_b))[:2])


def split_reference(flat, split, amax_a, amax_b):  # flat: [B, S, D]; also the site runner's reference
    return quantize_fp8_reference(flat[:, :split], amax_a), quantize_fp8_reference(flat[:, split:], amax_b)


@torch.library.custom_op("qwen_absorb::quantize_fp8", mutates_args=())
def _custom_op(x: torch.Tensor, split: int, amax_a: torch.Tensor, amax_b: torch.Tensor,
               activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    act = activation or None
    if kernel_usable_now(x):
        return launch(x, split, amax_fp32(amax_a), amax_fp32(amax_b), act)[:2]
    return split_reference(activation_reference(x if x.dim() == 3 else x.flatten(2), act), split, amax_a, amax_b)


@_custom_op.register_fake
def _(x, split, amax_a, amax_b, activation):
    B, S, D, e4m3 = x.shape[0], x.shape[1], x.shape[2] * (x.shape[3] if x.dim() == 4 else 1), torch.float8_e4m3fn
    return x.new_empty((B, split, D), dtype=e4m3), x.new_empty((B, S - split, D), dtype=e4m3)
