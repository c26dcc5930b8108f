"""CUDA-graph mode for the Qwen-Image transformer call: capture the call once per input signature, then replay it.

Eager Qwen-Image is host-bound (thousands of launches per call, each paying Python and dispatcher cost); a
replayed CUDA graph runs the same kernels with no Python in between. :func:`install` puts a
:class:`GraphedCall` on the transformer as its instance attribute ``forward``, wrapping whatever forward was
current (the class forward, a hook's wrapper; patched by ``qwen_absorb.patch`` or not, compiled blocks or
not); ``GraphedCall.remove()`` restores it. Per call:

- **refuse** (run the wrapped forward, count ``"cuda_graph: <reason>"`` in ``fallbacks``) when a replay could
  differ from eager: grad enabled, training mode, diffusers hooks (``enable_cache``, offloading, casting,
  parallelism), accelerate hooks, forward hooks on submodules, ModelOpt calibration, a model or input off
  CUDA, a Python number where a tensor is expected (it would be baked in), arguments a signature cannot
  describe, a signature whose capture failed;
- **invalidate** (drop every graph) when what graphs baked in changed: a per-call fingerprint of parameter
  and buffer ``data_ptr`` / ``_version``, module attributes and hooks, the forwards, processors, ModelOpt and
  LoRA switches, plus torch's registration hooks for assigned modules and parameters;
- **key** a graph by tensor shapes, strides, dtypes, devices and alignment, every non-tensor argument by value,
  and the global switches that change kernel choice; at most ``max_graphs`` graphs, least recently used first;
- **capture** a new signature: inputs copied into static buffers, one eager warm-up on a side stream (its
  output answers this call), then capture into the runner's one memory pool. ``torch.tensor(host data,
  device=cuda)`` (the edit models' ``modulate_index``, the text length next to a mask) cannot be captured:
  during the capture that exact call is answered by a device copy of what the warm-up created;
- **replay**: ``copy_`` into the static buffers, ``replay()``, return a **clone** of the static output. A
  clone because true CFG's two calls may share a signature (equal text lengths) and because graphs share
  one pool, so a static output may be another graph's scratch memory; it is one small copy.

Outputs are bit-identical to the wrapped forward run eagerly. Not thread-safe (one runner, one thread, replays
on the caller's current stream). Not seen by the fingerprint, so call ``invalidate()`` after them: writes
through ``param.data`` (replay reads the new values anyway; only caches derived from weights would be stale),
``del`` of a submodule or parameter, direct writes into ``_parameters`` / ``_modules``.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["GraphedCall", "install"]

log = logging.getLogger("qwen_absorb")

PREFIX = "cuda_graph: "
# Alignment (bytes) the signature distinguishes up to, and modulo which static buffers copy an input's
# address. The CUDA caching allocator hands out 512-byte aligned blocks.
_ALIGN = 256
# Invalidations of graphs that were never replayed, in a row, before the runner stops capturing: a model
# whose state changes on every call would otherwise capture on every call.
_MAX_UNREPLAYED_INVALIDATIONS = 3
# Device types graphs are captured on (a module constant so that the CPU tests can drive the capture logic
# with fake CUDA-graph objects).
_GRAPH_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Top-level arguments diffusers expects as tensors: a Python number there would be baked into the graph.
_TENSOR_SLOTS = frozenset({
    "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "guidance",
    "additional_t_cond",
})
# Instance attributes whose identity decides what a call runs (hook chains, compiled wrappers, processors,
# ModelOpt quantizer switches, PEFT switches): their identity is compared per call wherever present.
_WATCH_KEYS = (
    "forward", "_old_forward", "_compiled_call_impl", "_diffusers_hook", "_hf_hook", "processor",
    "_disabled", "_if_quant", "_if_calib", "_fake_quant", "_dequantize", "_num_bits",
    "_disable_adapters", "_active_adapter",
)
# diffusers' RoPE caches (QwenEmbedRope / QwenEmbedLayer3DRope) whose tensors a graph reads: see _KeepRope.
_ROPE_METHODS = ("_compute_video_freqs", "_compute_condition_freqs", "_get_device_freqs")

_version_of = attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr
# One C++ loop over (tensor, data_ptr) pairs (CUDA builds; what Inductor's CUDA-graph trees use); a map otherwise.
_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class _Refusal(Exception):
    """Raised while reading the arguments: the call must run eager, for ``reason``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


# ---------------------------------------------------------------------------------------------- registration


