"""CuPy side of the fused ops: NVRTC compilation, kernel cache, launches on torch's stream.

Kernels are CUDA C sources in ``csrc/`` compiled by CuPy's ``RawModule`` (NVRTC) on first use and
cached per (op, dtype, variant, device). CuPy also caches the compiled binary on disk, keyed by the
source text and options, so a second process skips NVRTC. Headers are inlined into the source
string before compilation so that the on-disk cache key covers them too.

Launches go to ``torch.cuda.current_stream()``, take raw pointers, allocate nothing and never
synchronise, so they can be captured in a CUDA graph once compiled.
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("qwen_absorb")

CSRC = Path(__file__).resolve().parent / "csrc"
# LayerNorm reduction layouts (csrc/layer_norm.cuh): mode -> (threads per row, elements per slot).
# Mode 0 is PyTorch's vectorized LayerNorm path, mode 1 its rowwise path.
LN_MODES = {0: (128, 4), 1: (512, 1)}
BGR_THREADS = 128  # QA_BGR_THREADS
_NV_CHOICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
MIN_CAPABILITY = (8, 0)  # cvt.rn.bf16.f32 needs sm_80

TRAITS = {torch.bfloat16: "QaBF16", torch.float16: "QaF16", torch.float32: "QaF32"}

_cupy = None
_cupy_reason: str | None = None
_cupy_checked = False
_kernels: dict[tuple, object] = {}
_streams: dict[tuple[int, int], object] = {}
_capability: dict[int, tuple[int, int]] = {}


def cupy_unavailable_reason() -> str | None:
    """None when CuPy imports and sees a GPU, else why not (memoised)."""
    global _cupy, _cupy_reason, _cupy_checked
    if not _cupy_checked:
        _cupy_checked = True
        try:
            import cupy  # noqa: PLC0415

            if cupy.cuda.runtime.getDeviceCount() < 1:
                _cupy_reason = "CuPy sees no CUDA device"
            else:
                _cupy = cupy
        except Exception as e:  # ImportError, CUDARuntimeError, missing libraries
            _cupy_reason = f"CuPy is not usable: {type(e).__name__}: {e}".strip()
    return _cupy_reason


def device_capability(device: torch.device) -> tuple[int, int]:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _capability:
        _capability[idx] = torch.cuda.get_device_capability(idx)
    return _capability[idx]


def kernel_source(filename: str) -> str:
    """The .cu file with its local #include "x.cuh" lines replaced by the header text (once each)."""
    seen: set[str] = set()

    def expand(name: str) -> str:
        text = (CSRC / name).read_text()

        def repl(m: re.Match) -> str:
            inc = m.group(1)
            if inc in seen:
                return ""
            seen.add(inc)
            return expand(inc)

        text = re.sub(r"^#pragma once\s*$", "", text, flags=re.M)
        return re.sub(r'^#include "([^"]+)"\s*$', repl, text, flags=re.M)

    return expand(filename)


def nvrtc_options() -> tuple[str, ...]:
    return ("-std=c++17",)


def _get_kernel(filename: str, expr: str, device_index: int):
    """(RawKernel, its low-level cupy Function), compiled and loaded (before any graph capture)."""
    key = (filename, expr, device_index)
    k = _kernels.get(key)
    if k is None:
        cp = _cupy
        with cp.cuda.Device(device_index):
            mod = cp.RawModule(code=kernel_source(filename), options=nvrtc_options(), name_expressions=[expr])
            raw = mod.get_function(expr)
            k = (raw, raw.kernel)
        log.debug("compiled %s for device %d", expr, device_index)
        _kernels[key] = k
    return k


def _stream(device_index: int):
    ptr = torch.cuda.current_stream(device_index).cuda_stream
    s = _streams.get((device_index, ptr))
    if s is None:
        with warnings.catch_warnings():  # CuPy 14 deprecates the name, not the behaviour
            warnings.simplefilter("ignore", DeprecationWarning)
            s = _cupy.cuda.ExternalStream(ptr, device_index)
        _streams[(device_index, ptr)] = s
    return s


# "context": make torch's stream (and the device) current for CuPy and call the RawKernel;
# "direct": pass the stream to the low-level Function call. Same launch; the host cost differs
# (benchmarks/launch_overhead.py measures both on the GPU).
LAUNCH_STYLE = os.environ.get("QWEN_ABSORB_LAUNCH_STYLE", "direct")


def _launch(filename: str, expr: str, device: torch.device, grid: int, block: int, args: tuple) -> None:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    raw, fn = _get_kernel(filename, expr, idx)
    if LAUNCH_STYLE == "direct":
        fn((grid, 1, 1), (block, 1, 1), args, 0, _stream(idx))
    else:
        with _cupy.cuda.Device(idx), _stream(idx):
            raw((grid,), (block,), args)


# ---- argument helpers ------------------------------------------------------------------------
def _ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _aligned(t: torch.Tensor | None, nbytes: int, row_stride: int | None = None) -> bool:
    if t is None:
        return True
    if t.data_ptr() % nbytes:
        return False
    return row_stride is None or (row_stride * t.element_size()) % nbytes == 0


def _pick_nv(per_thread: int) -> int:
    for nv in _NV_CHOICES:
        if nv >= per_thread:
            return nv
    return 0  # streaming variant


