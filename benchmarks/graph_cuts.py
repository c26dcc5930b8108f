#!/usr/bin/env python
"""Whole-call CUDA graphs cut at block entries (``qwen_absorb.cuda_graph.settings.BLOCKS_PER_GRAPH``) against one
graph, on the 60-layer model, bf16 and ModelOpt FP8, in one process.

A replay of one graph of the whole call left the GPU idle while the host got to the launch (the speed benchmark:
~4.9 ms before the FP8 call's GPU work started). Cutting the capture into consecutive graphs lets the GPU run the
first part while the host launches the others. For BLOCKS_PER_GRAPH in 0 (one graph), 8 (the default) and 4:
``qwen_absorb.patch(model)`` (defaults: graphs), the median of 7 calls after warm-up (CUDA events around one
synchronized call), GPU busy of one profiled call, and the runner's host time per replay (up to the launch, the
launch alone). bf16 eager unpatched is measured in the same run for the ratios.

    python benchmarks/graph_cuts.py --out benchmarks/results     # H200: ~2 min (FP8 calibration included)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb.cuda_graph import settings  # noqa: E402

CUTS = (0, 8, 4)


def markdown(d: dict[str, Any]) -> str:
    rows = [[k, v.get("ms"), v.get("gpu_busy_ms"), v.get("idle_ms"), str(v.get("graph_parts")),
             v.get("host_us_per_replay"), v.get("launch_us_per_replay")]
            for k, v in d.items() if isinstance(v, dict) and "ms" in v]
    lines = H.md_head("Whole-call CUDA graphs cut at block entries (issue 19)", d,
                      f"{d['config'].get('num_layers')} layers, 1024^2, B = 1; qwen_absorb.patch(model) defaults with "
                      "settings.BLOCKS_PER_GRAPH set per row; median of 7 after 3 warm-up; idle = ms - GPU busy")
    lines += ["", *H.md_table(["case", "ms", "GPU busy ms", "idle ms", "graph parts", "host us before launch end",
                               "of it: launch us"], rows)]
    return H.md_document(lines, d)


def _case(R: H.Results, key: str, model: torch.nn.Module, kw: dict, dev: torch.device, cut: int | None) -> None:
    qwen_absorb.unpatch(model)
    rep = None
    if cut is not None:
        settings.BLOCKS_PER_GRAPH = cut
        rep = qwen_absorb.patch(model)
    r = H.measure(key, lambda: model(**kw)[0], dev, 3, 7)
    b, _ = H.busy(r)
    cg = (rep.cuda_graph or {}) if rep is not None else {}
    R.put(key, {"ms": round(r["median_ms"], 3), "wall_ms": round(r["wall_median_ms"], 3),
                "gpu_busy_ms": b and round(b, 3), "idle_ms": b and round(r["median_ms"] - b, 3),
                **{k: cg.get(k) for k in ("graph_parts", "host_us_per_replay", "launch_us_per_replay",
                                          "overlapped_check_us_per_replay", "replays", "captures", "capture_ms")}})
    R.write()
    qwen_absorb.unpatch(model)


def main() -> int:
    p = H.parser(__doc__, (), budget_s=0.0, description=__doc__.split("\n\n")[0])
    H.add_model_args(p, (60, 2), (64, 8))
    a = H.finish_args(p, p.parse_args(), (), "graph_cuts")
    H.resolve_model_args(a, (60, 2), (64, 8))
    dev = a.device
    H.load_modelopt()
    R = H.Results(a.out, "graph_cuts", H.head("benchmarks/graph_cuts.py (issue 19)", H.environment(dev),
                                              {**vars(a), "device": str(dev), "out": str(a.out)}), markdown)
    model = H.build_transformer(a.tiny, a.num_layers, dev, torch.bfloat16, a.seed)
    kw = H.as_dtype(H.inputs(model, a.side, a.text_tokens, dev, torch.float32, a.seed + 1), torch.bfloat16)
    _case(R, "bf16_eager", model, kw, dev, None)
    for c in CUTS:
        _case(R, f"bf16_graph_cut{c}", model, kw, dev, c)
    H.fp8_quantize(model, kw)
    for c in CUTS:
        _case(R, f"fp8_graph_cut{c}", model, kw, dev, c)
    settings.BLOCKS_PER_GRAPH = 8
    R.write()
    H.log(f"wrote {R.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