_LIVE: weakref.WeakSet = weakref.WeakSet()
_hooks_lock = threading.Lock()
_hooks_registered = False


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: a module, parameter or buffer was (re)assigned somewhere.

    When it happens inside a runner's transformer the runner's snapshot is dropped at once (so it holds no
    replaced weights) and its graphs go at the next call. Never raises, returns None (keeps ``value``).
    """
    try:
        mid = id(module)
        for runner in list(_LIVE):
            scan = runner._scan
            if scan is not None and mid in scan.module_ids:
                runner._scan = None
                runner._dirty = f"module structure changed ({type(module).__name__}.{name} assigned)"
    except Exception:  # a registration must never fail because of us
        pass


def _ensure_registration_hooks() -> None:
    global _hooks_registered
    with _hooks_lock:
        if _hooks_registered:
            return
        from torch.nn.modules import module as _m  # noqa: PLC0415

        _m.register_module_module_registration_hook(_on_registration)
        _m.register_module_parameter_registration_hook(_on_registration)
        _m.register_module_buffer_registration_hook(_on_registration)
        _hooks_registered = True


# ---------------------------------------------------------------------------------------------- refusal helpers


def _hook_reason(name: str, hook: Any) -> str:
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


def _registry_reason(reg: Any) -> tuple[str, str] | None:
    hooks = getattr(reg, "hooks", None)
    if not hooks:
        return None
    name, hook = next(iter(hooks.items()))
    return _hook_reason(name, hook), f"diffusers hook {name!r} ({type(hook).__name__})"


def _root_reason(t: nn.Module) -> tuple[str, str] | None:
    """O(1) refusals read on the transformer itself (offload / cache hooks sit there or announce themselves)."""
    d = t.__dict__
    if d.get("_hf_hook") is not None:
        return "offloading hook", "accelerate hook on the transformer"
    r = _registry_reason(d.get("_diffusers_hook"))
    if r is not None:
        return r
    if getattr(t, "_cache_config", None) is not None:
        return "cache hook active (enable_cache)", f"_cache_config {type(t._cache_config).__name__}"
    return None


def _global_hook_count() -> int:
    from torch.nn.modules import module as _m  # noqa: PLC0415

    return len(_m._global_forward_hooks) + len(_m._global_forward_pre_hooks)


# ---------------------------------------------------------------------------------------------- the snapshot


class _Scan:
    """What the graphs of a runner baked in, and the verdict (refusal or not) for that state.

    ``changed()`` is the per-call check: list comparisons built with C-level ``map``s over lists prepared
    here (a Python loop per tensor would cost more than the launches a replay saves on small calls).
    """

    __slots__ = (
        "module_ids", "modules", "len_dicts", "lens", "hook_dicts", "hook_lens", "handle_id", "watch_dicts",
        "watch_keys", "watch_objs", "watch_ids", "tensors", "names", "ptrs", "indices", "vtensors", "vnames",
        "vers", "peft", "peft_state", "global_hooks", "refusal", "detail", "device", "sticky",
    )

    def __init__(self, t: nn.Module) -> None:
        self.refusal: str | None = None
        self.detail = ""
        self.sticky = False  # a refusal that weight moves cannot lift (hooks, calibration), see refresh()
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
            except Exception:  # tensor subclasses without storage (e.g. DTensor): nothing to compare
                return
            self.tensors.append(x)
            self.names.append(name)
            try:
                _version_of(x)
            except Exception:  # inference tensors have no version counter
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
                for hk in ("_forward_hooks", "_forward_pre_hooks"):
                    hd = d.get(hk)
                    if isinstance(hd, dict):
                        self.hook_dicts.append(hd)
                        if hd:
                            refuse("forward hook on a submodule", f"{hk} on {label}")
            for k in _WATCH_KEYS:
                if k in d and not (root and k == "forward"):
                    self.watch_dicts.append(d)
                    self.watch_keys.append(k)
            for k, v in d.items():
                if k.startswith("_qwen_absorb") or (isinstance(v, torch.Tensor) and k not in _WATCH_KEYS):
                    self.watch_dicts.append(d)
                    self.watch_keys.append(k)
                    if isinstance(v, torch.Tensor):
                        add_tensor(v, f"{label}.{k}")
            r = _registry_reason(d.get("_diffusers_hook"))
            if r is not None and not root:
                refuse(r[0], f"{r[1]} on {label}")
            if d.get("_hf_hook") is not None:
                refuse("offloading hook", f"accelerate hook on {label}")
            proc = d.get("processor")
            pd = getattr(proc, "__dict__", None) if proc is not None and not isinstance(proc, nn.Module) else None
            if isinstance(pd, dict):
                self.len_dicts.append(pd)
                for k in pd:
                    self.watch_dicts.append(pd)
                    self.watch_keys.append(k)
            if d.get("_if_calib") is True and d.get("_disabled") is False:
                refuse("ModelOpt calibration running", f"quantizer {label} is calibrating")
            if isinstance(d.get("merged_adapters"), list) and isinstance(d.get("scaling"), dict):
                self.peft.append(m)
            for group in ("_parameters", "_buffers"):
                for k, x in (d.get(group) or {}).items():
                    if x is None:
                        continue
                    add_tensor(x, f"{label}.{k}")
                    devices.add(x.device)
        if _global_hook_count():
            refuse("global module forward hook", "torch.nn.modules.module global forward (pre-)hooks are registered")
        self.device: torch.device | None = None
        if any(dv.type == "meta" for dv in devices):
            refuse("offloading hook", "parameters on the meta device (offloaded or not materialised)", False)
        elif any(dv.type not in _GRAPH_DEVICE_TYPES for dv in devices):
            refuse("model not on CUDA", "parameters on " + ", ".join(sorted({str(dv) for dv in devices})), False)
        elif len(devices) > 1:
            refuse("model on several devices", ", ".join(sorted(str(dv) for dv in devices)), False)
        elif devices:
            self.device = next(iter(devices))
        self.module_ids = frozenset(map(id, self.modules))
        self._take()

    def _take(self) -> None:
        """Record the values ``changed()`` compares against (strong references keep ids unique)."""
        self.lens = list(map(len, self.len_dicts))
        self.hook_lens = list(map(len, self.hook_dicts))
        self.handle_id = RemovableHandle.next_id
        self.watch_objs = list(map(dict.get, self.watch_dicts, self.watch_keys))
        self.watch_ids = list(map(id, self.watch_objs))
        self.ptrs = list(map(_data_ptr, self.tensors))
        self.indices = list(range(len(self.tensors)))
        self.vers = list(map(_version_of, self.vtensors))
        self.peft_state = list(map(_peft_state, self.peft))
        self.global_hooks = _global_hook_count()

    def changed(self) -> str | None:
        """None when nothing a graph depends on changed since the snapshot, else what changed."""
        if list(map(len, self.len_dicts)) != self.lens:
            return "module structure or attributes changed"
        # Every torch hook registration takes an id from RemovableHandle.next_id: the hook dicts are only
        # counted when it moved (or when refusing, so that removing the hook is seen too).
        if RemovableHandle.next_id != self.handle_id or self.refusal is not None:
            if list(map(len, self.hook_dicts)) != self.hook_lens or _global_hook_count() != self.global_hooks:
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
        if self.peft and list(map(_peft_state, self.peft)) != self.peft_state:
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
        return ""


def _peft_state(m: nn.Module) -> tuple:
    """What of a PEFT tuner layer changes which kernels run without a registration (set_adapters, fuse)."""
    d = m.__dict__
    active = d.get("_active_adapter")
    return (
        tuple(d.get("merged_adapters") or ()), d.get("_disable_adapters"),
        tuple(active) if isinstance(active, list) else active,
        tuple(d.get("scaling", {}).items()),
    )


# ---------------------------------------------------------------------------------------------- signature


_ATOMS = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _freeze(x: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable description of an argument; tensors are appended to ``tensors`` (their metadata is keyed
    separately). Type tags keep ``1`` / ``True`` / ``1.0`` and lists / tuples apart (diffusers branches on
    ``isinstance(..., list)`` for ``img_shapes``)."""
    tx = type(x)
    if isinstance(x, torch.Tensor):
        if tx is not torch.Tensor and tx is not nn.Parameter:
            raise _Refusal("unsupported argument type", f"tensor subclass {tx.__name__}")
        tensors.append(x)
        return _T
    if tx in _ATOMS:
        return (tx, x)
    if tx is float:
        return (float, x.hex())  # exact, and NaN equals itself
    if tx is complex:
        return (complex, x.real.hex(), x.imag.hex())
    if tx is list or tx is tuple:
        return (tx, tuple(_freeze(v, tensors) for v in x))
    if tx is torch.Size:
        return (tx, tuple(x))
    if tx is dict:
        items = []
        for k, v in x.items():
            if type(k) not in _ATOMS:
                raise _Refusal("unsupported argument type", f"dict key of type {type(k).__name__}")
            items.append((k, _freeze(v, tensors)))
        return (dict, tuple(items))
    import enum  # noqa: PLC0415

    if isinstance(x, enum.Enum):
        return (tx, x)
    raise _Refusal("unsupported argument type", tx.__name__)


