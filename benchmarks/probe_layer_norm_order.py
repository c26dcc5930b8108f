"""Which FMA grouping in the Welford combine reproduces PyTorch's CUDA LayerNorm bit for bit?

PyTorch's cuWelfordCombine computes `nA*meanA + nB*meanB`; nvcc contracts it into one FMA, but
which product it keeps unrounded is the compiler's choice. This probe compiles both groupings
(QA_WELFORD_MEAN_ORDER 0/1) and reports the share of bit-identical LayerNorm outputs against
torch, in fp32 (where any difference in mean or rstd shows). Usage: python benchmarks/probe_layer_norm_order.py
"""

import json
import sys

import torch

from qwen_absorb.ops import _runtime, layer_norm_scale_shift

results = {}
for order in (0, 1):
    _runtime.set_defines({"QA_WELFORD_MEAN_ORDER": order})
    row = {}
    for dtype in (torch.float32, torch.bfloat16):
        for D in (64, 3072, 3080, 5120):
            g = torch.Generator(device="cuda").manual_seed(D)
            x = (torch.randn(4, 1024, D, generator=g, device="cuda") * 3 + 1).to(dtype)
            zero = torch.zeros(4, 1, D, device="cuda", dtype=dtype)
            got = layer_norm_scale_shift(x, shift=zero, scale=zero)
            want = torch.nn.functional.layer_norm(x, (D,), eps=1e-6)
            same = (got == want).float().mean().item()
            row[f"{str(dtype)[6:]}-D{D}"] = same
    results[f"order{order}"] = row
_runtime.set_defines(None)
json.dump(results, sys.stdout, indent=1)
print()
