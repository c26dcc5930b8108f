"""The patched ``QwenImageTransformerBlock.forward``: the block's math through the fused ops, run by its
:class:`~qwen_absorb.plan.BlockPlan` (its watch asked first). What the plan cannot vouch for in a call (grad,
calibration, a user hook on a skipped module, a PEFT layer that must unmerge) runs diffusers' forward, counted in the
report. A deferred bias ``Parameter`` never moves: only during the attention / FFN call, under the plan's lock, does an
instance-``__dict__`` ``bias = None`` shadow it (``F.linear``, ModelOpt and PEFT read ``self.bias``); not one on meta."""

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import attention, compile_boundary, ffn, handoff, hooks, host_originals, lora, quant
from . import step_caches, taylorseer
from . import site_runners as R
from .ops import _validate, lane
from .ops._target_rows import expand_param
from .parallel import is_dtensor, local_view
from .plan import PLAN_ATTR, BlockPlan, SitePlan, decide, rebuild_codes
from .projection import fp8_linear, nvfp4_linear, run_module, wait
from .sites import resolve, unwrap_peft

log = logging.getLogger("qwen_absorb")

# ModelOpt's QuantAttention swaps F.scaled_dot_product_attention globally during its forward: one thread at a time.
_GLOBAL_SWAP_LOCK = threading.RLock()
HOOK_FALLBACK = "a forward hook on a module the fused path skips or changes: original diffusers forward"
# leaf-level group offloading / layerwise casting bring weights in (or cast them) only around their module's own call
WEIGHT_HOOK_FALLBACK = "weights there exist on the device only inside their module's call: original diffusers forward"


class PatchedForward:
    """What :func:`qwen_absorb.patch` installs in a block's forward slot: a plain object holding the block, so
    ``copy.deepcopy`` rebinds it to the copy and pickle restores it (a closure would keep the original's layers)."""

    __slots__ = ("block", "__weakref__")
    __qwen_absorb__ = True

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        if type(self) is PatchedForward:
            compile_boundary.track(block)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return patched_forward(self.block, *args, **kwargs)

    def __getstate__(self) -> nn.Module:
        return self.block

    def __setstate__(self, block: nn.Module) -> None:
        self.block = block
        compile_boundary.track(block)

    def __repr__(self) -> str:
        return f"<qwen_absorb patched forward of {type(self.block).__name__}>"


def redecide(plan: BlockPlan, block: nn.Module, device: torch.device, why: str) -> None:
    """Decide again (a new device, or the model changed under the plan); derived state is rebuilt."""
    with plan.rt.lock:
        decide(plan, block, device)
        plan.handoff_in_reasons = handoff.receive_reasons(plan, block)
        if not plan.attn_forwards:
            for f in plan.rt.attn_fwds.values():  # the hooked-attention FP8 weights are not what runs now
                f._clear()
    plan.rt.rebuilds[why] += 1
    log.info("block %d decided anew for %s (%s)", plan.index, device, why)


def _unpatched(block, hs, *args):
    """diffusers' forward, after the text lane's work (a previous block's hand-off) is waited for."""
    lane.settle(hs.device, "txt")
    with host_originals.onloaded(block, hs.device), quant.swaps_undone_on_error(block._modules.get("attn")):
        return type(block).forward(block, hs, *args)  # (host_originals: original weights kept on the host)