class _TensorSlot:
    """Placeholder for a tensor in a frozen argument structure."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"

    def __reduce__(self) -> str:
        return "_T"


_T = _TensorSlot()


def _thaw(spec: Any, it: Iterator[torch.Tensor]) -> Any:
    if spec is _T:
        return next(it)
    tx = spec[0]
    if tx is float:
        return float.fromhex(spec[1])
    if tx is complex:
        return complex(float.fromhex(spec[1]), float.fromhex(spec[2]))
    if tx is list or tx is tuple:
        return tx(_thaw(v, it) for v in spec[1])
    if tx is torch.Size:
        return torch.Size(spec[1])
    if tx is dict:
        return {k: _thaw(v, it) for k, v in spec[1]}
    return spec[1]


def _align_class(ptr: int) -> int:
    """The largest power of two dividing ``ptr``, capped at ``_ALIGN``: what alignment checks in kernels
    (vector widths, cuBLASLt heuristics) can see."""
    return min(ptr & -ptr, _ALIGN) if ptr else _ALIGN


def _tensor_meta(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.stride(), x.dtype, x.device, _align_class(x.data_ptr()))


_diffusers_registry: Any = None


def _attention_backend() -> Any:
    global _diffusers_registry
    if _diffusers_registry is None:
        try:
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry  # noqa: PLC0415

            _diffusers_registry = _AttentionBackendRegistry
        except Exception:
            _diffusers_registry = False
    return getattr(_diffusers_registry, "_active_backend", None) if _diffusers_registry else None


def _global_flags() -> tuple:
    """Process-wide switches that change which kernels a call picks (and so what a graph baked in)."""
    m = torch.backends.cuda.matmul
    try:
        autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    except TypeError:  # older signature
        autocast = torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None
    return (
        torch.is_inference_mode_enabled(), autocast, m.allow_tf32,
        getattr(m, "allow_bf16_reduced_precision_reduction", None),
        getattr(m, "allow_fp16_reduced_precision_reduction", None), torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(), getattr(torch.backends.cuda, "cudnn_sdp_enabled", bool)(),
        torch.are_deterministic_algorithms_enabled(), os.environ.get("QWEN_ABSORB_FORCE_REFERENCE"),
        str(_attention_backend()),
    )


def _describe_arg(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}[{','.join(map(str, x.shape))}]"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _signature(args: tuple, kwargs: dict, positional: tuple[str, ...]) -> tuple[Any, list[torch.Tensor], tuple]:
    """``(spec, tensors, key)`` of a call: its frozen argument structure, its tensors, and the key graphs are
    kept under (structure, per-tensor metadata, global switches). Raises :class:`_Refusal` for arguments a
    graph cannot take."""
    for i, v in enumerate(args):
        _check_slot(positional[i] if i < len(positional) else f"arg{i}", v)
    for k, v in kwargs.items():
        _check_slot(k, v)
    tensors: list[torch.Tensor] = []
    spec = (_freeze(args, tensors), tuple((k, _freeze(v, tensors)) for k, v in kwargs.items()))
    return spec, tensors, (spec, tuple(map(_tensor_meta, tensors)), _global_flags())


class _Call:
    """One call's arguments, read once: tensors, their frozen structure, the signature key, the device."""

    __slots__ = ("args", "kwargs", "tensors", "spec", "key", "device")

    def __init__(self, args: tuple, kwargs: dict, positional: tuple[str, ...]) -> None:
        self.args, self.kwargs = args, kwargs
        self.spec, self.tensors, self.key = _signature(args, kwargs, positional)
        if not self.tensors:
            raise _Refusal("no tensor argument", "")
        dev = self.tensors[0].device
        for x in self.tensors:
            if x.device.type not in _GRAPH_DEVICE_TYPES:
                raise _Refusal(f"input on {x.device.type}", "")
            if x.device != dev:
                raise _Refusal("inputs on several devices", f"{dev} and {x.device}")
            if x.numel() > 1 and torch._debug_has_internal_overlap(x) == 1:
                raise _Refusal("input with overlapping memory (expanded)", _describe_arg(x))
        self.device = dev

    def describe(self, positional: tuple[str, ...]) -> str:
        parts = [f"{positional[i] if i < len(positional) else i}={_describe_arg(v)}" for i, v in enumerate(self.args)]
        parts += [f"{k}={_describe_arg(v)}" for k, v in self.kwargs.items()]
        return " ".join(parts)


