"""The patched ``QwenImageTransformerBlock.forward``: the block's math, through the fused ops.

The forward is one module-level function bound to the block by :class:`PatchedForward` (a small
picklable, deep-copyable callable); everything it decides by is the block's own
:class:`~qwen_absorb.plan.BlockPlan` (``block._qwen_absorb_plan``), and every module it calls is
looked up on the block at call time. Whatever the plan cannot vouch for in this call (grad
enabled, modules replaced or converted since patching, a ModelOpt calibration running) runs
diffusers' original forward, counted in the report.

Deferred biases of linears that still run as their modules (ModelOpt fake quant, NVFP4): the bias
``Parameter`` never moves (so ``state_dict``, ``.to()`` and offload hooks see it); only while the
block calls the attention / FFN does an instance-``__dict__`` entry ``bias = None`` shadow it for
attribute lookup (``F.linear``, ModelOpt's GEMMs and PEFT read ``self.bias``). The shadowing runs
under the plan's lock, so concurrent calls of one model from several threads are serialised there
instead of dropping or doubling biases. A bias still on the meta device before its GEMM (accelerate
leaf offload) is not shadowed for that call: its GEMM adds it, as unpatched.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import torch
from torch import nn

from . import attention, handoff
from .parallel import is_dtensor, local_view, tp_defer_refusals
from .ops import _validate
from .ops._modulation import expand_param
from .ops._validate import param_rows as _rows
from .ops.bias_gate_residual import bias_gate_residual_reference
from .ops.bias_gate_residual import launch as bgr_launch
from .ops.bias_residual_layer_norm_scale_shift import bias_residual_layer_norm_scale_shift_reference
from .ops.bias_residual_layer_norm_scale_shift import launch as brln_launch
from .ops.layer_norm_scale_shift import launch as lnss_launch
from .ops.layer_norm_scale_shift import layer_norm_scale_shift_reference
from .ops.quantize_fp8 import launch as qf8_launch
from .plan import PLAN_ATTR, BlockPlan
from .projection import fp8_linear, tp_linear, tp_shard_for, wait
from .quant import quantizer_enabled, unwrap_peft
from .sites import resolve

_SUPPORTED = _validate.SUPPORTED_DTYPES
# ModelOpt's QuantAttention swaps torch.nn.functional.scaled_dot_product_attention module-globally for
# the duration of its forward: two threads inside it at once break each other. Patched blocks call such
# an attention under this lock.
_GLOBAL_SWAP_LOCK = threading.RLock()


class PatchedForward:
    """What :func:`qwen_absorb.patch` installs in a block's forward slot (or hook chain).

    A plain object holding the block, so ``copy.deepcopy`` rebinds it to the copy and pickle
    restores it (a bound method of a closure would keep pointing at the original's layers).
    """

    __slots__ = ("block", "__weakref__")
    __qwen_absorb__ = True

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return patched_forward(self.block, *args, **kwargs)

    def __getstate__(self) -> nn.Module:
        return self.block

    def __setstate__(self, block: nn.Module) -> None:
        self.block = block

    def __repr__(self) -> str:
        return f"<qwen_absorb patched forward of {type(self.block).__name__}>"


@torch.compiler.disable
def _opaque(module: nn.Module, *args: Any) -> Any:
    """Run a module outside the compiled graph: ModelOpt's quantized modules (dynamic attributes,
    global function swaps) cannot be traced by Dynamo in torch 2.11, so under ``torch.compile``
    the patched block calls them eagerly (a graph break) instead of failing."""
    return module(*args)


def _call(plan: BlockPlan, compiling: bool, module: nn.Module, *args: Any) -> Any:
    if compiling and plan.modelopt:
        return _opaque(module, *args)
    return module(*args)


def _original(block, hs, ehs, mask, temb, rope, kwargs, index):
    return type(block).forward(block, hs, ehs, mask, temb, rope, kwargs, index)


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
        return _original(self, *args)
    if torch.is_grad_enabled():
        # The kernels have no backward: training runs diffusers' forward, exactly the unpatched block.
        plan.count("grad enabled: original diffusers forward")
        if not compiling:
            handoff.drop()
        return _original(self, *args)
    if not compiling:
        why = _call_check(plan, self, hidden_states)
        if why is not None:
            plan.count(why)
            handoff.drop()
            return _original(self, *args)
        if not plan.kernels:
            plan.count("fused ops ran their torch references: " + "; ".join(plan.kernel_reasons))
    if _validate.is_dtensor(hidden_states) or _validate.is_dtensor(encoder_hidden_states):
        plan.count("DTensor activations: original diffusers forward")
        if not compiling:
            handoff.drop()
        return _original(self, *args)
    if plan.modelopt and not compiling:
        # ModelOpt's modules keep per-call state on the module (quantize_weight() toggles a flag,
        # QuantAttention swaps global functions): concurrent calls of one block would see each
        # other's state. One thread at a time per block; different blocks still overlap.
        with plan.lock:
            return _fused_forward(self, plan, compiling, *args)
    return _fused_forward(self, plan, compiling, *args)


def _call_check(plan: BlockPlan, block: nn.Module, x: torch.Tensor) -> str | None:
    """Why this call cannot take the planned path (None: it can); re-decides on a new device."""
    if plan.stale is not None:
        return plan.stale
    why = plan.changed(block)
    if why is not None:
        plan.stale = f"block structure changed ({why}): original diffusers forward; call qwen_absorb.patch() again"
        return plan.stale
    if plan.calib_watch and plan.calibrating(block):
        plan.recalibrated = True
        return "ModelOpt calibration running: original diffusers forward"
    if x.device != plan.runtime_device or plan.recalibrated:
        from .patch import redecide  # noqa: PLC0415  (patch imports this module)

        redecide(plan, block, x.device)
        plan.recalibrated = False
    return None


# ---------------------------------------------------------------------------- helpers


def _params_reason(x: torch.Tensor, params: tuple[torch.Tensor, ...], index: torch.Tensor | None) -> str | None:
    """Why the fused ops would reject these arguments where diffusers accepts them (else None)."""
    if x.dtype not in _SUPPORTED:
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

    def __init__(self, plan: BlockPlan, block: nn.Module, paths: tuple[str | None, ...]) -> None:
        self.plan, self.bases, self.names = plan, [], []
        for p in paths:
            base = unwrap_peft(resolve(block, p))[0] if p is not None else None
            if base is not None:
                b = base._parameters.get("bias")
                if b is None or b.device.type == "meta" or "bias" in base.__dict__:
                    plan.count(f"{p}: bias not materialised before its GEMM (meta device under an offload "
                               "hook); added in the GEMM")
                    base = None
                elif type(b) is not torch.nn.Parameter and type(b.data) is not torch.Tensor:
                    why = tp_defer_refusals(base)  # a DTensor bias: tensor parallelism
                    if not why and plan.options.defer_bias == "auto":
                        # measured on 2 H200s (benchmarks/results/parallel.md): the FP8 model under TP
                        # ran slower with its row-wise biases deferred; only defer_bias=True defers them
                        why = ["tensor parallelism: defer_bias='auto' leaves row-wise biases in the GEMM"]
                    if why:
                        plan.count(f"{p}: {why[0]}; added in the GEMM")
                        base = None
            self.bases.append(base)
            self.names.append(p)

    def __bool__(self) -> bool:
        return any(b is not None for b in self.bases)

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
            # e.g. leaf-level group offloading moved it back after the GEMM, or layerwise casting
            # stores it in another dtype: the value is the one the GEMM would have used.
            self.plan.count(f"{self.names[i]}: deferred bias was {b.dtype} on {b.device} at use; converted")
            b = b.to(device=x.device, dtype=x.dtype)
        return b


def _deferred(plan: BlockPlan, block: nn.Module, keys: tuple[str, str]) -> _Deferred:
    return _Deferred(plan, block, tuple(plan.deferred.get(k) for k in keys))


# ---------------------------------------------------------------------------- the fused forward


def _fused_forward(self, plan, compiling, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                   temb, image_rotary_emb, joint_attention_kwargs, modulate_index):
    use_kernels = plan.kernels and not compiling
    use_fused = not compiling or plan.options.kernels_under_compile
    temb_in = temb
    given = None if compiling else handoff.take(plan, hidden_states, encoder_hidden_states, temb, modulate_index)
    if given is not None:
        img_mod_params, txt_mod_params = given.img_mod, given.txt_mod
    else:
        img_mod_params, txt_mod_params = _modulations(plan, self, temb, use_kernels, compiling)
    img_mod1, img_mod2 = img_mod_params.chunk(2, dim=-1)
    txt_mod1, txt_mod2 = txt_mod_params.chunk(2, dim=-1)
    i_shift1, i_scale1, i_gate1 = img_mod1.chunk(3, dim=-1)
    i_shift2, i_scale2, i_gate2 = img_mod2.chunk(3, dim=-1)
    t_shift1, t_scale1, t_gate1 = txt_mod1.chunk(3, dim=-1)
    t_shift2, t_scale2, t_gate2 = txt_mod2.chunk(3, dim=-1)
    index = modulate_index
    site = plan.site

    if given is not None:
        img_in, txt_in = given.img_in, given.txt_in
    else:
        img_in = _norm1(plan, self, site("img", "norm1"), self.img_norm1, hidden_states, i_shift1, i_scale1, index,
                        img_mod1, use_kernels, use_fused, compiling)
        txt_in = _norm1(plan, self, site("txt", "norm1"), self.txt_norm1, encoder_hidden_states, t_shift1, t_scale1,
                        None, txt_mod1, use_kernels, use_fused, compiling)

    swaps = plan.quant_attention and not plan.own_attention
    # the shadowing decision and the shadowed GEMMs under one lock: another thread in this block
    # must neither see a shadowed bias as missing nor run its GEMM while the bias is shadowed
    with plan.lock if plan.deferred else contextlib.nullcontext():
        deferred = _deferred(plan, self, ("img.attn_residual", "txt.attn_residual"))
        with _GLOBAL_SWAP_LOCK if swaps else contextlib.nullcontext(), deferred:
            if plan.own_attention or (not compiling and _tp_attention(plan, self.attn, joint_attention_kwargs)):
                img_attn, txt_attn = attention.run(self.attn, plan, img_in, txt_in, encoder_hidden_states_mask,
                                                   image_rotary_emb, use_kernels, compiling)
            else:
                img_attn, txt_attn = self.attn(
                    hidden_states=img_in, encoder_hidden_states=txt_in,
                    encoder_hidden_states_mask=encoder_hidden_states_mask, image_rotary_emb=image_rotary_emb,
                    **(joint_attention_kwargs or {}),
                )
    hidden_states, img_ffn_in = _residual_norm(
        plan, self, site("img", "attn_residual"), self.img_norm2, plan.norms["img_norm2"].eps, hidden_states, img_attn,
        deferred.bias(0, img_attn), i_gate1, i_shift2, i_scale2, index, img_mod2, use_kernels, use_fused,
        "img.attn_residual")
    encoder_hidden_states, txt_ffn_in = _residual_norm(
        plan, self, site("txt", "attn_residual"), self.txt_norm2, plan.norms["txt_norm2"].eps, encoder_hidden_states,
        txt_attn, deferred.bias(1, txt_attn), t_gate1, t_shift2, t_scale2, None, txt_mod2, use_kernels, use_fused,
        "txt.attn_residual")

    with plan.lock if plan.deferred else contextlib.nullcontext():
        deferred = _deferred(plan, self, ("img.ffn_residual", "txt.ffn_residual"))
        with deferred:
            works: list = []  # row-wise all-reduces in flight (tensor parallelism)
            img_ffn = _ffn(plan, self, "img_mlp", img_ffn_in, use_kernels, compiling, works)
            txt_ffn = _ffn(plan, self, "txt_mlp", txt_ffn_in, use_kernels, compiling, works)
            wait(works)
    nxt = handoff.target(plan, self, hidden_states) if use_fused and not compiling else None
    if nxt is not None:
        nb, np_, frame, code = nxt
        n_img_mod, n_txt_mod = _modulations(np_, nb, temb_in, use_kernels, compiling)
        ni_shift1, ni_scale1, _ = n_img_mod.chunk(2, dim=-1)[0].chunk(3, dim=-1)
        nt_shift1, nt_scale1, _ = n_txt_mod.chunk(2, dim=-1)[0].chunk(3, dim=-1)
        hidden_states, n_img_in = _residual_norm(
            plan, nb, np_.site("img", "norm1"), nb.img_norm1, np_.norms["img_norm1"].eps, hidden_states, img_ffn,
            deferred.bias(0, img_ffn), i_gate2, ni_shift1, ni_scale1, index, n_img_mod.chunk(2, dim=-1)[0],
            use_kernels, use_fused, "img.ffn_residual + next img.norm1")
        encoder_hidden_states, n_txt_in = _residual_norm(
            plan, nb, np_.site("txt", "norm1"), nb.txt_norm1, np_.norms["txt_norm1"].eps, encoder_hidden_states,
            txt_ffn, deferred.bias(1, txt_ffn), t_gate2, nt_shift1, nt_scale1, None, n_txt_mod.chunk(2, dim=-1)[0],
            use_kernels, use_fused, "txt.ffn_residual + next txt.norm1")
        handoff.give(handoff.Handoff(np_, frame, code, hidden_states, encoder_hidden_states, temb_in, modulate_index,
                                     n_img_mod, n_txt_mod, n_img_in, n_txt_in))
        return encoder_hidden_states, hidden_states  # bf16/fp32 only (fp16 blocks do not receive)
    hidden_states = _ffn_residual(plan, site("img", "ffn_residual"), hidden_states, img_ffn,
                                  deferred.bias(0, img_ffn), i_gate2, index, use_kernels, use_fused)
    encoder_hidden_states = _ffn_residual(plan, site("txt", "ffn_residual"), encoder_hidden_states, txt_ffn,
                                          deferred.bias(1, txt_ffn), t_gate2, None, use_kernels, use_fused)

    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _local(y):
    """A tensor subclass reaching a fused site (under tensor parallelism the row-wise projections
    return an AsyncCollectiveTensor still being all-reduced): its complete local value, else why not.
    A subclass's storage must never reach a raw kernel."""
    local, why = local_view(y)
    return (local, None) if why is None else (y, f"output is a {type(y).__name__}: {why}")


