"""Tensor and context parallelism (diffusers 0.42.1) as the patched block sees it (``tests/parallel_worker.py``).

**TP**: q/k/v and ``net.0.proj`` (column-wise), ``to_out.0``, ``to_add_out`` and ``net.2`` (row-wise: ``b / N`` added
**before** the all-reduce) get DTensor Parameters; attention and FFN outputs are ``AsyncCollectiveTensor``s
(``data_ptr()`` 0). **CP**: inputs split on dim 1, all plain. Nothing here imports ``torch.distributed.tensor``."""

import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .hooks import global_hook_count
from .sites import unwrap_peft


def _is_loaded_instance(t: Any, module: str, name: str) -> bool:  # never imports module: unloaded, t cannot be one
    cls = None if is_plain_tensor(t) else getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(t, cls)


def is_plain_tensor(t: Any) -> bool:
    """``t`` is a ``torch.Tensor`` or ``nn.Parameter``: only those own their storage (subclasses: ``data_ptr()`` 0)."""
    return type(t) in (torch.Tensor, nn.Parameter)


def is_dtensor(t: Any) -> bool:
    return _is_loaded_instance(t, "torch.distributed.tensor", "DTensor")


def is_async_collective(t: Any) -> bool:
    return _is_loaded_instance(t, "torch.distributed._functional_collectives", "AsyncCollectiveTensor")


def _placements(t: Any) -> tuple:
    return tuple(getattr(t, "placements", ()))


def _shard_dim(p: Any, ndim: int) -> int:  # a Shard placement's dim, non-negative
    return p.dim % ndim if ndim else p.dim