def _check_slot(name: str, v: Any) -> None:
    if name in _TENSOR_SLOTS and type(v) in (int, float):
        raise _Refusal("python number argument (would be baked into the graph)", f"{name}={v!r}")


# ---------------------------------------------------------------------------------------------- host constants


def _norm_device(dev: Any) -> torch.device | None:
    if dev is None:
        return None
    try:
        d = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
    except Exception:
        return None
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def _freeze_data(x: Any) -> Any:
    """An exact, hashable form of host data given to ``torch.tensor`` (None: not something we key)."""
    tx = type(x)
    if tx in (bool, int, str) or x is None:
        return (tx, x)
    if tx is float:
        return (float, x.hex())
    if tx is complex:
        return (complex, x.real.hex(), x.imag.hex())
    if tx is list or tx is tuple:
        out = []
        for v in x:
            f = _freeze_data(v)
            if f is None:
                return None
            out.append(f)
        return (tx, tuple(out))
    if isinstance(x, torch.Tensor) and x.device.type == "cpu" and type(x) is torch.Tensor:
        flat = x.detach().reshape(-1).contiguous()
        raw = flat.tolist() if flat.dtype == torch.bool else flat.view(torch.uint8).tolist()
        return ("tensor", flat.dtype, tuple(x.shape), bytes(raw))
    if type(x).__module__ == "numpy" and hasattr(x, "tobytes"):
        return ("numpy", str(getattr(x, "dtype", "")), tuple(getattr(x, "shape", ())), x.tobytes())
    return None


