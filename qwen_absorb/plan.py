"""Plans: what a patched block does, decided from the site table, stored once (an instance attribute: a copy of the
model decides anew). Decisions with their reasons, derived state (FP8 weights, scales, amaxes) and runtime
(:class:`BlockRuntime`, whose watch of what the decisions depend on decides again on a change) are kept apart."""

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import dependencies as dep
from . import attention21, gating, hooks, host_codes, lora, nvfp4, ops, parallel, quant
from . import site_runners as R
from .ops.qk_norm_rope import probe_variance_order
from .quant import NormInfo, ProjectionInfo
from .sites import (ATTN_LINEARS, LINEAR_TABLE, NORMS, QWENIMAGE21, SITE_TABLE, Site, classes, containers,
                    family_of, resolve, swiglu21_refusals, unwrap_peft)
from .watch import Watch, content_fingerprint, tensor_key, tensor_version

derived_only_sources = dep.derived_only_sources  # (moved; qwen_absorb.cuda_graph.fingerprint reads it here)

PLAN_ATTR = "_qwen_absorb_plan"
QK_OFF_REASON = "the fused q/k RMSNorm + RoPE is switched off (Tuning(qk_fusion=False))"


@dataclass(frozen=True)
class Options:
    """The arguments of :func:`qwen_absorb.patch` that decisions depend on."""

    defer_bias: str | bool = "auto"
    fp8_gemm: str | bool = "auto"
    capabilities: frozenset = frozenset()
    fp8_capabilities: frozenset = frozenset()
    force_reference: bool = False
    kernels_under_compile: str | bool = "auto"
    offload_original_weights: bool = False
    use_fast_accum: str | bool = "auto"
    cross_block: bool = True
    tuning: gating.Tuning = gating.Tuning()


@dataclass
class SitePlan:
    """One fused site of one block: its decisions, and the derived state its op reads."""

    block: int
    stream: str
    site: str
    fused: bool = True
    reasons: list[str] = field(default_factory=list)  # why not fused
    runner: str = "eager"  # "kernel", "reference" (the op's torch reference) or "eager" (diffusers' ops)
    mode: int | None = None  # site_runners.KERNEL / REFERENCE (None: eager), what ``run`` is called with
    run: Any = None  # the site's op in qwen_absorb.site_runners, looked up once from Site.op
    run_with_residual: Any = None  # the op running it with the residual before it (Site.with_residual, else run)
    norm: str | None = None  # the block LayerNorm it replaces (Site.norm)
    projection: str | None = None  # the projection whose bias this site can take
    bias_deferred: bool = False
    defer_reasons: list[str] = field(default_factory=list)  # why the bias stays in the GEMM
    norm_quantizer: str | None = None  # "fp8-fused", "applied-before-op" or None
    fp8_out: bool = False  # emits the e4m3 codes its real-FP8 consumers read
    act_out: bool = False  # also hands its consumers the activation (their LoRA branches read it)
    # derived state
    norm_quant: Any = None  # ops.Fp8PerTensorQuant reproduced inside the op
    fp8_amax: torch.Tensor | None = None  # the consumers' input amax (fp32, one element)
    nvfp4_amax: torch.Tensor | None = None  # set: it emits its NVFP4 consumers' fake-quantized input, under this amax

    @property
    def key(self) -> str:
        return f"{self.stream}.{self.site}"

    @property
    def emit(self) -> str | None:  # what its consumers read: "fp8" codes, "nvfp4" (fake-quantized) or None (its output)
        return "fp8" if self.fp8_out else "nvfp4" if self.nvfp4_amax is not None else None


