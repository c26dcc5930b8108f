"""The attention of a patched Qwen-Image-2.1 block: diffusers' ``QwenImage21AttnProcessor`` step for step (q/k/v
called as modules: their hooks and real-FP8 forwards run), ``norm_q`` / ``norm_k`` and both RoPE calls (~22 eager
kernels) as one ``qk_norm_rope`` launch. Used where :func:`reasons` and, per call, :func:`call_ok` find nothing."""

from typing import Any, NamedTuple

import torch
from torch import nn

from . import hooks
from .ops.qk_norm_rope import HEAD_DIM, launch as qkr_launch, probe_variance_order
from .sites import attention21_functions

NORMS = ("norm_q", "norm_k")
LINEARS = ("to_q", "to_k", "to_v")


class QkPlan(NamedTuple):  # what reasons() decided for the q/k kernel
    kernel: bool
    eps: tuple[float, float]
    min_rows: int
    why_not: tuple[str, ...]


_NO_QK = QkPlan(False, (0.0, 0.0), 0, ())


def reasons(attn: nn.Module, kernels: bool, device: torch.device) -> tuple[list[str], QkPlan]:
    """``(why the attention cannot run here, the q/k kernel plan)``, decided once per block and device."""
    fns = attention21_functions()
    if fns is None:
        return ["diffusers has no Qwen-Image-2.1 attention"], _NO_QK
    _, _, attn_cls, proc_cls, rms = fns
    r: list[str] = []
    if type(attn) is not attn_cls:
        r.append(f"attn is a {type(attn).__name__}, not diffusers' {attn_cls.__name__}")
    elif type(attn.processor) is not proc_cls:
        r.append(f"attn.processor is a {type(attn.processor).__name__} (only {proc_cls.__name__} is replicated)")
    if hooks.hooked(attn):
        r.append("attn has a hook or a wrapped forward")
    for name in NORMS:
        n = attn._modules.get(name)
        if type(n) is not rms:
            r.append(f"attn.{name} is a {type(n).__name__}, not diffusers' RMSNorm")
        elif n.weight is None or getattr(n, "bias", None) is not None:
            r.append(f"attn.{name} is not an RMSNorm with weight and no bias")
        elif hooks.hooked(n):
            r.append(f"attn.{name} has a hook or a wrapped forward")
    r += [f"attn.{name}: missing" for name in LINEARS if not isinstance(attn._modules.get(name), nn.Module)]
    if r:
        return r, _NO_QK
    nq, nk, head_dim = attn.norm_q, attn.norm_k, attn.inner_dim // attn.heads
    why = [msg for bad, msg in (
        (not kernels, "the fused kernels cannot run here"),
        (head_dim != HEAD_DIM, f"head_dim {head_dim} != {HEAD_DIM}"),
        (nq.weight.dtype != nk.weight.dtype or any(type(n.weight.data) is not torch.Tensor for n in (nq, nk)),
         "attn.norm_q / norm_k weights differ in dtype or are not plain tensors")) if bad]
    min_rows = 0
    if not why:
        vo = probe_variance_order(device)  # once per device (cached)
        if vo.order is None:
            why.append(f"PyTorch's fp32 reduction order here is not one the kernel implements: {vo.detail}")
        min_rows = vo.min_rows
    return [], QkPlan(not why, (float(nq.eps), float(nk.eps)), min_rows, tuple(why))


def call_ok(attn: nn.Module, plan_eps: tuple[float, float]) -> bool:
    """The attention is still the one :func:`reasons` accepted (checked per call: hooks can come and go)."""
    fns = attention21_functions()
    if fns is None or type(attn) is not fns[2] or type(attn.processor) is not fns[3] or hooks.hooked(attn):
        return False  # (the attention module itself may have been replaced since deciding)
    return all(type(n := attn._modules.get(name)) is fns[4] and n.weight is not None and not hooks.hooked(n)
               and n.eps == eps for name, eps in zip(NORMS, plan_eps))


def rope_fits(q: torch.Tensor, f: torch.Tensor, device: torch.device, half: int) -> bool:
    """The ``qk_norm_rope`` kernel's layout: complex64 ``f`` [seq, half] on ``device``, unit last strides."""
    return (f.dtype == torch.complex64 and f.device == device and tuple(f.shape) == (q.shape[1], half)
            and f.stride(-1) == 1 and q.stride(-1) == 1)


