"""Latency and kernel launches of one full-size QwenImageTransformerBlock, unpatched vs patched.

Geometry: hidden 3072 (24 heads x 128), 4096 image tokens (1024x1024) + 128 text tokens, bf16,
batch 1, no text mask (the pipelines pass None when the mask is all ones), torch.inference_mode().
Cases: bf16 eager and torch.compile (the block compiled), unpatched and patched; then the same
block quantized with ModelOpt FP8_DEFAULT_CFG (short calibration), unpatched, patched (auto: biases
in the GEMMs) and patched with deferred biases (capability override), eager (``--fp8-compile``
adds compiled FP8 cases; ModelOpt's QuantAttention breaks the graph).

Latency: CUDA events around each call after warm-up, median over ``--iters`` calls. Launches:
torch.profiler (CUPTI) device kernels per block call (CuPy kernels launched on the torch stream
are seen too), memcpy/memset counted separately. Targets (issue 3): patched bf16 eager >= 1.12x
faster than unpatched eager with >= 17 fewer launches; patched + compile not slower than compile.

    python benchmarks/bench_block.py                     # H200: ~3-5 min (2 compiles, ModelOpt ext build ~60 s)
    python benchmarks/bench_block.py --tiny --device cpu # smoke test of the script on CPU (~30 s)

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/bench_block_<gpu>_<date>``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import qwen_absorb  # noqa: E402
from qwen_absorb import gating  # noqa: E402
from qwen_absorb import testing as T  # noqa: E402

TARGET_SPEEDUP = 1.12
TARGET_FEWER_LAUNCHES = 17


# ------------------------------------------------------------------------------- environment


def env_info(device: torch.device) -> dict[str, Any]:
    """GPU, driver and library versions, date: recorded with every result."""
    def version(mod: str) -> str | None:
        try:
            m = __import__(mod)
            return getattr(m, "__version__", "?")
        except Exception:
            return None

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "diffusers": version("diffusers"), "modelopt": version("modelopt"), "cupy": version("cupy"),
        "qwen_absorb_commit": _git_commit(),
        "device": str(device),
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        info["gpu"] = torch.cuda.get_device_name(idx)
        info["capability"] = list(torch.cuda.get_device_capability(idx))
        info["driver"] = _nvidia_smi("driver_version")
        info["kernels_available"] = not qwen_absorb.ops.kernel_runtime_reasons(device)
        info["kernel_unavailable_reasons"] = qwen_absorb.ops.kernel_runtime_reasons(device)
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _nvidia_smi(field: str) -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except Exception:
        return None


def default_out(prefix: str, env: dict[str, Any]) -> Path:
    gpu = (env.get("gpu") or "cpu").replace("NVIDIA ", "").replace(" ", "_").lower()
    return ROOT / "benchmarks" / "results" / f"{prefix}_{gpu}_{env['date'][:10]}"


def write_results(out: Path, data: dict[str, Any], markdown: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", flush=True)


# ------------------------------------------------------------------------------- measurement


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> dict[str, float]:
    """Median / min / mean milliseconds per call (CUDA events on GPU, perf_counter on CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "mean_ms": statistics.fmean(times),
            "iters": iters}


