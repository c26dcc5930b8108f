"""cuBLASLt's FP8 matmul with an accumulating epilogue, called through ctypes: a measurement tool of
``probe_lora_gemm.py`` (issue 18), not part of the library.

It was the library's LoRA path for one commit (f9c5cea, ``projection.LORA_EPILOGUE``) and was taken out after the
60-layer benchmark measured no gain: the LoRA call took 100.87 ms with the epilogue on the FFN up projections,
100.65 ms with every branch added after its GEMM, 99.80 ms with every branch accumulated by the epilogue, GPU busy
95.27 / 95.23 / 96.14 ms (``results/fp8_lora_f9c5cea.md``). The per-GEMM reason is in ``results/lora_gemm_h200.md``.

``torch._scaled_mm`` calls ``cublasLtMatmul`` with ``beta = 0``: it can write its product, never add it to
a tensor. A LoRA linear on the real-FP8 path needs ``base(x) + branches(x)``, and adding the branches after
the GEMM reads and writes the whole [M, N] output once more (8.8 ms of a 60-block call with a rank-64 LoRA
on 12 linears a block, `benchmarks/results/probe_fp8_profile.md`). :func:`scaled_mm` makes the
same cuBLASLt call as ``torch._scaled_mm`` (e4m3 operands, per-tensor fp32 dequantization scales, the bias
in the epilogue, fp32 accumulation, optional fast accumulation) with ``beta = 1`` and ``C = D = out``:

    out = bf16( scale_a * scale_b * (a @ b.T)  +  bias  +  out )       (one rounding, in the epilogue)

so the branches, written into ``out`` first, are read by the epilogue of a GEMM that is bound by its
tensor cores instead of by a separate memory-bound pass. TransformerEngine accumulates into a bf16 output the
same way (``beta = 1``). On the H200 cuBLASLt's kernels load C without overlapping the main loop, so the read
is not free: it pays off for wide outputs only (`benchmarks/results/lora_gemm_h200.md`).

Row-major torch tensors map onto cuBLASLt's column-major convention as ``D^T = W · X^T``: cuBLASLt's A is
the weight (``[N, K]`` row-major = ``K x N`` column-major, ``op = T``), its B the activation codes (``[M, K]``
row-major = ``K x M``, ``op = N``), C and D the output (``[M, N]`` row-major = ``N x M``, leading dimension
its row stride): the "TN" layout cuBLASLt's FP8 kernels require. The bias is a vector over D's rows (N).

``accumulate=False`` (``beta = 0``) is exactly ``torch._scaled_mm``'s call, for measurements and tests.

The library is the one torch already loaded (found in ``/proc/self/maps``), so the kernels are those
``torch._scaled_mm`` picks from. Handles and descriptors are per thread and device; algorithms come from
cuBLASLt's heuristic, once per shape, strides, alignments and flags; the workspace is a stream-ordered
allocation of torch's caching allocator, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

log = logging.getLogger(__name__)

# cublasLt.h / cublas_api.h / library_types.h (CUDA 12 and 13 agree on these values)
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF, _R_8F_E4M3 = 0, 2, 14, 28
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER, _DESC_FAST_ACCUM, _DESC_BIAS_DATA_TYPE = 17, 18, 25, 26
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
_OUT_TYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}
MAX_WORKSPACE = 32 * 1024 * 1024  # what torch gives cuBLASLt on Hopper


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


_lib = None
_lib_reason: str | None = None
_lib_checked = False
_lock = threading.Lock()
_tls = threading.local()
_algos: dict[tuple, list] = {}  # the heuristic's candidates per problem (empty: none)
_layouts: dict[tuple, ctypes.c_void_p] = {}
_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)
CANDIDATES = 8  # heuristic candidates kept per problem (0 is cuBLASLt's first choice)


def _loaded_library_path() -> str | None:
    """The path of the libcublasLt torch loaded into this process, if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                i = line.find("/")
                if i >= 0 and "libcublasLt.so" in line:
                    return line[i:].strip()
    except OSError:
        pass
    return None


def _load():
    global _lib, _lib_reason, _lib_checked
    with _lock:
        if _lib_checked:
            return _lib
        _lib_checked = True
        if not torch.cuda.is_available():
            _lib_reason = "CUDA is not available"
            return None
        torch.cuda.init()  # libtorch_cuda loads cuBLASLt with the CUDA runtime it was built for
        names = [p for p in (_loaded_library_path(),) if p] + [
            f"libcublasLt.so.{torch.version.cuda.split('.')[0]}" if torch.version.cuda else "", "libcublasLt.so"]
        for name in filter(None, names):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            _lib_reason = f"libcublasLt could not be loaded (tried {', '.join(filter(None, names))})"
            return None
        vp, sz, i32, u64, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64
        sigs = {
            "cublasLtCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), i32, i32],
            "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), i32, u64, u64, i64],
            "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                               ctypes.POINTER(i32)],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
        }
        try:
            for fname, argtypes in sigs.items():
                fn = getattr(lib, fname)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            lib.cublasLtGetStatusString.argtypes, lib.cublasLtGetStatusString.restype = [i32], ctypes.c_char_p
        except AttributeError as e:
            _lib_reason = f"libcublasLt lacks a function: {e}"
            return None
        _lib = lib
        return lib


