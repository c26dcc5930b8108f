"""Where the original weights of real-FP8 linears live: on the host while their FP8 codes run on the GPU.

The original weight serves only what the plan does not run (a fallback, a rebuild of the codes, ``state_dict``,
``unpatch``); on the GPU it would double the model's memory. So after every decision of a block (:func:`place`), a
real-FP8 linear keeps its weight ``Parameter`` (same object) with its data on the host; its :class:`HostWeight`
``_apply`` keeps it there on ``Module.to`` and drops the FP8 codes when the model leaves their device. A call of the
original forward brings the weights over for that call only (:func:`onloaded`); hooked linears are left to the hook."""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import hooks, host_codes, quant
from .host_codes import HOST
from .parallel import is_dtensor
from .plan import PLAN_ATTR, BlockPlan, refresh
from .sites import LINEAR_TABLE, QWENIMAGE, family_of, resolve, unwrap_peft

# Device types whose memory the originals are kept out of; the CPU tests add "cpu" to exercise the logic.
ACCELERATOR_TYPES: tuple[str, ...] = ("cuda",)
# The block's list of its HostWeight objects (the modules whose weight this patch keeps on the host).
HOST_ATTR = "_qwen_absorb_host_weights"


class HostWeight:
    """The ``_apply`` of a linear whose weight is kept on the host; ``device``: the model's device."""

    __slots__ = ("module", "device", "block", "__weakref__")

    def __init__(self, module: nn.Module, device: torch.device, block: nn.Module) -> None:
        self.module, self.device, self.block = module, device, block

    def __call__(self, fn: Any, recurse: bool = True) -> nn.Module:
        m = self.module
        w = m._parameters.get("weight")
        if w is None:
            return type(m)._apply(m, fn, recurse)
        m._parameters["weight"] = None  # Module._apply skips a None entry
        try:
            type(m)._apply(m, fn, recurse)
        finally:
            m._parameters["weight"] = w
        with torch.no_grad():
            probe = fn(torch.empty(0, dtype=w.dtype))  # where and in which dtype the model's tensors go
        if not isinstance(probe, torch.Tensor):
            return m
        if probe.device.type not in ACCELERATOR_TYPES and probe.device != w.device:
            _set_data(m, w, w.data.to(probe.device, probe.dtype))  # off the accelerators: as unpatched
        elif probe.dtype != w.dtype:
            w.data = w.data.to(dtype=probe.dtype)  # a dtype move, on the host
        if probe.device != self.device:
            self.device = probe.device
            _release(self.block, probe.device)
        return m

    def __repr__(self) -> str:
        return f"<qwen_absorb host-kept weight of {type(self.module).__name__} (model on {self.device})>"


def _release(block: nn.Module, device: torch.device) -> None:
    """The model moved to ``device``: FP8 codes built for another device are dropped; the block decides anew."""
    plan: BlockPlan | None = block.__dict__.get(PLAN_ATTR)
    if plan is None or plan.rt.device is None or plan.rt.device == device or plan.rt.moving:
        return  # (moving: the block's own BlockMove decides)
    with plan.rt.lock:
        _drop_codes(plan, block)
        for lp in plan.linears.values():
            lp.cache_key = ()
        plan.rt.device = None  # the next call decides for its own device (qwen_absorb.block._call_check)


def _drop_codes(plan: BlockPlan, block: nn.Module) -> None:
    host_codes.keep(plan, block)  # before the codes go: a return with unchanged sources copies them back
    for lp in plan.linears.values():
        lp.weight = lp.input_scale = None
    plan.rt.generation += 1  # graphs that read the dropped codes are stale


