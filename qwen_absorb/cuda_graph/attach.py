"""Where a :class:`~.runner.GraphedCall` goes: :func:`install` as the transformer's ``forward`` (``remove()`` undoes
it); :func:`install_blocks` on each block (Qwen-Image-2.1: diffusers' ``QwenImage21Transformer2DModel.forward`` syncs
with the host before its block loop, ``tolist()`` on the token masks, so only its blocks can be captured);
:class:`FirstUse`: graphs decided at the first call on a GPU, not where the model sat when patched (a model patched
on the CPU is usually moved next)."""

import collections
import inspect
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .. import hooks
from . import settings
from .fingerprint import under_model_offload
from .runner import GraphedCall, bound_inner
from .shared import BlockGraphs, Shared

log = logging.getLogger("qwen_absorb")
_DECIDING = threading.Lock()  # two threads' first calls on a GPU: one installs the runner, both use it


def install(transformer: nn.Module, *, fallbacks: collections.Counter, max_graphs: int = 8,
            host_tensors: Callable[[], Iterable[torch.Tensor]] | None = None, capture_after: int = 0,
            shared: Shared | None = None, warn_first: bool = False) -> GraphedCall:
    """Put CUDA-graph mode on ``transformer`` (or a pipeline's) and return its :class:`GraphedCall` (the installed one
    if any). fallbacks: refused calls counted by reason. max_graphs: least recently used dropped first. host_tensors:
    a callable returning the tensors allowed off the GPU (fingerprinted, left out of the device check; the forward
    must not read them). capture_after: eager calls a signature has before its capture. warn_first: a refusal of the
    first call is a warning. Under accelerate's ``CpuOffload`` the runner goes in ``_old_forward`` (the model is on
    its device when it looks)."""
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if not isinstance(fallbacks, collections.Counter):
        raise TypeError(f"fallbacks must be a collections.Counter, got {type(fallbacks).__name__}")
    if host_tensors is not None and not callable(host_tensors):
        raise TypeError(f"host_tensors must be a callable returning tensors, got {type(host_tensors).__name__}")
    if type(capture_after) is not int or capture_after < 0:
        raise ValueError(f"capture_after must be an int >= 0, got {capture_after!r}")
    if shared is not None and not isinstance(shared, Shared):
        raise TypeError(f"shared must be a qwen_absorb.cuda_graph.Shared, got {type(shared).__name__}")
    t = hooks.resolve_transformer(transformer, (nn.Module,))
    for current in (t.__dict__.get("forward"), t.__dict__.get("_old_forward")):
        if isinstance(current, GraphedCall) and not current._removed:
            log.debug("CUDA-graph mode already installed on %s", type(t).__name__)
            return current
    runner = GraphedCall(t, fallbacks, max_graphs, host_tensors, capture_after, shared)
    runner.warn_first = bool(warn_first)
    if shared is None and under_model_offload(t):
        runner._inner, runner._prev_present = t.__dict__["_old_forward"], True
        object.__setattr__(t, "_old_forward", runner)
    else:
        object.__setattr__(t, "forward", runner)
    log.log(logging.INFO if shared is None else logging.DEBUG, "CUDA-graph mode installed on %s (max %d graphs%s)",
            type(t).__name__, max_graphs, f", capture after {capture_after} eager calls" if capture_after else "")
    return runner


def install_blocks(blocks: Sequence[nn.Module], *, fallbacks: collections.Counter, parent: nn.Module | None = None,
                   max_graphs: int = 8, capture_after: int = 0,
                   indices: Sequence[int] | None = None) -> BlockGraphs:
    """A :class:`GraphedCall` on each of ``blocks``, sharing one :class:`Shared`, as a group (refusals counted per
    block call). ``parent``: the module around the blocks, whose hooks refuse the blocks' calls too; ``indices``: the
    blocks' indices in the model. A block that already carries a runner of its own keeps it and is left out."""
    idx = list(indices) if indices is not None else list(range(len(blocks)))
    if len(idx) != len(blocks):
        raise ValueError(f"indices: {len(idx)} for {len(blocks)} blocks")
    shared = Shared(parent)

    def put(i: int, block: nn.Module) -> GraphedCall | None:
        r = install(block, fallbacks=fallbacks, max_graphs=max_graphs, capture_after=capture_after, shared=shared)
        if r._shared is shared:
            return r
        log.warning("block %d already carries a CUDA-graph runner of its own; it is left as it is", i)
        return None

    group = BlockGraphs.install(shared, zip(idx, blocks), put, parent, max_graphs, capture_after)
    log.info("CUDA graphs per block installed on %d blocks (max %d graphs each%s)", len(group.runners), max_graphs,
             f", capture after {capture_after} eager calls" if capture_after else "")
    return group


def _device_of(args: tuple, kwargs: dict) -> torch.device | None:
    """The device of the call's image input (``hidden_states``), else of its first tensor argument."""
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(x, torch.Tensor):
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return x.device if x is not None else None


class FirstUse:  # passes calls off a graph device through, uncounted; the first on one installs the runner
    __qwen_absorb_graph__ = False  # not a per-block runner: qwen_absorb.patch's _strip leaves it
    __slots__ = ("__weakref__", "_transformer", "_inner", "_prev_present", "_slot", "_options", "runner", "_removed")

    def __init__(self, transformer: nn.Module, *, fallbacks: collections.Counter, max_graphs: int = 8,
                 host_tensors: Callable[[], Iterable[torch.Tensor]] | None = None, capture_after: int = 0) -> None:
        t = self._transformer = hooks.resolve_transformer(transformer, (nn.Module,))
        self._options = dict(fallbacks=fallbacks, max_graphs=max_graphs, host_tensors=host_tensors,
                             capture_after=capture_after)
        self.runner: GraphedCall | None = None
        self._removed = False
        self._slot = "_old_forward" if under_model_offload(t) else "forward"
        self._prev_present, self._inner = self._slot in t.__dict__, getattr(t, self._slot)  # (else the class forward)
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
        if not hooks.put_back(t, self, self._inner, self._prev_present and self._slot == "forward"):
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
