"""CUDA graphs of one function per input key (static inputs copied in, outputs cloned out), for the pipeline rooms.

The owner keys the calls (whatever a replay could not survive), drops the graphs when what they read changes
(:meth:`ShapeGraphs.clear`), and runs eager where a call answers None. The transformer has its own runner
(:mod:`qwen_absorb.cuda_graph`), which also checks hooks, RoPE caches and host constants."""

import contextlib
import logging
import threading
from collections import Counter, OrderedDict, namedtuple
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

log = logging.getLogger("qwen_absorb")


def map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:  # containers keep their types
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) is tuple or type(x) is list:
        return type(x)(map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        items = {k: map_tensors(v, fn) for k, v in x.items()}
        try:
            return type(x)(**items)  # diffusers BaseOutput (a dataclass + OrderedDict)
        except TypeError:
            return type(x)(items)
    return x


@contextlib.contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture into ``graph`` on ``stream``: ``torch.cuda.graph`` without its emptying of torch's device and pinned
    host caches before every capture (each cached block given back to the driver, ``cudaFree`` waiting for the device,
    and allocated again by the calls after it). Only near the memory limit could the emptied caches have made the room
    the capture needs (from ``pool``); there it fails and its signature runs eager, counted. ``capture_end`` runs
    either way, as in ``torch.cuda.graph``."""
    torch.cuda.synchronize(stream.device)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool, capture_error_mode="thread_local")
        try:
            yield
        finally:
            graph.capture_end()


_Graph = namedtuple("_Graph", "graph statics out aid")  # aid: what the graph reads, kept with it


class ShapeGraphs:
    """``fn(*tensors)`` captured per key at its ``capture_after + 1``-th call, at most ``limit`` graphs (LRU), one pool
    (calls serialized by a lock, outputs cloned before it is released). ``aid``: made per capture; its ``warmup()``
    and ``capture()`` contexts surround the two runs (host decisions replayed under capture), kept with the graph."""

    def __init__(self, fn: Callable[..., Any], capture_after: int = 1, limit: int = 4,
                 aid: Callable[[], Any] | None = None) -> None:
        self.fn, self.capture_after, self.limit, self.aid = fn, int(capture_after), int(limit), aid
        self.graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self.seen, self.refused, self.counts = Counter(), {}, Counter()  # refused: key -> why; captures, replays
        self.lock, self.pool = threading.Lock(), None

    def clear(self) -> None:  # drop every graph (what they read moved or changed); the next calls count again
        with self.lock:
            for d in (self.graphs, self.seen, self.refused):
                d.clear()
            self.pool = None

    def describe(self) -> dict[str, Any]:
        return {"graphs": len(self.graphs), "captures": self.counts["captures"], "replays": self.counts["replays"],
                "refused": dict((str(k), v) for k, v in self.refused.items())}

    def __call__(self, key: Hashable, args: tuple[torch.Tensor, ...]) -> Any:
        """The outputs of ``fn(*args)`` from a replay (cloned), or None: the caller runs eager."""
        with self.lock:
            if (g := self.graphs.get(key)) is None:
                if key in self.refused:
                    return None
                self.seen[key] += 1
                if self.seen[key] <= self.capture_after or (g := self._capture(key, args)) is None:
                    return None
            else:
                self.graphs.move_to_end(key)
                for s, a in zip(g.statics, args):
                    s.copy_(a)
            g.graph.replay()
            self.counts["replays"] += 1
            return map_tensors(g.out, torch.clone)

    def _capture(self, key: Hashable, args: tuple[torch.Tensor, ...]) -> _Graph | None:
        # static inputs with the inputs' shapes, strides and dtypes: the graph reads these strides
        statics = [torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype, device=a.device).copy_(a)
                   for a in args]
        side = torch.cuda.Stream(device=args[0].device)
        side.wait_stream(torch.cuda.current_stream(args[0].device))
        aid = self.aid() if self.aid is not None else None
        try:
            with torch.cuda.stream(side), (aid.warmup() if aid is not None else contextlib.nullcontext()):
                self.fn(*statics)  # warm-up outside the graph: lazy inits, library handles, workspaces
            torch.cuda.current_stream(args[0].device).wait_stream(side)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with recording(graph, self.pool, side), (aid.capture() if aid is not None else contextlib.nullcontext()):
                out = self.fn(*statics)
        except Exception as e:  # noqa: BLE001  (a capture that fails leaves the call to the eager path)
            self.refused[key] = f"capture failed: {type(e).__name__}: {e}"[:300]
            log.warning("CUDA graph of %s not kept: %s", key, self.refused[key])
            return None
        g = self.graphs[key] = _Graph(graph, statics, out, aid)
        self.counts["captures"] += 1
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)
        return g
