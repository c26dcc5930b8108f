"""``patch`` / ``unpatch``: run every Qwen-Image (and Qwen-Image-2.1) transformer block through the fused ops.

The patched forward goes where the *original* bound forward is kept (:mod:`qwen_absorb.hooks`), so hook chains stay
intact; block class, signature and return order never change. All blocks are planned, then installed; an exception
(or Ctrl-C) while installing undoes what was installed."""

import contextlib
import functools
import logging
import weakref
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from . import fp8_forward, gating, handoff, hooks, host_originals
from . import pipeline_walks as walks_room
from . import text_encoder as text_encoder_room
from . import vae as vae_room
from .block import PatchedForward, redecide
from .dependencies import block_lock
from .plan import PLAN_ATTR, BlockPlan, BlockRuntime, Options, content_changed, decide
from .qwenimage21 import Patched21Forward
from .report import PatchReport
from .sites import classes, classes21, model_classes, resolve, unwrap_peft

log = logging.getLogger("qwen_absorb")

_STATE_ATTR = "_qwen_absorb_state"
_SECTIONS_ATTR = "_qwen_absorb_sections"  # on a pipeline: the report sections its own patch() wrote
# on a pipeline: the VAE and the image processor its patch changed (_Patched), by the undo for each
_PATCHED_PARTS = {"_qwen_absorb_vae": vae_room.unpatch, "_qwen_absorb_image_processor": vae_room.unpatch_postprocess}
GRAPHS_21_AUTO = ("Qwen-Image-2.1: cuda_graph='auto' leaves the blocks eager: on the H200 per-block graphs were no "
                  "faster than the eager patched call (qwenimage21_h200_3341f42.md: FP8 79.2 vs 78.7 ms, bf16 "
                  "116.2 vs 115.4 ms) and hold one output per block; cuda_graph=True installs them")
NOT_PATCHED_HERE = "not patched on this pipeline (a copy, a from_pipe sibling, a part set since patch(): patch() it)"


class _Patched(weakref.ref):
    """A part a pipeline's patch changed (its VAE, its image processor), weakly: one swapped out since
    (``pipe.vae = other``) is put back by the next ``patch`` or ``unpatch`` of the pipeline. A deep copy of the
    pipeline follows the part's copy made by the same deep copy (the copy's part is patched too, so the copy's
    ``unpatch`` must find it after a swap), else holds None, as a pickle does (its parts are its own)."""

    __slots__ = ()

    def __reduce__(self) -> tuple:
        return type(None), ()

    def __deepcopy__(self, memo: dict) -> "_Patched | None":
        # only a part this deep copy copied: one swapped out before it belongs to the original, not to the copy
        part = self()
        copied = memo.get(id(part)) if part is not None else None
        return type(self)(copied) if copied is not None else None


@dataclass
class _BlockRecord:
    block: nn.Module
    installed: PatchedForward | Patched21Forward
    had_instance_forward: bool  # False: the slot was empty (the class forward ran)
    slot: str


@dataclass
class _PatchState:
    """What an active patch made, kept on the transformer (so copies of the model carry it)."""

    report: PatchReport
    options: Options
    cuda_graph: str | bool
    blocks: list[nn.Module]  # the model's blocks as patched, in order
    plans: list[BlockPlan]
    records: list[_BlockRecord] = field(default_factory=list)
    graph: Any = None
    active: bool = True
    model: Any = None  # the transformer (the report compares its blocks now with ``blocks``)

    def dtype(self) -> str:
        p0 = next((p for b in self.blocks for p in b.parameters()), None)
        return str(p0.dtype).replace("torch.", "") if p0 is not None else "?"

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.report.bind(self)  # a copy of the model reports on its own patch


def _decision_device(transformer: nn.Module) -> torch.device:
    """The device the blocks will run on (offloaded models live on the CPU until they run)."""
    first = None
    for p in transformer.parameters():
        first = first or p.device
        if p.device.type not in ("cpu", "meta"):
            return p.device
    dev = hooks.execution_device(transformer, list(getattr(transformer, "transformer_blocks", [])))
    if dev is not None:
        return dev
    return first if first is not None and first.type != "meta" else torch.device("cpu")