def patched_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_mask: torch.Tensor | None = None,
    temb: torch.Tensor | None = None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
    modulate_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``QwenImageTransformerBlock.forward`` with the same signature and outputs."""
    args = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb,
            joint_attention_kwargs, modulate_index)
    plan: BlockPlan | None = self.__dict__.get(PLAN_ATTR)
    compiling = torch.compiler.is_compiling()
    if plan is None:  # unpatched while a foreign wrapper still held us
        return _unpatched(self, *args)
    why = None
    if torch.is_grad_enabled():  # the kernels have no backward: training runs exactly the unpatched block
        why = "grad enabled: original diffusers forward"
    elif not compiling and (why := _call_check(plan, self, hidden_states)) is None and not plan.kernels:
        plan.count("fused ops ran their torch references: " + "; ".join(plan.kernel_reasons))
        _announce(plan)
    if why is None and joint_attention_kwargs and plan.own_attention:
        # diffusers hands these to its processor (which raises on an attention_mask); the fused attention has none
        why = f"attention kwargs {sorted(joint_attention_kwargs)}: original diffusers forward"
    if why is None and (_validate.is_dtensor(hidden_states) or _validate.is_dtensor(encoder_hidden_states)):
        why = "DTensor activations: original diffusers forward"
    if why is not None:
        plan.count(why)
        if not compiling:
            handoff.drop()
        return _unpatched(self, *args)
    if compiling and plan.options.kernels_under_compile == "auto":
        out = compile_boundary.call(self, *args)  # the whole eager patched forward as one opaque op
        if out is not None:
            return out
    if plan.modelopt and not compiling:
        # ModelOpt's modules keep per-call state on the module (quantize_weight() toggles a flag, QuantAttention
        # swaps global functions): one thread at a time per block
        with plan.rt.lock:
            return _fused_forward(self, plan, compiling, *args)
    return _fused_forward(self, plan, compiling, *args)


compile_boundary.register_forward(patched_forward)


def _announce(plan: BlockPlan) -> None:
    """One warning per patch and device where the model runs without its kernels, at the first call there."""
    seen = plan.rt.announced
    if plan.device not in seen:
        seen.add(plan.device)
        log.warning("the fused CUDA kernels cannot run on %s (%s); the patched blocks run the torch references "
                    "(same numbers, no speed-up)", plan.device, "; ".join(plan.kernel_reasons))


def _weight_hook(plan: BlockPlan) -> str | None:
    wh = plan.weight_hook
    if wh is not None and hooks.weight_moving(wh[1]) is not None:
        return f"{wh[0]}: {wh[2]} inside the block: {WEIGHT_HOOK_FALLBACK}"
    return None


def _call_check(plan: BlockPlan, block: nn.Module, x: torch.Tensor) -> str | None:
    """Why this call cannot take the planned path (None: it can); decides anew first on a new device or a change."""
    rt = plan.rt
    if rt.stale is not None:
        return rt.stale
    if (why := _weight_hook(plan)) is not None:  # asked first: such hooks swap weights (a watch change) every call
        return why
    if x.device != rt.device:
        why = f"first call on {x.device}"
    elif not handoff.vouched(plan) and rt.watch.changed():
        why = "the model changed (modules, weights, quantizers or LoRA adapters)"
    elif rt.codes_gone:  # back where it decided, nothing changed (host_originals.BlockMove)
        try:
            with rt.lock:
                rebuild_codes(plan, block)
            rt.rebuilds[f"back on {x.device}: decisions kept, FP8 codes made again"] += 1
        except Exception as e:  # noqa: BLE001 - decided anew instead (which says so if it fails too)
            why = f"making the FP8 codes again failed ({type(e).__name__}: {e})"
    if why is not None:
        try:
            redecide(plan, block, x.device, why)
        except Exception as e:  # never a crash where diffusers would run: its forward, and say why
            rt.stale = f"deciding anew failed ({type(e).__name__}: {e}): original diffusers forward"
            log.warning("block %d: %s", plan.index, rt.stale)
            return rt.stale
        handoff.drop()
        if (why := _weight_hook(plan)) is not None:  # such a hook added since the last decision
            return why
    if plan.calibrating:
        return "ModelOpt calibration running: original diffusers forward"
    if plan.hooked():
        return HOOK_FALLBACK
    for p, lp in plan.linears.items():
        if lp.lora and (refusal := lora.call_refusal(resolve(block, p))) is not None:
            return f"{p}: {refusal}: original diffusers forward"
    return None


@dataclass(frozen=True, slots=True)
class _Call:
    """What every site of one block call shares: the plan's modes, and what only the call sees (compiling)."""

    plan: BlockPlan
    block: nn.Module
    mode: int  # the launches between sites: the plan's mode (torch.compile traces the references)
    traced: bool  # under torch.compile the fused sites trace their references (kernels_under_compile=True), else eager
    compiling: bool

    def site_mode(self, sp: SitePlan) -> int | None:
        """What ``sp.run`` is called with in this call (None: the site's eager expression)."""
        if not self.compiling:
            return sp.mode
        return R.REFERENCE if self.traced and sp.mode is not None else None

    def q4(self, sp: SitePlan) -> torch.Tensor | None:
        """The amax of the site's NVFP4 emission in this call (None: none; under compile its consumers are modules)."""
        return sp.nvfp4_amax if not self.compiling else None