def _modulations(plan, block, temb, use_kernels, compiling):
    """(img_mod(temb), txt_mod(temb)) of a block, with diffusers' zero_cond_t split of temb."""
    img = _modulation(plan, block, "img_mod", temb, use_kernels, compiling)
    if block.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    return img, _modulation(plan, block, "txt_mod", temb, use_kernels, compiling)


def _modulation(plan, block, name, temb, use_kernels, compiling):
    """``img_mod`` / ``txt_mod`` (SiLU, Linear): a real FP8 GEMV from SiLU+quantize where planned."""
    lp = plan.linears[f"{name}.1"]
    if not lp.fp8_gemm:
        return _call(plan, compiling, block._modules[name], temb)
    x = temb.unsqueeze(0)  # [1, rows, D]: the quantize op's [B, S, D] layout
    if use_kernels:
        codes = qf8_launch(x, 0, None, lp.weight.input_amax, "silu")[1]
    else:
        codes = attention.fp8_codes(torch.nn.functional.silu(x), lp.weight.input_amax)
    return fp8_linear(codes, lp, plan)[0]


def _norm1(plan, block, sp, norm, h, shift, scale, index, mod1, use_kernels, use_fused, compiling):
    """norm1 + modulation. Returns the attention input: the modulated tensor, or its FP8 codes."""
    eps = plan.norms[f"{sp.stream}_norm1"].eps
    if sp.fused and use_fused:
        why = _params_reason(h, (shift, scale), index)
        if why is None:
            x, nq = h, None
            if sp.norm_quantizer is not None and quantizer_enabled(norm.input_quantizer):
                nq = sp.norm_quant  # reproduced inside the op ("fp8-fused")
                if nq is None or not use_kernels:
                    # what QuantLayerNorm feeds its LayerNorm, by ModelOpt itself
                    x, nq = _call(plan, compiling, norm.input_quantizer, h), None
            if use_kernels:
                amax, mode = (nq.amax_fp32(h.device), nq.mode_for(h.device)) if nq is not None else (None, 0)
                out, codes = lnss_launch(x.contiguous(), _rows(shift), _rows(scale), eps, _contig(index),
                                         out=not sp.fp8_out, fp8_amax=sp.fp8_amax, amax=amax, quant_mode=mode)
                return codes if sp.fp8_out else out
            out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
            return attention.fp8_codes(out, sp.fp8_amax) if sp.fp8_out else out
        plan.count(f"{sp.stream}.norm1: {why}")
    out = block._modulate(norm(h), mod1, index)[0]
    return attention.fp8_codes(out, sp.fp8_amax) if sp.fp8_out else out