def _kernel_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Any, attn: nn.Module, min_rows: int) -> bool:
    """Per call: plain tensors of the norms' dtype (``.to(value.dtype)`` is then the identity), rope as needed."""
    w = attn.norm_q.weight
    return (type(q) is torch.Tensor and type(k) is torch.Tensor and type(rope) is torch.Tensor
            and q.dtype == w.dtype == k.dtype == v.dtype == attn.norm_k.weight.dtype and q.device == w.device
            and rope_fits(q, rope, q.device, HEAD_DIM // 2) and k.stride(-1) == 1 and q.shape == k.shape
            and q.numel() // HEAD_DIM >= min_rows and q.numel() // HEAD_DIM < 2**31)


def run(attn: nn.Module, plan: Any, use_kernel: bool, hidden_states: torch.Tensor, attention_mask: Any,
        rotary_emb: torch.Tensor | None, layer_cache: Any, kv_cache_mode: str | None,
        cache_write_slice: slice | None, segments: list | None, key_valid: torch.Tensor | None,
        qkv: Any = None, codes: torch.Tensor | None = None) -> torch.Tensor:
    """``QwenImage21AttnProcessor()(attn, hidden_states, ...)`` bit for bit; ``qkv`` / ``codes``: q/k/v as GEMMs
    from the e4m3 codes of ``hidden_states``."""
    dispatch_attention_fn, apply_rotary_emb_qwen = attention21_functions()[:2]
    projected = ([f.gemm(codes) for f in qkv] if codes is not None
                 else [getattr(attn, n)(hidden_states) for n in LINEARS])  # to_q, to_k, to_v in diffusers' order
    query, key, value = (t.unflatten(-1, (-1, attn.inner_dim // attn.heads)) for t in projected)
    if use_kernel and plan.qk_fused and rotary_emb is not None \
            and _kernel_ok(query, key, value, rotary_emb, attn, plan.qk_min_rows):
        query, key = qkr_launch((query, key), (attn.norm_q.weight, attn.norm_k.weight), (rotary_emb, rotary_emb),
                                plan.qk_eps)
    else:
        query, key = attn.norm_q(query).to(value.dtype), attn.norm_k(key).to(value.dtype)
        if rotary_emb is not None:
            query, key = (apply_rotary_emb_qwen(t, rotary_emb, use_real=False) for t in (query, key))

    if layer_cache is not None:
        if kv_cache_mode == "extract" and cache_write_slice is not None:
            # clone(): a contiguous() of the prefix slice can be the same view at B = 1 (diffusers' note)
            layer_cache.store(key[:, cache_write_slice].clone(), value[:, cache_write_slice].clone())
        elif kv_cache_mode == "cached":
            cached_k, cached_v = layer_cache.get()
            key, value = torch.cat([cached_k, key], dim=1), torch.cat([cached_v, value], dim=1)
    seq_len_q, proc = query.shape[1], attn.processor
    if segments is None:  # decode: the target rows against [cached prefix, target]
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                    backend=proc._attention_backend, parallel_config=proc._parallel_config)
    else:  # prefill: each prefix segment sees the keys [0, end) (text: causal over its own), then the target all
        outputs = []
        for start, end, is_text in [*segments, (segments[-1][1] if segments else 0, None, False)]:
            seg_mask = None
            if is_text:
                n = end - start
                seg_mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=query.device),
                                      torch.tril(torch.ones(n, n, dtype=torch.bool, device=query.device))],
                                     dim=1)[None, None]
            if key_valid is not None:
                kv = key_valid[:, None, None, :end]
                seg_mask = kv if seg_mask is None else (seg_mask & kv)
            outputs.append(dispatch_attention_fn(query[:, start:end], key[:, :end], value[:, :end],
                                                 attn_mask=seg_mask, dropout_p=0.0, backend=None,
                                                 parallel_config=proc._parallel_config))
        out = torch.cat(outputs, dim=1)
    out = out[:, :seq_len_q].flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))