def _install(block: nn.Module, fwd: PatchedForward | Patched21Forward) -> _BlockRecord | None:
    """Put ``fwd`` where the original forward is held; None where no slot holds the class forward."""
    if "forward" not in block.__dict__:  # no hook, no instance forward: the class forward runs
        object.__setattr__(block, "forward", fwd)
        return _BlockRecord(block, fwd, False, "forward")
    for where, get, set_ in hooks.forward_slots(block):
        fn = get()
        if getattr(fn, "__func__", None) is type(block).forward and getattr(fn, "__self__", None) is block:
            set_(fwd)
            return _BlockRecord(block, fwd, True, where)
    return None


def _strip(block: nn.Module) -> None:
    """Remove a patch the block carries that is not this one's (a copied patched block, an earlier patch)."""
    block.__dict__.pop(PLAN_ATTR, None)
    host_originals.restore(block)
    fp8_forward.remove(block)
    for _, get, _ in list(hooks.forward_slots(block)):
        fn = get()
        if getattr(type(fn), "__qwen_absorb_graph__", False) is True and isinstance(fn._inner, PatchedForward):
            fn.remove()  # puts the patched forward it wraps back in its slot: removed next
    for where, get, _ in list(hooks.forward_slots(block)):
        fn = get()
        if isinstance(fn, PatchedForward):
            hooks.put_back(block, fn, type(block).forward.__get__(block), where != "forward")


def _new_state(transformer: nn.Module, options: Options, cuda_graph: str | bool, blocks: list,
               **kw: Any) -> _PatchState:
    report = PatchReport(transformer_class=type(transformer).__name__, defer_bias=options.defer_bias,
                         capabilities=sorted(str(c) for c in options.capabilities), fp8_gemm=options.fp8_gemm,
                         force_reference=options.force_reference, cuda_graph_mode=cuda_graph,
                         tuning=options.tuning.describe(), **kw)
    state = _PatchState(report, options, cuda_graph, blocks, [], model=transformer)
    report.bind(state)
    return state