@dataclass(frozen=True, slots=True)
class _Mod:
    """One modulation half of one stream: its chunks, the half (diffusers' ``_modulate``) and ``modulate_index``."""

    shift: torch.Tensor
    scale: torch.Tensor
    gate: torch.Tensor
    half: torch.Tensor
    index: torch.Tensor | None

    @classmethod
    def of(cls, half: torch.Tensor, index: torch.Tensor | None) -> "_Mod":
        return cls(*half.chunk(3, dim=-1), half, index)


def _params_reason(x: torch.Tensor, params: tuple[torch.Tensor, ...], index: torch.Tensor | None) -> str | None:
    """Why the fused ops would reject these arguments where diffusers accepts them (else None)."""
    if x.dtype not in _validate.SUPPORTED_DTYPES:
        return f"activation dtype {x.dtype} not supported by the fused ops"
    if type(x) is not torch.Tensor:
        return f"activations are a {type(x).__name__}, not a plain tensor"
    rows = x.shape[0] * (2 if index is not None else 1)
    for p in params:
        if p.dtype != x.dtype:
            return f"modulation parameters are {p.dtype}, activations {x.dtype}"
        if p.device != x.device:
            return "modulation parameters on another device than the activations"
        if p.shape[0] != rows:
            return f"modulation parameters have {p.shape[0]} rows, the ops need {rows} (broadcast batch)"
    if index is not None:
        if not isinstance(index, torch.Tensor) or tuple(index.shape) != tuple(x.shape[:2]) or index.device != x.device:
            return "modulate_index is not a [B, L] tensor matching the image stream"
    return None


class _Deferred:
    """The deferred biases of one GEMM call: shadowed while it runs (see the module docstring)."""

    __slots__ = ("bases", "names", "plan")

    def __init__(self, plan: BlockPlan, block: nn.Module, keys: tuple[str, str]) -> None:
        self.plan, self.bases, self.names = plan, [], []
        # unpatched (or patched anew) in another thread since this call began: the GEMMs add their biases
        current = block.__dict__.get(PLAN_ATTR) is plan
        for k in keys:
            p = plan.deferred(k) if current else None
            base = unwrap_peft(resolve(block, p))[0] if p is not None else None
            if base is not None:
                b = base._parameters.get("bias")
                if b is None or b.device.type == "meta" or "bias" in base.__dict__:
                    plan.count(f"{p}: bias not materialised before its GEMM (meta device under an offload "
                               "hook); added in the GEMM")
                    base = None
            self.bases.append(base)
            self.names.append(p)

    def __enter__(self) -> None:
        for b in self.bases:
            if b is not None:
                object.__setattr__(b, "bias", None)

    def __exit__(self, *exc: object) -> None:
        for b in self.bases:
            if b is not None:
                b.__dict__.pop("bias", None)

    def bias(self, i: int, x: torch.Tensor) -> torch.Tensor | None:
        base = self.bases[i]
        if base is None:
            return None
        b = base._parameters["bias"]
        if type(b.data) is not torch.Tensor:
            b = local_view(b)[0]  # a replicated DTensor bias under tensor parallelism
        if b.device != x.device or b.dtype != x.dtype:
            # (leaf-level offloading moved it back after the GEMM, layerwise casting): the value the GEMM used
            self.plan.count(f"{self.names[i]}: deferred bias was {b.dtype} on {b.device} at use; converted")
            b = b.to(device=x.device, dtype=x.dtype)
        return b


