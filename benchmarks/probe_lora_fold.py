#!/usr/bin/env python
"""net[0]'s GELU quantization with net[2]'s lora_A product folded in (``ops.lora_fold``) against the two steps it
replaces (issue 18), at the FeedForward's shapes, rank 64, bf16.

Per call (us, the median of 30 replays of a CUDA graph holding 10 calls; no host cost):

- ``two steps``: ``lora_add.add_gelu_fp8(..., act_out=True)`` (codes and the GELU output g written) then
  ``F.linear(g, A2)`` (net[2]'s lora_A product reads g back), what the FP8 path ran before the fold;
- ``gelu kernel alone``: the first step only; ``lora_A GEMM alone``: the second only;
- ``fold``: ``lora_fold.add_gelu_fp8_fold`` (the fold kernel and the partial-sum kernel);
- ``fold TB/s``: what the fold moves (y read, codes written) over its time.

    python benchmarks/probe_lora_fold.py --out benchmarks/results       # ~10 s on the H200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

from qwen_absorb.ops import lora_add, lora_fold  # noqa: E402

RANK = 64
SHAPES = [(4096, 12288), (128, 12288), (16384, 12288)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args()
    dev = "cuda"
    if not torch.cuda.is_available():
        print("probe_lora_fold.py needs CUDA; nothing written")
        return 3
    env = H.environment(dev)
    res = {**H.head("benchmarks/probe_lora_fold.py", env, {"rank": RANK, "shapes": SHAPES}), "us": {}}
    gen = torch.Generator(device=dev).manual_seed(0)
    lora_fold.size_reasons = lambda m, sms: []  # every size timed: the rule that keeps the text stream's off is this
    amax = torch.tensor([4.0], device=dev)
    rows = []
    for m, n in SHAPES:
        y = torch.randn(m, n, generator=gen, device=dev).bfloat16()
        t = torch.randn(m, RANK, generator=gen, device=dev).bfloat16()
        b = (torch.randn(n, RANK, generator=gen, device=dev) * 0.02).bfloat16()
        a2 = (torch.randn(RANK, n, generator=gen, device=dev) * n ** -0.5).bfloat16()
        why = lora_fold.reasons(y, t, b, a2)
        if why:
            raise RuntimeError(f"the fold refuses {m}x{n}: {why}")
        _, g = lora_add.add_gelu_fp8(y, t, b, 0.5, amax, True)
        r = res["us"][f"{m}x{n}"] = {
            "two steps": H.graph_us_per_call(
                lambda: torch.nn.functional.linear(lora_add.add_gelu_fp8(y, t, b, 0.5, amax, True)[1], a2)),
            "gelu kernel alone": H.graph_us_per_call(lambda: lora_add.add_gelu_fp8(y, t, b, 0.5, amax, True)),
            "lora_A GEMM alone": H.graph_us_per_call(lambda: torch.nn.functional.linear(g, a2)),
            "fold": H.graph_us_per_call(lambda: lora_fold.add_gelu_fp8_fold(y, t, b, 0.5, amax, a2)),
        }
        r["fold TB/s"] = round(3 * m * n / (r["fold"] * 1e-6) / 1e12, 2)
        r["segments"] = lora_fold.segments_for(m, n, y.device)
        rows.append([f"{m}x{n}", *r.values()])
        H.log(f"{m}x{n}: {r}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    H.write_atomic(out / "probe_lora_fold.json", json.dumps(H.json_safe(res), indent=1))
    lines = H.md_head("net[2]'s lora_A product folded into net[0]'s GELU quantization", res,
                      "us per call, the median of 30 replays of a CUDA graph holding 10 calls; rank 64, bf16")
    lines += ["", *H.md_table(["shape", *next(iter(res["us"].values()))], rows, 2)]
    H.write_atomic(out / "probe_lora_fold.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
