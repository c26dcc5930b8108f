#!/usr/bin/env python
"""Where a default (graph-mode) patched call leaves the GPU idle (issue 19's wall <= 1.05x GPU busy).

A synchronized call of ``qwen_absorb.patch(model)`` (``cuda_graph="auto"``) replays one CUDA graph. Its wall time
is the graph's kernels, the gaps between them, and the host work before the replay starts (the runner's checks,
the static input copies) and after it ends. This times, per call, with CUDA events recorded by the runner's own
launch (so that host time before the launch shows as GPU time from the call's start event):

- ``pre_launch_ms``: call start -> the runner's launch begins (host only: argument reading, ``Scan.moved``);
- ``copies_ms``: the static input copies; ``replay_host_ms``: ``CUDAGraph.replay()`` on the host;
- ``call_ms``: the whole call; ``moved_us`` / ``stale_us``: the two halves of the fingerprint, timed alone.

Cases: bf16 and ModelOpt FP8, 60 layers, 1024^2, B = 1; each as the library runs it and with ``Scan.moved`` /
``Scan.stale`` replaced by no-ops (what the checks cost the wall; those variants serve stale results and exist
only here). Medians of ``--iters`` calls after a 3 s warm-up.

    python benchmarks/probe_graph_idle.py --out benchmarks/results     # H200: ~2 min
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb import taylorseer  # noqa: E402
from qwen_absorb.cuda_graph import fingerprint as F  # noqa: E402

SECTIONS = ("bf16", "fp8")
VARIANTS = ("library", "no_moved", "no_stale", "no_checks")


def _ev() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def time_variant(model: torch.nn.Module, kw: dict[str, Any], variant: str, iters: int, warmup_s: float
                 ) -> dict[str, Any]:
    runner = model.__dict__["forward"]
    cls = type(runner)  # slotted: the launch is replaced on the class for the timed calls
    launch = cls._launch
    marks: dict[str, Any] = {}

    def timed_launch(self: Any, entry: Any, call: Any) -> None:
        marks["launch"] = e = _ev()
        e.record()
        marks["t_launch"] = time.perf_counter()
        for s, x in zip(entry.statics, call.tensors):
            s.copy_(x)
        marks["copied"] = e = _ev()
        e.record()
        t = time.perf_counter()
        entry.graph.replay()
        marks["replay_host_ms"] = (time.perf_counter() - t) * 1e3
        taylorseer.replayed()

    saved = F.Scan.moved, F.Scan.stale
    if variant in ("no_moved", "no_checks"):
        F.Scan.moved = lambda self: None  # type: ignore[method-assign]
    if variant in ("no_stale", "no_checks"):
        F.Scan.stale = lambda self: None  # type: ignore[method-assign]
    cls._launch = timed_launch
    rows: list[dict[str, float]] = []
    try:
        with torch.inference_mode():
            t_end = time.perf_counter() + warmup_s
            while time.perf_counter() < t_end:
                model(**kw)
            torch.cuda.synchronize()
            for _ in range(iters):
                marks.clear()
                s, e = _ev(), _ev()
                t0 = time.perf_counter()
                s.record()
                model(**kw)
                e.record()
                e.synchronize()
                if "launch" not in marks:
                    raise RuntimeError("the call did not replay a graph")
                rows.append({"call_ms": s.elapsed_time(e), "pre_launch_ms": s.elapsed_time(marks["launch"]),
                             "pre_launch_host_ms": (marks["t_launch"] - t0) * 1e3,
                             "copies_ms": marks["launch"].elapsed_time(marks["copied"]),
                             "replay_host_ms": marks["replay_host_ms"]})
            prof, why = H.profile_call(lambda: model(**kw), torch.device("cuda"))  # a graph call: no grad
    finally:
        F.Scan.moved, F.Scan.stale = saved
        cls._launch = launch
    out = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    scan = runner._scan
    for name, fn in (("moved_us", scan.moved), ("stale_us", scan.stale)):
        t = time.perf_counter()
        for _ in range(20):
            fn()
        out[name] = round((time.perf_counter() - t) / 20 * 1e6, 1)
    out["tensors_checked"] = len(scan.tensors)
    out["tensors_checked_after_launch"] = len(scan.stensors)
    # the pointer comparison alone, torch's C++ helper against a Python map over the same tensors
    ptrs, idx, tensors = scan.ptrs, scan.indices, scan.tensors
    for name, fn in (("ptrs_cpp_us", lambda: F._ptrs_equal(tensors, ptrs, idx)),
                     ("ptrs_py_us", lambda: list(map(F._data_ptr, tensors)) == ptrs)):
        if name == "ptrs_cpp_us" and F._ptrs_equal is None:
            continue
        t = time.perf_counter()
        for _ in range(20):
            fn()
        out[name] = round((time.perf_counter() - t) / 20 * 1e6, 1)
    out["replays"] = runner.replays
    out["gpu_busy_ms"] = prof and round(prof["gpu_busy_ms"], 4)
    out["idle"], out["profile_skipped"] = prof and prof.get("idle"), why
    return out


def section(name: str, a: Any, R: H.Results) -> None:
    dev = a.device
    model = H.build_transformer(a.tiny, 2 if a.tiny else 60, dev)
    kw = H.inputs(model, 8 if a.tiny else 64, 8 if a.tiny else 128, dev, torch.bfloat16, seed=1)
    if name == "fp8":
        H.fp8_quantize(model, kw)
    qwen_absorb.patch(model)
    with torch.inference_mode():
        for _ in range(3):
            model(**kw)
    for v in a.variants.split(","):
        r = time_variant(model, kw, v, a.iters, a.warmup_s)
        R.put(f"{name}.{v}", r)
        H.log(f"{name} {v}: {r}")
    qwen_absorb.unpatch(model)


def _markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("Where a default graph-mode call idles the GPU (issue 19)", d,
                      "60 layers, 1024^2, B = 1, qwen_absorb.patch(model) defaults (one CUDA graph replay per call); "
                      "CUDA events from the call's start to the runner's launch; medians after a steady warm-up; "
                      "no_moved / no_stale: the runner's checks replaced by no-ops (a measurement only)")
    cols = ["call_ms", "gpu_busy_ms", "pre_launch_ms", "pre_launch_host_ms", "copies_ms", "replay_host_ms",
            "moved_us", "stale_us", "tensors_checked", "tensors_checked_after_launch", "ptrs_cpp_us", "ptrs_py_us"]
    rows = []
    for sec in SECTIONS:
        for v in VARIANTS:
            r = (d.get(sec) or {}).get(v)
            if r:
                idle = r.get("idle") or {}
                rows.append([f"{sec} {v}", *(r.get(c) for c in cols), idle.get("idle_in_span_ms"),
                             idle.get("idle_outside_span_ms")])
    lines += ["", *H.md_table(["case", *cols, "profiled idle in span", "outside span"], rows)]
    return H.md_document(lines, d)


def main() -> int:
    ap = H.parser(__doc__, sections=SECTIONS)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--warmup-s", type=float, default=3.0)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    a = H.finish_args(ap, ap.parse_args(), SECTIONS, tiny_prefix="probe_graph_idle")
    if a.device.type != "cuda":
        H.log("probe_graph_idle needs CUDA (it times CUDA graph replays)")
        return 3
    H.load_modelopt()
    b = H.Bench(a)
    R = H.Results(a.out, "graph_idle_h200", H.head("probe_graph_idle", b.env, {"iters": a.iters,
                                                                                "warmup_s": a.warmup_s}), _markdown)
    steps = H.Steps([R], a.budget_s)
    for sec in a.sections:
        steps(sec, lambda sec=sec: section(sec, a, R))
        gc.collect()  # the section's model (a reference cycle through its graph runner) before the next one
        torch.cuda.empty_cache()
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
