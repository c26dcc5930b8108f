"""What a group of CUDA-graph runners shares (:class:`Shared`): per device a graph memory pool and a side stream, one
lock, the static input buffers, and the stream the buffers were last used on; and the group as one
(:class:`BlockGraphs`), for :func:`.attach.install_blocks` and :mod:`.first_block_cache`. The runners of a group run one
after another on one stream, never inside each other, so their graphs share what a graph needs only while it runs: the
pool (outputs are cloned right after a replay; a handle is reused only while some runner holds a graph, as the allocator
refuses a handle whose graphs are all gone), one static input per (position, tensor metadata, inference mode), held
weakly, and the lock (a second thread runs eager, counted). ``parent``: its O(1) refusals refuse the group's calls too.
``fbc``: a FirstBlockCache group, made by the whole-model runner ``outer`` (the parent is judged under its model-offload
hook). Copies and pickles are fresh and empty (``fbc`` kept)."""

import collections
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .capture import static_like
from .fingerprint import root_reason
from .signature import tensor_meta

log = logging.getLogger("qwen_absorb")


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


MODE = "per block"
_SUMMED = ("graphs", "captures", "replays", "eager_calls", "new_signature_calls", "evictions", "failed_signatures",
           "discarded_replays")
_MERGED = ("refusals", "invalidations", "capture_failures")


class BlockGraphs:  # the per-block runners of one model and what they share; removed, only their last description
    __slots__ = ("runners", "indices", "shared", "max_graphs", "capture_after", "_parent", "_last", "__weakref__")

    def __init__(self, runners: list[Any], indices: list[int], shared: Shared, parent: nn.Module | None,
                 max_graphs: int, capture_after: int) -> None:
        self.runners, self.indices, self.shared = runners, indices, shared
        self.max_graphs, self.capture_after = max_graphs, capture_after
        self._parent = weakref.ref(parent) if parent is not None else None
        self._last: dict[str, Any] | None = None  # the description as of remove()

    @classmethod
    def install(cls, shared: Shared, blocks: Iterable[tuple[int, nn.Module]], put: Callable[[int, nn.Module], Any],
                parent: nn.Module | None, max_graphs: int, capture_after: int) -> "BlockGraphs":
        """The group of what ``put`` installs on ``blocks`` (None: left out); an exception undoes it all."""
        runners: list[Any] = []
        kept: list[int] = []
        try:
            for i, block in blocks:
                if (r := put(i, block)) is not None:
                    runners.append(r)
                    kept.append(i)
        except BaseException:
            for r in runners:
                r.remove()
            shared.clear()
            raise
        return cls(runners, kept, shared, parent, max_graphs, capture_after)

    @property
    def installed(self) -> bool:
        return self._last is None

    def invalidate(self, reason: str = "invalidate() called") -> None:
        for r in self.runners:
            r.invalidate(reason)

    def remove(self) -> None:  # every runner (each block's previous forward back in place), then what they shared
        if self._last is not None:
            return
        try:
            for r in self.runners:
                r.remove()
        finally:
            self._last = self.describe()
            self._last["installed"] = False
            self.shared.clear()
            self.runners, self._parent = [], None
        log.info("CUDA graphs per block removed from %d blocks", len(self.indices))

    def describe(self) -> dict[str, Any]:  # GraphedCall.describe()'s keys summed over the blocks, each block's counts
        if self._last is not None:
            return dict(self._last)
        ds = [r.describe() for r in self.runners]
        out: dict[str, Any] = {"mode": MODE, "installed": True, "blocks": len(ds), "max_graphs": self.max_graphs,
                               "capture_after": self.capture_after}
        out.update({k: sum(d[k] for d in ds) for k in _SUMMED})
        out.update({k: dict(sum((collections.Counter(d[k]) for d in ds), collections.Counter())) for k in _MERGED})
        out["signatures"] = list(dict.fromkeys(s for d in ds for s in d["signatures"]))
        out["unstable"] = any(d["unstable"] for d in ds)
        out["unstable_blocks"] = [i for i, d in zip(self.indices, ds) if d["unstable"]]
        out["capture_ms"] = [round(sum(d["capture_ms"]), 1) for d in ds]  # per block, its graphs together
        n = out["replays"]
        for k in ("host_us_per_replay", "overlapped_check_us_per_replay", "launch_us_per_replay"):
            out[k] = round(sum((d[k] or 0.0) * d["replays"] for d in ds) / n, 1) if n else None
        out["outputs"] = "clone"
        out["shared"] = self.shared.describe()
        out["per_block"] = [{"block": i, "graphs": d["graphs"], "captures": d["captures"], "replays": d["replays"],
                             "eager_calls": d["eager_calls"]} for i, d in zip(self.indices, ds)]
        return out

    def __repr__(self) -> str:
        d = self.describe()
        return (f"<qwen_absorb BlockGraphs on {d['blocks']} blocks: {d['graphs']} graphs, {d['captures']} captures, "
                f"{d['replays']} replays{'' if d['installed'] else ', removed'}>")

    # the parent is held strongly in the state, so that a copy's parent is the copied model
    def __getstate__(self) -> dict[str, Any]:
        return {"runners": self.runners, "indices": self.indices, "shared": self.shared, "max_graphs": self.max_graphs,
                "capture_after": self.capture_after, "last": self._last,
                "parent": self._parent() if self._parent is not None else None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        parent = state["parent"]
        BlockGraphs.__init__(self, state["runners"], state["indices"], state["shared"], parent, state["max_graphs"],
                             state["capture_after"])
        self._last = state["last"]
        self.shared.set_parent(parent)
