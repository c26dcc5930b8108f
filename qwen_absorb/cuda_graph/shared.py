"""What a group of CUDA-graph runners shares: per device a graph memory pool and a side stream, one lock, the static
input buffers, and the stream the buffers were last used on.

The runners of a group run one after another on one stream, never inside each other, so their graphs share what a
graph needs only while it runs: the pool (outputs are cloned right after a replay; a handle is reused only while some
runner holds a graph, as the allocator refuses a handle whose graphs are all gone), one static input per (position,
tensor metadata, inference mode), held weakly, and the lock (a second thread runs eager, counted). ``parent``: its
O(1) refusals refuse the group's calls too. ``fbc``: a FirstBlockCache group, made by the whole-model runner ``outer``
(the parent is judged under its model-offload hook). Copies and pickles are fresh and empty (``fbc`` kept).
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


class Shared:  # pass it as ``shared=`` to :func:`.install`
    __slots__ = ("lock", "pools", "streams", "logged", "_statics", "members", "_last", "_parent", "fbc", "_outer",
                 "__weakref__")

    def __init__(self, parent: nn.Module | None = None, fbc: bool = False, outer: Any = None) -> None:
        self.fbc = bool(fbc)
        self._outer = weakref.ref(outer) if outer is not None else None
        self.lock = threading.Lock()
        self.pools: dict[torch.device, Any] = {}  # graph memory pool handles
        self.streams: dict[torch.device, Any] = {}  # the side streams captures run on
        self.logged: set[str] = set()  # what the group's runners logged once
        self._statics: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (position, meta) -> buffer
        self.members: weakref.WeakSet = weakref.WeakSet()  # the runners (they join and leave it themselves)
        self._last: dict[torch.device, Any] = {}  # the stream the buffers were last used on
        self.set_parent(parent)

    def parent_reason(self) -> tuple[str, str] | None:  # the parent's O(1) refusal (an offloading or cache hook)
        p = self._parent() if self._parent is not None else None
        if p is None:
            return None
        outer = self._outer() if self._outer is not None else None
        r = root_reason(p, cache_steps=False, runner=outer, fbc_outside=self.fbc)
        return (r[0], f"{r[1]} (on the {type(p).__name__} around the blocks)") if r is not None else None

    def order(self, device: torch.device) -> None:  # before a replay or capture
        """The current stream waits for the one the shared buffers were last used on."""
        cur = torch.cuda.current_stream(device)
        last = self._last.get(device)
        if last is not None and not last == cur:  # Stream.__eq__ compares the CUDA streams
            cur.wait_stream(last)
        self._last[device] = cur

    def statics(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The group's static buffers for a call's ``tensors`` (made where none is alive); inference-mode buffers
        are kept apart (no copy outside inference mode may write them)."""
        out, inference = [], torch.is_inference_mode_enabled()
        for i, x in enumerate(tensors):
            s = self._statics.get(key := (i, tensor_meta(x), inference))
            out.append(s if s is not None else self._statics.setdefault(key, static_like(x)))
        return out

    def forget_pools(self) -> None:
        """After a runner dropped its graphs: forget the pool handles when no runner of the group holds a graph."""
        if not any(r._graphs for r in list(self.members)):
            self.pools.clear()

    def clear(self) -> None:
        """Drop everything shared (the group's runners are removed first: their graphs hold the buffers)."""
        for x in (self.pools, self.streams, self._statics, self._last):
            x.clear()
        self.members = weakref.WeakSet()

    def describe(self) -> dict[str, Any]:
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