def count_launches(fn: Callable[[], Any], device: torch.device, calls: int = 5) -> dict[str, float] | None:
    """Device kernels (and memcpy/memset) per call, from torch.profiler; None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    kernels = mem = 0
    names: dict[str, int] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if e.name.startswith(("Memcpy", "Memset")) or "memcpy" in e.name.lower() or "memset" in e.name.lower():
            mem += 1
        else:
            kernels += 1
            names[e.name] = names.get(e.name, 0) + 1
    top = sorted(names.items(), key=lambda kv: -kv[1])[:40]
    return {"kernels_per_call": kernels / calls, "memops_per_call": mem / calls,
            "kernel_names": {k[:120]: v / calls for k, v in top}}


# ------------------------------------------------------------------------------- the block


def build(args: argparse.Namespace, device: torch.device):
    """(transformer with one block, block kwargs, calibration kwargs for the transformer)."""
    dtype = torch.bfloat16
    if args.tiny:
        model = T.tiny_transformer(dtype=dtype, num_layers=1, seed=args.seed).to(device)
        h = w = 8
        txt = 8
    else:
        model = T.full_size_transformer(num_layers=1, dtype=dtype, device=device, seed=args.seed)
        h = w = 64  # 1024 px / 8 (VAE) / 2 (patch) = 64 -> 4096 tokens
        txt = args.text_tokens
    tin = T.transformer_inputs(model, batch_size=1, height=h, width=w, text_len=txt, masked_tail=0,
                               seed=args.seed + 1, device=device, dtype=dtype)
    with torch.inference_mode():
        hs = model.img_in(tin["hidden_states"])
        ehs = model.txt_in(model.txt_norm(tin["encoder_hidden_states"]))
        temb = model.time_text_embed(tin["timestep"], hs)
        rope = model.pos_embed(tin["img_shapes"], max_txt_seq_len=txt, device=device)
    block_kw = dict(hidden_states=hs, encoder_hidden_states=ehs, encoder_hidden_states_mask=None, temb=temb,
                    image_rotary_emb=rope, joint_attention_kwargs=None, modulate_index=None)
    calib = [T.transformer_inputs(model, batch_size=1, height=h, width=w, text_len=txt, masked_tail=0,
                                  seed=args.seed + 10 + i, timestep=t, device=device, dtype=dtype)
             for i, t in enumerate((0.9, 0.5, 0.1)[: args.calib])]
    return model, block_kw, calib


def measure(name: str, call: Callable[[], Any], device: torch.device, args, reference=None) -> dict[str, Any]:
    print(f"  {name} ...", flush=True)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = call()  # first call: compile / extension builds happen here
        sync(device)
        first_s = time.perf_counter() - t0
        res: dict[str, Any] = {"case": name, "first_call_s": round(first_s, 2)}
        res.update(time_calls(call, device, args.warmup, args.iters))
        res["launches"] = count_launches(call, device)
    if reference is not None:
        d = [(a.float() - b.float()).abs().max().item() for a, b in zip(out, reference)]
        res["max_abs_diff_vs_unpatched"] = {"txt": d[0], "img": d[1]}
    print(f"    median {res['median_ms']:.3f} ms"
          + (f", {res['launches']['kernels_per_call']:.1f} kernels/call" if res["launches"] else ""), flush=True)
    return res, out


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    env = env_info(device)
    print(json.dumps({k: v for k, v in env.items() if k != "kernel_unavailable_reasons"}), flush=True)
    model, kw, calib = build(args, device)
    block = model.transformer_blocks[0]
    call = lambda: block(**kw)  # noqa: E731
    results: list[dict[str, Any]] = []
    reports: dict[str, Any] = {}

    def compiled_call():
        torch._dynamo.reset()
        cb = torch.compile(block)
        return lambda: cb(**kw)

    # ---- bf16
    r, ref = measure("bf16 unpatched eager", call, device, args)
    results.append(r)
    if args.compile:
        r, _ = measure("bf16 unpatched compile", compiled_call(), device, args, ref)
        results.append(r)
    reports["bf16"] = qwen_absorb.patch(model)
    r, _ = measure("bf16 patched eager", call, device, args, ref)
    results.append(r)
    if args.compile:
        r, _ = measure("bf16 patched compile", compiled_call(), device, args, ref)
        results.append(r)
        qwen_absorb.unpatch(model)
        reports["bf16_kernels_under_compile"] = qwen_absorb.patch(model, kernels_under_compile=True)
        r, _ = measure("bf16 patched compile (kernels_under_compile)", compiled_call(), device, args, ref)
        results.append(r)
    qwen_absorb.unpatch(model)
    torch._dynamo.reset()

    # ---- ModelOpt FP8
    if args.fp8:
        print("  quantizing (ModelOpt FP8_DEFAULT_CFG; first use builds its CUDA extension) ...", flush=True)
        t0 = time.perf_counter()
        T.fp8_quantize(model, calib)
        quant_s = time.perf_counter() - t0
        r, ref8 = measure("fp8 unpatched eager", call, device, args)
        r["quantize_s"] = round(quant_s, 1)
        results.append(r)
        if args.fp8_compile:
            r, _ = measure("fp8 unpatched compile", compiled_call(), device, args, ref8)
            results.append(r)
        reports["fp8"] = qwen_absorb.patch(model, defer_bias=False)
        r, _ = measure("fp8 patched eager", call, device, args, ref8)
        results.append(r)
        qwen_absorb.unpatch(model)
        rep = qwen_absorb.patch(model)  # auto: deferral where validated (sm_90 is)
        if rep.summary["biases_deferred"] == 0:
            qwen_absorb.unpatch(model)
            rep = qwen_absorb.patch(model, capabilities={gating.capability_key(device)})
        reports["fp8_deferred"] = rep
        r, _ = measure("fp8 patched+deferred eager", call, device, args, ref8)
        r["biases_deferred"] = rep.summary["biases_deferred"]
        results.append(r)
        if args.fp8_compile:
            r, _ = measure("fp8 patched+deferred compile", compiled_call(), device, args, ref8)
            results.append(r)
        qwen_absorb.unpatch(model)

    reports = {k: v.to_dict() for k, v in reports.items()}  # after the runs: fallback counts included
    by = {r["case"]: r for r in results}
    checks = _checks(by)
    return {"env": env, "config": vars(args) | {"img_tokens": kw["hidden_states"].shape[1],
                                               "txt_tokens": kw["encoder_hidden_states"].shape[1],
                                               "hidden": kw["hidden_states"].shape[2]},
            "results": results, "checks": checks, "patch_reports_summary": {k: v["summary"] for k, v in reports.items()},
            "patch_reports": reports}


def _checks(by: dict[str, dict[str, Any]]) -> dict[str, Any]:
    c: dict[str, Any] = {}
    u, p = by.get("bf16 unpatched eager"), by.get("bf16 patched eager")
    if u and p:
        c["bf16_eager_speedup"] = u["median_ms"] / p["median_ms"]
        c["bf16_eager_speedup_pass"] = c["bf16_eager_speedup"] >= TARGET_SPEEDUP
        if u["launches"] and p["launches"]:
            c["bf16_fewer_launches"] = u["launches"]["kernels_per_call"] - p["launches"]["kernels_per_call"]
            c["bf16_fewer_launches_pass"] = c["bf16_fewer_launches"] >= TARGET_FEWER_LAUNCHES
    uc, pc = by.get("bf16 unpatched compile"), by.get("bf16 patched compile")
    if uc and pc:
        c["bf16_compile_ratio_patched_over_unpatched"] = pc["median_ms"] / uc["median_ms"]
        c["bf16_compile_not_slower_pass"] = pc["median_ms"] <= uc["median_ms"] * 1.02  # 2 %: timing noise
    f, fp, fd = by.get("fp8 unpatched eager"), by.get("fp8 patched eager"), by.get("fp8 patched+deferred eager")
    if f and fp:
        c["fp8_eager_speedup"] = f["median_ms"] / fp["median_ms"]
    if f and fd:
        c["fp8_deferred_eager_speedup"] = f["median_ms"] / fd["median_ms"]
        if f["launches"] and fd["launches"]:
            c["fp8_deferred_fewer_launches"] = f["launches"]["kernels_per_call"] - fd["launches"]["kernels_per_call"]
    return c


def markdown(data: dict[str, Any]) -> str:
    env, cfg = data["env"], data["config"]
    lines = [
        "# One QwenImageTransformerBlock: unpatched vs qwen_absorb.patch",
        "",
        f"{env.get('gpu') or env.get('cpu')} (driver {env.get('driver')}), torch {env['torch']} (CUDA "
        f"{env['cuda_runtime']}), diffusers {env['diffusers']}, modelopt {env['modelopt']}, cupy {env['cupy']}, "
        f"qwen_absorb {env['qwen_absorb_commit']}, {env['date']}.",
        f"Block: hidden {cfg['hidden']}, {cfg['img_tokens']} image + {cfg['txt_tokens']} text tokens, bf16, batch 1, "
        f"inference_mode; median of {cfg['iters']} calls after {cfg['warmup']} warm-up (CUDA events); "
        "kernels per call from torch.profiler." + (" **--tiny smoke run, not a benchmark.**" if cfg["tiny"] else ""),
        "",
        "| case | median ms | min ms | kernels/call | memcpy+memset/call | first call s | max diff vs unpatched |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        la = r.get("launches") or {}
        diff = r.get("max_abs_diff_vs_unpatched")
        dtxt = "-" if diff is None else "img {:.3g}, txt {:.3g}".format(diff["img"], diff["txt"])
        lines.append(
            f"| {r['case']} | {r['median_ms']:.3f} | {r['min_ms']:.3f} | {la.get('kernels_per_call', '-')} | "
            f"{la.get('memops_per_call', '-')} | {r['first_call_s']} | {dtxt} |"
        )
    lines += ["", "## Targets (issue 3)", ""]
    for k, v in data["checks"].items():
        lines.append(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}")
    lines += ["", "Patch summaries:", ""]
    for k, v in data["patch_reports_summary"].items():
        lines.append(f"- {k}: {json.dumps(v)}")
    if env.get("kernel_unavailable_reasons"):
        lines += ["", f"**CUDA kernels unavailable:** {env['kernel_unavailable_reasons']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test of this script)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--text-tokens", type=int, default=128)
    ap.add_argument("--calib", type=int, default=2, help="FP8 calibration batches (1-3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--no-fp8", dest="fp8", action="store_false")
    ap.add_argument("--fp8-compile", action="store_true", help="also torch.compile the FP8 block")
    ap.add_argument("--out", type=Path, default=None, help="output path without suffix (.json and .md are written)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.iters, args.warmup = min(args.iters, 10), min(args.warmup, 2)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("CUDA is not available; use --tiny --device cpu for a smoke test")
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    data = run(args)
    out = args.out or default_out("bench_block" + ("_tiny" if args.tiny else ""), data["env"])
    write_results(out, data, markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
