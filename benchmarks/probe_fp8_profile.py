#!/usr/bin/env python
"""Where the default FP8 call and the FP8 + LoRA call spend their GPU and host time (issues 18, 19).

One process, 60 layers, 1024^2, ModelOpt FP8_DEFAULT_CFG:

- ``fp8_graph``: ``qwen_absorb.patch(model)`` (defaults: CUDA graphs), ``fp8_eager``: ``cuda_graph=False``,
  ``fp8_lora_graph``: a PEFT LoRA (rank 64, the 12 linears of benchmarks/fp8_lora.py) added and patched again;
- per case: median of 7 synchronized calls, 10 calls back to back, one profiled call with every kernel name
  (count, ms), and the SM clock and power sampled by NVML while 20 calls run back to back (a GPU held at its
  power limit runs the same kernels slower);
- the CUDA-graph runner's host time per replay (``describe()``) and, timed alone, each check it makes before the
  launch (``Call``, ``root_reason``, ``Scan.moved``) and after it (``Scan.stale``).

    python benchmarks/probe_fp8_profile.py --out benchmarks/results       # ~3 min on the H200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
from fp8_lora import lora_config, seed_lora  # noqa: E402

import qwen_absorb  # noqa: E402


def _nvml_sampler(stop: threading.Event, samples: list[tuple[float, float]]) -> None:
    try:
        import pynvml  # noqa: PLC0415
    except ImportError:
        try:
            from cupy.cuda import nvml as pynvml  # type: ignore  # noqa: PLC0415
        except ImportError:
            return
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not stop.is_set():
            samples.append((float(pynvml.nvmlDeviceGetClockInfo(h, 1)),  # NVML_CLOCK_SM
                            pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0))
            time.sleep(0.005)
    except Exception as e:  # noqa: BLE001
        H.log(f"  NVML sampling failed: {type(e).__name__}: {e}")


def clocks_under_load(fn: Any, calls: int = 20) -> dict[str, Any]:
    samples: list[tuple[float, float]] = []
    stop = threading.Event()
    th = threading.Thread(target=_nvml_sampler, args=(stop, samples), daemon=True)
    with torch.inference_mode():
        th.start()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        stop.set()
        th.join()
    if not samples:
        return {"skipped": "no NVML"}
    sm = [s for s, _ in samples]
    pw = [p for _, p in samples]
    return {"sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm), "power_w_median": statistics.median(pw),
            "power_w_max": max(pw), "samples": len(samples)}


def host_checks(model: torch.nn.Module, kw: dict[str, Any], n: int = 50) -> dict[str, Any]:
    """Each pre-launch / post-launch check of the runner, timed alone (us, median of ``n``)."""
    from qwen_absorb.cuda_graph import fingerprint, signature  # noqa: PLC0415

    runner = model.__dict__.get("forward")
    scan = getattr(runner, "_scan", None)
    if scan is None:
        return {"skipped": "no runner scan"}
    positional = runner._positional

    def t(fn: Any) -> float:
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t0) * 1e6)
        return round(statistics.median(xs), 1)

    return {
        "call_signature_us": t(lambda: signature.Call((), kw, positional)),
        "root_reason_us": t(lambda: fingerprint.root_reason(model)),
        "moved_us": t(scan.moved),
        "stale_us": t(scan.stale),
        "tensors": len(scan.tensors), "ident_attrs": len(scan.ident_dicts), "plain_dicts": len(scan.plain_dicts),
        "versioned": len(scan.vtensors), "len_dicts": len(scan.len_dicts), "hook_dicts": len(scan.hook_dicts),
        "peft_layers": len(scan.peft_dicts), "owners": len(scan.owners),
        "ptrs_equal_in_cpp": fingerprint._ptrs_equal is not None,
    }


def case(R: H.Results, key: str, model: torch.nn.Module, kw: dict[str, Any], dev: torch.device, rep: Any) -> None:
    torch.cuda.synchronize()
    fn = lambda: model(**kw)[0]  # noqa: E731
    r = H.measure(key, fn, dev, 2, 7, b2b=10, profile=False)
    with torch.inference_mode():  # grad enabled would run (and save) diffusers' forward
        r["profile"], r["profile_skipped"] = H.profile_call(fn, dev, top=0)
    r["clocks"] = clocks_under_load(fn)
    runner = model.__dict__.get("forward")
    if callable(getattr(runner, "describe", None)):
        r["graph_runner"] = runner.describe()
        r["host_checks"] = host_checks(model, kw)
    r["summary"] = H.summary(rep)
    R.d["details"][key] = r
    R.put(f"{key}_ms", round(r["median_ms"], 4))
    R.put(f"{key}_b2b_ms", round(r["b2b_ms"], 4))
    R.put(f"{key}_gpu_busy_ms", *H.busy(r))
    H.log(f"  {key}: b2b {r['b2b_ms']:.3f} ms, clocks {r['clocks']}, host {r.get('host_checks')}")


def copy_stacks(model: torch.nn.Module, kw: dict[str, Any], dev: torch.device) -> list[dict[str, Any]]:
    """The Python stacks of the same-dtype copies (aten::copy_ and what calls it) of one eager call: which
    code launches the small direct_copy kernels of the FP8 call."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with torch.inference_mode():
        fn = lambda: model(**kw)[0]  # noqa: E731
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                     record_shapes=True) as prof:
            fn()
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=12):
        if e.key not in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::to", "aten::cat",
                         "aten::_to_copy", "aten::reshape"):
            continue
        rows.append({"op": e.key, "count": e.count, "shapes": str(e.input_shapes)[:200],
                     "device_us": round(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)), 1),
                     "stack": [s for s in (e.stack or []) if "qwen_absorb" in s or "diffusers" in s][:6]})
    rows.sort(key=lambda r: -r["count"])
    return rows[:25]


