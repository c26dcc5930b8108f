"""``patch`` / ``unpatch``: run every QwenImageTransformerBlock through the fused ops.

Installation is hook-aware. diffusers hooks (``HookRegistry``: caches, context parallel, group
offloading) and accelerate hooks wrap ``module.forward`` by keeping the then-current bound forward
and assigning an instance attribute; a later ``block.forward = ...`` would silently replace the
whole chain. So the patched forward goes where the *original* bound forward is kept: the instance
``forward`` when there is no hook, else the innermost slot of the chain (a diffusers hook's
``fn_ref.original_forward`` / ``fn_ref.forward``, or accelerate's ``_old_forward``). Hooks added
after patching wrap the patched forward as they would the original. The block class, the forward
signature and the ``(encoder_hidden_states, hidden_states)`` return order never change, so diffusers'
block registry, ``compile_repeated_blocks`` and signature-mapping hooks keep working.

All blocks are planned first, then installed; an exception (or Ctrl-C) while installing undoes the
blocks already installed, so a model is never left half patched.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import gating, handoff
from .attention import FusedAttnProcessor
from .block import PatchedForward
from .plan import PLAN_ATTR, BlockPlan, Options, decide
from .quant import unwrap_peft
from .report import PatchReport
from .sites import resolve

log = logging.getLogger("qwen_absorb")

_STATE_ATTR = "_qwen_absorb_state"


@dataclass
class _BlockRecord:
    block: nn.Module
    installed: PatchedForward
    had_instance_forward: bool  # False: the slot was empty (the class forward ran)
    slot: str = ""


@dataclass
class _PatchState:
    report: PatchReport
    records: list[_BlockRecord]
    options: Options
    graph: Any = None
    offloaded: list[tuple[nn.Parameter, torch.device]] = field(default_factory=list)


# ---------------------------------------------------------------------------- target resolution


def _classes():
    from diffusers.models.transformers.transformer_qwenimage import (  # noqa: PLC0415
        QwenDoubleStreamAttnProcessor2_0,
        QwenImageTransformer2DModel,
        QwenImageTransformerBlock,
    )

    return QwenImageTransformer2DModel, QwenImageTransformerBlock, QwenDoubleStreamAttnProcessor2_0


def resolve_transformer(target: Any) -> nn.Module:
    """The ``QwenImageTransformer2DModel`` of a pipeline, or ``target`` itself (``torch.compile``
    wrappers of either are looked through)."""
    model_cls = _classes()[0]
    target = getattr(target, "_orig_mod", target)
    if isinstance(target, model_cls):
        return target
    inner = getattr(target, "transformer", None)
    inner = getattr(inner, "_orig_mod", inner)
    if isinstance(inner, model_cls):
        return inner
    raise TypeError(
        f"qwen_absorb.patch needs a QwenImageTransformer2DModel or a pipeline whose .transformer is one; "
        f"got {type(target).__name__}" + (f" with .transformer {type(inner).__name__}" if inner is not None else "")
    )


def _decision_device(transformer: nn.Module) -> torch.device:
    """The device the blocks will run on (offloaded models live on the CPU until they run)."""
    first = None
    for p in transformer.parameters():
        first = first or p.device
        if p.device.type not in ("cpu", "meta"):
            return p.device
    hook = getattr(transformer, "_hf_hook", None)  # accelerate / enable_model_cpu_offload
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
    blocks = getattr(transformer, "transformer_blocks", [])
    for m in (transformer, *(list(blocks)[:1])):  # diffusers group offloading
        reg = getattr(m, "_diffusers_hook", None)
        hook = reg.get_hook("group_offloading") if reg is not None else None
        dev = getattr(getattr(hook, "group", None), "onload_device", None)
        if dev is not None:
            return torch.device(dev)
    return first if first is not None and first.type != "meta" else torch.device("cpu")


# ---------------------------------------------------------------------------- hook-aware slots


def _slots(block: nn.Module) -> Iterator[tuple[str, Callable[[], Any], Callable[[Any], None]]]:
    """Every place a forward of ``block`` may be held: (description, get, set)."""
    d = block.__dict__
    if "forward" in d:
        yield "forward", (lambda: d.get("forward")), (lambda f: object.__setattr__(block, "forward", f))
    else:
        yield "forward", (lambda: None), (lambda f: object.__setattr__(block, "forward", f))
    reg = d.get("_diffusers_hook")
    for i, ref in enumerate(getattr(reg, "_fn_refs", None) or []):
        for attr in ("original_forward", "forward"):
            yield (f"diffusers hook {reg._hook_order[i]!r} {attr}",
                   (lambda r=ref, a=attr: getattr(r, a)), (lambda f, r=ref, a=attr: setattr(r, a, f)))
    if "_old_forward" in d:
        yield "accelerate _old_forward", (lambda: d.get("_old_forward")), (lambda f: object.__setattr__(block, "_old_forward", f))


def _is_class_forward(fn: Any, block: nn.Module) -> bool:
    return getattr(fn, "__func__", None) is type(block).forward and getattr(fn, "__self__", None) is block


def _install(block: nn.Module, fwd: PatchedForward) -> tuple[str, bool] | None:
    """Put ``fwd`` where the original forward is held; returns (where, an instance forward existed)."""
    if "forward" not in block.__dict__:  # no hook, no instance forward: the class forward runs
        object.__setattr__(block, "forward", fwd)
        return "forward", False
    for where, get, set_ in _slots(block):
        if where == "forward" and "forward" not in block.__dict__:
            continue
        if _is_class_forward(get(), block):
            set_(fwd)
            return where, True
    return None


def _uninstall(rec: _BlockRecord) -> bool:
    block = rec.block
    for where, get, set_ in _slots(block):
        if get() is rec.installed:
            if where == "forward" and not rec.had_instance_forward:
                del block.__dict__["forward"]
            else:
                set_(type(block).forward.__get__(block))
            return True
    return False


# ---------------------------------------------------------------------------- deciding


def _processor(block: nn.Module, plan: BlockPlan) -> None:
    """Install (or remove) qwen_absorb's attention processor as the plan needs it."""
    attn = block.attn
    proc = attn.processor
    if plan.own_attention and not isinstance(proc, FusedAttnProcessor):
        attn.set_processor(FusedAttnProcessor(proc))
    elif not plan.own_attention and isinstance(proc, FusedAttnProcessor):
        attn.set_processor(proc.original)
    plan.expected_processor = attn.processor


