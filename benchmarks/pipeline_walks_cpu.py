#!/usr/bin/env python
"""diffusers' per-call module walks against qwen_absorb's (``qwen_absorb/pipeline_walks.py``), host only.

A ``QwenImagePipeline`` built on the meta device at full size (60-layer transformer quantized with ModelOpt's
FP8_DEFAULT_CFG, no calibration: the modules are what matters; the 7B text encoder; the VAE), then
``_execution_device`` and ``maybe_free_model_hooks`` timed in one process: diffusers' own functions, then the
pipeline patched. Medians of ``--runs`` rounds of 10 calls each, ms per call. No GPU needed. Writes
``<out>/pipeline_walks_cpu.json``.

    python benchmarks/pipeline_walks_cpu.py --out benchmarks/results/pipeline
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as H  # noqa: E402
import pipeline_parts as P  # noqa: E402
import torch  # noqa: E402


def per_call_ms(fn, runs: int) -> float:
    fn()
    rounds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        rounds.append((time.perf_counter() - t0) * 100)
    return round(statistics.median(rounds), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=H.RESULTS / "pipeline")
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args(argv)
    import modelopt.torch.quantization as mtq  # noqa: PLC0415
    from diffusers import DiffusionPipeline, QwenImageTransformer2DModel  # noqa: PLC0415

    from qwen_absorb import pipeline_walks  # noqa: PLC0415

    with torch.device("meta"):
        t = QwenImageTransformer2DModel(num_layers=60)
    t = mtq.quantize(t, mtq.FP8_DEFAULT_CFG, forward_loop=None)
    pipe = P.build_pipeline(t, False, torch.device("meta"))
    out = {"benchmark": "benchmarks/pipeline_walks_cpu.py", **H.environment("cpu"), "runs": a.runs,
           "modules": {k: sum(1 for _ in m.modules()) for k, m in pipe.components.items()
                       if isinstance(m, torch.nn.Module)}}
    out["diffusers_ms"] = {"execution_device": per_call_ms(lambda: DiffusionPipeline._execution_device.fget(pipe),
                                                           a.runs),
                           "maybe_free_model_hooks": per_call_ms(lambda: DiffusionPipeline.maybe_free_model_hooks(
                               pipe), a.runs)}
    out["report"] = pipeline_walks.patch(pipe).to_dict()
    assert pipe._execution_device == DiffusionPipeline._execution_device.fget(pipe)
    out["patched_ms"] = {"execution_device": per_call_ms(lambda: pipe._execution_device, a.runs),
                         "maybe_free_model_hooks": per_call_ms(pipe.maybe_free_model_hooks, a.runs)}
    out["per_call_ms"] = {k: round(sum(out[k].values()), 3) for k in ("diffusers_ms", "patched_ms")}
    H.write_atomic(a.out / "pipeline_walks_cpu.json", json.dumps(out, indent=1) + "\n")
    H.log(f"walks: {out['diffusers_ms']} -> {out['patched_ms']} ({out['per_call_ms']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
