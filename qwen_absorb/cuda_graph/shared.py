"""What a group of CUDA-graph runners shares: one graph memory pool and one side stream per device, one lock,
the static input buffers, and the stream the buffers were last used on.

The runners of one group (the per-block runners of a Qwen-Image-2.1 transformer, :mod:`.blocks`) are called one
after another on one stream, never inside each other, so their graphs can share what a graph needs only while
it runs:

- **the pool**: a graph's transients are free once its replay finished, and its output is cloned right after
  it. A handle is reused only while some runner of the group holds a graph (the allocator refuses a handle whose
  graphs are all gone): then it is forgotten and the next capture starts a new pool;
- **the static inputs**: one buffer per (argument position, tensor metadata, inference mode) for the whole
  group, held by the graphs reading it (the table holds it weakly); safe because copies and replays run in
  stream order, one graph at a time;
- **the lock**: one caller at a time; a second thread runs eager (counted);
- **the stream order**: a replay on another stream than the previous one waits for it first (:meth:`Shared.order`).

``parent`` (the transformer around the blocks): its O(1) refusals (:func:`.fingerprint.root_reason`) refuse the
group's calls too. ``fbc``: a group of FirstBlockCache (:mod:`.first_block_cache`), whose runners sit inside the
cache's hooks (neither the hooks nor the cache's config refuse them); ``outer``, the whole-model runner that made
such a group: inside accelerate's model-offload hook the parent is refused as that runner would be
(:func:`.fingerprint.model_offload_around`). Copies and pickles of a :class:`Shared` are fresh and empty (``fbc``
kept).
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

    __slots__ = ("lock", "pools", "streams", "logged", "_statics", "members", "_last", "_parent", "fbc", "_outer",
                 "__weakref__")

    def __init__(self, parent: nn.Module | None = None, fbc: bool = False, outer: Any = None) -> None:
        self.fbc = bool(fbc)
        self._outer = weakref.ref(outer) if outer is not None else None
        self.lock = threading.Lock()  # one caller at a time in the static buffers; others run eager
        self.pools: dict[torch.device, Any] = {}  # graph memory pool handles, by device
        self.streams: dict[torch.device, Any] = {}  # the side streams captures run on, by device
        self.logged: set[str] = set()  # what the group's runners logged once
        self._statics: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (position, meta) -> buffer
        self.members: weakref.WeakSet = weakref.WeakSet()  # the runners (they join and leave it themselves)
        self._last: dict[torch.device, Any] = {}  # the stream the buffers were last used on, by device
        self._parent = weakref.ref(parent) if parent is not None else None

    def parent_reason(self) -> tuple[str, str] | None:  # the parent's O(1) refusal (an offloading or cache hook)
        p = self._parent() if self._parent is not None else None
        if p is None:
            return None
        outer = self._outer() if self._outer is not None else None
        r = root_reason(p, cache_steps=False, runner=outer, fbc_outside=self.fbc)
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
        """The group's static buffers for a call's ``tensors`` (made where none is alive). Buffers made under
        inference mode are inference tensors, which no copy outside it may write: they are kept apart."""
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
        if not any(r._graphs for r in list(self.members)):
            self.pools.clear()

    def clear(self) -> None:
        """Drop everything shared (the group's runners are removed first: their graphs hold the buffers)."""
        for x in (self.pools, self.streams, self._statics, self._last):
            x.clear()
        self.members = weakref.WeakSet()

    def describe(self) -> dict[str, Any]:
        """JSON-able: pools, side streams, static input buffers alive and their bytes."""
        bufs = list(self._statics.values())
        storages = {s.untyped_storage().data_ptr(): s.untyped_storage().nbytes() for s in bufs}
        return {"pools": len(self.pools), "streams": len(self.streams), "static_inputs": len(bufs),
                "static_input_bytes": sum(storages.values())}

    def __deepcopy__(self, memo: dict) -> "Shared":
        p = self._parent() if self._parent is not None else None
        new = Shared(memo.get(id(p)) if p is not None else None, self.fbc)  # the parent's copy, if copied too
        memo[id(self)] = new
        return new

    def __getstate__(self) -> dict[str, Any]:
        return {"fresh": True, "fbc": self.fbc}  # nothing else travels

    def __setstate__(self, state: dict[str, Any]) -> None:
        Shared.__init__(self, fbc=state.get("fbc", False))

    def set_parent(self, parent: nn.Module | None) -> None:
        self._parent = weakref.ref(parent) if parent is not None else None

    def __repr__(self) -> str:
        d = self.describe()
        return (f"<qwen_absorb CUDA-graph Shared: {len(self.members)} runners, {d['pools']} pools, "
                f"{d['static_inputs']} static inputs>")