def unavailable_reason() -> str | None:
    """None when cuBLASLt can be called from here; else why not."""
    _load()
    return _lib_reason


def _check(status: int, what: str) -> None:
    if status != 0:
        msg = _lib.cublasLtGetStatusString(status)
        raise RuntimeError(f"cuBLASLt {what} failed: status {status} ({msg.decode() if msg else '?'})")


def _set(setter, obj, attr: int, value) -> None:
    _check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")


class _ThreadState:
    """A thread's handle and matmul descriptors (one per device and flags: pointers are set per call)."""

    def __init__(self) -> None:
        self.handles: dict[int, ctypes.c_void_p] = {}
        self.descs: dict[tuple, ctypes.c_void_p] = {}

    def handle(self, dev: int) -> ctypes.c_void_p:
        h = self.handles.get(dev)
        if h is None:
            h = ctypes.c_void_p()
            with torch.cuda.device(dev):
                _check(_lib.cublasLtCreate(ctypes.byref(h)), "handle creation")
            self.handles[dev] = h
        return h

    def desc(self, fast_accum: bool, bias_type: int | None) -> ctypes.c_void_p:
        key = (fast_accum, bias_type)
        d = self.descs.get(key)
        if d is None:
            d = ctypes.c_void_p()
            _check(_lib.cublasLtMatmulDescCreate(ctypes.byref(d), _COMPUTE_32F, _R_32F), "descriptor creation")
            s = _lib.cublasLtMatmulDescSetAttribute
            _set(s, d, _DESC_TRANSA, ctypes.c_int32(_OP_T))
            _set(s, d, _DESC_TRANSB, ctypes.c_int32(_OP_N))
            _set(s, d, _DESC_FAST_ACCUM, ctypes.c_int8(1 if fast_accum else 0))
            _set(s, d, _DESC_EPILOGUE, ctypes.c_uint32(_EPILOGUE_DEFAULT if bias_type is None else _EPILOGUE_BIAS))
            if bias_type is not None:
                _set(s, d, _DESC_BIAS_DATA_TYPE, ctypes.c_int32(bias_type))
            self.descs[key] = d
        return d


def _state() -> _ThreadState:
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _ThreadState()
    return st


def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    key = (dtype, rows, cols, ld)
    lay = _layouts.get(key)
    if lay is None:
        lay = ctypes.c_void_p()
        _check(_lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "layout creation")
        with _lock:
            lay = _layouts.setdefault(key, lay)
    return lay


def _alignment(address: int) -> int:
    """The largest power of two <= 256 that divides ``address`` (what the kernel may assume)."""
    a = 256
    while a > 1 and address % a:
        a //= 2
    return a


