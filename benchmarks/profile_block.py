"""Where one full-size block's GPU time goes: per-kernel table of one transformer call, by variant.

Builds a ``--num-layers`` (default 2) full-size random transformer at 1024^2 (4096 image + 128 text
tokens, B = 1, bf16), and for each variant (bf16 unpatched, bf16 patched, ModelOpt FP8 fake quant,
FP8 patched with real FP8 GEMMs) profiles one call after warm-up and prints the kernels grouped by
name (count, total us per block), plus the host time of one call. Writes ``--out/profile_block.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import qwen_absorb
from qwen_absorb import testing as T


def kernels(model, inp, layers):
    with torch.inference_mode():
        for _ in range(3):
            model(**inp)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            model(**inp)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) / 5 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(**inp)
            torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name[:90], [0, 0.0])
            r[0] += 1
            r[1] += e.device_time
    total = sum(v[1] for v in rows.values())
    top = sorted(rows.items(), key=lambda kv: -kv[1][1])[:30]
    return {"wall_ms": wall_ms, "gpu_busy_ms": total / 1e3, "kernels": sum(v[0] for v in rows.values()),
            "top_per_block": [(name, n / layers, round(us / layers, 1)) for name, (n, us) in top]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    model = T.full_size_transformer(num_layers=args.num_layers, dtype=torch.bfloat16, device="cuda")
    inp = T.transformer_inputs(model, batch_size=1, height=64, width=64, text_len=128, masked_tail=0,
                               device="cuda", dtype=torch.bfloat16)
    res = {}
    res["bf16_unpatched"] = kernels(model, inp, args.num_layers)
    qwen_absorb.patch(model)
    res["bf16_patched"] = kernels(model, inp, args.num_layers)
    qwen_absorb.unpatch(model)
    T.fp8_quantize(model, [inp])
    res["fp8_fake"] = kernels(model, inp, args.num_layers)
    report = qwen_absorb.patch(model, fp8_gemm=True)
    res["fp8_real"] = kernels(model, inp, args.num_layers)
    res["fp8_real_summary"] = report.summary
    qwen_absorb.patch(model, fp8_gemm=True, use_fast_accum=True)
    res["fp8_real_fast_accum"] = kernels(model, inp, args.num_layers)
    for k, v in res.items():
        if "top_per_block" in v:
            print(f"== {k}: wall {v['wall_ms']:.2f} ms, GPU busy {v['gpu_busy_ms']:.2f} ms, "
                  f"{v['kernels'] / args.num_layers:.0f} kernels per block (incl. outside blocks)")
            for name, n, us in v["top_per_block"][:18]:
                print(f"   {us:9.1f} us  x{n:5.1f}  {name}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_block.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
