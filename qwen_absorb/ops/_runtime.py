"""CuPy runtime of the fused ops: NVRTC compilation, kernel cache, lean launches on torch's stream.

Sources in ``csrc/`` are compiled by CuPy's ``RawModule`` (NVRTC) on first use, cached per (file, template instance,
device) and on disk by CuPy (keyed by the source text: headers are inlined). Host cost decides whether the patched
model is faster at all and CuPy boxes every kernel argument: so every kernel takes ONE by-value ``struct``, packed by
a :class:`Launcher` into a per-thread host buffer, launched on torch's current raw stream. Launches allocate nothing
on the device and never synchronise."""

import ctypes
import functools
import logging
import re
import struct
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import torch

log = logging.getLogger("qwen_absorb")
CSRC = Path(__file__).resolve().parent / "csrc"
MIN_CAPABILITY = (8, 0)  # cvt.rn.bf16.f32 needs sm_80
TRAITS = {torch.bfloat16: "QaBF16", torch.float16: "QaF16", torch.float32: "QaF32"}
DEFINES_ENV = "QWEN_ABSORB_NVRTC_DEFINES"  # "NAME=VALUE,..." compile-time knobs (tests of kernel variants)


def _env_defines() -> dict[str, int]:
    raw = os.environ.get(DEFINES_ENV, "").strip()
    out = {}
    for item in filter(None, (t.strip() for t in raw.split(","))):
        name, _, value = item.partition("=")
        if not name.isidentifier() or not value.lstrip("-").isdigit():
            raise ValueError(f"{DEFINES_ENV}: expected NAME=INT[,NAME=INT...], got {raw!r}")
        out[name] = int(value)
    return out


NVRTC_OPTIONS = ("-std=c++17", *(f"-D{k}={v}" for k, v in _env_defines().items()))
_cupy = _cpointer = None  # set by cupy_unavailable_reason
_functions: dict[tuple[str, str, int], object] = {}
_caches: list[dict] = [_functions]  # every per-signature kernel cache (cleared by set_defines)
_streams: dict[int, object] = {}
_capability: dict[int, tuple[int, int]] = {}


@functools.cache
def cupy_unavailable_reason() -> str | None:
    """None when CuPy imports, sees a GPU and can pass a struct argument; else why not (memoised)."""
    global _cupy, _cpointer
    try:
        import cupy  # noqa: PLC0415
        from cupy.cuda.function import CPointer  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
        _cupy, _cpointer = cupy, CPointer
    except Exception as e:  # ImportError, CUDARuntimeError, missing libraries
        return f"CuPy is not usable: {type(e).__name__}: {e}".strip()
    return None


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_capability(device: torch.device) -> tuple[int, int]:
    idx = device_index(device)
    return _capability.get(idx) or _capability.setdefault(idx, torch.cuda.get_device_capability(idx))


def kernel_source(filename: str) -> str:
    """The .cu file with its local #include "x.cuh" lines replaced by the header text (once each)."""
    seen: set[str] = set()

    def repl(m: re.Match) -> str:
        inc = m.group(1)
        if inc in seen:
            return ""
        seen.add(inc)
        return expand(inc)

    def expand(name: str) -> str:
        text = re.sub(r"^#pragma once\s*$", "", (CSRC / name).read_text(), flags=re.M)
        return re.sub(r'^#include "([^"]+)"\s*$', repl, text, flags=re.M)

    return expand(filename)


def function(filename: str, expr: str, device_idx: int, dynamic_smem: int = 0):
    """The compiled kernel ``expr`` (a template instance) of ``csrc/filename`` on a device, compiled on first use
    (before a CUDA-graph capture: NVRTC and module loading cannot be captured). ``dynamic_smem``: the bytes of dynamic
    shared memory its launches ask for; above the default 48 KiB the kernel opts in once."""
    key = (filename, expr, device_idx, dynamic_smem)
    fn = _functions.get(key)
    if fn is None:
        with _cupy.cuda.Device(device_idx):
            mod = _cupy.RawModule(code=kernel_source(filename), options=NVRTC_OPTIONS, name_expressions=[expr])
            raw = mod.get_function(expr)
            if dynamic_smem > 48 * 1024:
                raw.max_dynamic_shared_size_bytes = dynamic_smem
            fn = raw.kernel  # the low-level Function: no argument preprocessing
        log.debug("compiled %s for device %d", expr, device_idx)
        _functions[key] = fn
    return fn


