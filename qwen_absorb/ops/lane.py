"""Second CUDA streams beside the caller's ("lanes"), for work that need not wait in line behind a GEMM.

Two lanes per device, each one stream:

- ``"branch"``: work of a few kernels that reads what a GEMM reads and is needed only after it: the next block's
  image modulation beside the image FFN, and, where ``Tuning.lora_products_aside`` asks for it (off by
  default, measured below), a LoRA branch's ``lora_A`` product (``x @ A.T``) beside the FP8 GEMM of its base
  layer (the GEMM is compute-bound, the rank-64 product memory- or latency-bound): :func:`aside` forks the lane from the caller's stream and runs the work there, :func:`settle` makes
  the caller's stream wait before the result is read.
- ``"txt"``: the text stream of a Qwen-Image block (128 rows: its GEMMs and fused ops are latency-bound and run
  in a few SMs) beside the image stream, from after the attention to the next block's q/k/v: :func:`region`
  runs a stretch of work on it; the caller settles before the joint attention reads its q/k/v.

Same kernels, same inputs, so the same bits as on one stream. Work inside a lane never forks another lane (it
runs in line there).

Measured (``benchmarks/results/archive/fp8_lora/fp8_lora_50e4b96.md``, 60 layers, H200): the FP8 call 81.9 ms against 84.6 on one stream,
with a rank-64 LoRA 94.9 against 100.2 ms; the branch lane alone gains nothing (a product beside a GEMM that fills
every SM slows it by about what it hides), beside the text lane 0.26-0.44 ms. With net[2]'s product folded into
the GELU kernel the LoRA call is faster with the products in line (``Tuning.lora_products_aside``, off:
94.5 against 96.8 ms, ``fp8_lora.md``); the next block's image modulation stays on the branch lane.

Only while a CUDA graph is captured (and in the eager warm-up before it, which sets each lane's cuBLAS workspace
up outside the graph): :func:`active` is entered by ``cuda_graph.capture``. In a graph a fork and a join are edges
and cost nothing at replay; eagerly each is an event record and a wait on the host (~5 us), which the host-bound
eager call cannot spare.

Memory: the caching allocator hands a freed block back to the stream that allocated it, to be reused by that
stream alone, without waiting for other streams. So a tensor of the caller's stream that a lane reads is held
until the lane joins back (the caller's later work is ordered after the lane's reads), and a tensor of the lane
that the caller reads is held until the lane forks again after the join (the lane's later work is ordered after
the caller's reads).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_local = threading.local()
NAMES = ("branch", "txt")  # which of them a patched model uses: its Tuning.lanes, asked by the callers


class Lane:
    """One lane of one device: its stream, whether it has work the caller's stream has not waited for, and the
    tensors held for the other stream (see the module's doc)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pending = False  # forked, not joined yet
        self.caller_held: list[Any] = []  # caller-stream tensors the lane reads: until the join
        self.lane_held: list[Any] = []  # lane tensors the caller will read: until a fork after the join
        self.lane_released: list[Any] = []  # lane tensors the caller may read now (joined): until the next fork
        self.forks = 0
        self.caller: torch.cuda.Stream | None = None  # the stream that forked it (lanes fork from no lane)

    def fork(self) -> None:
        self.caller = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(self.caller)
        self.lane_released.clear()  # the caller's reads of them were issued before this wait
        self.pending = True
        self.forks += 1

    def join(self) -> None:
        """The forking stream waits for the lane. Asked on another stream (the body of another lane's region,
        which runs its own work in line): nothing, as what the lane holds is held for the forking stream."""
        if not self.pending or torch.cuda.current_stream(self.stream.device) != self.caller:
            return
        self.caller.wait_stream(self.stream)
        self.pending = False
        self.caller_held.clear()
        self.lane_released.extend(self.lane_held)
        self.lane_held.clear()

    def reset(self) -> None:
        self.pending = False
        self.caller_held.clear()
        self.lane_held.clear()
        self.lane_released.clear()


class _State:
    def __init__(self) -> None:
        self.lanes: dict[tuple[torch.device, str], Lane] = {}
        self.depth = 0


def _state() -> _State:
    st = getattr(_local, "state", None)
    if st is None:
        st = _local.state = _State()
    return st


@contextlib.contextmanager
def active(enabled: bool = True) -> Iterator[None]:
    """Within: :func:`aside` and :func:`region` use the lanes of their inputs' device (this thread only). On exit
    every lane joins the caller's stream (a capture must end with its forks joined) and drops what it held."""
    st = _state()
    if not enabled:
        yield
        return
    st.depth += 1
    try:
        yield
    finally:
        st.depth -= 1
        if st.depth == 0:
            for key, lane in list(st.lanes.items()):
                try:
                    if lane.pending:
                        with torch.cuda.stream(lane.caller):
                            lane.join()
                except RuntimeError:  # a capture already invalidated (its error propagates): a fresh lane next time
                    del st.lanes[key]
                lane.reset()


def _device_of(tensors: tuple[Any, ...]) -> torch.device | None:
    t = next((x for x in tensors if isinstance(x, torch.Tensor)), None)
    return t.device if t is not None and t.is_cuda else None


def lane_for(device: torch.device | None, name: str) -> Lane | None:
    """The lane ``name`` of ``device`` where lanes are active and the caller is not itself on a lane (else None:
    run in line)."""
    st = _state()
    if st.depth == 0 or device is None or device.type != "cuda" or torch.compiler.is_compiling():
        return None
    cur = torch.cuda.current_stream(device)
    for (dev, _), other in st.lanes.items():
        if dev == device and other.stream == cur:
            return None
    lane = st.lanes.get((device, name))
    if lane is None:
        lane = st.lanes[(device, name)] = Lane(device)
    return lane


def _tensors(x: Any, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out)
    return out


def aside(fn: Callable[[], Any], *reads: Any) -> Any:
    """``fn()`` on the branch lane where one is active (its result is ready on the caller's stream after
    :func:`settle`), else in line. ``reads``: the caller's tensors ``fn`` reads (the first CUDA one names the
    device)."""
    lane = lane_for(_device_of(reads), "branch")
    if lane is None:
        return fn()
    lane.fork()
    with torch.cuda.stream(lane.stream):
        out = fn()
    lane.caller_held.extend(_tensors(reads, []))
    lane.lane_held.extend(_tensors(out, []))
    return out


class Region:
    """What :func:`region` yields: :meth:`hold` a caller tensor the work reads, :meth:`give` a lane tensor the
    caller will read (after :func:`settle`)."""

    __slots__ = ("lane",)

    def __init__(self, lane: Lane | None) -> None:
        self.lane = lane

    @property
    def on_lane(self) -> bool:
        return self.lane is not None

    def hold(self, *tensors: Any) -> None:
        if self.lane is not None:
            self.lane.caller_held.extend(_tensors(tensors, []))

    def give(self, *tensors: Any) -> None:
        if self.lane is not None:
            self.lane.lane_held.extend(_tensors(tensors, []))


class _InLine:
    """What :func:`region` returns where the work runs in line: entered on every block call of an eager model, so
    one shared object, not a generator per call."""

    __slots__ = ()

    def __enter__(self) -> Region:
        return _NO_LANE

    def __exit__(self, *exc: object) -> None:
        return None


_NO_LANE = Region(None)
_IN_LINE = _InLine()


def region(device: torch.device, name: str, fork: bool = True, reads: tuple = (),
           on: bool = True) -> contextlib.AbstractContextManager[Region]:
    """Run the body on lane ``name`` of ``device`` where ``on`` and lanes are active (else in line): after the
    caller's work so far (``fork``), or after the lane's own work only (``fork=False``: the body reads nothing of
    the caller's stream that was not there, or held, when the lane last forked). ``reads`` are held
    (:meth:`Region.hold`)."""
    lane = lane_for(device, name) if on else None
    return _IN_LINE if lane is None else _on_lane(lane, fork, reads)


@contextlib.contextmanager
def _on_lane(lane: Lane, fork: bool, reads: tuple) -> Iterator[Region]:
    if fork or not lane.pending:
        lane.fork()
    r = Region(lane)
    r.hold(*reads)
    with torch.cuda.stream(lane.stream):
        yield r


def pending(device: torch.device, name: str) -> bool:
    lane = _state().lanes.get((device, name))
    return lane is not None and lane.pending


def settle(device: torch.device | None = None, name: str | None = None) -> None:
    """The caller's stream waits for the work so far of lane ``name`` (every lane where None) of ``device`` (of
    every device where None): call before reading what a lane made. Nothing to do where none is pending."""
    st = _state()
    if not st.lanes:
        return
    for (dev, n), lane in st.lanes.items():
        if (device is None or dev == device) and (name is None or n == name):
            lane.join()


def forks(name: str | None = None) -> int:
    """How many times this thread's lanes (named ``name``, or all) forked (tests: a lane was used)."""
    return sum(lane.forks for (_, n), lane in _state().lanes.items() if name is None or n == name)


__all__ = ["NAMES", "Lane", "Region", "active", "aside", "forks", "lane_for", "pending", "region", "settle"]
