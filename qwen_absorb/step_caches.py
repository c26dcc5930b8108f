"""diffusers' PAB and MagCache under whole-model CUDA graphs; why FasterCache and FirstBlockCache are not (refusal).

Both decide each call's work on the host from their own counters: :func:`begin` predicts each state's decision on a
copy of it (diffusers' expressions on the same values), which keys the graph. The tensor a state carries between
calls is kept in place per (hook, cache context). A warm-up and a capture run the hooks with the timestep callback
answering the decided comparison (no device read inside a capture); a replay runs no hook: the predicted state is
applied after it. :class:`CallSteps`: the runner's view of one call's steps (also TaylorSeer's)."""

import itertools
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from . import hooks

PAB, MAG = "PyramidAttentionBroadcast", "MagCache"
_HOOKS = {"PyramidAttentionBroadcastHook": PAB, "MagCacheHeadHook": MAG, "MagCacheBlockHook": MAG}
_CONFIGS = {"PyramidAttentionBroadcastConfig": PAB, "MagCacheConfig": MAG}
PAB_HOOK_NAME = "pyramid_attention_broadcast"  # the name diffusers registers its PAB hook under
_EAGER = {  # caches whose calls run eager under graphs: (refusal, detail)
    "FirstBlockCacheConfig": (
        "FirstBlockCache: per-block CUDA graphs (the model call runs eager around them)",
        "diffusers compares the first block's residual with the last one (.item()) inside every call, which no "
        "graph of the whole model can take: its hooks run on the host and each block they compute replays a graph "
        "of its own (qwen_absorb.cuda_graph.first_block_cache)"),
    "FasterCacheConfig": (
        "FasterCache: hooks the transformer call itself (not graphed)",
        "its denoiser hook wraps the transformer's own forward, outside the graph runner, and splits batched "
        "cond/uncond inputs: QwenImagePipeline runs them as separate calls (is_guidance_distilled=False raises "
        "on Qwen-Image, patched or not); its attention approximation runs eager, exact"),
}
_serials = itertools.count(1)  # a new serial per kept allocation: keys the graphs that read it
# hook -> {cache context: kept tensors (also taylorseer's)}; by hook: diffusers drops its states after every run
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def release(hook: Any) -> None:  # forget the tensors kept for ``hook`` (graphs holding them keep theirs until dropped)
    _kept.pop(hook, None)


def _diffusers(obj: Any, names: dict) -> Any:
    t = type(obj)
    return names.get(t.__name__) if t.__module__.startswith("diffusers.") else None


def is_fbc_config(config: Any) -> bool:
    """``config`` (a transformer's ``_cache_config``) is diffusers' FirstBlockCache (graphed per block)."""
    return _diffusers(config, {"FirstBlockCacheConfig": True}) is not None


def is_fbc_hook(hook: Any) -> bool:  # ``hook`` is one of FirstBlockCache's block hooks (its head's or the others')
    return _diffusers(hook, {"FBCHeadBlockHook": True, "FBCBlockHook": True}) is not None


def kind(config: Any) -> str | None:
    """PAB or MAG when ``config`` (a transformer's ``_cache_config``) is a cache this module graphs."""
    return _diffusers(config, _CONFIGS)


def refusal(config: Any) -> tuple[str, str] | None:
    """Why the calls of a cache this module does not graph run eager: (reason, detail), or None."""
    return _diffusers(config, _EAGER)


def owned(module: nn.Module) -> list[Any]:
    """The diffusers hooks on ``module`` when all are PAB / MagCache hooks (the runner decides them); else []."""
    named = hooks.registry_hooks(module)
    return list(named.values()) if named and all(_diffusers(h, _HOOKS) for h in named.values()) else []


def attention_hook(module: nn.Module) -> Any | None:
    """The PAB hook of ``module`` when a patched block may run it around its own attention: diffusers' own, the
    module's only hook, wrapping the class forward, with the identity pre/post steps (the block calls neither)."""
    hook = hooks.sole_registry_hook(module, PAB_HOOK_NAME)  # (a patched block asks on every call it runs)
    if hook is None or _diffusers(hook, _HOOKS) != PAB or "pre_forward" in (steps := vars(type(hook))) \
            or "post_forward" in steps:
        return None
    orig = getattr(getattr(hook, "fn_ref", None), "original_forward", None)
    own = getattr(orig, "__self__", None) is module and getattr(orig, "__func__", None) is type(module).forward
    return hook if own else None


class _Around:
    """The PAB hook as its ``new_forward`` reads it, but with its own ``fn_ref``: other attributes go to the hook."""

    __slots__ = ("_hook", "fn_ref")

    def __init__(self, hook: Any, compute: Callable[[], Any]) -> None:
        object.__setattr__(self, "_hook", hook)
        object.__setattr__(self, "fn_ref", SimpleNamespace(original_forward=compute))  # the block's attention

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_hook"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_hook"), name, value)