def redecide(plan: BlockPlan, block: nn.Module, device: torch.device) -> None:
    """Decide again for a new device (or after a recalibration); called from the block's forward."""
    with plan.lock:
        decide(plan, block, device, _classes()[2])
        plan.handoff_in_reasons = handoff.receive_reasons(plan, block)
        _processor(block, plan)
    log.info("qwen_absorb: block %d decided anew for %s", plan.index, device)


def _offload_originals(state: _PatchState) -> None:
    """Move the original weights of FP8-GEMM linears to host memory (their values stay intact)."""
    for rec in state.records:
        plan = rec.block.__dict__[PLAN_ATTR]
        for path, lp in plan.linears.items():
            if lp.fp8_gemm and lp.weight is not None and not lp.weight.reused_storage:
                w = unwrap_peft(resolve(rec.block, path))[0]._parameters["weight"]
                if w.device.type != "cpu":
                    state.offloaded.append((w, w.device))
                    w.data = w.data.to("cpu")
                    lp.offloaded = True
    if state.offloaded:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- patch


def _options(defer_bias, fp8_gemm, capabilities, force_reference, kernels_under_compile,
             offload_original_weights, use_fast_accum, cross_block=True) -> Options:
    return Options(
        defer_bias=gating.check_mode(defer_bias), fp8_gemm=gating.check_fp8_mode(fp8_gemm),
        capabilities=gating.normalize_capabilities(capabilities),
        fp8_capabilities=gating.normalize_capabilities(capabilities, gating.VALIDATED_FP8_CAPABILITIES),
        force_reference=bool(force_reference), kernels_under_compile=bool(kernels_under_compile),
        offload_original_weights=bool(offload_original_weights), use_fast_accum=bool(use_fast_accum),
        cross_block=bool(cross_block),
    )


