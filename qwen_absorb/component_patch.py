"""What the VAE and prompt-encoding patches share: a report section, and a callable in an instance slot of a
pipeline component (graphs per shape) that puts back, when removed, the instance attribute it found there."""

import logging
from dataclasses import dataclass, field
from typing import Any

from .report import PartReport
from .shape_graphs import ShapeGraphs

log = logging.getLogger("qwen_absorb")


@dataclass
class ComponentReport(PartReport):
    on: bool
    reasons: list[str]
    contract: str = ""
    cuda_graph: str | bool = "auto"
    graphs: dict[str, Any] = field(default_factory=dict)

    def graph_counts(self) -> str:
        g = self.graphs
        return f"CUDA graphs {g.get('graphs', 0)} kept, {g.get('replays', 0)} replays" if g else ""


class Slot:
    """Kept in ``owner.__dict__[ATTR]`` by :func:`install`; subclasses define ``_run``, ``renew`` and what a copy
    goes without (``_uncopied``: made again there; the graphs always)."""

    ATTR, REPORT = "", ComponentReport
    _aid: Any = None  # ShapeGraphs' aid

    def __init__(self, report: ComponentReport, had_instance: Any) -> None:
        self.report, self.mode, self.had_instance = report, report.cuda_graph, had_instance
        self.graphs = self._new_graphs()

    def _new_graphs(self) -> ShapeGraphs:
        return ShapeGraphs(self._run, capture_after=0 if self.mode is True else 1, aid=self._aid)

    def _uncopied(self) -> dict[str, Any]:
        return {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **self._uncopied(), "graphs": None}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.graphs = self._new_graphs()


def current(owner: Any, cls: type) -> Any:
    cur = getattr(owner, "__dict__", {}).get(cls.ATTR)
    return cur if isinstance(cur, cls) else None


def install(owner: Any, cls: type[Slot], reasons_of: Any, what: str, cuda_graph: str | bool, **settings: Any) -> Any:
    """``cls`` in ``owner``'s slot, and its report (``on`` False with reasons, nothing installed, where
    ``reasons_of(owner)`` gives some). The same settings again renew the installed one; others replace it."""
    if (cur := current(owner, cls)) is not None:
        if cur.mode == cuda_graph and all(getattr(cur.report, k) == v for k, v in settings.items()):
            cur.renew()  # patch() again catches up with writes no watch sees (a user's in-place .data write)
            return cur.report
        remove(owner, cls)
    reasons = reasons_of(owner)
    report = cls.REPORT(on=not reasons, reasons=reasons, cuda_graph=cuda_graph, **settings)
    if reasons:
        log.info("%s left to diffusers: %s", what, "; ".join(reasons))
    else:
        owner.__dict__[cls.ATTR] = cls(owner, report, owner.__dict__.get(cls.ATTR))
    return report


def remove(owner: Any, cls: type) -> Any:
    """Undo :func:`install` (also a :class:`vae.FastPostprocess`'s); the object removed, or None."""
    if (cur := current(owner, cls)) is not None:
        del owner.__dict__[cls.ATTR]
        if cur.had_instance is not None:
            owner.__dict__[cls.ATTR] = cur.had_instance
        if isinstance(cur, Slot):  # unpatched: graphs and kept state released, and the report says so
            cur.__dict__.update(cur._uncopied())
            cur.graphs.clear()
            cur.report.on, cur.report.reasons = False, ["unpatched"]
    return cur
