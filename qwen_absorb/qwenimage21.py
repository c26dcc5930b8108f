"""The block runner of Qwen-Image-2.1: ``QwenImage21TransformerBlock.forward`` through the fused ops.

diffusers' block (one stream, modulation shared by all blocks and sliced per block)::

    scale1, gate1, scale2, gate2 = chunks of modulation   # rows chosen per token by target_token_mask
    x1 = img_norm1(h) * (1 + scale1)                       # "norm1":  ops.layer_norm_scale
    a  = attn(x1, ...)                                     # attention21.run, or the module itself
    h  = h + tanh(gate1) * a                               # "attn_residual" + "norm2":
    x2 = img_norm2(h) * (1 + scale2)                       #   ops.tanh_gate_residual_layer_norm_scale
    y  = img_mlp.out(silu(img_mlp.gate_layer(x2)) * img_mlp.proj(x2))  # "swiglu": ops.swiglu
    h  = h + tanh(gate2) * y;  fp16: h.clip(-65504, 65504)  # "ffn_residual": ops.tanh_gate_residual

Only ``img_norm1``, ``img_norm2`` (a ModelOpt ``QuantLayerNorm`` too) and ``img_mlp``'s forward are bypassed, where
unhooked; a site whose consumers are real-FP8 GEMMs under one input amax also writes the codes they read. What the
plan cannot vouch for per call runs diffusers' forward or the eager expression, counted in ``runtime_fallbacks``."""

import logging
from typing import Any

import torch
from torch import nn

from . import attention21, fp8_forward, hooks, quant
from . import site_runners as R
from .block import PatchedForward
from .ops import _validate
from .ops._target_rows import select_rows
from .plan import BlockPlan, LinearPlan, decide, linear21_decided
from .sites import resolve

log = logging.getLogger("qwen_absorb")

_SUPPORTED = _validate.SUPPORTED_DTYPES
_hooked = hooks.hooked  # torch / diffusers / accelerate hooks, or a forward replaced on the instance


class Patched21Forward(PatchedForward):
    """The forward slot of a patched ``QwenImage21TransformerBlock``; :meth:`linear_decided`: its linears' on_state."""

    __slots__ = ("plan",)

    def __init__(self, block: nn.Module, plan: BlockPlan) -> None:
        super().__init__(block)
        self.plan = plan

    index = property(lambda self: self.plan.index)

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plan = self.plan
        if not torch.compiler.is_compiling():
            for f in plan.rt.linear_fwds.values():  # mtq.compress since: each forward back in its own slot
                if "_forward_pre_dm" in f.linear.__dict__:
                    f.reclaim()
            if isinstance(hidden_states, torch.Tensor) and hidden_states.device != plan.rt.device:
                decide(plan, self.block, hidden_states.device)
                log.info("Qwen-Image-2.1 block %d decided anew for %s", plan.index, hidden_states.device)
        return patched_forward(self.block, plan, hidden_states, *args, **kwargs)

    def linear_decided(self, index: int, path: str, fp8: bool, reasons: list) -> None:
        f = fp8_forward.of(resolve(self.block, path), converted=True)  # None: refused at install, or wrapped since
        self.plan.linears[path] = f.lp if f is not None else LinearPlan(path, fp8_reasons=list(reasons))
        linear21_decided(self.plan)

    def __getstate__(self) -> tuple:
        return (self.block, self.plan)

    def __setstate__(self, state: tuple) -> None:
        self.block, self.plan = state


