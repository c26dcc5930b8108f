#!/usr/bin/env python
"""Transformer-level benchmark: Qwen-Image transformer calls unpatched vs patched vs compile_repeated_blocks().

    python examples/benchmark.py                 # CUDA, full-width random transformer, about 5-6 min on an H200
    python examples/benchmark.py --tiny          # CPU smoke run of the same code path (seconds)

For each base dtype / ModelOpt quantization (bf16, FP8 via mtq.quantize), each resolution (512^2, 1024^2,
2048^2 -> 1024, 4096, 16384 image tokens, plus --text-tokens text tokens) and each variant:

    eager             diffusers as is
    patched           qwen_absorb.patch(transformer)
    compiled          transformer.compile_repeated_blocks()
    patched+compiled  qwen_absorb.patch(transformer), then compile_repeated_blocks()

it measures the latency of one transformer call (CUDA events, warm-up, median of --iters) and the GPU
kernels launched per call (torch.profiler). With --num-layers N < 60 the blocks are measured on an N-layer
model and extrapolated to --extrapolate-to layers: T(60) = T(0) + (T(N) - T(0)) * 60 / N, where T(0) is
the same model with its block list emptied (embeddings, norm_out, proj_out). Both the measured and the
extrapolated numbers are written, labelled as such, to DIR/<tag>.json and DIR/<tag>.md (default DIR
benchmarks/results), with the GPU, driver, library versions and date.

--time-budget-s bounds the run: once exceeded, the remaining (quant, variant) groups are recorded as
skipped rather than run.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

VARIANTS = ("eager", "patched", "compiled", "patched+compiled")
QUANTS = ("none", "fp8")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--tiny", action="store_true",
                   help="smoke mode: tiny random transformer, CPU by default, fp32, small shapes, eager variants")
    p.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    p.add_argument("--dtype", default=None, help="base dtype (default bf16; fp32 with --tiny)")
    p.add_argument("--num-layers", type=int, default=None, help="blocks actually built and timed (default 8; --tiny: 2)")
    p.add_argument("--extrapolate-to", type=int, default=None,
                   help="report latency extrapolated to this many blocks (default 60; --tiny: no extrapolation)")
    p.add_argument("--resolutions", default=None, help="comma-separated pixel sizes (default 512,1024,2048)")
    p.add_argument("--text-tokens", type=int, default=None, help="text tokens per call (default 128)")
    p.add_argument("--quant", default=None, help=f"comma-separated subset of {','.join(QUANTS)} (default both)")
    p.add_argument("--fp8-compress", action="store_true", help="mtq.compress after mtq.quantize (real-quant FP8 weights)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default all; --tiny: eager,patched)")
    p.add_argument("--compile-dynamic", action="store_true",
                   help="compile_repeated_blocks(dynamic=True) (default dynamic=False: one static graph per shape)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel count")
    p.add_argument("--time-budget-s", type=float, default=300.0,
                   help="stop starting new (quant, variant) groups after this many seconds (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=str(C.REPO_ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default=None, help="output file stem (default transformer_<gpu>_<date>)")
    args = p.parse_args(argv)
    if args.tiny:
        args.device = args.device or "cpu"
        args.dtype = args.dtype or "fp32"
        args.resolutions = args.resolutions or "64,128"
        args.text_tokens = args.text_tokens or 8
        args.variants = args.variants or "eager,patched"
        args.warmup = min(args.warmup, 2)
        args.iters = min(args.iters, 3)
        args.num_layers = args.num_layers or 2
        args.extrapolate_to = args.extrapolate_to or args.num_layers
    args.device = args.device or "cuda"
    args.num_layers = args.num_layers or 8
    args.extrapolate_to = args.extrapolate_to or 60
    args.dtype = args.dtype or "bf16"
    args.resolutions = [int(r) for r in (args.resolutions or "512,1024,2048").split(",")]
    args.text_tokens = args.text_tokens or 128
    args.quant = _subset(args.quant or ",".join(QUANTS), QUANTS, "--quant")
    args.variants = _subset(args.variants or ",".join(VARIANTS), VARIANTS, "--variants")
    return args


def _subset(text, allowed, flag):
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise SystemExit(f"{flag}: unknown {bad}; choose from {','.join(allowed)}")
    return [a for a in allowed if a in items]


# ----------------------------------------------------------------------------------------------------


def make_inputs(model, resolution: int, text_tokens: int, device, dtype, seed: int):
    cfg = model.config
    side = max(1, resolution // 16)  # Qwen-Image: 8x VAE, then 2x2 patches -> one token per 16x16 pixels
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(1, side * side, cfg.in_channels, generator=g).to(device=device, dtype=dtype)
    ehs = torch.randn(1, text_tokens, cfg.joint_attention_dim, generator=g).to(device=device, dtype=dtype)
    return {
        "hidden_states": hs,
        "encoder_hidden_states": ehs,
        "encoder_hidden_states_mask": None,  # the pipelines pass None when the mask is all ones
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_shapes": [[(1, side, side)]],
        "return_dict": False,
    }, side * side


class Bench:
    def __init__(self, model, device, warmup, iters, profile):
        self.model, self.device = model, device
        self.warmup, self.iters, self.profile = warmup, iters, profile

    def call(self, inputs):
        return self.model(**inputs)[0]

    def latency(self, inputs):
        """(first call seconds, median ms, all ms) of one transformer call."""
        with torch.inference_mode():
            t0 = time.perf_counter()
            self.call(inputs)
            C.synchronize(self.device)
            first = time.perf_counter() - t0
            for _ in range(max(0, self.warmup - 1)):
                self.call(inputs)
            times = []
            if self.device.type == "cuda":
                for _ in range(self.iters):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    self.call(inputs)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
            else:
                for _ in range(self.iters):
                    t = time.perf_counter()
                    self.call(inputs)
                    times.append((time.perf_counter() - t) * 1e3)
        return first, statistics.median(times), times

    def kernels(self, inputs):
        """GPU kernels launched by one call (memcpy/memset excluded), or None off CUDA."""
        if self.device.type != "cuda" or not self.profile:
            return None
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode():
            self.call(inputs)
            torch.cuda.synchronize(self.device)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                self.call(inputs)
                torch.cuda.synchronize(self.device)
        n = 0
        for e in prof.events():
            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", "[memory]")):
                n += 1
        return n


class NoBlocks:
    """Temporarily empty the block list: T(0), the cost outside the blocks."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.blocks = self.model.transformer_blocks
        self.model.transformer_blocks = torch.nn.ModuleList()

    def __exit__(self, *exc):
        self.model.transformer_blocks = self.blocks
        return False


