"""The patched ``QwenImageTransformerBlock.forward``: same math, fused elementwise sites.

Per stream: norm1 + modulate -> ``layer_norm_scale_shift``; attention residual + norm2 + modulate
-> ``bias_residual_layer_norm_scale_shift``; FFN residual -> ``bias_gate_residual``. Everything that
can be decided once (norm eps, which sites fuse, which biases are deferred) is decided at patch time
in a :class:`BlockPlan`; a call only checks what can change between calls (dtypes, devices, shapes,
whether a ModelOpt norm quantizer is enabled, grad mode).

A site that cannot take the fused path for a call runs the diffusers expression for that site,
with a deferred bias added as the separate add ``x + bias`` (what the ops' references do), and the
reason is counted in the report's ``runtime_fallbacks``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import ops
from .ops.fp8 import modelopt_not_supported_reasons
from .quant import quantizer_enabled

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------- deferred biases


class DeferredBias:
    """A projection whose bias is consumed by the fused op after it instead of by its GEMM.

    Storage (why it looks like this): the bias ``Parameter`` never moves. It stays in the innermost
    linear's ``_parameters["bias"]`` (the PEFT ``base_layer`` if wrapped), and outside the patched
    forward the module is untouched. So ``state_dict()`` / ``save_pretrained`` / ``load_state_dict``
    see the same keys and the very same tensor objects (nothing is copied, memory does not grow),
    ``.to()`` moves it, and offload hooks, which manage ``_parameters`` and read ``module.bias``
    (accelerate's ``set_module_tensor_to_device`` does), keep working whenever they run.

    Only while the patched block calls the attention / FFN does an instance-``__dict__`` entry
    ``bias = None`` shadow the parameter for attribute lookup (``nn.Module.__getattr__``, which
    serves ``_parameters``, runs only when normal lookup fails): ``F.linear(x, W, self.bias)``,
    ModelOpt's real-quant GEMMs and PEFT's ``base_layer`` read ``self.bias`` and get None. The
    entry is removed right after (also on error), and the fused op then reads
    ``_parameters["bias"]``, i.e. wherever the hooks left it. A bias still on the meta device
    before the GEMM (accelerate leaf offload materialises weights only inside the leaf's own
    forward) is not shadowed for that call: its GEMM adds it, as unpatched. Not thread-safe for
    concurrent calls of the same block (neither is ModelOpt's QuantAttention).
    """

    __slots__ = ("linear", "name")

    def __init__(self, linear: nn.Module, name: str) -> None:
        self.linear = linear
        self.name = name

    def shadow(self) -> None:
        object.__setattr__(self.linear, "bias", None)

    def unshadow(self) -> None:
        self.linear.__dict__.pop("bias", None)

    def usable(self) -> bool:
        """The bias exists, is materialised, and nothing else shadows it already."""
        b = self.linear._parameters.get("bias")
        return b is not None and b.device.type != "meta" and "bias" not in self.linear.__dict__


# ---------------------------------------------------------------------------- the plan


@dataclass
class BlockPlan:
    """What a patched block does, decided at patch time (see :mod:`qwen_absorb.patch`)."""

    index: int
    counter: Counter
    force_reference: bool
    eps: dict[str, float]  # norm name -> eps
    fuse: dict[tuple[str, str], bool]  # (stream, site) -> fused statically
    deferred: dict[tuple[str, str], DeferredBias | None]  # (stream, site) -> deferred projection
    quant_norms: frozenset[str]  # norm names that are ModelOpt QuantLayerNorms
    kernels_under_compile: bool = False  # see qwen_absorb.patch
    all_deferred: list[DeferredBias] = field(default_factory=list)
    _kernel_reasons: dict[torch.device, str | None] = field(default_factory=dict)

    def count(self, reason: str) -> None:
        if not torch.compiler.is_compiling():
            self.counter[reason] += 1

    def fused(self, key: tuple[str, str]) -> bool:
        """Whether this site takes the fused op in this call (statically, and under compile)."""
        return self.fuse[key] and (self.kernels_under_compile or not torch.compiler.is_compiling())

    def kernel_reason(self, device: torch.device) -> str | None:
        """Why the fused ops will run their references on ``device`` (cached), else None."""
        try:
            return self._kernel_reasons[device]
        except KeyError:
            r = ops.kernel_runtime_reasons(device)
            if self.force_reference or ops._eligibility.force_reference_requested():
                r = ["reference forced", *r]
            why = ("fused ops ran their torch references: " + "; ".join(r)) if r else None
            self._kernel_reasons[device] = why
            return why


# ---------------------------------------------------------------------------- helpers


def _expand(p: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """A [R, D] chunk as diffusers' ``_modulate`` broadcasts it ([B, 1, D] or per-token [B, L, D])."""
    if index is None:
        return p.unsqueeze(1)
    b = p.size(0) // 2
    return torch.where(index.unsqueeze(-1) == 0, p[:b].unsqueeze(1), p[b:].unsqueeze(1))


def _params_reason(x: torch.Tensor, params: tuple[torch.Tensor, ...], index: torch.Tensor | None) -> str | None:
    """Why the fused ops would reject these arguments where diffusers accepts them (else None)."""
    if x.dtype not in _SUPPORTED:
        return f"activation dtype {x.dtype} not supported by the fused ops"
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


def _fp8_direct(q: Any) -> bool:
    """Whether the op can reproduce the norm's ModelOpt quantizer itself (FP8 per-tensor static,
    with an amax it can read: on the meta device, e.g. under accelerate leaf offload, it cannot)."""
    if modelopt_not_supported_reasons(q):
        return False
    return q._amax.device.type != "meta"


def _bias_for_op(d: DeferredBias, x: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    b = d.linear._parameters["bias"]
    if b.device != x.device or b.dtype != x.dtype:
        # e.g. leaf-level group offloading moved it back after the GEMM, or layerwise casting
        # stores it in another dtype: the value is the same one the GEMM would have used.
        plan.count(f"{d.name}: deferred bias was {b.dtype} on {b.device} at use; converted")
        b = b.to(device=x.device, dtype=x.dtype)
    return b


def _this_call(plan: BlockPlan, a: DeferredBias | None, b: DeferredBias | None):
    """The deferred biases to take out of this call's GEMMs (others stay in, counted)."""
    out = []
    for d in (a, b):
        if d is not None and not d.usable():
            plan.count(f"{d.name}: bias not materialised before its GEMM (meta device under an offload hook); "
                       "added in the GEMM")
            d = None
        out.append(d)
    return out[0], out[1]


def _shadow(a: DeferredBias | None, b: DeferredBias | None) -> None:
    if a is not None:
        a.shadow()
    if b is not None:
        b.shadow()


def _unshadow(a: DeferredBias | None, b: DeferredBias | None) -> None:
    if a is not None:
        a.unshadow()
    if b is not None:
        b.unshadow()


# ---------------------------------------------------------------------------- the forward


def make_forward(plan: BlockPlan, original: Callable[..., Any]) -> Callable[..., Any]:
    """The patched forward for one block, to be bound to it (``types.MethodType``).

    ``original`` is the unbound class forward (``QwenImageTransformerBlock.forward``), run when
    grad is enabled. The signature is the class forward's, so hooks that map positional arguments
    through ``inspect.signature(type(block).forward)`` (context parallel, caches, checkpointing) work.
    """
    fref = plan.force_reference
    lnss = ops.layer_norm_scale_shift
    brln = ops.bias_residual_layer_norm_scale_shift
    bgr = ops.bias_gate_residual

    def norm1_site(block, stream, norm, h, shift, scale, index, mod1):
        key = (stream, "norm1")
        name = f"{stream}_norm1"
        if plan.fused(key):
            why = _params_reason(h, (shift, scale), index)
            if why is None:
                x = h
                if name in plan.quant_norms and quantizer_enabled(norm.input_quantizer):
                    x = norm.input_quantizer(h)  # exactly what QuantLayerNorm feeds its LayerNorm
                return lnss(x, shift=shift, scale=scale, eps=plan.eps[name], index=index, force_reference=fref)
            plan.count(f"{stream}.norm1: {why}")
        return block._modulate(norm(h), mod1, index)[0]

    def attn_site(block, stream, norm, h, y, d, gate, shift, scale, index, mod2):
        """Returns (new residual, modulated norm2 output); ``d``: the bias deferred for this call."""
        key = (stream, "attn_residual")
        name = f"{stream}_norm2"
        bias = _bias_for_op(d, h, plan) if d is not None else None
        if plan.fused(key):
            why = _params_reason(h, (gate, shift, scale), index)
            if why is None and y.dtype != h.dtype:
                why = f"attention output is {y.dtype}, residual {h.dtype}"
            if why is None:
                eps = plan.eps[name]
                q = norm.input_quantizer if name in plan.quant_norms else None
                if q is not None and not quantizer_enabled(q):
                    q = None
                if q is None or _fp8_direct(q):
                    return brln(h, y, bias=bias, gate=gate, shift=shift, scale=scale, eps=eps, index=index,
                                norm_input_quant=q, force_reference=fref)
                # A quantizer the FP8 path cannot reproduce (e.g. NVFP4 dynamic): apply it exactly
                # between the two other fused ops.
                new_h = bgr(h, y, bias=bias, gate=gate, index=index, force_reference=fref)
                return new_h, lnss(q(new_h), shift=shift, scale=scale, eps=eps, index=index, force_reference=fref)
            plan.count(f"{stream}.attn_residual: {why}")
        if bias is not None:
            y = y + bias
        new_h = h + _expand(gate, index) * y
        return new_h, block._modulate(norm(new_h), mod2, index)[0]

    def ffn_site(stream, h, y, d, gate, index):
        key = (stream, "ffn_residual")
        bias = _bias_for_op(d, h, plan) if d is not None else None
        if plan.fused(key):
            why = _params_reason(h, (gate,), index)
            if why is None and y.dtype != h.dtype:
                why = f"FFN output is {y.dtype}, residual {h.dtype}"
            if why is None:
                return bgr(h, y, bias=bias, gate=gate, index=index, force_reference=fref)
            plan.count(f"{stream}.ffn_residual: {why}")
        if bias is not None:
            y = y + bias
        return h + _expand(gate, index) * y

    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor,
        temb: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
        modulate_index: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.is_grad_enabled():
            # The kernels have no backward: training runs diffusers' forward, i.e. exactly the
            # unpatched block (biases are shadowed only inside the fused path below).
            plan.count("grad enabled: original diffusers forward")
            return original(
                self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb,
                image_rotary_emb, joint_attention_kwargs, modulate_index,
            )
        if not torch.compiler.is_compiling():
            why = plan.kernel_reason(hidden_states.device)
            if why is not None:
                plan.counter[why] += 1

        img_mod_params = self.img_mod(temb)
        if self.zero_cond_t:
            temb = torch.chunk(temb, 2, dim=0)[0]
        txt_mod_params = self.txt_mod(temb)
        img_mod1, img_mod2 = img_mod_params.chunk(2, dim=-1)
        txt_mod1, txt_mod2 = txt_mod_params.chunk(2, dim=-1)
        i_shift1, i_scale1, i_gate1 = img_mod1.chunk(3, dim=-1)
        i_shift2, i_scale2, i_gate2 = img_mod2.chunk(3, dim=-1)
        t_shift1, t_scale1, t_gate1 = txt_mod1.chunk(3, dim=-1)
        t_shift2, t_scale2, t_gate2 = txt_mod2.chunk(3, dim=-1)
        index = modulate_index

        img_modulated = norm1_site(self, "img", self.img_norm1, hidden_states, i_shift1, i_scale1, index, img_mod1)
        txt_modulated = norm1_site(self, "txt", self.txt_norm1, encoder_hidden_states, t_shift1, t_scale1, None, txt_mod1)

        joint_attention_kwargs = joint_attention_kwargs or {}
        d_img, d_txt = plan.deferred[("img", "attn_residual")], plan.deferred[("txt", "attn_residual")]
        d_img, d_txt = _this_call(plan, d_img, d_txt)
        _shadow(d_img, d_txt)
        try:
            img_attn_output, txt_attn_output = self.attn(
                hidden_states=img_modulated,
                encoder_hidden_states=txt_modulated,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                image_rotary_emb=image_rotary_emb,
                **joint_attention_kwargs,
            )
        finally:
            _unshadow(d_img, d_txt)

        hidden_states, img_modulated2 = attn_site(
            self, "img", self.img_norm2, hidden_states, img_attn_output, d_img, i_gate1, i_shift2, i_scale2, index, img_mod2
        )
        encoder_hidden_states, txt_modulated2 = attn_site(
            self, "txt", self.txt_norm2, encoder_hidden_states, txt_attn_output, d_txt, t_gate1, t_shift2, t_scale2, None,
            txt_mod2,
        )

        d_iffn, d_tffn = plan.deferred[("img", "ffn_residual")], plan.deferred[("txt", "ffn_residual")]
        d_iffn, d_tffn = _this_call(plan, d_iffn, d_tffn)
        _shadow(d_iffn, d_tffn)
        try:
            img_mlp_output = self.img_mlp(img_modulated2)
            txt_mlp_output = self.txt_mlp(txt_modulated2)
        finally:
            _unshadow(d_iffn, d_tffn)
        hidden_states = ffn_site("img", hidden_states, img_mlp_output, d_iffn, i_gate2, index)
        encoder_hidden_states = ffn_site("txt", encoder_hidden_states, txt_mlp_output, d_tffn, t_gate2, None)

        if encoder_hidden_states.dtype == torch.float16:
            encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return encoder_hidden_states, hidden_states

    forward.__qwen_absorb_plan__ = plan  # type: ignore[attr-defined]
    forward.__doc__ = "qwen_absorb fused forward of QwenImageTransformerBlock (same signature and outputs)."
    return forward
