"""What the graphs of a runner baked in, and whether it changed: the per-call fingerprint and its verdict.

A :class:`Scan` walks the transformer once and records what a replay depends on: every parameter and buffer
(``data_ptr`` and ``_version``), tensors and qwen_absorb state held as module attributes, the instance
attributes where forwards, hooks, processors, ModelOpt and PEFT switches live (plain values by value, one
``itemgetter`` per dict; everything else by identity), the lengths of module and hook dicts, and PEFT LoRA
state (merged adapters, scaling, enabled, active; against copies, as PEFT mutates them in place). It is compared
per call with C-level ``map``s: a Python loop per item would cost more than the launches a replay saves (a
60-block FP8 model has ~20,000 quantizer switches). ``moved()`` is the half a replay must not be launched past,
``stale()`` the half checked while the GPU runs it. The same walk gives the verdict: a refusal, or the device.
torch's global registration hooks (:func:`watch`) drop a runner's snapshot when a module, parameter or buffer
is assigned inside its transformer.
"""

from __future__ import annotations

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

# Instance attributes whose identity decides what a call runs: hook chains and compiled wrappers (from
# qwen_absorb.hooks), processors, ModelOpt quantizer switches, PEFT switches, and a norm's eps (a graph holds the
# eps its kernels were launched with; ``norm.eps = ...`` moves no tensor). Compared wherever present.
WATCH_KEYS = (
    *hooks.WRAPPER_ATTRS, "processor",
    "_disabled", "_if_quant", "_if_calib", "_fake_quant", "_dequantize", "_num_bits",
    "_disable_adapters", "_active_adapter", "eps",
)

SWITCHED = "forward, hook, processor, quantizer or adapter switch replaced"

_version_of = attrgetter("_version")
_generation = attrgetter("generation")
_data_ptr = torch.Tensor.data_ptr
# One C++ loop over (tensor, data_ptr) pairs (CUDA builds; what Inductor's CUDA-graph trees use); a map otherwise.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)
# PEFT's per-layer switches, read from a LoRA layer's __dict__ in one C call; _PEFT_KEYS are compared there
# (by value) and left out of the attribute comparison
_PEFT_KEYS = ("merged_adapters", "scaling", "_disable_adapters", "_active_adapter")
_peft_get = itemgetter(*_PEFT_KEYS)
_PLAIN = (bool, int, float, str, type(None))


def _same_ptrs(tensors: list[torch.Tensor], ptrs: list[int], indices: list[int]) -> bool:  # one C++ loop
    if _ptrs_equal is not None:
        return _ptrs_equal(tensors, ptrs, indices)
    return list(map(_data_ptr, tensors)) == ptrs


# ---------------------------------------------------------------------------------------------- registration


