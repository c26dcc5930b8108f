#!/usr/bin/env python
"""The host's share of a model-offload return, on the CPU (issue 39 C): 60 tiny ModelOpt FP8 blocks (the full
model's module structure at tiny widths), the GPU faked as in ``tests/test_fp8_memory.py``. One round trip: the
departure and return moves (``Module._apply``, new storages as accelerate's ``.to`` makes) and the first call
back, with the blocks keeping their decisions across the moves (the default) against deciding anew
(``Tuning(move_keeps_decisions=False)``); under ``torch.no_grad`` (diffusers' ``__call__``) and under
``torch.inference_mode`` (moved tensors without version counters: the watches fingerprint them). Return overhead =
away + back + first call - the next call. Both arms in one process, interleaved, medians of 5 after one.

    python benchmarks/offload_host_cpu.py --out benchmarks/results/journey   # ~2 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import qwen_absorb  # noqa: E402
from qwen_absorb import host_originals as H  # noqa: E402
from tests import builders as T  # noqa: E402

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}, "cuda_graph": False}


def trip(m, kw, mode) -> tuple[list[float], torch.Tensor]:
    real = H._destination
    H._destination = lambda block, fn: (torch.device("meta"), True)  # the departure, announced as a device move
    ts = [time.perf_counter()]
    with mode():
        m._apply(lambda t: t.clone())
    H._destination = real
    ts.append(time.perf_counter())
    with mode():
        m._apply(lambda t: t.clone())
    ts.append(time.perf_counter())
    out = T.run_transformer(m, kw)
    ts.append(time.perf_counter())
    T.run_transformer(m, kw)
    ts.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(ts, ts[1:])], out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/journey")
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    H.ACCELERATOR_TYPES = ("cpu", "meta")
    model = T.tiny_transformer(dtype=torch.bfloat16, num_layers=60, seed=0)
    kw = T.transformer_inputs(model, seed=1)
    T.fp8_quantize(model, [kw, T.transformer_inputs(model, seed=2)])
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL, tuning=qwen_absorb.Tuning(move_keeps_decisions=False))
    res: dict = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "threads": torch.get_num_threads(), "blocks": 60, "runs": a.runs}
    for mode_name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        rows: dict[str, list[list[float]]] = {"keep": [], "redecide": []}
        for i in range(a.runs + 1):
            outs = {}
            for arm, m in (("keep", model), ("redecide", twin)):
                ms, outs[arm] = trip(m, kw, mode)
                if i:
                    rows[arm].append(ms)
            assert torch.equal(outs["keep"], outs["redecide"])
        for arm, r in rows.items():
            med = [round(statistics.median(x[j] for x in r), 1) for j in range(4)]
            res[f"{mode_name}.{arm}"] = {"away_ms": med[0], "back_ms": med[1], "first_call_ms": med[2],
                                         "next_call_ms": med[3], "return_overhead_ms": round(sum(med[:3]) - med[3], 1)}
            print(mode_name, arm, res[f"{mode_name}.{arm}"])
    out = Path(a.out) / "offload_host_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