class _HostConstants:
    """``torch.tensor`` / ``torch.as_tensor`` of host data onto a CUDA device, made capturable.

    Such a call is a pageable host-to-device copy followed by a synchronisation, which a capture refuses.
    diffusers' Qwen-Image forward makes it for values fixed by the signature (``modulate_index`` from
    ``img_shapes`` for ``zero_cond_t`` models, the text length next to a mask). In ``"record"`` mode (the
    warm-up) the real function runs and a copy of its device result is kept under an exact key (the data, the
    dtype, the device, the other keywords); in ``"replay"`` mode (the capture) the same call is answered by a
    device-to-device clone of that copy, which the graph records like any kernel. A call without a recorded
    twin runs the real function (and fails the capture if it copies from the host: the signature then runs
    eager). The functions are swapped on the ``torch`` module itself for the duration of the warm-up and of
    the capture only: swapping a module's ``torch`` global instead would break torch.compile's guards on it.
    Calls from elsewhere in that window behave exactly as the real ones (a twin is the same value).
    """

    _lock = threading.RLock()
    device_types: tuple[str, ...] = ("cuda",)

    def __init__(self) -> None:
        self.recorded: dict[Any, list[torch.Tensor]] = {}
        self.used: collections.Counter = collections.Counter()
        self.mode: str | None = None
        self.hits = 0

    def tensors(self) -> list[torch.Tensor]:
        return [x for lst in self.recorded.values() for x in lst]

    def _key(self, fname: str, data: Any, args: tuple, kwargs: dict) -> tuple | None:
        if isinstance(data, torch.Tensor) and data.device.type != "cpu":
            return None  # no host copy involved
        if fname == "as_tensor":
            names = ("dtype", "device")
            kw = dict(zip(names, args))
            if len(args) > len(names):
                return None
        elif args:
            return None
        else:
            kw = {}
        kw.update(kwargs)
        dev = _norm_device(kw.get("device"))
        if dev is None or dev.type not in self.device_types:
            return None
        frozen = _freeze_data(data)
        if frozen is None:
            return None
        rest = []
        for k in sorted(kw):
            v = kw[k]
            if k == "device" or v is None:  # None is the default: the same call as without it
                continue
            if type(v) not in _ATOMS:
                return None
            rest.append((k, type(v), v))
        return (fname, frozen, dev, tuple(rest))

    def _wrap(self, fname: str, real: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
            key = None
            if self.mode is not None and not torch.compiler.is_compiling():
                try:
                    key = self._key(fname, data, args, kwargs)
                except Exception:
                    key = None
            if key is not None and self.mode == "replay":
                lst = self.recorded.get(key)
                i = self.used[key]
                if lst and i < len(lst):
                    self.used[key] += 1
                    self.hits += 1
                    return lst[i].clone()
            out = real(data, *args, **kwargs)
            if key is not None and self.mode == "record" and type(out) is torch.Tensor:
                self.recorded.setdefault(key, []).append(out.detach().clone())
            return out

        wrapper.__wrapped__ = real  # type: ignore[attr-defined]
        return wrapper

    def active(self, mode: str) -> "_Swap":
        return _Swap(self, mode)


class _Swap:
    """Context manager: ``torch.tensor`` / ``torch.as_tensor`` go through a :class:`_HostConstants`."""

    def __init__(self, consts: _HostConstants, mode: str) -> None:
        self.consts, self.mode = consts, mode
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> _HostConstants:
        if not _HostConstants._lock.acquire(timeout=60):
            raise RuntimeError("another CUDA-graph capture holds torch.tensor")
        try:
            for name in ("tensor", "as_tensor"):
                real = getattr(torch, name)
                self.saved[name] = real
                setattr(torch, name, self.consts._wrap(name, real))
            self.consts.mode = self.mode
            if self.mode == "replay":
                self.consts.used.clear()
        except BaseException:
            self._restore()
            raise
        return self.consts

    def _restore(self) -> None:
        try:
            for name, real in self.saved.items():
                setattr(torch, name, real)
            self.consts.mode = None
        finally:
            _HostConstants._lock.release()

    def __exit__(self, *exc: Any) -> None:
        self._restore()


class _KeepRope:
    """During a capture, keep every tensor diffusers' RoPE module hands out from its caches.

    ``QwenEmbedRope._compute_video_freqs`` is an LRU cache (128 entries, shared by all instances): a graph
    reads the cached tensor, and an eviction would free memory the graph still reads. Holding a reference
    per graph keeps it valid. Instance attributes shadow the cached methods for the capture only.
    """

    def __init__(self, transformer: nn.Module, keep: list[torch.Tensor]) -> None:
        self.pe = getattr(transformer, "pos_embed", None)
        self.keep = keep
        self.names: list[str] = []

    def __enter__(self) -> None:
        pe = self.pe
        if not isinstance(pe, nn.Module):
            return
        for name in _ROPE_METHODS:
            if name in pe.__dict__ or not callable(getattr(type(pe), name, None)):
                continue
            bound = getattr(pe, name)

            def wrapper(*a: Any, _f: Callable = bound, **k: Any) -> Any:
                out = _f(*a, **k)
                for x in out if isinstance(out, tuple) else (out,):
                    if isinstance(x, torch.Tensor):
                        self.keep.append(x)
                return out

            object.__setattr__(pe, name, wrapper)
            self.names.append(name)

    def __exit__(self, *exc: Any) -> None:
        for name in self.names:
            self.pe.__dict__.pop(name, None)


# ---------------------------------------------------------------------------------------------- outputs


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) is tuple or type(x) is list:
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        items = {k: _map_tensors(v, fn) for k, v in x.items()}
        try:
            return type(x)(**items)  # diffusers BaseOutput (a dataclass + OrderedDict)
        except TypeError:
            return type(x)(items)
    return x


