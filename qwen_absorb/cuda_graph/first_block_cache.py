"""diffusers' FirstBlockCache under CUDA graphs per block.

FirstBlockCache (``enable_cache(FirstBlockCacheConfig(...))``) hooks every block. The head hook runs block 0, compares
its residual with the one of the last computed step (``.item()``: a device read) and decides whether the other blocks
run; when they do not, their hooks hand their inputs back and the head adds the residuals cached by the tail. No graph
of the whole call can take that branch, but every block can be graphed on its own. While the transformer's
``_cache_config`` is a FirstBlockCache, the whole-model runner (:class:`~.runner.GraphedCall`) runs the model call
eager and keeps one runner on each patched block (:func:`follow`), a :class:`~.group.BlockGraphs` sharing one
:class:`~.shared.Shared` with ``fbc=True``. Each block runner takes the place of the patched forward, which diffusers'
hook holds as its ``fn_ref.original_forward``: the hooks stay diffusers' and run on the host as they do eager (the
head's decision included), and each block they compute replays its own graph. A call is the eager prologue and
epilogue, the hooks, and the replays of the blocks computed; its outputs are the patched eager call's, bit for bit.

- The cross-block hand-off (:mod:`qwen_absorb.handoff`) never crosses a hooked block: a block with a hook neither hands
  its outputs over nor is handed any (``handoff.target``), so no block graph holds one. A runner of the group refuses a
  block that carries no FirstBlockCache hook (:func:`.fingerprint.fbc_block_reason`).
- Decided at each model call: a cache enabled before ``patch`` or after it is seen by the first call on a graph device,
  which makes the group; a cache disabled (or replaced by another) removes the group at the next model call, each
  patched forward back in the slot its runner held, and the whole-model graphs capture again (or that call runs eager
  for its own reason).
- Counted: each model call under the group in the runner's fallbacks, with the reason ``step_caches.refusal(config)``
  ("FirstBlockCache: per-block CUDA graphs ..."); the block runners' refusals in the same counter (block calls); the
  group's description under ``"first_block_cache"`` in the whole-model runner's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .. import hooks, host_originals, step_caches
from ..block import PatchedForward
from . import settings
from .group import BlockGraphs, install_each
from .shared import Shared

log = logging.getLogger("qwen_absorb")

NO_GROUP = "FirstBlockCache: eager (no per-block CUDA graphs)"


class Follow:
    """What the FirstBlockCache glue keeps for one whole-model runner (its ``_fbc``, made by the first call that
    meets the cache; a copied runner starts without): its group (kept after removal, for its last description) and
    why none could be made."""

    __slots__ = ("group", "why")

    def __init__(self) -> None:
        self.group: BlockGraphs | None = None
        self.why: str | None = None


class _BlockHost:
    """A block's runner's ``host_tensors``: the weights the patch keeps on the host for that block only
    (:func:`qwen_absorb.host_originals.host_weights` reads ``transformer_blocks``: this object holds that one block)."""

    __slots__ = ("transformer_blocks",)

    def __init__(self, block: nn.Module) -> None:
        self.transformer_blocks = (block,)

    def __call__(self) -> list[torch.Tensor]:
        return host_originals.host_weights(self)


def follow(runner: Any, root: tuple[str, str] | None) -> tuple[str, str] | None:
    """For a whole-model ``runner`` about to answer a call that ``root`` refuses (or not): make or remove its
    FirstBlockCache group to match the transformer's cache now, and return the call's refusal. Block runners
    (``runner._shared`` set) and calls with neither a refusal nor a group return at once."""
    if runner._shared is not None:
        return root
    f = runner._fbc
    if root is None and f is None:
        return None
    cfg = getattr(runner._transformer, "_cache_config", None)
    if not step_caches.is_fbc_config(cfg):
        if f is not None and f.group is not None and f.group.installed:
            _remove(f, "the transformer's cache is no longer FirstBlockCache")
        return root
    eager = step_caches.refusal(cfg)
    if root is None or eager is None or root[0] != eager[0]:
        return root  # refused before the cache's turn (an offloading hook): a group's runners refuse it too
    if f is None:
        f = runner._fbc = Follow()
    if f.group is None or not f.group.installed:
        f.why = _make(runner, f)
        if f.why is not None:
            return NO_GROUP, f.why
    runner.warn_first = False  # graphs do run, per block: no warning that this model cannot use them
    return root


def _patched_slot(block: nn.Module) -> tuple[Any, PatchedForward] | None:
    """(the setter of the slot holding ``block``'s patched forward, that forward), or None (not patched here). A
    runner found wrapping the patched forward (the group of a copied model, or of a runner removed meanwhile) is
    removed first: its forward back in that slot."""
    for _, get, set_ in hooks.forward_slots(block):
        fn = get()
        if getattr(type(fn), "__qwen_absorb_graph__", False) is True and isinstance(fn._inner, PatchedForward):
            fn.remove()
            fn = get()
        if isinstance(fn, PatchedForward):
            return set_, fn
    return None


def _make(runner: Any, f: Follow) -> str | None:
    """Put a runner on every patched block of ``runner``'s transformer, in its patched forward's slot; None when
    made, else why not."""
    t = runner._transformer
    types = settings.GRAPH_DEVICE_TYPES
    if not any(p.device.type in types for p in t.parameters()):
        return "the model is not on a GPU"
    shared = Shared(t, fbc=True, outer=runner)

    def put(i: int, block: nn.Module) -> Any:
        found = _patched_slot(block)
        if found is None:
            return None  # runs diffusers' forward (see its report entry): eager inside the hooks
        set_, fwd = found
        # the whole-model runner's class: importing it here would close an import cycle (it imports this module)
        r = type(runner)(block, runner.fallbacks, runner.max_graphs, _BlockHost(block), runner.capture_after, shared)
        r._inner = r._prev = fwd  # what it wraps and puts back: the patched forward, in the slot found
        r._prev_present = True
        set_(r)
        return r

    runners, kept = install_each(shared, enumerate(getattr(t, "transformer_blocks", None) or ()), put)
    if not runners:
        shared.clear()
        return "no block runs the patched forward"
    f.group = BlockGraphs(runners, kept, shared, t, runner.max_graphs, runner.capture_after)
    log.info("FirstBlockCache on %s: CUDA graphs per block on %d blocks (its hooks decide on the host between "
             "them)", type(t).__name__, len(runners))
    return None


def _remove(f: Follow, why: str) -> None:
    f.group.remove()
    log.info("FirstBlockCache per-block CUDA graphs removed: %s", why)


def remove(runner: Any) -> None:
    """The whole-model ``runner`` is being removed: its group with it."""
    f, runner._fbc = runner._fbc, None
    if f is not None and f.group is not None and f.group.installed:
        _remove(f, "the CUDA-graph runner was removed")


def invalidate(runner: Any, reason: str) -> None:
    f = runner._fbc
    if f is not None and f.group is not None and f.group.installed:
        f.group.invalidate(reason)


def describe(runner: Any) -> dict[str, Any]:
    """``{"first_block_cache": ...}`` for the whole-model runner's description once FirstBlockCache was seen: its
    group's (``mode`` "per block", block calls summed, ``installed``), or why none could be made; else ``{}``."""
    f = runner._fbc
    if f is None:
        return {}
    d = f.group.describe() if f.group is not None else {"mode": "per block", "installed": False}
    if f.why is not None and not d["installed"]:
        d["not_made"] = f.why
    return {"first_block_cache": d}
