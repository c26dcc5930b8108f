"""diffusers' FirstBlockCache under CUDA graphs per block: its head hook decides on the host (``.item()``) whether
the blocks after block 0 run, which no graph of the whole call can take. The whole-model runner runs the call eager
(counted) and keeps a :class:`~.shared.BlockGraphs` (:func:`follow`) whose runners are the hooks' ``original_forward``:
the hooks run on the host, each computed block replays its graph. A cache disabled or replaced removes the group."""

import functools
import logging
from types import SimpleNamespace
from typing import Any

from torch import nn

from .. import hooks, host_originals, step_caches
from ..block import PatchedForward
from . import settings
from .shared import BlockGraphs, Shared

log = logging.getLogger("qwen_absorb")

NO_GROUP = "FirstBlockCache: eager (no per-block CUDA graphs)"


def follow(runner: Any, root: tuple[str, str] | None) -> tuple[str, str] | None:
    """Make or remove the FirstBlockCache group of a whole-model ``runner`` to match the transformer's cache now,
    and return the call's refusal (``root``, or why no group could be made). ``runner._fbc``, once the cache was
    met: its group (kept after removal, for its description) and why none was made."""
    f = runner._fbc
    if runner._shared is not None or (root is None and f is None):
        return root
    cfg = getattr(runner._transformer, "_cache_config", None)
    if not step_caches.is_fbc_config(cfg):
        _remove(f, "the transformer's cache is no longer FirstBlockCache")
        return root
    eager = step_caches.refusal(cfg)
    if root is None or eager is None or root[0] != eager[0]:
        return root  # refused before the cache's turn (an offloading hook): a group's runners refuse it too
    if f is None:
        f = runner._fbc = SimpleNamespace(group=None, why=None)
    if _installed(f) is None:
        f.why = _make(runner, f)
        if f.why is not None:
            return NO_GROUP, f.why
    runner.warn_first = False  # graphs do run, per block: no warning that this model cannot use them
    return root


def _patched_slot(block: nn.Module) -> tuple[Any, PatchedForward] | None:
    """(setter of the slot holding ``block``'s patched forward, that forward), or None. A runner found wrapping it
    (of a copied model's group, or a removed runner's) is removed first."""
    for _, get, set_ in hooks.forward_slots(block):
        fn = get()
        if getattr(type(fn), "__qwen_absorb_graph__", False) is True and isinstance(fn._inner, PatchedForward):
            fn.remove()
            fn = get()
        if isinstance(fn, PatchedForward):
            return set_, fn
    return None


def _make(runner: Any, f: Any) -> str | None:
    """Put a runner in the patched forward's slot of every patched block; None when made, else why not."""
    t = runner._transformer
    if not any(p.device.type in settings.GRAPH_DEVICE_TYPES for p in t.parameters()):
        return "the model is not on a GPU"
    shared = Shared(t, fbc=True, outer=runner)

    def put(i: int, block: nn.Module) -> Any:
        found = _patched_slot(block)
        if found is None:
            return None  # runs diffusers' forward (see its report entry): eager inside the hooks
        set_, fwd = found
        # the whole-model runner's class: importing it here would close an import cycle (it imports this module)
        host = functools.partial(host_originals.host_weights, SimpleNamespace(transformer_blocks=(block,)))
        r = type(runner)(block, runner.fallbacks, runner.max_graphs, host, runner.capture_after, shared)
        r._inner, r._prev_present = fwd, True  # what it wraps and puts back: the patched forward, in the slot found
        set_(r)
        return r

    group = BlockGraphs.install(shared, enumerate(getattr(t, "transformer_blocks", None) or ()), put, t,
                                runner.max_graphs, runner.capture_after)
    if not group.runners:
        shared.clear()
        return "no block runs the patched forward"
    f.group = group
    log.info("FirstBlockCache on %s: CUDA graphs per block on %d blocks (its hooks decide on the host between "
             "them)", type(t).__name__, len(group.runners))
    return None


def _installed(f: Any) -> BlockGraphs | None:
    return f.group if f is not None and f.group is not None and f.group.installed else None


def _remove(f: Any, why: str) -> None:
    if (group := _installed(f)) is not None:
        group.remove()
        log.info("FirstBlockCache per-block CUDA graphs removed: %s", why)


def remove(runner: Any) -> None:  # the whole-model ``runner`` is being removed: its group with it
    f, runner._fbc = runner._fbc, None
    _remove(f, "the CUDA-graph runner was removed")


def invalidate(runner: Any, reason: str) -> None:
    if (group := _installed(runner._fbc)) is not None:
        group.invalidate(reason)


def describe(runner: Any) -> dict[str, Any]:
    """``{"first_block_cache": group description or why none was made}`` once the cache was seen, else ``{}``."""
    f = runner._fbc
    if f is None:
        return {}
    d = f.group.describe() if f.group is not None else {"mode": "per block", "installed": False}
    if f.why is not None and not d["installed"]:
        d["not_made"] = f.why
    return {"first_block_cache": d}