def patch(
    target: Any, *, defer_bias: str | bool = "auto", fp8_gemm: str | bool = "auto", cuda_graph: bool = False,
    offload_original_weights: bool = False, capabilities: Collection[tuple[int, int] | str] | None = None,
    force_reference: bool = False, kernels_under_compile: bool = False, use_fast_accum: bool = False,
    cross_block: bool = True,
) -> PatchReport:
    """Make every ``QwenImageTransformerBlock`` of ``target`` run the fused ops of :mod:`qwen_absorb.ops`.

    target: a diffusers Qwen-Image pipeline (any class whose ``.transformer`` is a
        ``QwenImageTransformer2DModel``) or the transformer itself; any device, before or after
        offloading, caches, context parallelism, LoRA or ``compile_repeated_blocks()``.
    defer_bias: ``"auto"`` defers an output-projection bias into the following fused op exactly when
        the projection is ModelOpt FP8/NVFP4 without an enabled output quantizer, the CUDA kernels are
        available and the device capability is validated (:mod:`qwen_absorb.gating`); ``True`` defers
        wherever it is not wrong; ``False`` never.
    fp8_gemm: run ModelOpt FP8 (e4m3, per-tensor, static) linears as real FP8 ``torch._scaled_mm``
        fed by FP8-emitting fused kernels: ``"auto"`` on validated capabilities
        (:data:`qwen_absorb.gating.VALIDATED_FP8_CAPABILITIES`), ``True`` wherever possible (sm_89+),
        ``False`` never (the linears run as ModelOpt runs them). Every linear that does not qualify
        runs as ModelOpt runs it, with the reason in the report.
    cuda_graph: capture the transformer call once per input signature and replay it
        (:mod:`qwen_absorb.cuda_graph`); refused per call, with a reason, where replay would be wrong.
    offload_original_weights: keep only the FP8 weights of real-FP8 linears on the GPU; their original
        weights move to host memory (values intact, ``state_dict`` the same values on the CPU) and
        :func:`unpatch` moves them back. Moving the model with ``.to()`` afterwards moves them too.
    capabilities: replaces the validated capability sets for this call, e.g. ``{(9, 0)}``, or
        ``{"cpu"}`` to exercise deferral on the CPU with the ops' references.
    force_reference: make the fused ops run their torch references (debugging).
    kernels_under_compile: while ``torch.compile`` traces a patched block, use the fused CUDA
        kernels (custom ops) instead of leaving the elementwise chains to Inductor (off: Inductor
        fuses them about as fast, without the per-op launch cost).
    use_fast_accum: ``torch._scaled_mm``'s faster, less exact accumulation for the FP8 GEMMs.
    cross_block: let each block's FFN residual op also compute the next block's norm1 (one kernel
        instead of two at every block boundary, :mod:`qwen_absorb.handoff`); the next block takes it
        only when it receives exactly the tensors handed over, else it recomputes (counted).

    Patching again with the same arguments returns the current report; with other arguments (or
    after the model changed under the patch, e.g. ``mtq.quantize`` after patching) it unpatches and
    patches anew.
    """
    transformer = resolve_transformer(target)
    options = _options(defer_bias, fp8_gemm, capabilities, force_reference, kernels_under_compile,
                       offload_original_weights, use_fast_accum, cross_block)
    state = transformer.__dict__.get(_STATE_ATTR)
    if state is not None:
        stale = _stale(state)
        if state.options == options and bool(state.graph) == bool(cuda_graph) and stale is None:
            log.debug("qwen_absorb: already patched with these arguments; returning the current report")
            return state.report
        log.info("qwen_absorb: patching again (%s)", stale or "other arguments")
        unpatch(transformer)
    report = PatchReport(
        transformer_class=type(transformer).__name__, dtype=_dtype(transformer), defer_bias=options.defer_bias,
        capabilities=sorted(str(c) for c in options.capabilities), fp8_gemm=options.fp8_gemm,
        force_reference=options.force_reference, runtime_fallbacks=Counter(),
        offload_original_weights=options.offload_original_weights,
    )
    device = _decision_device(transformer)
    _, block_cls, proc_cls = _classes()
    plans: list[tuple[nn.Module, BlockPlan]] = []
    for i, block in enumerate(getattr(transformer, "transformer_blocks", [])):
        plan = BlockPlan(index=i, options=options, counter=report.runtime_fallbacks)
        report.blocks.append(plan)
        if not isinstance(block, block_cls):
            plan.reasons.append(f"{type(block).__name__} is not a QwenImageTransformerBlock")
            continue
        decide(plan, block, device, proc_cls)
        plan.handoff_in_reasons = handoff.receive_reasons(plan, block)
        plans.append((block, plan))
    state = _PatchState(report, [], options)
    try:
        for block, plan in plans:
            _install_block(state, block, plan)
        handoff.link(report.blocks, list(getattr(transformer, "transformer_blocks", [])), transformer)
        if options.offload_original_weights:
            _offload_originals(state)
        if cuda_graph:
            from . import cuda_graph as graphs  # noqa: PLC0415

            state.graph = report.cuda_graph = graphs.install(transformer, fallbacks=report.runtime_fallbacks)
    except BaseException:
        _undo(state)
        raise
    object.__setattr__(transformer, _STATE_ATTR, state)
    if not report.kernels_available:
        log.warning("qwen_absorb: the fused CUDA kernels cannot run here (%s); the patched blocks run the "
                    "torch references (same numbers, no speed-up)", "; ".join(report.kernel_unavailable_reasons))
    log.info("%s", report)
    return report


