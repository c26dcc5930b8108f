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
"""

from __future__ import annotations

import logging
import types
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import gating, ops
from .block import BlockPlan, DeferredBias, make_forward
from .quant import inspect_norm, inspect_projection
from .report import SITE_PROJECTION, SITES, STREAMS, BlockReport, PatchReport, SiteReport

log = logging.getLogger("qwen_absorb")

_STATE_ATTR = "_qwen_absorb_state"
_NORMS = ("img_norm1", "txt_norm1", "img_norm2", "txt_norm2")


@dataclass
class _BlockRecord:
    block: nn.Module
    patched_forward: Any  # the bound method we installed
    original: Any  # the object that held the slot before (None: the class forward, no instance attr)
    deferred: list[DeferredBias] = field(default_factory=list)


@dataclass
class _PatchState:
    report: PatchReport
    records: list[_BlockRecord]


# ---------------------------------------------------------------------------- target resolution


def _classes():
    from diffusers.models.transformers.transformer_qwenimage import (  # noqa: PLC0415
        QwenDoubleStreamAttnProcessor2_0,
        QwenImageTransformer2DModel,
        QwenImageTransformerBlock,
    )

    return QwenImageTransformer2DModel, QwenImageTransformerBlock, QwenDoubleStreamAttnProcessor2_0


def resolve_transformer(target: Any) -> nn.Module:
    """The ``QwenImageTransformer2DModel`` of a pipeline, or ``target`` itself."""
    model_cls = _classes()[0]
    target = getattr(target, "_orig_mod", target)  # torch.compile(transformer) wrapper
    if isinstance(target, model_cls):
        return target
    inner = getattr(target, "transformer", None)
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


def _install(block: nn.Module, bound: Any) -> tuple[str, Any] | None:
    """Put ``bound`` where the original forward is held; returns (where, the object replaced)."""
    if "forward" not in block.__dict__:  # no hook, no instance forward: the class forward runs
        object.__setattr__(block, "forward", bound)
        return "forward", None
    for where, get, set_ in _slots(block):
        if where == "forward" and "forward" not in block.__dict__:
            continue
        current = get()
        if _is_class_forward(current, block):
            set_(bound)
            return where, current
    return None


def _uninstall(rec: _BlockRecord) -> bool:
    block = rec.block
    for where, get, set_ in _slots(block):
        if get() is rec.patched_forward:
            if where == "forward" and rec.original is None:
                del block.__dict__["forward"]
            else:
                set_(rec.original if rec.original is not None else type(block).forward.__get__(block))
            return True
    return False


# ---------------------------------------------------------------------------- patch


def _projections(block: nn.Module) -> dict[str, nn.Module | None]:
    attn = block.attn
    to_out = getattr(attn, "to_out", None)
    return {
        "attn.to_out.0": to_out[0] if to_out is not None and len(to_out) > 0 else None,
        "attn.to_add_out": getattr(attn, "to_add_out", None),
        "img_mlp.net.2": _ffn_out(block.img_mlp),
        "txt_mlp.net.2": _ffn_out(block.txt_mlp),
    }


def _ffn_out(ffn: nn.Module) -> nn.Module | None:
    net = getattr(ffn, "net", None)
    return net[2] if net is not None and len(net) > 2 else None


def _structure_refusals(block: nn.Module, name: str) -> list[str]:
    """Deferral needs the projection to be the last thing that touches the output."""
    _, _, proc_cls = _classes()
    if name.startswith("attn."):
        proc = getattr(block.attn, "processor", None)
        if type(proc) is not proc_cls:
            return [f"attention processor {type(proc).__name__} is not {proc_cls.__name__}"]
        to_out = block.attn.to_out
        if len(to_out) > 2 or (len(to_out) == 2 and not _is_identity_dropout(to_out[1])):
            return ["attn.to_out has modules after the projection"]
        return []
    net = (block.img_mlp if name.startswith("img") else block.txt_mlp).net
    if len(net) != 3:
        return [f"{name.split('.')[0]}.net has {len(net)} modules (expected GELU, Dropout, Linear)"]
    return []


def _is_identity_dropout(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout) and (m.p == 0.0 or not m.training)


def patch(
    target: Any, *, defer_bias: str | bool = "auto",
    capabilities: Collection[tuple[int, int] | str] | None = None, force_reference: bool = False,
    kernels_under_compile: bool = False,
) -> PatchReport:
    """Make every ``QwenImageTransformerBlock`` of ``target`` run the fused ops of :mod:`qwen_absorb.ops`.

    target: a diffusers Qwen-Image pipeline (any class whose ``.transformer`` is a
        ``QwenImageTransformer2DModel``) or the transformer itself; any device, before or after
        offloading, caches, context parallelism, LoRA or ``compile_repeated_blocks()``.
    defer_bias: ``"auto"`` defers an output-projection bias into the following fused op exactly when
        the projection is ModelOpt FP8/NVFP4 without an enabled output quantizer, the CUDA kernels are
        available and the device capability is validated (:mod:`qwen_absorb.gating`); ``True`` defers
        wherever it is not wrong; ``False`` never.
    capabilities: replaces :data:`qwen_absorb.gating.VALIDATED_DEFER_CAPABILITIES` for this call, e.g.
        ``{(9, 0)}``, or ``{"cpu"}`` to exercise deferral on the CPU with the ops' references.
    force_reference: make the fused ops run their torch references (debugging).
    kernels_under_compile: while ``torch.compile`` traces a patched block, use the fused CUDA
        kernels (as custom ops, bit-exact to eager) instead of leaving the chains to Inductor. Off by
        default: Inductor fuses the same chains into Triton kernels about as fast as ours and without
        the per-op Python launch cost (benchmarks/results/bench_block.md), so "patch + compile" stays
        as fast as compile alone; deferred biases are still taken out of the GEMMs either way.

    Patching an already patched model is a no-op that returns the current report.
    """
    transformer = resolve_transformer(target)
    state = transformer.__dict__.get(_STATE_ATTR)
    if state is not None:
        log.debug("qwen_absorb: %s is already patched; returning the current report", type(transformer).__name__)
        return state.report
    mode = gating.check_mode(defer_bias)
    caps = gating.normalize_capabilities(capabilities)
    device = _decision_device(transformer)
    kernel_reasons = list(ops.kernel_runtime_reasons(device))
    if force_reference or ops._eligibility.force_reference_requested():
        kernel_reasons.insert(0, "reference forced (force_reference=True or QWEN_ABSORB_FORCE_REFERENCE=1)")
    p0 = next(transformer.parameters(), None)
    report = PatchReport(
        transformer_class=type(transformer).__name__, device=str(device),
        dtype=str(p0.dtype).replace("torch.", "") if p0 is not None else "?",
        defer_bias=mode, capabilities=sorted(str(c) for c in caps),
        kernels_available=not kernel_reasons, kernel_unavailable_reasons=kernel_reasons,
        force_reference=bool(force_reference), runtime_fallbacks=Counter(),
    )
    _, block_cls, _ = _classes()
    records: list[_BlockRecord] = []
    for i, block in enumerate(getattr(transformer, "transformer_blocks", [])):
        br, rec = _patch_block(
            i, block, block_cls, report, mode, caps, device, kernel_reasons, force_reference, kernels_under_compile
        )
        report.blocks.append(br)
        if rec is not None:
            records.append(rec)
    object.__setattr__(transformer, _STATE_ATTR, _PatchState(report, records))
    log.info("%s", report)
    return report


def _patch_block(
    i: int, block: nn.Module, block_cls: type, report: PatchReport, mode: str | bool,
    caps: frozenset, device: torch.device, kernel_reasons: list[str], force_reference: bool,
    kernels_under_compile: bool,
) -> tuple[BlockReport, _BlockRecord | None]:
    br = BlockReport(index=i, patched=False)
    if not isinstance(block, block_cls):
        br.reasons.append(f"{type(block).__name__} is not a QwenImageTransformerBlock")
        return br, None
    norms = {n: inspect_norm(n, getattr(block, n)) for n in _NORMS}
    br.norms = norms
    mods = _projections(block)
    for name, m in mods.items():
        if m is not None:
            br.projections[name] = inspect_projection(name, m)

    fuse: dict[tuple[str, str], bool] = {}
    deferred: dict[tuple[str, str], DeferredBias | None] = {}
    for stream in STREAMS:
        for site in SITES:
            s = SiteReport(block=i, stream=stream, site=site, fused=True)
            if site == "norm1":
                s.reasons = list(norms[f"{stream}_norm1"].unsupported)
            elif site == "attn_residual":
                s.reasons = list(norms[f"{stream}_norm2"].unsupported)
            s.fused = not s.reasons
            norm = norms[f"{stream}_norm1" if site == "norm1" else f"{stream}_norm2"]
            if site != "ffn_residual" and norm.input_quantizer_enabled:
                s.norm_quantizer = "fp8-fused" if (site == "attn_residual" and not norm.fp8_kernel_reasons) \
                    else "applied-before-op"
            fuse[(stream, site)] = s.fused
            deferred[(stream, site)] = None
            proj_name = SITE_PROJECTION.get((stream, site))
            if proj_name is not None:
                s.projection = proj_name
                info = br.projections.get(proj_name)
                if info is None:
                    s.defer_reasons = [f"{proj_name} not found"]
                else:
                    s.defer_reasons = _structure_refusals(block, proj_name) + gating.defer_refusals(
                        info, mode=mode, consumer_fused=s.fused, device=device, capabilities=caps,
                        kernel_reasons=kernel_reasons,
                    )
                if not s.defer_reasons:
                    s.bias_deferred = True
            br.sites.append(s)

    plan = BlockPlan(
        index=i, counter=report.runtime_fallbacks, force_reference=bool(force_reference),
        kernels_under_compile=bool(kernels_under_compile),
        eps={n: norms[n].eps for n in _NORMS}, fuse=fuse, deferred=deferred,
        quant_norms=frozenset(n for n in _NORMS if norms[n].modelopt),
    )
    forward = make_forward(plan, type(block).forward)
    bound = types.MethodType(forward, block)
    installed = _install(block, bound)
    if installed is None:
        br.reasons.append("the block's forward is wrapped by something unknown (no slot holds the class forward)")
        for s in br.sites:
            s.fused, s.bias_deferred = False, False
            s.reasons = ["block not patched"]
            if s.projection:
                s.defer_reasons = ["block not patched"]
        return br, None
    br.patched, br.install = True, installed[0]
    rec = _BlockRecord(block=block, patched_forward=bound, original=installed[1])
    for s in br.sites:
        if s.bias_deferred:
            base = _base(mods[s.projection])
            d = DeferredBias(base, f"block {i} {s.projection}")
            deferred[(s.stream, s.site)] = d
            rec.deferred.append(d)
    plan.all_deferred = list(rec.deferred)
    return br, rec


def _base(m: nn.Module) -> nn.Module:
    while isinstance(getattr(m, "base_layer", None), nn.Module):
        m = m.base_layer
    return m


# ---------------------------------------------------------------------------- unpatch


def unpatch(target: Any) -> None:
    """Undo :func:`patch`: the original forwards (in the same hook slots) and biases back in their GEMMs.

    Module structure, parameters and ``state_dict`` are exactly those of the unpatched model (they
    never changed); outputs are bit-identical to a never-patched model. A no-op if not patched.
    """
    transformer = resolve_transformer(target)
    state = transformer.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        log.debug("qwen_absorb: unpatch on a model that is not patched")
        return
    for rec in state.records:
        for d in rec.deferred:
            d.unshadow()  # only set during a call; cleared here too in case a call was interrupted
        if not _uninstall(rec):
            log.warning("qwen_absorb: block forward of %s not found in its hook chain; left in place", rec.block)
    state.report.active = False
    log.info("qwen_absorb: unpatched %d blocks", len(state.records))


def patch_report(target: Any) -> PatchReport | None:
    """The report of the active patch on ``target``, or None."""
    state = resolve_transformer(target).__dict__.get(_STATE_ATTR)
    return state.report if state is not None else None