_LIVE: weakref.WeakSet = weakref.WeakSet()


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: every watched runner is told (``module_assigned``); never raises."""
    try:
        mid = id(module)
        for runner in list(_LIVE):
            runner.module_assigned(mid, f"{type(module).__name__}.{name} assigned")
    except Exception:  # noqa: BLE001 - a registration must never fail because of us
        pass


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


# ---------------------------------------------------------------------------------------------- refusals


def registry_reason(module: nn.Module, skip: Callable[[Any], bool] | None = None) -> tuple[str, str] | None:
    """The refusal for the first diffusers hook on ``module`` that ``skip`` does not pass: (category, detail), or
    None without one."""
    for name, hook in hooks.registry_hooks(module).items():
        if skip is None or not skip(hook):
            cat = hooks.hook_category(name, hook)
            why = _HOOK_WHY.get(cat)
            return cat, f"diffusers hook {name!r} ({type(hook).__name__})" + (f": {why}" if why else "")
    return None


# why a graph cannot replay under these hooks (said in the report's detail)
_HOOK_WHY = {"offloading hook": "weights move during the call",
             "layerwise casting hook": "weights are cast anew inside every call"}


def under_model_offload(t: nn.Module) -> bool:
    """accelerate's ``CpuOffload`` hook wraps ``t``'s forward (its ``_old_forward`` holds what it calls)."""
    h = t.__dict__.get("_hf_hook")
    return ("_old_forward" in t.__dict__ and type(h).__name__ == "CpuOffload"
            and type(h).__module__.startswith("accelerate."))


def model_offload_around(t: nn.Module, runner: Any) -> bool:
    """Whether ``runner`` sits inside accelerate's ``CpuOffload`` hook on ``t`` (``enable_model_cpu_offload()``):
    the hook moves the whole model to its execution device before the forward it wraps runs and moves nothing
    during the call, so the runner sees a resident model. A move between calls changes the weights' addresses,
    which :meth:`Scan.moved` checks before every replay (the graphs are dropped, the next call captures anew)."""
    if runner is None or t.__dict__.get("_old_forward") is not runner or not under_model_offload(t):
        return False
    tuning = patch_tuning(t)  # Tuning.model_offload_graphs=False turns them off
    return bool(getattr(tuning, "model_offload_graphs", True))


def root_reason(t: nn.Module, cache_steps: bool = True, runner: Any = None,
                fbc_outside: bool = False) -> tuple[str, str] | None:
    """O(1) refusals read on the transformer itself (offload / cache hooks sit there or announce themselves).
    ``cache_steps``: a TaylorSeer, PAB or MagCache cache is left to the walk (whole-model runners replay its steps,
    see :mod:`qwen_absorb.taylorseer`, :mod:`qwen_absorb.step_caches`); per-block runners refuse it here.
    ``runner``: the whole-model runner asking; inside a model-offload hook (:func:`model_offload_around`, unless
    ``Tuning(model_offload_graphs=False)``) that hook is no refusal. Every other offload hook streams weights
    during the call: refused. A block runner of a FirstBlockCache group (:mod:`.first_block_cache`: its
    ``Shared.fbc``) sits inside the cache's hook, which is no refusal on its block (:func:`fbc_block_reason`), nor is
    the cache's config on the transformer around it (``fbc_outside``, from :meth:`.shared.Shared.parent_reason`)."""
    fbc_block = runner is not None and getattr(runner._shared, "fbc", False)
    if hooks.offload_hooked(t) and not model_offload_around(t, runner):
        if under_model_offload(t):
            return ("model offload hook (graphs there turned off: Tuning(model_offload_graphs=False))",
                    "enable_model_cpu_offload(): see qwen_absorb.Tuning.model_offload_graphs")
        return "offloading hook", "offload hook on the transformer: weights move during the call"
    cfg = getattr(t, "_cache_config", None)
    if fbc_outside and step_caches.is_fbc_config(cfg):
        cfg = None  # its hooks sit on the blocks, outside their runners
    why = step_caches.refusal(cfg) if cfg is not None else None
    if why is not None:  # said before the hook on the transformer FasterCache puts there
        return why
    r = fbc_block_reason(t) if fbc_block else registry_reason(t)
    if r is not None:
        return r
    if cfg is not None and not (cache_steps and (taylorseer.is_config(cfg) or step_caches.kind(cfg))):
        return "cache hook active (enable_cache)", f"_cache_config {type(cfg).__name__}"
    return None


def fbc_block_reason(block: nn.Module) -> tuple[str, str] | None:
    """The diffusers-hook refusal of a block whose runner sits inside FirstBlockCache's hook (the runner is that
    hook's ``original_forward``: the hook decides on the host whether to call it and reads only what it returns).
    Any other diffusers hook refuses as anywhere. Without a FirstBlockCache hook the cache was disabled since the
    group was made: refused until the model call removes the group, as an unhooked block may hand its outputs
    over to the next one (:mod:`qwen_absorb.handoff`), which a graph of one block cannot carry."""
    r = registry_reason(block, step_caches.is_fbc_hook)
    if r is None and not hooks.registry_hooks(block):
        return ("FirstBlockCache hooks gone (their per-block graphs wait for the model call to remove them)",
                "the block carries no FirstBlockCache hook")
    return r


# ---------------------------------------------------------------------------------------------- the snapshot


def _is_lora_layer(d: dict) -> bool:
    return isinstance(d.get("merged_adapters"), list) and isinstance(d.get("scaling"), dict)