def run(module: nn.Module, compute: Callable[[], Any]) -> Any:
    """What calling the PAB-hooked ``module`` returns, with ``compute()`` (the block's attention) as its forward:
    diffusers' ``new_forward`` on a stand-in of the hook (its ``fn_ref`` is shared with the module's other callers)."""
    if (hook := attention_hook(module)) is None:
        raise RuntimeError("qwen_absorb: the PyramidAttentionBroadcast hook this block was decided for is gone")
    return type(hook).new_forward(_Around(hook, compute), module)


def _flat(v: Any) -> list[torch.Tensor]:
    return [v] if isinstance(v, torch.Tensor) else list(v)


def _copy(v: Any) -> Any:  # what a snapshot holds: 0-d tensors diffusers updates in place (MagCache's *=) cloned
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return v.clone()
    return list(v) if isinstance(v, list) else v


class _Kept:  # the tensors a state carries from call to call, kept in place for graphs
    __slots__ = ("serial", "bufs", "box")

    def __init__(self, v: Any) -> None:
        self.serial = next(_serials)
        self.box = None if isinstance(v, torch.Tensor) else type(v)  # the container diffusers used
        self.bufs = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in _flat(v)]

    def fits(self, like: list[torch.Tensor]) -> bool:
        return len(like) == len(self.bufs) and all(
            b.shape == x.shape and b.dtype == x.dtype and b.device == x.device for b, x in zip(self.bufs, like))

    def value(self) -> Any:  # the kept tensors as the state holds them
        return self.bufs[0] if self.box is None else self.box(self.bufs)

    def tensors(self) -> list[torch.Tensor]:
        return self.bufs


class _Step:
    """One state's decision for one call (``post``: its plain attributes after the call; ``reset``: a run ends)."""

    __slots__ = ("hook", "state", "name", "field", "compute", "post", "reset", "kept", "changed", "before", "after")

    def __init__(self, hook: Any, state: Any, name: str, field: str, compute: bool, post: dict,
                 reset: bool = False) -> None:
        self.hook, self.state, self.name, self.field = hook, state, name, field
        self.compute, self.post, self.reset = compute, post, reset
        self.changed, self.before, self.after = False, None, None
        self.kept = self._adopt()

    def _adopt(self) -> _Kept | None:
        """The kept tensors, holding what the state holds (copied in after an eager call made new ones)."""
        v = getattr(self.state, self.field)
        per = _kept.setdefault(self.hook, {})
        k = per.get(self.name)
        if v is None:
            return k
        like = _flat(v)
        if k is None or not k.fits(like):
            k = per[self.name] = _Kept(v)
        if not self.compute and any(b is not x for b, x in zip(k.bufs, like)):
            for b, x in zip(k.bufs, like):
                b.copy_(x)
            setattr(self.state, self.field, k.value())
        return k

    def key(self) -> tuple:
        # a compute step that ends a MagCache run copies no residual (the tail drops it): a graph of its own
        return (self.compute, self.compute and self.reset, self.kept.serial if self.kept is not None else None)

    def keep(self, capturing: bool) -> None:
        """After the hooks ran a compute step (a warm-up, a capture): their new tensor into the kept ones."""
        v = getattr(self.state, self.field) if self.compute else None
        if v is None:
            return
        like = _flat(v)
        if self.kept is None or not self.kept.fits(like):
            if capturing:
                raise RuntimeError(f"{self.field} changed shape during a CUDA-graph capture")
            self.kept = _kept.setdefault(self.hook, {})[self.name] = _Kept(v)
            self.changed = True
        for b, x in zip(self.kept.bufs, like):
            b.copy_(x)
        setattr(self.state, self.field, self.kept.value())

    def snapshot(self) -> dict:
        return {k: _copy(v) for k, v in vars(self.state).items()}

    def restore(self, snap: dict) -> None:
        vars(self.state).update({k: _copy(v) for k, v in snap.items()})

    def apply(self) -> None:  # the state after a replay: what diffusers' hooks leave
        vars(self.state).update(self.post)
        if self.compute:
            setattr(self.state, self.field, None if self.reset else self.kept.value())


class _Decided:  # what a PAB hook's timestep callback answers in a warm-up or capture: ``lo < x < hi`` is the decision
    __slots__ = ("inside",)

    def __init__(self, inside: bool) -> None:
        self.inside = inside

    def __gt__(self, other: Any) -> bool:
        return self.inside

    __lt__ = __gt__


def _pab(hook_list: list[Any]) -> tuple[list[_Step], list[tuple[Any, _Decided]]]:
    steps, shadows, times = [], [], {}
    for h in hook_list:
        cb = h.current_timestep_callback
        if id(cb) not in times:
            times[id(cb)] = cb()  # once per call per callback (diffusers asks every hook; the same value)
        lo, hi = h.timestep_skip_range
        inside = bool(lo < times[id(cb)] < hi)
        st = h.state
        compute = st.cache is None or st.iteration == 0 or not inside or st.iteration % h.block_skip_range == 0
        steps.append(_Step(h, st, "", "cache", bool(compute), {"iteration": st.iteration + 1}))
        shadows.append((h, _Decided(inside)))
    return steps, shadows