@contextlib.contextmanager
def _gated_forwards(plan: BlockPlan, block: nn.Module):
    """The plan's gated real-FP8 forwards in their linears' slots, open for this thread (their GEMMs run), for one
    hooked-attention call only (never between calls: ``mtq.compress`` would keep one as ``_forward_pre_dm`` and
    recurse). Nested, the gates are restored."""
    placed = []
    for p, f in plan.rt.attn_fwds.items():
        m = resolve(block, p)
        if m is f.linear and "forward" not in m.__dict__:  # a linear replaced or wrapped since runs as its module
            object.__setattr__(m, "forward", f)
            placed.append(f)
    prev = [f.gate for f in placed]
    try:
        for f in placed:
            f.gate = threading.get_ident()
        yield
    finally:
        for f, g in zip(placed, prev):
            f.gate = g
            if f.linear.__dict__.get("forward") is f:
                del f.linear.__dict__["forward"]


def _fused_forward(self, plan, compiling, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                   temb, image_rotary_emb, joint_attention_kwargs, index):
    c = _Call(plan, self, R.REFERENCE if compiling else plan.mode, plan.options.kernels_under_compile is True,
              compiling)
    given = None if compiling else handoff.take(plan, hidden_states, encoder_hidden_states, temb, index)
    tl = _text_lane(c, plan, self, hidden_states)
    if given is None or not tl:  # what the text lane made (the previous block's hand-off) is read here
        lane.settle(hidden_states.device, "txt")
    img_mod_params, txt_mod_params = ((given.img_mod, given.txt_mod) if given is not None else (
        _modulation(c, plan, self, "img_mod", temb), _txt_modulation(c, plan, self, temb)))
    i1, i2 = (_Mod.of(half, index) for half in img_mod_params.chunk(2, dim=-1))
    t1, t2 = (_Mod.of(half, None) for half in txt_mod_params.chunk(2, dim=-1))
    site = plan.site
    img_in, txt_in = ((given.img_in, given.txt_in) if given is not None else
                      (_norm1(c, site("img", "norm1"), self.img_norm1, hidden_states, i1),
                       _norm1(c, site("txt", "norm1"), self.txt_norm1, encoder_hidden_states, t1)))

    swaps = plan.quant_attention and not plan.own_attention
    # shadowing and the shadowed GEMMs under the block's one lock: no other thread sees a shadowed bias as missing
    with plan.rt.lock:
        deferred = _Deferred(plan, self, ("img.attn_residual", "txt.attn_residual"))
        with _GLOBAL_SWAP_LOCK if swaps else contextlib.nullcontext(), deferred:
            if plan.attn_cache and not compiling:  # diffusers' TaylorSeer / PAB hook, run around our attention
                run = step_caches.run if plan.attn_cache_kind == step_caches.PAB else taylorseer.run
                img_attn, txt_attn = run(self.attn, lambda: attention.run(
                    self.attn, plan, img_in, txt_in, encoder_hidden_states_mask, image_rotary_emb, c.mode, compiling))
            elif (plan.own_attention and not plan.attn_cache) or (
                    not compiling and _tp_attention(plan, self.attn, joint_attention_kwargs)):
                img_attn, txt_attn = attention.run(self.attn, plan, img_in, txt_in, encoder_hidden_states_mask,
                                                   image_rotary_emb, c.mode, compiling, tl)
            else:  # as its module; hooked (plan.attn_forwards): its linears' gated forwards run real FP8
                gate = plan.attn_forwards and not compiling
                with _gated_forwards(plan, self) if gate else contextlib.nullcontext():
                    img_attn, txt_attn = self.attn(
                        hidden_states=img_in[0], encoder_hidden_states=txt_in[0],
                        encoder_hidden_states_mask=encoder_hidden_states_mask, image_rotary_emb=image_rotary_emb,
                        **(joint_attention_kwargs or {}),
                    )
    # the text stream from here to the next block's q/k/v: on the text lane where tl (forked in attention.run)
    txt_reads = (encoder_hidden_states, txt_mod_params, temb)
    with _txt_stretch(tl, hidden_states, txt_reads):
        encoder_hidden_states, txt_ffn_in = _residual_norm(
            c, self, site("txt", "attn_residual"), self.txt_norm2, encoder_hidden_states, txt_attn,
            deferred.bias(1, txt_attn), t1.gate, t2, "txt.attn_residual")
    hidden_states, img_ffn_in = _residual_norm(
        c, self, site("img", "attn_residual"), self.img_norm2, hidden_states, img_attn, deferred.bias(0, img_attn),
        i1.gate, i2, "img.attn_residual")

    nxt = handoff.target(plan, self, hidden_states) if not compiling else None
    if nxt is not None:
        nb, np_, frame, code = nxt
        nc = _Call(np_, nb, np_.mode, c.traced, compiling)
        # the next block's image modulation GEMV beside this block's image FFN (on the branch lane where it runs)
        n_img_mod = (lane.aside(lambda: _modulation(nc, np_, nb, "img_mod", temb), temb)
                     if "branch" in plan.options.tuning.lanes else _modulation(nc, np_, nb, "img_mod", temb))
    with plan.rt.lock:
        deferred = _Deferred(plan, self, ("img.ffn_residual", "txt.ffn_residual"))
        with deferred:
            works: list = []  # row-wise all-reduces in flight (tensor parallelism)
            with _txt_stretch(tl, hidden_states, txt_reads):
                txt_ffn = ffn.run(plan, self, "txt_mlp", txt_ffn_in, works, compiling, c.mode)
            img_ffn = ffn.run(plan, self, "img_mlp", img_ffn_in, works, compiling, c.mode)
            wait(works)
    if nxt is not None:
        with _txt_stretch(tl, hidden_states, txt_reads):
            n_txt_mod = _txt_modulation(nc, np_, nb, temb)
            encoder_hidden_states, n_txt_in = _residual_norm(
                nc, nb, np_.site("txt", "norm1"), nb.txt_norm1, encoder_hidden_states, txt_ffn,
                deferred.bias(1, txt_ffn), t2.gate, _Mod.of(n_txt_mod.chunk(2, dim=-1)[0], None),
                "txt.ffn_residual + next txt.norm1", plan)
        lane.settle(hidden_states.device, "branch")
        hidden_states, n_img_in = _residual_norm(
            nc, nb, np_.site("img", "norm1"), nb.img_norm1, hidden_states, img_ffn, deferred.bias(0, img_ffn),
            i2.gate, _Mod.of(n_img_mod.chunk(2, dim=-1)[0], index), "img.ffn_residual + next img.norm1", plan)
        handoff.give(handoff.Handoff(np_, frame, code, hidden_states, encoder_hidden_states, temb, index,
                                     n_img_mod, n_txt_mod, n_img_in, n_txt_in, np_.rt.generation))
        return encoder_hidden_states, hidden_states  # bf16/fp32 only (fp16 blocks do not receive)
    with _txt_stretch(tl, hidden_states, txt_reads):
        encoder_hidden_states = _ffn_residual(c, site("txt", "ffn_residual"), encoder_hidden_states, txt_ffn,
                                              deferred.bias(1, txt_ffn), t2.gate, None)
    hidden_states = _ffn_residual(c, site("img", "ffn_residual"), hidden_states, img_ffn,
                                  deferred.bias(0, img_ffn), i2.gate, index)
    lane.settle(hidden_states.device, "txt")  # the block's text output is read after it
    return tuple(t.clip(-65504, 65504) if t.dtype == torch.float16 else t  # as diffusers
                 for t in (encoder_hidden_states, hidden_states))


