"""Why the CUDA kernel of a fused op cannot run for given inputs, as a list of readable reasons.

An empty list means the kernel runs. Anything else sends the call to the op's torch reference,
which is the diffusers eager expression itself, so a fallback never changes the numbers.
"""

from __future__ import annotations

import os

import torch

from . import _cuda
from ._validate import SUPPORTED_DTYPES

FORCE_REFERENCE_ENV = "QWEN_ABSORB_FORCE_REFERENCE"
MAX_D = 1 << 24  # the Welford count is a float, exact up to 2^24 (PyTorch has the same bound)
MAX_ROWS = (1 << 31) - 1  # one block per row, grid.x limit

# Set by _custom_ops when torch.library registration succeeded.
CUSTOM_OPS: dict[str, bool] = {"registered": False}


def force_reference_requested(force_reference: bool = False) -> bool:
    return bool(force_reference) or os.environ.get(FORCE_REFERENCE_ENV, "") == "1"


def kernel_runtime_reasons(device: torch.device) -> list[str]:
    """Reasons tied to the machine, not to the inputs (checked inside the custom op too)."""
    if device.type != "cuda":
        return [f"tensors are on {device.type}, the kernels need CUDA"]
    why = _cuda.cupy_unavailable_reason()
    if why is not None:
        return [why]
    cap = _cuda.device_capability(device)
    if cap < _cuda.MIN_CAPABILITY:
        return [f"compute capability {cap[0]}.{cap[1]} < {_cuda.MIN_CAPABILITY[0]}.{_cuda.MIN_CAPABILITY[1]}"]
    return []


def common_reasons(tensors: list[torch.Tensor | None], force_reference: bool = False) -> list[str]:
    x = tensors[0]
    reasons = []
    if force_reference_requested(force_reference):
        reasons.append(f"reference forced (force_reference=True or {FORCE_REFERENCE_ENV}=1)")
    if x.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {x.dtype} not supported")
    if x.shape[-1] > MAX_D:
        reasons.append(f"D = {x.shape[-1]} > {MAX_D}")
    if x.shape[0] * x.shape[1] > MAX_ROWS:
        reasons.append(f"B*L = {x.shape[0] * x.shape[1]} rows > {MAX_ROWS}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        reasons.append("autograd: an input requires grad and the kernels have no backward")
    if torch.compiler.is_compiling():
        if not CUSTOM_OPS["registered"]:
            reasons.append("under torch.compile tracing and the custom ops are not registered")
        return reasons  # the custom op checks the machine when it runs
    reasons.extend(kernel_runtime_reasons(x.device))
    return reasons
