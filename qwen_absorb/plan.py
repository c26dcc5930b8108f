"""Plans: what a patched block does, decided from the site table, and the only record of it.

A :class:`BlockPlan` is built per block at patch time from :mod:`qwen_absorb.sites` and ModelOpt's
per-layer facts (:mod:`qwen_absorb.quant`), and decided for the device the block runs on: at
patch time for the device the model sits on (or will run on, under offload hooks), and again
whenever the block first runs on another device, so ``patch(pipe); pipe.to("cuda")`` ends up with
the CUDA decisions. The :class:`~qwen_absorb.report.PatchReport` is these plans, read.

The plan lives on the block (an instance attribute), never in a closure: a ``deepcopy`` or pickle
of the model carries a consistent copy, bound to the copy's own modules. At call time the plan
checks that the modules it decided about are still the block's (identity and class): a replaced
linear, ``mtq.quantize`` after patching or a running calibration sends the call to diffusers'
original forward, counted, instead of a silently wrong fused path.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import gating, ops, parallel, quant
from .ops.qk_norm_rope import probe_variance_order
from .quant import NormInfo, ProjectionInfo, unwrap_peft
from .sites import LINEAR_TABLE, NORMS, SITE_TABLE, STREAMS, Site, resolve

PLAN_ATTR = "_qwen_absorb_plan"


@dataclass(frozen=True)
class Options:
    """The arguments of :func:`qwen_absorb.patch` that decisions depend on."""

    defer_bias: str | bool = "auto"
    fp8_gemm: str | bool = "auto"
    capabilities: frozenset = frozenset()
    fp8_capabilities: frozenset = frozenset()
    force_reference: bool = False
    kernels_under_compile: bool = False
    offload_original_weights: bool = False
    use_fast_accum: bool = False
    cross_block: bool = True


@dataclass
class SitePlan:
    """One fused site of one block (and its report entry)."""

    block: int
    stream: str
    site: str
    fused: bool = True
    reasons: list[str] = field(default_factory=list)  # why not fused
    projection: str | None = None  # the projection whose bias this site can take
    bias_deferred: bool = False
    defer_reasons: list[str] = field(default_factory=list)  # why the bias stays in the GEMM
    norm_quantizer: str | None = None  # "fp8-fused", "applied-before-op" or None
    fp8_out: bool = False  # emits the e4m3 codes its real-FP8 consumers read
    # runtime (not reported)
    norm_quant: Any = None  # ops.Fp8PerTensorQuant reproduced inside the op
    fp8_amax: torch.Tensor | None = None  # the consumers' input amax (fp32, one element)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in (
            "block", "stream", "site", "fused", "reasons", "projection", "bias_deferred", "defer_reasons",
            "norm_quantizer", "fp8_out")}


@dataclass
class LinearPlan:
    """How one linear of the block runs: as it is, or as a real FP8 ``torch._scaled_mm``."""

    path: str
    fp8_gemm: bool = False
    fp8_reasons: list[str] = field(default_factory=list)
    weight: quant.Fp8Weight | None = None  # runtime
    input_scale: torch.Tensor | None = None  # runtime: input amax / 448
    bias: torch.Tensor | None = None  # runtime: the bias the GEMM epilogue adds (a Parameter, or its TP share)
    tp: Any = None  # runtime: parallel.TpShard of a tensor-parallel linear run on its local shard
    offloaded: bool = False  # its original weight was moved to host memory

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "fp8_gemm": self.fp8_gemm, "fp8_reasons": list(self.fp8_reasons),
                "reused_compressed_storage": bool(self.weight is not None and self.weight.reused_storage),
                "original_weight_offloaded": self.offloaded}


@dataclass
class BlockPlan:
    index: int
    patched: bool = False
    reasons: list[str] = field(default_factory=list)  # why the block forward was not replaced
    install: str = ""  # where the patched forward went
    device: str = ""  # the device the decisions below were made for
    kernel_reasons: list[str] = field(default_factory=list)
    sites: list[SitePlan] = field(default_factory=list)
    linears: dict[str, LinearPlan] = field(default_factory=dict)
    projections: dict[str, ProjectionInfo] = field(default_factory=dict)  # the four output projections
    norms: dict[str, NormInfo] = field(default_factory=dict)
    # runtime
    options: Options = field(default_factory=Options)
    counter: Counter = field(default_factory=Counter)
    runtime_device: torch.device | None = None
    kernels: bool = False  # fused ops launch their kernels (else their references)
    fp8_attention: bool = False  # an attention linear runs as a real FP8 GEMM
    qk_fused: bool = False  # the four q/k RMSNorm + RoPE chains run as one qk_norm_rope launch
    qk_eps: tuple[float, ...] = ()
    qk_min_rows: int = 1  # rows (B * L * heads) from which PyTorch's variance order is the kernel's
    own_attention: bool = False  # the attention runs qwen_absorb's path (qwen_absorb.attention.run)
    qk_reasons: list[str] = field(default_factory=list)  # why the q/k chains are not fused
    # tensor parallelism: per group ("attn", "img_mlp", "txt_mlp"), why its linears may not run on
    # their local shards without DTensor ([]: they may, whenever TP is found at call time)
    tp_reasons: dict[str, list[str]] = field(default_factory=lambda: {"attn": [], "img_mlp": [], "txt_mlp": []})
    # cross-block fusion: this block's FFN residual also computes the next block's norm1 (+ its
    # modulation), handed over per call (qwen_absorb.handoff)
    handoff_to: nn.Module | None = None  # the next block, or None
    handoff_reasons: list[str] = field(default_factory=list)  # why not (reported)
    handoffs_used: int = 0  # calls of this block that took a norm1 handed over by the previous one
    handoff_in_reasons: list[str] = field(default_factory=list)  # why this block cannot take one
    loop_owner: Any = None  # the transformer class whose forward loop calls the blocks
    modelopt: bool = False  # the block holds ModelOpt-quantized modules (called outside compiled graphs)
    quant_attention: bool = False  # block.attn is ModelOpt's QuantAttention (a global function swap)
    deferred: dict[str, str] = field(default_factory=dict)  # site key -> deferred projection path
    expected: tuple = ()  # ((path parts), module, class) of what the fused path bypasses or reimplements
    stale: str | None = None  # set when a call found the block changed; patch() re-patches
    recalibrated: bool = False  # a ModelOpt calibration ran since the last decision: decide anew
    expected_processor: Any = None  # the processor object installed on block.attn (or found there)
    calib_watch: tuple[str, ...] = ()  # modules whose ModelOpt quantizers may enter calibration
    lock: Any = field(default_factory=threading.RLock)

    # -- reading
    def site(self, stream: str, name: str) -> SitePlan:
        for s in self.sites:
            if s.stream == stream and s.site == name:
                return s
        raise KeyError((stream, name))

    def site_plan(self, key: str) -> SitePlan:
        stream, name = key.split(".")
        return self.site(stream, name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "patched": self.patched, "reasons": list(self.reasons), "install": self.install,
            "device": self.device, "sites": [s.to_dict() for s in self.sites],
            "qk_norm_rope_fused": self.qk_fused, "qk_norm_rope_reasons": list(self.qk_reasons),
            "tp_local_reasons": {k: list(v) for k, v in self.tp_reasons.items()},
            "cross_block_handoff": self.handoff_to is not None, "cross_block_reasons": list(self.handoff_reasons),
            "cross_block_receive_reasons": list(self.handoff_in_reasons),
            "linears": {k: v.to_dict() for k, v in self.linears.items()},
            "projections": {k: v.to_dict() for k, v in self.projections.items()},
            "norms": {k: v.to_dict() for k, v in self.norms.items()},
        }

    def count(self, reason: str) -> None:
        if not torch.compiler.is_compiling():
            self.counter[reason] += 1

    # -- copies: the lock is not copyable; everything else is (deepcopy remaps module references)
    def __getstate__(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["lock"] = None
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        d["lock"] = threading.RLock()
        self.__dict__.update(d)

    # -- call-time checks
    def changed(self, block: nn.Module) -> str | None:
        """Why the block is no longer what was decided about (None: it is). Only the modules the
        fused path bypasses or reimplements are checked (norms, deferred projections, FP8 linears):
        everything else is called as the block holds it at call time."""
        for parts, mod, cls in self.expected:
            now = block
            for part in parts:
                now = now.__dict__["_modules"].get(part) if now is not None else None
            if now is not mod or type(now) is not cls:
                return f"{'.'.join(parts)} was replaced or converted since patching"
        want = self.expected_processor
        if want is not None and getattr(block.attn, "processor", None) is not want:
            return "the attention processor was replaced since patching"
        return None

    def calibrating(self, block: nn.Module) -> bool:
        """A ModelOpt calibration is collecting statistics: the original forward must run (it calls
        every quantizer), and FP8 weights / scales decided earlier may go stale."""
        for path in self.calib_watch:
            m = resolve(block, path)
            if m is not None and quant.calibrating(m):
                return True
        return False


# ---------------------------------------------------------------------------- decisions


def _kernel_reasons(device: torch.device, options: Options) -> list[str]:
    r = list(ops.kernel_runtime_reasons(device))
    if options.force_reference or ops._eligibility.force_reference_requested():
        r.insert(0, "reference forced (force_reference=True or QWEN_ABSORB_FORCE_REFERENCE=1)")
    return r


def _structure_refusals(block: nn.Module, path: str, proc_cls: type) -> list[str]:
    """Deferral needs the projection to be the last thing that touches the output."""
    if path.startswith("attn."):
        proc = getattr(block.attn, "processor", None)
        proc = getattr(proc, "original", proc)  # our processor wraps diffusers'
        if type(proc) is not proc_cls:
            return [f"attention processor {type(proc).__name__} is not {proc_cls.__name__}"]
        to_out = block.attn.to_out
        if len(to_out) > 2 or (len(to_out) == 2 and not _identity_dropout(to_out[1])):
            return ["attn.to_out has modules after the projection"]
        return []
    net = resolve(block, path.rsplit(".", 1)[0])
    if net is None or len(net) != 3:
        return [f"{path.split('.')[0]}.net is not (GELU, Dropout, Linear)"]
    return []


def _identity_dropout(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout) and (m.p == 0.0 or not m.training)


def decide(plan: BlockPlan, block: nn.Module, device: torch.device, proc_cls: type) -> None:
    """(Re)make every decision of ``plan`` for ``block`` running on ``device``."""
    o = plan.options
    plan.runtime_device = device
    plan.device = str(device)
    plan.kernel_reasons = _kernel_reasons(device, o)
    plan.kernels = not plan.kernel_reasons
    plan.norms = {n: quant.inspect_norm(n, getattr(block, n)) for n in NORMS}
    plan.projections = {}
    for s in SITE_TABLE.values():
        if s.takes_bias_of:
            m = resolve(block, s.takes_bias_of)
            if m is not None:
                plan.projections[s.takes_bias_of] = quant.inspect_projection(s.takes_bias_of, m)
    plan.linears = {p: _decide_linear(block, p, device, o) for p in LINEAR_TABLE}
    plan.sites, plan.deferred = [], {}
    for s in SITE_TABLE.values():
        plan.sites.append(_decide_site(plan, block, s, device, proc_cls))
    _decide_fp8_inputs(plan, block)
    watched = (*NORMS, *plan.deferred.values(), *(p for p, lp in plan.linears.items() if lp.fp8_gemm))
    plan.expected = tuple((tuple(p.split(".")), m, type(m)) for p in dict.fromkeys(watched)
                          if (m := resolve(block, p)) is not None)
    plan.modelopt = any(_has_quantizers(m) for m in block.modules())
    plan.quant_attention = type(block.attn).__module__.startswith("modelopt.")
    plan.calib_watch = tuple(p for p in (*LINEAR_TABLE, *NORMS) if _has_quantizers(resolve(block, p)))
    plan.stale = None


def _has_quantizers(m: nn.Module | None) -> bool:
    return m is not None and (quant.is_modelopt_quantizer(getattr(m, "input_quantizer", None))
                              or quant.is_modelopt_quantizer(getattr(m, "weight_quantizer", None)))


def _decide_linear(block: nn.Module, path: str, device: torch.device, o: Options) -> LinearPlan:
    lp = LinearPlan(path)
    m = resolve(block, path)
    if o.fp8_gemm is False:
        lp.fp8_reasons = ["fp8_gemm=False"]
        return lp
    r = ["not found"] if m is None else quant.fp8_gemm_reasons(m)
    if r == ["not ModelOpt-quantized"]:
        lp.fp8_reasons = r
        return lp
    if device.type != "cuda":
        # capabilities={"cpu"} with fp8_gemm=True runs the path on the CPU (torch._scaled_mm has a
        # CPU implementation): for tests of the logic, not for speed.
        if not (o.fp8_gemm is True and device.type in o.fp8_capabilities):
            r.append(f"tensors are on {device.type}; real FP8 GEMMs need CUDA")
    else:
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap < quant.FP8_GEMM_MIN_CAPABILITY:
            r.append(f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs 8.9)")
        elif o.fp8_gemm == "auto" and cap not in o.fp8_capabilities:
            r.append(f"device capability sm_{cap[0]}{cap[1]} is not in the FP8-validated set "
                     f"{sorted(map(str, o.fp8_capabilities))}")
    if m is not None and _offload_hooked(m):
        r.append("an offloading hook manages its weights (group offloading / accelerate): the module runs them")
    w = m._parameters.get("weight") if m is not None else None
    if w is not None and parallel.is_dtensor(w):
        lp.tp, why = parallel.tp_shard_reasons(m, own_forward=False)
        r += [f"tensor parallelism: {x}" for x in why]
    elif w is not None and type(w.data) is not torch.Tensor and type(w).__name__ != "QTensorWrapper":
        r.append(f"weight is a {type(w.data).__name__}: the GEMM must stay the module's")
    if w is not None and w.device.type == "meta":
        r.append("weight on the meta device (offload hook)")
    if w is not None and getattr(w, "metadata", {}).get("dtype", w.dtype) not in (torch.bfloat16, torch.float16):
        r.append("activations are not bf16/fp16")
    r += _fp8_context_reasons(block, path)
    if r:
        lp.fp8_reasons, lp.tp = r, None
        return lp
    lp.fp8_gemm = True
    return lp


def _epilogue_bias(b: torch.Tensor | None, tp: Any) -> torch.Tensor | None:
    """The bias a real FP8 GEMM adds: the Parameter; under tensor parallelism what DTensor adds on
    each rank (column-wise: the local shard; row-wise: ``b / N`` before the sum all-reduce)."""
    if b is None or tp is None:
        return b
    local = b.to_local()
    return local if tp.style == "colwise" else local / tp.world


def _offload_hooked(m: nn.Module) -> bool:
    """An offload hook onloads this module's parameters only inside its own forward (which the FP8
    path does not call): diffusers group offloading or an accelerate hook, on it or a wrapper."""
    base = unwrap_peft(m)[0]
    for mod in (m, base):
        if getattr(mod, "_hf_hook", None) is not None:
            return True
        reg = getattr(mod, "_diffusers_hook", None)
        if reg is not None and any("offload" in str(name) for name in getattr(reg, "_hook_order", [])):
            return True
    return False


def _fp8_context_reasons(block: nn.Module, path: str) -> list[str]:
    """What around a linear the FP8 path reproduces: diffusers' processor without attention
    quantizers, and the FeedForward GELU(tanh) -> Dropout(0) -> Linear."""
    if path.startswith("attn."):
        proc = getattr(block.attn, "processor", None)
        proc = getattr(proc, "original", proc)
        from .patch import _classes  # noqa: PLC0415

        if type(proc) is not _classes()[2]:
            return [f"attention processor {type(proc).__name__} is not diffusers' QwenDoubleStreamAttnProcessor2_0"]
        for q in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer", "softmax_quantizer",
                  "bmm2_output_quantizer"):
            if quant.quantizer_enabled(getattr(block.attn, q, None)):
                return [f"ModelOpt attention quantizer {q} is enabled"]
        return []
    if path.endswith("_mod.1"):
        mod = resolve(block, path.split(".")[0])
        if mod is None or len(mod) != 2 or type(mod[0]) is not nn.SiLU:
            return [f"{path.split('.')[0]} is not (SiLU, Linear)"]
        return []
    net = resolve(block, path.split(".")[0] + ".net")
    if net is None or len(net) != 3 or not _identity_dropout(net[1]) or getattr(net[0], "approximate", None) != "tanh":
        return ["the FeedForward is not GELU(tanh) -> Dropout(0) -> Linear"]
    return []


def _decide_site(plan: BlockPlan, block: nn.Module, s: Site, device: torch.device, proc_cls: type) -> SitePlan:
    sp = SitePlan(block=plan.index, stream=s.stream, site=s.name)
    o = plan.options
    if s.norm is not None:
        info = plan.norms[s.norm]
        sp.reasons = list(info.unsupported)
        if info.input_quantizer_enabled:
            nq, why = quant.norm_input_fp8(getattr(block, s.norm).input_quantizer)
            if nq is not None and nq.amax.device.type != "meta":
                sp.norm_quantizer, sp.norm_quant = "fp8-fused", nq
            else:
                sp.norm_quantizer = "applied-before-op"
    sp.fused = not sp.reasons
    if s.takes_bias_of is not None:
        sp.projection = s.takes_bias_of
        info = plan.projections.get(s.takes_bias_of)
        if info is None:
            sp.defer_reasons = [f"{s.takes_bias_of} not found"]
        elif plan.linears[s.takes_bias_of].fp8_gemm:
            sp.defer_reasons = ["the projection runs as a real FP8 GEMM: its bias is fused in the GEMM epilogue"]
        else:
            sp.defer_reasons = _structure_refusals(block, s.takes_bias_of, proc_cls) + gating.defer_refusals(
                info, mode=o.defer_bias, consumer_fused=sp.fused, device=device, capabilities=o.capabilities,
                kernel_reasons=plan.kernel_reasons,
            )
        sp.bias_deferred = not sp.defer_reasons
        if sp.bias_deferred:
            plan.deferred[s.key] = s.takes_bias_of
    return sp


def _decide_fp8_inputs(plan: BlockPlan, block: nn.Module) -> None:
    """Which producer emits FP8 for which consumers; a linear whose producer cannot emit its codes
    exactly (unfused site, q/k/v with unequal input scales) runs as ModelOpt runs it instead."""
    for s in SITE_TABLE.values():
        if not s.feeds:
            continue
        sp = plan.site_plan(s.key)
        lps = [plan.linears[p] for p in s.feeds]
        if not all(lp.fp8_gemm for lp in lps):
            if any(lp.fp8_gemm for lp in lps):
                for lp in lps:
                    if lp.fp8_gemm:
                        _refuse(lp, f"{s.key} feeds {', '.join(s.feeds)}, not all of which run as FP8 GEMMs")
            continue
        amaxes = [resolve(block, p).input_quantizer._amax for p in s.feeds]
        why = None
        if not sp.fused:
            why = f"{s.key} is not fused, so it cannot emit FP8"
        elif sp.norm_quantizer == "applied-before-op":
            why = "norm2's input quantizer cannot be reproduced inside the op"
        elif any(not torch.equal(a.float(), amaxes[0].float()) for a in amaxes[1:]):
            why = f"{', '.join(s.feeds)} have different input amax: one FP8 emission cannot serve all"
        if why is not None:
            for lp in lps:
                _refuse(lp, why)
            continue
        sp.fp8_out = True
    for p, lp in plan.linears.items():
        if lp.fp8_gemm:
            m = resolve(block, p)
            lp.weight = quant.make_fp8_weight(m, plan.runtime_device)
            lp.input_scale = ops.dequant_scale(lp.weight.input_amax)
            lp.bias = _epilogue_bias(unwrap_peft(m)[0]._parameters.get("bias"), lp.tp)
    for s in SITE_TABLE.values():
        sp = plan.site_plan(s.key)
        if sp.fp8_out:
            sp.fp8_amax = plan.linears[s.feeds[0]].weight.input_amax
    plan.fp8_attention = any(plan.linears[p].fp8_gemm for p in LINEAR_TABLE if p.startswith("attn."))
    plan.qk_fused, plan.qk_eps, plan.qk_reasons = _decide_qk(plan, block)
    plan.own_attention = plan.fp8_attention or plan.qk_fused
    plan.tp_reasons = _decide_tp(block)


def _decide_tp(block: nn.Module) -> dict[str, list[str]]:
    """Where a tensor-parallel model's linears may run on their local shards (qwen_absorb.projection.
    tp_linear): the attention only as diffusers' own processor computes it (qwen_absorb.attention.run
    reproduces it), a FeedForward only as diffusers' (GELU: proj + gelu, Dropout, Linear)."""
    r = {"attn": _fp8_context_reasons(block, "attn.to_q")}
    to_out = block.attn.to_out
    if len(to_out) > 2 or (len(to_out) == 2 and not isinstance(to_out[1], nn.Dropout)):
        r["attn"].append("attn.to_out has modules after the projection")
    for mlp in ("img_mlp", "txt_mlp"):
        net = resolve(block, mlp + ".net")
        ok = (net is not None and len(net) == 3 and type(net[0]).__name__ == "GELU"
              and isinstance(getattr(net[0], "proj", None), nn.Module) and callable(getattr(net[0], "gelu", None))
              and isinstance(net[1], nn.Dropout))
        r[mlp] = [] if ok else [f"{mlp}.net is not diffusers' (GELU, Dropout, Linear)"]
    return r


QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
# The fused q/k RMSNorm + RoPE runs only where it is bit-exact: the kernel's fp32 variance order is
# probed against PyTorch's on the device (ops.qk_norm_rope.probe_variance_order); False turns the
# fusion off everywhere (a switch for measurements).
QK_FUSION = True
QK_OFF_REASON = "the fused q/k RMSNorm + RoPE is switched off (qwen_absorb.plan.QK_FUSION = False)"


def _decide_qk(plan: BlockPlan, block: nn.Module) -> tuple[bool, tuple[float, ...], list[str]]:
    """Whether the q/k RMSNorm + RoPE chains can run as one ``qk_norm_rope`` launch."""
    attn = block.attn
    if not QK_FUSION:
        return False, (), [QK_OFF_REASON]
    r = [] if plan.kernels else ["the fused kernels cannot run here"]
    r += _fp8_context_reasons(block, "attn.to_q")
    norms = [getattr(attn, n, None) for n in QK_NORMS]
    dtype = next((p.dtype for p in block.parameters()), None)
    for name, n in zip(QK_NORMS, norms):
        if type(n).__name__ != "RMSNorm" or not type(n).__module__.startswith("diffusers."):
            r.append(f"attn.{name} is {type(n).__name__}, not diffusers' RMSNorm")
        elif getattr(n, "weight", None) is None or getattr(n, "bias", None) is not None:
            r.append(f"attn.{name} is not an RMSNorm with weight and no bias")
        elif n.weight.dtype != dtype or type(n.weight.data) is not torch.Tensor:
            r.append(f"attn.{name}.weight is {n.weight.dtype} / {type(n.weight.data).__name__}")
    if attn.inner_dim // attn.heads != 128:
        r.append(f"head_dim {attn.inner_dim // attn.heads} != 128")
    if not r:
        vo = probe_variance_order(plan.runtime_device)
        if vo.order is None:
            r.append(f"PyTorch's fp32 reduction order here is not one the kernel implements: {vo.detail}")
        else:
            plan.qk_min_rows = vo.min_rows
    if r:
        return False, (), r
    return True, tuple(float(n.eps) for n in norms), []


def _refuse(lp: LinearPlan, why: str) -> None:
    lp.fp8_gemm, lp.tp = False, None
    lp.fp8_reasons = [why]


__all__ = ["PLAN_ATTR", "BlockPlan", "LinearPlan", "Options", "SitePlan", "STREAMS", "decide"]
