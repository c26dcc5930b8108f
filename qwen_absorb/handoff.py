"""Cross-block fusion: block i computes block i+1's modulation and norm1 with its FFN residual in one kernel.

Safe only if nothing touches ``hidden_states`` in between: no forward hooks on either block, both called from the
transformer's forward loop frame, block i+1 with the very tensors block i returned and the same ``temb`` and
``modulate_index``; else it computes its norm1 itself (counted). The record is thread-local."""

import functools
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .hooks import global_hook_count, has_hooks
from .plan import PLAN_ATTR, BlockPlan

_local = threading.local()


@dataclass
class Handoff:
    """What block i computed for block i+1 (one record per thread)."""

    to: BlockPlan  # the receiving block's plan
    frame: int  # id() of the transformer forward frame both calls must come from
    code: Any  # that frame's code object
    img: torch.Tensor  # block i's returned hidden_states ...
    txt: torch.Tensor  # ... and encoder_hidden_states, identity-checked
    temb: torch.Tensor
    index: torch.Tensor | None
    img_mod: torch.Tensor  # block i+1's img_mod(temb), txt_mod(temb)
    txt_mod: torch.Tensor
    img_in: torch.Tensor  # block i+1's norm1 outputs (attention inputs: tensors or FP8 codes)
    txt_in: torch.Tensor
    generation: int = -1  # the receiving plan's generation whose watch block i asked (vouched, see vouched())


def link(plans: list[BlockPlan], blocks: list[nn.Module], transformer: nn.Module) -> None:
    """Point each patched block at the next one (structure only; the rest is checked per call)."""
    loop_code = _loop_code(type(transformer))
    for i, (plan, nxt) in enumerate(zip(plans, [*plans[1:], None])):
        plan.rt.handoff_to, plan.handoff_reasons = None, []
        if not plan.patched:
            continue
        if not plan.options.cross_block:
            plan.handoff_reasons.append("cross_block=False")
        elif nxt is None:
            plan.handoff_reasons.append("last block: its output goes to the transformer's norm_out")
        elif not nxt.patched:
            plan.handoff_reasons.append(f"block {i + 1} is not patched")
        elif loop_code is None:
            plan.handoff_reasons.append(f"{type(transformer).__name__}.forward is not a Python function")
        else:
            plan.rt.handoff_to, plan.rt.loop_owner = blocks[i + 1], type(transformer)


@functools.lru_cache(maxsize=None)
def _loop_code(cls: type) -> Any:  # the code of cls.forward (unwrapped): the frame the block loop runs in
    return getattr(inspect.unwrap(cls.forward), "__code__", None)


def receive_reasons(plan: BlockPlan, block: nn.Module) -> list[str]:  # why it cannot take its norm1 from block i-1
    r = []
    for stream in ("img", "txt"):
        sp = plan.site(stream, "norm1")
        if not sp.fused:
            r.append(f"{stream}.norm1 is not fused")
        elif sp.norm_quantizer == "applied-before-op":
            r.append(f"{stream}.norm1's input quantizer runs as a ModelOpt module before the op")
    if plan.modelopt and not all(plan.linears[f"{m}.1"].quant for m in ("img_mod", "txt_mod")):
        r.append("the modulation linears run as ModelOpt modules (called by this block only)")
    if (p0 := next(block.parameters(), None)) is not None and p0.dtype == torch.float16:
        r.append("float16: diffusers clips the block output after the residual")
    return r


def _caller_frame(code: Any) -> int | None:
    """id() of the nearest enclosing frame running ``code``, the forward loop (deeper under torch.compile)."""
    f = sys._getframe(2)
    for _ in range(40):
        if f is None or f.f_code is code:
            return None if f is None else id(f)
        f = f.f_back
    return None


def target(plan: BlockPlan, block: nn.Module, h: torch.Tensor) -> tuple[nn.Module, BlockPlan, int, Any] | None:
    """The next block, its plan, the loop frame and its code, if this call can hand over (else None; counted)."""
    if (nb := plan.rt.handoff_to) is None:
        return None
    np_: BlockPlan | None = nb.__dict__.get(PLAN_ATTR)
    if (np_ is None or np_.rt.stale is not None or np_.rt.device != h.device or np_.rt.codes_gone
            or np_.handoff_in_reasons or np_.options is not plan.options or np_.calibrating):
        return None  # not decided for this device yet, or cannot receive: see its report entry
    if np_.rt.watch.changed():  # it decides again at its own call, and computes its norm1 then
        plan.count("cross-block hand-off not made: the next block changed since it decided (it decides again)")
        return None
    if h.dtype == torch.float16:
        return None  # diffusers clips fp16 block outputs after the residual (fp16 blocks do not receive)
    if has_hooks(block) or has_hooks(nb) or global_hook_count():
        plan.count("cross-block hand-off not made: a forward hook on this or the next block (or a global one) "
                   "could change hidden_states in between")
        return None
    frame = _caller_frame(code := _loop_code(plan.rt.loop_owner))
    if frame is None:
        plan.count("cross-block hand-off not made: block not called from the transformer's forward loop")
        return None
    return nb, np_, frame, code


def give(rec: Handoff) -> None:
    _local.rec = rec


def take(plan: BlockPlan, h: torch.Tensor, txt: torch.Tensor, temb: torch.Tensor,
         index: torch.Tensor | None) -> Handoff | None:
    """The record handed to this block, if it applies to this very call; any record is dropped."""
    rec, _local.rec = getattr(_local, "rec", None), None
    if rec is None or rec.to is not plan:
        return None
    if (h is rec.img and txt is rec.txt and temb is rec.temb and index is rec.index
            and _caller_frame(rec.code) == rec.frame):
        plan.rt.handoffs[plan.index] += 1
        return rec
    plan.count("cross-block hand-off refused: this block did not receive the tensors the previous block returned, "
               "from the same forward loop (a ControlNet residual or the caller changed them); norm1 recomputed")
    return None


def vouched(plan: BlockPlan) -> bool:
    """Whether this thread holds a record for ``plan`` made after its watch was asked (:func:`target`)."""
    rec: Handoff | None = getattr(_local, "rec", None)
    return rec is not None and rec.to is plan and rec.generation == plan.rt.generation


def drop() -> None:  # a patched block ran another path
    _local.rec = None
