"""How one linear of a patched block runs: as its module, as a real FP8 ``torch._scaled_mm`` plus its PEFT LoRA
branches (:func:`fp8_linear`), or on this rank's tensor-parallel shards (:func:`tp_linear`). ``torch._scaled_mm``:
``scale_a * scale_b * (a @ b) + bias`` in fp32, the scales ``amax / 448`` as one-element fp32 device tensors (no host
sync). The bias rides in the epilogue when it has the output's dtype, else is added after."""

from typing import Any

import torch
from torch import nn

from . import lora
from .ops import lora_add, lora_fold
from .ops.quantize_fp8 import launch as qf8_launch
from .parallel import TpShard, tp_shard
from .plan import BlockPlan, LinearPlan


@torch.compiler.disable
def _opaque(module: nn.Module, *args: Any) -> Any:
    """A module outside the compiled graph (a graph break): Dynamo (torch 2.11) cannot trace ModelOpt's modules."""
    return module(*args)


def run_module(plan: BlockPlan, compiling: bool, module: nn.Module, *args: Any) -> Any:
    """``module(*args)``: outside a compiled graph for ModelOpt modules; an NVFP4 linear's runner when eager."""
    if plan.nvfp4 and not compiling and (runner := plan.nvfp4.get(module)) is not None:
        return runner(*args)
    if compiling and plan.modelopt:
        return _opaque(module, *args)
    return module(*args)


def nvfp4_linear(fq: torch.Tensor, lp: LinearPlan) -> torch.Tensor:
    """ModelOpt's NVFP4 ``F.linear(fq(x), fq(W), bias)`` from ``fq(x)``, its producer's emission."""
    return torch.nn.functional.linear(fq, lp.nvfp4.weight(), lp.nvfp4.lin.bias)


