"""The capture of one signature (:func:`capture`): static buffers, the warm-up on a side stream (its output
answers the call), host constants (:class:`HostConstants`), RoPE tables kept (:class:`KeepRope`), the graph.
Both run with :mod:`qwen_absorb.ops.lane` active (the warm-up sets the lane's stream up outside the graph)."""

import collections
import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .. import hooks
from ..shape_graphs import map_tensors, recording
from ..ops import lane
from . import settings
from .signature import ATOMS, Call, freeze, thaw_call

# diffusers' RoPE caches (QwenEmbedRope / QwenEmbedLayer3DRope) whose tensors a graph reads: see KeepRope.
ROPE_METHODS = ("_compute_video_freqs", "_compute_condition_freqs", "_get_device_freqs")


def freeze_data(x: Any) -> Any:
    """An exact, hashable form of host data given to ``torch.tensor`` (None: not something we key)."""
    tx = type(x)
    if tx in (bool, int, str, float, complex) or x is None:
        return freeze(x, [])  # as a call's argument: with its type, floats exactly
    if tx is list or tx is tuple:
        out = tuple(map(freeze_data, x))
        return None if None in out else (tx, out)
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and type(x) is torch.Tensor:
        flat = x.detach().reshape(-1).contiguous()
        raw = flat.tolist() if flat.dtype == torch.bool else flat.view(torch.uint8).tolist()
        return ("tensor", flat.dtype, tuple(x.shape), bytes(raw))
    if type(x).__module__ == "numpy" and hasattr(x, "tobytes"):
        return ("numpy", str(getattr(x, "dtype", "")), tuple(getattr(x, "shape", ())), x.tobytes())
    return None


