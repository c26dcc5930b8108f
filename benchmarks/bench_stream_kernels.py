#!/usr/bin/env python
"""The streaming kernels issue 21 names, their build variants against the device copy rate: ``qk_norm_rope``
(4 elements per lane, ``ROWS_PER_WARP`` 2 / 4, against the wide form: 8 per lane, a row per half-warp, RPW 2 / 4 / 8)
and ``swiglu`` (``UNROLL`` 1 / 2 / 4 vectors per thread; bf16 out and the FP8 codes-only form), at the shapes the
models run.

Each time is a CUDA-graph replay of one call (launch overhead removed), median of 30 replays after a steady
warm-up; bytes = what the call must read and write (the rope table stays in L2); ``of_copy`` = the time of a
``copy_`` of the same bytes / the kernel's. Every variant's outputs are compared bit for bit with the eager
expression (and, for qk_norm_rope, the probed variance order's chain) and with the library's default variant.

    python benchmarks/bench_stream_kernels.py --out benchmarks/results      # H200: ~1 min
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

from qwen_absorb.ops._eligibility import kernel_runtime_reasons  # noqa: E402

qkr = importlib.import_module("qwen_absorb.ops.qk_norm_rope")  # the modules (ops.qk_norm_rope is also the op)
sw = importlib.import_module("qwen_absorb.ops.swiglu")

QK_SHAPES = {"qwenimage_img_1024": (4096, 24), "qwenimage21_1024": (4224, 32), "qwenimage21_2048": (16512, 32)}
QK_VARIANTS = (("narrow", 2), ("narrow", 4), ("wide", 2), ("wide", 4), ("wide", 8))
SW_SHAPES = {"qwenimage21_1024": (4224, 12288), "qwenimage21_2048": (16512, 12288)}
SW_UNROLLS = (1, 2, 4)


def _us(fn: Any, warmup_s: float) -> float:
    t = time.perf_counter()
    while time.perf_counter() - t < warmup_s:
        fn()
    torch.cuda.synchronize()
    return H.time_graph(fn, warmup=5, reps=30)[0] * 1e3


def _copy_us(nbytes: int, warmup_s: float) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return _us(lambda: dst.copy_(src), warmup_s)


def _same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want))


def qk_norm_rope(a: Any, R: H.Results, gen: torch.Generator) -> None:
    saved = qkr.ROWS_PER_WARP, qkr.WIDE
    default = f"{'wide' if qkr.WIDE else 'narrow'} {qkr.ROWS_PER_WARP}"
    try:
        for name, (L, H_) in QK_SHAPES.items():
            q = torch.randn(1, L, H_, 128, device="cuda", generator=gen).bfloat16()
            k = torch.randn(1, L, H_, 128, device="cuda", generator=gen).bfloat16() * 3
            wq = (torch.rand(128, device="cuda", generator=gen) + 0.5).bfloat16()
            wk = (torch.rand(128, device="cuda", generator=gen) + 0.5).bfloat16()
            ang = torch.rand(L, 64, device="cuda", generator=gen) * 6.3
            f = torch.polar(torch.ones_like(ang), ang)
            want = [qkr.qk_norm_rope_reference(q, wq, f), qkr.qk_norm_rope_reference(k, wk, f)]
            nbytes = 4 * q.numel() * q.element_size()
            copy_us = _copy_us(nbytes, a.warmup_s)
            row: dict[str, Any] = {"rows": 2 * L * H_, "bytes": nbytes, "copy_us": round(copy_us, 2), "variants": {}}
            outs = {}
            for form, rpw in QK_VARIANTS:
                qkr.WIDE, qkr.ROWS_PER_WARP = form == "wide", rpw
                call = lambda: qkr.launch((q, k), (wq, wk), (f, f), (1e-6, 1e-6))  # noqa: E731
                got = outs[f"{form} {rpw}"] = call()
                us = _us(call, a.warmup_s)
                row["variants"][f"{form} {rpw}"] = {"us": round(us, 2), "of_copy": round(copy_us / us, 3),
                                                    "bit_identical_to_eager": _same(got, want)}
                H.log(f"qk_norm_rope {name} {form} RPW {rpw}: {us:.1f} us ({copy_us / us:.0%} of copy)")
            for v, r in row["variants"].items():
                r["bit_identical_to_default"] = _same(outs[v], outs[default])
            R.put(f"qk_norm_rope.{name}", row)
            R.write()
    finally:
        qkr.ROWS_PER_WARP, qkr.WIDE = saved
    R.put("qk_norm_rope_default", default)


def swiglu(a: Any, R: H.Results, gen: torch.Generator) -> None:
    saved = sw.UNROLL
    amax = torch.tensor([7.5], device="cuda")
    try:
        for name, (rows, cols) in SW_SHAPES.items():
            x = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16() * 2
            y = torch.randn(rows, cols, device="cuda", generator=gen).bfloat16()
            want = sw.swiglu_reference(x, y)
            want_codes = sw.swiglu_fp8_reference(x, y, amax)[0]
            for form in ("bf16", "fp8_codes"):
                nbytes = x.numel() * (3 * x.element_size() if form == "bf16" else 2 * x.element_size() + 1)
                copy_us = _copy_us(nbytes, a.warmup_s)
                row: dict[str, Any] = {"bytes": nbytes, "copy_us": round(copy_us, 2), "variants": {}}
                outs = {}
                for unroll in SW_UNROLLS:
                    sw.UNROLL = unroll
                    if form == "bf16":
                        call = lambda: sw.launch(x, y)[0]  # noqa: E731
                    else:
                        call = lambda: sw.launch(x, y, out=False, fp8_amax=amax)[1]  # noqa: E731
                    got = outs[unroll] = call()
                    us = _us(call, a.warmup_s)
                    row["variants"][str(unroll)] = {
                        "us": round(us, 2), "of_copy": round(copy_us / us, 3),
                        "bit_identical_to_eager": _same([got], [want if form == "bf16" else want_codes])}
                    H.log(f"swiglu {name} {form} UNROLL {unroll}: {us:.1f} us ({copy_us / us:.0%} of copy)")
                for u, r in row["variants"].items():
                    r["bit_identical_to_default"] = _same([outs[int(u)]], [outs[saved]])
                R.put(f"swiglu.{name}_{form}", row)
                R.write()
    finally:
        sw.UNROLL = saved
    R.put("swiglu_default_unroll", saved)


def _markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("Streaming kernels against the copy rate (issue 21)", d,
                      "one call per CUDA-graph replay, median of 30 after a steady warm-up; of copy = a copy_ of the "
                      "same bytes / the kernel's time; exact = bit-identical to eager and to the default variant")
    for op, variants in (("qk_norm_rope", [f"{f} {r}" for f, r in QK_VARIANTS]),
                         ("swiglu", [str(u) for u in SW_UNROLLS])):
        rows = []
        for shape, row in (d.get(op) or {}).items():
            cells = []
            for v in variants:
                r = row["variants"].get(v) or {}
                exact = r.get("bit_identical_to_eager") and r.get("bit_identical_to_default")
                cells.append(f"{r.get('us')} ({H.fmt(100 * (r.get('of_copy') or 0), 0)}%)"
                             f"{'' if exact else ' NOT EXACT'}")
            rows.append([shape, row["bytes"], row["copy_us"], *cells])
        head = "RPW" if op == "qk_norm_rope" else "UNROLL"
        lines += ["", f"### {op} (default: {d.get(op + '_default') or d.get(op + '_default_unroll')})", "",
                  *H.md_table(["shape", "bytes", "copy us", *(f"{head} {v} us (of copy)" for v in variants)], rows)]
    return H.md_document(lines, d)


def main() -> int:
    ap = H.parser(__doc__)
    H.add_steady_warmup_arg(ap)
    a = H.finish_args(ap, ap.parse_args(), tiny_prefix="bench_stream_kernels")
    a.warmup_s = H.steady_warmup_s(a) / 3  # per variant: a second keeps the clocks where the last one left them
    if a.device.type != "cuda":
        ap.error("this benchmark times CUDA kernels: it needs a GPU")
    why = kernel_runtime_reasons(a.device)
    if why:
        ap.error(f"the kernels cannot run here: {why}")
    b = H.Bench(a)
    R = H.Results(a.out, "bench_stream_kernels", {**H.head("benchmarks/bench_stream_kernels.py", b.env, {}),
                                                  "variance_order": qkr.probe_variance_order(a.device).detail},
                  _markdown)
    gen = torch.Generator(device="cuda").manual_seed(a.seed)
    steps = H.Steps([R], a.budget_s)
    steps("qk_norm_rope", lambda: qk_norm_rope(a, R, gen))
    steps("swiglu", lambda: swiglu(a, R, gen))
    exact = all(r.get("bit_identical_to_eager") and r.get("bit_identical_to_default")
                for op in ("qk_norm_rope", "swiglu") for row in (R.get(op) or {}).values()
                for r in row["variants"].values())
    R.put("all_exact", exact)
    R.write()
    return 0 if exact and not steps.failed else 1


if __name__ == "__main__":
    sys.exit(main())