@dataclass
class LinearPlan:
    """How one linear runs (its module, or a real FP8 GEMM plus its LoRA branches); owns what is derived from it."""

    path: str
    fp8_gemm: bool = False
    fp8_reasons: list[str] = field(default_factory=list)
    lora: bool = False  # a PEFT LoRA layer whose branches are added after the FP8 GEMM
    lora_active: bool = False  # it has active branches now (False: its input activation need not be handed over)
    offloaded: bool = False  # its original weight was moved to host memory
    # derived state
    weight: quant.Fp8Weight | None = None
    input_scale: torch.Tensor | None = None  # input amax / 448
    bias: torch.Tensor | None = None  # what the GEMM epilogue adds (the Parameter, or its TP share)
    tp: Any = None  # parallel.TpShard of a tensor-parallel linear run on its local shard
    cache_key: tuple = ()  # what ``weight`` was built from (reused when unchanged)
    nvfp4: Any = None  # fed by its producer's NVFP4 emission: its nvfp4.Nvfp4Linear (owns the fake-quantized weight)

    @property
    def quant(self) -> str | None:  # its GEMM: "fp8" (real FP8), "nvfp4" (its producer's emission) or None (its module)
        return "fp8" if self.fp8_gemm else "nvfp4" if self.nvfp4 is not None else None


@dataclass
class BlockRuntime:
    """Per-call state of a patched block: never a decision."""

    counter: Counter = field(default_factory=Counter)  # the report's runtime_fallbacks (shared)
    rebuilds: Counter = field(default_factory=Counter)  # decisions made again, by what changed (shared)
    device: torch.device | None = None  # the device the decisions were made for
    watch: Watch = field(default_factory=Watch)
    stale: str | None = None  # set when deciding again failed: the block runs diffusers' forward
    handoff_to: nn.Module | None = None  # the next block, when cross-block fusion links them
    loop_owner: Any = None  # the transformer class whose forward loop calls the blocks
    handoffs: Counter = field(default_factory=Counter)  # hand-overs taken, by block index (shared)
    announced: set = field(default_factory=set)  # devices told that the kernels cannot run (shared)
    on_decide: Any = None  # called with the plan after every decision (the report's record)
    generation: int = 0  # bumped by every decide(): derived tensors a CUDA graph read may be gone
    attn_fwds: dict = field(default_factory=dict)  # the attention linears' gated real-FP8 forwards, by path
    linear_fwds: dict = field(default_factory=dict)  # Qwen-Image-2.1: its linears' real-FP8 forwards, by path
    lock: Any = field(default_factory=threading.RLock)  # the block's (dependencies.block_lock), shared by its plans
    host_codes: dict = field(default_factory=dict)  # FP8 codes kept on the host while the model is away (host_codes)
    codes_gone: bool = False  # moved off ``device`` with its decisions kept: the FP8 codes are made at the next call
    moving: bool = False  # inside the block's own move (host_originals.BlockMove)

    def __getstate__(self) -> dict[str, Any]:
        # a lock is not copyable; a copy's FP8 codes on the host would match none of its weights (another identity)
        return {**self.__dict__, "lock": None, "host_codes": {}}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d, lock=threading.RLock())