def _residual_reason(h: torch.Tensor, y, params: tuple, index: torch.Tensor | None, what: str) -> tuple:
    """``(y, None)`` where the residual ops take ``h`` and ``y`` (a subclass as its local value), else ``(y, why)``."""
    why = _params_reason(h, params, index)
    if why is None and type(y) is not torch.Tensor:
        local, why = local_view(y)
        y, why = (local, None) if why is None else (y, f"output is a {type(y).__name__}: {why}")
    if why is None and y.dtype != h.dtype:
        why = f"{what} output is {y.dtype}, residual {h.dtype}"
    return y, why


def _txt_modulation(c: _Call, plan: BlockPlan, block: nn.Module, temb: torch.Tensor) -> torch.Tensor:
    """txt_mod(temb), with diffusers' zero_cond_t split of temb."""
    if block.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    return _modulation(c, plan, block, "txt_mod", temb)


def _text_lane(c: _Call, plan: BlockPlan, block: nn.Module, h: torch.Tensor) -> bool:
    """Whether this call runs its text stream on the text lane: lanes active, its own attention on kernels without a
    cache hook, no TP linear (the lane would reorder its all-reduces)."""
    if c.compiling or not (c.mode == R.KERNEL and plan.own_attention and not plan.attn_cache) \
            or "txt" not in plan.options.tuning.lanes or lane.lane_for(h.device, "txt") is None:
        return False
    return not any(is_dtensor(p) for p in block.txt_mlp.parameters())


