"""diffusers' TaylorSeer cache (``enable_cache(TaylorSeerCacheConfig(...))``): the one reader of its hooks and states.

Each step (update the Taylor factors, or extrapolate) is decided on the host from a counter, before the call runs.
A patched block's :func:`run` wraps its own attention in diffusers' decision, update and prediction. In CUDA-graph
mode the runner decides every step first (:class:`GraphSteps`) and keys its graphs by them; the factors live in
place per (hook, cache context) and the kernels read the step sizes from device memory (one graph for every
offset). Anything else stays diffusers' hooked module, which graph mode refuses."""

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import hooks, step_caches
from .ops import kernel_runtime_reasons as graph_reasons  # why the steps' kernels cannot run on a device
from .ops import taylor_seer as ts_ops

log = logging.getLogger("qwen_absorb")
_local = threading.local()


def capturing() -> bool:  # the current stream is capturing a CUDA graph (the graph runner asks on every call)
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()  # (initialized implies available)


def is_config(config: Any) -> bool:
    """``config`` (a transformer's ``_cache_config``) is diffusers' TaylorSeer configuration."""
    return step_caches._diffusers(config, {"TaylorSeerCacheConfig": True}) is not None


def supported_hook(module: nn.Module) -> Any | None:
    """The TaylorSeer hook of ``module`` when a patched block may run it: the only hook, active mode, at most
    ``ts_ops.MAX_ORDER`` orders, factors in bf16 / fp16 / fp32."""
    hook = hooks.sole_registry_hook(module, "taylorseer_cache")
    kw = getattr(getattr(hook, "state_manager", None), "_init_kwargs", None)
    if step_caches._diffusers(hook, {"TaylorSeerCacheHook": True}) is None or not isinstance(kw, dict) \
            or kw.get("is_inactive", False) or not 0 <= int(kw.get("max_order", 1)) <= ts_ops.MAX_ORDER \
            or kw.get("taylor_factors_dtype", torch.bfloat16) not in (torch.bfloat16, torch.float16, torch.float32):
        return None
    return hook


class _Record:
    """The factors of one (hook, cache context) in place: ``bufs[i][k]`` is order k of output i."""

    __slots__ = ("serial", "bufs", "dtypes")

    def __init__(self, like: list[torch.Tensor], dtype: torch.dtype, orders: int) -> None:
        self.serial = next(step_caches._serials)
        self.dtypes = tuple(x.dtype for x in like)  # the module's output dtypes (what predictions are made in)
        self.bufs = [[torch.empty(x.shape, dtype=dtype, device=x.device) for _ in range(orders)] for x in like]

    def fits(self, like: list[torch.Tensor], dtype: torch.dtype) -> bool:
        return len(self.bufs) == len(like) and all(
            b[0].shape == x.shape and b[0].dtype == dtype and b[0].device == x.device for b, x in zip(self.bufs, like))

    def tensors(self) -> list[torch.Tensor]:
        return [t for b in self.bufs for t in b]


def _record(hook: Any, name: str) -> _Record | None:  # in step_caches' per-hook store (its release forgets it)
    return step_caches._kept.get(hook, {}).get(name)


def _new_record(hook: Any, name: str, like: list[torch.Tensor], dtype: torch.dtype, orders: int) -> _Record:
    rec = step_caches._kept.setdefault(hook, {})[name] = _Record(like, dtype, orders)
    log.debug("TaylorSeer factors kept for %r: %d tensors, %.1f MiB", name, len(rec.tensors()),
              sum(t.numel() * t.element_size() for t in rec.tensors()) / 2**20)
    return rec


