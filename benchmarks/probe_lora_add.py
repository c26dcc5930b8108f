#!/usr/bin/env python
"""The LoRA branch add, kernel against cuBLAS (issue 18): ``ops.lora_add`` against ``addmm_`` at a block's shapes.

Per call (us, the median of 30 replays of a CUDA graph holding 10 calls; no host cost), rank 64, bf16; columns:

- ``cuBLAS / row kernel``: ``add`` is ``y.addmm_(t, B.T, alpha=s)``, ``add_gelu_fp8`` is ``addmm_`` then the GELU +
  e4m3 quantization kernel (``gelu alone``: that kernel without the branch), ``qkv grouped add`` six ``addmm_``
  (q/k/v of the image and text streams); ``copy``: ``y.copy_`` of the same size (the rate to reach);
- ``rows kernel``: ``ops.lora_add`` with ``lora_add.TILES = False`` (lora_add_kernel);
- ``tiles R x S x B``: the tiled kernel (lora_add_tiles.cu) with R rows per tile, S ring stages, B blocks per SM
  (``lora_add.configure_tiles``); TB/s: the traffic the op moves (read + write; + codes and GELU output).

    python benchmarks/probe_lora_add.py --out benchmarks/results       # ~30 s on the H200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

from qwen_absorb.ops import lora_add  # noqa: E402
from qwen_absorb.ops.quantize_fp8 import launch as qf8_launch  # noqa: E402

RANK = 64
SHAPES = [(4096, 3072), (4096, 12288), (128, 3072), (128, 12288)]


def _ops(m: int, n: int, gen: torch.Generator, dev: str) -> tuple:
    y = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    t = torch.randn(m, RANK, generator=gen, device=dev).bfloat16()
    b = (torch.randn(n, RANK, generator=gen, device=dev) * 0.02).bfloat16()
    return y, t, b


def _tile_configs(text: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in c.split(",")) for c in text.split(";") if c.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tiles", type=_tile_configs, default=_tile_configs("64,3,2;32,3,3;32,2,4"),
                    help="tile geometries of the tiled kernel: 'rows,stages,min_blocks;...'")
    a = ap.parse_args()
    dev = "cuda"
    if not torch.cuda.is_available():
        print("probe_lora_add.py needs CUDA (the kernel and cuBLAS's addmm_ on a GPU); nothing written")
        return 3
    env = H.environment(dev)
    res = {**H.head("benchmarks/probe_lora_add.py", env, {"rank": RANK, "shapes": SHAPES}), "us": {}}
    gen = torch.Generator(device=dev).manual_seed(0)
    amax = torch.tensor([4.0], device=dev)
    ref = res["us"]["cuBLAS / row kernel"] = {}
    ops = {(m, n): _ops(m, n, gen, dev) for m, n in SHAPES}
    probs = [(*_ops(m, 3072, gen, dev), 0.5) for m in (4096,) * 3 + (128,) * 3]
    for m, n in SHAPES:
        y, t, b = ops[(m, n)]
        src = torch.empty_like(y)
        ref[f"{m}x{n} copy"] = H.graph_us_per_call(lambda: y.copy_(src))
        k = ref[f"{m}x{n} add"] = H.graph_us_per_call(lambda: y.addmm_(t, b.t(), alpha=0.5))
        ref[f"{m}x{n} add TB/s"] = round(4 * m * n / (k * 1e-6) / 1e12, 2)
        k = ref[f"{m}x{n} add_gelu_fp8"] = H.graph_us_per_call(
            lambda: qf8_launch(y.addmm_(t, b.t(), alpha=0.5).unsqueeze(0), 0, None, amax, "gelu_tanh", True))
        ref[f"{m}x{n} add_gelu_fp8 TB/s"] = round(5 * m * n / (k * 1e-6) / 1e12, 2)
        ref[f"{m}x{n} gelu alone"] = H.graph_us_per_call(
            lambda: qf8_launch(y.unsqueeze(0), 0, None, amax, "gelu_tanh", True))
    ref["qkv grouped add"] = H.graph_us_per_call(lambda: [y.addmm_(t, b.t(), alpha=s) for y, t, b, s in probs])
    configs = [("rows kernel", None)] + [(f"tiles {r}x{st}x{mb}", (r, st, mb)) for r, st, mb in a.tiles]
    for label, geometry in configs:
        lora_add.TILES = geometry is not None
        if geometry:
            lora_add.configure_tiles(*geometry)
        row = res["us"][label] = {}
        for m, n in SHAPES:
            y, t, b = ops[(m, n)]
            row[f"{m}x{n} copy"] = ref[f"{m}x{n} copy"]
            k = row[f"{m}x{n} add"] = H.graph_us_per_call(lambda: lora_add.add_([(y, t, b, 0.5)]))
            row[f"{m}x{n} add TB/s"] = round(4 * m * n / (k * 1e-6) / 1e12, 2)
            k = row[f"{m}x{n} add_gelu_fp8"] = H.graph_us_per_call(
                lambda: lora_add.add_gelu_fp8(y, t, b, 0.5, amax, True))
            row[f"{m}x{n} add_gelu_fp8 TB/s"] = round(5 * m * n / (k * 1e-6) / 1e12, 2)
            row[f"{m}x{n} gelu alone"] = ref[f"{m}x{n} gelu alone"]
        row["qkv grouped add"] = H.graph_us_per_call(lambda: lora_add.add_(probs))
        H.log(f"{label}: {row}")
    lora_add.TILES = True
    lora_add.configure_tiles()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_lora_add.json").write_text(json.dumps(H.json_safe(res), indent=1))
    lines = ["# LoRA branch add: ops.lora_add (tiled and row kernels) against addmm_ (us per call, CUDA graph, rank 64, bf16)", "",
             f"- GPU: {env.get('gpu')}, driver {env.get('driver')}; torch {env.get('torch')}, cupy {env.get('cupy')}; "
             f"qwen_absorb {env.get('qwen_absorb_commit')} (dirty: {env.get('git_dirty')}); {env.get('date')}", ""]
    keys = list(next(iter(res["us"].values())))
    lines += H.md_table(["case", *res["us"]], [[k, *(res["us"][c][k] for c in res["us"])] for k in keys], 2)
    (out / "probe_lora_add.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
