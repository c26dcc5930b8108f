"""Tensor and context parallelism (diffusers 0.42.1) as the patched block sees it, and small helpers.

Everything below was observed by running it (2 processes, gloo, CPU, torch 2.13, diffusers 0.42.1,
tiny Qwen-Image transformer; ``tests/parallel_worker.py`` records it again on every CI run), not
read off documentation.

Tensor parallelism: ``transformer.enable_parallelism(config=TensorParallelConfig(tp_degree=N))``
-------------------------------------------------------------------------------------------------
diffusers calls torch's ``parallelize_module`` once per block with the model's ``_tp_plan``:
``ColwiseParallel()`` for ``attn.to_q/to_k/to_v/add_q_proj/add_k_proj/add_v_proj`` and
``img_mlp.net.0.proj`` / ``txt_mlp.net.0.proj``; ``RowwiseParallel()`` for ``attn.to_out.0``,
``attn.to_add_out``, ``img_mlp.net.2`` and ``txt_mlp.net.2``; default layouts,
``use_local_output=True``. Nothing else is touched: ``img_mod`` / ``txt_mod``, the block norms,
``norm_q/k``, ``img_in``, ``txt_in``, ``norm_out`` and ``proj_out`` keep plain parameters.

- Parameters (the ``nn.Parameter`` objects are *replaced*, so a plan made at patch time before
  ``enable_parallelism`` still holds the module but sees new parameter objects afterwards):
  column-wise weight ``DTensor [out, in]`` placements ``(Shard(0),)``, local ``[out/N, in]``, bias
  ``(Shard(0),)`` local ``[out/N]``; row-wise weight ``(Shard(1),)`` local ``[out, in/N]``, bias
  ``DTensor [out]`` placements ``(Replicate(),)``, local ``[out]`` (the full bias on every rank).
- The block forward receives **plain local tensors with the full (global) shapes**, identical on
  every rank: ``hidden_states [B, L_img, D]``, ``encoder_hidden_states [B, L_txt, D]``,
  ``encoder_hidden_states_mask [B, L_txt]``, ``temb [B, D]`` (``[2B, D]`` with ``zero_cond_t``),
  ``image_rotary_emb`` (plain complex
  ``[L_img, hd/2]``, ``[L_txt, hd/2]``), ``modulate_index [B, L_img]`` or None. ``img_mod(temb)`` /
  ``txt_mod`` outputs, the shift/scale/gate chunks and the norm outputs are plain full tensors.
- Inside attention/FFN: a column-wise linear gets a ``Replicate`` DTensor input made from the plain
  tensor and returns a plain local tensor sharded on the last dim (``to_q``: ``[B, L, D/N]``, i.e.
  ``heads/N`` heads; ``net.0.proj``: ``[B, L, 4D/N]``); the processor reshapes with a fixed
  ``head_dim`` so each rank runs ordinary attention over its own heads.
- A row-wise linear gets its input wrapped as ``Shard(-1)`` DTensor; ``F.linear`` on DTensors yields
  a ``Partial(sum)`` DTensor whose local value is ``x_local @ W_local.T + b / N``: **DTensor adds the
  bias before the all-reduce**, after redistributing the ``Replicate`` bias to ``Partial`` by dividing
  it by N (so unpatched TP already rounds differently from one GPU). The output hook then
  redistributes ``Partial -> Replicate`` with ``async_op=True`` and returns ``.to_local()``.
- So the attention outputs and the FFN outputs that the block hands to its residual sites are
  ``torch.distributed._functional_collectives.AsyncCollectiveTensor`` with the full shape
  ``[B, L, D]``: a *wrapper subclass* around the all-reduce result whose collective may still be in
  flight. Torch ops on it wait first, but it has no storage of its own: **``data_ptr()`` is 0** and
  ``.contiguous()`` returns the wrapper itself. A raw CUDA kernel handed one reads address 0 (or,
  via the inner tensor without a wait, a buffer NCCL may still be writing): that is the "illegal
  memory access" of issue 12. It is not a DTensor, so a DTensor check alone does not catch it.
- ModelOpt-quantized models cannot be tensor-parallelised by diffusers 0.42.1: ``parallelize_module``
  fails inside ``RowwiseParallel._partition_linear_fn`` (``'TensorQuantizer' object has no attribute
  'weight'``: ``distribute_module`` visits the quantizer submodules too). The order that works is
  ``enable_parallelism`` first, then ``mtq.quantize``: the ``QuantLinear`` weights stay DTensors with
  the TP hooks, and ModelOpt calibrates their weight and input amax over the whole tensors (plain
  tensors, equal on every rank), so a rank's FP8 codes are the shard of the one-GPU codes.

Context parallelism: ``ContextParallelConfig(ulysses_degree=N)`` (ring needs an LSE backend)
--------------------------------------------------------------------------------------------
No parameter changes. diffusers' hooks split ``hidden_states`` / ``encoder_hidden_states`` on dim 1
at ``transformer_blocks.0`` and ``modulate_index`` / ``encoder_hidden_states_mask`` on dim 1 at every
block (``tensor.chunk(N, 1)[rank]``: a *view*, non-contiguous when B > 1, so block 0's
``hidden_states`` / ``encoder_hidden_states`` and every block's ``modulate_index`` and mask are
non-contiguous for B > 1; the kernels must keep calling ``.contiguous()``), and the rope tables at
``pos_embed``; ``proj_out``'s output is all-gathered (the *model* output is an
``AsyncCollectiveTensor``). Inside the block everything is a plain tensor with the rank-local
sequence length: ``[B, L_img/N, D]``, ``[B, L_txt/N, D]``, ``modulate_index [B, L_img/N]``, ``temb``
full (the modulation runs redundantly on each rank). Attention and FFN outputs are plain
tensors ``[B, L/N, D]`` (Ulysses' all-to-alls are waited inside ``dispatch_attention_fn``). Every
fused op is token-local, so the patched block needs nothing for CP; patched CP is bit-identical to
unpatched CP.

Measured on CPU (references, no bias deferred): unpatched CP / TP vs one process max |diff|
2.4e-7..3.6e-7 (fp32); patched (before or after ``enable_parallelism``) vs unpatched parallel:
bit-identical for both, B = 1 and B = 2 with ``zero_cond_t``; ``unpatch`` restores it bit for bit.

What the patched block does under TP: it runs the twelve sharded linears of each block on their
local shards without DTensor (:func:`tp_shard` recognises torch's default column-/row-wise styles;
``qwen_absorb.projection.tp_linear`` computes what DTensor computes, plus the row-wise sum
all-reduce; real FP8 GEMMs likewise on the local FP8 shards), so what reaches a fused site is a plain
tensor; anything it does not recognise runs through DTensor, as unpatched. Beyond that it must (the
rest of this module): pass every operand of a fused
op through :func:`local_view` (the attention / FFN outputs become the waited plain tensors; a
refusal means "run the diffusers expression for this site"); take a deferred bias with
:func:`local_view` (``Replicate`` DTensor -> full local bias); decide deferral per call with
:func:`tp_defer_refusals` (TP may be applied after patching); never launch a kernel on a tensor that
fails :func:`is_plain_tensor` (:func:`kernel_arg_refusal`).

On a CPU ``_resolve_parallel_config`` calls ``torch.accelerator.device_count()`` (0) and
``apply_tensor_parallel`` rejects device type ``"cpu"``; :func:`allow_cpu_parallelism` lifts both for
tests and ``--tiny`` runs.

The helpers below are cheap (type checks; ``torch.distributed.tensor`` is never imported by them:
no DTensor can exist unless it is already loaded) and pure, except :func:`local_view`, which waits
for a pending collective (that is its purpose), and :func:`allow_cpu_parallelism`.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .hooks import global_forward_hooks
from .sites import unwrap_peft

__all__ = [
    "TpShard",
    "allow_cpu_parallelism",
    "describe_tensor",
    "global_forward_hooks",
    "is_async_collective",
    "is_dtensor",
    "is_plain_tensor",
    "kernel_arg_refusal",
    "local_view",
    "parallel_kind",
    "projection_tp_style",
    "tp_defer_refusals",
    "tp_shard",
    "tp_shard_reasons",
]

_DTENSOR_MODULE = "torch.distributed.tensor"
_FUNCOL_MODULE = "torch.distributed._functional_collectives"


def _loaded_class(module: str, name: str) -> type | None:
    """``module.name`` if ``module`` is already imported, else None (never imports anything)."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