def patch(
    target: Any, *, defer_bias: str | bool = "auto", fp8_gemm: str | bool = "auto", cuda_graph: str | bool = "auto",
    offload_original_weights: str | bool = "auto", capabilities: Collection[tuple[int, int] | str] | None = None,
    force_reference: bool = False, kernels_under_compile: str | bool = "auto", use_fast_accum: str | bool = "auto",
    cross_block: bool = True, vae: bool = True, text_encoder: bool = True, pipeline_walks: bool = True,
    tuning: gating.Tuning | None = None,
) -> PatchReport:
    """Make every ``QwenImageTransformerBlock`` of ``target`` run the fused ops of :mod:`qwen_absorb.ops`.

    target: a diffusers Qwen-Image (or 2.1) pipeline or its transformer; any device, before or after offloading,
        caches, parallelism, LoRA or ``compile_repeated_blocks()``.
    defer_bias: ``"auto"`` defers an output-projection bias into the next fused op where the projection is ModelOpt
        FP8 without an enabled output quantizer, the kernels run and the capability is validated
        (:mod:`qwen_absorb.gating`); ``True`` wherever it is not wrong; ``False`` never.
    fp8_gemm: ModelOpt FP8 (e4m3, per-tensor, static) linears, PEFT LoRA layers around them included, as real FP8
        ``torch._scaled_mm`` fed by FP8-emitting fused kernels: ``"auto"`` on validated capabilities, ``True``
        wherever possible (sm_89+), ``False`` never; other linears run as their modules (reason in the report).
    cuda_graph: replay the transformer call per input signature (:mod:`qwen_absorb.cuda_graph`), refused per call
        where replay would be wrong. ``"auto"``: decided at the first call on a GPU, a signature captured at its
        second call, eager calls in ``report.graph_fallbacks``; ``True``: captured at first sight, refusals in
        ``report.runtime_fallbacks``; ``False``: never.
    offload_original_weights: ``"auto"`` / ``True``: real-FP8 linears' original weights stay in host memory while
        their codes run on a GPU (same ``Parameter`` objects; a fallback call brings them over, :func:`unpatch`
        puts them back); ``False``: beside the codes (about 1.5x the bf16 memory).
    capabilities: replaces the validated capability sets, e.g. ``{(9, 0)}``, or ``{"cpu"}`` to exercise the
        decisions on the CPU with the ops' references.
    force_reference: the fused ops run their torch references (debugging).
    kernels_under_compile: what ``torch.compile`` sees of a patched Qwen-Image block: ``"auto"`` one opaque op
        running the eager patched forward (:mod:`qwen_absorb.compile_boundary`); ``True`` the forward traced with
        the kernels as custom ops; ``False`` traced with the references.
    use_fast_accum: ``torch._scaled_mm``'s fast accumulation: ``"auto"`` on GPUs that passed the fidelity gate
        (:data:`qwen_absorb.gating.VALIDATED_FAST_ACCUM_CAPABILITIES`), ``True`` / ``False`` everywhere.
    cross_block: each block's FFN residual op also computes the next block's norm1 (:mod:`qwen_absorb.handoff`).
    tuning: a :class:`qwen_absorb.Tuning` of measurement switches (None: the measured defaults).
    vae / text_encoder / pipeline_walks: for a pipeline, also its VAE decode (:mod:`qwen_absorb.vae`), prompt
        encoding (:mod:`qwen_absorb.text_encoder`) and diffusers' per-call module walks (the pipeline's class
        becomes a subclass of the same name, :mod:`qwen_absorb.pipeline_walks`), in ``report.parts``.

    Patching again with the same arguments returns the current report; with others, or after blocks were replaced,
    added or removed, it patches anew. Changes inside a block (weights, quantizers, LoRA, dtype, device) are seen
    at that block's next call, which decides again.
    """
    transformer = hooks.resolve_transformer(target, model_classes())
    tri = gating.check_tristate
    cuda_graph = tri("cuda_graph", cuda_graph)
    if not all(isinstance(x, bool) for x in (vae, text_encoder, pipeline_walks, cross_block)):  # before patching
        raise ValueError("vae, text_encoder, pipeline_walks and cross_block must be True or False")
    if not isinstance(force_reference, bool):
        raise ValueError(f"force_reference must be True or False, got {force_reference!r}")
    options = Options(
        defer_bias=tri("defer_bias", defer_bias), fp8_gemm=tri("fp8_gemm", fp8_gemm),
        capabilities=gating.normalize_capabilities(capabilities), force_reference=bool(force_reference),
        fp8_capabilities=gating.normalize_capabilities(capabilities, gating.VALIDATED_FP8_CAPABILITIES),
        kernels_under_compile=tri("kernels_under_compile", kernels_under_compile),
        offload_original_weights=tri("offload_original_weights", offload_original_weights),
        use_fast_accum=tri("use_fast_accum", use_fast_accum), cross_block=bool(cross_block),
        tuning=gating.check_tuning(tuning))
    report = _patch_transformer(transformer, options, cuda_graph)
    return _rooms(target, transformer, report, cuda_graph, vae, text_encoder, pipeline_walks)


