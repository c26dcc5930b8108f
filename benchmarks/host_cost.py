"""Host cost of one fused-op call against ``torch.add``, in one process (issue 7's op-level targets).

At [1, 128, 3072] bf16 the GPU work of each call is a few microseconds, so a loop of calls is bound
by the host: ``time.perf_counter`` over N calls (then one synchronize) divided by N is the host cost
of one call. Measured side by side, several rounds, median of the rounds. Rows:

- ``torch_add_us``: ``torch.add(x, y)`` (the yardstick);
- ``op_us``: the public, fully validating ops;
- ``block_entry_us``: the checked-once ``launch`` entry points the patched block calls;
- ``ratio_*``: each divided by ``torch_add_us`` (target: <= 1.5).

Merges its keys into ``--out/host_cost.json`` (the transformer-level keys come from
``benchmarks/transformer_suite.py --sections host``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import qwen_absorb.ops as ops
from qwen_absorb.ops.bias_gate_residual import launch as bgr
from qwen_absorb.ops.bias_residual_layer_norm_scale_shift import launch as brln
from qwen_absorb.ops.layer_norm_scale_shift import launch as lnss
from qwen_absorb.ops.quantize_fp8 import launch as qf8


def per_call_us(fn, n: int, rounds: int) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    B, L, D = 1, 128, 3072
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, L, D, generator=g, device=dev).bfloat16()
    r = torch.randn(B, L, D, generator=g, device=dev).bfloat16()
    mod = torch.randn(B, 6 * D, generator=g, device=dev).bfloat16()
    sh, sc, gt, sh2, sc2, gt2 = (c.unsqueeze(1) for c in mod.chunk(6, dim=-1))
    rows = [c.squeeze(1) for c in (sh, sc, gt)]
    bias = torch.randn(D, generator=g, device=dev).bfloat16()
    amax = torch.tensor([4.0], device=dev)
    n, k = args.calls, args.rounds

    res: dict = {"shape": [B, L, D], "dtype": "bfloat16", "calls": n, "rounds": k}
    cases = {
        "torch_add": lambda: torch.add(x, r),
        "op:layer_norm_scale_shift": lambda: ops.layer_norm_scale_shift(x, shift=sh, scale=sc),
        "op:bias_residual_layer_norm_scale_shift": lambda: ops.bias_residual_layer_norm_scale_shift(
            r, x, bias=bias, gate=gt, shift=sh2, scale=sc2),
        "op:bias_gate_residual": lambda: ops.bias_gate_residual(r, x, bias=bias, gate=gt2),
        "op:quantize_fp8": lambda: ops.quantize_fp8(x, amax),
        "entry:layer_norm_scale_shift": lambda: lnss(x, rows[0], rows[1], 1e-6, None),
        "entry:layer_norm_scale_shift_fp8": lambda: lnss(x, rows[0], rows[1], 1e-6, None, out=False, fp8_amax=amax),
        "entry:bias_residual_layer_norm_scale_shift": lambda: brln(r, x, bias, rows[2], rows[0], rows[1], 1e-6, None,
                                                                   None, 0),
        "entry:bias_gate_residual": lambda: bgr(r, x, bias, rows[2], None),
        "entry:quantize_fp8": lambda: qf8(x, 0, None, amax),
        "F.layer_norm": lambda: torch.nn.functional.layer_norm(x, (D,), eps=1e-6),
    }
    # interleave the cases over rounds so slow drifts of a shared host hit all of them alike
    samples: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(k):
        for name, fn in cases.items():
            samples[name].append(per_call_us(fn, n, 1))
    us = {c: statistics.median(v) for c, v in samples.items()}
    add = us["torch_add"]
    res["torch_add_us"] = round(add, 2)
    res["f_layer_norm_us"] = round(us["F.layer_norm"], 2)
    res["op_us"] = {c.split(":", 1)[1]: round(v, 2) for c, v in us.items() if c.startswith("op:")}
    res["block_entry_us"] = {c.split(":", 1)[1]: round(v, 2) for c, v in us.items() if c.startswith("entry:")}
    res["ratio_op_vs_add"] = {c: round(v / add, 2) for c, v in res["op_us"].items()}
    res["ratio_block_entry_vs_add"] = {c: round(v / add, 2) for c, v in res["block_entry_us"].items()}
    res["samples_us"] = {c: [round(s, 2) for s in v] for c, v in samples.items()}
    res["gpu"] = torch.cuda.get_device_name()
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res["torch"] = torch.__version__
    try:
        import cupy

        res["cupy"] = cupy.__version__
    except Exception:  # noqa: BLE001
        pass
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "host_cost.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    old.update(res)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(old, indent=2))
    tmp.replace(path)
    print(json.dumps({k: res[k] for k in ("torch_add_us", "op_us", "block_entry_us", "ratio_op_vs_add",
                                          "ratio_block_entry_vs_add")}, indent=1))


if __name__ == "__main__":
    main()
