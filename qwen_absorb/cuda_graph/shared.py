"""What a group of CUDA-graph runners shares: one graph memory pool and one side stream per device, one lock,
the static input buffers, and the stream the buffers were last used on.

The runners of one group (the per-block runners of a Qwen-Image-2.1 transformer, :mod:`.blocks`) are called one
after another on one stream, never inside each other: the transformers' block loop. Their graphs can then share
what a graph only needs while it runs:

- **the memory pool**: a graph's transients are free once its replay has finished, so the next graph may reuse
  them; its *output* stays allocated (held by the graph) and is cloned right after the replay, before anything
  else runs on the stream. So one pool serves every graph of the group, in any replay order. A pool handle is
  reused only while some runner of the group holds a graph (then the allocator's pool is alive); once a drop
  leaves the group without graphs the handle is forgotten, as a private runner forgets its own, and the next
  capture starts a new pool (reusing a handle whose graphs are all gone is refused by the allocator);
- **the static inputs**: the graph of each block reads its inputs from static buffers, and every replay first
  copies the call's tensors into them. One buffer serves each (argument position, tensor metadata) pair for the
  whole group: position ``i`` of the call's tensors with shape, strides, dtype, device and alignment class
  ``m``, made in inference mode or not (an inference tensor takes no copy outside it). Two tensors of one call
  have different positions, so they never share a buffer; graphs of different blocks (or signatures) do, which
  is safe because the copies and replays run in stream order, one graph at a time. The buffers are held by the
  graphs reading them (the table holds them weakly): memory is one set of inputs plus one output per graph, not
  one set of inputs per block;
- **the lock**: one caller at a time in the shared buffers. A second thread finds it taken and runs eager
  (counted: "another thread is using the CUDA-graph runner");
- **the stream order**: a replay or capture on another stream than the previous one first makes its stream wait
  for that one (:meth:`Shared.order`), so replays from two streams never overlap in the shared memory.

``parent`` (a module, e.g. the transformer around the blocks): its O(1) refusals (offloading hooks, diffusers
hooks, an enabled cache: :func:`.fingerprint.root_reason`) refuse the group's calls too, as they would refuse
a runner on the parent itself.

Copies and pickles of a :class:`Shared` are fresh and empty (graphs, pools, buffers are never copied or saved).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn

from .capture import static_like
from .fingerprint import root_reason
from .signature import tensor_meta


class Shared:
    """What the runners of one group share (see the module doc); pass it as ``shared=`` to :func:`.install`."""

    __slots__ = ("lock", "pools", "streams", "logged", "_statics", "_members", "_last", "_parent", "__weakref__")

    def __init__(self, parent: nn.Module | None = None) -> None:
        self.lock = threading.Lock()  # one caller at a time in the static buffers; others run eager
        self.pools: dict[torch.device, Any] = {}  # graph memory pool handles, by device
        self.streams: dict[torch.device, Any] = {}  # the side streams captures run on, by device
        self.logged: set[str] = set()  # what the group's runners logged once
        self._statics: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (position, meta) -> buffer
        self._members: weakref.WeakSet = weakref.WeakSet()
        self._last: dict[torch.device, Any] = {}  # the stream the buffers were last used on, by device
        self._parent = weakref.ref(parent) if parent is not None else None

    # ------------------------------------------------------------------ membership

    def join(self, runner: Any) -> None:
        self._members.add(runner)

    def leave(self, runner: Any) -> None:
        self._members.discard(runner)

    def graphs(self) -> int:
        """Graphs the group's runners hold now."""
        return sum(len(r._graphs) for r in list(self._members))

    # ------------------------------------------------------------------ per call

    def parent_reason(self) -> tuple[str, str] | None:
        """The parent's O(1) refusal (an offloading or cache hook on the transformer), or None."""
        p = self._parent() if self._parent is not None else None
        if p is None:
            return None
        r = root_reason(p, cache_steps=False)
        return (r[0], f"{r[1]} (on the {type(p).__name__} around the blocks)") if r is not None else None

    def order(self, device: torch.device) -> None:
        """Before a replay or capture on ``device``: the current stream waits for the stream the shared buffers
        and pool were last used on, when that is another one."""
        cur = torch.cuda.current_stream(device)
        last = self._last.get(device)
        if last is not None and not last == cur:  # Stream.__eq__ compares the CUDA streams
            cur.wait_stream(last)
        self._last[device] = cur

    def statics(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The static buffers for a call's ``tensors``: the group's buffer for each (position, metadata) pair,
        made (:func:`.capture.static_like`) where there is none alive. Buffers made under inference mode are
        inference tensors, which no copy outside it may write: they are kept apart."""
        out = []
        inference = torch.is_inference_mode_enabled()
        for i, x in enumerate(tensors):
            key = (i, tensor_meta(x), inference)
            s = self._statics.get(key)
            if s is None:
                s = static_like(x)
                self._statics[key] = s
            out.append(s)
        return out

    def forget_pools(self) -> None:
        """After a runner dropped its graphs: forget the pool handles when no runner of the group holds one."""
        if not self.graphs():
            self.pools.clear()

    # ------------------------------------------------------------------ lifetime

    def clear(self) -> None:
        """Drop everything shared (the group's runners are removed first: their graphs hold the buffers)."""
        self.pools.clear()
        self.streams.clear()
        self._statics.clear()
        self._last.clear()
        self._members = weakref.WeakSet()

    def describe(self) -> dict[str, Any]:
        """JSON-able: pools, side streams, static input buffers alive and their bytes."""
        bufs = list(self._statics.values())
        storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in bufs}
        return {"pools": len(self.pools), "streams": len(self.streams), "static_inputs": len(bufs),
                "static_input_bytes": sum(storages.values())}

    def __deepcopy__(self, memo: dict) -> "Shared":
        p = self._parent() if self._parent is not None else None
        new = Shared(memo.get(id(p)) if p is not None else None)  # the copy of the parent, if it is copied too
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {"fresh": True}  # nothing travels (never an empty state: pickle would skip __setstate__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        Shared.__init__(self)

    def set_parent(self, parent: nn.Module | None) -> None:
        self._parent = weakref.ref(parent) if parent is not None else None

    def __repr__(self) -> str:
        d = self.describe()
        return (f"<qwen_absorb CUDA-graph Shared: {len(self._members)} runners, {d['pools']} pools, "
                f"{d['static_inputs']} static inputs>")
