"""A group of per-block CUDA-graph runners as one (:class:`BlockGraphs`), for :mod:`.blocks` and
:mod:`.first_block_cache`; it imports no runner (runner imports first_block_cache, which imports this module)."""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from .shared import Shared

log = logging.getLogger("qwen_absorb")

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
                parent: nn.Module | None, max_graphs: int, capture_after: int) -> BlockGraphs:
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