@dataclass
class BlockPlan:
    index: int
    options: Options = field(default_factory=Options)
    patched: bool = False
    reasons: list[str] = field(default_factory=list)  # why the block forward was not replaced
    install: str = ""  # where the patched forward went
    device: str = ""  # the device the decisions below were made for
    kernel_reasons: list[str] = field(default_factory=list)
    kernels: bool = False  # fused ops launch their kernels (else their references)
    fast_accum: bool = False  # the FP8 GEMMs use torch._scaled_mm's fast accumulation
    sites: list[SitePlan] = field(default_factory=list)
    linears: dict[str, LinearPlan] = field(default_factory=dict)
    projections: dict[str, ProjectionInfo] = field(default_factory=dict)  # the four output projections
    norms: dict[str, NormInfo] = field(default_factory=dict)
    own_attention: bool = False  # the attention runs qwen_absorb's path (qwen_absorb.attention.run)
    attn_forwards: bool = False  # a hooked attention runs as its module, its linears' gated forwards real FP8
    attn_cache: bool = False  # a TaylorSeer / PAB cache, the attention's only hook, runs around our attention
    attn_cache_kind: str = ""  # which ("TaylorSeer", "PyramidAttentionBroadcast"), for the report
    qk_fused: bool = False  # the four q/k RMSNorm + RoPE chains run as one qk_norm_rope launch
    qk_eps: tuple[float, ...] = ()
    qk_min_rows: int = 1  # rows (B * L * heads) from which PyTorch's variance order is the kernel's
    qk_reasons: list[str] = field(default_factory=list)
    # per group ("attn", "img_mlp", "txt_mlp"), why its TP linears may not run on their local shards ([]: they may)
    tp_reasons: dict[str, list[str]] = field(default_factory=lambda: {"attn": [], "img_mlp": [], "txt_mlp": []})
    handoff_reasons: list[str] = field(default_factory=list)  # why this block hands no norm1 over
    handoff_in_reasons: list[str] = field(default_factory=list)  # why this block cannot take one
    modelopt: bool = False  # the block holds ModelOpt-quantized modules (called outside compiled graphs)
    nvfp4: dict = field(default_factory=dict)  # module -> its NVFP4 runner (qwen_absorb.nvfp4): run_module calls it
    quant_attention: bool = False  # block.attn is ModelOpt's QuantAttention (a global function swap)
    calibrating: bool = False  # a ModelOpt quantizer of the block collects statistics now
    # (__dict__, pre-hooks, hooks allowed) of the modules the fused path skips or changes: another hook -> diffusers'
    bypassed: tuple[tuple[dict, int, int], ...] = ()
    weight_hook: tuple | None = None  # (path, module, category): a hook moves/casts weights inside (diffusers' forward)
    rt: BlockRuntime = field(default_factory=BlockRuntime)

    def site(self, stream: str, name: str) -> SitePlan:
        for s in self.sites:
            if s.stream == stream and s.site == name:
                return s
        raise KeyError((stream, name))

    def site_plan(self, key: str) -> SitePlan:
        return self.site(*key.split("."))

    @property
    def mode(self) -> int:  # how the fused ops and the quantizations between them launch: kernels, else references
        return R.KERNEL if self.kernels else R.REFERENCE

    def deferred(self, key: str) -> str | None:
        """The projection whose bias the site ``key`` adds (None: its GEMM adds it)."""
        return next((s.projection for s in self.sites if s.key == key and s.bias_deferred), None)

    def deferred_paths(self) -> list[str]:
        return [s.projection for s in self.sites if s.bias_deferred and s.projection]

    def count(self, reason: str) -> None:
        if not torch.compiler.is_compiling():
            self.rt.counter[reason] += 1

    def hooked(self) -> bool:
        """A user's forward hook on a module the fused path skips or changes, or a global one."""
        return any(hooks.user_hooked(d, a, b) for d, a, b in self.bypassed) or hooks.global_hook_count() > 0


def _kernel_reasons(device: torch.device, options: Options) -> list[str]:
    r = list(ops.kernel_runtime_reasons(device))
    if options.force_reference or ops._eligibility.force_reference_requested():
        r.insert(0, "reference forced (force_reference=True or QWEN_ABSORB_FORCE_REFERENCE=1)")
    return r


def _identity_dropout(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout) and (m.p == 0.0 or not m.training)


def _processor_reasons(block: nn.Module) -> list[str]:
    proc, want = getattr(block.attn, "processor", None), classes()[2]
    return [] if type(proc) is want else [f"attention processor {type(proc).__name__} is not {want.__name__} (diffusers')"]


def _structure_refusals(block: nn.Module, path: str) -> list[str]:
    """Deferral needs the projection to be the last thing that touches the output."""
    if path.startswith("attn."):
        r = _processor_reasons(block)
        to_out = block.attn.to_out
        if len(to_out) > 2 or (len(to_out) == 2 and not _identity_dropout(to_out[1])):
            r.append("attn.to_out has modules after the projection")
        return r
    net = resolve(block, path.rsplit(".", 1)[0])
    if net is None or len(net) != 3:
        return [f"{path.split('.')[0]}.net is not (GELU, Dropout, Linear)"]
    return []


