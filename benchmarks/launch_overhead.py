"""Host cost of one fused-op call for each CuPy launch style (qwen_absorb.ops._cuda.LAUNCH_STYLE).

Wall time per call of ops.bias_gate_residual on a small [1, 16, 3072] bf16 input (GPU work
negligible, no synchronisation inside the loop), median of 5 rounds of 500 calls, next to one
torch.add for scale. The block-level effect: run benchmarks/bench_block.py with
QWEN_ABSORB_LAUNCH_STYLE=context|direct. Usage: python benchmarks/launch_overhead.py [--out DIR]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import qwen_absorb.ops as ops
from qwen_absorb.ops import _cuda


def host_us(fn, n=500, rounds=5):
    per = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        per.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = "cuda"
    x = torch.randn(1, 16, 3072, device=dev, dtype=torch.bfloat16)
    g = torch.randn(1, 3072, device=dev, dtype=torch.bfloat16)
    b = torch.randn(3072, device=dev, dtype=torch.bfloat16)
    res = {"torch_add_us": host_us(lambda: torch.add(x, x))}
    for style in ("context", "direct"):
        _cuda.LAUNCH_STYLE = style
        with torch.inference_mode():
            res[f"bias_gate_residual_{style}_us"] = host_us(lambda: ops.bias_gate_residual(x, x, bias=b, gate=g))
    _cuda.LAUNCH_STYLE = "context"
    with torch.inference_mode():
        res["launch_only_context_us"] = host_us(
            lambda: _cuda.bias_gate_residual(x, x, b, g, None))
    print(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "launch_overhead.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
