""":class:`GraphedCall`: per call, refuse (eager, counted), replay or capture. Around a replay the fingerprint is
asked ``Scan.moved`` before the launch (memory the graph reads may be gone) and ``Scan.stale`` while the GPU runs it:
a change found after the launch discards the replay (``discarded_replays``), drops the graphs and runs the call
eager. With ``shared=`` (:mod:`.shared`) the group's lock, pools, streams and static inputs are used."""

import collections
import contextlib
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import hooks, step_caches, taylorseer
from ..plan import BlockRuntime
from . import first_block_cache, settings
from .capture import Graph, capture, map_tensors
from .fingerprint import Scan, root_reason, unwatch, watch
from .shared import Shared
from .signature import Call, Refusal, patch_tuning, positional_names

log = logging.getLogger("qwen_absorb")
_MISS = object()  # _fast_replay: no replay served


def _weak_forward(fn: Any, owner: nn.Module, held_elsewhere: bool) -> Callable[[], Any]:
    """A reference to ``fn`` not keeping ``owner`` alive where safe: weak for its method, or where a slot holds it."""
    if inspect.ismethod(fn) and fn.__self__ is owner:
        return weakref.WeakMethod(fn)
    if held_elsewhere:
        with contextlib.suppress(TypeError):  # not weak-referenceable: held
            return weakref.ref(fn)
    return lambda: fn


def bound_inner(t: nn.Module | None, inner: Any) -> Any:
    """``inner`` for a state: None for ``t``'s class forward bound to ``t`` (made again on load)."""
    cls_forward = (t is not None and getattr(inner, "__func__", None) is type(t).forward
                   and getattr(inner, "__self__", None) is t)
    return None if cls_forward else inner


