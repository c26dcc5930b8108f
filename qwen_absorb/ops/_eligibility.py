"""Why the CUDA kernel of a fused op cannot run, as readable reasons (empty: it runs); any sends the call to the op's
torch reference. Machine reasons are cached per device; the public ops add the per-call ones. Also the dispatch the
public ops and their custom ops share."""

import os

import torch

from . import _runtime
from ._validate import SUPPORTED_DTYPES
from .fp8 import quantize_fp8_reference

FORCE_REFERENCE_ENV = "QWEN_ABSORB_FORCE_REFERENCE"
MAX_D = 1 << 24  # the Welford count is a float, exact up to 2^24 (PyTorch has the same bound)
MAX_ROWS = (1 << 31) - 1  # one block per row, grid.x limit
_machine: dict[torch.device, tuple[str, ...]] = {}


def force_reference_requested(force_reference: bool = False) -> bool:
    return bool(force_reference) or os.environ.get(FORCE_REFERENCE_ENV, "") == "1"


def kernel_runtime_reasons(device: torch.device) -> list[str]:
    """Reasons tied to the machine, not to the inputs (memoised per device)."""
    r = _machine.get(device)
    if r is None:
        r = _machine[device] = tuple(_machine_reasons(device))
    return list(r)


def _machine_reasons(device: torch.device) -> list[str]:
    if device.type != "cuda":
        return [f"tensors are on {device.type}, the kernels need CUDA"]
    why = _runtime.cupy_unavailable_reason()
    if why is not None:
        return [why]
    cap = _runtime.device_capability(device)
    if cap < _runtime.MIN_CAPABILITY:
        return [f"compute capability {cap[0]}.{cap[1]} < {_runtime.MIN_CAPABILITY[0]}.{_runtime.MIN_CAPABILITY[1]}"]
    return []


def common_reasons(tensors: list[torch.Tensor | None], force_reference: bool = False) -> list[str]:
    """The per-call reasons of the public ops (inputs already validated)."""
    x, reasons = tensors[0], []
    if force_reference_requested(force_reference):
        reasons.append(f"reference forced (force_reference=True or {FORCE_REFERENCE_ENV}=1)")
    if x.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {x.dtype} not supported")
    if x.shape[-1] > MAX_D:
        reasons.append(f"D = {x.shape[-1]} > {MAX_D}")
    if x.numel() // max(x.shape[-1], 1) > MAX_ROWS:
        reasons.append(f"{x.numel() // x.shape[-1]} rows > {MAX_ROWS}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        reasons.append("autograd: an input requires grad and the kernels have no backward")
    if not torch.compiler.is_compiling():  # under compile the custom op checks the machine when it runs
        reasons.extend(kernel_runtime_reasons(x.device))
    return reasons


def dispatch(reasons: list[str], reference, custom_op, kernel):
    """Every public op's dispatch: reference if any reason, custom op under compile, else the kernel (callables)."""
    if reasons:
        return reference()
    return custom_op() if torch.compiler.is_compiling() else kernel()


def kernel_usable_now(x: torch.Tensor) -> bool:
    """What a custom op body checks when it runs (eagerly, inside a compiled graph)."""
    return x.device.type == "cuda" and not force_reference_requested() and not kernel_runtime_reasons(x.device)


def _tuple(r) -> tuple:
    return r if isinstance(r, tuple) else (r,)


def dispatch_fp8(reasons: list[str], fp8_amax: torch.Tensor, also_output: bool, reference, custom_op, kernel):
    """Every ``*_fp8`` op's dispatch, returning ``(*head, codes, out if also_output else None)``: ``reference()``
    gives the plain op's outputs (the reference quantizer codes the last), ``custom_op()`` the custom op's
    ``(*head, out, codes)``, ``kernel(also_output)`` the launch's (it writes ``out`` only if asked)."""

    def reorder(r: tuple) -> tuple:
        *head, out, codes = r
        return (*head, codes, out if also_output else None)

    def ref():
        r = _tuple(reference())
        return reorder((*r, quantize_fp8_reference(r[-1], fp8_amax)))

    return dispatch(reasons, ref, lambda: reorder(custom_op()), lambda: reorder(kernel(also_output)))


def custom_op_result(x: torch.Tensor, fp8_amax: torch.Tensor | None, kernel, reference) -> tuple:
    """A codes-emitting custom op's body: ``kernel()`` where usable now, else ``reference()`` and the reference codes
    of its last output; codes empty without ``fp8_amax`` (custom ops need fixed output types)."""
    if kernel_usable_now(x):
        *outs, codes = kernel()
    else:
        outs = _tuple(reference())
        codes = quantize_fp8_reference(outs[-1], fp8_amax) if fp8_amax is not None else None
    return (*outs, codes if codes is not None else x.new_empty(0, dtype=torch.float8_e4m3fn))


def fake_outputs(x: torch.Tensor, n: int, fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The fake of :func:`custom_op_result`: ``n`` contiguous tensors like x, then the codes."""
    like = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(n)]
    return (*like, torch.empty(x.shape if fp8_amax is not None else (0,), dtype=torch.float8_e4m3fn, device=x.device))
