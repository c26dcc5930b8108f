"""A pipeline call's walks over every module, each done once and without the per-module attribute misses.

A diffusers pipeline call walks every module of every component three to five times (``_execution_device``,
``device``, ``maybe_free_model_hooks``), each visit a ``hasattr(module, "_diffusers_hook")`` that raises and catches
an ``AttributeError`` (through ModelOpt's Python ``__getattr__`` for quantized modules). :func:`patch` gives the
pipeline a subclass of its class (same name and module) whose two methods give the same answers with the same side
effects, walking each component once and reading hook attributes from ``module.__dict__``. The mirrored diffusers
code is pinned by a hash of its source: where it changed, the pipeline keeps its class and the report says why."""

import functools
import hashlib
import inspect
import itertools
import logging
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import quant
from .report import PartReport

log = logging.getLogger("qwen_absorb")

_MISSING = object()
# source_sha256() as diffusers 0.42.1 has it
MIRRORED_SHA256 = "3e75ec209c2ead6f"
_DICT, _ASK, _COMPILED = 1, 2, 3  # _kind's answers, all true: ``kinds.get(cls) or _kind(cls, kinds)``


def source_hash(functions: Iterable[Any]) -> str | None:
    """sha256 (16 hex digits) of the dedented sources of ``functions`` (None: one is missing or unreadable)."""
    try:
        text = "".join(textwrap.dedent(inspect.getsource(f)) for f in functions)
    except (AttributeError, OSError, TypeError):
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def source_sha256() -> str:
    """The :func:`source_hash` of this diffusers' functions that :class:`FastWalks` mirrors ("": unreadable)."""
    try:
        from diffusers import DiffusionPipeline  # noqa: PLC0415
        from diffusers.hooks import HookRegistry, group_offloading  # noqa: PLC0415
        from diffusers.models import cache_utils, modeling_utils  # noqa: PLC0415

        return source_hash([DiffusionPipeline._execution_device.fget, DiffusionPipeline.device.fget,
                            DiffusionPipeline.maybe_free_model_hooks, cache_utils.CacheMixin._reset_stateful_cache,
                            HookRegistry.reset_stateful_hooks, HookRegistry.check_if_exists_or_initialize,
                            group_offloading._get_top_level_group_offload_hook,
                            group_offloading._get_group_onload_device, modeling_utils.get_parameter_device]) or ""
    except (ImportError, AttributeError):
        return ""


def _kind(cls: type, kinds: dict[type, int]) -> int:
    """How a module of class ``cls`` is asked for a hook attribute: its ``__dict__``, ``getattr`` (a class with its
    own ``__getattr__``), or through ``torch.compile``'s wrapper (diffusers' ``is_compiled_module``)."""
    got = kinds.get(cls)
    if got is None:
        wrapper = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "OptimizedModule", None)
        got = kinds[cls] = _COMPILED if wrapper is not None and issubclass(cls, wrapper) else \
            _DICT if quant.hook_attrs_in_dict(cls) else _ASK
    return got


def _own(module: nn.Module, name: str) -> Any:
    """``getattr(module, name, _MISSING)`` without the exception a miss costs."""
    return module.__dict__.get(name, _MISSING) if _kind(type(module), {}) == _DICT else getattr(module, name, _MISSING)


def _walk(root: nn.Module, name: str, skip_root: bool = False, unwrap: bool = False) -> list[tuple[nn.Module, Any]]:
    """``(module, getattr(module, name))`` for each module of ``root`` (pre-order, once each, as ``modules()``)
    that has ``name``; ``unwrap``: looked at through ``torch.compile``'s wrapper (diffusers' ``unwrap_module``)."""
    out, seen, stack, kinds = [], set(), [root], {}
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        d = m.__dict__
        if kids := d["_modules"]:
            stack.extend(reversed([c for c in kids.values() if c is not None]))
        if skip_root and m is root:
            continue
        kind = kinds.get(type(m)) or _kind(type(m), kinds)
        if unwrap and kind == _COMPILED:
            m = m._orig_mod
            d, kind = m.__dict__, _kind(type(m), kinds)
        value = d.get(name, _MISSING) if kind == _DICT else getattr(m, name, _MISSING)
        if value is not _MISSING:
            out.append((m, value))
    return out