def decide(plan: BlockPlan, block: nn.Module, device: torch.device) -> None:
    """Every decision of ``plan`` for ``block`` on ``device`` anew, derived state rebuilt (or reused), a new watch."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        # a tensor's device always carries its index: "cuda" alone would never equal it (decided again per call)
        device = torch.device("cuda", torch.cuda.current_device())
    o = plan.options
    plan.rt.generation += 1
    plan.rt.codes_gone = False
    plan.rt.device, plan.device = device, str(device)
    plan.kernel_reasons = _kernel_reasons(device, o)
    plan.kernels = not plan.kernel_reasons
    plan.weight_hook = dep.weight_moving_hook(block)
    if family_of(block) is QWENIMAGE21:
        return _decide21(plan, block, device)
    for p in ATTN_LINEARS:  # gated forwards just installed by the patch: the plan holds them
        m = resolve(block, p)
        f = m.__dict__.get("forward") if m is not None else None
        if hooks.ours(f) and getattr(f, "gated", False) is True:  # (qwen_absorb.fp8_forward sits above the plan)
            del m.__dict__["forward"]
            plan.rt.attn_fwds[p] = f
    old = {p: lp for p, lp in plan.linears.items() if lp.weight is not None}
    plan.fast_accum = gating.fast_accum(o.use_fast_accum, device)
    plan.norms = {n: quant.inspect_norm(n, getattr(block, n)) for n in NORMS}
    plan.projections = {s.takes_bias_of: quant.inspect_projection(s.takes_bias_of, m) for s in SITE_TABLE.values()
                        if s.takes_bias_of and (m := resolve(block, s.takes_bias_of)) is not None}
    plan.linears = {p: _decide_linear(block, p, device, o) for p in LINEAR_TABLE}
    plan.nvfp4 = (nvfp4.block_runners(block, [p for p, lp in plan.linears.items() if not lp.fp8_gemm], plan.kernels)
                  if plan.kernels or device.type != "cuda" else {})  # on CUDA, only the kernel rounds as ModelOpt
    plan.sites = [_decide_site(plan, block, s, device) for s in SITE_TABLE.values()]
    _decide_fp8_inputs(plan, block)
    nvfp4.decide_rows(plan, block, _fp8_context_reasons)
    _build_fp8(plan, block, old)
    plan.qk_fused, plan.qk_eps, plan.qk_reasons = _decide_qk(plan, block)
    plan.own_attention = any(plan.linears[p].fp8_gemm or (resolve(block, p) in plan.nvfp4 and not _fp8_context_reasons(
        block, p)) for p in ATTN_LINEARS) or plan.qk_fused
    plan.attn_cache_kind = (dep.attention_cache_kind(block) or "") if plan.own_attention else ""
    plan.attn_cache = bool(plan.attn_cache_kind)
    plan.attn_forwards = (not plan.own_attention and o.fp8_gemm is not False and not _attention_reasons(block)
                          and dep.hooked(block, "attn") is not None)
    for p in ATTN_LINEARS if plan.attn_forwards else ():
        if plan.linears[p].fp8_reasons:
            plan.linears[p].fp8_reasons[-1] += " (inside it, its gated forward runs a real FP8 GEMM where it can)"
    plan.tp_reasons = _decide_tp(block)
    plan.modelopt = any(quant.is_modelopt_quantizer(getattr(m, q, None)) for m in block.modules()
                        for q in ("input_quantizer", "weight_quantizer"))
    plan.quant_attention = quant.is_modelopt_object(block.attn)
    plan.calibrating = any(quant.calibrating(m) for p in (*LINEAR_TABLE, *NORMS) if (m := resolve(block, p)) is not None)
    plan.bypassed = dep.bypassed(plan, block)
    plan.rt.watch = dep.watch(block)
    plan.rt.stale = None
    if plan.rt.on_decide is not None:
        plan.rt.on_decide(plan)


def refresh(plan: BlockPlan, block: nn.Module) -> None:
    """The watch and FP8 source keys anew after the patch itself moved weights (``offload_original_weights``)."""
    for p, lp in plan.linears.items():
        if lp.fp8_gemm:  # moved, not changed: the content fingerprint carries over (no read of the moved weight)
            lp.cache_key = _fp8_cache_key(block, p, plan.rt.device, lp.cache_key[2][4] if lp.cache_key else None)
    plan.rt.watch = dep.watch(block)


def content_changed(plan: BlockPlan, block: nn.Module) -> bool:
    """Whether an FP8 weight's or an NVFP4 linear's ``fq(W)`` sources changed where no per-call check sees it
    (``.data`` writes: ``fuse_lora`` then ``unfuse_lora``; ``quantizer.amax = v``). A sync per linear (``patch()``)."""
    try:
        return any(lp.fp8_gemm and lp.weight is not None and (
            _fp8_cache_key(block, p, plan.rt.device) != lp.cache_key
            or quant.fp8_sources_moved(resolve(block, p), lp.weight, plan.rt.device)) for p, lp in plan.linears.items()
        ) or any(r.content_changed() for r in plan.nvfp4.values())
    except Exception:  # noqa: BLE001 - a source that cannot be read as decided for: decide again
        return True


def _decide_linear(block: nn.Module, path: str, device: torch.device, o: Options) -> LinearPlan:
    m = resolve(block, path)
    dev = gating.fp8_device_refusals(device, o.fp8_gemm, o.fp8_capabilities)  # fp8_gemm=False: that alone
    r = dev if o.fp8_gemm is False else ["not found"] + dev if m is None else quant.fp8_linear_refusals(m, dev)
    lp = LinearPlan(path, fp8_reasons=list(r))
    if o.fp8_gemm is False or r == ["not ModelOpt-quantized"]:
        return lp
    base, wrappers = unwrap_peft(m)
    if wrappers:
        r += [f"PEFT LoRA: {x}" for x in lora.unsupported_reasons(wrappers[0])]
        lp.lora = True  # its branches are added after the GEMM (none while merged or disabled)
        lp.lora_active = bool(lora.active_branches(wrappers[0]))
    if m is not None and any(hooks.offload_hooked(x) for x in (m, base)):
        r.append("an offloading hook manages its weights (group offloading / accelerate): the module runs them")
    w = base._parameters.get("weight") if base is not None else None
    if w is not None and parallel.is_dtensor(w):
        lp.tp, why = parallel.tp_shard_reasons(base, own_forward=False)
        r += [f"tensor parallelism: {x}" for x in why]
        if wrappers:
            r.append("tensor parallelism with a LoRA adapter")
    r += _fp8_context_reasons(block, path)
    r += dep.hook_refusal(block, "the linear runs as its module", path, *containers(path))
    if r:
        _refuse(lp, *r)
    else:
        lp.fp8_gemm = True
    return lp


def _fp8_context_reasons(block: nn.Module, path: str) -> list[str]:
    """What around a linear the FP8 path reproduces: diffusers' processor, FeedForward GELU(tanh) -> Dropout(0)."""
    if path.startswith("attn."):
        r = _processor_reasons(block) + dep.attention_hook_refusal(block)
        return r or _attention_reasons(block)
    if path.endswith("_mod.1"):
        mod = resolve(block, path.split(".")[0])
        ok = mod is not None and len(mod) == 2 and type(mod[0]) is nn.SiLU
        return [] if ok else [f"{path.split('.')[0]} is not (SiLU, Linear)"]
    net = resolve(block, path.split(".")[0] + ".net")
    if net is None or len(net) != 3 or not _identity_dropout(net[1]) or getattr(net[0], "approximate", None) != "tanh":
        return ["the FeedForward is not GELU(tanh) -> Dropout(0) -> Linear"]
    return []


