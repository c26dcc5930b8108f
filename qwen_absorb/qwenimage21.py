"""The block runner of Qwen-Image-2.1: ``QwenImage21TransformerBlock.forward`` through the fused ops.

diffusers' block (one stream, modulation shared by all blocks and sliced per block)::

    scale1, gate1, scale2, gate2 = chunks of modulation   # rows chosen per token by target_token_mask
    x1 = img_norm1(h) * (1 + scale1)                       # "norm1":  ops.layer_norm_scale
    a  = attn(x1, ...)                                     # the module itself, unchanged
    h  = h + tanh(gate1) * a                               # "attn_residual" + "norm2":
    x2 = img_norm2(h) * (1 + scale2)                       #   ops.tanh_gate_residual_layer_norm_scale
    y  = img_mlp.out(silu(img_mlp.gate_layer(x2)) * img_mlp.proj(x2))  # "swiglu": ops.swiglu
    h  = h + tanh(gate2) * y;  fp16: h.clip(-65504, 65504)  # "ffn_residual": ops.tanh_gate_residual

The attention is called as ``block.attn(...)`` with diffusers' own keyword arguments, so its
processors (segment or flex), the prefix KV cache (``extract`` / ``cached`` / none) and anything
hooked on the attention keep working; so are the FFN's three linears (LoRA, ModelOpt, TP shards
are theirs). What the fused ops bypass is only ``img_norm1``, ``img_norm2`` and ``img_mlp``'s own
forward: a site is fused only where those are plain and unhooked. A ModelOpt ``QuantLayerNorm``
(``LayerNorm(input_quantizer(x))``) counts as plain: on kernels, an FP8 per-tensor static input
quantizer runs inside the fused op (``Fp8PerTensorQuant``, ModelOpt's formula bit for bit, read per
call); any other quantizer (disabled, calibrating, references) is called as the module and the rest
fused, norm2 then as the residual op followed by norm1's op, the quantizer between them.

Real FP8 (ModelOpt FP8 linears, :mod:`qwen_absorb.fp8_forward`, installed by the patch floor in each
linear's forward slot): where a site's real-FP8 consumers share one input amax, its fused op also writes
the e4m3 codes of its output in the same launch (norm1 -> to_q/to_k/to_v, norm2 -> gate_layer/proj,
SwiGLU -> out) and hands them over for exactly that tensor. Where the FFN's linears are unhooked the
runner calls their GEMMs itself from the codes, so the bf16 activation is never written (norm2's and
SwiGLU's outputs: memory traffic saved); otherwise the linears are called as modules (hooks run) and
take the handed codes. Under ``torch.compile`` nothing is emitted and the linears run as ModelOpt's.

Wiring (the patch floor does it): ``decision = decide(block, device)``, then install
``lambda *a, **k: patched_forward(block, decision, *a, **k)`` in the block's forward slot. A
:class:`Decision` is plain data decided once; per call, whatever it cannot vouch for (grad enabled,
a global forward hook, an argument diffusers would broadcast or promote, a hook added since) runs
diffusers' forward or the eager expression of that site, counted in ``decision.counts``. Kernels
run only on CUDA with CuPy (:mod:`qwen_absorb.ops._eligibility`); elsewhere the ops' torch
references run, which are the diffusers expressions themselves (bit-identical).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import attention21, fp8_forward, hooks, quant
from .ops import _validate
from .ops._eligibility import force_reference_requested, kernel_runtime_reasons
from .ops._target_rows import select_rows
from .ops.layer_norm_scale import launch as ln_scale_launch
from .ops.fp8 import quantize_fp8_reference
from .ops.layer_norm_scale import layer_norm_scale_reference
from .ops.swiglu import launch as swiglu_launch
from .ops.swiglu import swiglu_reference
from .ops.tanh_gate_residual import launch as tgr_launch
from .ops.tanh_gate_residual import tanh_gate_residual_reference
from .ops.tanh_gate_residual_layer_norm_scale import launch as tgrln_launch
from .ops.tanh_gate_residual_layer_norm_scale import tanh_gate_residual_layer_norm_scale_reference

log = logging.getLogger("qwen_absorb")

BLOCK_CLASS = "QwenImage21TransformerBlock"
SWIGLU_CLASS = "QwenImage21SwiGLUFeedForward"
SITES = ("norm1", "norm2", "swiglu")  # the sites that bypass a module; both residuals are always fused
_SUPPORTED = _validate.SUPPORTED_DTYPES
_KERNEL, _COMPILED, _REFERENCE = 0, 1, 2


class _Counts:
    """A thread-safe count of reasons (calls that ran diffusers' forward, a site's eager expression, or
    the references), read by the report."""

    __slots__ = ("_c", "_lock")

    def __init__(self) -> None:
        self._c: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self._lock:
            first = reason not in self._c
            self._c[reason] += 1
        if first:
            log.debug("%s", reason)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)

    def __repr__(self) -> str:
        return f"_Counts({self.snapshot()!r})"

    def __getstate__(self) -> dict[str, int]:  # pickle / deepcopy (a lock is neither)
        return self.snapshot()

    def __setstate__(self, state: dict[str, int]) -> None:
        self._c = Counter(state)
        self._lock = threading.Lock()


@dataclass(frozen=True)
class Decision:
    """What :func:`patched_forward` does for one block, decided once by :func:`decide`.

    ``enabled``: False runs diffusers' forward on every call. ``kernels``: CUDA kernels (else the ops'
    torch references). ``norm1``/``norm2``/``swiglu``: whether that site is fused (the attention
    residual and the FFN residual always are when enabled). ``reasons``: readable strings saying why
    anything is not fused or not a kernel. ``counts``: live per-call counts (not part of equality).
    """

    device: torch.device
    enabled: bool
    kernels: bool
    norm1: bool
    norm2: bool
    swiglu: bool
    eps1: float
    eps2: float
    reasons: tuple[str, ...]
    attn: bool = False  # the attention runs as attention21.run (q/k RMSNorm + RoPE fused where qk.kernel)
    qk: attention21.QkPlan | None = None
    counts: _Counts = field(default_factory=_Counts, compare=False, repr=False)

    @property
    def fused(self) -> tuple[str, ...]:
        """The fused sites, by name (``attn_residual`` and ``ffn_residual`` whenever enabled)."""
        if not self.enabled:
            return ()
        on = {"norm1": self.norm1, "norm2": self.norm2, "swiglu": self.swiglu}
        return tuple(s for s in ("norm1", "attn_residual", "norm2", "swiglu", "ffn_residual")
                     if on.get(s, True))


# ---------------------------------------------------------------------------- decide


_hooked = hooks.hooked  # torch / diffusers / accelerate hooks, or a forward replaced on the instance


def _norm_reason(block: nn.Module, name: str) -> str | None:
    m = block._modules.get(name)
    if m is None:
        return f"{name}: missing"
    if type(m) is not nn.LayerNorm:
        # A ModelOpt QuantLayerNorm computes LayerNorm(input_quantizer(x)): the runner applies the quantizer
        # (the module itself, so exactly ModelOpt's fake quant) and fuses the rest.
        info = quant.inspect_norm(name, m) if isinstance(m, nn.LayerNorm) else None
        if info is not None and info.modelopt:
            if info.unsupported:
                return "; ".join(info.unsupported)
            if not quant.quant_input_norm_ok(m):
                return f"{name}: a ModelOpt norm whose forward is not LayerNorm(input_quantizer(x))"
        else:
            return f"{name} is a {type(m).__name__}, not a plain nn.LayerNorm"
    if m.weight is not None or m.bias is not None:
        return f"{name} has an elementwise affine (the fused op has no weight or bias)"
    if len(m.normalized_shape) != 1:
        return f"{name} normalizes over {tuple(m.normalized_shape)}, not the last dimension"
    if _hooked(m):
        return f"{name} has a hook or a wrapped forward (the fused op would skip it)"
    return None


def _swiglu_reason(block: nn.Module) -> str | None:
    mlp = block._modules.get("img_mlp")
    if mlp is None:
        return "img_mlp: missing"
    if type(mlp).__name__ != SWIGLU_CLASS:
        return f"img_mlp is a {type(mlp).__name__}, not diffusers' {SWIGLU_CLASS}"
    if type(mlp).forward is not _swiglu_forward_of(mlp):
        return "img_mlp's class overrides forward"
    if _hooked(mlp):
        return "img_mlp has a hook or a wrapped forward (the fused path calls its linears directly)"
    act = mlp._modules.get("activation_fn")
    if type(act) is not nn.SiLU:
        return f"img_mlp.activation_fn is a {type(act).__name__}, not nn.SiLU"
    if _hooked(act):
        return "img_mlp.activation_fn has a hook or a wrapped forward"
    for name in ("gate_layer", "proj", "out"):
        if not isinstance(mlp._modules.get(name), nn.Module):
            return f"img_mlp.{name}: missing"
    return None


def _swiglu_forward_of(mlp: nn.Module):
    for cls in type(mlp).__mro__:
        if cls.__name__ == SWIGLU_CLASS:
            return cls.forward
    return None


def decide(block: nn.Module, device: torch.device | str) -> Decision:
    """Which sites of ``block`` are fused on ``device``, kernels or references, and why not."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    reasons: list[str] = []
    enabled = True
    if type(block).__name__ != BLOCK_CLASS and BLOCK_CLASS not in (c.__name__ for c in type(block).__mro__):
        enabled = False
        reasons.append(f"{type(block).__name__} is not a {BLOCK_CLASS}: diffusers' forward")
    elif not isinstance(block._modules.get("attn"), nn.Module):
        enabled = False
        reasons.append("block has no attn module: diffusers' forward")
    site_reasons = {}
    if enabled:
        site_reasons = {"norm1": _norm_reason(block, "img_norm1"), "norm2": _norm_reason(block, "img_norm2"),
                        "swiglu": _swiglu_reason(block)}
        reasons += [f"{s} not fused: {r}" for s, r in site_reasons.items() if r is not None]
    kernel_reasons = []
    if force_reference_requested():
        kernel_reasons.append("reference forced (QWEN_ABSORB_FORCE_REFERENCE=1)")
    kernel_reasons += kernel_runtime_reasons(device)
    reasons += [f"fused ops run their torch references: {r}" for r in kernel_reasons]
    kernels = enabled and not kernel_reasons
    attn_ok, qk = False, None
    if enabled:
        attn_why, qk = attention21.reasons(block.attn, kernels, device)
        attn_ok = not attn_why
        reasons += [f"attention runs as its module: {r}" for r in attn_why]
        if attn_ok and not qk.kernel:
            reasons += [f"q/k RMSNorm + RoPE not fused: {r}" for r in qk.why_not]
    n1, n2 = block._modules.get("img_norm1"), block._modules.get("img_norm2")
    return Decision(
        device=device,
        enabled=enabled,
        kernels=kernels,
        norm1=enabled and site_reasons.get("norm1") is None,
        norm2=enabled and site_reasons.get("norm2") is None,
        swiglu=enabled and site_reasons.get("swiglu") is None,
        eps1=float(getattr(n1, "eps", 1e-6)),
        eps2=float(getattr(n2, "eps", 1e-6)),
        reasons=tuple(reasons),
        attn=attn_ok,
        qk=qk,
    )