def _contig(t):
    return t.contiguous() if t is not None else None


def _residual_norm(plan, block, sp, norm, eps, h, y, bias, gate, shift, scale, index, mod, use_kernels, use_fused,
                   where):
    """``h + gate * (y + bias)``, then ``norm`` + modulation of it: the attention residual + norm2 of
    a block, or the FFN residual + the next block's norm1 (cross-block). Returns (new residual,
    the consumer's input: the modulated norm output or its FP8 codes)."""
    if sp.fused and use_fused:
        why = _params_reason(h, (gate, shift, scale), index)
        if why is None and type(y) is not torch.Tensor:
            y, why = _local(y)
        if why is None and y.dtype != h.dtype:
            why = f"attention output is {y.dtype}, residual {h.dtype}"
        if why is None:
            q = norm.input_quantizer if sp.norm_quantizer is not None else None
            if q is not None and not quantizer_enabled(q):
                q = None
            nq = sp.norm_quant if q is not None else None
            if q is None or nq is not None:
                if use_kernels:
                    amax, mode = (nq.amax_fp32(h.device), nq.mode_for(h.device)) if nq is not None else (None, 0)
                    new_h, out, codes = brln_launch(
                        h.contiguous(), y.contiguous(), bias, _rows(gate), _rows(shift), _rows(scale), eps,
                        _contig(index), amax, mode, out=not sp.fp8_out, fp8_amax=sp.fp8_amax)
                    return new_h, (codes if sp.fp8_out else out)
                new_h, out = bias_residual_layer_norm_scale_shift_reference(
                    h, y, bias=bias, gate=gate, shift=shift, scale=scale, eps=eps, index=index, norm_input_quant=nq)
                return new_h, (attention.fp8_codes(out, sp.fp8_amax) if sp.fp8_out else out)
            # A quantizer the op cannot reproduce (e.g. NVFP4 dynamic): applied exactly between
            # the residual op and the norm op.
            new_h = _ffn_residual_op(h, y, bias, gate, index, use_kernels)
            x = q(new_h)
            if use_kernels:
                out = lnss_launch(x.contiguous(), _rows(shift), _rows(scale), eps, _contig(index))[0]
            else:
                out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
            return new_h, out
        plan.count(f"{where}: {why}")
    if bias is not None:
        y = y + bias
    new_h = h + expand_param(gate, index) * y
    out = block._modulate(norm(new_h), mod, index)[0]
    return new_h, (attention.fp8_codes(out, sp.fp8_amax) if sp.fp8_out else out)


