"""Second CUDA streams beside the caller's ("lanes"), for work that need not wait in line behind a GEMM.

- ``"branch"``: kernels that read what a GEMM reads and are needed only after it (the next block's image modulation,
  beside the image FFN): :func:`aside` runs them there, :func:`settle` waits before the result is read.
- ``"txt"``: a block's text stream (128 rows, latency-bound) beside the image stream (:func:`region`).

Same kernels, same inputs: the same bits. Work inside a lane runs any other lane in line. Only while a CUDA graph is
captured (and its eager warm-up, :func:`active` entered by ``cuda_graph.capture``): in a graph a fork and a join are
free edges, eagerly each costs host time. Memory: the caching allocator reuses a freed block on its stream without
waiting for others, so a caller tensor a lane reads is held until the join, a lane tensor the caller reads until the
next fork after it."""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

NAMES = ("branch", "txt")  # which of them a patched model uses: its Tuning.lanes, asked by the callers


class Lane:
    """One lane of one device: its stream, whether the caller's stream must still wait for it, the tensors held."""

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
        """The forking stream waits for the lane; asked on another stream (another lane's region): nothing."""
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


class _State(threading.local):
    def __init__(self) -> None:
        self.lanes: dict[tuple[torch.device, str], Lane] = {}
        self.depth = 0


_local = _State()  # each thread gets its own on first use


@contextlib.contextmanager
def active() -> Iterator[None]:
    """Within: :func:`aside` and :func:`region` use the lanes of their inputs' device (this thread only). On exit
    every lane joins the caller's stream (a capture must end with its forks joined) and drops what it held."""
    _local.depth += 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            for key, lane in list(_local.lanes.items()):
                try:
                    if lane.pending:
                        with torch.cuda.stream(lane.caller):
                            lane.join()
                except RuntimeError:  # a capture already invalidated (its error propagates): a fresh lane next time
                    del _local.lanes[key]
                lane.reset()


def lane_for(device: torch.device | None, name: str) -> Lane | None:
    """The lane ``name`` of ``device`` where lanes are active and the caller is on no lane (else None: in line)."""
    st = _local
    if st.depth == 0 or device is None or device.type != "cuda" or torch.compiler.is_compiling():
        return None
    cur = torch.cuda.current_stream(device)
    if any(dev == device and other.stream == cur for (dev, _), other in st.lanes.items()):
        return None
    return st.lanes.get((device, name)) or st.lanes.setdefault((device, name), Lane(device))


def _tensors(x: Any, out: list) -> list:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple, dict)):
        for v in x.values() if isinstance(x, dict) else x:
            _tensors(v, out)
    return out


def aside(fn: Callable[[], Any], *reads: Any) -> Any:
    """``fn()`` on the branch lane where one is active (its result ready on the caller's stream after :func:`settle`),
    else in line. ``reads``: the caller's tensors ``fn`` reads (the first CUDA one names the device)."""
    t = next((x for x in reads if isinstance(x, torch.Tensor)), None)
    lane = lane_for(t.device if t is not None else None, "branch")
    if lane is None:
        return fn()
    lane.fork()
    with torch.cuda.stream(lane.stream):
        out = fn()
    lane.caller_held.extend(_tensors(reads, []))
    lane.lane_held.extend(_tensors(out, []))
    return out


class Region(NamedTuple):
    """What :func:`region` yields: hold a caller tensor the work reads, give a lane tensor the caller will read."""

    lane: Lane | None

    @property
    def on_lane(self) -> bool:
        return self.lane is not None

    def hold(self, *tensors: Any) -> None:
        if self.lane is not None:
            self.lane.caller_held.extend(_tensors(tensors, []))

    def give(self, *tensors: Any) -> None:
        if self.lane is not None:
            self.lane.lane_held.extend(_tensors(tensors, []))


# what region returns where the work runs in line: entered on every block call of an eager model, so one shared
# object, not a generator per call
_IN_LINE = contextlib.nullcontext(Region(None))


def region(device: torch.device, name: str, fork: bool = True, reads: tuple = (),
           on: bool = True) -> contextlib.AbstractContextManager[Region]:
    """Run the body on lane ``name`` of ``device`` where ``on`` and lanes are active (else in line): after the
    caller's work so far (``fork``), or after the lane's own work only (``fork=False``: the body reads nothing of
    the caller's stream that was not there, or held, when the lane last forked). ``reads`` are held."""
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


def settle(device: torch.device | None = None, name: str | None = None) -> None:
    """The caller's stream waits for the work so far of lane ``name`` (every lane where None) of ``device`` (of
    every device where None): call before reading what a lane made. Nothing to do where none is pending."""
    for (dev, n), lane in _local.lanes.items():
        if (device is None or dev == device) and (name is None or n == name):
            lane.join()


def forks(name: str | None = None) -> int:
    """How many times this thread's lanes (named ``name``, or all) forked (tests: a lane was used)."""
    return sum(lane.forks for (_, n), lane in _local.lanes.items() if name is None or n == name)
