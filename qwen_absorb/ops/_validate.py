"""Argument checks shared by the fused ops, before choosing a path: kernel and reference see the same arguments."""

import os

import torch

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def is_dtensor(t: object) -> bool:
    """A torch.distributed DTensor (its storage is a shard; a raw kernel must never read it)."""
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


def check_tensor(name: str, t: object, dtensor_hint: str = "") -> None:
    """A plain tensor argument: a torch.Tensor, and not a DTensor (whose storage is a shard)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if is_dtensor(t):
        raise TypeError(f"{name} is a DTensor; pass its local tensor (t.to_local()){dtensor_hint}")


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: bfloat16, float16, float32")


def check_activation(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, " where the math is token-local")
    if t.dim() != 3:
        raise ValueError(f"{name} must have shape [B, L, D], got {tuple(t.shape)}")
    check_dtype(name, t)
    if t.shape[0] < 1 or t.shape[2] < 1:
        raise ValueError(f"{name} needs B >= 1 and D >= 1, got {tuple(t.shape)}")


def check_device(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str = "x") -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_same(name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str) -> None:
    check_tensor(name, t)
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")
    check_device(name, t, ref, ref_name)


def check_residual(residual: torch.Tensor, x: torch.Tensor) -> None:
    """x and the residual it is added to: both activations, same dtype, device and shape."""
    check_activation("x", x)
    check_activation("residual", residual)
    check_same("residual", residual, x, "x")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")


def check_index(index: torch.Tensor | None, x: torch.Tensor) -> None:
    if index is None:
        return
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be a torch.Tensor or None, got {type(index).__name__}")
    if index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"index must be an integer (or bool) tensor of 0/1, got dtype {index.dtype}")
    check_device("index", index, x)
    B, L = x.shape[0], x.shape[1]
    if tuple(index.shape) != (B, L):
        raise ValueError(f"index must have shape [B, L] = [{B}, {L}], got {tuple(index.shape)}")
    # Index values cost a device->host sync on CUDA: checked there only with QWEN_ABSORB_VALIDATE=1. Kernels and
    # reference both follow diffusers' torch.where(index == 0, set0, set1): any non-zero value selects the second set.
    if index.numel() and not torch.compiler.is_compiling() and (
            index.device.type == "cpu" or os.environ.get("QWEN_ABSORB_VALIDATE", "") == "1"):
        if bool(((index != 0) & (index != 1)).any()):
            raise ValueError("index must contain only 0 and 1")


def check_param(name: str, p: torch.Tensor, x: torch.Tensor, index: torch.Tensor | None) -> None:
    """A modulation parameter: [R, D] or [R, 1, D], R = B (or 2B with index), last stride 1."""
    check_same(name, p, x, "x")
    B, D = x.shape[0], x.shape[2]
    rows = 2 * B if index is not None else B
    if tuple(p.shape) not in ((rows, D), (rows, 1, D)):
        why = " (2B rows because index is given)" if index is not None else ""
        raise ValueError(f"{name} must have shape [{rows}, {D}] or [{rows}, 1, {D}]{why}, got {tuple(p.shape)}")
    if D > 1 and p.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {p.stride()}")


def check_bias(bias: torch.Tensor | None, x: torch.Tensor) -> None:
    if bias is not None:
        check_same("bias", bias, x, "x")
        if bias.dim() != 1 or bias.shape[0] != x.shape[2]:
            raise ValueError(f"bias must have shape [D] = [{x.shape[2]}], got {tuple(bias.shape)}")


def check_amax(name: str, amax: torch.Tensor, x: torch.Tensor) -> None:
    """A per-tensor FP8 amax: one floating-point value on x's device (read there by the kernel)."""
    if not isinstance(amax, torch.Tensor) or amax.numel() != 1 or not amax.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor holding one value")
    check_device(name, amax, x)


def check_fp8_amax(fp8_amax: torch.Tensor | None, x: torch.Tensor) -> None:
    """The optional amax of an op's FP8 output (None: the op writes no codes)."""
    if fp8_amax is not None:
        check_amax("fp8_amax", fp8_amax, x)


def check_eps(eps: float) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (eps >= 0.0):
        raise ValueError(f"eps must be >= 0, got {eps}")
    return float(eps)


def param_rows(p: torch.Tensor) -> torch.Tensor:
    """[R, D] view of a [R, D] or [R, 1, D] parameter, without copying."""
    return p if p.dim() == 2 else p.squeeze(1)
