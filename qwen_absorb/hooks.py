"""The one reader of forward slots and hook chains: torch's, diffusers' ``HookRegistry`` and accelerate's.

diffusers and accelerate hooks wrap ``module.forward`` by keeping the then-current bound forward and assigning an
instance attribute: patching must put its forward where the *original* one is kept."""

import functools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from traceback import walk_stack
from typing import Any

import torch
from torch import nn

Slot = tuple[str, Callable[[], Any], Callable[[Any], None]]
# Instance attributes where a wrapper of a module's forward lives (torch.compile's ``module.compile()``,
# diffusers' registry, accelerate's hook): their identity decides what calling the module runs.
WRAPPER_ATTRS = ("forward", "_old_forward", "_compiled_call_impl", "_diffusers_hook", "_hf_hook")
HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")  # torch's per-module ones (the per-call checks spell them out)
_TRANSPARENT = ("offloading hook", "layerwise casting hook")  # diffusers' that move or cast weights, reading no values
# torch's functions that walk the global registration hook dicts (Module.__setattr__ walks the module ones inline)
_REGISTERING = frozenset(f.__code__ for f in (nn.Module.__setattr__, nn.Module.register_module, nn.Module.add_module,
                                              nn.Module.register_parameter, nn.Module.register_buffer))


def forward_slots(module: nn.Module) -> Iterator[Slot]:
    """Every place a forward of ``module`` may be held, outermost first, as (description, get, set)."""
    d = module.__dict__
    yield "forward", (lambda: d.get("forward")), (lambda f: object.__setattr__(module, "forward", f))
    reg = d.get("_diffusers_hook")
    order = getattr(reg, "_hook_order", None) or []
    for i, ref in enumerate(getattr(reg, "_fn_refs", None) or []):
        name = order[i] if i < len(order) else i
        for attr in ("original_forward", "forward"):
            yield (f"diffusers hook {name!r} {attr}",
                   (lambda r=ref, a=attr: getattr(r, a, None)), (lambda f, r=ref, a=attr: setattr(r, a, f)))
    if "_old_forward" in d:
        yield ("accelerate _old_forward", (lambda: d.get("_old_forward")),
               (lambda f: object.__setattr__(module, "_old_forward", f)))


def put_back(module: nn.Module, me: Any, inner: Any, prev_present: bool) -> bool:
    """Put ``inner`` where ``module`` holds ``me`` (``forward`` deleted where there was none); False: held nowhere."""
    for where, get, set_ in forward_slots(module):
        if get() is me:
            if where == "forward" and not prev_present:
                del module.__dict__["forward"]
            else:
                set_(inner)
            return True
    return False


def registry_hooks(module: nn.Module) -> dict[str, Any]:
    """diffusers' hooks on ``module`` by name (empty when it has no ``HookRegistry``)."""
    hooks = getattr(module.__dict__.get("_diffusers_hook"), "hooks", None)
    return dict(hooks) if hooks else {}


def sole_registry_hook(module: nn.Module, name: str) -> Any | None:
    """The diffusers hook registered on ``module`` under ``name`` when it is the module's only hook of any kind and
    nothing wraps the registry's forward: then a patched block may run that hook's logic around its own computation."""
    d = module.__dict__
    named, fwd = getattr(d.get("_diffusers_hook"), "hooks", None), d.get("forward")
    # no torch or accelerate hook; the instance forward diffusers' HookRegistry installs: a partial of its new_forward
    if d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_hf_hook") is not None or not named \
            or len(named) != 1 or not isinstance(fwd, functools.partial) \
            or "create_new_forward" not in getattr(fwd.func, "__qualname__", ""):
        return None
    return named.get(name)


def torch_hook_dicts(module: nn.Module) -> list[dict]:
    """The dicts of ``module``'s forward hooks and pre-hooks (their lengths: a cheap per-call check)."""
    return [hd for n in HOOK_DICTS if isinstance(hd := module.__dict__.get(n), dict)]


def global_hook_count() -> int:
    """Global module forward (pre-)hooks registered (any: each would run inside a module call skipped)."""
    return len(nn.modules.module._global_forward_hooks) + len(nn.modules.module._global_forward_pre_hooks)


def has_hooks(module: nn.Module) -> bool:
    """Whether calling ``module`` runs a torch, diffusers registry or accelerate hook around its forward."""
    d = module.__dict__
    return bool(d.get("_forward_hooks") or d.get("_forward_pre_hooks") or registry_hooks(module)
                or d.get("_hf_hook") is not None)


def ours(fn: Any) -> bool:
    """Whether a forward slot holds one of qwen_absorb's own forwards (classes saying ``__qwen_absorb__ = True``)."""
    return getattr(type(fn), "__qwen_absorb__", False) is True


def hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs anything besides its class forward (or ours)."""
    d = module.__dict__
    return has_hooks(module) or ("forward" in d and not ours(d["forward"]))


def user_hooked(d: dict, allowed_pre: int = 0, allowed_post: int = 0) -> bool:
    """Whether a module (its ``__dict__``) has a hook that may read or edit its inputs or outputs: more torch
    (pre-)hooks than ``allowed`` (TP style hooks), a diffusers hook other than offloading / casting, or an instance
    ``forward`` neither ours nor explained by a weight-moving hook."""
    if len(d.get("_forward_pre_hooks") or ()) > allowed_pre or len(d.get("_forward_hooks") or ()) > allowed_post:
        return True
    if "forward" not in d or ours(d["forward"]):
        return False
    if (reg := d.get("_diffusers_hook")) is not None:
        return any(hook_category(n, h) not in _TRANSPARENT for n, h in (getattr(reg, "hooks", None) or {}).items())
    return d.get("_hf_hook") is None


def offload_hooked(module: nn.Module) -> bool:
    """An offload hook (diffusers group offloading, accelerate) onloads the parameters only inside the forward."""
    return module.__dict__.get("_hf_hook") is not None or any("offload" in str(n) for n in registry_hooks(module))


def weight_moving(module: nn.Module) -> str | None:
    """The category of a hook on ``module`` that moves or casts its weights only around its own call, or None."""
    if module.__dict__.get("_hf_hook") is not None:
        return "accelerate hook"
    return next((c for n, h in registry_hooks(module).items() if (c := hook_category(n, h)) in _TRANSPARENT), None)


def hook_category(name: str, hook: Any) -> str:
    """A readable category for a diffusers ``ModelHook`` (names differ between diffusers versions)."""
    text = f"{name} {type(hook).__module__} {type(hook).__name__}".lower()
    if "offload" in text:
        return "offloading hook"
    if "cache" in text or "pyramid" in text or getattr(hook, "_is_stateful", False):
        return "cache hook active (enable_cache)"
    if "casting" in text:
        return "layerwise casting hook"
    if "parallel" in text:
        return "parallelism hook (context/tensor parallel)"
    return "diffusers hook active"


def execution_device(transformer: nn.Module, blocks: list[nn.Module]) -> torch.device | None:
    """The device an offloading hook runs the model on, or None."""
    dev = getattr(transformer.__dict__.get("_hf_hook"), "execution_device", None)  # accelerate / model CPU offload
    if dev is not None:
        return as_device(dev)
    for m in (transformer, *blocks[:1]):
        dev = getattr(getattr(registry_hooks(m).get("group_offloading"), "group", None), "onload_device", None)
        if dev is not None:
            return torch.device(dev)
    return None


def as_device(spec: Any) -> torch.device:
    """``spec`` as a ``torch.device``; an int is a CUDA index (accelerate's ``execution_device``)."""
    return torch.device("cuda", spec) if isinstance(spec, int) else torch.device(spec)


def resolve_transformer(target: Any, classes: tuple[type, ...]) -> nn.Module:
    """``target`` or its ``.transformer``, whichever is one of ``classes`` (``torch.compile`` looked through)."""
    target = getattr(target, "_orig_mod", target)
    if isinstance(target, classes):
        return target
    inner = getattr(target, "transformer", None)
    inner = getattr(inner, "_orig_mod", inner)
    if isinstance(inner, classes):
        return inner
    names = " or ".join(c.__name__ for c in classes)
    raise TypeError(f"qwen_absorb needs a {names} or a pipeline whose .transformer is one; got {type(target).__name__}"
                    + (f" with .transformer {type(inner).__name__}" if inner is not None else ""))


class HeldGlobalHooks:
    """Process-wide torch hooks (``register`` registers them, returns their handles) that exist only while at least
    one holder lives (``unpatch`` leaves torch's global hook dicts as it found them)."""

    def __init__(self, register: Callable[[], list[Any]]) -> None:
        self._register, self._handles, self._holders = register, [], set()  # handles; holders' ids
        self._lock = threading.RLock()  # a holder's finalizer may run inside a locked section (garbage collection)

    def hold(self, holder: Any) -> None:
        with self._lock:
            if id(holder) in self._holders:
                return
            if not self._handles:  # (hooks whose removal waits are taken again)
                self._handles = self._register()
            self._holders.add(id(holder))
        weakref.finalize(holder, self._drop, id(holder))

    def release(self, holder: Any) -> None:
        self._drop(id(holder))

    def _drop(self, key: int | None = None) -> None:
        with self._lock:
            self._holders.discard(key)
            if self._holders or not self._handles:
                return
            if any(f.f_code in _REGISTERING for top in sys._current_frames().values() for f, _ in walk_stack(top)):
                # a thread walks torch's registration hooks (a holder collected inside ``module.child = ...``, or
                # another thread's): removing one breaks that walk ("OrderedDict mutated during iteration"). Again
                # from the next garbage collection, which frees ``cycle`` (or from the next hold or release)
                cycle = lambda: cycle  # noqa: E731  (garbage in a reference cycle of its own)
                weakref.finalize(cycle, self._drop).atexit = False
                return
            handles, self._handles = self._handles, []
            for h in handles:
                h.remove()
