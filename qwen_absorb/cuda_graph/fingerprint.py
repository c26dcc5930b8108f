"""What the graphs of a runner baked in, and whether it changed: the per-call fingerprint and its verdict.

A :class:`Scan` walks the transformer once and records what a replay depends on: every parameter and buffer
(``data_ptr`` and ``_version``), tensors and qwen_absorb state held as module attributes, the instance
attributes where forwards, hooks, processors, ModelOpt and PEFT switches live (by identity), the lengths of
module dicts and torch hook dicts, and the state of PEFT LoRA layers (merged adapters, scaling, enabled,
active). ``changed()`` compares all of it per call with C-level ``map``s over lists prepared here (a Python
loop per tensor would cost more than the launches a replay saves on small calls). The same walk gives the
verdict: a refusal (hooks, calibration, a model off the graph device) or the device graphs run on.

torch's global registration hooks (:func:`watch`) see modules, parameters and buffers assigned anywhere; an
assignment inside a watched transformer drops its runner's snapshot at once.

Reads hook chains only through :mod:`qwen_absorb.hooks`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from .. import hooks
from . import settings

# Instance attributes whose identity decides what a call runs: hook chains and compiled wrappers (from
# qwen_absorb.hooks), processors, ModelOpt quantizer switches, PEFT switches. Compared wherever present.
WATCH_KEYS = (
    *hooks.WRAPPER_ATTRS, "processor",
    "_disabled", "_if_quant", "_if_calib", "_fake_quant", "_dequantize", "_num_bits",
    "_disable_adapters", "_active_adapter",
)

_version_of = attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr
# One C++ loop over (tensor, data_ptr) pairs (CUDA builds; what Inductor's CUDA-graph trees use); a map otherwise.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
_merged = attrgetter("merged_adapters")
_scaling = attrgetter("scaling")
_disabled = attrgetter("_disable_adapters")
_active = attrgetter("_active_adapter")


# ---------------------------------------------------------------------------------------------- registration


_LIVE: weakref.WeakSet = weakref.WeakSet()
_hooks_lock = threading.Lock()
_hooks_registered = False


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: a module, parameter or buffer was (re)assigned somewhere.

    Every watched runner is told (``module_assigned``); one whose transformer holds ``module`` drops its
    snapshot at once (so it holds no replaced weights) and its graphs at the next call. Never raises,
    returns None (keeps ``value``).
    """
    try:
        mid = id(module)
        for runner in list(_LIVE):
            runner.module_assigned(mid, f"{type(module).__name__}.{name} assigned")
    except Exception:  # noqa: BLE001 - a registration must never fail because of us
        pass


def watch(runner: Any) -> None:
    """Tell ``runner.module_assigned(module_id, what)`` about every module / parameter / buffer assignment."""
    global _hooks_registered
    with _hooks_lock:
        if not _hooks_registered:
            _torch_module.register_module_module_registration_hook(_on_registration)
            _torch_module.register_module_parameter_registration_hook(_on_registration)
            _torch_module.register_module_buffer_registration_hook(_on_registration)
            _hooks_registered = True
    _LIVE.add(runner)


def unwatch(runner: Any) -> None:
    _LIVE.discard(runner)


# ---------------------------------------------------------------------------------------------- refusals


def registry_reason(module: nn.Module) -> tuple[str, str] | None:
    """The refusal for a diffusers hook on ``module``: (category, detail), or None without one."""
    reg = hooks.registry_hooks(module)
    if not reg:
        return None
    name, hook = next(iter(reg.items()))
    return hooks.hook_category(name, hook), f"diffusers hook {name!r} ({type(hook).__name__})"


def root_reason(t: nn.Module) -> tuple[str, str] | None:
    """O(1) refusals read on the transformer itself (offload / cache hooks sit there or announce themselves)."""
    if hooks.offload_hooked(t):
        return "offloading hook", "offload hook on the transformer"
    r = registry_reason(t)
    if r is not None:
        return r
    if getattr(t, "_cache_config", None) is not None:
        return "cache hook active (enable_cache)", f"_cache_config {type(t._cache_config).__name__}"
    return None


# ---------------------------------------------------------------------------------------------- the snapshot


def _is_lora_layer(d: dict) -> bool:
    return isinstance(d.get("merged_adapters"), list) and isinstance(d.get("scaling"), dict)