class GraphedCall:
    """The transformer's ``forward`` in CUDA-graph mode, made by :func:`install`; removed, only counters."""

    __qwen_absorb_graph__ = True  # qwen_absorb.patch recognises its per-block runners by it (not a hook library's)
    __slots__ = ("__weakref__", "_transformer", "_name", "_inner", "_weak_inner", "_prev_present", "_positional",
                 "_host_tensors", "fallbacks", "max_graphs", "capture_after", "_graphs", "_pools", "_streams", "_scan",
                 "_dirty", "_failed", "_seen", "_removed", "_busy", "_lock", "_unstable", "_unreplayed", "_logged",
                 "captures", "replays", "eager_calls", "new_signature_calls", "evictions", "refusals", "invalidations",
                 "warn_first", "capture_failures", "_host_us", "_host_n", "_check_us", "_launch_us",
                 "discarded_replays", "_shared", "_cache", "_gens", "_fbc")

    def __init__(self, transformer: nn.Module, fallbacks: collections.Counter, max_graphs: int,
                 host_tensors: Callable[[], Iterable[torch.Tensor]] | None = None, capture_after: int = 0,
                 shared: Shared | None = None) -> None:
        self._transformer, self._shared, self._name = transformer, shared, type(transformer).__name__
        self.fallbacks, self.max_graphs, self.capture_after = fallbacks, int(max_graphs), int(capture_after)
        self._host_tensors = host_tensors
        self._prev_present = "forward" in transformer.__dict__
        self._inner = transformer.forward  # the instance's, else the class forward bound; what remove() puts back
        self._setup()

    def _setup(self) -> None:
        """Fresh runtime state (also after deepcopy and unpickling: graphs are never shared or saved)."""
        t = self._transformer
        self._weak_inner: Callable[[], Any] = lambda: None  # a removed runner's forward, once its model is gone
        self._positional = positional_names(type(t)) if t is not None else ()
        self._graphs: collections.OrderedDict[Any, Graph] = collections.OrderedDict()
        sh = self._shared
        self._pools, self._streams = (sh.pools, sh.streams) if sh is not None else ({}, {})  # by device
        self._scan: Scan | None = None
        self._dirty: str | None = None  # why the snapshot was dropped (the next scan's reason)
        self._failed, self._seen = {}, collections.OrderedDict()  # key -> why its capture failed / its eager calls
        self._removed = self._busy = self._unstable = False
        self._lock = sh.lock if sh is not None else threading.Lock()  # one caller in the static buffers at a time
        self._logged: set[str] = sh.logged if sh is not None else set()
        self.captures = self.replays = self.eager_calls = self.new_signature_calls = self.evictions = 0
        self._unreplayed = self.discarded_replays = self._host_n = 0
        self.refusals, self.invalidations, self.capture_failures = (collections.Counter() for _ in range(3))
        self._host_us = self._check_us = self._launch_us = 0.0  # replayed calls' host time (see describe())
        self._cache: taylorseer.GraphSteps | None = None  # TaylorSeer step sizes on the device (made on first use)
        self._gens: list[tuple[Any, int]] | None = None  # the owners' generations as the capture began
        self.warn_first = False  # a refusal of the next call is a warning (set by .attach.FirstUse), once
        self._fbc: Any = None  # the FirstBlockCache group, once the cache was met (first_block_cache.follow)
        if t is not None:
            watch(self)
            if sh is not None:
                sh.members.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._removed:
            return self._wrapped()(*args, **kwargs)
        if self._busy or torch.compiler.is_compiling() or taylorseer.capturing():
            return self._inner(*args, **kwargs)  # inside our capture, a compile, or the caller's own capture
        if not self._lock.acquire(blocking=False):  # another thread is in the static buffers
            return self._eager("another thread is using the CUDA-graph runner", "", args, kwargs)
        try:
            return self._call(args, kwargs)
        finally:
            self._lock.release()

    def _call(self, args: tuple, kwargs: dict) -> Any:  # noqa: C901  (the per-call decision, in order)
        t0 = time.perf_counter()
        if torch.is_grad_enabled():
            return self._eager("grad enabled", "", args, kwargs)
        t = self._transformer
        if t.training:
            return self._eager("module in training mode", "", args, kwargs)
        root = root_reason(t, runner=self)
        if root is None and self._shared is not None:
            root = self._shared.parent_reason()  # e.g. an offloading hook on the transformer around a block
        root = first_block_cache.follow(self, root)  # FirstBlockCache: this call's blocks replay graphs of their own
        if root is not None:
            self._drop(f"refused: {root[0]}", count=False, track=False)  # offloading needs the memory back
            return self._eager(root[0], root[1], args, kwargs)
        try:
            call = Call(args, kwargs, self._positional)
        except Refusal as r:
            return self._eager(r.reason, r.detail, args, kwargs)
        call.key = (call.key, patch_tuning(t))  # the patch's measurement switches: which kernels a graph bakes in
        steps = self._cache_steps(call)
        if isinstance(steps, str):
            return self._eager(steps, "", args, kwargs)
        if steps is None:
            return self._keyed(call, args, kwargs, t0, None)
        call.key = (call.key, steps.key)  # one graph per kind of step (taylorseer, step_caches)
        replays = self.replays
        with steps:  # (a raising call: the states as diffusers' hooks leave them, Steps.abandon)
            out = self._keyed(call, args, kwargs, t0, steps)
        steps.apply(self.replays != replays)  # the states' Python side (a replay ran none of it; eager runs did)
        return out

    def _cache_steps(self, call: Call) -> taylorseer.Steps | step_caches.Steps | str | None:
        """This call's cache steps; None without them; a refusal when they cannot be replayed here."""
        cfg = getattr(self._transformer, "_cache_config", None)
        if cfg is None or not (taylorseer.is_config(cfg) or step_caches.kind(cfg)):
            return None
        scan = self._scan if self._scan is not None else self._current_scan()
        if scan.refusal is not None or scan.device != call.device:
            return None
        if not taylorseer.is_config(cfg):
            steps = step_caches.begin(cfg, scan.step_hooks)
            if not isinstance(steps, step_caches.Steps) and scan is not self._current_scan():
                scan = self._scan  # decided on hooks of an older snapshot (a cache replaced): decided again
                steps = step_caches.begin(cfg, scan.step_hooks) if scan.refusal is None else None
            return steps
        if not scan.cache_hooks:
            return None
        why = taylorseer.graph_reasons(call.device)
        if why:
            return "TaylorSeer cache: " + why[0]
        if self._cache is None:
            self._cache = taylorseer.GraphSteps()
        return self._cache.begin(scan.cache_hooks, call.device)

    def _keyed(self, call: Call, args: tuple, kwargs: dict, t0: float,
               steps: taylorseer.Steps | step_caches.Steps | None) -> Any:
        out = self._fast_replay(call, t0, steps is not None and steps.writes)
        if out is not _MISS:
            return out
        scan = self._current_scan()
        if scan.refusal is not None:
            return self._eager(scan.refusal, scan.detail, args, kwargs)
        if scan.device != call.device:
            return self._eager("model and inputs on different devices", f"{scan.device} vs {call.device}", args, kwargs)
        if self._unstable:
            return self._eager("model state changes on every call", "", args, kwargs)
        if (scan.cache_hooks or scan.step_hooks) if steps is None else not steps.decided_for(scan):
            what = "TaylorSeer" if scan.cache_hooks else step_caches.kind(self._transformer._cache_config) or "A"
            return self._eager(f"{what} cache: steps not decided for this call", "", args, kwargs)  # hooks replaced
        if steps is not None and not steps.capturable:
            return self._eager(steps.first, "", args, kwargs)
        if call.key in self._failed:  # (no graph for the key here: _fast_replay served it, or the scan dropped it)
            return self._eager("capture failed (this signature runs eager)", self._failed[call.key], args, kwargs)
        self.warn_first = False  # graphs can take this call: decided
        # capture_after holds until the first replay: after it the runner is in a loop, where an eager call for a
        # new signature (a new prompt length) costs more than its capture
        if self.capture_after and not self.replays and self._count_new(call.key):
            return self._inner(*args, **kwargs)
        return self._capture(call, steps)

    def _fast_replay(self, call: Call, t0: float, writes: bool = False) -> Any:
        """Replay ``call``'s graph on an unchanged snapshot; ``_MISS``: none, or changed (the full path drops them)."""
        scan = self._scan
        if scan is None or scan.refusal is not None or self._unstable or scan.device != call.device:
            return _MISS
        entry = self._graphs.get(call.key)
        # (a replay that updates cache factors in place cannot be discarded: ``writes`` checks first)
        if entry is None or scan.moved() is not None or (writes and scan.stale() is not None):
            return _MISS
        tl = time.perf_counter()
        if self._shared is not None:
            self._shared.order(call.device)  # the shared buffers' last stream first
        for s, x in zip(entry.statics, call.tensors):
            s.copy_(x)
        entry.graph.replay()
        taylorseer.replayed()
        t1 = time.perf_counter()
        self._launch_us += (t1 - tl) * 1e6
        if not writes and scan.stale() is not None:
            self.discarded_replays += 1  # its output is never read; _current_scan drops the graphs after it ran
            return _MISS
        self._graphs.move_to_end(call.key)
        self.warn_first = False
        entry.replays += 1
        self.replays += 1
        self._host_n += 1
        self._unreplayed = 0
        out = map_tensors(entry.out, torch.Tensor.clone)
        self._host_us += (t1 - t0) * 1e6
        self._check_us += (time.perf_counter() - t1) * 1e6
        return out

    def _wrapped(self) -> Callable[..., Any]:  # the forward this runner wraps (after remove(), held weakly)
        fn = self._inner if self._inner is not None else self._weak_inner()
        if fn is None:
            raise RuntimeError(f"qwen_absorb: this CUDA-graph runner of a {self._name} was removed, and the "
                               "forward it wrapped is gone with its model")
        return fn

    def _count_new(self, key: Any) -> bool:
        """True when the signature has had fewer than ``capture_after`` eager calls: this one runs eager too."""
        seen = self._seen
        if seen.get(key, 0) >= self.capture_after:
            return False
        seen[key] = seen.get(key, 0) + 1
        seen.move_to_end(key)
        while len(seen) > settings.MAX_COUNTED_SIGNATURES:
            seen.popitem(last=False)
        self.new_signature_calls += 1
        return True

    def _count(self, reason: str) -> None:  # an eager call, for ``reason``
        self.fallbacks[settings.PREFIX + reason] += 1
        self.refusals[reason] += 1
        self.eager_calls += 1

    def _eager(self, reason: str, detail: str, args: tuple, kwargs: dict) -> Any:
        self._count(reason)
        if self.warn_first:
            self.warn_first = False
            self._logged.add(reason)
            log.warning("CUDA graphs cannot be used for this %s (%s%s); its calls run eager, counted in the patch "
                        "report's graph_fallbacks", self._name, reason, f": {detail}" if detail else "")
        elif self._first(reason):
            log.info("CUDA graph refused, running eager: %s%s", reason, f" ({detail})" if detail else "")
        return self._inner(*args, **kwargs)

    def _host(self) -> list[torch.Tensor]:  # the tensors allowed off the graph device, read anew for every scan
        try:
            return list(self._host_tensors()) if self._host_tensors is not None else []
        except Exception as e:  # noqa: BLE001 - a failing callable must not fail the call: none allowed
            if self._first("host_tensors"):
                log.warning("host_tensors() raised %s: %s; no tensor may live off the GPU", type(e).__name__, e)
            return []

    def _current_scan(self) -> Scan:
        """The snapshot graphs are valid for; rebuilt (and graphs dropped) when the model changed."""
        scan = self._scan
        if scan is not None:
            what = scan.changed()
            if what is None:
                return scan
            if scan.sticky and what.startswith("weights") and not self._graphs:
                scan.take()  # refused for a hook that recasts weights every call (layerwise casting): verdict stands
                return scan
            detail = scan.which()
            reason = what + (f" ({detail})" if detail else "")
        else:
            reason = self._dirty or "first scan"
        self._dirty = None
        if self._graphs:
            self._drop(reason)
        self._scan = scan = Scan(self._transformer, self._host(), self)
        return scan

    def module_assigned(self, module_id: int, what: str) -> None:
        """torch registered a module / parameter / buffer on the module ``module_id`` (see fingerprint.watch)."""
        scan = self._scan
        if scan is not None and module_id in scan.module_ids:
            self._scan, self._dirty = None, f"module structure changed ({what})"

    def _capture(self, call: Call, steps: taylorseer.Steps | step_caches.Steps | None = None) -> Any:
        desc = call.describe(self._positional)
        sh = self._shared
        self._busy = True
        try:
            if sh is not None:
                sh.order(call.device)
            got = capture(self._staged(call.key, steps), self._transformer, call, desc, self._streams, self._pools,
                          sh.statics(call.tensors) if sh is not None else None)
        finally:
            self._busy = False
        error = got.error if got.error is not None or got.graph is None else self._after_capture(call.key)
        if error is not None:
            self._capture_failed(call, desc, error)
            return got.warm
        if steps is not None:
            if not steps.capturable:  # the warm-up reallocated cache factors: the graph read the old ones
                return got.warm
            got.graph.keep.extend(steps.tensors())  # the cache factors and step sizes it reads and writes
        self._insert(call.key, got.graph)
        self.captures += 1
        log.log(self._level("captured " + desc), "captured CUDA graph %d/%d in %.0f ms: %s (%d host constants)",
                len(self._graphs), self.max_graphs, got.graph.capture_ms, desc, got.host_constants)
        if self._scan.refusal is not None:
            self._drop(f"refused after capture: {self._scan.refusal}")
        return got.warm

    def _staged(self, key: Any, steps: Any = None) -> Callable[..., Any]:
        """The wrapped forward for :func:`.capture.capture`: the warm-up, :meth:`_warmed`, then the capture."""
        self._gens, calls = None, []
        inner = steps.wrap(self._inner) if steps is not None else self._inner

        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(None)
            out = inner(*args, **kwargs)
            if len(calls) == 1:  # the warm-up ran
                self._warmed(key)
            return out

        return run

    def _warmed(self, key: Any) -> None:
        """The capture sees lazy state the warm-up set (plans decided after a move, caches): snapshot taken now;
        if it changed, older graphs are dropped."""
        scan = self._scan
        if (scan.changed() if scan is not None else "changed during the warm-up") is not None:
            # (blocks deciding on weights moved in: the same scan)
            self._only(key, rescan=scan is None or not scan.redecided())
        self._gens = [(o, o.generation) for o in self._scan.owners]

    def _after_capture(self, key: Any) -> BaseException | None:
        """Derived tensors rebuilt or weights moved inside the capture: the graph is not kept (such a block decides
        again at its next call). Anything else it changed is what the graph saw: new snapshot, older graphs dropped."""
        gens, self._gens, scan = self._gens, None, self._scan
        if gens is not None:  # (None: the warm-up raised or never returned here)
            rebuilt = [o for o, g in gens if o.generation != g]
            moved = "derived tensors rebuilt" if rebuilt else scan.moved() if scan is not None else None
            if moved is not None:
                for o in rebuilt:  # (an FP8 forward dropped its decision itself)
                    if isinstance(o, BlockRuntime):
                        o.device = None  # the next call decides (block._call_check)
                self._scan, self._dirty = None, "the model changed during a capture"
                return RuntimeError(f"the model changed during the capture ({moved})")
        if (scan.stale() if gens is not None else scan.changed()) if scan is not None else True:
            self._only(key)
        return None

    def _only(self, key: Any, rescan: bool = True) -> None:
        """The model changed under a capture: every graph but ``key``'s dropped, and (``rescan``) a new snapshot."""
        for k in [k for k in self._graphs if k != key]:
            self._sync()
            del self._graphs[k]
        if rescan:
            self._scan, self._dirty = Scan(self._transformer, self._host(), self), None

    def _capture_failed(self, call: Call, desc: str, e: BaseException) -> None:
        self._failed[call.key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        self.capture_failures[type(e).__name__] += 1
        self._count("capture failed (this signature runs eager)")
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(call.device)  # the failed capture's device, whichever is current
        first = self._first("capture failed")
        log.log(logging.WARNING if first else logging.DEBUG, "CUDA graph capture failed for %s (%s)%s", desc,
                self._failed[call.key], "; this signature runs eager from now on" if first else "")

    def _insert(self, key: Any, entry: Graph) -> None:
        while len(self._graphs) >= self.max_graphs:
            self._sync()
            self._graphs.popitem(last=False)
            self.evictions += 1
        self._graphs[key] = entry

    def _sync(self) -> None:
        """Wait for in-flight replays before their graphs, static buffers and pool memory are released."""
        if self._graphs and torch.cuda.is_available() and torch.cuda.is_initialized():
            for dev in {s.device for g in self._graphs.values() for s in g.statics[:1]}:
                torch.cuda.synchronize(dev)

    def _drop(self, reason: str, count: bool = True, track: bool = True) -> None:
        """Drop every graph and the pools. ``track``: a state change; if such drops keep hitting graphs never
        replayed, the model changes every call and the runner turns itself off."""
        if not self._graphs:
            return
        self._sync()
        if track and any(g.replays == 0 for g in self._graphs.values()):
            self._unreplayed += 1
            if self._unreplayed >= settings.MAX_UNREPLAYED_INVALIDATIONS and not self._unstable:
                self._unstable = True
                log.warning("CUDA graphs were invalidated before any replay %d times in a row (%s); "
                            "graph mode stays off for this model (invalidate() re-enables it)",
                            self._unreplayed, reason)
        self._graphs.clear()
        if self._shared is None:  # the pool handles go with the graphs (a group's: see Shared.forget_pools)
            self._pools.clear()
        else:
            self._shared.forget_pools()
        if count:
            self.invalidations[reason] += 1
        log.log(self._level("dropped " + reason), "dropped CUDA graphs: %s", reason)

    def _level(self, what: str) -> int:
        """INFO for a private runner; in a group, INFO the first time any of its runners logs ``what``."""
        return logging.INFO if self._shared is None or self._first(what) else logging.DEBUG

    def _first(self, what: str) -> bool:  # True the first time ``what`` is logged (per group)
        new = what not in self._logged
        self._logged.add(what)
        return new

    def invalidate(self, reason: str = "invalidate() called") -> None:
        """Drop all graphs; the next call of each signature captures anew (also re-enables an unstable runner)."""
        self._drop(reason, count=False, track=False)
        first_block_cache.invalidate(self, reason)
        self.invalidations[reason] += 1
        self._unstable, self._unreplayed, self._scan, self._dirty = False, 0, None, reason

    def remove(self) -> None:
        """The previous forward back where this runner sits; graphs, pools, the snapshot and the model dropped."""
        if self._removed:
            return
        first_block_cache.remove(self)  # a FirstBlockCache group's runners: each patched forward back in its slot
        t = self._transformer
        restored = hooks.put_back(t, self, self._inner, self._prev_present)  # (or inside a chain that wrapped us since)
        if not restored:
            log.warning("the CUDA-graph forward of %s was not found in its hook chain; it stays as "
                        "a pass-through", self._name)
        self._drop("remove()", count=False, track=False)
        if self._shared is not None:  # the group's pools and streams stay with the group
            self._shared.members.discard(self)
            self._shared.forget_pools()
            self._pools, self._streams, self._logged = {}, {}, set(self._logged)
            self._shared = None
        for x in (self._pools, self._failed, self._seen, self._streams):
            x.clear()
        for h in self._scan.cache_hooks + self._scan.step_hooks if self._scan is not None else ():
            step_caches.release(h)  # the cache tensors kept for graphs (the states keep what they hold)
        self._cache = self._scan = None
        self._removed = True
        unwatch(self)
        self._weak_inner = _weak_forward(self._inner, t, held_elsewhere=restored)
        self._inner = self._transformer = self._host_tensors = None

    def describe(self) -> dict[str, Any]:
        """JSON-able status: graphs held, captures, replays, refusals, invalidations, limits."""
        n, g = self._host_n, self._graphs.values()
        return {
            "installed": not self._removed, "max_graphs": self.max_graphs, "capture_after": self.capture_after,
            "graphs": len(self._graphs), "signatures": [e.desc for e in g], "captures": self.captures,
            "replays": self.replays, "eager_calls": self.eager_calls, "new_signature_calls": self.new_signature_calls,
            "evictions": self.evictions, "refusals": dict(self.refusals), "invalidations": dict(self.invalidations),
            "capture_failures": dict(self.capture_failures), "failed_signatures": len(self._failed),
            "unstable": self._unstable, "capture_ms": [round(e.capture_ms, 1) for e in g],
            "host_us_per_replay": round(self._host_us / n, 1) if n else None,
            "overlapped_check_us_per_replay": round(self._check_us / n, 1) if n else None,
            "launch_us_per_replay": round(self._launch_us / n, 1) if n else None,
            "discarded_replays": self.discarded_replays, "outputs": "clone", **first_block_cache.describe(self),
        }

    @property
    def __signature__(self) -> inspect.Signature:
        try:
            return inspect.signature(self._wrapped())
        except RuntimeError:
            return inspect.Signature()

    def __repr__(self) -> str:
        return (f"<qwen_absorb GraphedCall on {self._name}: {len(self._graphs)}/{self.max_graphs} graphs, "
                f"{self.captures} captures, {self.replays} replays{', removed' if self._removed else ''}>")

    def __getstate__(self) -> dict[str, Any]:  # (deepcopy too: the copy is in the memo before its state is copied)
        t = self._transformer  # (host_tensors: a closure over this model, neither copied nor saved)
        return {"transformer": t, "name": self._name, "fallbacks": self.fallbacks, "max_graphs": self.max_graphs,
                "capture_after": self.capture_after, "prev_present": self._prev_present,
                "inner": bound_inner(t, self._inner), "removed": self._removed,
                "shared": self._shared}  # a Shared copies fresh and empty, once per group

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = self._transformer = state["transformer"]
        self._name = state.get("name") or type(t).__name__
        self.fallbacks, self.max_graphs = state["fallbacks"], state["max_graphs"]
        self.capture_after, self._host_tensors = state.get("capture_after", 0), None
        self._prev_present, inner = state["prev_present"], state["inner"]
        self._inner = inner if inner is not None or t is None else type(t).forward.__get__(t)
        self._shared = None if state["removed"] else state.get("shared")
        self._setup()
        self._removed = state["removed"]
        if self._removed:
            unwatch(self)