# ------------------------------------------------------------------------------ tensor kinds


def is_plain_tensor(t: Any) -> bool:
    """``t`` is a ``torch.Tensor`` or ``nn.Parameter`` and no other subclass.

    Why: only those own their storage, so ``data_ptr()`` is the address of the values a raw kernel
    reads. Tensor subclasses seen under diffusers parallelism (DTensor, AsyncCollectiveTensor) are
    wrapper subclasses whose ``data_ptr()`` is 0.
    """
    tp = type(t)
    return tp is torch.Tensor or tp is nn.Parameter


def is_dtensor(t: Any) -> bool:
    """``t`` is a ``torch.distributed.tensor.DTensor`` (a DTensor parameter included).

    Cheap on the hot path: plain tensors return after one type check, and the DTensor class is only
    looked up in ``sys.modules`` (if ``torch.distributed.tensor`` was never imported, no DTensor
    exists, and nothing is imported here).
    """
    if is_plain_tensor(t):
        return False
    cls = _loaded_class(_DTENSOR_MODULE, "DTensor")
    return cls is not None and isinstance(t, cls)


def is_async_collective(t: Any) -> bool:
    """``t`` is an ``AsyncCollectiveTensor``: what a TP row-wise linear returns in diffusers 0.42.1.

    Why it matters: its all-reduce may still be in flight and its ``data_ptr()`` is 0; torch ops on
    it wait first, raw kernels do not. Same cheap lookup as :func:`is_dtensor`.
    """
    if is_plain_tensor(t):
        return False
    cls = _loaded_class(_FUNCOL_MODULE, "AsyncCollectiveTensor")
    return cls is not None and isinstance(t, cls)