def lora_state(mods: list[nn.Module]) -> list:
    """What of PEFT tuner layers changes what runs without a registration: merged adapters (``fuse_lora``
    writes ``base_layer.weight.data`` in place, which no ``_version`` sees), scaling (``set_adapters``, a
    deleted adapter), ``disable_adapters`` and the active adapters. The live objects, read with C-level maps:
    compared against :func:`lora_snapshot` element by element (list and dict equality, no copies per call)."""
    return [list(map(_merged, mods)), list(map(_scaling, mods)), list(map(_disabled, mods)), list(map(_active, mods))]


def lora_snapshot(mods: list[nn.Module]) -> list:
    """Copies of :func:`lora_state` (the lists and dicts are mutated in place by PEFT)."""
    merged, scaling, disabled, active = lora_state(mods)
    return [list(map(list, merged)), list(map(dict, scaling)), disabled,
            [list(a) if isinstance(a, list) else a for a in active]]


class Scan:
    """What the graphs of a runner baked in, and the verdict (refusal or not) for that state.

    ``host``: tensors allowed to live off the graph device (e.g. original weights offloaded to host memory
    while FP8 copies run on the GPU): left out of the device verdict, fingerprinted like every other tensor.
    """

    __slots__ = (
        "module_ids", "modules", "len_dicts", "lens", "hook_dicts", "hook_lens", "handle_id", "watch_dicts",
        "watch_keys", "watch_objs", "watch_ids", "tensors", "names", "ptrs", "indices", "vtensors", "vnames",
        "vers", "peft", "peft_names", "peft_state", "global_hooks", "refusal", "detail", "device", "sticky",
        "host_count",
    )

    def __init__(self, t: nn.Module, host: Iterable[torch.Tensor] = ()) -> None:
        self.refusal: str | None = None
        self.detail = ""
        self.sticky = False  # a refusal that weight moves cannot lift (hooks, calibration), see the runner
        self.modules: list[nn.Module] = []
        self.len_dicts: list[dict] = []
        self.hook_dicts: list[dict] = []
        self.watch_dicts: list[dict] = []
        self.watch_keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self.vtensors: list[torch.Tensor] = []
        self.vnames: list[str] = []
        self.peft: list[nn.Module] = []
        self.peft_names: list[str] = []
        host = [x for x in host if isinstance(x, torch.Tensor)]
        host_ids = set(map(id, host))
        self.host_count = 0
        seen: set[int] = set()
        devices: set[torch.device] = set()

        def refuse(reason: str, detail: str, sticky: bool = True) -> None:
            if self.refusal is None:
                self.refusal, self.detail, self.sticky = reason, detail, sticky

        def add_tensor(x: torch.Tensor, name: str) -> None:
            if id(x) in seen:
                return
            seen.add(id(x))
            try:
                _data_ptr(x)
            except Exception:  # noqa: BLE001 - tensor subclasses without storage (e.g. DTensor): nothing to compare
                return
            self.tensors.append(x)
            self.names.append(name)
            try:
                _version_of(x)
            except Exception:  # noqa: BLE001 - inference tensors have no version counter
                return
            self.vtensors.append(x)
            self.vnames.append(name)

        for name, m in t.named_modules():
            d = m.__dict__
            root = m is t
            label = name or "<transformer>"
            self.modules.append(m)
            self.len_dicts.append(d)  # a new instance attribute: a hook's forward, _hf_hook, a compiled call, ...
            if not root:  # the transformer's own hooks run outside the forward we wrap
                for hd in hooks.torch_hook_dicts(m):
                    self.hook_dicts.append(hd)
                    if hd:
                        refuse("forward hook on a submodule", f"forward hook or pre-hook on {label}")
            for k in WATCH_KEYS:
                if k in d and not (root and k == "forward"):
                    self.watch_dicts.append(d)
                    self.watch_keys.append(k)
            for k, v in d.items():
                if k.startswith("_qwen_absorb") or (isinstance(v, torch.Tensor) and k not in WATCH_KEYS):
                    self.watch_dicts.append(d)
                    self.watch_keys.append(k)
                    if isinstance(v, torch.Tensor):
                        add_tensor(v, f"{label}.{k}")
            if not root:
                r = registry_reason(m)
                if r is not None:
                    refuse(r[0], f"{r[1]} on {label}")
            if hooks.offload_hooked(m):
                refuse("offloading hook", f"offload hook on {label}")
            proc = d.get("processor")
            pd = getattr(proc, "__dict__", None) if proc is not None and not isinstance(proc, nn.Module) else None
            if isinstance(pd, dict):
                self.len_dicts.append(pd)
                for k in pd:
                    self.watch_dicts.append(pd)
                    self.watch_keys.append(k)
            if d.get("_if_calib") is True and d.get("_disabled") is False:
                refuse("ModelOpt calibration running", f"quantizer {label} is calibrating")
            if _is_lora_layer(d):
                self.peft.append(m)
                self.peft_names.append(label)
            for group in ("_parameters", "_buffers"):
                for k, x in (d.get(group) or {}).items():
                    if x is None:
                        continue
                    add_tensor(x, f"{label}.{k}")
                    if id(x) in host_ids:
                        self.host_count += 1
                    else:
                        devices.add(x.device)
        for i, x in enumerate(host):  # tensors handed in that the modules do not register: fingerprinted too
            add_tensor(x, f"host tensor {i}")
        if hooks.global_hook_count():
            refuse("global module forward hook", "torch.nn.modules.module global forward (pre-)hooks are registered")
        self.device: torch.device | None = None
        types = settings.GRAPH_DEVICE_TYPES
        if any(dv.type == "meta" for dv in devices):
            refuse("offloading hook", "parameters on the meta device (offloaded or not materialised)", False)
        elif any(dv.type not in types for dv in devices):
            refuse("model not on CUDA", "parameters on " + ", ".join(sorted({str(dv) for dv in devices})), False)
        elif len(devices) > 1:
            refuse("model on several devices", ", ".join(sorted(str(dv) for dv in devices)), False)
        elif devices:
            self.device = next(iter(devices))
        self.module_ids = frozenset(map(id, self.modules))
        self.take()

    def take(self) -> None:
        """Record the values ``changed()`` compares against (strong references keep ids unique)."""
        self.lens = list(map(len, self.len_dicts))
        self.hook_lens = list(map(len, self.hook_dicts))
        self.handle_id = RemovableHandle.next_id
        self.watch_objs = list(map(dict.get, self.watch_dicts, self.watch_keys))
        self.watch_ids = list(map(id, self.watch_objs))
        self.ptrs = list(map(_data_ptr, self.tensors))
        self.indices = list(range(len(self.tensors)))
        self.vers = list(map(_version_of, self.vtensors))
        self.peft_state = lora_snapshot(self.peft)
        self.global_hooks = hooks.global_hook_count()

    def changed(self) -> str | None:
        """None when nothing a graph depends on changed since the snapshot, else what changed."""
        if list(map(len, self.len_dicts)) != self.lens:
            return "module structure or attributes changed"
        # Every torch hook registration takes an id from RemovableHandle.next_id: the hook dicts are only
        # counted when it moved (or when refusing, so that removing the hook is seen too).
        if RemovableHandle.next_id != self.handle_id or self.refusal is not None:
            if list(map(len, self.hook_dicts)) != self.hook_lens or hooks.global_hook_count() != self.global_hooks:
                return "forward hooks added or removed"
            self.handle_id = RemovableHandle.next_id
        if list(map(id, map(dict.get, self.watch_dicts, self.watch_keys))) != self.watch_ids:
            return "forward, hook, processor, quantizer or adapter switch replaced"
        if _ptrs_equal is not None:
            if not _ptrs_equal(self.tensors, self.ptrs, self.indices):
                return "weights moved or replaced"
        elif list(map(_data_ptr, self.tensors)) != self.ptrs:
            return "weights moved or replaced"
        if list(map(_version_of, self.vtensors)) != self.vers:
            return "weights modified in place"
        if self.peft and lora_state(self.peft) != self.peft_state:
            return "LoRA adapter state changed"
        return None

    def which(self) -> str:
        """The first changed item, by name (slow; for the log only)."""
        for x, n, p in zip(self.tensors, self.names, self.ptrs):
            if _data_ptr(x) != p:
                return n
        for x, n, v in zip(self.vtensors, self.vnames, self.vers):
            if _version_of(x) != v:
                return n
        for d, k, i in zip(self.watch_dicts, self.watch_keys, self.watch_ids):
            if id(d.get(k)) != i:
                return f"attribute {k!r} of a {type(d.get(k)).__name__ if k in d else 'module (removed)'}"
        if self.peft:
            now = lora_state(self.peft)
            for j, n in enumerate(self.peft_names):
                if any(a[j] != b[j] for a, b in zip(now, self.peft_state)):
                    return n
        return ""