def _txt_stretch(on: bool, h: torch.Tensor, reads: tuple) -> contextlib.AbstractContextManager:
    """A stretch of the text stream on its lane where ``on``, continuing the lane's work (no wait for the image's)."""
    return lane.region(h.device, "txt", fork=False, reads=reads, on=on)


def _modulation(c: _Call, plan: BlockPlan, block: nn.Module, name: str, temb: torch.Tensor) -> torch.Tensor:
    """``img_mod`` / ``txt_mod`` (SiLU, Linear): a real FP8 GEMV from SiLU+quantize where planned."""
    lp = plan.linears[f"{name}.1"]
    if lp.nvfp4 is not None and not c.compiling:  # SiLU + NVFP4 fake quantization in one launch
        mod = block._modules[name]
        return nvfp4_linear(R.quantize_nvfp4(c.mode, temb, lp.nvfp4.input_amax32(), "silu", mod[0]), lp)
    if not lp.fp8_gemm:
        return run_module(plan, c.compiling, block._modules[name], temb)
    # temb as [1, rows, D]: the quantize op's [B, S, D] layout
    codes, act = R.quantize_fp8(c.mode, temb.unsqueeze(0), lp.weight.input_amax, "silu", lp.lora)
    return fp8_linear(codes, lp, plan, None, act, block._modules[name][1])[0]


def _hand(c: _Call, sp: SitePlan, out: torch.Tensor | None, second: torch.Tensor | None) -> tuple:
    """A producer's hand-over: ``(codes or NVFP4 emission, activation for LoRA or None)``, else ``(out, None)``."""
    return (second, out if sp.act_out else None) if sp.fp8_out or c.q4(sp) is not None else (out, None)


def _emit(c: _Call, sp: SitePlan, out: torch.Tensor) -> tuple:
    """:func:`_hand` of an eager expression: FP8 codes by the reference (exact), NVFP4 by the call's mode."""
    if c.q4(sp) is not None:
        return _hand(c, sp, out, R.quantize_nvfp4(c.mode, out.contiguous(), sp.nvfp4_amax))
    return _hand(c, sp, out, R.quantize_fp8(R.REFERENCE, out, sp.fp8_amax)[0] if sp.fp8_out else None)