def _dtype(transformer: nn.Module) -> str:
    p0 = next(transformer.parameters(), None)
    return str(p0.dtype).replace("torch.", "") if p0 is not None else "?"


def _install_block(state: _PatchState, block: nn.Module, plan: BlockPlan) -> None:
    fwd = PatchedForward(block)
    installed = _install(block, fwd)
    if installed is None:
        plan.reasons.append("the block's forward is wrapped by something unknown (no slot holds the class forward)")
        for s in plan.sites:
            s.fused, s.bias_deferred = False, False
            s.reasons = ["block not patched"]
            if s.projection:
                s.defer_reasons = ["block not patched"]
        plan.deferred.clear()
        for lp in plan.linears.values():
            if lp.fp8_gemm:
                lp.fp8_gemm, lp.fp8_reasons, lp.weight = False, ["block not patched"], None
        return
    object.__setattr__(block, PLAN_ATTR, plan)
    state.records.append(_BlockRecord(block, fwd, installed[1], installed[0]))
    plan.patched = True
    plan.install = installed[0]
    _processor(block, plan)


def _stale(state: _PatchState) -> str | None:
    """Why the active patch no longer matches the model (None: it does)."""
    for rec in state.records:
        plan = rec.block.__dict__.get(PLAN_ATTR)
        if plan is None:
            return f"block {rec.block} lost its plan"
        why = plan.stale or plan.changed(rec.block)
        if why is not None:
            return f"block {plan.index}: {why}"
    return None


# ---------------------------------------------------------------------------- unpatch


def _undo(state: _PatchState) -> None:
    if state.graph is not None:
        state.graph.remove()
        state.graph = None
    for w, dev in state.offloaded:
        w.data = w.data.to(dev)
    state.offloaded.clear()
    for rec in state.records:
        proc = getattr(rec.block.attn, "processor", None)
        if isinstance(proc, FusedAttnProcessor):
            rec.block.attn.set_processor(proc.original)
        for path in {p for plan in [rec.block.__dict__.get(PLAN_ATTR)] if plan for p in plan.deferred.values()}:
            base = unwrap_peft(resolve(rec.block, path))[0] if resolve(rec.block, path) is not None else None
            if base is not None:
                base.__dict__.pop("bias", None)  # only set during a call; cleared in case one was interrupted
        rec.block.__dict__.pop(PLAN_ATTR, None)
        if not _uninstall(rec):
            log.warning("qwen_absorb: block forward of %s not found in its hook chain; left in place "
                        "(it runs the original forward)", type(rec.block).__name__)


def unpatch(target: Any) -> None:
    """Undo :func:`patch`: the original forwards (in the same hook slots), processors and biases.

    Module structure, parameters and ``state_dict`` are exactly those of the unpatched model (they
    never changed; offloaded originals come back to their device); outputs are bit-identical to a
    never-patched model. A no-op if not patched.
    """
    transformer = resolve_transformer(target)
    state = transformer.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        log.debug("qwen_absorb: unpatch on a model that is not patched")
        return
    _undo(state)
    state.report.active = False
    log.info("qwen_absorb: unpatched %d blocks", len(state.records))


def patch_report(target: Any) -> PatchReport | None:
    """The report of the active patch on ``target``, or None."""
    state = resolve_transformer(target).__dict__.get(_STATE_ATTR)
    return state.report if state is not None else None
