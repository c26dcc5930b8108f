"""The joint attention of a patched block: diffusers' ``QwenDoubleStreamAttnProcessor2_0`` step for step, except:
the four RMSNorm + RoPE chains are one ``qk_norm_rope`` launch; at batch 1 on kernels q/k/v are written straight into
the joint tensors (``Tuning.joint_outputs``); each planned linear is an FP8 GEMM fed by e4m3 codes."""

import torch
from torch import nn

from . import lora
from . import site_runners as R
from .ops import lane
from .ops.qk_norm_rope import launch as qkr_launch
from .projection import (add_deferred, fp8_linear, fp8_linear_into, nvfp4_linear, run_module, tp_linear, tp_shard_for,
                         wait, writes_into)
from .attention21 import rope_fits
from .sites import IMG_QKV, TXT_QKV, attention_functions

_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")  # img q, img k, txt q, txt k


def _linear(attn: nn.Module, plan, path: str, x: torch.Tensor, act: torch.Tensor | None, compiling: bool,
            works: list, branches: list | None = None, defer: list | None = None) -> torch.Tensor:
    """One attention linear: real FP8 (``x`` the codes), NVFP4, on TP shards (all-reduce to ``works``), or module."""
    lp, m = plan.linears[path], _module(attn, path)
    if lp.fp8_gemm:
        return fp8_linear(x, lp, plan, None, act, m, branches, defer)
    if lp.nvfp4 is not None and not compiling:  # x: the NVFP4 fake quantization its producer emitted
        return nvfp4_linear(x, lp)
    shard = None if compiling else tp_shard_for(plan, path, m, x)
    if shard is None:
        return run_module(plan, compiling, m, x)
    y, work = tp_linear(m, shard, x)
    if work is not None:
        works.append(work)
    return y


def _shared_lora(attn: nn.Module, plan, paths: tuple[str, ...], act: torch.Tensor | None) -> dict | None:
    """``{path: branches}`` of one stream's real-FP8 LoRA q/k/v, their lora_A products from one GEMM, or None."""
    if act is None:
        return None
    lora_paths = [p for p in paths if plan.linears[p].fp8_gemm and plan.linears[p].lora]
    dtypes = {plan.linears[p].weight.out_dtype for p in lora_paths}
    if len(dtypes) != 1:
        return None
    rows = lora.shared_input_branches([_module(attn, p) for p in lora_paths], act, dtypes.pop())
    return None if rows is None else dict(zip(lora_paths, rows))


def _module(attn: nn.Module, path: str) -> nn.Module:  # "attn.to_q" -> attn.to_q
    name = path.split(".", 1)[1]
    return attn.to_out[0] if name == "to_out.0" else attn._modules[name]


