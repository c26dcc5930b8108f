#!/usr/bin/env python
"""Host cost of the CUDA-graph runner's per-call fingerprint halves (issue 19): ``Scan.moved()`` (asked before a
replay is launched) and ``Scan.stale()`` (while the GPU runs it; it also compares the identities of forwards,
processors and plans, ``identities_us`` alone), with the plans' derived-only sources
(``plan.derived_only_sources``) checked after the launch, as the library does, and all checked before it (the
sources made an empty list: the previous split), side by side in one process.

Host metadata only, so it runs anywhere: a 60-block random Qwen-Image transformer of tiny width on the CPU,
ModelOpt FP8_DEFAULT_CFG, patched through the real-FP8 decision path (``fp8_gemm=True, capabilities={"cpu"}``):
the same ~3,900 tensors and ~20,000 quantizer switches as the full-size model. Medians of ``--reps`` timings
of ``--calls`` checks each.

    python benchmarks/probe_scan_cost.py --out benchmarks/results      # ~1 min
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb import testing as T  # noqa: E402
from qwen_absorb.cuda_graph import fingerprint as F  # noqa: E402

SPLITS = ("sources_after_launch", "all_before_launch")


def _median_us(fn: Any, calls: int, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) / calls * 1e6)
    return round(statistics.median(times), 1)


def measure(a: Any, R: H.Results) -> None:
    model = T.tiny_transformer(torch.bfloat16, num_layers=a.layers, seed=a.seed)
    kw = T.transformer_inputs(model, seed=a.seed + 1)
    with H.quiet():
        T.fp8_quantize(model, [kw])
    rep = qwen_absorb.patch(model, fp8_gemm=True, capabilities={"cpu"}, cuda_graph=False)
    R.put("fp8_gemm_linears", rep.summary["fp8_gemm_linears"])
    for split in SPLITS:
        saved = F.derived_only_sources
        if split == "all_before_launch":
            F.derived_only_sources = lambda plan, block: []  # type: ignore[assignment]
        try:
            scan = F.Scan(model)
        finally:
            F.derived_only_sources = saved
        assert scan.changed() is None
        ident = lambda: list(map(id, map(dict.get, scan.ident_dicts, scan.ident_keys))) != scan.watch_ids  # noqa: E731
        R.put(split, {"tensors_before_launch": len(scan.tensors), "tensors_after_launch": len(scan.stensors),
                      "moved_us": _median_us(scan.moved, a.calls, a.reps),
                      "stale_us": _median_us(scan.stale, a.calls, a.reps),
                      "identities": len(scan.ident_keys), "identities_us": _median_us(ident, a.calls, a.reps),
                      "generations": len(scan.owners)})
        H.log(f"{split}: {R.get(split)}")


def _markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("Host cost of the graph runner's fingerprint halves (issue 19)", d,
                      f"{(d.get('config') or {}).get('layers')}-block tiny-width Qwen-Image, ModelOpt FP8, real-FP8 "
                      f"decisions on the CPU ({d.get('fp8_gemm_linears')} FP8-GEMM linears); medians of "
                      f"{(d.get('config') or {}).get('reps')} x {(d.get('config') or {}).get('calls')} checks; "
                      "moved() runs before a replay's launch (tensor addresses, generations), stale() after it (the "
                      "identity comparison of forwards, processors and plans among the rest; identities_us: that "
                      "comparison alone, in moved() before 2026-12-02 06:30)")
    cols = ["tensors_before_launch", "tensors_after_launch", "moved_us", "stale_us", "identities", "identities_us",
            "generations"]
    lines += ["", *H.md_table(["split", *cols], [[s, *((d.get(s) or {}).get(c) for c in cols)] for s in SPLITS])]
    return H.md_document(lines, d)


def main() -> int:
    ap = H.parser(__doc__)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    a.device = a.device or "cpu"  # host metadata only: no GPU needed
    a = H.finish_args(ap, a, tiny_prefix="probe_scan_cost")
    H.load_modelopt()
    b = H.Bench(a)
    R = H.Results(a.out, "scan_cost", H.head("probe_scan_cost", b.env, {"layers": a.layers, "calls": a.calls,
                                                                       "reps": a.reps}), _markdown)
    steps = H.Steps([R], a.budget_s)
    steps("measure", lambda: measure(a, R))
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