def _patch_transformer(transformer: nn.Module, options: Options, cuda_graph: str | bool) -> PatchReport:
    state = transformer.__dict__.get(_STATE_ATTR)
    if state is not None:
        stale = _stale(state, transformer)
        if state.options == options and state.cuda_graph == cuda_graph and stale is None:
            _catch_up(state)
            log.debug("already patched with these arguments; returning the current report")
            return state.report
        log.info("patching again (%s)", stale or "other arguments")
        unpatch(transformer)
    blocks, device = list(getattr(transformer, "transformer_blocks", [])), _decision_device(transformer)
    if classes21() is not None and isinstance(transformer, classes21()[0]):
        return _patch21(transformer, _new_state(transformer, options, cuda_graph, blocks), device)
    state = _new_state(transformer, options, cuda_graph, blocks,
                       offload_original_weights=options.offload_original_weights)
    report, plans, block_cls, announced = state.report, state.plans, classes()[1], set()
    for i, block in enumerate(blocks):
        plan = BlockPlan(index=i, options=options, rt=BlockRuntime(
            counter=report.runtime_fallbacks, rebuilds=report.rebuilds, handoffs=report.handoffs, announced=announced,
            on_decide=functools.partial(host_originals.after_decide, report.record, block), lock=block_lock(block)))
        plans.append(plan)
        if not isinstance(block, block_cls):
            plan.reasons.append(f"{type(block).__name__} is not a QwenImageTransformerBlock")
            continue
        _strip(block)
        try:
            # gated real-FP8 forwards on the attention linears, run only while the block calls a hooked
            # attention as its module (plan.attn_forwards); installed before deciding: the watch sees them
            fp8_forward.install(block, i, options, report.runtime_fallbacks, report.rebuilds,
                                report.record_forward, paths=fp8_forward.ATTN_LINEARS, gated=True)
            decide(plan, block, device)
            plan.handoff_in_reasons = handoff.receive_reasons(plan, block)
        except BaseException:
            for b in blocks[: i + 1]:
                fp8_forward.remove(b)
            raise
    try:
        for block, plan in zip(blocks, plans):
            if not plan.reasons:
                _install_block(state, block, plan)
        handoff.link(plans, blocks, transformer)
        for rec in state.records:  # originals where offload_original_weights wants them
            host_originals.place(rec.block.__dict__[PLAN_ATTR], rec.block)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the moved originals' memory back to the driver
        auto = cuda_graph == "auto"
        graph_args = dict(fallbacks=report.graph_fallbacks if auto else report.runtime_fallbacks,
                          host_tensors=lambda: host_originals.host_weights(transformer), capture_after=int(auto))
        if cuda_graph is True or (auto and device.type == "cuda"):
            state.graph = _cuda_graph().install(transformer, **graph_args, warn_first=auto)
        elif auto:  # on the CPU now: decided at the first call on a GPU (.to("cuda"), an offload hook)
            state.graph = _cuda_graph().FirstUse(transformer, **graph_args)
    except BaseException:
        _undo(state)
        for b in blocks:
            if isinstance(b, block_cls):
                fp8_forward.remove(b)  # blocks planned but not installed yet hold gated forwards too
        raise
    for plan in plans:
        report.record(plan)  # after installing: patched, install slot, links
    return _activate(transformer, state)


def _activate(transformer: nn.Module, state: _PatchState) -> PatchReport:
    object.__setattr__(transformer, _STATE_ATTR, state)
    log.info("%s", state.report)  # whether kernels run is said at the first call on a device (qwen_absorb.block)
    return state.report


def _rooms(target: Any, transformer: nn.Module, report: PatchReport | None, cuda_graph: str | bool, vae: bool,
           text_encoder: bool, walks: bool) -> PatchReport | None:
    """A pipeline's VAE decode, prompt encoding and module walks, their sections in ``report.parts`` and on the
    pipeline; each one asked for False is undone and has none."""
    if target is transformer or not hasattr(target, "transformer"):
        return report
    parts: dict[str, Any] = {}
    if walks:
        parts["pipeline"] = walks_room.patch(target)
    else:
        walks_room.unpatch(target)
    pipe_vae, proc = getattr(target, "vae", None), getattr(target, "image_processor", None)
    for (attr, undo), now in zip(_PATCHED_PARTS.items(), (pipe_vae, proc)):
        held = target.__dict__.pop(attr, None)
        old = held() if isinstance(held, _Patched) else None
        if old is not None and old is not now:
            undo(old)  # swapped out of the pipeline since its patch
    if vae and isinstance(pipe_vae, nn.Module):
        parts["vae"] = vae_room.patch(pipe_vae, cuda_graph=cuda_graph)
        parts["vae"].postprocess = vae_room.patch_postprocess(proc)
        for attr, part in zip(_PATCHED_PARTS, (pipe_vae, proc)):
            with contextlib.suppress(TypeError):  # a part that takes no weak reference is not followed
                target.__dict__[attr] = _Patched(part)
    else:
        vae_room.unpatch(pipe_vae)
        vae_room.unpatch_postprocess(proc)
    if text_encoder:
        # "auto" (a key's second call) even under cuda_graph=True: a prompt length seen once costs no capture
        parts["text_encoder"] = text_encoder_room.patch(target, cuda_graph=False if cuda_graph is False else "auto")
    else:
        text_encoder_room.unpatch(target)
    if report is not None:
        report.parts = target.__dict__[_SECTIONS_ATTR] = parts
    elif (own := target.__dict__.pop(_SECTIONS_ATTR, None)) and "pipeline" in own:  # unpatch: a kept report
        own["pipeline"].on, own["pipeline"].reason = False, "unpatched"  # says so (the rooms' slots mark theirs)
    return report