# ---------------------------------------------------------------------------- the forward


def _original(block, *args):
    return type(block).forward(block, *args)


def patched_forward(
    block: nn.Module,
    decision: Decision,
    hidden_states: torch.Tensor,
    modulation: torch.Tensor,
    rotary_emb: torch.Tensor | None = None,
    attention_mask: Any | None = None,
    target_token_mask: torch.Tensor | None = None,
    layer_cache: Any | None = None,
    kv_cache_mode: str | None = None,
    cache_write_slice: slice | None = None,
    segments: list[tuple[int, int, bool]] | None = None,
    key_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``QwenImage21TransformerBlock.forward`` with the same signature (after ``block, decision``)
    and the same output, bit for bit."""
    args = (hidden_states, modulation, rotary_emb, attention_mask, target_token_mask, layer_cache, kv_cache_mode,
            cache_write_slice, segments, key_valid)
    compiling = torch.compiler.is_compiling()
    why = _call_reason(decision, hidden_states, modulation, target_token_mask)
    if why is not None:
        if not compiling:
            decision.counts.add(why)
        return _original(block, *args)
    if compiling:
        mode = _COMPILED
    elif decision.kernels and hidden_states.device == decision.device:
        mode = _KERNEL
    else:
        mode = _REFERENCE
        if decision.kernels:
            decision.counts.add(f"activations on {hidden_states.device}, kernels decided for {decision.device}: "
                                "torch references")
    x, mask = hidden_states, target_token_mask
    if mode == _KERNEL:
        x = x.contiguous()
        if mask is not None:
            mask = mask.contiguous()
    mod1, mod2 = modulation.chunk(2, dim=-1)
    scale1, gate1 = mod1.chunk(2, dim=-1)
    scale2, gate2 = mod2.chunk(2, dim=-1)

    # Real FP8 GEMMs (qwen_absorb.fp8_forward) run eagerly; under torch.compile the linears are ModelOpt's.
    fp8 = mode != _COMPILED
    dev = x.device
    attn = block.attn

    # norm1 + (1 + scale1), with the e4m3 codes of its output for to_q/to_k/to_v when all three are real FP8
    norm1 = decision.norm1 and _norm_ok(block, "img_norm1", decision.eps1, decision, compiling)
    qkv = fp8_forward.group(attn, ("to_q", "to_k", "to_v"), dev) if fp8 and norm1 else None
    codes1 = None
    if norm1:
        nq1 = _fused_quant(block.img_norm1, mode, dev)
        img_modulated, codes1 = _layer_norm_scale(mode, x if nq1 is not None else _norm_input(block.img_norm1, x, mode),
                                                  scale1, decision.eps1, mask, qkv, nq=nq1)
    else:
        img_modulated = block.img_norm1(hidden_states) * (1 + select_rows(scale1, target_token_mask))

    if codes1 is not None:  # diffusers' processors call to_q/to_k/to_v with exactly this tensor
        fp8_forward.hand(qkv, img_modulated, codes1)
    try:
        if decision.attn and mode != _COMPILED and attention21.call_ok(attn, decision.qk.eps):
            attn_output = attention21.run(attn, decision.qk, mode == _KERNEL, img_modulated, attention_mask,
                                          rotary_emb, layer_cache, kv_cache_mode, cache_write_slice, segments,
                                          key_valid)
        else:
            if decision.attn and not compiling:
                decision.counts.add("attn, its processor or its q/k norms changed or hooked since patching: "
                                    "the attention runs as its module")
            attn_output = attn(
                hidden_states=img_modulated,
                attention_mask=attention_mask,
                rotary_emb=rotary_emb,
                layer_cache=layer_cache,
                kv_cache_mode=kv_cache_mode,
                cache_write_slice=cache_write_slice,
                segments=segments,
                key_valid=key_valid,
            )
    finally:
        if codes1 is not None:
            fp8_forward.take_back(qkv, img_modulated)

    # h + tanh(gate1) * attn_output, then norm2 + (1 + scale2) (with the codes for gate_layer / proj)
    amode = mode if _like(attn_output, hidden_states) else _REFERENCE
    if amode != mode and not compiling:
        decision.counts.add("attention output is not a plain tensor shaped like hidden_states: eager expression")
    mlp = block.img_mlp
    swiglu = decision.swiglu and _swiglu_ok(mlp, decision, compiling)
    norm2 = decision.norm2 and _norm_ok(block, "img_norm2", decision.eps2, decision, compiling)
    ab = fp8_forward.group(mlp, ("gate_layer", "proj"), dev) if fp8 and norm2 else None
    # unhooked real-FP8 linears are run as their GEMMs straight from the codes: then the bf16 activation
    # they would have been called with is never written (norm2's output, SwiGLU's output: memory traffic)
    ab_direct = ab is not None and swiglu and all(f.direct() for f in ab)
    codes2 = None
    if norm2:
        nq2 = _fused_quant(block.img_norm2, amode, dev)
        if nq2 is None and "input_quantizer" in block.img_norm2._modules:  # LayerNorm(Q(h)), Q between two ops
            h = _residual(amode, x, attn_output, gate1, mask, False)
            img_modulated2, codes2 = _layer_norm_scale(amode, _norm_input(block.img_norm2, h, amode), scale2,
                                                       decision.eps2, mask, ab, not ab_direct)
        else:
            h, img_modulated2, codes2 = _residual_norm(amode, x, attn_output, gate1, scale2, decision.eps2, mask,
                                                       ab, not ab_direct, nq=nq2)
    else:
        h = _residual(amode, x, attn_output, gate1, mask, False)
        img_modulated2 = block.img_norm2(h) * (1 + select_rows(scale2, target_token_mask))

    # FFN: SwiGLU through the FFN's own linears (or their FP8 GEMMs), then h + tanh(gate2) * y (and the fp16 clip)
    if codes2 is not None and not ab_direct:
        fp8_forward.hand(ab, img_modulated2, codes2)
    try:
        if ab_direct:
            a, b = ab[0].gemm(codes2), ab[1].gemm(codes2)
        elif swiglu:
            a, b = mlp.gate_layer(img_modulated2), mlp.proj(img_modulated2)
        else:
            y = mlp(img_modulated2)
    finally:
        if codes2 is not None and not ab_direct:
            fp8_forward.take_back(ab, img_modulated2)
    if swiglu:
        smode = mode if _pair_ok(a, b) else _REFERENCE
        o = fp8_forward.group(mlp, ("out",), dev) if fp8 else None
        o_direct = o is not None and o[0].direct()
        s, codes3 = _swiglu(smode, a, b, o, not o_direct)
        if o_direct:
            y = o[0].gemm(codes3)
        else:
            if codes3 is not None:
                fp8_forward.hand(o, s, codes3)
            try:
                y = mlp.out(s)
            finally:
                if codes3 is not None:
                    fp8_forward.take_back(o, s)
    fmode = mode if _like(y, h) else _REFERENCE
    if fmode != mode and not compiling:
        decision.counts.add("FFN output is not a plain tensor shaped like hidden_states: eager expression")
    out = _residual(fmode, h, y, gate2, mask, True)
    if mode == _REFERENCE and not compiling and not decision.kernels:
        decision.counts.add("fused ops ran their torch references")
    return out


def _call_reason(decision: Decision, x: Any, modulation: Any, mask: Any) -> str | None:
    """Why this call must run diffusers' forward (None: the fused path takes it exactly)."""
    if not decision.enabled:
        return "block not fused: diffusers' forward"
    if torch.is_grad_enabled():
        return "grad enabled: original diffusers forward (the kernels have no backward)"
    if hooks.global_forward_hooks():
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
    if mask is not None:
        if type(mask) is not torch.Tensor or mask.dtype != torch.bool or tuple(mask.shape) != (L,) \
                or mask.device != x.device:
            return "target_token_mask is not a bool [L] tensor on the activations' device: original diffusers forward"
    return None


def _norm_ok(block: nn.Module, name: str, eps: float, decision: Decision, compiling: bool) -> bool:
    m = block._modules.get(name)
    ok = ((type(m) is nn.LayerNorm or (isinstance(m, nn.LayerNorm) and quant.quant_input_norm_ok(m)))
          and m.weight is None and m.bias is None and m.eps == eps and not _hooked(m))
    if not ok and not compiling:
        decision.counts.add(f"{name} changed or hooked since patching: its eager expression")
    return ok


def _swiglu_ok(mlp: nn.Module, decision: Decision, compiling: bool) -> bool:
    ok = not _hooked(mlp) and type(mlp._modules.get("activation_fn")) is nn.SiLU \
        and not _hooked(mlp._modules["activation_fn"])
    if not ok and not compiling:
        decision.counts.add("img_mlp changed or hooked since patching: img_mlp(x)")
    return ok


def _like(t: Any, ref: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and t.shape == ref.shape and t.dtype == ref.dtype and t.device == ref.device


def _pair_ok(a: Any, b: Any) -> bool:
    return type(a) is torch.Tensor and _like(b, a) and a.dim() >= 1 and a.dtype in _SUPPORTED


# ---------------------------------------------------------------------------- one op, three ways


def _norm_input(norm: nn.Module, x: torch.Tensor, mode: int) -> torch.Tensor:
    """What the norm's LayerNorm sees: ``x``, or ModelOpt's ``input_quantizer(x)`` (the module itself) for
    a QuantLayerNorm."""
    q = norm._modules.get("input_quantizer")
    if q is None:
        return x
    qx = q(x)
    return qx.contiguous() if mode == _KERNEL else qx


def _fused_quant(norm: nn.Module, mode: int, device: torch.device):
    """A QuantLayerNorm's input quantizer as the kernels' ``Fp8PerTensorQuant``, applied inside the fused op
    (bit for bit ModelOpt's fake quantization, as for Qwen-Image's norms), or None: no quantizer, not on
    kernels, or one the kernels do not reproduce (disabled, calibrating, not FP8 per-tensor: then the
    runner calls the quantizer module itself, :func:`_norm_input`). Read per call: quantizers can change."""
    q = norm._modules.get("input_quantizer")
    if q is None or mode != _KERNEL or _hooked(q):  # a hook on the quantizer runs with the module
        return None
    return quant.norm_input_fp8(q, device)[0]


def _emits(fwds, mode):
    """The fp32 one-element amax of the consumers (None: no FP8 emission)."""
    return fwds[0].weight.input_amax if fwds is not None and mode != _COMPILED else None


def _layer_norm_scale(mode, x, scale, eps, mask, fwds=None, want_out=True, nq=None):
    """``(out or None, codes or None)``: codes when ``fwds`` (the real-FP8 consumers) is given; ``nq``
    (kernels only): the norm-input fake quantizer, applied in the kernel."""
    amax = _emits(fwds, mode)
    if mode == _KERNEL:
        return ln_scale_launch(x, scale, eps, mask, out=want_out or amax is None, fp8_amax=amax, norm_input_quant=nq)
    if mode == _COMPILED:
        return torch.ops.qwen_absorb.layer_norm_scale(x, scale, eps, mask, None)[0], None
    out = layer_norm_scale_reference(x, scale=scale, eps=eps, target_token_mask=mask)
    return out, (quantize_fp8_reference(out, amax) if amax is not None else None)


def _residual_norm(mode, h, y, gate, scale, eps, mask, fwds=None, want_out=True, nq=None):
    """``(new residual, modulated or None, codes or None)``; ``nq`` as for :func:`_layer_norm_scale`."""
    amax = _emits(fwds, mode)
    if mode == _KERNEL:
        return tgrln_launch(h.contiguous(), y.contiguous(), gate, scale, eps, mask, False,
                            out=want_out or amax is None, fp8_amax=amax, norm_input_quant=nq)
    if mode == _COMPILED:
        out = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale(h, y, gate, scale, eps, mask, False, None)
        return out[0], out[1], None
    nh, m = tanh_gate_residual_layer_norm_scale_reference(h, y, gate=gate, scale=scale, eps=eps,
                                                          target_token_mask=mask)
    return nh, m, (quantize_fp8_reference(m, amax) if amax is not None else None)


def _residual(mode, h, y, gate, mask, clip_fp16):
    if mode == _KERNEL:
        return tgr_launch(h.contiguous(), y.contiguous(), gate, mask, clip_fp16)
    if mode == _COMPILED:
        return torch.ops.qwen_absorb.tanh_gate_residual(h, y, gate, mask, clip_fp16)
    return tanh_gate_residual_reference(h, y, gate=gate, target_token_mask=mask, clip_fp16=clip_fp16)


def _swiglu(mode, a, b, fwds=None, want_out=True):
    """``(out or None, codes or None)``."""
    amax = _emits(fwds, mode)
    if mode == _KERNEL:
        return swiglu_launch(a.contiguous(), b.contiguous(), out=want_out or amax is None, fp8_amax=amax)
    if mode == _COMPILED:
        return torch.ops.qwen_absorb.swiglu(a, b, None)[0], None
    out = swiglu_reference(a, b)
    return out, (quantize_fp8_reference(out, amax) if amax is not None else None)


# ---------------------------------------------------------------------------- the patch floor's hooks


class CounterSink:
    """A ``Decision.counts`` that counts into the report's ``runtime_fallbacks`` (a shared Counter)."""

    __slots__ = ("counter",)

    def __init__(self, counter: Counter) -> None:
        self.counter = counter

    def add(self, reason: str) -> None:
        self.counter[reason] += 1

    def snapshot(self) -> dict[str, int]:
        return dict(self.counter)

    def __getstate__(self) -> Counter:
        return self.counter

    def __setstate__(self, counter: Counter) -> None:
        self.counter = counter


def decide_into(block: nn.Module, device: torch.device, counter: Counter) -> Decision:
    """:func:`decide`, counting per-call fallbacks into ``counter``."""
    return dataclasses.replace(decide(block, device), counts=CounterSink(counter))