def _mag(head: Any) -> _Step | str:
    """The head hook's decision and the tail's step advance, on copies of the state's values."""
    cfg, mgr = head.config, head.state_manager
    if cfg.calibrate:
        return "MagCache: calibration reads tensor values (eager)"
    if mgr._context is None:
        return "MagCache: no cache context yet (its hooks set one)"
    st = mgr.get_state()
    ratio, n, err = _copy(st.accumulated_ratio), st.accumulated_steps, _copy(st.accumulated_err)
    cur, compute = st.step_index, True
    if cur >= int(cfg.retention_ratio * cfg.num_inference_steps + 0.5):
        ratio *= 1.0 if cur >= len(cfg.mag_ratios) else cfg.mag_ratios[cur]
        n += 1
        err += abs(1.0 - ratio)
        if st.previous_residual is not None and err <= cfg.threshold and n <= cfg.max_skip_steps:
            compute = False
        else:
            ratio, n, err = 1.0, 0, 0.0
    post = {"should_compute": compute, "accumulated_ratio": ratio, "accumulated_steps": n,
            "accumulated_err": err, "step_index": cur + 1}
    reset = cur + 1 >= cfg.num_inference_steps
    if reset:  # the tail ends the run (_advance_step)
        post.update(step_index=0, accumulated_ratio=1.0, accumulated_steps=0, accumulated_err=0.0,
                    previous_residual=None, calibration_ratios=[])
    return _Step(head, st, mgr._context.name, "previous_residual", compute, post, reset)


def begin(config: Any, hook_list: list[Any]) -> "Steps | str | None":
    """This call's steps, decided without touching the states' counters; a refusal (eager); None: none of its hooks."""
    if kind(config) == PAB:
        pab = [h for h in hook_list if _diffusers(h, _HOOKS) == PAB]
        return Steps(*_pab(pab), PAB) if pab else None
    heads = [h for h in hook_list if type(h).__name__ == "MagCacheHeadHook"]
    step = _mag(heads[0]) if heads else None
    return Steps([step], [], MAG) if isinstance(step, _Step) else step


class CallSteps:
    """One call's steps as the runner uses them: ``key`` (its part of the graph key), ``first`` (the refusal while
    not :attr:`capturable`), entered around the call, :meth:`wrap` (the forward for a warm-up and a capture),
    :meth:`apply` after it, :meth:`abandon` when it raised. Its steps have ``hook``, ``compute``, ``kept``."""

    __slots__ = ()
    HOOKS = "step_hooks"  # the runner's snapshot's list of the hooks these steps are decided for

    @property
    def capturable(self) -> bool:
        """Every step has its kept tensors (a first compute step makes them) and none was reallocated meanwhile."""
        return all(s.kept is not None and not s.changed for s in self.steps)

    @property
    def writes(self) -> bool:
        return any(s.compute for s in self.steps)

    def tensors(self) -> list[torch.Tensor]:
        """What a graph of this call reads and writes outside its pool: kept alive with the graph."""
        return [t for s in self.steps if s.kept is not None for t in s.kept.tensors()]

    def decided_for(self, scan: Any) -> bool:  # the hooks of the runner's current snapshot
        return {id(s.hook) for s in self.steps} <= set(map(id, getattr(scan, self.HOOKS)))

    def __enter__(self) -> "CallSteps":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:  # the call raised
            self.abandon()

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        return inner

    def abandon(self) -> None:  # a raising call ran diffusers' hooks: they left the states as they do eager
        pass


class Steps(CallSteps):  # one call's PAB or MagCache decisions
    __slots__ = ("steps", "shadows", "key", "first")

    def __init__(self, steps: list[_Step], shadows: list[tuple[Any, _Decided]], name: str) -> None:
        self.steps, self.shadows = steps, shadows
        self.key = (name, tuple(s.key() for s in steps))
        self.first = f"{name} cache: first computed step of its state"

    def wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``inner`` for a warm-up (first call) and a capture (second: from the pre-call state, put back after)."""
        runs = itertools.count()

        def run(*args: Any, **kwargs: Any) -> Any:
            capturing = next(runs) == 1
            for s in self.steps:
                if capturing:
                    s.after = s.snapshot()
                    s.restore(s.before)
                else:
                    s.before = s.snapshot()
            saved = [(h, h.current_timestep_callback) for h, _ in self.shadows]
            for h, d in self.shadows:
                h.current_timestep_callback = lambda d=d: d
            try:
                out = inner(*args, **kwargs)
                for s in self.steps:
                    s.keep(capturing)
            finally:
                for h, cb in saved:
                    h.current_timestep_callback = cb
                if capturing:
                    for s in self.steps:
                        s.restore(s.after)
            return out

        return run

    def apply(self, replayed: bool) -> None:  # after the call: a replay ran no hook
        if replayed:
            for s in self.steps:
                s.apply()
