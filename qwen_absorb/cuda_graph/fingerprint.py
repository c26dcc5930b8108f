"""What the graphs of a runner baked in, and whether it changed: the per-call fingerprint and its verdict.
A :class:`Scan` walks the transformer once and records what a replay depends on: parameters and buffers
(``data_ptr``, ``_version``), tensor attributes, the attributes holding forwards, hooks, processors, ModelOpt and
PEFT switches (plain values by value, the rest by identity), dict lengths, and PEFT LoRA state. It is compared per
call with C-level ``map``s: a Python loop per item would cost more than a replay saves (a 60-block FP8 model has
~20,000 quantizer switches). torch's registration hooks (:func:`watch`) drop a snapshot on an assignment inside it."""

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable
from operator import attrgetter, call, itemgetter
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module
from torch.utils.hooks import RemovableHandle

from .. import hooks, step_caches, taylorseer
from ..plan import PLAN_ATTR, derived_only_sources
from . import settings
from .signature import patch_tuning

# Instance attributes that decide what a call runs: hook chains and compiled wrappers, processors, ModelOpt and
# PEFT switches, and a norm's eps (baked into a graph's launches; ``norm.eps = ...`` moves no tensor).
WATCH_KEYS = (*hooks.WRAPPER_ATTRS, "processor", "_disabled", "_if_quant", "_if_calib", "_fake_quant", "_dequantize",
              "_num_bits", "_disable_adapters", "_active_adapter", "eps", "approximate", "scale_rope")

SWITCHED = "forward, hook, processor, quantizer or adapter switch replaced"

_version_of = attrgetter("_version")
_generation = attrgetter("generation")
_data_ptr = torch.Tensor.data_ptr
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # one C++ loop (CUDA builds)
# PEFT's per-layer switches, read in one C call and compared by value (left out of the attribute comparison)
_PEFT_KEYS = ("merged_adapters", "scaling", "_disable_adapters", "_active_adapter")
_peft_get = itemgetter(*_PEFT_KEYS)
_PLAIN = (bool, int, float, str, type(None))


