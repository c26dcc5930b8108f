"""Where the original weights of real-FP8 linears live: on the host while their FP8 codes run on the GPU.

A linear that runs as a real FP8 GEMM reads only its plan's e4m3 codes (:func:`qwen_absorb.quant.make_fp8_weight`);
its original weight (bf16 for a model from ``mtq.quantize`` or ``mto.restore``) is needed only by what the plan
does not run: diffusers' / ModelOpt's forward on a fallback call, a rebuild of the codes after an amax or weight
change, ``fuse_lora``, ``state_dict``, ``unpatch``. Keeping it on the GPU doubles the model's memory (a
60-layer model: 38 GiB of bf16 beside 19 GiB of codes). So, by default (``offload_original_weights="auto"``),
after every decision of a block (:func:`place`):

- a linear that runs as a real FP8 GEMM on an accelerator keeps its weight ``Parameter`` (same object, values
  intact) with its data in host memory;
- a linear that may run so once the model is on a GPU (patched on the CPU: ``.to("cuda")`` or an offload hook
  comes next) keeps it on the host too, so the move never brings it to the GPU;
- every other linear's weight is where the model is (a host-kept one goes back there).

The weight's module gets a :class:`HostWeight` as its instance ``_apply`` (what ``Module.to`` / ``.cuda()`` /
``.half()`` call on every submodule): the module's other tensors move as before, the weight takes dtype changes
on the host and stays there on a move to an accelerator; the block's derived FP8 codes are released when the
model leaves the device they were built for (accelerate's model offload moves the whole transformer to the CPU
after the denoising loop), so nothing of the transformer stays on the GPU. A call that runs the block's original
forward brings the host-kept weights to the call's device for that call only (:func:`onloaded`); outputs are the
unpatched model's. A ModelOpt compressed model (``mtq.compress``) has FP8 storage already: its codes are that
storage (nothing is duplicated) and nothing moves. ``unpatch`` puts every weight back on the device the model is on
(:func:`restore`). ``offload_original_weights=False``: weights stay where the model keeps them (two copies on the
GPU). Linears under an offloading or casting hook are left to the hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import hooks, quant
from .parallel import is_dtensor
from .plan import PLAN_ATTR, BlockPlan, refresh
from .sites import LINEAR_TABLE, resolve, unwrap_peft

HOST = torch.device("cpu")
# Device types whose memory the originals are kept out of; the CPU tests add "cpu" to exercise the logic.
ACCELERATOR_TYPES: tuple[str, ...] = ("cuda",)
# The block's list of its HostWeight objects (the modules whose weight this patch keeps on the host).
HOST_ATTR = "_qwen_absorb_host_weights"


class HostWeight:
    """The ``_apply`` of a linear whose weight the patch keeps in host memory: ``Module._apply`` for everything
    but the weight; the weight takes dtype changes on the host, and follows a move only off the accelerators.
    ``device`` is where the weight would be without the patch (the model's device)."""

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

    def __getstate__(self) -> tuple:
        return (self.module, self.device, self.block)

    def __setstate__(self, state: tuple) -> None:
        self.module, self.device, self.block = state

    def __repr__(self) -> str:
        return f"<qwen_absorb host-kept weight of {type(self.module).__name__} (model on {self.device})>"


def _release(block: nn.Module, device: torch.device) -> None:
    """The model moved to ``device``: FP8 codes the block's plan built for another device are dropped (they
    would keep GPU memory while the model sits on the CPU); the block decides anew at its next call."""
    plan: BlockPlan | None = block.__dict__.get(PLAN_ATTR)
    if plan is None or plan.rt.device is None or plan.rt.device == device:
        return
    with plan.rt.lock:
        for lp in plan.linears.values():
            lp.weight, lp.cache_key = None, ()
        plan.rt.device = None  # the next call decides for its own device (qwen_absorb.block._call_check)
        plan.rt.generation += 1  # graphs that read the dropped codes are stale


def _managed_by_hooks(block: nn.Module) -> bool:
    """An offloading or layerwise-casting hook moves or recasts the block's weights itself: it owns them."""
    return any(hooks.weight_moving(m) is not None for m in block.modules())


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
    return (plan.options.fp8_gemm is not False and w is not None and w.device == HOST
            and type(w).__name__ != "QTensorWrapper" and not quant.fp8_gemm_reasons(m))


def place(plan: BlockPlan, block: nn.Module) -> None:
    """Put each real-FP8 linear's original weight where the decision wants it (see the module doc); a weight
    moved retakes the plan's watch, so the move is not seen as a change of the model."""
    mode = plan.options.offload_original_weights
    kept: list[HostWeight] = block.__dict__.get(HOST_ATTR, [])
    by_module = {id(h.module): h for h in kept}
    managed = mode is not False and _managed_by_hooks(block)
    moved = False
    for path in LINEAR_TABLE:
        base = unwrap_peft(resolve(block, path))[0]
        if base is None or base._parameters.get("weight") is None:
            continue
        h = by_module.pop(id(base), None)
        if not managed and wanted(mode, plan, block, path):
            w = base._parameters["weight"]
            if h is None:
                h = HostWeight(base, w.device, block)
                object.__setattr__(base, "_apply", h)
            if not any(x is h for x in kept):
                kept.append(h)
            if w.device != HOST:
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
    """``w.data = new`` as ``Module._apply`` does it: in place where the tensor types allow (CPU <-> CUDA), else a
    new ``Parameter`` (e.g. to or from the meta device, as ``.to()`` of the unpatched model would make)."""
    if torch._has_compatible_shallow_copy_type(w.data, new):
        w.data = new
    else:
        m._parameters["weight"] = nn.Parameter(new, requires_grad=w.requires_grad)


class AfterDecide:
    """A patched block's ``BlockRuntime.on_decide``: :func:`place` (once the block is installed:
    ``plan.patched``), then the report's record. A plain object holding the block, so that a copy of the
    model rebinds it."""

    __slots__ = ("record", "block")

    def __init__(self, record: Any, block: nn.Module) -> None:
        self.record, self.block = record, block

    def __call__(self, plan: BlockPlan) -> None:
        if plan.patched:
            place(plan, self.block)
        if self.record is not None:
            self.record(plan)

    def __getstate__(self) -> tuple:
        return (self.record, self.block)

    def __setstate__(self, state: tuple) -> None:
        self.record, self.block = state


def _adapters_to(module: nn.Module | None, device: torch.device) -> bool:
    """PEFT put the adapters of a layer loaded while its base weight was on the host there
    (``_move_adapter_to_device_of_base_layer``): where the base weight is now, as PEFT would have."""
    moved = False
    for wrapper in unwrap_peft(module)[1]:
        for name, p in wrapper.named_parameters():
            if not name.startswith("base_layer.") and p.device == HOST and device != HOST:
                p.data = p.data.to(device)
                moved = True
    return moved


def restore(block: nn.Module) -> None:
    """Every host-kept weight of ``block`` back on the model's device (``unpatch``)."""
    for h in block.__dict__.pop(HOST_ATTR, []):
        _put_back(h)


@contextlib.contextmanager
def onloaded(block: nn.Module, device: torch.device) -> Iterator[None]:
    """The block's host-kept weights on ``device`` for one call of its original forward (a fallback), then
    the same host tensors again (nothing the plan watches changes)."""
    kept = block.__dict__.get(HOST_ATTR)
    if not kept:
        yield
        return
    held = []
    try:
        for h in kept:
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
    out = []
    for block in getattr(transformer, "transformer_blocks", []):
        for h in block.__dict__.get(HOST_ATTR, ()):
            w = h.module._parameters.get("weight")
            if w is not None and w.device == HOST:
                out.append(w)
    return out


__all__ = ["ACCELERATOR_TYPES", "AfterDecide", "HOST", "HOST_ATTR", "HostWeight", "host_weights", "onloaded", "place",
           "restore", "wanted"]
