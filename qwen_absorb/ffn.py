"""How a patched Qwen-Image block's FeedForward runs: as its module, on its tensor-parallel shards, or with its
linears as real FP8 GEMMs, net[0]'s GELU fused with the e4m3 quantization that feeds net[2]."""

import torch
from torch import nn

from . import hooks
from . import site_runners as R
from .parallel import is_dtensor
from .plan import BlockPlan
from .projection import fp8_linear, fp8_linear_gelu_fp8, nvfp4_linear, run_module, tp_linear, tp_shard_for


def _tp_ffn(plan, mlp_name, mlp, x, works):
    """The FeedForward on its TP shards (all-reduce to ``works``), or None: not TP, or not diffusers' own unhooked."""
    net, up = mlp.net, mlp.net[0].proj
    if plan.tp_reasons[mlp_name] or not is_dtensor(up._parameters.get("weight")):
        return None
    if any(hooks.hooked(m) for m in (mlp, net[0], net[1])):
        plan.count(f"{mlp_name}: a forward hook on the FeedForward: it runs through DTensor")
        return None
    s_up = tp_shard_for(plan, f"{mlp_name}.net.0.proj", up, x)
    s_down = tp_shard_for(plan, f"{mlp_name}.net.2", net[2], x) if s_up is not None else None
    if s_down is None:
        return None
    y, work = tp_linear(net[2], s_down, net[1](net[0].gelu(tp_linear(up, s_up, x)[0])))
    if work is not None:
        works.append(work)
    return y


def run(plan: BlockPlan, block: nn.Module, mlp_name: str, x_in: tuple, works: list, compiling: bool,
        mode: int) -> torch.Tensor:
    """The FeedForward ``mlp_name`` of ``block``; ``x_in``: ``(input, activation or None)`` from the producing site."""
    (x, act), mlp = x_in, block._modules[mlp_name]
    up, down = plan.linears[f"{mlp_name}.net.0.proj"], plan.linears[f"{mlp_name}.net.2"]
    q4 = not compiling and (up.nvfp4 is not None or down.nvfp4 is not None)  # NVFP4 rows (eager only)
    if not up.fp8_gemm and not down.fp8_gemm and not q4:
        y = None if compiling else _tp_ffn(plan, mlp_name, mlp, x, works)
        return y if y is not None else run_module(plan, compiling, mlp, x)
    net = mlp.net
    # net[0]'s LoRA inside the GELU quantization (and net[2]'s lora_A products with it, where they fold)
    if (fused := fp8_linear_gelu_fp8(x, up, down, plan, act, net[0].proj, net[2])) is not None:
        codes, g, branches = fused
        return fp8_linear(codes, down, plan, works, g, net[2], branches)
    if up.fp8_gemm:
        h = fp8_linear(x, up, plan, None, act, net[0].proj)
    else:  # x: the NVFP4 fake quantization attn_residual emitted, where planned
        h = nvfp4_linear(x, up) if up.nvfp4 is not None and q4 else run_module(plan, compiling, net[0].proj, x)
    if down.nvfp4 is not None and q4:  # GELU + NVFP4 fake quantization in one launch
        return nvfp4_linear(R.quantize_nvfp4(mode, h, down.nvfp4.input_amax32(), "gelu_tanh", net[0].gelu), down)
    if not down.fp8_gemm:
        return run_module(plan, compiling, net[2], net[1](net[0].gelu(h)))
    codes, g = R.quantize_fp8(mode, h, down.weight.input_amax, "gelu_tanh", down.lora and down.lora_active, net[0].gelu)
    return fp8_linear(codes, down, plan, works, g, net[2])
