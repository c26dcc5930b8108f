"""Graphs decided at the transformer's first call on a GPU, not where it sat when it was patched (a model patched on
the CPU is usually moved next). :class:`FirstUse` sits where the runner would, passes calls on other devices through,
uncounted, and at the first call on a graph device installs the :class:`~.runner.GraphedCall`, which answers it and
then ``describe()``, ``invalidate()`` and ``remove()`` (a refusal of that call is logged once as a warning).
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import hooks
from . import settings
from .attach import install
from .fingerprint import under_model_offload
from .runner import GraphedCall, bound_inner, put_back

log = logging.getLogger("qwen_absorb")
_DECIDING = threading.Lock()  # two threads' first calls on a GPU: one installs the runner, both use it


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the call's image input (``hidden_states``), else of its first tensor argument."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(x, torch.Tensor):
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return x.device if x is not None else None


class FirstUse:
    __qwen_absorb_graph__ = False  # not a per-block runner: qwen_absorb.patch's _strip leaves it
    __slots__ = ("__weakref__", "_transformer", "_inner", "_prev_present", "_slot", "_options", "runner",
                 "_removed")

    def __init__(self, transformer: nn.Module, *, fallbacks: collections.Counter, max_graphs: int = 8,
                 host_tensors: Callable[[], Iterable[torch.Tensor]] | None = None, capture_after: int = 0) -> None:
        t = self._transformer = hooks.resolve_transformer(transformer, (nn.Module,))
        self._options = dict(fallbacks=fallbacks, max_graphs=max_graphs, host_tensors=host_tensors,
                             capture_after=capture_after)
        self.runner: GraphedCall | None = None
        self._removed = False
        d = t.__dict__
        self._slot = "_old_forward" if under_model_offload(t) else "forward"
        self._prev_present = self._slot in d
        self._inner = d[self._slot] if self._prev_present else type(t).forward.__get__(t)
        object.__setattr__(t, self._slot, self)
        log.info("CUDA graphs for %s: decided at its first call on a GPU", type(t).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        r = self.runner
        if r is not None:  # something wrapped us before we were replaced: the runner answers
            return r(*args, **kwargs)
        dev = None if self._removed else _device_of(args, kwargs)
        if dev is None or dev.type not in settings.GRAPH_DEVICE_TYPES or torch.compiler.is_compiling():
            return self._inner(*args, **kwargs)  # removed, or not on a graph device
        with _DECIDING:
            if self.runner is None:
                self._take_out()
                self.runner = install(self._transformer, **self._options, warn_first=True)
                log.info("CUDA graphs for %s decided at its first call on %s", type(self._transformer).__name__, dev)
        return self.runner(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The wrapped forward's (ModelOpt's export passes only the arguments ``model.forward`` names)."""
        try:
            return inspect.signature(self.runner if self.runner is not None else self._inner)
        except (TypeError, ValueError, RuntimeError):
            return inspect.Signature()

    def _take_out(self) -> None:  # the wrapped forward back in the slot holding this object (wherever that is now)
        t = self._transformer
        if not put_back(t, self, self._inner, self._prev_present and self._slot == "forward"):
            log.warning("the CUDA-graph decision of %s was not found in its forward chain; it stays as a "
                        "pass-through", type(t).__name__)

    def remove(self) -> None:
        if self.runner is not None:
            self.runner.remove()
        elif not self._removed:
            self._take_out()
        self._removed = True

    def invalidate(self, reason: str = "invalidate() called") -> None:
        if self.runner is not None:
            self.runner.invalidate(reason)

    def describe(self) -> dict[str, Any]:
        if self.runner is not None:
            return self.runner.describe()
        return {"installed": not self._removed, "decided": False,
                "mode": "decided at the first call on a GPU (none yet)", "graphs": 0, "captures": 0,
                "replays": 0, "eager_calls": 0}

    def __getstate__(self) -> dict[str, Any]:
        t = self._transformer
        opts = dict(self._options, host_tensors=None)  # a closure over this model: neither copied nor saved
        return {"t": t, "inner": bound_inner(t, self._inner), "prev_present": self._prev_present,
                "slot": self._slot, "options": opts, "runner": self.runner, "removed": self._removed}

    def __setstate__(self, st: dict[str, Any]) -> None:
        t = st["t"]
        self._transformer, self._slot, self._prev_present = t, st["slot"], st["prev_present"]
        self._inner = st["inner"] if st["inner"] is not None else type(t).forward.__get__(t)
        self._options, self.runner, self._removed = st["options"], st["runner"], st["removed"]

    def __repr__(self) -> str:
        state = "decided" if self.runner is not None else "waiting for a call on a GPU"
        return f"<qwen_absorb CUDA graphs of {type(self._transformer).__name__}: {state}>"