def compile_case(R: H.Results, model: torch.nn.Module, kw: dict[str, Any], dev: torch.device) -> None:
    """FP8 patched (defaults) + compile_repeated_blocks(fullgraph=True): the blocks are opaque ops."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    torch._dynamo.reset()
    counters.clear()
    rep = qwen_absorb.patch(model)
    model.compile_repeated_blocks(fullgraph=True)
    case(R, "fp8_graph_compiled", model, kw, dev, rep)
    R.d["details"]["fp8_graph_compiled"]["dynamo"] = H.dynamo_counters()
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    torch._dynamo.reset()


def markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("FP8 call profile: GPU time per kernel, clocks, host checks (issues 18, 19)", d,
                      "60 layers, 1024^2, B = 1, ModelOpt FP8_DEFAULT_CFG; median of 7 synchronized calls after 2 "
                      "warm-up; b2b = 10 calls back to back; one profiled call; NVML samples during 20 calls")
    rows = []
    for k, r in d["details"].items():
        p = r.get("profile") or {}
        c = r.get("clocks") or {}
        rows.append([k, r.get("median_ms"), r.get("b2b_ms"), p.get("gpu_busy_ms"), p.get("kernels_per_call"),
                     c.get("sm_mhz_median"), c.get("power_w_median")])
    lines += H.md_table(["case", "ms", "b2b ms", "GPU busy ms", "kernels", "SM MHz (median)", "power W"], rows)
    for k, r in d["details"].items():
        if r.get("host_checks"):
            lines += ["", f"`{k}` host checks (us): `{r['host_checks']}`",
                      f"runner: host_us_per_replay {r['graph_runner'].get('host_us_per_replay')}, launch_us_per_replay "
                      f"{r['graph_runner'].get('launch_us_per_replay')}, overlapped_check_us_per_replay "
                      f"{r['graph_runner'].get('overlapped_check_us_per_replay')}"]
    if d.get("copy_stacks"):
        lines += ["", "### copies of one eager FP8 call, by launching code", ""]
        lines += [f"- {r['op']} x{r['count']} {r['shapes']} {r['device_us']} us: {' <- '.join(r['stack'][:4])}"
                  for r in d["copy_stacks"]]
    for k, r in d["details"].items():
        p = r.get("profile") or {}
        lines += ["", f"### {k}: kernels by time", ""]
        lines += H.md_table(["kernel", "count", "ms"], [[x["name"][:110], x["count"], x["ms"]]
                                                        for x in (p.get("top_kernels_by_time") or [])[:45]], 4)
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--num-layers", type=int, default=60)
    ap.add_argument("--compile", action="store_true", help="also FP8 defaults + compile_repeated_blocks()")
    ap.add_argument("--stacks", action="store_true", help="Python stacks of the copies of an eager call")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    env = H.environment(dev)
    R = H.Results(Path(a.out or "/tmp"), "probe_fp8_profile",
                  H.head("benchmarks/probe_fp8_profile.py (issues 18, 19)", env, vars(a)), markdown)
    R.d["details"] = {}
    H.load_modelopt()
    H.start_profiler(dev)
    model = H.build_transformer(False, a.num_layers, dev, torch.bfloat16, 0)
    kw = H.as_dtype(H.inputs(model, 64, 128, dev, torch.float32, 1), torch.bfloat16)
    calib = [H.inputs(model, 64, 128, dev, torch.bfloat16, 10 + i, t) for i, t in enumerate((0.9, 0.5))]
    H.fp8_quantize(model, calib)
    rep = qwen_absorb.patch(model)
    case(R, "fp8_graph", model, kw, dev, rep)
    if a.compile:
        compile_case(R, model, kw, dev)
        rep = qwen_absorb.patch(model)
        case(R, "fp8_graph_again", model, kw, dev, rep)
    rep = qwen_absorb.patch(model, cuda_graph=False)
    case(R, "fp8_eager", model, kw, dev, rep)
    if a.stacks:
        R.put("copy_stacks", copy_stacks(model, kw, dev))
    qwen_absorb.patch(model)  # patched when the LoRA is added (benchmarks/fp8_lora.py's order)
    model.add_adapter(lora_config(64))
    seed_lora(model, 64, 0)
    rep = qwen_absorb.patch(model)
    case(R, "fp8_lora_graph", model, kw, dev, rep)
    qwen_absorb.unpatch(model)
    rep = qwen_absorb.patch(model)  # the LoRA already there when patched
    case(R, "fp8_lora_graph_fresh", model, kw, dev, rep)
    R.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