def _tensors_in(x: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map_tensors(x, out.append)
    return out


def _static_like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor with ``x``'s shape, strides, dtype, device and address modulo ``_ALIGN``: kernels pick
    vectorized or scalar paths by alignment, so a static buffer aligned differently could change the bits."""
    if x.numel() == 0:
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    es = x.element_size()
    base = torch.empty(span + _ALIGN // es, dtype=x.dtype, device=x.device)
    off = ((x.data_ptr() - base.data_ptr()) % _ALIGN) // es  # both addresses are multiples of es
    return base.as_strided(x.shape, x.stride(), off)


class _Graph:
    """One captured signature."""

    __slots__ = ("graph", "statics", "out", "keep", "desc", "replays", "capture_ms")

    def __init__(self, graph: Any, statics: list[torch.Tensor], out: Any, keep: list[torch.Tensor], desc: str,
                 capture_ms: float) -> None:
        self.graph, self.statics, self.out, self.keep, self.desc = graph, statics, out, keep, desc
        self.replays = 0
        self.capture_ms = capture_ms


# ---------------------------------------------------------------------------------------------- the runner


class GraphedCall:
    """The transformer's ``forward`` in CUDA-graph mode (see the module docstring). Create with :func:`install`."""

    __slots__ = (
        "__weakref__", "_transformer", "_inner", "_prev", "_prev_present", "_positional", "fallbacks", "max_graphs",
        "_graphs", "_pools", "_streams", "_scan", "_dirty", "_failed", "_removed", "_busy", "_unstable",
        "_unreplayed", "_logged", "captures", "replays", "eager_calls", "evictions", "refusals", "invalidations",
        "capture_failures", "_host_us", "_host_n",
    )

    def __init__(self, transformer: nn.Module, fallbacks: collections.Counter, max_graphs: int) -> None:
        self._transformer = transformer
        self.fallbacks = fallbacks
        self.max_graphs = int(max_graphs)
        d = transformer.__dict__
        self._prev_present = "forward" in d
        self._prev = d.get("forward")
        self._inner = self._prev if self._prev_present else type(transformer).forward.__get__(transformer)
        self._setup()

    def _setup(self) -> None:
        """Fresh runtime state (also after deepcopy and unpickling: graphs are never shared or saved)."""
        self._positional = _positional_names(type(self._transformer))
        self._graphs: collections.OrderedDict[Any, _Graph] = collections.OrderedDict()
        self._pools: dict[torch.device, Any] = {}
        self._streams: dict[torch.device, Any] = {}
        self._scan: _Scan | None = None
        self._dirty: str | None = None
        self._failed: dict[Any, str] = {}
        self._removed = False
        self._busy = False
        self._unstable = False
        self._unreplayed = 0
        self._logged: set[str] = set()
        self.captures = self.replays = self.eager_calls = self.evictions = 0
        self.refusals: collections.Counter = collections.Counter()
        self.invalidations: collections.Counter = collections.Counter()
        self.capture_failures: collections.Counter = collections.Counter()
        self._host_us = 0.0
        self._host_n = 0
        _ensure_registration_hooks()
        _LIVE.add(self)

    # ------------------------------------------------------------------ the call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._removed or self._busy or torch.compiler.is_compiling():
            return self._inner(*args, **kwargs)
        t0 = time.perf_counter()
        if torch.is_grad_enabled():
            return self._eager("grad enabled", "", args, kwargs)
        t = self._transformer
        if t.training:
            return self._eager("module in training mode", "", args, kwargs)
        root = _root_reason(t)
        if root is not None:
            self._drop(f"refused: {root[0]}", count=False, track=False)  # offloading needs the memory back
            return self._eager(root[0], root[1], args, kwargs)
        try:
            call = _Call(args, kwargs, self._positional)
        except _Refusal as r:
            return self._eager(r.reason, r.detail, args, kwargs)
        scan = self._current_scan()
        if scan.refusal is not None:
            return self._eager(scan.refusal, scan.detail, args, kwargs)
        if scan.device != call.device:
            return self._eager("model and inputs on different devices", f"{scan.device} vs {call.device}", args, kwargs)
        if self._unstable:
            return self._eager("model state changes on every call", "", args, kwargs)
        entry = self._graphs.get(call.key)
        if entry is not None:
            out = self._replay(entry, call)
            self._host_us += (time.perf_counter() - t0) * 1e6
            self._host_n += 1
            return out
        if call.key in self._failed:
            return self._eager("capture failed (this signature runs eager)", self._failed[call.key], args, kwargs)
        return self._capture(call)

    def _eager(self, reason: str, detail: str, args: tuple, kwargs: dict) -> Any:
        self.fallbacks[PREFIX + reason] += 1
        self.refusals[reason] += 1
        self.eager_calls += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("qwen_absorb: CUDA graph refused, running eager: %s%s", reason, f" ({detail})" if detail else "")
        return self._inner(*args, **kwargs)

    def _current_scan(self) -> _Scan:
        """The snapshot graphs are valid for; rebuilt (and graphs dropped) when the model changed."""
        scan = self._scan
        if scan is not None:
            what = scan.changed()
            if what is None:
                return scan
            if scan.sticky and what.startswith("weights") and not self._graphs:
                # Refused for a hook (e.g. layerwise casting, which recasts the weights on every call): the
                # structure is unchanged, so the verdict stands; only the tensor values are taken anew.
                scan._take()
                return scan
            detail = scan.which()
            reason = what + (f" ({detail})" if detail else "")
        else:
            reason = self._dirty or "first scan"
        self._dirty = None
        if self._graphs:
            self._drop(reason)
        self._scan = scan = _Scan(self._transformer)
        return scan

    def _replay(self, entry: _Graph, call: _Call) -> Any:
        self._graphs.move_to_end(call.key)
        for s, x in zip(entry.statics, call.tensors):
            s.copy_(x)
        entry.graph.replay()
        entry.replays += 1
        self.replays += 1
        self._unreplayed = 0
        return _map_tensors(entry.out, torch.Tensor.clone)

    def _capture(self, call: _Call) -> Any:
        dev = call.device
        desc = call.describe(self._positional)
        with torch.cuda.device(dev):
            cur = torch.cuda.current_stream()
            statics = [_static_like(x) for x in call.tensors]
            for s, x in zip(statics, call.tensors):
                s.copy_(x)
            it = iter(statics)
            s_args = _thaw(call.spec[0], it)
            s_kwargs = {k: _thaw(v, it) for k, v in call.spec[1]}
            side = self._streams.get(dev)
            if side is None:
                side = self._streams[dev] = torch.cuda.Stream(dev)
            consts = _HostConstants()
            self._busy = True
            try:
                # Warm-up on the side stream the capture will use (lazy per-stream state such as cuBLAS
                # workspaces is created outside the graph). Its output answers this call.
                side.wait_stream(cur)
                with torch.cuda.stream(side), consts.active("record"):
                    warm = self._inner(*s_args, **s_kwargs)
                cur.wait_stream(side)
                statics_storage = {s.untyped_storage().data_ptr() for s in statics}

                def own(x: torch.Tensor) -> torch.Tensor:
                    if x.untyped_storage().data_ptr() in statics_storage:
                        return x.clone()  # never hand out a static buffer
                    if x.is_cuda:
                        x.record_stream(cur)  # allocated on the side stream, used and freed on the caller's
                    return x

                warm = _map_tensors(warm, own)
                graph = torch.cuda.CUDAGraph()
                keep: list[torch.Tensor] = []
                pool = self._pools.get(dev)
                if pool is None:
                    pool = self._pools[dev] = torch.cuda.graph_pool_handle()
                t0 = time.perf_counter()
                try:
                    # The outer stream context restores the caller's stream even if capture_end raises
                    # (torch.cuda.graph.__exit__ skips its own stream restore then).
                    with torch.cuda.stream(side), consts.active("replay"), _KeepRope(self._transformer, keep):
                        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                            out = self._inner(*s_args, **s_kwargs)
                except Exception as e:  # noqa: BLE001 - any capture failure means: eager for this signature
                    self._capture_failed(call, desc, e)
                    return warm
                finally:
                    cur.wait_stream(side)
                ms = (time.perf_counter() - t0) * 1e3
            finally:
                self._busy = False
        entry = _Graph(graph, statics, out, keep + consts.tensors(), desc, ms)
        self._insert(call.key, entry)
        self.captures += 1
        log.info("qwen_absorb: captured CUDA graph %d/%d in %.0f ms: %s (%d host constants)",
                 len(self._graphs), self.max_graphs, ms, desc, consts.hits)
        # Lazy state set by the warm-up or the capture itself (plans decided on first run, caches) is part
        # of what this graph saw: take the snapshot now. If it moved, older graphs may be stale: drop them.
        scan = self._scan
        what = scan.changed() if scan is not None else (self._dirty or "changed during capture")
        if what is not None:
            for k in [k for k in self._graphs if k != call.key]:
                self._evict(k, count=False)
            self._scan = new = _Scan(self._transformer)
            self._dirty = None
            if new.refusal is not None:
                self._drop(f"refused after capture: {new.refusal}")
        return warm

    def _capture_failed(self, call: _Call, desc: str, e: BaseException) -> None:
        self._failed[call.key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        self.capture_failures[type(e).__name__] += 1
        self.fallbacks[PREFIX + "capture failed (this signature runs eager)"] += 1
        self.refusals["capture failed (this signature runs eager)"] += 1
        self.eager_calls += 1
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        if "capture failed" not in self._logged:
            self._logged.add("capture failed")
            log.warning("qwen_absorb: CUDA graph capture failed for %s (%s); this signature runs eager from now on",
                        desc, self._failed[call.key])
        else:
            log.debug("qwen_absorb: CUDA graph capture failed for %s (%s)", desc, self._failed[call.key])

    # ------------------------------------------------------------------ graph bookkeeping

    def _insert(self, key: Any, entry: _Graph) -> None:
        while len(self._graphs) >= self.max_graphs:
            self._evict(next(iter(self._graphs)), count=True)
        self._graphs[key] = entry

    def _sync(self) -> None:
        """Wait for in-flight replays before their graphs, static buffers and pool memory are released."""
        if self._graphs and torch.cuda.is_available() and torch.cuda.is_initialized():
            for dev in {s.device for g in self._graphs.values() for s in g.statics[:1]}:
                torch.cuda.synchronize(dev)

    def _evict(self, key: Any, count: bool) -> None:
        self._sync()
        del self._graphs[key]
        if count:
            self.evictions += 1

    def _drop(self, reason: str, count: bool = True, track: bool = True) -> None:
        """Drop every graph (and the pools: memory goes back to the allocator).

        ``track``: a drop caused by a state change; if it keeps hitting graphs that were never replayed,
        the model changes on every call and capturing is pointless (the runner turns itself off)."""
        if not self._graphs:
            return
        self._sync()
        if track and any(g.replays == 0 for g in self._graphs.values()):
            self._unreplayed += 1
            if self._unreplayed >= _MAX_UNREPLAYED_INVALIDATIONS and not self._unstable:
                self._unstable = True
                log.warning("qwen_absorb: CUDA graphs were invalidated before any replay %d times in a row (%s); "
                            "graph mode stays off for this model (invalidate() re-enables it)",
                            self._unreplayed, reason)
        self._graphs.clear()
        self._pools.clear()
        if count:
            self.invalidations[reason] += 1
        log.info("qwen_absorb: dropped CUDA graphs: %s", reason)

    # ------------------------------------------------------------------ public API

    def invalidate(self, reason: str = "invalidate() called") -> None:
        """Drop all graphs; the next call of each signature captures anew (also re-enables an unstable runner)."""
        self._drop(reason, count=False, track=False)
        self.invalidations[reason] += 1
        self._unstable = False
        self._unreplayed = 0
        self._scan = None
        self._dirty = reason

    def remove(self) -> None:
        """Put the previous forward back exactly where this runner sits, and drop everything."""
        if self._removed:
            return
        t = self._transformer
        d = t.__dict__
        restored = False
        if d.get("forward") is self:
            if self._prev_present:
                object.__setattr__(t, "forward", self._prev)
            else:
                del d["forward"]
            restored = True
        else:  # something wrapped us after install: we sit inside its chain
            for get, set_ in _slots(t):
                if get() is self:
                    set_(self._inner)
                    restored = True
                    break
        if not restored:
            log.warning("qwen_absorb: the CUDA-graph forward of %s was not found in its hook chain; it stays as "
                        "a pass-through", type(t).__name__)
        self._drop("remove()", count=False, track=False)
        self._failed.clear()
        self._streams.clear()
        self._scan = None
        self._removed = True
        _LIVE.discard(self)

    def describe(self) -> dict[str, Any]:
        """JSON-able status: graphs held, captures, replays, refusals, invalidations, limits."""
        return {
            "installed": not self._removed,
            "max_graphs": self.max_graphs,
            "graphs": len(self._graphs),
            "signatures": [g.desc for g in self._graphs.values()],
            "captures": self.captures,
            "replays": self.replays,
            "eager_calls": self.eager_calls,
            "evictions": self.evictions,
            "refusals": dict(self.refusals),
            "invalidations": dict(self.invalidations),
            "capture_failures": dict(self.capture_failures),
            "failed_signatures": len(self._failed),
            "unstable": self._unstable,
            "capture_ms": [round(g.capture_ms, 1) for g in self._graphs.values()],
            "host_us_per_replay": round(self._host_us / self._host_n, 1) if self._host_n else None,
            "outputs": "clone",
        }

    @property
    def __signature__(self) -> Any:
        import inspect  # noqa: PLC0415

        return inspect.signature(self._inner)

    def __repr__(self) -> str:
        return (f"<qwen_absorb GraphedCall on {type(self._transformer).__name__}: {len(self._graphs)}/"
                f"{self.max_graphs} graphs, {self.captures} captures, {self.replays} replays"
                f"{', removed' if self._removed else ''}>")

    # ------------------------------------------------------------------ copy / pickle

    def __deepcopy__(self, memo: dict) -> "GraphedCall":
        new = GraphedCall.__new__(GraphedCall)
        memo[id(self)] = new
        new._transformer = copy.deepcopy(self._transformer, memo)
        new.fallbacks = copy.deepcopy(self.fallbacks, memo)
        new.max_graphs = self.max_graphs
        new._prev_present = self._prev_present
        new._prev = copy.deepcopy(self._prev, memo)
        new._inner = copy.deepcopy(self._inner, memo)
        new._setup()
        new._removed = self._removed
        if new._removed:
            _LIVE.discard(new)
        return new

    def __getstate__(self) -> dict[str, Any]:
        t = self._transformer
        inner = self._inner
        cls_forward = getattr(inner, "__func__", None) is type(t).forward and getattr(inner, "__self__", None) is t
        return {
            "transformer": t, "fallbacks": self.fallbacks, "max_graphs": self.max_graphs,
            "prev_present": self._prev_present, "prev": self._prev,
            "inner": None if cls_forward else self._inner, "removed": self._removed,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        t = state["transformer"]
        self._transformer = t
        self.fallbacks = state["fallbacks"]
        self.max_graphs = state["max_graphs"]
        self._prev_present = state["prev_present"]
        self._prev = state["prev"]
        inner = state["inner"]
        self._inner = inner if inner is not None else type(t).forward.__get__(t)
        self._setup()
        self._removed = state["removed"]
        if self._removed:
            _LIVE.discard(self)


def _positional_names(cls: type) -> tuple[str, ...]:
    import inspect  # noqa: PLC0415

    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _slots(t: nn.Module) -> Iterator[tuple[Callable[[], Any], Callable[[Any], None]]]:
    """Hook-chain places that may hold the runner after something wrapped it: (get, set)."""
    d = t.__dict__
    reg = d.get("_diffusers_hook")
    for ref in getattr(reg, "_fn_refs", None) or []:
        for attr in ("original_forward", "forward"):
            yield (lambda r=ref, a=attr: getattr(r, a, None)), (lambda f, r=ref, a=attr: setattr(r, a, f))
    if "_old_forward" in d:
        yield (lambda: d.get("_old_forward")), (lambda f: object.__setattr__(t, "_old_forward", f))


def _resolve(target: Any) -> nn.Module:
    target = getattr(target, "_orig_mod", target)
    if isinstance(target, nn.Module):
        return target
    inner = getattr(target, "transformer", None)
    if isinstance(inner, nn.Module):
        return inner
    raise TypeError(f"install needs a transformer module (or a pipeline with .transformer); "
                    f"got {type(target).__name__}")


def install(transformer: nn.Module, *, fallbacks: collections.Counter, max_graphs: int = 8) -> GraphedCall:
    """Put CUDA-graph mode on ``transformer`` (a ``QwenImageTransformer2DModel``, patched or not, or a
    pipeline holding one) and return its :class:`GraphedCall`.

    fallbacks: a ``Counter`` to count refused calls in, by reason (``"cuda_graph: grad enabled"``, ...);
        ``qwen_absorb.patch`` passes its report's ``runtime_fallbacks``.
    max_graphs: graphs kept at most (one per input signature; least recently used dropped first).

    Installing twice returns the runner already installed. ``GraphedCall.remove()`` undoes it exactly.
    """
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    if not isinstance(fallbacks, collections.Counter):
        raise TypeError(f"fallbacks must be a collections.Counter, got {type(fallbacks).__name__}")
    t = _resolve(transformer)
    current = t.__dict__.get("forward")
    if isinstance(current, GraphedCall) and not current._removed:
        log.debug("qwen_absorb: CUDA-graph mode already installed on %s", type(t).__name__)
        return current
    runner = GraphedCall(t, fallbacks, max_graphs)
    object.__setattr__(t, "forward", runner)
    log.info("qwen_absorb: CUDA-graph mode installed on %s (max %d graphs)", type(t).__name__, max_graphs)
    return runner