def _rows(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(tensor, row stride in elements) of a [R, D] / [R, 1, D] parameter."""
    return p, int(p.stride(0))


def _index_args(index: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
    if index is None:
        return None, 0
    index = index.contiguous()
    return index, index.element_size()


def _ln_layout(D: int, vectorized: bool) -> tuple[int, int, int, int]:
    """(mode, threads, elements per slot, slots per thread) of the LayerNorm kernels.

    ``vectorized``: whether eager PyTorch would take its vectorized LayerNorm path for this input
    (D % 4 == 0 and the LayerNorm input 4-element aligned); the kernel then uses the same layout.
    """
    mode = 0 if (vectorized and D % 4 == 0) else 1
    threads, ch = LN_MODES[mode]
    return mode, threads, ch, _pick_nv(math.ceil((D // ch) / threads))


# ---- launchers (inputs already validated; activations contiguous) --------------------------------
def layer_norm_scale_shift(x, shift, scale, eps, index):
    B, L, D = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    # eager's norm1 sees x itself: a misaligned x sends PyTorch down its rowwise path
    mode, threads, ch, nv = _ln_layout(D, _aligned(x, 4 * x.element_size()))
    a = ch * x.element_size()
    shift, shift_rs = _rows(shift)
    scale, scale_rs = _rows(scale)
    index, ikind = _index_args(index)
    flags = (
        (_aligned(x, a) and _aligned(out, a))
        | (_aligned(shift, a, shift_rs) << 1)
        | (_aligned(scale, a, scale_rs) << 2)
    )
    expr = f"layer_norm_scale_shift_kernel<{TRAITS[x.dtype]}, {mode}, {nv}>"
    args = (
        _ptr(x), _ptr(out), _ptr(shift), np.int64(shift_rs), _ptr(scale), np.int64(scale_rs),
        _ptr(index), np.int32(ikind), np.int64(B), np.int64(L), np.int32(D), np.float32(eps),
        np.int32(flags),
    )
    _launch("layer_norm_scale_shift.cu", expr, x.device, B * L, threads, args)
    return out


def bias_residual_layer_norm_scale_shift(residual, x, bias, gate, shift, scale, eps, index, amax, quant_mode):
    B, L, D = x.shape
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return new_residual, out
    # eager's norm2 sees a freshly allocated (aligned) tensor
    mode, threads, ch, nv = _ln_layout(D, True)
    a = ch * x.element_size()
    gate, gate_rs = _rows(gate)
    shift, shift_rs = _rows(shift)
    scale, scale_rs = _rows(scale)
    index, ikind = _index_args(index)
    flags = (
        (_aligned(x, a) and _aligned(residual, a) and _aligned(out, a) and _aligned(new_residual, a))
        | (_aligned(shift, a, shift_rs) << 1)
        | (_aligned(scale, a, scale_rs) << 2)
        | (_aligned(gate, a, gate_rs) << 3)
        | (_aligned(bias, a) << 4)
    )
    expr = f"bias_residual_layer_norm_scale_shift_kernel<{TRAITS[x.dtype]}, {mode}, {nv}>"
    args = (
        _ptr(residual), _ptr(x), _ptr(bias), _ptr(gate), np.int64(gate_rs), _ptr(shift),
        np.int64(shift_rs), _ptr(scale), np.int64(scale_rs), _ptr(new_residual), _ptr(out),
        _ptr(index), np.int32(ikind), np.int64(B), np.int64(L), np.int32(D), np.float32(eps),
        _ptr(amax), np.int32(quant_mode), np.int32(flags),
    )
    _launch("bias_residual_layer_norm_scale_shift.cu", expr, x.device, B * L, threads, args)
    return new_residual, out


def bias_gate_residual(residual, x, bias, gate, index):
    B, L, D = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    vec = 16 // x.element_size()
    if D % vec:
        vec = 1
    nv = _pick_nv(math.ceil((D // vec) / BGR_THREADS))
    if nv > 8:
        nv = 0
    a = vec * x.element_size()
    gate, gate_rs = _rows(gate)
    index, ikind = _index_args(index)
    flags = (
        (_aligned(x, a) and _aligned(residual, a) and _aligned(out, a))
        | (_aligned(gate, a, gate_rs) << 3)
        | (_aligned(bias, a) << 4)
    )
    expr = f"bias_gate_residual_kernel<{TRAITS[x.dtype]}, {vec}, {nv}>"
    args = (
        _ptr(residual), _ptr(x), _ptr(bias), _ptr(gate), np.int64(gate_rs), _ptr(out),
        _ptr(index), np.int32(ikind), np.int64(B), np.int64(L), np.int32(D), np.int32(flags),
    )
    _launch("bias_gate_residual.cu", expr, x.device, B * L, BGR_THREADS, args)
    return out


def all_kernel_expressions() -> list[tuple[str, str]]:
    """Every (file, template instance) the launchers can ask for: used by the compile test."""
    out = []
    for t in TRAITS.values():
        for mode in LN_MODES:
            for nv in (*_NV_CHOICES, 0):
                out.append(("layer_norm_scale_shift.cu", f"layer_norm_scale_shift_kernel<{t}, {mode}, {nv}>"))
                out.append(
                    (
                        "bias_residual_layer_norm_scale_shift.cu",
                        f"bias_residual_layer_norm_scale_shift_kernel<{t}, {mode}, {nv}>",
                    )
                )
        vec = 8 if t != "QaF32" else 4
        for v in (1, vec):
            for nv in (1, 2, 3, 4, 5, 6, 8, 0):
                out.append(("bias_gate_residual.cu", f"bias_gate_residual_kernel<{t}, {v}, {nv}>"))
    return out