def uncompile(model):
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    torch._dynamo.reset()


def setup_variant(model, variant, args, patch_kwargs):
    """Bring the model to ``variant`` from any previous state; returns the PatchReport or None."""
    qwen_absorb.unpatch(model)
    uncompile(model)
    report = None
    if variant in ("patched", "patched+compiled"):
        report = qwen_absorb.patch(model, **patch_kwargs)
    if variant in ("compiled", "patched+compiled"):
        model.compile_repeated_blocks(dynamic=bool(args.compile_dynamic))
    return report


def summarize_report(report):
    if report is None:
        return None
    return {
        "kernels_available": bool(getattr(report, "kernels_available", False)),
        "kernel_unavailable_reasons": list(getattr(report, "kernel_unavailable_reasons", []) or []),
        "summary": C.json_safe(dict(getattr(report, "summary", {}) or {})),
        "runtime_fallbacks": C.runtime_fallbacks(report),
    }


def build_model(args, device, dtype):
    if args.tiny:
        return C.tiny_transformer(dtype, device, seed=args.seed, num_layers=args.num_layers)
    return C.full_size_transformer(num_layers=args.num_layers, dtype=dtype, device=device, seed=args.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = C.resolve_device(args.device)
    dtype = C.parse_dtype(args.dtype)
    t_start = time.perf_counter()
    env = C.environment(device)
    print(f"qwen_absorb transformer benchmark on {env['gpu'] or 'CPU'} ({device}), base dtype {C.SHORT_DTYPE[dtype]}, "
          f"torch {env['torch']}, diffusers {env['diffusers']}, modelopt {env['nvidia_modelopt']}, cupy {env['cupy']}")
    if device.type != "cuda":
        print("NOTE: not on CUDA: the fused kernels cannot run (the patched model uses the torch references), "
              "latencies are CPU wall-clock and kernel launches are not counted. Use a GPU for real numbers.")

    model = build_model(args, device, dtype)
    n_layers = model.config.num_layers
    extrap = args.extrapolate_to
    hidden = model.config.num_attention_heads * model.config.attention_head_dim
    print(f"transformer: {n_layers} layers built (hidden {hidden}); "
          + (f"block costs extrapolated to {extrap} layers" if extrap != n_layers else "no extrapolation"))
    inputs = {r: make_inputs(model, r, args.text_tokens, device, dtype, args.seed) for r in args.resolutions}
    bench = Bench(model, device, args.warmup, args.iters, not args.no_profile)

    rows, skipped, quant_info = [], [], {}
    budget_hit = False
    for quant in args.quant:
        elapsed = time.perf_counter() - t_start
        if args.time_budget_s and elapsed > args.time_budget_s:
            budget_hit = True
            skipped.append({"quant": quant, "variant": "*",
                            "reason": f"time budget {args.time_budget_s:.0f} s reached ({elapsed:.0f} s)"})
            print(f"SKIP quant={quant}: time budget reached")
            continue
        if quant != "none":
            why = C.quant_unavailable_reason(quant, device)
            if why:
                skipped.append({"quant": quant, "variant": "*", "reason": why})
                print(f"SKIP quant={quant}: {why}")
                continue
            qwen_absorb.unpatch(model)
            uncompile(model)
            calib_res = 1024 if 1024 in inputs else args.resolutions[0]

            def forward_loop(m, _inp=inputs[calib_res][0]):
                with torch.no_grad():
                    m(**_inp)

            quant_info[quant] = C.quantize_transformer(model, quant, forward_loop)
            if args.fp8_compress:
                import modelopt.torch.quantization as mtq

                mtq.compress(model)
                quant_info[quant]["compressed"] = True
            print(f"quantized with ModelOpt {quant_info[quant]['config']} in {quant_info[quant]['calibration_s']:.1f} s")
        # T(0) per resolution: the same for every variant (the patch and compile_repeated_blocks touch blocks only)
        t0 = {}
        with NoBlocks(model):
            qwen_absorb.unpatch(model)
            uncompile(model)
            for r in args.resolutions:
                _, ms, _ = bench.latency(inputs[r][0])
                t0[r] = (ms, bench.kernels(inputs[r][0]))
        for variant in args.variants:
            elapsed = time.perf_counter() - t_start
            if args.time_budget_s and elapsed > args.time_budget_s:
                budget_hit = True
                skipped.append({"quant": quant, "variant": variant,
                                "reason": f"time budget {args.time_budget_s:.0f} s reached ({elapsed:.0f} s)"})
                print(f"SKIP quant={quant} {variant}: time budget reached")
                continue
            report = setup_variant(model, variant, args, {})
            for r in args.resolutions:
                inp, n_img = inputs[r]
                elapsed = time.perf_counter() - t_start
                if args.time_budget_s and elapsed > args.time_budget_s:
                    budget_hit = True
                    skipped.append({"quant": quant, "variant": variant, "resolution": r,
                                    "reason": f"time budget {args.time_budget_s:.0f} s reached ({elapsed:.0f} s)"})
                    print(f"SKIP quant={quant} {variant} {r}^2: time budget reached")
                    continue
                try:
                    first, ms, all_ms = bench.latency(inp)
                    k = bench.kernels(inp)
                except Exception as e:  # record and go on: one failing variant must not hide the others
                    rows.append({"quant": quant, "variant": variant, "resolution": r, "error": f"{type(e).__name__}: {e}"})
                    print(f"ERROR quant={quant} {variant} {r}^2: {type(e).__name__}: {e}")
                    continue
                base_ms, base_k = t0[r]
                per_block = (ms - base_ms) / n_layers
                row = {
                    "quant": quant, "dtype": C.SHORT_DTYPE[dtype], "variant": variant, "resolution": r,
                    "image_tokens": n_img, "text_tokens": args.text_tokens,
                    "measured_layers": n_layers, "ms_measured": ms, "ms_samples": all_ms,
                    "ms_outside_blocks": base_ms, "ms_per_block": per_block,
                    "extrapolated_layers": extrap, "ms_extrapolated": base_ms + per_block * extrap,
                    "first_call_s": first,
                    "kernels_measured": k,
                    "kernels_outside_blocks": base_k,
                    "kernels_per_block": None if k is None or base_k is None else (k - base_k) / n_layers,
                    "kernels_extrapolated": None if k is None or base_k is None
                    else base_k + (k - base_k) / n_layers * extrap,
                    "report": summarize_report(report) if report is not None else None,
                }
                rows.append(row)
                print(f"  {quant:4s} {variant:17s} {r:5d}^2  {ms:9.3f} ms measured ({n_layers} layers)  "
                      f"{row['ms_extrapolated']:9.3f} ms @{extrap}  kernels {k if k is not None else '-'}  "
                      f"(first call {first:.1f} s)")
            if report is not None:  # runtime fallbacks accumulate during the runs: read them at the end
                for row in rows:
                    if row.get("variant") == variant and row.get("quant") == quant and "error" not in row:
                        row["report"] = summarize_report(report)
        qwen_absorb.unpatch(model)
        uncompile(model)

    for row in rows:  # speed-up against eager of the same quant and resolution
        if "error" in row:
            continue
        base = next((b for b in rows if b.get("variant") == "eager" and b.get("quant") == row["quant"]
                     and b.get("resolution") == row["resolution"] and "error" not in b), None)
        row["speedup_vs_eager"] = base["ms_measured"] / row["ms_measured"] if base else None
    result = {
        "benchmark": "examples/benchmark.py (transformer call latency and kernel launches)",
        "environment": env,
        "config": {k: (v if not isinstance(v, torch.dtype) else str(v)) for k, v in vars(args).items()},
        "method": ("CUDA events around one transformer call, median of iters after warm-up; kernels counted with "
                   "torch.profiler (CUDA kernel events, memcpy/memset excluded) over one call; blocks measured on "
                   f"{n_layers} layers and extrapolated to {extrap}: T = T(0) + (T(N) - T(0)) * {extrap} / N"
                   if device.type == "cuda" else
                   "CPU wall-clock (perf_counter) around one transformer call, median of iters after warm-up"),
        "quantization": quant_info,
        "rows": rows,
        "skipped": skipped,
        "time_budget_reached": budget_hit,
        "total_s": time.perf_counter() - t_start,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = args.tag or default_tag(env, args.tiny)
    json_path, md_path = out_dir / f"{tag}.json", out_dir / f"{tag}.md"
    json_path.write_text(json.dumps(C.json_safe(result), indent=2) + "\n")
    md_path.write_text(markdown(result))
    print(f"wrote {json_path}\nwrote {md_path}\n")
    print(markdown(result))
    errors = [r for r in rows if "error" in r]
    return 1 if errors or not rows else 0


def default_tag(env, tiny):
    gpu = env["gpu"] or "cpu"
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    date = env["date"][:10].replace("-", "")
    return f"transformer_{'tiny_' if tiny else ''}{slug}_{date}"


def markdown(result) -> str:
    env, cfg, rows = result["environment"], result["config"], result["rows"]
    n = next((r["measured_layers"] for r in rows if "measured_layers" in r), None)
    x = next((r["extrapolated_layers"] for r in rows if "extrapolated_layers" in r), None)
    lines = [
        "# Qwen-Image transformer: unpatched vs qwen_absorb vs compile_repeated_blocks",
        "",
        f"- GPU: {env['gpu'] or 'none (CPU)'}" + (f" ({env['gpu_capability']}), driver {env['driver']}" if env["gpu"] else ""),
        f"- torch {env['torch']} (CUDA {env['torch_cuda']}), diffusers {env['diffusers']}, "
        f"nvidia-modelopt {env['nvidia_modelopt']}, cupy {env['cupy']}, qwen_absorb {env['qwen_absorb_commit']}",
        f"- date: {env['date']}",
        f"- method: {result['method']}",
        f"- text tokens per call: {cfg['text_tokens']}; warm-up {cfg['warmup']}, iters {cfg['iters']}; "
        f"compile: compile_repeated_blocks(dynamic={cfg['compile_dynamic']})",
        "",
        f"| resolution | image tokens | quant | variant | ms/call measured ({n} layers) | ms/call extrapolated to {x} layers "
        f"| speed-up vs eager | kernels/call measured | kernels/call extrapolated | first call (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['resolution']}^2 | | {r['quant']} | {r['variant']} | error: {r['error']} | | | | | |")
            continue
        q = "bf16" if r["quant"] == "none" and r["dtype"] == "bf16" else (
            r["dtype"] if r["quant"] == "none" else f"ModelOpt {r['quant'].upper()} ({r['dtype']})")
        sp = f"{r['speedup_vs_eager']:.3f}x" if r.get("speedup_vs_eager") else ""
        km = "" if r["kernels_measured"] is None else str(r["kernels_measured"])
        kx = "" if r["kernels_extrapolated"] is None else f"{r['kernels_extrapolated']:.0f}"
        lines.append(f"| {r['resolution']}^2 | {r['image_tokens']} | {q} | {r['variant']} | {r['ms_measured']:.3f} "
                     f"| {r['ms_extrapolated']:.3f} | {sp} | {km} | {kx} | {r['first_call_s']:.1f} |")
    for s in result["skipped"]:
        res = f" {s['resolution']}^2" if "resolution" in s else ""
        lines.append(f"\nSkipped: quant={s['quant']} variant={s['variant']}{res}: {s['reason']}")
    reports = {(r["quant"], r["variant"]): r["report"] for r in rows if r.get("report")}
    if reports:
        lines.append("\nPatch reports:")
        for (q, v), rep in reports.items():
            lines.append(f"- {q}/{v}: kernels available: {rep['kernels_available']}"
                         + (f" ({'; '.join(rep['kernel_unavailable_reasons'])})" if rep["kernel_unavailable_reasons"] else "")
                         + f"; summary {rep['summary']}; runtime fallbacks {rep['runtime_fallbacks'] or 'none'}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