def describe_tensor(t: Any) -> str:
    """E.g. ``DTensor[64] (Replicate(),) local [64] float32`` or ``Tensor[1, 16, 64] float32``."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    if is_dtensor(t):
        return f"DTensor{list(t.shape)} {_placements(t)} local {list(t.to_local().shape)} {str(t.dtype)[6:]}"
    return f"{type(t).__name__}{list(t.shape)} {str(t.dtype)[6:]}"


def local_view(t: Any, *, shard_ok_dims: tuple[int, ...] = ()) -> tuple[torch.Tensor | None, str | None]:
    """``(plain tensor, None)`` when the per-token math on it is complete on this rank, else ``(None, reason)``;
    ``shard_ok_dims``: token dims every operand shares (a ``Shard`` there is fine)."""
    if is_plain_tensor(t):
        return t, None
    if not isinstance(t, torch.Tensor):
        return None, f"not a tensor ({type(t).__name__})"
    if is_async_collective(t):
        if torch.compiler.is_compiling():
            return None, "AsyncCollectiveTensor under torch.compile tracing"
        return local_view(t.trigger_wait())
    if is_dtensor(t):
        ndim = t.dim()
        for p in _placements(t):
            d = _shard_dim(p, ndim) if p.is_shard() else None
            if p.is_replicate() or d is not None and ndim and d in {k % ndim for k in shard_ok_dims}:
                continue
            if d is not None:
                return None, (f"DTensor sharded on dim {d} (global {list(t.shape)}, local "
                              f"{list(t.to_local().shape)}): the rank-local tensor is a slice")
            if p.is_partial():
                return None, f"DTensor with {p!r} placement: a pending reduction, no rank holds the value"
            return None, f"DTensor with placement {p!r}"
        return local_view(t.to_local())
    return None, f"tensor subclass {type(t).__name__} (no storage of its own for a raw kernel)"


def _weight(linear: nn.Module) -> Any:
    m = unwrap_peft(linear)[0]
    w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
    return w if w is not None else getattr(m, "weight", None)


def projection_tp_style(linear: nn.Module) -> str | None:
    """``"colwise"`` (weight ``Shard(0)``), ``"rowwise"`` (``Shard(1)``) or None, read at call time."""
    w = _weight(linear)
    p = next((p for p in _placements(w) if p.is_shard()), None) if is_dtensor(w) else None
    d = _shard_dim(p, w.dim()) if p is not None else None
    return "colwise" if d == 0 else "rowwise" if d == 1 else None


def tp_defer_refusals(linear: nn.Module) -> list[str]:
    """Why an output projection's bias must stay in its GEMM under TP ([]: fine, or not TP). Row-wise only, with a
    ``Replicate`` bias and output: the fused op adds it once after the all-reduce (unpatched: ``b / N`` before)."""
    m = unwrap_peft(linear)[0]
    style = projection_tp_style(m)
    b = m._parameters.get("bias") if hasattr(m, "_parameters") else None
    if style is None:
        w = _weight(m)
        return [f"TP layout not understood (weight {describe_tensor(w)}, bias {describe_tensor(b)})"] \
            if is_dtensor(w) or is_dtensor(b) else []
    if style == "colwise":
        return ["tensor parallel column-wise projection: its output is sharded on the hidden dim"]
    out: list[str] = []
    if b is not None and not is_dtensor(b):
        out.append(f"row-wise TP projection with a non-DTensor bias ({describe_tensor(b)})")
    elif b is not None and not all(p.is_replicate() for p in _placements(b)):
        out.append(f"row-wise TP projection whose bias is not replicated ({_placements(b)})")
    pouts = (_hook_partial(h, "_prepare_output_fn") for h in getattr(m, "_forward_hooks", {}).values())
    pout = next((p for p in pouts if p is not None and len(p.args) >= 2), None)  # a torch ParallelStyle's partial
    if pout is not None:
        layouts = tuple(pout.args[0]) if isinstance(pout.args[0], (tuple, list)) else (pout.args[0],)
        if not all(p.is_replicate() for p in layouts):
            out.append(f"row-wise TP projection whose output stays {layouts} (not reduced to Replicate)")
    return out


def parallel_kind(transformer: nn.Module) -> str | None:
    cfg = getattr(transformer, "_parallel_config", None)
    if getattr(cfg, "tensor_parallel_config", None) is not None:
        return "tp"
    return "cp" if getattr(cfg, "context_parallel_config", None) is not None else None


# Local shards: DTensor's host work per linear dominated the TP forward. The local computation is the one DTensor
# dispatches to (bit-identical): column-wise ``F.linear(x, W_local, b_local)``; row-wise
# ``F.linear(x_local, W_local, b / N)``, then the output hook's all-reduce on the same group.
class TpShard:
    """One ``nn.Linear`` under torch's stock TP styles: what its local computation needs and was recognised from."""

    __slots__ = ("style", "weight", "bias", "pre", "post", "group", "world", "_scaled")

    def __init__(self, style: str, weight: Any, bias: Any, pre: tuple, post: tuple, group: Any, world: int):
        self.style, self.weight, self.bias, self.pre, self.post = style, weight, bias, pre, post
        self.group, self.world, self._scaled = group, world, None  # _scaled: (local bias, its _version, / world)

    def current(self, linear: nn.Module) -> bool:
        p = linear._parameters
        return (p.get("weight") is self.weight and p.get("bias") is self.bias
                and tuple(linear._forward_pre_hooks) == self.pre and tuple(linear._forward_hooks) == self.post
                and "forward" not in linear.__dict__ and not global_hook_count())

    def local_bias(self, linear: nn.Module) -> torch.Tensor | None:
        """None while deferred, the local shard (column-wise), or ``b / N`` (row-wise, cached per value)."""
        if "bias" in linear.__dict__ or self.bias is None:
            return None
        b = self.bias.to_local()
        if self.style == "colwise":
            return b
        c = self._scaled
        if c is None or c[0] is not b or c[1] != b._version:
            c = self._scaled = (b, b._version, b / self.world)
        return c[2]


def _hook_partial(hook: Any, fn_name: str) -> functools.partial | None:
    for obj in (hook, *(getattr(hook, "__closure__", None) or ())):
        with contextlib.suppress(ValueError):  # an empty closure cell has no contents
            obj = obj.cell_contents if isinstance(obj, types.CellType) else obj
            if isinstance(obj, functools.partial) and getattr(obj.func, "__name__", "") == fn_name:
                return obj
    return None


def _style_of(p: functools.partial) -> str:
    return getattr(p.func, "__qualname__", "").split(".")[0]


_REPLICATE = (lambda p: p.is_replicate(),)
_LAST_SHARD = (lambda p: p.is_shard() and p.dim == -1,)
_SHARD0 = (lambda p: p.is_shard() and p.dim == 0,)
_SHARD1 = (lambda p: p.is_shard() and p.dim in (1, -1),)
_LAYOUTS = ("input layouts", "desired input layouts", "output layouts", "weight placements", "bias placements")
_DEFAULTS = {"ColwiseParallel": (_REPLICATE, _REPLICATE, _LAST_SHARD, _SHARD0, _SHARD0),
             "RowwiseParallel": (_LAST_SHARD, _LAST_SHARD, _REPLICATE, _SHARD1, _REPLICATE)}  # in _LAYOUTS order