def _attention_reasons(block: nn.Module) -> list[str]:
    """Why ``block.attn`` is not the attention the fused path reproduces (hooks aside)."""
    on = [q for q in quant.ATTENTION_QUANTIZERS if quant.quantizer_enabled(getattr(block.attn, q, None))]
    return _processor_reasons(block) or [f"ModelOpt attention quantizer {q} is enabled" for q in on[:1]]


def _decide_site(plan: BlockPlan, block: nn.Module, s: Site, device: torch.device) -> SitePlan:
    sp = SitePlan(block=plan.index, stream=s.stream, site=s.name)
    o = plan.options
    if s.norm is not None:
        info = plan.norms[s.norm]
        sp.reasons = list(info.unsupported) + dep.hook_refusal(block, "the norm runs as its module", s.norm)
        if info.input_quantizer_enabled:
            nq, _ = quant.norm_input_fp8(getattr(block, s.norm).input_quantizer, device)
            if nq is not None and nq.amax.device.type != "meta":
                sp.norm_quantizer, sp.norm_quant = "fp8-fused", nq
            else:
                sp.norm_quantizer = "applied-before-op"
    elif s.op == "swiglu":
        sp.reasons = swiglu21_refusals(block)
    sp.fused = not sp.reasons
    sp.mode = plan.mode if sp.fused else None
    sp.runner, sp.run = R.MODE_NAMES[sp.mode], getattr(R, s.op)
    sp.run_with_residual, sp.norm = getattr(R, s.with_residual or s.op), s.norm
    if s.takes_bias_of is not None:
        sp.projection = s.takes_bias_of
        info = plan.projections.get(s.takes_bias_of)
        if info is None:
            sp.defer_reasons = [f"{s.takes_bias_of} not found"]
        elif plan.linears[s.takes_bias_of].fp8_gemm or resolve(block, s.takes_bias_of) in plan.nvfp4:
            sp.defer_reasons = ["the projection runs as a real FP8 GEMM or an NVFP4 runner: its bias is fused in the GEMM"]
        else:
            base = unwrap_peft(resolve(block, s.takes_bias_of))[0]
            holder = "attn" if s.takes_bias_of.startswith("attn.") else s.takes_bias_of.split(".")[0]
            sp.defer_reasons = (
                dep.hook_refusal(block, "its output must include its bias", s.takes_bias_of, holder)
                + _structure_refusals(block, s.takes_bias_of)
                + gating.defer_refusals(info, mode=o.defer_bias, consumer_fused=sp.fused, device=device,
                                        capabilities=o.capabilities, kernel_reasons=plan.kernel_reasons)
                + gating.tp_bias_refusals(base, o.defer_bias))
        sp.bias_deferred = not sp.defer_reasons
    return sp


