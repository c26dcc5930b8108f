#!/usr/bin/env python
"""Transformer-level benchmark: Qwen-Image transformer calls unpatched vs patched vs compile_repeated_blocks().

    python examples/benchmark.py                 # CUDA, full-width random transformer, about 5-6 min on an H200
    python examples/benchmark.py --tiny          # smoke run of the same code path (CPU without CUDA: seconds)
    python examples/benchmark.py --out benchmarks/results/speed   # record a GPU run in the repository

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
extrapolated numbers are written, labelled as such, to DIR/<tag>.json and DIR/<tag>.md, with the GPU,
driver, library versions and date.

Results are rewritten (atomically: a temporary file, then a rename) after every configuration, so Ctrl-C or
a crash keeps what was measured; a configuration that fails is recorded with its error and the run goes on.
DIR is ./benchmark_results unless --out says otherwise: nothing is written into the repository's
benchmarks/results/ unless you pass --out benchmarks/results. Off CUDA (--tiny, --device cpu) the times are
CPU wall-clock, labelled "not a speed measurement", without speed-up ratios.

--time-budget-s bounds the run: once exceeded, the remaining (quant, variant) groups are recorded as
skipped rather than run.

Exit codes: 0 every configuration measured; 1 one or more failed (recorded in the results) or nothing was
measured; 2 bad arguments (checked before any work); 3 the run cannot happen here (no CUDA device without
--tiny or --device cpu, a model larger than the device's memory, a patch option this qwen_absorb lacks);
130 interrupted (the results so far are written).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

VARIANTS = ("eager", "patched", "compiled", "patched+compiled")
QUANTS = ("none", "fp8")
DEFAULT_OUT = "benchmark_results"
EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGS, EXIT_UNSUPPORTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _subset(allowed):
    """argparse ``type=`` for a comma-separated subset of ``allowed`` (kept in ``allowed``'s order)."""
    def parse(text):
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose one or more of {','.join(allowed)}")
        return [a for a in allowed if a in items]
    return parse


def _resolutions(text):
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more comma-separated pixel sizes")
    try:
        return [C.multiple_of_16(s) for s in items]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated pixel sizes, each {e}") from None


def _seconds(text):
    value = C.finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    description, epilog = C.help_texts(__doc__)  # every line of the docstring once
    p = C.ArgumentParser(description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true",
                   help="smoke mode: tiny random transformer, CPU by default, fp32, small shapes, eager variants")
    p.add_argument("--device", type=_device, default="auto",
                   help="auto (default): cuda if available, else cpu with --tiny (without --tiny: exit 3)")
    p.add_argument("--dtype", type=C.parse_dtype, default=None, help="base dtype (default bf16; fp32 with --tiny)")
    p.add_argument("--num-layers", type=C.positive_int, default=None,
                   help="blocks actually built and timed (default 8; --tiny: 2)")
    p.add_argument("--extrapolate-to", type=C.positive_int, default=None,
                   help="report latency extrapolated to this many blocks (default 60; --tiny: no extrapolation)")
    p.add_argument("--resolutions", type=_resolutions, default=None,
                   help="comma-separated pixel sizes, multiples of 16 (default 512,1024,2048)")
    p.add_argument("--text-tokens", type=C.positive_int, default=None, help="text tokens per call (default 128)")
    p.add_argument("--quant", type=_subset(QUANTS), default=list(QUANTS),
                   help=f"comma-separated subset of {','.join(QUANTS)} (default both)")
    p.add_argument("--fp8-compress", action="store_true", help="mtq.compress after mtq.quantize (real-quant FP8 weights)")
    p.add_argument("--variants", type=_subset(VARIANTS), default=None,
                   help=f"comma-separated subset of {','.join(VARIANTS)} (default all; --tiny: eager,patched)")
    p.add_argument("--compile-dynamic", action="store_true",
                   help="compile_repeated_blocks(dynamic=True) (default dynamic=False: one static graph per shape)")
    p.add_argument("--cuda-graph", type=C.tristate, nargs="?", const="true", default="auto", metavar="{auto,true,false}",
                   help="patched variants: qwen_absorb.patch(cuda_graph=\"auto\"|True|False) (bare --cuda-graph: true)")
    p.add_argument("--fp8-gemm", type=C.tristate, default="auto", metavar="{auto,true,false}",
                   help="patched variants: qwen_absorb.patch(fp8_gemm=\"auto\"|True|False) (default auto: not passed)")
    p.add_argument("--warmup", type=C.nonnegative_int, default=3)
    p.add_argument("--iters", type=C.positive_int, default=10)
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler kernel count")
    p.add_argument("--time-budget-s", type=_seconds, default=300.0,
                   help="stop starting new (quant, variant) groups after this many seconds (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--out-dir", dest="out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder (default ./{DEFAULT_OUT}; pass benchmarks/results to record a run in the "
                        "repository); created and checked writable before any work")
    p.add_argument("--tag", type=C.file_tag, default=None, help="output file stem (default transformer_<gpu>_<date>)")
    return p


def _device(text: str):
    """--device: "auto" is resolved in parse_args (it depends on --tiny); anything else parsed and checked now."""
    return "auto" if text == "auto" else C.device_arg(text)


def parse_args(argv=None):
    """Parse and check every argument; a bad one exits 2 (argparse) before anything is built."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = torch.device("cuda" if torch.cuda.is_available() or not args.tiny else "cpu")
    if args.tiny:
        args.device = args.device or torch.device("cpu")
        args.dtype = args.dtype or torch.float32
        args.resolutions = args.resolutions or [64, 128]
        args.text_tokens = args.text_tokens or 8
        args.variants = args.variants or ["eager", "patched"]
        args.warmup = min(args.warmup, 2)
        args.iters = min(args.iters, 3)
        args.num_layers = args.num_layers or 2
        args.extrapolate_to = args.extrapolate_to or args.num_layers
    # not checked here: a missing CUDA device without --device is "unavailable here" (exit 3), not a bad argument
    args.device = args.device or torch.device("cuda")
    args.num_layers = args.num_layers or 8
    args.extrapolate_to = args.extrapolate_to or 60
    args.dtype = args.dtype or torch.bfloat16
    args.resolutions = args.resolutions or [512, 1024, 2048]
    args.text_tokens = args.text_tokens or 128
    args.variants = args.variants or list(VARIANTS)
    why = C.writable_dir_problem(Path(args.out))  # last: it creates the folder
    if why:
        p.error(f"--out: {why}")
    return args


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


def reset(model):
    """Back to the plain model (unpatched, uncompiled) from any state, a failed one included."""
    qwen_absorb.unpatch(model)
    uncompile(model)


def setup_variant(model, variant, args, patch_kwargs):
    """Bring the model to ``variant`` from any previous state; returns the PatchReport or None."""
    reset(model)
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


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


# ----------------------------------------------------------------------------------------------------
# Results: one file pair, rewritten after every configuration


class Results:
    """Rows, skips and errors so far; ``save()`` rewrites DIR/<tag>.json and .md atomically."""

    def __init__(self, args, env, device, out_dir: Path, tag: str):
        self.args, self.env, self.device = args, env, device
        self.json_path, self.md_path = out_dir / f"{tag}.json", out_dir / f"{tag}.md"
        self.rows, self.skipped, self.errors, self.quant_info = [], [], [], {}
        self.status, self.budget_hit = "running", False
        self.n_layers = self.extrap = None
        self.t_start = time.perf_counter()

    def add_row(self, row):
        self.rows.append(row)
        self.save()

    def skip(self, reason, **where):
        self.skipped.append({**where, "reason": reason})
        self.save()

    def error(self, e: BaseException, **where):
        """A failed step that produced no row (quantization, T(0), variant setup); the run goes on."""
        self.errors.append({**where, "error": error_text(e), "traceback": traceback.format_exc()})
        print(f"ERROR {' '.join(f'{k}={v}' for k, v in where.items())}: {error_text(e)}")
        self.save()

    def failed(self) -> bool:
        return bool(self.errors) or any("error" in r for r in self.rows) or not self.rows

    def document(self) -> dict:
        speed = C.timings_are_speed(self.device)
        for row in self.rows:
            if "error" not in row:
                row["speedup_vs_eager"] = self._speedup(row) if speed else None
        n, x = self.n_layers, self.extrap
        return {
            "benchmark": "examples/benchmark.py (transformer call latency and kernel launches)",
            "status": self.status,
            "environment": self.env,
            "config": {k: (str(v) if isinstance(v, (torch.dtype, torch.device)) else v)
                       for k, v in vars(self.args).items()},
            "method": ("CUDA events around one transformer call, median of iters after warm-up; kernels counted "
                       "with torch.profiler (CUDA kernel events, memcpy/memset excluded) over one call; blocks "
                       f"measured on {n} layers and extrapolated to {x}: T = T(0) + (T(N) - T(0)) * {x} / N"
                       if speed else
                       "CPU wall-clock (perf_counter) around one transformer call, median of iters after warm-up; "
                       + C.CPU_TIMING_NOTE),
            "speed_measurement": speed,
            "quantization": self.quant_info,
            "rows": self.rows,
            "skipped": self.skipped,
            "errors": self.errors,
            "time_budget_reached": self.budget_hit,
            "total_s": time.perf_counter() - self.t_start,
        }

    def _speedup(self, row):
        base = next((b for b in self.rows if b.get("variant") == "eager" and b.get("quant") == row["quant"]
                     and b.get("resolution") == row["resolution"] and "error" not in b), None)
        return base["ms_measured"] / row["ms_measured"] if base else None

    def save(self):
        doc = self.document()
        C.write_atomic(self.json_path, json.dumps(C.json_safe(doc), indent=2) + "\n")
        C.write_atomic(self.md_path, markdown(doc))


# ----------------------------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds, results):
        self.seconds, self.results, self.t0 = seconds, results, time.perf_counter()

    def exceeded(self, label, **where) -> bool:
        """True (and the skip recorded) once the time budget is spent."""
        elapsed = time.perf_counter() - self.t0
        if not self.seconds or elapsed <= self.seconds:
            return False
        self.results.budget_hit = True
        self.results.skip(f"time budget {self.seconds:.0f} s reached ({elapsed:.0f} s)", **where)
        print(f"SKIP {label}: time budget reached")
        return True


def quantize(model, quant, args, inputs, res) -> bool:
    """ModelOpt-quantize ``model`` in place for ``quant``; False (recorded) where it cannot or failed."""
    why = C.quant_unavailable_reason(quant, args.device)
    if why:
        res.skip(why, quant=quant, variant="*")
        print(f"SKIP quant={quant}: {why}")
        return False
    reset(model)
    calib_res = 1024 if 1024 in inputs else args.resolutions[0]

    def forward_loop(m, _inp=inputs[calib_res][0]):
        with torch.no_grad():
            m(**_inp)

    try:
        info = C.quantize_transformer(model, quant, forward_loop)
        if args.fp8_compress:
            C.import_modelopt().compress(model)
            info["compressed"] = True
    except Exception as e:  # record and go on: the quantizations after this one may still run
        res.error(e, quant=quant, variant="*", step="quantize")
        return False
    res.quant_info[quant] = info
    print(f"quantized with ModelOpt {info['config']} in {info['calibration_s']:.1f} s")
    return True


def outside_blocks(model, bench, args, inputs):
    """T(0) per resolution: the same for every variant (the patch and compile_repeated_blocks touch blocks only)."""
    t0 = {}
    with NoBlocks(model):
        reset(model)
        for r in args.resolutions:
            _, ms, _ = bench.latency(inputs[r][0])
            t0[r] = (ms, bench.kernels(inputs[r][0]))
    return t0


def measure(bench, quant, variant, r, inputs, t0, args, dtype, report, n_layers):
    inp, n_img = inputs[r]
    first, ms, all_ms = bench.latency(inp)
    k = bench.kernels(inp)
    base_ms, base_k = t0[r]
    per_block = (ms - base_ms) / n_layers
    extrap = args.extrapolate_to
    return {
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
        "report": summarize_report(report),
    }


def run_variant(model, bench, quant, variant, args, dtype, inputs, t0, res, budget):
    try:
        report = setup_variant(model, variant, args, C.patch_options(args))
    except Exception as e:  # e.g. compile or patch failing: the other variants may still run
        res.error(e, quant=quant, variant=variant, step="setup")
        return
    n_layers, extrap = model.config.num_layers, args.extrapolate_to
    for r in args.resolutions:
        if budget.exceeded(f"quant={quant} {variant} {r}^2", quant=quant, variant=variant, resolution=r):
            continue
        try:
            row = measure(bench, quant, variant, r, inputs, t0, args, dtype, report, n_layers)
        except Exception as e:  # record and go on: one failing configuration must not hide the others
            res.add_row({"quant": quant, "variant": variant, "resolution": r, "error": error_text(e),
                         "traceback": traceback.format_exc()})
            print(f"ERROR quant={quant} {variant} {r}^2: {error_text(e)}")
            continue
        res.add_row(row)
        k = row["kernels_measured"]
        print(f"  {quant:4s} {variant:17s} {r:5d}^2  {row['ms_measured']:9.3f} ms measured ({n_layers} layers)  "
              f"{row['ms_extrapolated']:9.3f} ms @{extrap}  kernels {k if k is not None else '-'}  "
              f"(first call {row['first_call_s']:.1f} s)")
    if report is not None:  # runtime fallbacks accumulate during the runs: read them at the end
        for row in res.rows:
            if row.get("variant") == variant and row.get("quant") == quant and "error" not in row:
                row["report"] = summarize_report(report)
        res.save()


def run_all(model, args, device, dtype, res):
    inputs = {r: make_inputs(model, r, args.text_tokens, device, dtype, args.seed) for r in args.resolutions}
    bench = Bench(model, device, args.warmup, args.iters, not args.no_profile)
    budget = Budget(args.time_budget_s, res)
    for quant in args.quant:
        if budget.exceeded(f"quant={quant}", quant=quant, variant="*"):
            continue
        if quant != "none" and not quantize(model, quant, args, inputs, res):
            continue
        try:
            t0 = outside_blocks(model, bench, args, inputs)
        except Exception as e:
            res.error(e, quant=quant, variant="*", step="outside_blocks")
            continue
        for variant in args.variants:
            if budget.exceeded(f"quant={quant} {variant}", quant=quant, variant=variant):
                continue
            run_variant(model, bench, quant, variant, args, dtype, inputs, t0, res, budget)
        reset(model)


def preflight(args, device, dtype) -> str | None:
    """Why this run cannot happen on this machine (exit 3), checked before anything is built."""
    why = C.device_problem(device)
    if why:
        return (f"{why}. The benchmark measures CUDA kernels; use --tiny (or --device cpu) for a CPU smoke run "
                "of the same code")
    if not args.tiny:
        why = C.full_size_memory_problem(args.num_layers, dtype, device)
        if why:
            return why
    return C.unsupported_patch_options(C.patch_options(args), qwen_absorb.patch)


def main(argv=None) -> int:
    args = parse_args(argv)
    device, dtype = args.device, args.dtype
    why = preflight(args, device, dtype)  # first: C.environment() queries the device
    if why:
        print(f"CANNOT RUN HERE: {why}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    env = C.environment(device)
    print(f"qwen_absorb transformer benchmark on {env['gpu'] or 'CPU'} ({device}), base dtype {C.SHORT_DTYPE[dtype]}, "
          f"torch {env['torch']}, diffusers {env['diffusers']}, modelopt {env['nvidia_modelopt']}, cupy {env['cupy']}")
    if not C.timings_are_speed(device):
        print("NOTE: not on CUDA: the fused kernels cannot run (the patched model uses the torch references), "
              f"latencies are CPU wall-clock ({C.CPU_TIMING_NOTE}) and kernel launches are not counted.")
    res = Results(args, env, device, Path(args.out), args.tag or default_tag(env, args.tiny))
    try:
        model = build_model(args, device, dtype)
        res.n_layers, res.extrap = model.config.num_layers, args.extrapolate_to
        hidden = model.config.num_attention_heads * model.config.attention_head_dim
        print(f"transformer: {res.n_layers} layers built (hidden {hidden}); "
              + (f"block costs extrapolated to {res.extrap} layers" if res.extrap != res.n_layers
                 else "no extrapolation"))
        print(f"writing results after every configuration to {res.json_path} and {res.md_path}")
        run_all(model, args, device, dtype, res)
        res.status = "complete"
    except KeyboardInterrupt:
        res.status = "interrupted"
        res.save()
        print(f"\ninterrupted: the results so far are in {res.json_path} and {res.md_path}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # e.g. building the model: record it where the results would be
        res.status = "error"
        res.error(e, step="run")
        traceback.print_exc()
        return EXIT_FAILED
    res.save()
    print(f"wrote {res.json_path}\nwrote {res.md_path}\n")
    print(markdown(res.document()))
    return EXIT_FAILED if res.failed() else EXIT_OK


def default_tag(env, tiny):
    gpu = env["gpu"] or "cpu"
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    date = env["date"][:10].replace("-", "")
    return f"transformer_{'tiny_' if tiny else ''}{slug}_{date}"


def markdown(result) -> str:
    env, cfg, rows = result["environment"], result["config"], result["rows"]
    n = next((r["measured_layers"] for r in rows if "measured_layers" in r), None)
    x = next((r["extrapolated_layers"] for r in rows if "extrapolated_layers" in r), None)
    speed = result["speed_measurement"]
    lines = [
        "# Qwen-Image transformer: unpatched vs qwen_absorb vs compile_repeated_blocks",
        "",
        f"- status: {result['status']}" + ("" if result["status"] == "complete" else " (partial results)"),
        f"- GPU: {env['gpu'] or 'none (CPU)'}" + (f" ({env['gpu_capability']}), driver {env['driver']}" if env["gpu"] else ""),
        f"- torch {env['torch']} (CUDA {env['torch_cuda']}), diffusers {env['diffusers']}, "
        f"nvidia-modelopt {env['nvidia_modelopt']}, cupy {env['cupy']}, qwen_absorb {env['qwen_absorb']} "
        f"(commit {env['qwen_absorb_commit'] or 'unknown: no git'})",
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
        lines.append(_md_row(r, speed))
    for s in result["skipped"]:
        res = f" {s['resolution']}^2" if "resolution" in s else ""
        lines.append(f"\nSkipped: quant={s.get('quant')} variant={s.get('variant')}{res}: {s['reason']}")
    for e in result["errors"]:
        where = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("error", "traceback"))
        lines.append(f"\nError: {where}: {e['error']}")
    reports = {(r["quant"], r["variant"]): r["report"] for r in rows if r.get("report")}
    if reports:
        lines.append("\nPatch reports:")
        for (q, v), rep in reports.items():
            lines.append(f"- {q}/{v}: kernels available: {rep['kernels_available']}"
                         + (f" ({'; '.join(rep['kernel_unavailable_reasons'])})" if rep["kernel_unavailable_reasons"] else "")
                         + f"; summary {rep['summary']}; runtime fallbacks {rep['runtime_fallbacks'] or 'none'}")
    return "\n".join(lines) + "\n"


def _md_row(r, speed) -> str:
    if "error" in r:
        return f"| {r['resolution']}^2 | | {r['quant']} | {r['variant']} | error: {r['error']} | | | | | |"
    q = "bf16" if r["quant"] == "none" and r["dtype"] == "bf16" else (
        r["dtype"] if r["quant"] == "none" else f"ModelOpt {r['quant'].upper()} ({r['dtype']})")
    sp = (f"{r['speedup_vs_eager']:.3f}x" if r.get("speedup_vs_eager") else "") if speed else "n/a (CPU)"
    km = "" if r["kernels_measured"] is None else str(r["kernels_measured"])
    kx = "" if r["kernels_extrapolated"] is None else f"{r['kernels_extrapolated']:.0f}"
    return (f"| {r['resolution']}^2 | {r['image_tokens']} | {q} | {r['variant']} | {r['ms_measured']:.3f} "
            f"| {r['ms_extrapolated']:.3f} | {sp} | {km} | {kx} | {r['first_call_s']:.1f} |")


if __name__ == "__main__":
    sys.exit(main())