class BlockMove:
    """A patched Qwen-Image block's ``_apply``. A device move alone (``.to(device)``, model offload's hook) with
    nothing changed since the block's last decision keeps the decisions: leaving the device they were made for drops
    the FP8 codes (:func:`plan.rebuild_codes` makes them again at the first call back there); only the watch is
    taken anew. Anything else (a dtype, a change before the move, NVFP4, tensor-parallel or hooked-attention state,
    ``Tuning(move_keeps_decisions=False)``) releases the block as before: it decides anew at its next call."""

    __slots__ = ("block", "__weakref__")

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, fn: Any, recurse: bool = True) -> nn.Module:
        block = self.block
        plan: BlockPlan | None = block.__dict__.get(PLAN_ATTR)
        if plan is None or plan.rt.device is None:
            return type(block)._apply(block, fn, recurse)
        rt = plan.rt
        with rt.lock, torch.no_grad():
            to, only = _destination(block, fn)
            keep = only and _keeps(plan) and not rt.watch.changed()
            rt.moving = keep
            try:
                out = type(block)._apply(block, fn, recurse)
            finally:
                rt.moving = False
            if keep:
                if to != rt.device and not rt.codes_gone:
                    _drop_codes(plan, block)
                    rt.codes_gone = True
                rt.watch.take()
            elif to is not None:
                _release(block, to)
        return out


def _destination(block: nn.Module, fn: Any) -> tuple[torch.device | None, bool]:
    """Where ``fn`` puts the block's tensors, and whether that is all it changes (not their dtype)."""
    to, only = None, True
    for dtype in {p.dtype for p in block.parameters()} or {torch.float32}:
        probe = fn(torch.empty(0, dtype=dtype))
        if not isinstance(probe, torch.Tensor):
            return None, False
        only = only and probe.dtype == dtype and to in (None, probe.device)
        to = probe.device
    return to, only


def _keeps(plan: BlockPlan) -> bool:
    """Whether the plan's derived state is its FP8 codes alone (what a move may drop and a return rebuild)."""
    rt = plan.rt
    return (plan.options.tuning.move_keeps_decisions and plan.patched and rt.stale is None and not plan.nvfp4
            and not plan.attn_forwards and not rt.linear_fwds and all(lp.tp is None for lp in plan.linears.values()))


def wanted(mode: str | bool, plan: BlockPlan, block: nn.Module, path: str) -> bool:
    """Whether the original weight of ``path`` belongs on the host after ``plan``'s decision."""
    if mode is False:
        return False
    lp = plan.linears.get(path)
    dev = plan.rt.device
    m = resolve(block, path)
    base, wrappers = unwrap_peft(m)
    w = base._parameters.get("weight") if base is not None else None
    if lp is None or dev is None or wrappers or w is None or is_dtensor(w):
        return False  # LoRA: PEFT merges into the base weight on its device; a DTensor: its mesh owns it
    if dev.type in ACCELERATOR_TYPES:
        return bool(lp.fp8_gemm and lp.weight is not None and not lp.weight.reused_storage)
    # not on an accelerator yet: keep a weight that is on the host there if it would run as an FP8 GEMM
    return (plan.options.fp8_gemm is not False and w.device == HOST
            and type(w).__name__ != "QTensorWrapper" and not quant.fp8_gemm_reasons(m))


def place(plan: BlockPlan, block: nn.Module) -> None:
    """Each real-FP8 linear's original weight where the decision wants it (a move retakes the plan's watch)."""
    mode = plan.options.offload_original_weights
    kept: list[HostWeight] = block.__dict__.get(HOST_ATTR, [])
    by_module = {id(h.module): h for h in kept}
    # an offloading or layerwise-casting hook moves or recasts the block's weights itself: it owns them
    managed = mode is not False and any(hooks.weight_moving(m) is not None for m in block.modules())
    moved = False
    for path in LINEAR_TABLE:
        base = unwrap_peft(resolve(block, path))[0]
        if base is None or base._parameters.get("weight") is None:
            continue
        h = by_module.pop(id(base), None)
        if not managed and wanted(mode, plan, block, path):
            w = base._parameters["weight"]
            if h is None:  # else it is in kept already (by_module was made from it)
                h = HostWeight(base, w.device, block)
                object.__setattr__(base, "_apply", h)
                kept.append(h)
            if w.device != HOST:
                with torch.inference_mode(False):  # a tensor with a version counter: watched without reading it
                    w.data = w.data.to(HOST)
                moved = True
            plan.linears[path].offloaded = True
        elif h is not None:
            plan.linears[path].offloaded = False
            moved |= _put_back(h)
            moved |= _adapters_to(resolve(block, path), h.device)
    for h in by_module.values():  # modules no longer at a linear's path (replaced): theirs back too
        moved |= _put_back(h)
    kept[:] = [h for h in kept if h.module.__dict__.get("_apply") is h]
    if kept:
        object.__setattr__(block, HOST_ATTR, kept)
    else:
        block.__dict__.pop(HOST_ATTR, None)
    if plan.patched and family_of(block) is QWENIMAGE and "_apply" not in block.__dict__:
        object.__setattr__(block, "_apply", BlockMove(block))
    if moved:
        refresh(plan, block)


