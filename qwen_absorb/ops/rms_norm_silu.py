"""rms_norm_silu: the Qwen-Image VAE's channel RMS norm (``QwenImageRMS_norm``) and SiLU of a channels-last image.

The rounding points of ``F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma``, then ``F.silu``, are kept; the
norm's sum of squares runs in the kernel's own order, so an output may differ from eager's by one rounding: not
bit-identical, covered by the VAE's fidelity gate (:mod:`qwen_absorb.vae`). bf16/fp16, C even, C <= 1024."""

import torch
import torch.nn.functional as F

from . import _runtime as rt
from ._eligibility import kernel_runtime_reasons

CU = "rms_norm_silu.cu"
WARPS = 8  # QA_RNS_WARPS: rows per block
MAX_C = 64 * 16  # 64 * QA_RNS_MAXP
EPS = 1e-12  # F.normalize's default
# RmsNormSiluParams in the .cu: x, gamma, out (pointers); rows (int64); pairs (int32); scale, eps (float); silu
LAYOUT = "3Pqiffi"
_fns: dict[tuple, object] = rt.register_cache({})


def rms_norm_silu_reference(x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool = True) -> torch.Tensor:
    """diffusers' expression on a 4-D image (``gamma`` of C elements)."""
    y = F.normalize(x.float(), dim=1).to(x.dtype) * scale * gamma.reshape(-1, 1, 1)
    return F.silu(y) if silu else y


def not_supported_reasons(x: torch.Tensor, gamma: torch.Tensor) -> list[str]:
    """Why the kernel would not run for these tensors (empty: it runs)."""
    reasons = []
    if x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        reasons.append("x is not a channels-last 4-D image")
    if x.dtype not in (torch.bfloat16, torch.float16):
        reasons.append(f"dtype {x.dtype}: the kernel takes bfloat16 / float16")
    c = x.shape[1] if x.dim() == 4 else 0
    if c % 2 or c > MAX_C or c == 0:
        reasons.append(f"C = {c}: the kernel takes an even C <= {MAX_C}")
    if gamma.numel() != c or gamma.dtype != x.dtype or gamma.device != x.device or not gamma.is_contiguous():
        reasons.append("gamma is not C contiguous values of x's dtype and device")
    if x.data_ptr() % 4 or gamma.data_ptr() % 4:
        reasons.append("x or gamma is not 4-byte aligned")
    if torch.is_grad_enabled() and (x.requires_grad or gamma.requires_grad):
        reasons.append("autograd")
    return reasons + kernel_runtime_reasons(x.device)


def launch(x: torch.Tensor, gamma: torch.Tensor, scale: float, silu: bool = True) -> torch.Tensor:
    """The kernel (inputs checked by :func:`not_supported_reasons`); the output is channels-last like ``x``."""
    out = torch.empty_like(x, memory_format=torch.channels_last)
    rows = x.numel() // x.shape[1]
    if rows == 0:
        return out
    dev = x.get_device()
    key = (x.dtype, dev)
    launcher = _fns.get(key) or rt.launcher(_fns, key, CU, f"rms_norm_silu_kernel<{rt.TRAITS[x.dtype]}>", dev,
                                            WARPS * 32, LAYOUT)
    launcher((rows + WARPS - 1) // WARPS, x.data_ptr(), gamma.data_ptr(), out.data_ptr(), rows, x.shape[1] // 2,
             float(scale), EPS, int(bool(silu)))
    return out


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(CU, f"rms_norm_silu_kernel<{rt.TRAITS[d]}>") for d in (torch.bfloat16, torch.float16)]