def fp8_linear(codes: torch.Tensor, lp: LinearPlan, plan: BlockPlan, works: list | None = None,
               x: torch.Tensor | None = None, module: nn.Module | None = None,
               branches: list | None = None, defer: list | None = None) -> torch.Tensor:
    """``linear(x)`` from the e4m3 codes of ``x`` ([..., K]) -> [..., N] in the linear's dtype. A LoRA linear's
    (``module`` the PEFT layer, ``x`` the unquantized input) active branches are added as PEFT adds them, or from
    ``branches``; ``defer`` collects them for :func:`add_deferred`. Row-wise TP: all-reduced (async into ``works``)."""
    w, lead = lp.weight, codes.shape[:-1]
    if (lp.lora or branches is not None) and writes_into(lp) and codes.numel():
        # the LoRA tail is fp8_linear_into's; a plain GEMM lets torch._scaled_mm allocate (cheaper on the host)
        out = torch.empty((codes.numel() // codes.shape[-1], w.codes.shape[0]), dtype=w.out_dtype, device=codes.device)
        return fp8_linear_into(codes, lp, plan, out, x, module, branches, defer).view(*lead, out.shape[-1])
    bias = lp.bias
    fuse_bias = bias is not None and bias.dtype == w.out_dtype and w.out_dtype != torch.float32
    out = torch._scaled_mm(codes.reshape(-1, codes.shape[-1]), w.codes.t(), scale_a=lp.input_scale, scale_b=w.scale,
                           bias=bias if fuse_bias else None, out_dtype=w.out_dtype, use_fast_accum=plan.fast_accum)
    if bias is not None and not fuse_bias:
        out = out + bias.to(out.dtype)
    out = out.reshape(*lead, out.shape[-1])
    if branches is not None:
        out = lora.add_products(out.contiguous(), branches)
    elif lp.lora:
        out = lora.add_branches(module, out, x)
    if (tp := lp.tp) is not None and tp.style == "rowwise":
        work = torch.distributed.all_reduce(out, group=tp.group, async_op=True)
        if works is None:
            work.wait()
        else:
            works.append(work)
    return out


def writes_into(lp: LinearPlan) -> bool:
    """Whether :func:`fp8_linear_into` computes exactly what :func:`fp8_linear` does for ``lp`` (fused bias, no TP)."""
    w, bias = lp.weight, lp.bias
    return (lp.fp8_gemm and lp.tp is None and w is not None and w.out_dtype != torch.float32
            and (bias is None or bias.dtype == w.out_dtype))


def fp8_linear_into(codes: torch.Tensor, lp: LinearPlan, plan: BlockPlan, out: torch.Tensor,
                    x: torch.Tensor | None = None, module: nn.Module | None = None,
                    branches: list | None = None, defer: list | None = None) -> torch.Tensor:
    """:func:`fp8_linear` of a :func:`writes_into` linear into ``out`` (a contiguous [M, N] view: no concatenation
    copy); the LoRA branches are added after the GEMM, or handed to ``defer``."""
    w = lp.weight
    prods = lora.products(module, x, w.out_dtype) if branches is None and lp.lora else branches
    torch._scaled_mm(codes.reshape(-1, codes.shape[-1]), w.codes.t(), scale_a=lp.input_scale, scale_b=w.scale,
                     bias=lp.bias, out_dtype=w.out_dtype, use_fast_accum=plan.fast_accum, out=out)
    if prods is not None:
        if defer is not None:
            defer.append((out, prods))
        else:
            lora.add_products(out, prods)
    elif lp.lora:  # PEFT's own expression (not in place): its result, where the view is
        y = lora.add_branches(module, out, x)
        if y is not out:
            out.copy_(y.reshape(out.shape))
    return out


def add_deferred(deferred: list) -> None:
    """Add the branches :func:`fp8_linear_into` deferred, output by output, and empty ``deferred``."""
    for y, prods in deferred:
        lora.add_products(y, prods)
    deferred.clear()


def fp8_linear_gelu_fp8(codes: torch.Tensor, lp: LinearPlan, down: LinearPlan, plan: BlockPlan, x: torch.Tensor,
                        module: nn.Module, down_module: nn.Module | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor | None, lora.Products | None] | None:
    """net[0].proj with its last LoRA branch added inside the GELU(tanh) + e4m3 quantization for a real-FP8 net[2]:
    ``(codes, g, branches)``; None (nothing computed: the caller runs the steps) where the switch or kernels refuse."""
    tuning = plan.options.tuning
    if not (tuning.lora_gelu_kernel and plan.kernels and lp.lora and down.fp8_gemm and writes_into(lp)
            and codes.numel()) or torch.compiler.is_compiling():
        return None
    amax, act_out = down.weight.input_amax, down.lora and down.lora_active
    dtype, lead, n = lp.weight.out_dtype, codes.shape[:-1], lp.weight.codes.shape[0]
    out = torch.empty((codes.numel() // codes.shape[-1], n), dtype=dtype, device=codes.device)
    prods = lora.products(module, x, dtype)
    if not prods or any(type(s) is not float or lora_add.reasons(out, t, b) for t, b, s in prods):
        fp8_linear_into(codes, lp, plan, out, x, module, prods)  # the two steps, on the products computed
        _, c, g = qf8_launch(out.view(*lead, n), 0, None, amax, "gelu_tanh", act_out=act_out)
        return c, g, None
    fp8_linear_into(codes, lp, plan, out, x, module, prods[:-1])
    t, b, s = prods[-1]
    fold = lora.foldable_branch(down_module, out.dtype, out.device) if act_out and down_module is not None else None
    if fold is not None and tuning.lora_fold and tuning.lora_add_tiles and not lora_fold.reasons(out, t, b, fold[0]):
        c, t2 = lora_fold.add_gelu_fp8_fold(out, t, b, s, amax, fold[0])
        return c.view(*lead, n), None, [(t2, fold[1], fold[2])]
    c, g = lora_add.add_gelu_fp8(out, t, b, s, amax, act_out, tiles=tuning.lora_add_tiles)
    return c.view(*lead, n), (g.view(*lead, n) if g is not None else None), None


def tp_shard_for(plan: BlockPlan, path: str, linear: nn.Module, x: Any) -> TpShard | None:
    """The local-shard record of a TP linear that may skip DTensor for input ``x``, else None (counted with why)."""
    if not plan.options.tuning.tp_local:
        return None
    shard, why = tp_shard(linear)
    if shard is not None and type(x) is not torch.Tensor:
        shard, why = None, f"input is a {type(x).__name__}"
    if shard is None and why is not None:
        plan.count(f"{path}: tensor-parallel linear runs through DTensor ({why})")
    return shard


def tp_linear(linear: nn.Module, shard: TpShard, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``linear(x)`` as DTensor computes it, on the local shards: ``(output, all-reduce work or None)``."""
    y = torch.nn.functional.linear(x, shard.weight.to_local(), shard.local_bias(linear))
    return y, None if shard.style == "colwise" else torch.distributed.all_reduce(y, group=shard.group, async_op=True)


def wait(works: list) -> None:  # on CUDA the stream waits, not the host
    for w in works:
        w.wait()
    works.clear()