def _plain(v: Any) -> bool:  # compared by value: a plain scalar, or a tuple of them (``_num_bits = (4, 3)``)
    tv = type(v)
    return tv in _PLAIN or (tv is tuple and all(type(x) in _PLAIN for x in v))


def lora_state(dicts: list[dict]) -> list[tuple]:
    """PEFT state that changes what runs without a registration (``fuse_lora`` writes ``.data``, which no
    ``_version`` sees; ``set_adapters``; ``disable_adapters``), one tuple per layer, one C-level map."""
    return list(map(_peft_get, dicts))


def lora_snapshot(dicts: list[dict]) -> list[tuple]:
    """Copies of :func:`lora_state` (the lists and dicts are mutated in place by PEFT)."""
    return [(list(m), dict(s), dis, list(a) if isinstance(a, list) else a) for m, s, dis, a in lora_state(dicts)]


@functools.cache
def _getter(keys: tuple[str, ...]) -> itemgetter:
    return itemgetter(*keys)


def _plan_facts(plan: Any, block: nn.Module, sources: set[int], cache_ok: set[int]) -> None:
    """What a scan takes from ``plan``'s decisions: the ids of the tensors only its derived state is made from, and
    the attention whose cache the block runs itself."""
    sources.update(map(id, derived_only_sources(plan, block)))
    if getattr(plan, "attn_cache", False) and (a := block._modules.get("attn")) is not None:
        cache_ok.add(id(a))