class HostConstants:
    """``torch.tensor`` / ``torch.as_tensor`` of host data onto a CUDA device, made capturable: such a call (diffusers'
    ``modulate_index`` of ``zero_cond_t`` models, the text length next to a mask) is a pageable copy and a sync, which a
    capture refuses. ``"record"`` (the warm-up) keeps a copy of each result under an exact key; ``"replay"`` (the
    capture) answers the same call with a device clone of it. Swapped on the ``torch`` module itself, for the warm-up
    and the capture only (swapping a module's ``torch`` global breaks torch.compile's guards)."""

    _lock = threading.RLock()
    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self) -> None:
        self.recorded: dict[Any, list[torch.Tensor]] = {}
        self.used: collections.Counter = collections.Counter()
        self.mode: str | None = None
        self.hits = 0

    def tensors(self) -> list[torch.Tensor]:
        return [x for lst in self.recorded.values() for x in lst]

    def _key(self, fname: str, data: Any, args: tuple, kwargs: dict) -> tuple | None:
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            return None  # no host copy involved
        if len(args) > (2 if fname == "as_tensor" else 0):  # as_tensor(data, dtype, device); tensor's are keywords
            return None
        kw = {**dict(zip(("dtype", "device"), args)), **kwargs}
        if kw.get("device") is None:
            return None
        dev = hooks.as_device(kw["device"])
        if dev.type not in self.device_types:
            return None
        if dev.type == "cuda" and dev.index is None:  # "cuda" is the calling thread's current device
            dev = torch.device("cuda", torch.cuda.current_device())
        # None is the default: the same call as without it
        rest = tuple((k, type(v), v) for k, v in sorted(kw.items()) if k != "device" and v is not None)
        frozen = freeze_data(data)
        if frozen is None or any(tv not in ATOMS for _, tv, _ in rest):
            return None
        return (fname, frozen, dev, rest)

    def _wrap(self, fname: str, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            key = None
            if self.mode is not None and not torch.compiler.is_compiling():
                with contextlib.suppress(Exception):  # an unusual call: not ours to answer
                    key = self._key(fname, data, args, kwargs)
            if key is not None and self.mode == "replay":
                lst = self.recorded.get(key)
                i = self.used[key]
                if lst and i < len(lst):
                    self.used[key] += 1
                    self.hits += 1
                    return lst[i].clone()
            out = real(data, *args, **kwargs)
            if key is not None and self.mode == "record" and type(out) is torch.Tensor:
                self.recorded.setdefault(key, []).append(out.detach().clone())
            return out

        wrapper.__wrapped__ = real  # type: ignore[attr-defined]
        return wrapper

    @contextlib.contextmanager
    def active(self, mode: str) -> Iterator["HostConstants"]:
        """``torch.tensor`` / ``torch.as_tensor`` go through this object for the ``with`` block."""
        if not HostConstants._lock.acquire(timeout=60):
            raise RuntimeError("another CUDA-graph capture holds torch.tensor")
        saved: dict[str, Any] = {}
        try:
            for name in ("tensor", "as_tensor"):
                saved[name] = real = getattr(torch, name)
                setattr(torch, name, self._wrap(name, real))
            self.mode = mode
            if mode == "replay":
                self.used.clear()
            yield self
        finally:
            for name, real in saved.items():
                setattr(torch, name, real)
            self.mode = None
            HostConstants._lock.release()


class KeepRope:
    """During a capture, keep every tensor diffusers' RoPE caches hand out (an LRU eviction would free memory
    the graph reads): instance attributes shadow the cached methods for the capture only."""

    def __init__(self, transformer: nn.Module, keep: list[torch.Tensor]) -> None:
        self.pe, self.keep, self.names = getattr(transformer, "pos_embed", None), keep, []

    def __enter__(self) -> None:
        pe = self.pe
        if not isinstance(pe, nn.Module):
            return
        for name in ROPE_METHODS:
            if name in pe.__dict__ or not callable(getattr(type(pe), name, None)):
                continue
            bound = getattr(pe, name)

            def wrapper(*a: Any, _f: Callable = bound, **k: Any) -> Any:
                out = _f(*a, **k)
                for x in out if isinstance(out, tuple) else (out,):
                    if isinstance(x, torch.Tensor):
                        self.keep.append(x)
                return out

            object.__setattr__(pe, name, wrapper)
            self.names.append(name)

    def __exit__(self, *exc: Any) -> None:
        for name in self.names:
            self.pe.__dict__.pop(name, None)


def tensors_in(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(x, out.append)
    return out


def static_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor with ``x``'s shape, strides, dtype, device and address modulo ``settings.ALIGN``: kernels pick
    vectorized or scalar paths by alignment, so a static buffer aligned differently could change the bits."""
    if x.numel() == 0:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    align = settings.ALIGN
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    es = x.element_size()
    base = torch.empty(span + align // es, dtype=x.dtype, device=x.device)
    off = ((x.data_ptr() - base.data_ptr()) % align) // es  # both addresses are multiples of es
    return base.as_strided(x.shape, x.stride(), off)


class Graph:  # one captured signature
    __slots__ = ("graph", "statics", "out", "keep", "desc", "replays", "capture_ms")

    def __init__(self, graph: Any, statics: list[torch.Tensor], out: Any, keep: list[torch.Tensor], desc: str,
                 capture_ms: float) -> None:
        self.graph, self.statics, self.out, self.keep, self.desc = graph, statics, out, keep, desc
        self.replays, self.capture_ms = 0, capture_ms


# the warm-up's output (the call's answer), and the graph or the error
Captured = collections.namedtuple("Captured", "warm graph error host_constants")


def capture(inner: Callable[..., Any], transformer: nn.Module, call: Call, desc: str, streams: dict,
            pools: dict, statics: list[torch.Tensor] | None = None) -> Captured:
    """Warm up and capture ``inner`` (the wrapped forward) for ``call``'s signature. ``streams`` / ``pools``: by
    device, made here when missing. ``statics``: one per tensor of ``call`` (a group's shared ones), else made here.
    An exception of the warm-up propagates (the eager call would raise it too); one of the capture is returned in
    ``Captured.error``. The caller keeps ``inner`` from re-entering the runner meanwhile."""
    dev = call.device
    with torch.cuda.device(dev):
        cur = torch.cuda.current_stream()
        if statics is None:
            statics = [static_like(x) for x in call.tensors]
        for s, x in zip(statics, call.tensors):
            s.copy_(x)
        s_args, s_kwargs = thaw_call(call.spec, statics)
        if (side := streams.get(dev)) is None:
            side = streams[dev] = torch.cuda.Stream(dev)
        consts = HostConstants()
        # Warm-up on the side stream the capture will use (lazy per-stream state such as cuBLAS workspaces
        # is created outside the graph). Its output answers this call.
        side.wait_stream(cur)
        with torch.cuda.stream(side), consts.active("record"), lane.active():
            warm = inner(*s_args, **s_kwargs)
        cur.wait_stream(side)
        statics_storage = {s.untyped_storage().data_ptr() for s in statics}

        def own(x: torch.Tensor) -> torch.Tensor:
            if x.untyped_storage().data_ptr() in statics_storage:
                return x.clone()  # never hand out a static buffer
            if x.is_cuda:
                x.record_stream(cur)  # allocated on the side stream, used and freed on the caller's
            return x

        warm = map_tensors(warm, own)
        graph = torch.cuda.CUDAGraph()
        keep: list[torch.Tensor] = []
        if (pool := pools.get(dev)) is None:
            pool = pools[dev] = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        # No cyclic garbage collection while capturing: a collected CUDAGraph (an evicted one, or one of
        # a dropped model) resets itself in its destructor, which is not permitted during a capture and
        # invalidates it (seen on the H200: "operation not permitted when stream is capturing (reset)").
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(side), consts.active("replay"), KeepRope(transformer, keep):
                with recording(graph, pool, side), lane.active():  # (no cache emptying: shape_graphs.recording)
                    out = inner(*s_args, **s_kwargs)
        except Exception as e:  # noqa: BLE001 - any capture failure means: eager for this signature
            return Captured(warm, None, e, consts.hits)
        finally:
            if gc_was_on:
                gc.enable()
            cur.wait_stream(side)
        ms = (time.perf_counter() - t0) * 1e3
    return Captured(warm, Graph(graph, statics, out, keep + consts.tensors(), desc, ms), None, consts.hits)