def _decide_fp8_inputs(plan: BlockPlan, block: nn.Module) -> None:
    """Which producer emits FP8 for which consumers; a linear whose producer cannot emit its codes runs as a module."""
    for s in SITE_TABLE.values():
        if not s.feeds:
            continue
        sp, lps = plan.site_plan(s.key), [plan.linears[p] for p in s.feeds]
        fp8 = all(lp.fp8_gemm for lp in lps)
        amaxes = [quant.input_amax(resolve(block, p)).float() for p in s.feeds] if fp8 else []
        if not fp8:
            why = f"{s.key} feeds {', '.join(s.feeds)}, not all of which run as FP8 GEMMs"
        elif not sp.fused:
            why = f"{s.key} is not fused, so it cannot emit FP8"
        elif sp.norm_quantizer == "applied-before-op":
            why = "norm2's input quantizer cannot be reproduced inside the op"
        elif any(not torch.equal(a, amaxes[0]) for a in amaxes[1:]):
            why = f"{', '.join(s.feeds)} have different input amax: one FP8 emission cannot serve all"
        else:
            sp.fp8_out, sp.act_out = True, any(lp.lora and lp.lora_active for lp in lps)
            continue
        for lp in lps:
            if lp.fp8_gemm:
                _refuse(lp, why)