def _catch_up(state: _PatchState) -> None:
    """``patch()`` again on a model changed inside its blocks: they decide now, so the report is current."""
    for rec in state.records:
        plan = rec.block.__dict__.get(PLAN_ATTR)
        if plan is not None:
            plan.rt.host_codes.clear()  # trusted by identity and version only: a ``.data`` write is seen from here
        if plan is None or plan.rt.device is None:
            continue
        if content_changed(plan, rec.block):
            for lp in plan.linears.values():  # no FP8 weight is reused: its key does not hold the amaxes' values
                lp.cache_key = ()
        elif not plan.rt.watch.changed():
            continue
        redecide(plan, rec.block, plan.rt.device, "the model changed (seen by patch())")


def _cuda_graph() -> Any:
    from . import cuda_graph  # noqa: PLC0415  (the one lazy import: graph mode is optional and large)

    return cuda_graph


def _patch21(transformer: nn.Module, state: _PatchState, device: torch.device) -> PatchReport:
    """Qwen-Image-2.1: the same install, report and unpatch (no deferral or hand-off; real FP8 in the linears' forward
    slots). Its model forward syncs with the host before the blocks, so ``cuda_graph=True`` graphs each block."""
    report, options, cuda_graph, block_cls = state.report, state.options, state.cuda_graph, classes21()[1]
    try:
        for i, block in enumerate(state.blocks):
            if not isinstance(block, block_cls):
                continue
            _strip(block)
            plan = BlockPlan(index=i, options=options, rt=BlockRuntime(counter=report.runtime_fallbacks,
                                                                       rebuilds=report.rebuilds))
            decide(plan, block, device)
            rec = _install(block, Patched21Forward(block, plan))
            if rec is None:
                log.warning("block %d: its forward is wrapped by something unknown; left unpatched", i)
                continue
            plan.patched, plan.install, plan.rt.on_decide = True, rec.slot, report.record
            state.records.append(rec)
            state.plans.append(plan)
            report.record(plan)
            plan.rt.linear_fwds = fp8_forward.install(block, i, options, report.runtime_fallbacks, report.rebuilds,
                                                      rec.installed.linear_decided)
        if state.records and cuda_graph is True:
            state.graph = _cuda_graph().install_blocks(
                [rec.block for rec in state.records], parent=transformer, fallbacks=report.runtime_fallbacks,
                capture_after=0, indices=[rec.installed.index for rec in state.records])
        elif state.records and cuda_graph == "auto" and device.type == "cuda":
            report.cuda_graph_refused = GRAPHS_21_AUTO
    except BaseException:
        _undo(state)
        raise
    return _activate(transformer, state)


def _install_block(state: _PatchState, block: nn.Module, plan: BlockPlan) -> None:
    rec = _install(block, PatchedForward(block))
    if rec is None:
        plan.reasons.append("the block's forward is wrapped by something unknown (no slot holds the class forward)")
        fp8_forward.remove(block)
        plan.attn_forwards = False
        for s in plan.sites:
            s.fused, s.bias_deferred, s.runner, s.mode, s.reasons = False, False, "eager", None, ["block not patched"]
            if s.projection:
                s.defer_reasons = ["block not patched"]
        for lp in plan.linears.values():
            if lp.fp8_gemm:
                lp.fp8_gemm, lp.fp8_reasons, lp.weight, lp.lora = False, ["block not patched"], None, False
        return
    object.__setattr__(block, PLAN_ATTR, plan)
    state.records.append(rec)
    plan.patched, plan.install = True, rec.slot


def _stale(state: _PatchState, transformer: nn.Module) -> str | None:
    """Why the active patch no longer matches the model (None: it does; changes inside a block are the block's)."""
    now = list(getattr(transformer, "transformer_blocks", []))
    if len(now) != len(state.blocks) or any(a is not b for a, b in zip(now, state.blocks)):
        return "the model's blocks were replaced, added or removed"
    for rec in state.records:
        if isinstance(rec.installed, Patched21Forward):  # a 2.1 block decides by itself, but for what no call sees
            if (why := fp8_forward.stale_reason(rec.block, rec.installed.plan.rt.linear_fwds)) is not None:
                return f"block {rec.installed.index}: {why}"
            continue
        plan = rec.block.__dict__.get(PLAN_ATTR)
        if plan is None:
            return f"a block lost its plan ({type(rec.block).__name__})"
        if plan.rt.stale is not None:
            return f"block {plan.index}: {plan.rt.stale}"
    return None