class Step:  # one hook's step in one call, decided before the call (graph mode)
    __slots__ = ("hook", "state", "name", "compute", "n", "delta", "offset", "coef", "kept", "orders", "changed",
                 "entered", "ran")

    def __init__(self, hook: Any, state: Any, compute: bool) -> None:
        self.hook, self.state, self.compute = hook, state, compute
        self.entered = self.ran = False  # the block reached this step / finished it (see Steps.abandon)
        self.name, self.orders = hook.state_manager._context.name, int(state.max_order) + 1
        self.delta = self.offset = 0
        self.coef: torch.Tensor | None = None  # this step's row of the device coefficients
        self.changed = False  # the factors were reallocated while running: no graph of this call
        facs = state.taylor_factors
        if compute:
            first = state.last_update_step is None
            self.delta = 0 if first else state.current_step - state.last_update_step
            if not first and self.delta == 0:
                raise ValueError("Delta step cannot be zero for TaylorSeer update.")
            # diffusers differences each order it holds (up to max_order) against the new features
            self.n = 0 if first else min(int(state.max_order), len(facs.get(0, {})))
        elif state.last_update_step is None or not facs:
            self.n = -1  # diffusers raises; run() raises the same
        else:
            self.offset = state.current_step - state.last_update_step
            self.n = len(facs[0])
        self.kept = self._adopt()

    def key(self) -> tuple:
        return (self.compute, self.n, self.kept.serial if self.kept is not None else None)

    def coefficients(self) -> list[float]:
        if self.compute:
            return ts_ops.update_coefficients(self.delta) if self.n > 0 else []
        return ts_ops.predict_coefficients(self.offset, self.n) if self.n > 0 else []

    def _adopt(self) -> _Record | None:
        """The kept factors this step reads, holding what the state holds (copied in after diffusers' own update)."""
        st = self.state
        need = self.n if self.compute else max(self.n, 0)
        rec = _record(self.hook, self.name)
        if need == 0:
            return rec
        outs = [st.taylor_factors[i] for i in sorted(st.taylor_factors)]
        if rec is not None and len(outs) == len(rec.bufs) and all(
                o.get(k) is b[k] for o, b in zip(outs, rec.bufs) for k in range(need)):
            return rec  # the state holds the kept factors themselves (every step after the first, in graph mode)
        like = [o[0] for o in outs]
        dtype = like[0].dtype
        if rec is None or not rec.fits(like, dtype):
            rec = _new_record(self.hook, self.name, like, dtype, self.orders)
        if st.module_dtypes:
            rec.dtypes = tuple(st.module_dtypes)
        for o, b in zip(outs, rec.bufs):
            for k in range(need):
                if o[k] is not b[k]:
                    b[k].copy_(o[k])
        return rec

    def run(self, compute: Callable[[], Any]) -> Any:
        st = self.state
        self.entered = True
        if not self.compute:
            if self.n < 0:
                raise ValueError("Cannot predict without prior initialization/update.")
            outs = [ts_ops.predict_reference(b, self.n, self.offset, dt) if ts_ops.reasons(b[0], b)
                    else ts_ops.predict(b, self.n, self.coef, dt) for b, dt in zip(self.kept.bufs, st.module_dtypes)]
            self.ran = True
            return outs[0] if len(outs) == 1 else tuple(outs)
        out = compute()
        feats = [out] if isinstance(out, torch.Tensor) else list(out)
        rec, fdtype = self.kept, st.taylor_factors_dtype
        if rec is None or not rec.fits(feats, fdtype):
            if capturing():
                raise RuntimeError("TaylorSeer factors reallocated during a CUDA-graph capture")
            self.kept = rec = _new_record(self.hook, self.name, feats, fdtype, self.orders)
            self.changed, self.n = True, 0  # diffusers restarts its expansion on a shape change too
        rec.dtypes = tuple(x.dtype for x in feats)
        for x, b in zip(feats, rec.bufs):
            if ts_ops.reasons(x, b):  # off CUDA (the runner never decides steps there): diffusers' ops
                ts_ops.update_reference_(x, b, self.n, self.delta)
            else:
                ts_ops.update_(x.contiguous(), b, self.n, self.coef)
        self.ran = True
        return out

    def apply(self) -> None:
        """The state's Python side after this step ran (replayed or not): what diffusers' update leaves."""
        if not self.compute or self.kept is None:
            return
        st = self.state
        for i, b in enumerate(self.kept.bufs):
            st.taylor_factors[i] = {k: b[k] for k in range(self.n + 1)}
        st.module_dtypes, st.device = self.kept.dtypes, self.kept.bufs[0][0].device
        st.last_update_step = st.current_step