def _fp8_cache_key(block: nn.Module, path: str, device: torch.device, content: tuple | None = None,
                   staged: torch.Tensor | None = None) -> tuple:
    """What an FP8 weight is made from, its content fingerprint included (PEFT merges write ``weight.data``).
    ``content``: the fingerprint carried over (a move); ``staged``: the weight's values on the device."""
    m = resolve(block, path)
    base, wrappers = unwrap_peft(m)
    w = base._parameters["weight"]
    ts = (quant.input_amax(base), getattr(base.weight_quantizer, "_amax", None),
          getattr(base.weight_quantizer, "_scale", None))
    merged = tuple(lora.state(x)[0] for x in wrappers if lora.is_lora_layer(x))
    if content is None:
        content = content_fingerprint(w if staged is None else staged)
    wk = (id(w), tensor_version(w), w.data_ptr(), w.dtype, content)
    return (str(device), merged, wk) + tuple(map(tensor_key, ts))


def rebuild_codes(plan: BlockPlan, block: nn.Module) -> None:
    """The FP8 weights again, back on the device the decisions were made for with nothing changed while away
    (``host_originals.BlockMove``): from the originals as they are now, their keys read anew (a ``.data`` write
    while away shows in no version; the key must say what the codes were made from)."""
    plan.rt.generation += 1
    _build_fp8(plan, block, {})
    plan.rt.codes_gone = False


def _build_fp8(plan: BlockPlan, block: nn.Module, old: dict[str, LinearPlan]) -> None:
    """The FP8 weights, scales and epilogue biases of the FP8-GEMM linears (reused where their key is unchanged)."""
    back = host_codes.take(plan, block, plan.rt.device)  # back from the host with unchanged sources: no rebuild
    for p, lp in plan.linears.items():
        if not lp.fp8_gemm:
            continue
        m = resolve(block, p)
        if p in back:
            codes, content = back[p]
            lp.weight = quant.make_fp8_weight(m, plan.rt.device, codes=codes)
            lp.cache_key = _fp8_cache_key(block, p, plan.rt.device, content)
        else:
            # a host-kept weight: one copy, read on the device
            staged = quant.staged_weight(m, plan.rt.device, plan.options.tuning.pinned_staging)
            key = _fp8_cache_key(block, p, plan.rt.device, staged=staged)
            prev = old.get(p)
            if prev is not None and prev.cache_key == key and prev.weight is not None:
                lp.weight, lp.offloaded = prev.weight, prev.offloaded
            else:
                lp.weight = quant.make_fp8_weight(m, plan.rt.device, staged)
            del staged
            lp.cache_key = key
        lp.input_scale = ops.dequant_scale(lp.weight.input_amax)
        # the bias the GEMM adds: the Parameter, or DTensor's per rank (local shard, or row-wise b / N)
        b, tp = unwrap_peft(m)[0]._parameters.get("bias"), lp.tp
        lp.bias = b if b is None or tp is None else b.to_local() if tp.style == "colwise" else b.to_local() / tp.world
    for s in SITE_TABLE.values():
        sp = plan.site_plan(s.key)
        if sp.fp8_out:
            sp.fp8_amax = plan.linears[s.feeds[0]].weight.input_amax


def _decide_tp(block: nn.Module) -> dict[str, list[str]]:
    """Where a TP model's linears may run on local shards: inside diffusers' own attention and FeedForward only."""
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