def _undo(state: _PatchState) -> None:
    if state.graph is not None:
        state.graph.remove()
    for block in state.blocks:
        host_originals.restore(block)  # on the device the model is on now
    for rec in state.records:
        with block_lock(rec.block):  # a call in another thread finishes its shadowed GEMMs first
            plan = rec.block.__dict__.get(PLAN_ATTR)
            for path in plan.deferred_paths() if plan is not None else ():
                base = unwrap_peft(resolve(rec.block, path))[0]
                if base is not None:
                    base.__dict__.pop("bias", None)  # only set during a call; cleared in case one was interrupted
            rec.block.__dict__.pop(PLAN_ATTR, None)
        fwds = rec.installed.plan.rt.linear_fwds.values() if isinstance(rec.installed, Patched21Forward) else ()
        fp8_forward.remove(rec.block, list(fwds))  # with them, their FP8 weights
        if not hooks.put_back(rec.block, rec.installed, type(rec.block).forward.__get__(rec.block),
                              rec.had_instance_forward):
            log.warning("block forward of %s not found in its hook chain; left in place (it runs the "
                        "original forward)", type(rec.block).__name__)
    handoff.drop()  # a record of an interrupted call would keep tensors and plans alive


def unpatch(target: Any) -> None:
    """Undo :func:`patch` on the blocks the model has now (forwards in the same hook slots, biases, weight places):
    outputs bit-identical to a never-patched model; plans, FP8 weights and graphs released. A no-op if not patched."""
    if hasattr(target, "transformer") and getattr(target, "transformer") is None and not isinstance(target, nn.Module):
        _rooms(target, None, None, False, vae=False, text_encoder=False, walks=False)  # a pipeline's own, still
        return
    transformer = hooks.resolve_transformer(target, model_classes())
    _rooms(target, transformer, None, False, vae=False, text_encoder=False, walks=False)
    state = transformer.__dict__.pop(_STATE_ATTR, None)
    for block in getattr(transformer, "transformer_blocks", []):
        if state is None or not any(rec.block is block for rec in state.records):
            _strip(block)
    if state is None:
        log.debug("unpatch on a model that is not patched")
        return
    state.report.freeze()
    _undo(state)
    state.active, state.graph = False, None
    state.plans.clear()
    state.records.clear()
    log.info("unpatched %d blocks", len(state.blocks))


def patch_report(target: Any) -> PatchReport | None:
    """The report of the active patch on ``target``, or None. For a pipeline, a view of its transformer's report
    (shared by ``from_pipe`` siblings) with that pipeline's sections as it is now: what runs there, else the section
    its own ``patch`` wrote where that says why it is off, else NOT_PATCHED_HERE; for the names its own ``patch``
    wrote (never patched: those of the transformer's report)."""
    transformer = hooks.resolve_transformer(target, model_classes())
    state = transformer.__dict__.get(_STATE_ATTR)
    if state is None or target is transformer or not hasattr(target, "transformer"):
        return state.report if state is not None else None
    own = target.__dict__.get(_SECTIONS_ATTR)
    vae = vae_room.report_of(getattr(target, "vae", None))
    proc = getattr(getattr(target, "image_processor", None), "__dict__", {}).get("postprocess")
    if vae is not None and vae.postprocess != isinstance(proc, vae_room.FastPostprocess):
        vae = replace(vae, postprocess=not vae.postprocess)  # the VAE's section, this pipeline's processor
    now = {"pipeline": walks_room.WalksReport(True) if isinstance(target, walks_room.FastWalks) else None,
           "vae": vae, "text_encoder": text_encoder_room.report_of(target)}
    off = {"pipeline": walks_room.WalksReport(False, NOT_PATCHED_HERE),
           "vae": vae_room.VaeReport(on=False, reasons=[NOT_PATCHED_HERE]),
           "text_encoder": text_encoder_room.TextEncoderReport(on=False, reasons=[NOT_PATCHED_HERE])}
    said_off = {n: p for n, p in (own or {}).items() if p is not None and not p.on}  # by its own patch()
    names = own if own is not None else state.report.parts
    return replace(state.report, parts={n: now[n] or said_off.get(n, off[n]) for n in names})