def template(name: str, *args, optional: int = 0) -> str:
    """The instance ``name<args...>``, ``optional`` appended where non-zero (0 is the template's default: the plain
    instance keeps its shorter name)."""
    return f"{name}<{', '.join(map(str, args + ((optional,) if optional else ())))}>"


def launcher(cache: dict, key: tuple, filename: str, expr: str, device_idx: int, block: int, layout: str,
             smem: int = 0) -> "Launcher":
    """A cache miss: the :class:`Launcher` of :func:`function` ``(filename, expr)``, stored under ``key``."""
    return cache.setdefault(key, Launcher(function(filename, expr, device_idx, smem), block, layout, device_idx, smem))


def register_cache(cache: dict) -> dict:
    """Register an op's per-signature cache of compiled kernels (see :func:`set_defines`)."""
    _caches.append(cache)
    return cache


def set_defines(defines: dict[str, int] | None = None) -> None:
    """Compile later kernels with ``-DNAME=VALUE`` options, clearing every kernel cache. ``None`` restores the
    defaults (those of ``QWEN_ABSORB_NVRTC_DEFINES``, if set)."""
    global NVRTC_OPTIONS
    merged = {**_env_defines(), **(defines or {})}
    NVRTC_OPTIONS = ("-std=c++17", *(f"-D{k}={v}" for k, v in merged.items()))
    for c in _caches:
        c.clear()


def _stream(device_idx: int) -> SimpleNamespace:
    """What CuPy's low-level launch needs of torch's current stream: an object with its ``ptr``."""
    ptr = torch._C._cuda_getCurrentRawStream(device_idx)
    return _streams.get(ptr) or _streams.setdefault(ptr, SimpleNamespace(ptr=ptr))


class Launcher:
    """Launches one compiled kernel whose only parameter is a struct laid out as ``layout`` (a :mod:`struct`
    format in native mode, fields in the order of the C struct)."""

    __slots__ = ("fn", "block", "dev", "smem", "_pack", "_size", "_tls")

    def __init__(self, fn, block: int, layout: str, device_idx: int, smem: int = 0) -> None:
        self.fn, self.block, self.dev, self.smem = fn, (block, 1, 1), device_idx, smem
        packer = struct.Struct("@" + layout)
        self._pack = packer.pack_into
        self._size = (packer.size + 15) // 16 * 16  # room for the C struct's trailing padding
        self._tls = threading.local()

    def __call__(self, grid: int, *values) -> None:
        tls = self._tls
        buf = getattr(tls, "buf", None)
        if buf is None:
            buf = tls.buf = ctypes.create_string_buffer(self._size)
            tls.arg = (_cpointer(ctypes.addressof(buf)),)
        self._pack(buf, 0, *values)
        dev = self.dev
        if torch._C._cuda_getDevice() == dev:
            return self.fn((grid, 1, 1), self.block, tls.arg, self.smem, _stream(dev))
        # CuPy launches in the current context: a kernel of cuda:1 launched from cuda:0 has an invalid handle
        with torch.cuda.device(dev):
            self.fn((grid, 1, 1), self.block, tls.arg, self.smem, _stream(dev))


def ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def aligned(t: torch.Tensor, nbytes: int) -> bool:
    """Whether vector loads of ``nbytes`` are legal on each row start of the 2-D ``t``."""
    return t.data_ptr() % nbytes == 0 and (t.stride(0) * t.element_size()) % nbytes == 0