def _placements(t: Any) -> tuple:
    return tuple(getattr(t, "placements", ()))


def describe_tensor(t: Any) -> str:
    """A short description for reports and logs, e.g. ``DTensor[64] (Replicate(),) local [64]``,
    ``AsyncCollectiveTensor[1, 16, 64] float32``, ``Tensor[1, 16, 64] float32``."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    shape = list(t.shape)
    if is_dtensor(t):
        return f"DTensor{shape} {_placements(t)} local {list(t.to_local().shape)} {str(t.dtype)[6:]}"
    return f"{type(t).__name__}{shape} {str(t.dtype)[6:]}"


# ------------------------------------------------------------------------------ local views


def local_view(t: Any, *, shard_ok_dims: tuple[int, ...] = ()) -> tuple[torch.Tensor | None, str | None]:
    """``(plain tensor, None)`` when the per-token math on it is complete on this rank, else ``(None, reason)``.

    - plain tensor: itself (one type check; the hot path under CP and without parallelism);
    - ``AsyncCollectiveTensor`` (a TP row-wise output): waits for its collective and returns the
      inner tensor, which holds the all-reduced full value;
    - ``DTensor`` whose placements are all ``Replicate()`` (e.g. a row-wise bias): its local tensor,
      the full value, itself waited if it came from an async redistribution;
    - ``DTensor`` with ``Shard(d)``: refused (the local tensor is a slice; for ``d`` = the hidden dim a
      LayerNorm or a bias add over it would be wrong), unless ``d`` (normalised) is in
      ``shard_ok_dims``, i.e. the caller knows every other operand is sharded the same way on a
      token dim;
    - ``DTensor`` with ``Partial``: refused (a pending reduction: no rank has the value);
    - anything else (None, other subclasses): refused.

    The returned tensor is what a raw kernel may be handed (``is_plain_tensor`` holds).
    """
    if is_plain_tensor(t):
        return t, None
    if not isinstance(t, torch.Tensor):
        return None, f"not a tensor ({type(t).__name__})"
    if is_async_collective(t):
        if torch.compiler.is_compiling():
            return None, "AsyncCollectiveTensor under torch.compile tracing"
        inner = t.trigger_wait()
        return local_view(inner)
    if is_dtensor(t):
        ndim = t.dim()
        for p in _placements(t):
            if p.is_replicate():
                continue
            if p.is_shard():
                d = p.dim % ndim if ndim else p.dim
                if ndim and d in {k % ndim for k in shard_ok_dims}:
                    continue
                return None, (f"DTensor sharded on dim {d} (global {list(t.shape)}, local "
                              f"{list(t.to_local().shape)}): the rank-local tensor is a slice")
            if p.is_partial():
                return None, f"DTensor with {p!r} placement: a pending reduction, no rank holds the value"
            return None, f"DTensor with placement {p!r}"
        return local_view(t.to_local())
    return None, f"tensor subclass {type(t).__name__} (no storage of its own for a raw kernel)"


def kernel_arg_refusal(*tensors: Any) -> str | None:
    """Why a raw kernel must not be handed these arguments, or None (None arguments are skipped).

    A second line of defence for the fused ops' eligibility: any tensor subclass (DTensor,
    AsyncCollectiveTensor, ...) goes to the torch reference, which handles subclasses correctly.
    """
    for t in tensors:
        if t is not None and not is_plain_tensor(t):
            return (f"argument is a {type(t).__name__} (a tensor subclass under distributed parallelism; "
                    "data_ptr() is not its values), the kernels need plain tensors")
    return None


# ------------------------------------------------------------------------------ projections


def _weight(linear: nn.Module) -> Any:
    m = unwrap_peft(linear)[0]
    w = m._parameters.get("weight") if hasattr(m, "_parameters") else None
    return w if w is not None else getattr(m, "weight", None)


def projection_tp_style(linear: nn.Module) -> str | None:
    """``"colwise"`` (weight ``Shard(0)``: output sharded on the hidden dim), ``"rowwise"``
    (weight ``Shard(1)``: output all-reduced to the full value), or None (weight not a sharded
    DTensor). PEFT ``base_layer`` wrappers are unwrapped.

    Why: it decides whether the bias may be deferred into the fused op after the projection under TP
    (see :func:`tp_defer_refusals`). Read it at call time, or after ``enable_parallelism``: TP
    applied after patching replaces the parameters.
    """
    w = _weight(linear)
    if not is_dtensor(w):
        return None
    ndim = w.dim()
    for p in _placements(w):
        if p.is_shard():
            d = p.dim % ndim if ndim else p.dim
            return "colwise" if d == 0 else "rowwise" if d == 1 else None
    return None


def _tp_output_hook(linear: nn.Module) -> tuple[tuple, bool] | None:
    """``(output_layouts, use_local_output)`` of a torch ``ParallelStyle`` output hook, if found.

    ``distribute_module`` registers ``lambda mod, inputs, outputs: output_fn(mod, outputs, mesh)``
    where ``output_fn`` is ``functools.partial(style._prepare_output_fn, output_layouts,
    use_local_output)``: look for that partial in the hook or its closure (best effort; None if the
    layout of torch's hooks changes).
    """
    for hook in getattr(linear, "_forward_hooks", {}).values():
        obj = _hook_partial(hook, "_prepare_output_fn")
        if obj is not None and len(obj.args) >= 2:
            layouts = obj.args[0]
            return (tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)), bool(obj.args[1])
    return None


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def tp_defer_refusals(linear: nn.Module) -> list[str]:
    """Why the bias of an output projection must stay in its GEMM under tensor parallelism ([]: fine).

    - not TP-sharded and the bias is no DTensor: [] (nothing TP-specific to refuse);
    - column-wise: refused, the output the fused op would get is a hidden-dim shard;
    - row-wise: allowed when the bias is a ``Replicate`` DTensor (take it with :func:`local_view`)
      and the output hook reduces to ``Replicate``: with the bias shadowed, the GEMM's ``Partial``
      output is all-reduced without it and the fused op adds the full bias once, after the
      reduction. Unpatched, DTensor adds ``b / N`` on each rank *before* the all-reduce, so the two
      agree up to rounding (as deferral does anyway), not bit for bit.
    """
    m = unwrap_peft(linear)[0]
    style = projection_tp_style(m)
    b = m._parameters.get("bias") if hasattr(m, "_parameters") else None
    if style is None:
        w = _weight(m)
        if is_dtensor(w) or is_dtensor(b):
            return [f"TP layout not understood (weight {describe_tensor(w)}, bias {describe_tensor(b)})"]
        return []
    if style == "colwise":
        return ["tensor parallel column-wise projection: its output is sharded on the hidden dim"]
    out: list[str] = []
    if b is not None:
        if not is_dtensor(b):
            out.append(f"row-wise TP projection with a non-DTensor bias ({describe_tensor(b)})")
        elif not all(p.is_replicate() for p in _placements(b)):
            out.append(f"row-wise TP projection whose bias is not replicated ({_placements(b)})")
    hook = _tp_output_hook(m)
    if hook is not None and not all(p.is_replicate() for p in hook[0]):
        out.append(f"row-wise TP projection whose output stays {hook[0]} (not reduced to Replicate)")
    return out


def parallel_kind(transformer: nn.Module) -> str | None:
    """``"tp"``, ``"cp"`` or None: what ``enable_parallelism`` applied to this diffusers model
    (read from its ``_parallel_config``). For reports and plan building."""
    cfg = getattr(transformer, "_parallel_config", None)
    if cfg is None:
        return None
    if getattr(cfg, "tensor_parallel_config", None) is not None:
        return "tp"
    if getattr(cfg, "context_parallel_config", None) is not None:
        return "cp"
    return None


# ------------------------------------------------------------------------------ local shards

# Where a column- or row-wise linear of torch's TP styles runs on this rank's shards directly (what
# qwen_absorb.projection.tp_linear does), the patched block skips DTensor: measured on 2 H200s
# (benchmarks/results/parallel/parallel.md, commit 60af1d5) diffusers' TP forward took ~1 s at 1024^2 and at
# 2048^2 alike against 173 ms on one GPU, i.e. per-call host work of the twelve DTensor linears of
# each block, not GPU work. The local computation is the one DTensor dispatches to (so the result is
# bit-identical): column-wise ``F.linear(x, W_local, b_local)`` on the replicated input; row-wise
# ``F.linear(x_local, W_local, b / N)`` (DTensor turns the replicated bias into a ``Partial`` one by
# dividing it by N before the GEMM) and then the sum all-reduce of the output hook, same group.

_COLWISE = "ColwiseParallel"
_ROWWISE = "RowwiseParallel"


class TpShard:
    """One ``nn.Linear`` sharded by torch's stock ``ColwiseParallel`` / ``RowwiseParallel`` with
    default layouts: what its rank-local computation needs, and what it was recognised from (the
    parameter objects and hook ids, compared on every use: TP applied, undone or re-applied, a hook
    added, the parameters replaced, all make it stale)."""

    __slots__ = ("style", "weight", "bias", "pre", "post", "group", "world", "_scaled")

    def __init__(self, style: str, weight: Any, bias: Any, pre: tuple, post: tuple, group: Any, world: int):
        self.style, self.weight, self.bias, self.pre, self.post = style, weight, bias, pre, post
        self.group, self.world = group, world
        self._scaled: tuple | None = None  # (local bias, its _version, local bias / world)

    def current(self, linear: nn.Module) -> bool:
        """The module is still exactly what this record was made from (cheap: identities and keys)."""
        p = linear._parameters
        return (p.get("weight") is self.weight and p.get("bias") is self.bias
                and tuple(linear._forward_pre_hooks) == self.pre and tuple(linear._forward_hooks) == self.post
                and "forward" not in linear.__dict__ and not global_forward_hooks())

    def local_weight(self) -> torch.Tensor:
        return self.weight.to_local()

    def local_bias(self, linear: nn.Module) -> torch.Tensor | None:
        """The bias the rank-local GEMM adds: none while it is deferred (shadowed by ``bias = None`` in
        the instance dict), the local shard (column-wise), or ``b / N`` (row-wise, cached per value)."""
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
    cells = getattr(hook, "__closure__", None) or ()
    for obj in (hook, *(c.cell_contents for c in cells if _cell_filled(c))):
        if isinstance(obj, functools.partial) and getattr(obj.func, "__name__", "") == fn_name:
            return obj
    return None


def _style_of(p: functools.partial) -> str:
    return getattr(p.func, "__qualname__", "").split(".")[0]


def tp_shard_reasons(linear: nn.Module, *, own_forward: bool = True) -> tuple[TpShard | None, list[str]]:
    """``(record, [])`` when ``linear`` is a TP-sharded ``nn.Linear`` that may run on its local shards,
    else ``(None, reasons)``. Recognised: exactly torch's ``ColwiseParallel()`` (input ``Replicate``,
    output ``Shard(-1)``, local output) or ``RowwiseParallel()`` (input ``Shard(-1)``, output
    ``Replicate``, local output) on a one-dimensional mesh, and no other hook on the module.

    ``own_forward=False``: the caller computes the linear itself (a real FP8 GEMM of a ModelOpt
    ``QuantLinear``), so any ``nn.Linear`` subclass is accepted; else exactly ``nn.Linear``, whose
    forward is ``F.linear``."""
    r: list[str] = []
    if (type(linear) is not nn.Linear) if own_forward else not isinstance(linear, nn.Linear):
        return None, [f"{type(linear).__name__}, not torch.nn.Linear"]
    if "forward" in linear.__dict__:
        r.append("its forward is replaced on the instance")
    w = linear._parameters.get("weight")
    b = linear._parameters.get("bias")
    if not is_dtensor(w):
        return None, ["weight is not a DTensor"]
    mesh = w.device_mesh
    if mesh.ndim != 1:
        r.append(f"{mesh.ndim}-dimensional device mesh")
    if len(linear._forward_pre_hooks) != 1 or len(linear._forward_hooks) != 1:
        r.append(f"{len(linear._forward_pre_hooks)} forward pre-hooks and {len(linear._forward_hooks)} forward "
                 "hooks (torch's TP style registers one of each)")
    if global_forward_hooks():
        r.append("a global module forward hook is registered")
    if r:
        return None, r
    pin = _hook_partial(next(iter(linear._forward_pre_hooks.values())), "_prepare_input_fn")
    pout = _hook_partial(next(iter(linear._forward_hooks.values())), "_prepare_output_fn")
    if pin is None or pout is None or len(pin.args) < 2 or len(pout.args) < 2:
        return None, ["its hooks are not torch's ParallelStyle input/output functions"]
    style = _style_of(pin)
    if style != _style_of(pout) or style not in (_COLWISE, _ROWWISE):
        return None, [f"parallel style {style!r} ({_style_of(pout)!r} output), not ColwiseParallel/RowwiseParallel"]
    in_layouts, desired = tuple(pin.args[0]), tuple(pin.args[1])
    out_layouts, use_local = tuple(pout.args[0]), bool(pout.args[1])
    wp, bp = _placements(w), _placements(b) if b is not None else None
    if style == _COLWISE:
        want = ((_is_replicate,), (_is_replicate,), (_is_last_shard,), (_is_shard0,), (_is_shard0,))
    else:
        want = ((_is_last_shard,), (_is_last_shard,), (_is_replicate,), (_is_shard1,), (_is_replicate,))
    got = (in_layouts, desired, out_layouts, wp, bp)
    names = ("input layouts", "desired input layouts", "output layouts", "weight placements", "bias placements")
    for name, preds, g in zip(names, want, got):
        if g is None:  # no bias
            continue
        if len(g) != len(preds) or not all(f(x, 2) for f, x in zip(preds, g)):
            r.append(f"{name} {g} are not the {style}() defaults")
    if not use_local:
        r.append("use_local_output=False (the output stays a DTensor)")
    if r:
        return None, r
    return TpShard("colwise" if style == _COLWISE else "rowwise", w, b, tuple(linear._forward_pre_hooks),
                   tuple(linear._forward_hooks), mesh.get_group(), mesh.size()), []


def _is_replicate(p: Any, ndim: int) -> bool:
    return p.is_replicate()


def _is_last_shard(p: Any, ndim: int) -> bool:
    return p.is_shard() and p.dim == -1


def _is_shard0(p: Any, ndim: int) -> bool:
    return p.is_shard() and p.dim == 0


def _is_shard1(p: Any, ndim: int) -> bool:
    return p.is_shard() and p.dim in (1, -1)


_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tp_shard(linear: nn.Module) -> tuple[TpShard | None, str | None]:
    """``(record, None)`` if ``linear`` may run on its local shards now; ``(None, why not)`` for a
    TP-sharded linear that must run through DTensor; ``(None, None)`` when its weight is a plain one.

    Cheap when nothing changed (a cached record, checked by identity); a module that is not sharded
    costs one type check of its weight.
    """
    w = linear._parameters.get("weight") if hasattr(linear, "_parameters") else None
    if w is None or type(w) is nn.Parameter or type(w) is torch.Tensor:
        return None, None
    rec = _SHARDS.get(linear)
    if rec is not None and rec.current(linear):
        return rec, None
    rec, why = tp_shard_reasons(linear)
    if rec is None:
        _SHARDS.pop(linear, None)
        return None, "; ".join(why)
    _SHARDS[linear] = rec
    return rec, None


# ------------------------------------------------------------------------------ CPU testing support


@contextlib.contextmanager
def allow_cpu_parallelism() -> Iterator[None]:
    """Let diffusers' ``enable_parallelism`` build a CPU (gloo) mesh: for tests and ``--tiny`` runs.

    diffusers 0.42.1 computes ``rank % torch.accelerator.device_count()`` (0 on a CPU: modulo by
    zero) and ``apply_tensor_parallel`` accepts only cuda/neuron/tpu/xpu meshes. Inside this context
    the device count reads 1 when it is 0, and "cpu" is an accepted TP device type; both are undone
    on exit. Process-global: use it in single-purpose processes (workers, scripts), not in threads.
    """
    import diffusers.hooks.tensor_parallel as tpmod  # noqa: PLC0415

    orig_count = torch.accelerator.device_count
    orig_devices = tpmod._SUPPORTED_TP_DEVICES

    def device_count() -> int:
        return orig_count() or 1

    torch.accelerator.device_count = device_count
    if "cpu" not in orig_devices:
        tpmod._SUPPORTED_TP_DEVICES = (*orig_devices, "cpu")
    try:
        yield
    finally:
        torch.accelerator.device_count = orig_count
        tpmod._SUPPORTED_TP_DEVICES = orig_devices