def tp_shard_reasons(linear: nn.Module, *, own_forward: bool = True) -> tuple[TpShard | None, list[str]]:
    """``(record, [])`` when ``linear`` is under exactly torch's ``ColwiseParallel()`` or ``RowwiseParallel()`` on a
    1-D mesh and no other hook; else ``(None, reasons)``. ``own_forward=False``: any ``nn.Linear`` subclass."""
    r: list[str] = []
    if (type(linear) is not nn.Linear) if own_forward else not isinstance(linear, nn.Linear):
        return None, [f"{type(linear).__name__}, not torch.nn.Linear"]
    if "forward" in linear.__dict__:
        r.append("its forward is replaced on the instance")
    w, b = linear._parameters.get("weight"), linear._parameters.get("bias")
    if not is_dtensor(w):
        return None, ["weight is not a DTensor"]
    if (mesh := w.device_mesh).ndim != 1:
        r.append(f"{mesh.ndim}-dimensional device mesh")
    if len(linear._forward_pre_hooks) != 1 or len(linear._forward_hooks) != 1:
        r.append(f"{len(linear._forward_pre_hooks)} forward pre-hooks and {len(linear._forward_hooks)} forward "
                 "hooks (torch's TP style registers one of each)")
    if global_hook_count():
        r.append("a global module forward hook is registered")
    if r:
        return None, r
    pin = _hook_partial(next(iter(linear._forward_pre_hooks.values())), "_prepare_input_fn")
    pout = _hook_partial(next(iter(linear._forward_hooks.values())), "_prepare_output_fn")
    if pin is None or pout is None or len(pin.args) < 2 or len(pout.args) < 2:
        return None, ["its hooks are not torch's ParallelStyle input/output functions"]
    style = _style_of(pin)
    if style != _style_of(pout) or style not in _DEFAULTS:
        return None, [f"parallel style {style!r} ({_style_of(pout)!r} output), not ColwiseParallel/RowwiseParallel"]
    got = (tuple(pin.args[0]), tuple(pin.args[1]), tuple(pout.args[0]), _placements(w),
           _placements(b) if b is not None else None)
    for name, preds, g in zip(_LAYOUTS, _DEFAULTS[style], got):
        if g is not None and (len(g) != len(preds) or not all(f(x) for f, x in zip(preds, g))):  # None: no bias
            r.append(f"{name} {g} are not the {style}() defaults")
    if not pout.args[1]:
        r.append("use_local_output=False (the output stays a DTensor)")
    if r:
        return None, r
    return TpShard("colwise" if style == "ColwiseParallel" else "rowwise", w, b, tuple(linear._forward_pre_hooks),
                   tuple(linear._forward_hooks), mesh.get_group(), mesh.size()), []


_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tp_shard(linear: nn.Module) -> tuple[TpShard | None, str | None]:
    """``(record, None)``: on its local shards; ``(None, why not)``: through DTensor; ``(None, None)``: plain weight."""
    w = linear._parameters.get("weight") if hasattr(linear, "_parameters") else None
    if w is None or is_plain_tensor(w):
        return None, None
    if (rec := _SHARDS.get(linear)) is not None and rec.current(linear):
        return rec, None
    rec, why = tp_shard_reasons(linear)
    if rec is None:
        _SHARDS.pop(linear, None)
        return None, "; ".join(why)
    _SHARDS[linear] = rec
    return rec, None


@contextlib.contextmanager
def allow_cpu_parallelism() -> Iterator[None]:
    """Let diffusers' ``enable_parallelism`` build a CPU (gloo) mesh (tests, ``--tiny``): diffusers 0.42.1 computes
    ``rank % torch.accelerator.device_count()`` (0 on a CPU) and rejects "cpu" for TP. Process-global."""
    import diffusers.hooks.tensor_parallel as tpmod  # noqa: PLC0415

    orig_count, orig_devices = torch.accelerator.device_count, tpmod._SUPPORTED_TP_DEVICES
    torch.accelerator.device_count = lambda: orig_count() or 1
    if "cpu" not in orig_devices:
        tpmod._SUPPORTED_TP_DEVICES = (*orig_devices, "cpu")
    try:
        yield
    finally:
        torch.accelerator.device_count = orig_count
        tpmod._SUPPORTED_TP_DEVICES = orig_devices