def _same_ptrs(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:
    if _ptrs_equal is not None:
        return _ptrs_equal(tensors, ptrs, indices)
    return list(map(_data_ptr, tensors)) == ptrs


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _on_registration(module: nn.Module, name: str, value: Any) -> None:  # every watched runner is told
    with contextlib.suppress(Exception):  # a registration must never fail because of us
        for runner in list(_LIVE):
            runner.module_assigned(id(module), f"{type(module).__name__}.{name} assigned")


# registered while a runner is watched: removed with the last one (unpatch, or the model collected)
_REGISTRATIONS = hooks.HeldGlobalHooks(lambda: [
    _torch_module.register_module_module_registration_hook(_on_registration),
    _torch_module.register_module_parameter_registration_hook(_on_registration),
    _torch_module.register_module_buffer_registration_hook(_on_registration)])


def watch(runner: Any) -> None:  # runner.module_assigned(module_id, what) hears of every assignment
    _LIVE.add(runner)
    _REGISTRATIONS.hold(runner)


def unwatch(runner: Any) -> None:
    _LIVE.discard(runner)
    _REGISTRATIONS.release(runner)


_HOOK_WHY = {"offloading hook": "weights move during the call",
             "layerwise casting hook": "weights are cast anew inside every call"}


def registry_reason(module: nn.Module, skip: Callable[[Any], bool] | None = None) -> tuple[str, str] | None:
    """(category, detail) for the first diffusers hook on ``module`` that ``skip`` does not pass, or None."""
    for name, hook in hooks.registry_hooks(module).items():
        if skip is None or not skip(hook):
            why = _HOOK_WHY.get(cat := hooks.hook_category(name, hook))
            return cat, f"diffusers hook {name!r} ({type(hook).__name__})" + (f": {why}" if why else "")
    return None


def under_model_offload(t: nn.Module) -> bool:
    """accelerate's ``CpuOffload`` hook wraps ``t``'s forward (its ``_old_forward`` holds what it calls)."""
    h = t.__dict__.get("_hf_hook")
    return ("_old_forward" in t.__dict__ and type(h).__name__ == "CpuOffload"
            and type(h).__module__.startswith("accelerate."))


def model_offload_around(t: nn.Module, runner: Any) -> bool:
    """Whether ``runner`` sits inside accelerate's ``CpuOffload`` hook on ``t``: it moves the model before the call
    and nothing during it (a move between calls is seen by :meth:`Scan.moved`)."""
    if runner is None or t.__dict__.get("_old_forward") is not runner or not under_model_offload(t):
        return False
    return bool(getattr(patch_tuning(t), "model_offload_graphs", True))  # Tuning(model_offload_graphs=False): off


def root_reason(t: nn.Module, cache_steps: bool = True, runner: Any = None,
                fbc_outside: bool = False) -> tuple[str, str] | None:
    """O(1) refusals read on the transformer itself (offload and cache hooks sit there or announce themselves).
    ``cache_steps``: a TaylorSeer, PAB or MagCache cache is left to the walk (whole-model runners replay its steps).
    ``runner``: the runner asking (a model-offload hook around it is no refusal). A FirstBlockCache block runner is
    not refused by the cache's hook on its block (:func:`fbc_block_reason`), nor by its config (``fbc_outside``)."""
    fbc_block = runner is not None and getattr(runner._shared, "fbc", False)
    if hooks.offload_hooked(t) and not model_offload_around(t, runner):
        if under_model_offload(t):
            return ("model offload hook (graphs there turned off: Tuning(model_offload_graphs=False))",
                    "enable_model_cpu_offload(): see qwen_absorb.Tuning.model_offload_graphs")
        return "offloading hook", "offload hook on the transformer: weights move during the call"
    cfg = getattr(t, "_cache_config", None)
    if fbc_outside and step_caches.is_fbc_config(cfg):
        cfg = None  # its hooks sit on the blocks, outside their runners
    if cfg is not None and (why := step_caches.refusal(cfg)) is not None:  # before FasterCache's transformer hook
        return why
    if (r := fbc_block_reason(t) if fbc_block else registry_reason(t)) is not None:
        return r
    if cfg is not None and not (cache_steps and (taylorseer.is_config(cfg) or step_caches.kind(cfg))):
        return "cache hook active (enable_cache)", f"_cache_config {type(cfg).__name__}"
    return None


def fbc_block_reason(block: nn.Module) -> tuple[str, str] | None:
    """The diffusers-hook refusal of a block whose runner is FirstBlockCache's ``original_forward``: other hooks
    refuse as anywhere. A block without the cache's hook is refused (the cache was disabled: the model call
    removes the group), as it may hand its outputs over to the next block (:mod:`qwen_absorb.handoff`)."""
    r = registry_reason(block, step_caches.is_fbc_hook)
    if r is None and not hooks.registry_hooks(block):
        return ("FirstBlockCache hooks gone (their per-block graphs wait for the model call to remove them)",
                "the block carries no FirstBlockCache hook")
    return r


def _plain(v: Any) -> bool:  # compared by value: a plain scalar, or a tuple of them (``_num_bits = (4, 3)``)
    tv = type(v)
    return tv in _PLAIN or (tv is tuple and all(type(x) in _PLAIN for x in v))


def lora_state(dicts: list[dict]) -> list[tuple]:
    """PEFT state that changes what runs without a registration (``fuse_lora`` writes ``.data``, unseen by
    ``_version``; ``set_adapters``; ``disable_adapters``): one tuple per layer."""
    return list(map(_peft_get, dicts))


@functools.cache
def _getter(keys: tuple[str, ...]) -> itemgetter:
    return itemgetter(*keys)


def _plan_facts(plan: Any, block: nn.Module, sources: set[int], cache_ok: set[int]) -> None:
    """From ``plan``'s decisions: ids of the tensors only its derived state is made from, and the attention whose
    cache the block runs itself."""
    sources.update(map(id, derived_only_sources(plan, block)))
    if getattr(plan, "attn_cache", False) and (a := block._modules.get("attn")) is not None:
        cache_ok.add(id(a))


class Scan:
    """What the graphs of a runner baked in, and the verdict. ``host``: tensors allowed off the graph device
    (originals kept on the host), left out of the device verdict, fingerprinted like the others."""

    __slots__ = ("module_ids", "modules", "len_dicts", "lens", "hook_dicts", "hook_lens", "handle_id", "watched",
                 "ident_dicts", "ident_keys", "watch_objs", "watch_ids", "plain_dicts", "plain_keys", "plain_getters",
                 "plain_vals", "tensors", "names", "ptrs", "indices", "stensors", "snames", "sptrs", "sindices",
                 "vtensors", "vnames", "vers", "peft", "peft_dicts", "peft_names", "peft_state", "global_hooks",
                 "refusal", "detail", "device", "sticky", "host_count", "owners", "gens", "cache_hooks", "step_hooks",
                 "plans", "facts", "types")

    def __init__(self, t: nn.Module, host: Iterable[torch.Tensor] = (), runner: Any = None) -> None:
        self.refusal, self.detail, self.sticky = None, "", False  # sticky: outlasts weight moves (hooks, calibration)
        self.modules, self.len_dicts, self.hook_dicts = [], [], []
        self.watched: list[tuple[dict, str]] = []  # (dict, key): compared by value or identity (see take())
        watched, self.host_count = self.watched, 0
        self.tensors, self.names, self.vtensors, self.vnames = [], [], [], []
        self.peft, self.peft_dicts, self.peft_names = [], [], []
        self.owners: list[Any] = []  # plans' runtimes and FP8 forwards: ``generation`` moves on a rebuild
        self.plans: list[tuple[Any, nn.Module]] = []  # (plan, block): what their decisions give is self.facts
        sources: set[int] = set()  # ids of tensors only the plans' derived state is made from (see moved())
        self.cache_hooks: list[Any] = []  # TaylorSeer hooks the patched blocks run (their steps key the graphs)
        self.step_hooks: list[Any] = []  # PAB / MagCache hooks, decided by the runner (step_caches)
        cache_ok: set[int] = set()  # the attention modules of blocks whose plan runs their cache
        host = [x for x in host if isinstance(x, torch.Tensor)]
        host_ids, seen, devices = set(map(id, host)), set(), set()

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
            if "_modules" in d:  # a ModuleList's del (a new dict) or insert (this one longer): no hook is called
                self.len_dicts.append(d["_modules"])
                watched.append((d, "_modules"))
            peft_layer = isinstance(d.get("merged_adapters"), list) and isinstance(d.get("scaling"), dict)
            watched.extend((d, k) for k in WATCH_KEYS
                           if k in d and not (root and k == "forward") and not (peft_layer and k in _PEFT_KEYS))
            for k, v in d.items():
                if k.startswith("_qwen_absorb") or (isinstance(v, torch.Tensor) and k not in WATCH_KEYS):
                    watched.append((d, k))
                    if isinstance(v, torch.Tensor):
                        add_tensor(v, f"{label}.{k}")
            if not root:  # the transformer's own hooks run outside the forward we wrap
                for hd in hooks.torch_hook_dicts(m):
                    self.hook_dicts.append(hd)
                    if hd:
                        refuse("forward hook on a submodule", f"forward hook or pre-hook on {label}")
                r = registry_reason(m)
                if r is not None:
                    h = taylorseer.supported_hook(m) if id(m) in cache_ok else None
                    if h is not None:
                        self.cache_hooks.append(h)
                    elif owned := step_caches.owned(m):
                        self.step_hooks.extend(owned)
                    else:
                        refuse(r[0], f"{r[1]} on {label}")
            if hooks.offload_hooked(m) and not (root and model_offload_around(m, runner)):
                refuse("offloading hook", f"offload hook on {label}: weights move during the call")
            proc = d.get("processor")
            pd = getattr(proc, "__dict__", None) if proc is not None and not isinstance(proc, nn.Module) else None
            if isinstance(pd, dict):
                self.len_dicts.append(pd)
                watched.extend((pd, k) for k in pd)
            if d.get("_if_calib") is True and d.get("_disabled") is False:
                refuse("ModelOpt calibration running", f"quantizer {label} is calibrating")
            fwd = d.get("forward")
            if getattr(type(fwd), "__qwen_absorb__", False) and hasattr(fwd, "generation"):
                self.owners.append(fwd)
            plan = d.get(PLAN_ATTR)
            if plan is not None and hasattr(plan, "rt"):
                self.owners.append(plan.rt)
                self.plans.append((plan, m))
                _plan_facts(plan, m, sources, cache_ok)
            if peft_layer:
                self.peft.append(m)
                self.peft_dicts.append(d)
                self.peft_names.append(label)
            for group in ("_parameters", "_buffers"):
                slots = d.get(group) or {}
                for k, x in slots.items():  # by identity: ``bias = None`` or ``_parameters[k] = p`` call no hook
                    watched.append((slots, k))
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
        self.facts = (sources, cache_ok)
        kept = [(x, n) for x, n in zip(self.tensors, self.names) if id(x) not in sources]
        src = [(x, n) for x, n in zip(self.tensors, self.names) if id(x) in sources]
        self.tensors, self.names = [x for x, _ in kept], [n for _, n in kept]
        self.stensors, self.snames = [x for x, _ in src], [n for _, n in src]
        self.take()

    def take(self) -> None:  # record the values ``changed()`` compares against (strong references keep ids unique)
        self.lens = list(map(len, self.len_dicts))
        self.types = list(map(type, self.modules))  # a class swapped in place (a conversion, ``__class__ = ...``)
        self.hook_lens = list(map(len, self.hook_dicts))
        self.handle_id = RemovableHandle.next_id
        plain: dict[int, tuple[dict, list[str]]] = {}
        self.ident_dicts, self.ident_keys = [], []
        for d, k in self.watched:
            if k in d and _plain(d[k]):
                plain.setdefault(id(d), (d, []))[1].append(k)
            else:
                self.ident_dicts.append(d)
                self.ident_keys.append(k)
        self.plain_dicts = [d for d, _ in plain.values()]
        self.plain_keys = [tuple(ks) for _, ks in plain.values()]
        self.plain_getters = list(map(_getter, self.plain_keys))
        self.plain_vals = list(map(call, self.plain_getters, self.plain_dicts))
        self.watch_objs = list(map(dict.get, self.ident_dicts, self.ident_keys))  # held: ids stay unique
        self.watch_ids = list(map(id, self.watch_objs))
        self.ptrs = list(map(_data_ptr, self.tensors))
        self.indices = list(range(len(self.tensors)))
        self.sptrs = list(map(_data_ptr, self.stensors))
        self.sindices = list(range(len(self.stensors)))
        self.vers = list(map(_version_of, self.vtensors))
        self.peft_state = [(list(m), dict(s), dis, list(a) if isinstance(a, list) else a)  # PEFT mutates them in place
                           for m, s, dis, a in lora_state(self.peft_dicts)]
        self.gens = list(map(_generation, self.owners))
        self.global_hooks = hooks.global_hook_count()

    def redecided(self) -> bool:
        """After blocks decided anew and nothing else changed (a first call on weights just moved in): True, the
        generations taken anew, when their decisions give the same :func:`_plan_facts`; False: scan again."""
        if not _same_ptrs(self.tensors, self.ptrs, self.indices) or self.stale() is not None:
            return False
        facts: tuple[set[int], set[int]] = (set(), set())
        for plan, m in self.plans:
            _plan_facts(plan, m, *facts)
        if facts != self.facts:
            return False
        self.gens = list(map(_generation, self.owners))
        return True

    def changed(self) -> str | None:
        """None when nothing a graph depends on changed since the snapshot, else what changed."""
        return self.moved() or self.stale()

    def moved(self) -> str | None:
        """What a replay must not run past: memory the graph reads may be gone (a tensor moved or replaced, a block
        decided anew, an FP8 forward rebuilt). Derived state's sources and identities are left to :meth:`stale`."""
        if list(map(_generation, self.owners)) != self.gens:
            return "a block decided anew or an FP8 forward rebuilt its derived tensors"
        if not _same_ptrs(self.tensors, self.ptrs, self.indices):
            return "weights moved or replaced"
        return None

    def stale(self) -> str | None:
        """The rest of :meth:`changed`: what makes a replay's result wrong, not unsafe (asked while it runs)."""
        if list(map(len, self.len_dicts)) != self.lens or list(map(type, self.modules)) != self.types:
            return "module structure or attributes changed"
        if list(map(id, map(dict.get, self.ident_dicts, self.ident_keys))) != self.watch_ids:
            return SWITCHED
        # every hook registration takes a RemovableHandle id: the dicts are counted when it moved (or when refused)
        if RemovableHandle.next_id != self.handle_id or self.refusal is not None:
            if list(map(len, self.hook_dicts)) != self.hook_lens or hooks.global_hook_count() != self.global_hooks:
                return "forward hooks added or removed"
            self.handle_id = RemovableHandle.next_id
        try:
            if list(map(call, self.plain_getters, self.plain_dicts)) != self.plain_vals:
                return SWITCHED
        except Exception:  # noqa: BLE001 - a switch deleted (KeyError) or a value that cannot be compared
            return SWITCHED
        if not _same_ptrs(self.stensors, self.sptrs, self.sindices):
            return "weights moved or replaced"
        if list(map(_version_of, self.vtensors)) != self.vers:
            return "weights modified in place"
        if self.peft_dicts and not _equal(self.peft_dicts, self.peft_state, lora_state):  # (or attributes deleted)
            return "LoRA adapter state changed"
        return None

    def which(self) -> str:  # the first changed item, by name (slow; for the log only)
        for x, n, p in zip(self.tensors + self.stensors, self.names + self.snames, self.ptrs + self.sptrs):
            if _data_ptr(x) != p:
                return n
        for x, n, v in zip(self.vtensors, self.vnames, self.vers):
            if _version_of(x) != v:
                return n
        for d, k, i in zip(self.ident_dicts, self.ident_keys, self.watch_ids):
            if id(d.get(k)) != i:
                return f"attribute {k!r} of a {type(d.get(k)).__name__ if k in d else 'module (removed)'}"
        for d, ks, vals in zip(self.plain_dicts, self.plain_keys, self.plain_vals):
            for k, v in zip(ks, vals if len(ks) > 1 else (vals,)):
                if k not in d or not _equal(d[k], v):
                    return f"attribute {k!r}: {v!r} -> {d[k]!r}" if k in d else f"attribute {k!r} (removed)"
        return next((n for d, n, snap in zip(self.peft_dicts, self.peft_names, self.peft_state)
                     if not _equal(d, snap, _peft_get)), "")


def _equal(a: Any, b: Any, get: Any = None) -> bool:
    """``a == b`` (of ``get(a)`` when given); False where the comparison raises (a deleted or odd value)."""
    try:
        return bool((get(a) if get is not None else a) == b)
    except Exception:  # noqa: BLE001
        return False