class GraphSteps:
    """A runner's step decisions, and the coefficients the kernels read (``MAX_ORDER`` a hook, from a pinned ring)."""

    RING = 4

    def __init__(self) -> None:
        self._dev: torch.Tensor | None = None
        self._host, self._events, self._next = [], [], 0  # the pinned ring, its copies' events, the next slot

    def _rows(self, n: int, device: torch.device) -> torch.Tensor:
        if (dev := self._dev) is None or dev.shape[0] < n or dev.device != device:
            self._dev = dev = torch.zeros(max(n, 1), ts_ops.MAX_ORDER, dtype=torch.float32, device=device)
            self._host = [torch.zeros(dev.shape, dtype=torch.float32, pin_memory=device.type == "cuda")
                          for _ in range(self.RING)]
            self._events = [None] * self.RING
        return dev

    def begin(self, hooks: list[Any], device: torch.device) -> "Steps":
        """Each hook's step for this call (the hooks' own counters advance, as their eager calls would)."""
        steps = [Step(h, state, bool(should)) for h in hooks for should, state in [h._measure_should_compute()]]
        dev = self._rows(len(steps), device)
        r, self._next = self._next, (self._next + 1) % self.RING
        if (ev := self._events[r]) is not None:
            ev.synchronize()  # the copy that last read this pinned slot has run (never waits in practice)
        m = ts_ops.MAX_ORDER
        flat = [x for c in map(Step.coefficients, steps) for x in c + [0.0] * (m - len(c))]
        for i, s in enumerate(steps):
            s.coef = dev[i]
        if flat:
            self._host[r][: len(steps)].copy_(torch.tensor(flat, dtype=torch.float32).view(len(steps), m))
        dev.copy_(self._host[r], non_blocking=device.type == "cuda")
        if device.type == "cuda":
            ev = self._events[r] = torch.cuda.Event()
            ev.record()
        return Steps(steps, self)

    def tensors(self) -> list[torch.Tensor]:
        return [self._dev] if self._dev is not None else []


class Steps(step_caches.CallSteps):
    """One call's steps; entered, the context :func:`run` finds them in. The blocks run them: nothing to stage."""

    __slots__ = ("steps", "by_hook", "key", "owner", "_prev")
    first = "TaylorSeer cache: first update of its factors"
    HOOKS = "cache_hooks"

    def __init__(self, steps: list[Step], owner: GraphSteps) -> None:
        self.steps, self.owner = steps, owner
        self.by_hook = {id(s.hook): s for s in steps}
        self.key = tuple(s.key() for s in steps)

    def tensors(self) -> list[torch.Tensor]:  # the factors, and the step sizes the kernels read
        return super().tensors() + self.owner.tensors()

    def __enter__(self) -> "Steps":
        self._prev = getattr(_local, "steps", None)
        _local.steps = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _local.steps = self._prev
        super().__exit__(*exc)

    def apply(self, replayed: bool = False) -> None:  # (each step ran, or its launch marked it: :func:`replayed`)
        for s in self.steps:
            s.apply()

    def replayed(self) -> None:  # a graph ran every step of this call (no Python of the steps runs in a replay)
        for s in self.steps:
            s.entered = s.ran = True

    def abandon(self) -> None:
        """The call raised: each state as diffusers' hooks would leave it. A finished step is applied, an entered one
        kept as is, one never reached gets back the counter ``begin`` advanced."""
        for s in self.steps:
            if s.ran:
                s.apply()
            elif not s.entered:
                s.state.current_step -= 1  # what _measure_should_compute added


def replayed() -> None:  # the runner launched a graph for the call whose steps are current in this thread (if any)
    if (steps := getattr(_local, "steps", None)) is not None:
        steps.replayed()


def run(module: nn.Module, compute: Callable[[], Any]) -> Any:
    """What calling the TaylorSeer-hooked ``module`` returns, with ``compute()`` as its forward: the step decided
    for this call in graph mode (:class:`Steps`), else diffusers' own decision, update and prediction."""
    if (hook := supported_hook(module)) is None:
        raise RuntimeError("qwen_absorb: the TaylorSeer hook this block was decided for is gone")
    steps = getattr(_local, "steps", None)
    step = steps.by_hook.get(id(hook)) if steps is not None else None
    if step is not None:
        out = step.run(compute)
        if not capturing():
            step.apply()
        return out
    should, state = hook._measure_should_compute()
    if should:
        out = compute()
        state.update((out,) if isinstance(out, torch.Tensor) else out)
        return out
    outs = state.predict()
    return outs[0] if len(outs) == 1 else tuple(outs)