def _norm1(c: _Call, sp: SitePlan, norm: nn.Module, h: torch.Tensor, m: _Mod):
    """norm1 + modulation. Returns the attention input ``(input, activation or None)``."""
    plan, mode = c.plan, c.site_mode(sp)
    if mode is not None:
        why = _params_reason(h, (m.shift, m.scale), m.index)
        if why is None:
            x, nq = h, sp.norm_quant if sp.norm_quantizer is not None else None
            if sp.norm_quantizer is not None and (nq is None or mode != R.KERNEL):
                # what QuantLayerNorm feeds its LayerNorm, by ModelOpt itself
                x, nq = run_module(plan, c.compiling, norm.input_quantizer, h), None
            eps = plan.norms[f"{sp.stream}_norm1"].eps
            return _hand(c, sp, *sp.run(mode, x, m.shift, m.scale, eps, m.index, sp.fp8_amax, sp.act_out, nq,
                                        c.q4(sp)))
        plan.count(f"{sp.stream}.norm1: {why}")
    return _emit(c, sp, c.block._modulate(norm(h), m.half, m.index)[0])


def _residual_norm(c: _Call, block: nn.Module, sp: SitePlan, norm: nn.Module, h: torch.Tensor, y, bias, gate,
                   m: _Mod, where: str, counting: BlockPlan | None = None):
    """``h + gate * (y + bias)``, then ``norm`` + modulation ``m``: the attention residual + norm2, or the FFN
    residual + the next block's norm1 (``c``, ``block``: the next block's). Returns (new residual, consumer input)."""
    eps = c.plan.norms[sp.norm].eps
    counting, mode = counting or c.plan, c.site_mode(sp)
    if mode is not None:
        y, why = _residual_reason(h, y, (gate, m.shift, m.scale), m.index, "attention")
        if why is None:
            if sp.norm_quantizer != "applied-before-op":
                # the hand-off (sp: the next block's norm1) runs its row's op with the residual before it
                new_h, out, second = sp.run_with_residual(mode, h, y, bias, gate, m.shift, m.scale, eps, m.index,
                                                          sp.fp8_amax, sp.act_out, sp.norm_quant, c.q4(sp))
                return new_h, _hand(c, sp, out, second)
            # a quantizer the op cannot reproduce (NVFP4 dynamic): ModelOpt's, between the residual and norm ops
            new_h = R.bias_gate_residual(mode, h, y, bias, gate, m.index)
            x = run_module(c.plan, c.compiling, norm.input_quantizer, new_h)
            return new_h, _hand(c, sp, *R.layer_norm_scale_shift(mode, x, m.shift, m.scale, eps, m.index,
                                                                 nvfp4_amax=c.q4(sp)))
        counting.count(f"{where}: {why}")
    new_h = h + expand_param(gate, m.index) * (y + bias if bias is not None else y)
    return new_h, _emit(c, sp, block._modulate(norm(new_h), m.half, m.index)[0])


def _ffn_residual(c: _Call, sp: SitePlan, h, y, bias, gate, index):
    mode = c.site_mode(sp)
    if mode is not None:
        y, why = _residual_reason(h, y, (gate,), index, "FFN")
        if why is None:
            return sp.run(mode, h, y, bias, gate, index)
        c.plan.count(f"{sp.stream}.ffn_residual: {why}")
    return h + expand_param(gate, index) * (y + bias if bias is not None else y)


def _tp_attention(plan, attn, joint_attention_kwargs) -> bool:
    """Whether :func:`qwen_absorb.attention.run` runs a TP attention the plan does not own (on local shards)."""
    if joint_attention_kwargs or not is_dtensor(attn.to_q._parameters.get("weight")):
        return False
    return not plan.tp_reasons["attn"]
