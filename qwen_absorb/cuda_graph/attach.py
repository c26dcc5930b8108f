""":func:`install`: a :class:`~.runner.GraphedCall` as the transformer's ``forward`` (``remove()`` undoes it)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable

import torch
from torch import nn

from .. import hooks
from .fingerprint import under_model_offload
from .runner import GraphedCall
from .shared import Shared

log = logging.getLogger("qwen_absorb")


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
        inner = t.__dict__["_old_forward"]
        runner._inner, runner._prev_present = inner, True
        object.__setattr__(t, "_old_forward", runner)
    else:
        object.__setattr__(t, "forward", runner)
    log.log(logging.INFO if shared is None else logging.DEBUG, "CUDA-graph mode installed on %s (max %d graphs%s)",
            type(t).__name__, max_graphs, f", capture after {capture_after} eager calls" if capture_after else "")
    return runner