def _group_offload_hook(module: nn.Module) -> Any:
    """diffusers' ``_get_top_level_group_offload_hook``."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING  # noqa: PLC0415

    return next((hook for _, reg in _walk(module, "_diffusers_hook")
                 if (hook := reg.get_hook(_GROUP_OFFLOADING)) is not None), None)


def _device(module: nn.Module, no_group_hooks: set[int]) -> torch.device:
    """``module.device``; for a diffusers model already walked and found without group offloading, its first
    parameter's or buffer's device, as ``get_parameter_device`` answers after that walk."""
    from diffusers.models.modeling_utils import ModelMixin  # noqa: PLC0415

    if id(module) in no_group_hooks and inspect.getattr_static(type(module), "device", None) is \
            ModelMixin.__dict__["device"]:
        if (first := next(itertools.chain(module.parameters(), module.buffers()), None)) is not None:
            return first.device
    return module.device


def execution_device(pipe: Any) -> torch.device:
    """``DiffusionPipeline._execution_device`` with one walk of each component."""
    comps = pipe.components
    clean: set[int] = set()
    for model in comps.values():
        if isinstance(model, nn.Module):
            if (hook := _group_offload_hook(model)) is not None:
                return hook.config.onload_device
            clean.add(id(model))
    for name, model in comps.items():
        if not isinstance(model, nn.Module) or name in pipe._exclude_from_cpu_offload:
            continue
        if _own(model, "_hf_hook") is _MISSING:
            return _pipe_device(pipe, clean)
        for module in model.modules():  # accelerate's hooks: rare, walked as diffusers walks
            hook = _own(module, "_hf_hook")
            if hook is not _MISSING and getattr(hook, "execution_device", None) is not None:
                return torch.device(hook.execution_device)
    return _pipe_device(pipe, clean)


def _pipe_device(pipe: Any, clean: set[int]) -> torch.device:
    """``DiffusionPipeline.device``, each component's device asked once."""
    names, _ = pipe._get_signature_keys(pipe)
    modules = [m for m in (getattr(pipe, n, None) for n in names) if isinstance(m, nn.Module)]
    for module in modules:
        if (dev := _device(module, clean)).type not in ("cpu", "meta"):
            return dev
    return _device(modules[0], clean) if modules else torch.device("cpu")


def reset_stateful_hooks(component: nn.Module) -> None:
    """``CacheMixin._reset_stateful_cache()``: the stateful diffusers hooks of the component and its modules reset."""
    from diffusers.hooks import HookRegistry  # noqa: PLC0415
    from diffusers.utils.torch_utils import unwrap_module  # noqa: PLC0415

    root = HookRegistry.check_if_exists_or_initialize(component)
    root.reset_stateful_hooks(recurse=False)
    for _, reg in _walk(unwrap_module(root._module_ref), "_diffusers_hook", skip_root=True, unwrap=True):
        reg.reset_stateful_hooks(recurse=False)


class FastWalks:
    """Mixed in before a pipeline's class by :func:`patch`."""

    _execution_device = property(execution_device)

    def maybe_free_model_hooks(self) -> None:
        from diffusers.models.cache_utils import CacheMixin  # noqa: PLC0415
        from diffusers.utils.torch_utils import get_device  # noqa: PLC0415

        ours = CacheMixin.__dict__["_reset_stateful_cache"]
        for component in self.components.values():
            if inspect.getattr_static(type(component), "_reset_stateful_cache", None) is ours:
                reset_stateful_hooks(component)
            elif hasattr(component, "_reset_stateful_cache"):
                component._reset_stateful_cache()
        if hasattr(self, "_all_hooks") and len(self._all_hooks) > 0:
            self.enable_model_cpu_offload(device=getattr(self, "_offload_device", get_device()))

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Copies and pickles are of the original class (one made at run time cannot be pickled by name), made by
        :func:`_remade` (pickle checks ``copyreg.__newobj__``'s class against ``type(self)``)."""
        rv = list(super().__reduce_ex__(protocol))
        if len(rv) > 1 and isinstance(rv[1], tuple) and rv[1] and rv[1][0] is type(self):
            rv[0], rv[1] = _remade, (original_class(self), *rv[1][1:])
        return tuple(rv)


def _remade(cls: type, *args: Any) -> Any:
    """A copy's or unpickled pipeline's new object, of diffusers' class (its state is set after)."""
    return cls.__new__(cls, *args)


@dataclass
class WalksReport(PartReport):
    """The ``pipeline`` section of a patch report."""

    on: bool
    reason: str = ""

    def line(self) -> str:
        return ("pipeline call: diffusers' module walks done once each (_execution_device, maybe_free_model_hooks)"
                if self.on else f"pipeline call: diffusers' module walks ({self.reason})")


def original_class(pipe: Any) -> type:
    cls = type(pipe)
    return cls.__bases__[1] if issubclass(cls, FastWalks) else cls


def refusal(pipe: Any) -> str:
    """Why ``pipe`` keeps diffusers' walks ("" where it can have the mirrored ones)."""
    try:
        from diffusers import DiffusionPipeline  # noqa: PLC0415
    except ImportError:
        return "diffusers is not importable"
    cls = original_class(pipe)
    if not isinstance(pipe, DiffusionPipeline):
        return f"{cls.__name__} is not a DiffusionPipeline"
    for name in ("_execution_device", "device", "maybe_free_model_hooks", "components", "__reduce_ex__"):
        if inspect.getattr_static(cls, name, None) is not inspect.getattr_static(DiffusionPipeline, name, None):
            return f"{cls.__name__} defines its own {name}"
    if source_sha256() != MIRRORED_SHA256:
        return "this diffusers' walks differ from the ones qwen_absorb mirrors (diffusers 0.42.1)"
    return ""


def patch(pipe: Any) -> WalksReport:
    if why := refusal(pipe):
        log.info("pipeline call: keeping diffusers' module walks: %s", why)
        return WalksReport(False, why)
    if not isinstance(pipe, FastWalks):
        cls = type(pipe)
        pipe.__class__ = type(cls.__name__, (FastWalks, cls), {"__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
    return WalksReport(True)


def unpatch(pipe: Any) -> None:
    if isinstance(pipe, FastWalks):
        pipe.__class__ = original_class(pipe)