def run(attn: nn.Module, plan, img_in, txt_in, encoder_hidden_states_mask: torch.Tensor | None, image_rotary_emb,
        mode: int, compiling: bool, txt_lane: bool = False):
    """``(img_attn_output, txt_attn_output)``; ``img_in``/``txt_in``: ``(input, activation or None)`` from norm1.
    ``txt_lane``: the text stream's q/k/v and output projection run on the ``"txt"`` lane."""
    dispatch_attention_fn, _ = attention_functions()
    (img_in, img_act), (txt_in, txt_act) = img_in, txt_in
    B, seq_img, seq_txt, dev = img_in.shape[0], img_in.shape[1], txt_in.shape[1], img_in.device
    attention_mask = None
    if encoder_hidden_states_mask is not None:
        image_mask = torch.ones((B, seq_img), dtype=torch.bool, device=dev)
        attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)[:, None, None, :]
    head_dim = attn.inner_dim // attn.heads
    works: list = []  # row-wise all-reduces in flight (tensor parallelism)
    # B = 1 on kernels: q/k/v written straight into the joint tensors (saves three copies per block)
    kernels = mode == R.KERNEL
    joint = (plan.options.tuning.joint_outputs and kernels and not compiling and B == 1 and seq_txt > 0 and seq_img > 0
             and plan.qk_fused and image_rotary_emb is not None)
    jv = None
    if joint and all(writes_into(plan.linears[p]) for p in (IMG_QKV[2], TXT_QKV[2])):
        w_img, w_txt = plan.linears[IMG_QKV[2]].weight, plan.linears[TXT_QKV[2]].weight
        if w_img.out_dtype == w_txt.out_dtype and w_img.codes.shape[0] == w_txt.codes.shape[0]:
            jv = torch.empty((seq_txt + seq_img, w_img.codes.shape[0]), dtype=w_img.out_dtype, device=dev)
    qkv = {}
    deferred: list = []  # the q/k/v LoRA branch sums (addmm_, output by output), added once every GEMM is queued
    streams = (("img", IMG_QKV, img_in, img_act, slice(seq_txt, None)),
               ("txt", TXT_QKV, txt_in, txt_act, slice(0, seq_txt)))
    for name, paths, x, act, rows in streams[::-1] if txt_lane else streams:  # the lane's work first: it forks
        with lane.region(dev, "txt", reads=(x, act, jv), on=txt_lane and name == "txt") as r:
            pre = None if compiling else _shared_lora(attn, plan, paths, act)
            own = [] if r.on_lane else deferred  # the lane adds its own
            defer = own if pre else None
            ys = []
            for p in paths:
                br = pre.get(p) if pre else None
                if jv is not None and p == paths[2]:
                    y = fp8_linear_into(x, plan.linears[p], plan, jv[rows], act, _module(attn, p), br, defer)[None]
                else:
                    y = _linear(attn, plan, p, x, act, compiling, works, br, defer)
                ys.append(y.unflatten(-1, (-1, head_dim)))
            if r.on_lane and own:
                add_deferred(own)
            r.give(*ys)
        qkv[name] = ys
    if deferred:  # (a call per block per eager call saved where nothing was deferred)
        add_deferred(deferred)
    if txt_lane:
        lane.settle(dev, "txt")
    (img_q, img_k, img_v), (txt_q, txt_k, txt_v) = qkv["img"], qkv["txt"]
    qk = (img_q, img_k, txt_q, txt_k)
    freqs = None
    if image_rotary_emb is not None:  # unpacked as diffusers' processor does (a non-pair raises there too)
        img_freqs, txt_freqs = image_rotary_emb
        freqs = (img_freqs, img_freqs, txt_freqs, txt_freqs)
    joint_q = joint_k = None
    if plan.qk_fused and kernels and freqs is not None and _qk_ok(img_q, txt_q, image_rotary_emb, plan.qk_min_rows):
        outs = None
        if joint:
            shape = (1, seq_txt + seq_img, img_q.shape[2], head_dim)
            dt = attn.norm_q.weight.dtype  # the kernel's output dtype (RMSNorm returns the weight's)
            joint_q, joint_k = (torch.empty(shape, dtype=dt, device=img_q.device) for _ in range(2))
            outs = (joint_q[:, seq_txt:], joint_k[:, seq_txt:], joint_q[:, :seq_txt], joint_k[:, :seq_txt])
        weights = tuple(getattr(attn, n).weight for n in _NORMS)
        img_q, img_k, txt_q, txt_k = qkr_launch(qk, weights, freqs, plan.qk_eps, outs, wide=plan.options.tuning.qk_wide)
    else:
        img_q, img_k, txt_q, txt_k = _qk_eager(attn, qk, freqs)
    if joint_q is None:
        joint_q, joint_k = torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1)
    joint_v = jv.view(1, seq_txt + seq_img, -1, head_dim) if jv is not None else torch.cat([txt_v, img_v], dim=1)
    proc = attn.processor
    out = dispatch_attention_fn(joint_q, joint_k, joint_v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
                                backend=proc._attention_backend, parallel_config=proc._parallel_config)
    out = out.to(joint_q.dtype)  # [B, S, H, D]
    flat = out.flatten(2, 3)
    img_lp, txt_lp = plan.linears["attn.to_out.0"], plan.linears["attn.to_add_out"]
    if img_lp.fp8_gemm and txt_lp.fp8_gemm:
        txt_codes, img_codes = R.quantize_fp8_split(mode, out, seq_txt, txt_lp.weight.input_amax,
                                                    img_lp.weight.input_amax)
        with lane.region(dev, "txt", reads=(out, txt_codes), on=txt_lane):  # forked: it reads the quantized output
            txt_out = fp8_linear(txt_codes, txt_lp, plan, works, flat[:, :seq_txt], attn.to_add_out)
        img_out = fp8_linear(img_codes, img_lp, plan, works, flat[:, seq_txt:], attn.to_out[0])
    else:
        with lane.region(dev, "txt", reads=(out,), on=txt_lane):
            txt_out = _out_projection(attn, plan, "attn.to_add_out", flat[:, :seq_txt], mode, compiling, works)
        img_out = _out_projection(attn, plan, "attn.to_out.0", flat[:, seq_txt:], mode, compiling, works)
    wait(works)
    if len(attn.to_out) > 1:
        img_out = attn.to_out[1](img_out)  # dropout, as diffusers
    return img_out, txt_out


def _qk_ok(img_q, txt_q, rope, min_rows: int) -> bool:
    """Per-call conditions of the fused q/k path (a mismatch runs diffusers' chain, which raises as diffusers would)."""
    f_img, f_txt = rope
    if any(type(t) is not torch.Tensor for t in (img_q, txt_q, f_img, f_txt)):
        return False
    half, dev, rows = img_q.shape[-1] // 2, img_q.device, min(img_q.numel(), txt_q.numel()) // img_q.shape[-1]
    return (rows >= min_rows and img_q.dtype == txt_q.dtype
            and rope_fits(img_q, f_img, dev, half) and rope_fits(txt_q, f_txt, dev, half))


def _qk_eager(attn, qk: tuple, freqs: tuple | None) -> list:
    """diffusers' own RMSNorm modules and apply_rotary_emb_qwen, as its processor calls them."""
    _, apply_rotary_emb_qwen = attention_functions()
    qk = [x if (norm := getattr(attn, n)) is None else norm(x) for n, x in zip(_NORMS, qk)]
    if freqs is not None:
        qk = [apply_rotary_emb_qwen(x, f, use_real=False) for x, f in zip(qk, freqs)]
    return qk


def _out_projection(attn, plan, path, x, mode, compiling, works):
    lp = plan.linears[path]
    if lp.nvfp4 is not None and not compiling:
        return nvfp4_linear(R.quantize_nvfp4(mode, x.contiguous(), lp.nvfp4.input_amax32()), lp)
    if not lp.fp8_gemm:
        return _linear(attn, plan, path, x.contiguous(), None, compiling, works)
    return fp8_linear(R.quantize_fp8(mode, x, lp.weight.input_amax)[0], lp, plan, works, x, _module(attn, path))