def _ffn_residual_op(h, y, bias, gate, index, use_kernels):
    if use_kernels:
        return bgr_launch(h.contiguous(), y.contiguous(), bias, _rows(gate), _contig(index))
    return bias_gate_residual_reference(h, y, bias=bias, gate=gate, index=index)


def _ffn_residual(plan, sp, h, y, bias, gate, index, use_kernels, use_fused):
    if sp.fused and use_fused:
        why = _params_reason(h, (gate,), index)
        if why is None and type(y) is not torch.Tensor:
            y, why = _local(y)
        if why is None and y.dtype != h.dtype:
            why = f"FFN output is {y.dtype}, residual {h.dtype}"
        if why is None:
            return _ffn_residual_op(h, y, bias, gate, index, use_kernels)
        plan.count(f"{sp.stream}.ffn_residual: {why}")
    if bias is not None:
        y = y + bias
    return h + expand_param(gate, index) * y


def _tp_attention(plan, attn, joint_attention_kwargs) -> bool:
    """Run the attention through :func:`qwen_absorb.attention.run` in this call although the plan
    does not own it: under tensor parallelism (applied before or after patching), where its linears
    then run on their local shards. Only for diffusers' own processor, without extra kwargs."""
    if joint_attention_kwargs or not is_dtensor(attn.to_q._parameters.get("weight")):
        return False
    return not plan.tp_reasons["attn"]


