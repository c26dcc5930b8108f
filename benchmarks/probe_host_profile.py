#!/usr/bin/env python
"""Where the host time of an eager (``cuda_graph=False``) patched FP8 call goes (issues 19, 21).

An eager FP8 call is host-bound on the device's hosts (Qwen-Image: ~115 ms wall for ~77 ms of GPU work). This
runs one such call under ``cProfile`` after warm-up, for Qwen-Image (60 layers) and Qwen-Image-2.1 (32 layers),
1024^2, ModelOpt FP8_DEFAULT_CFG, and writes the functions by own time and by cumulative time, with the call's
wall time without the profiler and the number of kernels (``torch.profiler``) beside them.

    python benchmarks/probe_host_profile.py --out benchmarks/results       # ~2 min on the H200
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb import testing as T  # noqa: E402

FAMILIES = ("qwenimage", "qwenimage21")


def _stats(pr: cProfile.Profile, key: str, n: int) -> list[dict[str, Any]]:
    st = pstats.Stats(pr, stream=io.StringIO())
    st.sort_stats(key)
    rows = []
    for func in st.fcn_list[:n]:  # type: ignore[attr-defined]
        cc, nc, tt, ct, _ = st.stats[func]  # type: ignore[attr-defined]
        file, line, name = func
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": nc, "tottime_ms": round(tt * 1e3, 3),
                     "cumtime_ms": round(ct * 1e3, 3)})
    return rows


def profile_family(family: str, a: Any, calls: int = 3) -> dict[str, Any]:
    dev = a.device
    if family == "qwenimage":
        model = H.build_transformer(a.tiny, 4 if a.tiny else 60, dev)
        kw = H.inputs(model, 8 if a.tiny else 64, 8 if a.tiny else 128, dev, torch.bfloat16, seed=1)
    else:
        cfg = dict(T.QWENIMAGE21_TINY_CONFIG) if a.tiny else {"num_layers": 32}
        model = T.random_qwenimage21_transformer(device=dev, **cfg)
        kw = T.qwenimage21_inputs(model, height=8 if a.tiny else 64, width=8 if a.tiny else 64,
                                  text_len=8 if a.tiny else 128, seed=1)
    H.fp8_quantize(model, kw)
    rep = qwen_absorb.patch(model, cuda_graph=False)
    out: dict[str, Any] = {"summary": H.summary(rep)}
    def fn() -> Any:
        return model(**kw)

    r = H.measure(f"{family} fp8 eager", fn, dev, warmup=2, iters=5)
    out["median_ms"], out["wall_median_ms"] = r["median_ms"], r["wall_median_ms"]
    p = r.get("profile") or {}
    out["gpu_busy_ms"], out["kernels"] = p.get("gpu_busy_ms"), p.get("kernels_per_call")
    pr = cProfile.Profile()
    with torch.inference_mode():
        H.sync(dev)
        t0 = time.perf_counter()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        H.sync(dev)
    out["profiled_ms_per_call"] = (time.perf_counter() - t0) * 1e3 / calls
    out["calls_profiled"] = calls
    out["by_tottime"] = _stats(pr, "tottime", 40)
    out["by_cumtime"] = _stats(pr, "cumulative", 40)
    qwen_absorb.unpatch(model)
    del model, kw, rep, fn
    gc.collect()
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    return out


def _markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("Host time of an eager patched FP8 call (cProfile)", d,
                      "1024^2, B = 1, ModelOpt FP8_DEFAULT_CFG, qwen_absorb.patch(model, cuda_graph=False); "
                      "medians of 5 calls; then 3 calls under cProfile (its own overhead included in "
                      "profiled_ms_per_call)")
    for fam in FAMILIES:
        f = d.get(fam)
        if not f:
            continue
        lines += ["", f"## {fam}", "",
                  f"- call: {H.fmt(f.get('median_ms'))} ms (wall {H.fmt(f.get('wall_median_ms'))}), GPU busy "
                  f"{H.fmt(f.get('gpu_busy_ms'))} ms, {f.get('kernels')} kernels; under cProfile "
                  f"{H.fmt(f.get('profiled_ms_per_call'))} ms per call", ""]
        for key, title in (("by_tottime", "own time"), ("by_cumtime", "cumulative time")):
            rows = [[r["function"], r["calls"], r["tottime_ms"], r["cumtime_ms"]] for r in f.get(key, [])[:30]]
            lines += [f"By {title} ({f.get('calls_profiled')} calls):", "",
                      *H.md_table(["function", "calls", "own ms", "cum ms"], rows, 2), ""]
    return H.md_document(lines, d)


def main() -> int:
    ap = H.parser(__doc__, sections=FAMILIES)
    a = H.finish_args(ap, ap.parse_args(), FAMILIES, tiny_prefix="probe_host_profile")
    H.load_modelopt()
    b = H.Bench(a)
    res = H.Results(a.out, "host_profile_h200", H.head("probe_host_profile", b.env, {"tiny": a.tiny}), _markdown)
    steps = H.Steps([res], a.budget_s)
    for fam in a.sections:
        steps(fam, lambda fam=fam: res.put(fam, profile_family(fam, a)))
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