class Scan:
    """What the graphs of a runner baked in, and the verdict. ``host``: tensors allowed off the graph device
    (originals kept on the host), left out of the device verdict, fingerprinted like the others."""

    __slots__ = (
        "module_ids", "modules", "len_dicts", "lens", "hook_dicts", "hook_lens", "handle_id", "watch_dicts",
        "watch_keys", "ident_dicts", "ident_keys", "watch_objs", "watch_ids", "plain_dicts", "plain_keys",
        "plain_getters", "plain_vals", "tensors", "names", "ptrs", "indices", "stensors", "snames", "sptrs",
        "sindices", "vtensors", "vnames", "vers", "peft",
        "peft_dicts", "peft_names", "peft_state", "global_hooks", "refusal", "detail", "device", "sticky",
        "host_count", "owners", "gens", "cache_hooks", "step_hooks", "plans", "facts", "types",
    )

    def __init__(self, t: nn.Module, host: Iterable[torch.Tensor] = (), runner: Any = None) -> None:
        self.refusal: str | None = None
        self.detail = ""
        self.sticky = False  # a refusal that weight moves cannot lift (hooks, calibration), see the runner
        self.modules, self.len_dicts, self.hook_dicts, self.watch_dicts, self.watch_keys = [], [], [], [], []
        self.tensors, self.names, self.vtensors, self.vnames = [], [], [], []
        self.peft, self.peft_dicts, self.peft_names = [], [], []
        # what holds derived tensors a graph reads: the plans' runtimes and the FP8 forwards. Their
        # ``generation`` moves whenever those tensors are dropped or replaced (a decision, a rebuild)
        self.owners: list[Any] = []
        self.plans: list[tuple[Any, nn.Module]] = []  # (plan, block): what their decisions give is self.facts
        sources: set[int] = set()  # ids of tensors only the plans' derived state is made from (see moved())
        # TaylorSeer hooks the patched blocks run themselves (taylorseer.run): their steps key the graphs
        self.cache_hooks: list[Any] = []
        self.step_hooks: list[Any] = []  # PAB / MagCache hooks, decided by the runner (step_caches)
        cache_ok: set[int] = set()  # the attention modules of blocks whose plan runs their cache
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
            if "_modules" in d:  # a ModuleList's del (a new dict) or insert (this one longer): no hook is called
                self.len_dicts.append(d["_modules"])
                self.watch_dicts.append(d)
                self.watch_keys.append("_modules")
            if not root:  # the transformer's own hooks run outside the forward we wrap
                for hd in hooks.torch_hook_dicts(m):
                    self.hook_dicts.append(hd)
                    if hd:
                        refuse("forward hook on a submodule", f"forward hook or pre-hook on {label}")
            peft_layer = _is_lora_layer(d)
            for k in WATCH_KEYS:
                if k in d and not (root and k == "forward") and not (peft_layer and k in _PEFT_KEYS):
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
                    h = taylorseer.supported_hook(m) if id(m) in cache_ok else None
                    owned = step_caches.owned(m) if h is None else []
                    if h is not None:
                        self.cache_hooks.append(h)
                    elif owned:
                        self.step_hooks.extend(owned)
                    else:
                        refuse(r[0], f"{r[1]} on {label}")
            if hooks.offload_hooked(m) and not (root and model_offload_around(m, runner)):
                refuse("offloading hook", f"offload hook on {label}: weights move during the call")
            proc = d.get("processor")
            pd = getattr(proc, "__dict__", None) if proc is not None and not isinstance(proc, nn.Module) else None
            if isinstance(pd, dict):
                self.len_dicts.append(pd)
                for k in pd:
                    self.watch_dicts.append(pd)
                    self.watch_keys.append(k)
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
                for k, x in slots.items():
                    # the slot by identity: ``bias = None`` and a direct ``_parameters[k] = p`` (accelerate's
                    # set_module_tensor_to_device) call no registration hook
                    self.watch_dicts.append(slots)
                    self.watch_keys.append(k)
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
        # the tensors a graph reads are checked before a replay launches, the plans' sources after (moved())
        kept = [(x, n) for x, n in zip(self.tensors, self.names) if id(x) not in sources]
        src = [(x, n) for x, n in zip(self.tensors, self.names) if id(x) in sources]
        self.tensors, self.names = [x for x, _ in kept], [n for _, n in kept]
        self.stensors, self.snames = [x for x, _ in src], [n for _, n in src]
        self.take()

    def take(self) -> None:
        """Record the values ``changed()`` compares against (strong references keep ids unique)."""
        self.lens = list(map(len, self.len_dicts))
        self.types = list(map(type, self.modules))  # a class swapped in place (a conversion, ``__class__ = ...``)
        self.hook_lens = list(map(len, self.hook_dicts))
        self.handle_id = RemovableHandle.next_id
        # plain values by value, one itemgetter per dict; everything else by identity (see the module doc)
        plain: dict[int, tuple[dict, list[str]]] = {}
        self.ident_dicts, self.ident_keys = [], []
        for d, k in zip(self.watch_dicts, self.watch_keys):
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
        self.peft_state = lora_snapshot(self.peft_dicts)
        self.gens = list(map(_generation, self.owners))
        self.global_hooks = hooks.global_hook_count()

    def redecided(self) -> bool:
        """After blocks decided anew and nothing else changed (a first call on weights just moved in, scanned
        before the call): True when their decisions give the same :func:`_plan_facts`, the generations taken anew;
        False when a new scan is needed. (An H100 profile of an 8-step model-offload run of 60 blocks spent
        0.9 s in ``Scan.__init__``, walked twice per run: before the first call's warm-up and after it.)"""
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
        """What a replay must not run past: memory the graph reads may be gone (a parameter or buffer moved or
        replaced, a block decided anew, an FP8 forward rebuilt). Left to :meth:`stale`, as the memory a graph
        reads survives them: the tensors only derived state is made from (``plan.derived_only_sources``, 2520 of
        the 3866 tensors of a 60-block ModelOpt model) and the identities of forwards, processors and plans (the
        scan holds the replaced objects). On the H200's host: 2.3 ms with everything, 378 us split
        (benchmarks/results/graphs/graph_idle_h200*.md, scan_cost.md)."""
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
        # Every torch hook registration takes an id from RemovableHandle.next_id: the hook dicts are only
        # counted when it moved (or when refusing, so that removing the hook is seen too).
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
        if self.peft_dicts:
            try:
                if lora_state(self.peft_dicts) != self.peft_state:
                    return "LoRA adapter state changed"
            except Exception:  # noqa: BLE001 - PEFT's attributes deleted
                return "LoRA adapter state changed"
        return None

    def which(self) -> str:
        """The first changed item, by name (slow; for the log only)."""
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