def patched_forward(
    block: nn.Module, plan: BlockPlan, hidden_states: torch.Tensor, modulation: torch.Tensor,
    rotary_emb: torch.Tensor | None = None, attention_mask: Any | None = None,
    target_token_mask: torch.Tensor | None = None, layer_cache: Any | None = None, kv_cache_mode: str | None = None,
    cache_write_slice: slice | None = None, segments: list[tuple[int, int, bool]] | None = None,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``QwenImage21TransformerBlock.forward``, same signature (after ``block, plan``), same output bit for bit."""
    args = (hidden_states, modulation, rotary_emb, attention_mask, target_token_mask, layer_cache, kv_cache_mode,
            cache_write_slice, segments, key_valid)
    if (why := _call_reason(plan, hidden_states, modulation, target_token_mask)) is not None:
        plan.count(why)  # (BlockPlan.count counts nothing while torch.compile traces)
        return type(block).forward(block, *args)
    mode = R.COMPILED if torch.compiler.is_compiling() else plan.mode  # the sites' planned mode (by their rows)
    if mode == R.KERNEL and hidden_states.device != plan.rt.device:
        mode = R.REFERENCE
        plan.count(f"activations on {hidden_states.device}, kernels decided for {plan.rt.device}: torch references")
    x, mask = hidden_states, target_token_mask
    if mode == R.KERNEL:
        x, mask = x.contiguous(), (mask.contiguous() if mask is not None else None)
    scale1, gate1, scale2, gate2 = modulation.chunk(4, dim=-1)  # rows checked to be [.., 4 * D]
    site_norm1, site_res1, site_norm2, site_swiglu, site_res2 = plan.sites
    eps1, eps2 = plan.norms["img_norm1"].eps, plan.norms["img_norm2"].eps
    fp8, dev, attn = mode != R.COMPILED, x.device, block.attn  # under torch.compile the linears are ModelOpt's

    # norm1 + (1 + scale1), with the e4m3 codes of its output for to_q/to_k/to_v where the block calls them itself
    norm1 = site_norm1.fused and _norm_ok(block, "img_norm1", eps1, plan)
    own_attn = plan.own_attention and mode != R.COMPILED and attention21.call_ok(attn, plan.qk_eps)
    if plan.own_attention and not own_attn:
        plan.count("attn, its processor or its q/k norms changed or hooked since patching: the attention runs as "
                   "its module")
    qkv = fp8_forward.group(attn, ("to_q", "to_k", "to_v"), dev) if fp8 and norm1 and own_attn else None
    codes1 = None
    if norm1:
        nq1 = _fused_quant(block.img_norm1, mode, dev)
        img_modulated, codes1 = site_norm1.run(mode, x if nq1 is not None else _norm_input(block.img_norm1, x, mode),
                                               scale1, eps1, mask, _amax(qkv), nq=nq1)
    else:
        img_modulated = block.img_norm1(hidden_states) * (1 + select_rows(scale1, target_token_mask))
    if own_attn:
        attn_output = attention21.run(attn, plan, mode == R.KERNEL, img_modulated, attention_mask, rotary_emb,
                                      layer_cache, kv_cache_mode, cache_write_slice, segments, key_valid,
                                      qkv if codes1 is not None else None, codes1)
    else:
        attn_output = attn(hidden_states=img_modulated, attention_mask=attention_mask, rotary_emb=rotary_emb,
                           layer_cache=layer_cache, kv_cache_mode=kv_cache_mode, cache_write_slice=cache_write_slice,
                           segments=segments, key_valid=key_valid)

    # h + tanh(gate1) * attn_output, then norm2 + (1 + scale2) (with the codes for gate_layer / proj)
    amode = mode if _like(attn_output, hidden_states) else R.REFERENCE
    if amode != mode:
        plan.count("attention output is not a plain tensor shaped like hidden_states: eager expression")
    mlp = block.img_mlp
    swiglu = site_swiglu.fused and _swiglu_ok(mlp, plan)
    norm2 = site_norm2.fused and _norm_ok(block, "img_norm2", eps2, plan)
    # unhooked real-FP8 linears run as their GEMMs from the codes: the bf16 activation is never written
    ab = fp8_forward.group(mlp, ("gate_layer", "proj"), dev) if fp8 and norm2 and swiglu else None
    codes2 = None
    if norm2:
        nq2 = _fused_quant(block.img_norm2, amode, dev)
        if nq2 is None and "input_quantizer" in block.img_norm2._modules:  # LayerNorm(Q(h)), Q between two ops
            h = site_res1.run(amode, x, attn_output, gate1, mask, False)
            img_modulated2, codes2 = R.layer_norm_scale(amode, _norm_input(block.img_norm2, h, amode), scale2,
                                                       eps2, mask, _amax(ab), ab is None)
        else:
            h, img_modulated2, codes2 = site_norm2.run(amode, x, attn_output, gate1, scale2, eps2, mask,
                                                       _amax(ab), ab is None, nq=nq2)
    else:
        h = site_res1.run(amode, x, attn_output, gate1, mask, False)
        img_modulated2 = block.img_norm2(h) * (1 + select_rows(scale2, target_token_mask))

    # FFN: SwiGLU through the FFN's own linears (or their FP8 GEMMs), then h + tanh(gate2) * y (and the fp16 clip)
    if ab is not None:
        a, b = ab[0].gemm(codes2), ab[1].gemm(codes2)
    elif swiglu:
        a, b = mlp.gate_layer(img_modulated2), mlp.proj(img_modulated2)
    else:
        y = mlp(img_modulated2)
    if swiglu:
        pair_ok = type(a) is torch.Tensor and _like(b, a) and a.dim() >= 1 and a.dtype in _SUPPORTED
        smode = mode if pair_ok else R.REFERENCE
        o = fp8_forward.group(mlp, ("out",), dev) if fp8 else None
        s, codes3 = site_swiglu.run(smode, a, b, _amax(o), o is None)
        y = o[0].gemm(codes3) if o is not None else mlp.out(s)
    fmode = mode if _like(y, h) else R.REFERENCE
    if fmode != mode:
        plan.count("FFN output is not a plain tensor shaped like hidden_states: eager expression")
    out = site_res2.run(fmode, h, y, gate2, mask, True)
    if mode == R.REFERENCE and not plan.kernels:
        plan.count("fused ops ran their torch references")
    return out


def _call_reason(plan: BlockPlan, x: Any, modulation: Any, mask: Any) -> str | None:
    """Why this call must run diffusers' forward (None: the fused path takes it exactly)."""
    if plan.reasons:
        return "block not fused: diffusers' forward"
    if torch.is_grad_enabled():
        return "grad enabled: original diffusers forward (the kernels have no backward)"
    if hooks.global_hook_count():
        return "a global module forward hook is registered: original diffusers forward"
    if type(x) is not torch.Tensor or type(modulation) is not torch.Tensor:
        return "activations or modulation are not plain tensors (DTensor?): original diffusers forward"
    if torch.is_autocast_enabled(x.device.type):
        return "autocast enabled (it changes the eager dtypes): original diffusers forward"
    if x.dim() != 3 or x.dtype not in _SUPPORTED or x.shape[0] < 1 or x.shape[2] < 1:
        return f"hidden_states {tuple(x.shape)} {x.dtype} not supported by the fused ops: original diffusers forward"
    B, L, D = x.shape
    if modulation.dtype != x.dtype or modulation.device != x.device:
        return (f"modulation is {modulation.dtype} on {modulation.device}, hidden_states {x.dtype} on {x.device}: "
                "original diffusers forward")
    rows = B + 1 if mask is not None else B
    if modulation.dim() != 2 or tuple(modulation.shape) != (rows, 4 * D) or (D > 1 and modulation.stride(-1) != 1):
        return (f"modulation {tuple(modulation.shape)} is not [{rows}, {4 * D}] with unit last stride "
                "(diffusers would broadcast it): original diffusers forward")
    if mask is not None and (type(mask) is not torch.Tensor or mask.dtype != torch.bool or tuple(mask.shape) != (L,)
                             or mask.device != x.device):
        return "target_token_mask is not a bool [L] tensor on the activations' device: original diffusers forward"
    return None


def _norm_ok(block: nn.Module, name: str, eps: float, plan: BlockPlan) -> bool:
    m = block._modules.get(name)
    ok = ((type(m) is nn.LayerNorm or (isinstance(m, nn.LayerNorm) and quant.quant_input_norm_ok(m)))
          and m.weight is None and m.bias is None and m.eps == eps and not _hooked(m))
    if not ok:
        plan.count(f"{name} changed or hooked since patching: its eager expression")
    return ok


def _swiglu_ok(mlp: nn.Module, plan: BlockPlan) -> bool:
    act = mlp._modules.get("activation_fn")
    ok = not _hooked(mlp) and type(act) is nn.SiLU and not _hooked(act)
    if not ok:
        plan.count("img_mlp changed or hooked since patching: img_mlp(x)")
    return ok


def _amax(fwds) -> torch.Tensor | None:
    """The input amax of a site's real-FP8 consumers (they share it), or None: the site emits no codes."""
    return fwds[0].weight.input_amax if fwds is not None else None


def _like(t: Any, ref: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.shape == ref.shape and t.dtype == ref.dtype and t.device == ref.device


def _norm_input(norm: nn.Module, x: torch.Tensor, mode: int) -> torch.Tensor:
    """What the norm's LayerNorm sees: ``x``, or a QuantLayerNorm's ``input_quantizer(x)`` (the module itself)."""
    q = norm._modules.get("input_quantizer")
    qx = x if q is None else q(x)
    return qx.contiguous() if q is not None and mode == R.KERNEL else qx


def _fused_quant(norm: nn.Module, mode: int, device: torch.device):
    """A QuantLayerNorm's input quantizer as the kernels' ``Fp8PerTensorQuant`` (applied inside the fused op), or
    None: none, not on kernels, or one the kernels do not reproduce (:func:`_norm_input` calls it). Read per call."""
    q = norm._modules.get("input_quantizer")
    if q is None or mode != R.KERNEL or _hooked(q):  # a hook on the quantizer runs with the module
        return None
    return quant.norm_input_fp8(q, device)[0]
