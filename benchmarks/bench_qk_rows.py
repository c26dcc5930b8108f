#!/usr/bin/env python
"""qk_norm_rope: rows per warp (the kernel's RPW) against the device copy rate, at the shapes the models run.

One launch normalizes and rotates q and k ([1, L, H, 128] bf16, the complex64 rope table [L, 64]) as the patched
attentions call it. For each RPW in 1, 2, 4, 8 (``qk_norm_rope.ROWS_PER_WARP``), the median over 7 rounds of 20
launches timed with CUDA events; bytes = q and k read + both outputs written (the rope table stays in L2); the
copy rate = ``torch.Tensor.copy_`` of the same bytes, measured in the same run. Every variant's outputs are
compared bit for bit with RPW = 1 and with diffusers' eager chain.

    python benchmarks/bench_qk_rows.py --out benchmarks/results      # H200: ~20 s
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qwen_absorb.ops._eligibility import kernel_runtime_reasons  # noqa: E402

qkr = importlib.import_module("qwen_absorb.ops.qk_norm_rope")  # the module (ops.qk_norm_rope is also the op)

SHAPES = {"qwenimage_img_1024": (4096, 24), "qwenimage21_1024": (4224, 32), "qwenimage21_2048": (16512, 32)}
VARIANTS = (1, 2, 4, 8)


def _time(fn, rounds: int = 7, n: int = 20) -> float:
    """Median us per call."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args()
    dev = torch.device("cuda")
    why = kernel_runtime_reasons(dev)  # loads CuPy (the kernels' runtime) and says why not
    if why:
        print(f"the kernels cannot run here: {why}")
        return 2
    gen = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "variance_order":
                 qkr.probe_variance_order(dev).detail, "shapes": {}}
    default_rpw = qkr.ROWS_PER_WARP
    try:
        return _run(a, dev, gen, res)
    finally:
        qkr.ROWS_PER_WARP = default_rpw


def _run(a: argparse.Namespace, dev: torch.device, gen: torch.Generator, res: dict) -> int:
    for name, (L, H) in SHAPES.items():
        q = torch.randn(1, L, H, 128, device=dev, generator=gen).bfloat16()
        k = torch.randn(1, L, H, 128, device=dev, generator=gen).bfloat16() * 3
        wq = (torch.rand(128, device=dev, generator=gen) + 0.5).bfloat16()
        wk = (torch.rand(128, device=dev, generator=gen) + 0.5).bfloat16()
        ang = torch.rand(L, 64, device=dev, generator=gen) * 6.3
        f = torch.polar(torch.ones_like(ang), ang)
        want = [qkr.qk_norm_rope_reference(q, wq, f), qkr.qk_norm_rope_reference(k, wk, f)]
        nbytes = 4 * q.numel() * q.element_size()
        src, dst = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev), torch.empty(nbytes // 2, dtype=torch.uint8,
                                                                                      device=dev)
        copy_us = _time(lambda: dst.copy_(src))
        row = {"rows": 2 * L * H, "bytes": nbytes, "copy_us": round(copy_us, 2),
               "copy_gbs": round(nbytes / copy_us / 1e3, 1), "variants": {}}
        base = None
        for rpw in VARIANTS:
            qkr.ROWS_PER_WARP = rpw
            call = (lambda: qkr.launch((q, k), (wq, wk), (f, f), (1e-6, 1e-6)))
            got = call()
            us = _time(call)
            same_eager = all(torch.equal(g, w) for g, w in zip(got, want))
            base = got if base is None else base
            row["variants"][str(rpw)] = {
                "us": round(us, 2), "gbs": round(nbytes / us / 1e3, 1), "of_copy_rate": round(copy_us / us, 3),
                "bit_identical_to_eager": same_eager,
                "bit_identical_to_rpw1": all(torch.equal(g, b) for g, b in zip(got, base))}
            print(f"{name} RPW {rpw}: {us:.1f} us ({copy_us / us:.0%} of copy rate), eager-identical {same_eager}")
        res["shapes"][name] = row
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_qk_rows.json").write_text(json.dumps(res, indent=1))
    lines = [f"# qk_norm_rope rows per warp ({res['gpu']}, torch {res['torch']}, {res['date']})", "",
             f"variance order: {res['variance_order']}", "",
             "| shape | rows | copy us | " + " | ".join(f"RPW {r} us (of copy rate)" for r in VARIANTS) + " |",
             "|---|---|---|" + "---|" * len(VARIANTS)]
    for name, row in res["shapes"].items():
        v = row["variants"]
        lines.append(f"| {name} | {row['rows']} | {row['copy_us']} | " + " | ".join(
            f"{v[str(r)]['us']} ({v[str(r)]['of_copy_rate']:.0%}){'' if v[str(r)]['bit_identical_to_eager'] else ' NOT EXACT'}"
            for r in VARIANTS) + " |")
    (a.out / "bench_qk_rows.md").write_text("\n".join(lines) + "\n")
    ok = all(v["bit_identical_to_eager"] and v["bit_identical_to_rpw1"]
             for row in res["shapes"].values() for v in row["variants"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