def _put_back(h: HostWeight) -> bool:
    """The weight back on the model's device, the module's own ``_apply`` again; True if data moved."""
    m = h.module
    if m.__dict__.get("_apply") is h:
        del m.__dict__["_apply"]
    w = m._parameters.get("weight")
    if w is not None and w.device == HOST and h.device != HOST:  # elsewhere (meta): a hook moved it since
        _set_data(m, w, w.data.to(h.device))
        return True
    return False


def _set_data(m: nn.Module, w: nn.Parameter, new: torch.Tensor) -> None:
    """``w.data = new`` as ``Module._apply`` does it: in place where the tensor types allow, else a new Parameter."""
    if torch._has_compatible_shallow_copy_type(w.data, new):
        w.data = new
    else:
        m._parameters["weight"] = nn.Parameter(new, requires_grad=w.requires_grad)


def after_decide(record: Any, block: nn.Module, plan: BlockPlan) -> None:
    """A patched block's ``BlockRuntime.on_decide`` (a ``functools.partial``, which a copy of the model rebinds):
    :func:`place` once ``plan.patched``, then the report's ``record``."""
    if plan.patched:
        place(plan, block)
    record(plan)


def _adapters_to(module: nn.Module | None, device: torch.device) -> bool:
    """Adapters PEFT put on the host beside a host-kept base weight: to ``device``, as PEFT would have."""
    moved = False
    for wrapper in unwrap_peft(module)[1]:
        for name, p in wrapper.named_parameters():
            if not name.startswith("base_layer.") and p.device == HOST and device != HOST:
                p.data = p.data.to(device)
                moved = True
    return moved


def restore(block: nn.Module) -> None:
    """Every host-kept weight of ``block`` back on the model's device, and no codes kept on the host (``unpatch``)."""
    plan = block.__dict__.get(PLAN_ATTR)
    if plan is not None:
        plan.rt.host_codes.clear()
    for h in block.__dict__.pop(HOST_ATTR, []):
        _put_back(h)
    if isinstance(block.__dict__.get("_apply"), BlockMove):
        del block.__dict__["_apply"]


@contextlib.contextmanager
def onloaded(block: nn.Module, device: torch.device) -> Iterator[None]:
    """The block's host-kept weights on ``device`` for one call of its original forward, then the same host tensors."""
    held = []
    try:
        for h in block.__dict__.get(HOST_ATTR) or ():
            w = h.module._parameters.get("weight")
            if w is not None and w.device == HOST and device != HOST:
                held.append((w, w.data))
                w.data = w.data.to(device)
        yield
    finally:
        for w, host in held:
            w.data = host


def host_weights(transformer: nn.Module) -> list[torch.Tensor]:
    """The weights the patch keeps on the host now (the CUDA-graph runner allows them off the GPU)."""
    return [w for block in getattr(transformer, "transformer_blocks", []) for h in block.__dict__.get(HOST_ATTR, ())
            if (w := h.module._parameters.get("weight")) is not None and w.device == HOST]