def _decide_qk(plan: BlockPlan, block: nn.Module) -> tuple[bool, tuple[float, ...], list[str]]:
    """Whether the q/k RMSNorm + RoPE chains can run as one ``qk_norm_rope`` launch."""
    attn = block.attn
    if not plan.options.tuning.qk_fusion:
        return False, (), [QK_OFF_REASON]
    r = [] if plan.kernels else ["the fused kernels cannot run here"]
    r += _fp8_context_reasons(block, "attn.to_q")
    r += dep.hook_refusal(block, "the q/k norms run as their modules", *(f"attn.{n}" for n in dep.QK_NORMS))
    norms = [getattr(attn, n, None) for n in dep.QK_NORMS]
    dtype = next((p.dtype for p in block.parameters()), None)
    for name, n in zip(dep.QK_NORMS, norms):
        if type(n).__name__ != "RMSNorm" or not type(n).__module__.startswith("diffusers."):
            r.append(f"attn.{name} is {type(n).__name__}, not diffusers' RMSNorm")
        elif getattr(n, "weight", None) is None or getattr(n, "bias", None) is not None:
            r.append(f"attn.{name} is not an RMSNorm with weight and no bias")
        elif n.weight.dtype != dtype or type(n.weight.data) is not torch.Tensor:
            r.append(f"attn.{name}.weight is {n.weight.dtype} / {type(n.weight.data).__name__}")
    if attn.inner_dim // attn.heads != 128:
        r.append(f"head_dim {attn.inner_dim // attn.heads} != 128")
    if not r:
        vo = probe_variance_order(plan.rt.device)
        if vo.order is None:
            r.append(f"PyTorch's fp32 reduction order here is not one the kernel implements: {vo.detail}")
        else:
            plan.qk_min_rows = vo.min_rows
    return (False, (), r) if r else (True, tuple(float(n.eps) for n in norms), [])


def _decide21(plan: BlockPlan, block: nn.Module, device: torch.device) -> None:
    """A Qwen-Image-2.1 block from its rows; its linears' plans are their forward slots' (:func:`linear21_decided`)."""
    attn = block._modules.get("attn")
    plan.reasons = [] if isinstance(attn, nn.Module) else ["block has no attn module: diffusers' forward"]
    plan.norms = {n: quant.inspect_norm(n, block._modules.get(n)) for n in QWENIMAGE21.norms}  # None: "not a LayerNorm"
    plan.sites = [] if plan.reasons else [_decide_site(plan, block, s, device) for s in QWENIMAGE21.sites.values()]
    why, qk = attention21.reasons(attn, plan.kernels, device) if attn is not None else (plan.reasons, None)
    plan.own_attention, plan.qk_fused = not why, not why and qk.kernel
    plan.qk_eps, plan.qk_min_rows, plan.qk_reasons = (qk.eps, qk.min_rows, [] if plan.qk_fused else list(
        why or qk.why_not)) if qk is not None else ((), 1, list(why))
    plan.tp_reasons, plan.handoff_reasons = {}, ["Qwen-Image-2.1: not implemented"]
    linear21_decided(plan)


def linear21_decided(plan: BlockPlan) -> None:
    """After a 2.1 block or linear decided: which sites emit FP8 for their consumers; the report hears the plan."""
    for s, sp in zip(QWENIMAGE21.sites.values(), plan.sites):
        lps = [plan.linears.get(p) for p in s.feeds]
        sp.fp8_out = bool(lps) and sp.fused and all(lp is not None and lp.fp8_gemm for lp in lps) and all(
            torch.equal(lp.weight.input_amax, lps[0].weight.input_amax) for lp in lps[1:])
    fp8 = any(lp.fp8_gemm for lp in plan.linears.values())
    plan.fast_accum = fp8 and gating.fast_accum(plan.options.use_fast_accum, plan.rt.device)
    if plan.rt.on_decide is not None:
        plan.rt.on_decide(plan)


def _refuse(lp: LinearPlan, *why: str) -> None:
    lp.fp8_gemm, lp.tp, lp.lora, lp.lora_active, lp.fp8_reasons = False, None, False, False, list(why)