def _tp_ffn(plan, mlp_name, mlp, x, works):
    """The FeedForward on its tensor-parallel shards (column-wise up projection, GELU, row-wise down
    projection whose all-reduce goes to ``works``), or None: not TP, or not exactly diffusers'
    (GELU, Dropout, Linear) without hooks on the FeedForward, GELU or Dropout module."""
    net = mlp.net
    up = net[0].proj
    if plan.tp_reasons[mlp_name] or not is_dtensor(up._parameters.get("weight")):
        return None
    if _hooked(mlp) or _hooked(net[0]) or _hooked(net[1]):
        plan.count(f"{mlp_name}: a forward hook on the FeedForward: it runs through DTensor")
        return None
    s_up = tp_shard_for(plan, f"{mlp_name}.net.0.proj", up, x)
    s_down = tp_shard_for(plan, f"{mlp_name}.net.2", net[2], x) if s_up is not None else None
    if s_down is None:
        return None
    h = tp_linear(up, s_up, x)[0]
    h = net[1](net[0].gelu(h))
    y, work = tp_linear(net[2], s_down, h)
    if work is not None:
        works.append(work)
    return y


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__)


def _ffn(plan, block, mlp_name, x, use_kernels, compiling, works):
    """The FeedForward (net[0]: proj + GELU, net[1]: dropout p=0, net[2]: linear), FP8 where planned,
    on its local shards under tensor parallelism."""
    mlp = block._modules[mlp_name]
    up, down = plan.linears[f"{mlp_name}.net.0.proj"], plan.linears[f"{mlp_name}.net.2"]
    if not up.fp8_gemm and not down.fp8_gemm:
        y = None if compiling else _tp_ffn(plan, mlp_name, mlp, x, works)
        return y if y is not None else _call(plan, compiling, mlp, x)
    net = mlp.net
    h = fp8_linear(x, up, plan) if up.fp8_gemm else _call(plan, compiling, net[0].proj, x)
    if not down.fp8_gemm:
        return _call(plan, compiling, net[2], net[1](net[0].gelu(h)))
    if use_kernels:
        codes = qf8_launch(h, 0, None, down.weight.input_amax, "gelu_tanh")[1]
    else:
        codes = attention.fp8_codes(net[0].gelu(h), down.weight.input_amax)
    return fp8_linear(codes, down, plan, works)