def scaled_mm_reasons(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> list[str]:
    """Why :func:`scaled_mm` cannot take these operands (empty: it can, if cuBLASLt offers an
    algorithm for them). ``a`` [M, K] and ``b`` [N, K] e4m3 row-major, ``out`` [M, N] bf16/fp16 with unit column
    stride, ``bias`` [N] of ``out``'s dtype, all on one CUDA device."""
    r = []
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        r.append(f"operands are {a.dtype} / {b.dtype}, not float8_e4m3fn")
    if out.dtype not in _OUT_TYPES:
        r.append(f"output dtype {out.dtype} (bf16 or fp16 only)")
    if a.dim() != 2 or b.dim() != 2 or out.dim() != 2:
        r.append("operands are not 2-D")
        return r
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2 or tuple(out.shape) != (m, n):
        r.append(f"shapes {tuple(a.shape)} x {tuple(b.shape)}^T -> {tuple(out.shape)} do not agree")
    if a.stride(1) != 1 or b.stride(1) != 1 or out.stride(1) != 1 or m < 1:
        r.append("an operand is not row-major, or there are no rows")
    elif a.stride(0) % 16 or b.stride(0) % 16 or (out.stride(0) * out.element_size()) % 16 or k % 16:
        r.append("leading dimensions are not multiples of 16 bytes")
    if bias is not None and (bias.dtype != out.dtype or bias.dim() != 1 or bias.shape[0] != n
                             or bias.stride(0) != 1):
        r.append("bias is not a contiguous [N] vector of the output's dtype")
    devs = {t.device for t in (a, b, out) + ((bias,) if bias is not None else ())}
    if len(devs) != 1 or next(iter(devs)).type != "cuda":
        r.append("operands are not on one CUDA device")
    elif unavailable_reason() is not None:
        r.append(unavailable_reason())
    return r


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out: torch.Tensor, *, fast_accum: bool, accumulate: bool,
              algo_index: int = 0) -> bool:
    """``out = scale_a * scale_b * (a @ b.T) + bias (+ out if accumulate)`` in one cuBLASLt FP8 matmul on torch's
    current stream (``beta = 1`` and ``C = D = out`` when accumulating, else ``beta = 0``: what
    ``torch._scaled_mm`` computes). Operands as :func:`scaled_mm_reasons` accepts them (the caller checked);
    ``scale_a`` / ``scale_b``: one-element fp32 device tensors (dequantization scales). ``algo_index``: which of
    cuBLASLt's heuristic candidates (0: its first choice). Returns False, having done nothing, when cuBLASLt
    offers no such algorithm (the caller then computes it otherwise)."""
    if _lib is None and _load() is None:
        raise RuntimeError(f"cuBLASLt is not usable: {_lib_reason}")
    key, ptrs = _problem(a, b, bias, out, fast_accum, accumulate)
    dev, m, n, k, lda, ldb, ldd, out_type, bias_type, _, _, aligns = key
    st = _state()
    desc = st.desc(bool(fast_accum), bias_type)
    s = _lib.cublasLtMatmulDescSetAttribute
    _set(s, desc, _DESC_A_SCALE_POINTER, ctypes.c_void_p(scale_b.data_ptr()))
    _set(s, desc, _DESC_B_SCALE_POINTER, ctypes.c_void_p(scale_a.data_ptr()))
    if bias is not None:
        _set(s, desc, _DESC_BIAS_POINTER, ctypes.c_void_p(ptrs[3]))
    lay_a = _layout(_R_8F_E4M3, k, n, lda)  # the weight, K x N column-major, op T
    lay_b = _layout(_R_8F_E4M3, k, m, ldb)  # the activation codes, K x M column-major, op N
    lay_d = _layout(out_type, n, m, ldd)  # C and D: N x M column-major
    handle = st.handle(dev)
    found = _algos.get(key)
    if found is None:
        found = _algos[key] = _heuristic(handle, desc, lay_a, lay_b, lay_d, aligns, CANDIDATES)
        log.debug("cuBLASLt FP8 %dx%dx%d (accumulate %s): %d algorithms", m, n, k, accumulate, len(found))
    if algo_index >= len(found):
        return False
    result = found[algo_index]
    ws_size = int(result.workspaceSize)
    ws = torch.empty(ws_size, dtype=torch.uint8, device=out.device) if ws_size else None
    stream = torch._C._cuda_getCurrentRawStream(dev)
    beta = _ONE if accumulate else _ZERO
    _check(_lib.cublasLtMatmul(handle, desc, ctypes.byref(_ONE), ptrs[0], lay_a, ptrs[1], lay_b, ctypes.byref(beta),
                               ptrs[2], lay_d, ptrs[2], lay_d, ctypes.byref(result.algo),
                               None if ws is None else ws.data_ptr(), ws_size, stream), "matmul")
    return True


def algorithm_count(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, *,
                    fast_accum: bool, accumulate: bool) -> int:
    """How many heuristic candidates :func:`scaled_mm` has for these operands (after one call with them)."""
    return len(_algos.get(_problem(a, b, bias, out, fast_accum, accumulate)[0]) or ())


def _problem(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, fast_accum: bool,
             accumulate: bool) -> tuple[tuple, tuple[int, int, int, int]]:
    """``(key, pointers)``: what the heuristic's answer depends on (device, sizes, leading dimensions, types,
    flags, pointer alignments), and the pointers of cuBLASLt's A (weight), B (codes), C = D (out) and bias."""
    m, k = a.shape
    dev = out.device.index if out.device.index is not None else torch.cuda.current_device()
    out_type = _OUT_TYPES[out.dtype]
    ptrs = (b.data_ptr(), a.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr())
    key = (dev, m, b.shape[0], k, b.stride(0), a.stride(0), out.stride(0), out_type,
           None if bias is None else out_type, bool(fast_accum), bool(accumulate), tuple(map(_alignment, ptrs)))
    return key, ptrs


def _heuristic(handle, desc, lay_a, lay_b, lay_d, aligns, count: int) -> list[_HeuristicResult]:
    pref = ctypes.c_void_p()
    _check(_lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference creation")
    try:
        sp = _lib.cublasLtMatmulPreferenceSetAttribute
        _set(sp, pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(MAX_WORKSPACE))
        for name, al in zip("abcd", aligns[:3] + (aligns[2],)):
            _set(sp, pref, _PREF_MIN_ALIGNMENT[name], ctypes.c_uint32(al))
        results, got = (_HeuristicResult * count)(), ctypes.c_int(0)
        status = _lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, lay_a, lay_b, lay_d, lay_d, pref, count,
                                                     results, ctypes.byref(got))
    finally:
        _lib.cublasLtMatmulPreferenceDestroy(pref)
    if status != 0:
        return []
    return [results[i] for i in range(got.value) if results[i].state == 0]


__all__ = ["MAX_WORKSPACE", "scaled_mm_reasons", "algorithm_count", "scaled_mm", "unavailable_reason"]
