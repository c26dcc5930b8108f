#!/usr/bin/env python
"""CUDA-graph mode (``qwen_absorb.cuda_graph``) for the Qwen-Image transformer call: eager vs graph replay.

One process builds the random full-size transformer (60 layers, hidden 3072, bf16, ~41 GB) once and measures,
B = 1, 128 text tokens (no mask: the pipelines pass None when it is all ones), ``torch.inference_mode()``:

section ``bf16``           1024^2: unpatched eager, graph (unpatched), patched eager, patched + graph; 512^2 and
                           2048^2: unpatched eager vs patched + graph
section ``compile``        1024^2, ``compile_repeated_blocks()`` (torch.compile defaults): unpatched; then
                           ``qwen_absorb.patch`` + compile (recompiled from scratch); then graph mode on top of
                           that patched compiled model; with ``--compile-kernels`` also
                           ``patch(kernels_under_compile=True)`` + compile
section ``pipeline_bf16``  QwenImagePipeline around the same transformer (tiny random 8x VAE, no text encoder,
                           precomputed prompt embeddings of 128 / 32 tokens), 1024^2, 8 steps, true CFG: unpatched
                           eager vs patched + graph mode (its first call, which captures, timed apart)
section ``fp8``            the same model quantized in place with ModelOpt FP8 (``qwen_absorb.testing.fp8_quantize``,
                           fake quant), 1024^2: unpatched eager, graph (unpatched), patched + graph
section ``pipeline_fp8``   the pipeline again on the FP8 model

"graph" = ``qwen_absorb.cuda_graph.install`` on the transformer; "patched" = ``qwen_absorb.patch(model)`` (default
arguments). Per case: a first call (timed apart: for graph mode it is warm-up + capture), ``--warmup`` calls, then
``--iters`` (>= 5) calls each between CUDA events and synchronized after it, median reported (the wall time of one
call, host work before the replay included); ``--b2b`` calls back to back between two events (host work overlaps the
GPU: the throughput of a denoising loop); GPU busy = the sum of the kernel durations of one call under
torch.profiler. Keys of ``<out>/cuda_graph.json`` (written after every measurement, so a killed run keeps what was
done; a key not measured stays null with a reason under ``skipped``):

    bf16_eager_ms  bf16_graph_ms (patched + graph)  bf16_graph_unpatched_ms  bf16_patched_ms
    bf16_compile_ms (unpatched + compile_repeated_blocks)  bf16_patched_compile_ms (patch + compile)
    bf16_compile_graph_ms (patch + compile + graph)  bf16_patched_compile_kernels_ms (patch(kernels_under_compile=
    True) + compile; only with --compile-kernels)  bf16_512_eager_ms  bf16_512_graph_ms  bf16_2048_eager_ms
    bf16_2048_graph_ms  fp8_eager_ms  fp8_graph_ms (patched + graph)  fp8_graph_unpatched_ms
    <each>_gpu_busy_ms  pipeline_bf16_s / pipeline_fp8_s: {eager, graph, first_call}  gpu  date  versions
    speedups (ratios of the medians, > 1: the second faster), among them compile_graph_vs_compile =
    bf16_compile_ms / bf16_compile_graph_ms (issue 10 target >= 1.05) and patched_compile_vs_compile =
    bf16_compile_ms / bf16_patched_compile_ms (issue 11 target >= 1.05)

    python benchmarks/cuda_graph_bench.py                          # H200: ~5-6 min (+60 s ModelOpt ext build once)
    python benchmarks/cuda_graph_bench.py --sections bf16,fp8      # a subset
    python benchmarks/cuda_graph_bench.py --sections compile       # H200: ~3-4 min (two cold compiles + graph)
    python benchmarks/cuda_graph_bench.py --tiny --out /tmp/cg     # CPU smoke run of the same code paths (seconds)

``--time-budget-s`` (default 330) stops starting new sections once exceeded. ``--tiny`` never writes into
benchmarks/results unless ``--out`` says so.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import io
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "examples"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import _common as C  # noqa: E402  (examples/_common.py: environment, tiny VAE, prompt embeddings)
import torch  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb import testing as T  # noqa: E402
from qwen_absorb.cuda_graph import install  # noqa: E402

SECTIONS = ("bf16", "compile", "pipeline_bf16", "fp8", "pipeline_fp8")
TARGETS = {  # issue: CUDA-graph mode for the patched transformer call
    "bf16_graph_vs_eager": 1.10,
    "compile_graph_vs_compile": 1.05,
    "patched_compile_vs_compile": 1.05,  # issue 11: patched + compile_repeated_blocks vs compile alone
    "fp8_graph_vs_eager": 2.5,
}


def keys(extra_resolutions: list[int]) -> list[str]:
    """The per-call keys (ms), in table order; with the default resolutions exactly the documented ones."""
    out = ["bf16_eager_ms", "bf16_graph_ms", "bf16_graph_unpatched_ms", "bf16_patched_ms", "bf16_compile_ms",
           "bf16_patched_compile_ms", "bf16_compile_graph_ms", "bf16_patched_compile_kernels_ms"]
    for r in extra_resolutions:
        out += [f"bf16_{r}_eager_ms", f"bf16_{r}_graph_ms"]
    return out + ["fp8_eager_ms", "fp8_graph_ms", "fp8_graph_unpatched_ms"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- results file


class Results:
    """The JSON document, rewritten atomically after every measurement."""

    def __init__(self, out_dir: Path, env: dict[str, Any], args: argparse.Namespace) -> None:
        self.out_dir = out_dir
        self.doc: dict[str, Any] = {
            "benchmark": "benchmarks/cuda_graph_bench.py (CUDA-graph mode of the transformer call)",
            "gpu": env.get("gpu"),
            "date": env.get("date"),
            "versions": {k: env.get(k) for k in ("torch", "torch_cuda", "diffusers", "transformers", "nvidia_modelopt",
                                                 "cupy", "python", "qwen_absorb_commit", "driver", "gpu_capability")},
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k != "out"},
            "tiny": bool(args.tiny),
            "keys": keys(args.extra_resolutions),
            **{k: None for k in keys(args.extra_resolutions)},
            **{k.replace("_ms", "_gpu_busy_ms"): None for k in keys(args.extra_resolutions)},
            "pipeline_bf16_s": None,
            "pipeline_fp8_s": None,
            "speedups": {},
            "targets": {},
            "details": {},
            "sections": {},
            "skipped": {},
            "total_s": None,
        }

    def set(self, key: str, value: Any) -> None:
        self.doc[key] = value
        self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._derive()
        for name, text in (("cuda_graph.json", json.dumps(C.json_safe(self.doc), indent=2) + "\n"),
                           ("cuda_graph.md", markdown(self.doc))):
            tmp = self.out_dir / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out_dir / name)

    def _derive(self) -> None:
        d = self.doc

        def ratio(a: str, b: str) -> float | None:
            x, y = d.get(a), d.get(b)
            return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y else None

        sp = {
            "bf16_graph_vs_eager": ratio("bf16_eager_ms", "bf16_graph_ms"),
            "bf16_graph_unpatched_vs_eager": ratio("bf16_eager_ms", "bf16_graph_unpatched_ms"),
            "bf16_patched_vs_eager": ratio("bf16_eager_ms", "bf16_patched_ms"),
            "compile_graph_vs_compile": ratio("bf16_compile_ms", "bf16_compile_graph_ms"),
            "patched_compile_vs_compile": ratio("bf16_compile_ms", "bf16_patched_compile_ms"),
            "compile_graph_vs_patched_compile": ratio("bf16_patched_compile_ms", "bf16_compile_graph_ms"),
            "patched_compile_kernels_vs_compile": ratio("bf16_compile_ms", "bf16_patched_compile_kernels_ms"),
            "compile_vs_eager": ratio("bf16_eager_ms", "bf16_compile_ms"),
            **{f"bf16_{r}_graph_vs_eager": ratio(f"bf16_{r}_eager_ms", f"bf16_{r}_graph_ms")
               for r in d["config"]["extra_resolutions"]},
            "fp8_graph_vs_eager": ratio("fp8_eager_ms", "fp8_graph_ms"),
            "fp8_graph_unpatched_vs_eager": ratio("fp8_eager_ms", "fp8_graph_unpatched_ms"),
        }
        for name in ("pipeline_bf16_s", "pipeline_fp8_s"):
            p = d.get(name) or {}
            if p.get("eager") and p.get("graph"):
                sp[name.replace("_s", "_graph_vs_eager")] = p["eager"] / p["graph"]
        d["speedups"] = {k: (round(v, 4) if v is not None else None) for k, v in sp.items()}
        graph_key = {"bf16_graph_vs_eager": "bf16_graph_ms", "compile_graph_vs_compile": "bf16_compile_graph_ms",
                     "patched_compile_vs_compile": "bf16_patched_compile_ms", "fp8_graph_vs_eager": "fp8_graph_ms"}
        d["targets"] = {}
        for k, t in TARGETS.items():
            m = d["speedups"].get(k)
            note = (d["details"].get(graph_key[k]) or {}).get("note")
            d["targets"][k] = {"target": t, "measured": m,
                               "met": None if m is None or d.get("tiny") or note else m >= t}
            if d.get("tiny"):
                d["targets"][k]["why_not_judged"] = "--tiny smoke run"
            elif note:
                d["targets"][k]["why_not_judged"] = note


# ------------------------------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, b2b: int) -> dict[str, Any]:
    """``warmup`` untimed calls, ``iters`` calls each between CUDA events and synchronized after it (median: the
    latency of one call), then ``b2b`` calls back to back between two events (per-call throughput)."""
    for _ in range(warmup):
        fn()
    sync(device)
    ms: list[float] = []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
    r: dict[str, Any] = {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms),
                         "samples_ms": [round(x, 4) for x in ms], "warmup": warmup, "iters": iters,
                         "timer": "cuda_events" if device.type == "cuda" else "perf_counter"}
    if b2b > 0:
        sync(device)
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(b2b):
                fn()
            e.record()
            e.synchronize()
            r["b2b_ms"] = s.elapsed_time(e) / b2b
        else:
            t0 = time.perf_counter()
            for _ in range(b2b):
                fn()
            r["b2b_ms"] = (time.perf_counter() - t0) * 1e3 / b2b
        r["b2b_calls"] = b2b
    return r


def gpu_busy(fn: Callable[[], Any], device: torch.device) -> tuple[dict[str, Any] | None, str | None]:
    """One call under torch.profiler (CUDA activity): kernels and the sum of their device durations."""
    if device.type != "cuda":
        return None, f"no CUDA device ({device.type}): torch.profiler CUDA activity not available"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            sync(device)
    except Exception as e:  # noqa: BLE001 - a profiler problem must not cost the timings
        return None, f"profiler failed: {type(e).__name__}: {e}"
    kernels, busy_us, mem_us = 0, 0.0, 0.0
    for ev in prof.events():
        if ev.device_type != DeviceType.CUDA or getattr(ev, "is_user_annotation", False):
            continue
        dur = float(ev.time_range.elapsed_us())
        if "memcpy" in ev.name.lower() or "memset" in ev.name.lower():
            mem_us += dur
            continue
        kernels += 1
        busy_us += dur
    if kernels == 0:
        return None, "the profiler saw no kernels for this call"
    return {"gpu_busy_ms": busy_us / 1e3, "kernels": kernels, "memops_ms": mem_us / 1e3}, None


def measure(label: str, fn: Callable[[], Any], device: torch.device, args: argparse.Namespace,
            runner: Any = None) -> dict[str, Any]:
    """First call (timed apart: for graph mode, warm-up + capture), timing, one profiled call."""
    log(f"  {label}: first call ...")
    mem0 = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        first = time.perf_counter() - t0
        mem1 = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        r: dict[str, Any] = {"first_call_s": round(first, 4)}
        r.update(time_calls(fn, device, args.warmup, args.iters, args.b2b))
        if not args.no_profile:
            prof, why = gpu_busy(fn, device)
            r["profile"], r["profile_skipped"] = prof, why
    if mem0 is not None:
        r["memory_after_first_call_mb"] = round((mem1 - mem0) / 2**20, 1)
    if runner is not None:
        d = runner.describe()
        r["graph"] = d
        if d["replays"] == 0:
            r["note"] = ("graph mode did not replay: " + ", ".join(f"{k} x{v}" for k, v in d["refusals"].items())
                         if d["refusals"] else "graph mode did not replay")
    busy = (r.get("profile") or {}).get("gpu_busy_ms")
    log(f"  {label}: median {r['median_ms']:.3f} ms, back-to-back {r.get('b2b_ms', float('nan')):.3f} ms"
        + (f", GPU busy {busy:.3f} ms" if busy is not None else "") + f" (first call {first:.2f} s)"
        + (f"  NOTE {r['note']}" if r.get("note") else ""))
    return r


def record(res: Results, key: str, r: dict[str, Any]) -> None:
    res.doc["details"][key] = r
    res.doc[key] = round(r["median_ms"], 4)
    busy = (r.get("profile") or {}).get("gpu_busy_ms")
    res.doc[key.replace("_ms", "_gpu_busy_ms")] = round(busy, 4) if busy is not None else None
    res.write()


# ------------------------------------------------------------------------------------------- model and inputs


def make_inputs(model: torch.nn.Module, resolution: int, text_tokens: int, device: torch.device,
                dtype: torch.dtype, seed: int) -> dict[str, Any]:
    cfg = model.config
    side = max(1, resolution // 16)  # Qwen-Image: 8x VAE, then 2x2 patches -> one token per 16x16 pixels
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(1, side * side, cfg.in_channels, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(1, text_tokens, cfg.joint_attention_dim, generator=g).to(device, dtype),
        "encoder_hidden_states_mask": None,
        "timestep": torch.full((1,), 0.5, device=device, dtype=dtype),
        "img_shapes": [[(1, side, side)]],
        "return_dict": False,
    }


def build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if args.tiny:
        return T.tiny_transformer(dtype=dtype, num_layers=args.num_layers, seed=args.seed).to(device).eval()
    return T.full_size_transformer(num_layers=args.num_layers, dtype=dtype, device=device, seed=args.seed).eval()


def uncompile(model: torch.nn.Module) -> None:
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    torch._dynamo.reset()


class Bench:
    """The model, its inputs per resolution, and the state switches (patch, graph mode)."""

    def __init__(self, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, res: Results) -> None:
        self.args, self.device, self.dtype, self.res = args, device, dtype, res
        t0 = time.perf_counter()
        self.model = build(args, device, dtype)
        log(f"built the transformer ({self.model.config.num_layers} layers) in {time.perf_counter() - t0:.1f} s")
        self.inputs = {r: make_inputs(self.model, r, args.text_tokens, device, dtype, args.seed)
                       for r in sorted({args.resolution, *args.extra_resolutions})}
        self.runner = None
        self.fallbacks: collections.Counter = collections.Counter()

    def call(self, r: int) -> Callable[[], Any]:
        kw = self.inputs[r]
        return lambda: self.model(**kw)

    def graph_on(self) -> Any:
        self.graph_off()
        self.fallbacks = collections.Counter()
        self.runner = install(self.model, fallbacks=self.fallbacks, max_graphs=self.args.max_graphs)
        return self.runner

    def graph_off(self) -> None:
        if self.runner is not None:
            self.runner.remove()
            self.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def plain(self) -> None:
        """Unpatched, uncompiled, no graph mode."""
        self.graph_off()
        qwen_absorb.unpatch(self.model)
        uncompile(self.model)

    def run(self, key: str, r: int, graph: bool) -> dict[str, Any]:
        runner = self.graph_on() if graph else None
        try:
            out = measure(key, self.call(r), self.device, self.args, runner)
        finally:
            if graph:
                out_fb = dict(self.fallbacks)
                self.graph_off()
        if graph:
            out["fallbacks"] = out_fb
        record(self.res, key, out)
        return out


# ------------------------------------------------------------------------------------------- sections


def section_bf16(b: Bench) -> None:
    a = b.args
    b.plain()
    b.run("bf16_eager_ms", a.resolution, graph=False)
    b.run("bf16_graph_unpatched_ms", a.resolution, graph=True)
    for r in a.extra_resolutions:
        b.run(f"bf16_{r}_eager_ms", r, graph=False)
    rep = qwen_absorb.patch(b.model)
    b.res.doc["details"]["patch_report"] = {
        "kernels_available": getattr(rep, "kernels_available", None),
        "kernel_unavailable_reasons": getattr(rep, "kernel_unavailable_reasons", None),
    }
    b.run("bf16_patched_ms", a.resolution, graph=False)
    b.run("bf16_graph_ms", a.resolution, graph=True)
    for r in a.extra_resolutions:
        b.run(f"bf16_{r}_graph_ms", r, graph=True)
    b.plain()


def section_compile(b: Bench) -> None:
    """``compile_repeated_blocks()`` at the main resolution, each case compiled from scratch:

    1. unpatched + compile                                   -> ``bf16_compile_ms``
    2. ``qwen_absorb.patch(model)`` + compile                -> ``bf16_patched_compile_ms``
    3. graph mode on top of 2 (patched + compiled + graph)   -> ``bf16_compile_graph_ms``
    4. only with ``--compile-kernels``: ``patch(model, kernels_under_compile=True)`` + compile
                                                             -> ``bf16_patched_compile_kernels_ms``

    Between cases ``b.plain()`` unpatches and uncompiles (``_compiled_call_impl = None`` on every module, then
    ``torch._dynamo.reset()``), so each case traces its own forward; checked before every compile. Per case the
    details keep the compile + first call time and Dynamo's counters (graphs, graph breaks, recompiles).
    """
    a = b.args
    det = b.res.doc["details"]
    kw = {"backend": "eager"} if a.tiny else {}  # --tiny: no C++/Triton toolchain needed
    det["compile_call"] = f"compile_repeated_blocks({', '.join(f'{k}={v!r}' for k, v in kw.items())})"

    def dynamo_stats() -> dict[str, Any]:
        from torch._dynamo.utils import counters

        out: dict[str, Any] = {k: dict(counters[k]) for k in ("stats", "frames") if k in counters}
        gb = counters.get("graph_break") or {}
        out["graph_breaks"] = int(sum(gb.values()))
        if gb:
            out["graph_break_reasons"] = {str(k)[:200]: int(v) for k, v in list(gb.items())[:5]}
        out.update({k: dict(counters[k]) for k in counters if "recompil" in k})
        cfg = torch._dynamo.config
        out["recompile_limit"] = getattr(cfg, "recompile_limit", getattr(cfg, "cache_size_limit", None))
        return out

    def compiled(key: str, patch_kw: dict[str, Any] | None, how: str) -> None:
        b.plain()
        left = [n for n, m in b.model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
        if left:
            raise RuntimeError(f"b.plain() left {len(left)} compiled module(s), e.g. {left[:3]}")
        from torch._dynamo.utils import counters

        counters.clear()
        rep = qwen_absorb.patch(b.model, **patch_kw) if patch_kw is not None else None
        t0 = time.perf_counter()
        b.model.compile_repeated_blocks(**kw)  # only wraps; Dynamo/Inductor compile in the first call
        wrap_s = time.perf_counter() - t0
        b.run(key, a.resolution, graph=False)
        d = det[key]
        d["compile_and_first_call_s"] = round(wrap_s + d["first_call_s"], 2)
        d["how"] = how
        d["dynamo"] = dynamo_stats()
        if rep is not None:
            d["patch_summary"] = C.json_safe(dict(rep.summary))
            d["runtime_fallbacks"] = C.runtime_fallbacks(rep)
        log(f"  {key}: dynamo {json.dumps(d['dynamo'], default=str)[:300]}")
        b.res.write()

    compiled("bf16_compile_ms", None, "unpatched + " + det["compile_call"])
    compiled("bf16_patched_compile_ms", {}, "qwen_absorb.patch(model) + " + det["compile_call"])
    b.run("bf16_compile_graph_ms", a.resolution, graph=True)  # on top of the patched compiled model
    det["bf16_compile_graph_ms"]["how"] = ("qwen_absorb.patch(model) + " + det["compile_call"]
                                           + " + cuda_graph.install(model)")
    if a.compile_kernels:
        compiled("bf16_patched_compile_kernels_ms", {"kernels_under_compile": True},
                 "qwen_absorb.patch(model, kernels_under_compile=True) + " + det["compile_call"])
    else:
        b.res.doc["skipped"]["bf16_patched_compile_kernels_ms"] = "not requested (--compile-kernels)"
    b.plain()


def section_fp8(b: Bench) -> None:
    a = b.args
    b.plain()
    if not b.res.doc.get("fp8_quantized"):
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # ModelOpt prints one line per quantizer group
            T.fp8_quantize(b.model, b.inputs[a.resolution])
        b.res.doc["fp8_quantized"] = {"how": "qwen_absorb.testing.fp8_quantize (mtq.FP8_DEFAULT_CFG, fake quant)",
                                      "calibration_s": round(time.perf_counter() - t0, 2),
                                      "calibration_input": f"{a.resolution}^2, {a.text_tokens} text tokens"}
        log(f"quantized with ModelOpt FP8 in {time.perf_counter() - t0:.1f} s")
    iters = a.iters
    a.iters = max(5 if not a.tiny else 1, a.iters_fp8)  # the eager FP8 call is slow; >= 5 timed calls anyway
    try:
        b.run("fp8_eager_ms", a.resolution, graph=False)
        b.run("fp8_graph_unpatched_ms", a.resolution, graph=True)
        qwen_absorb.patch(b.model)
        b.run("fp8_graph_ms", a.resolution, graph=True)
    finally:
        a.iters = iters
    b.plain()


class Pipe:
    """A QwenImagePipeline around the benchmark's transformer (tiny random VAE, precomputed prompt embeddings)."""

    def __init__(self, b: Bench) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

        a, dev, dt = b.args, b.device, b.dtype
        self.b = b
        cfg = b.model.config
        if a.tiny:
            vae = T.tiny_vae(seed=a.seed + 1, dtype=dt).to(dev)
            pe, pm = T.tiny_prompt_embeds(seq_len=7, dim=cfg.joint_attention_dim, masked_tail=0, seed=a.seed + 2,
                                          dtype=dt, device=dev)
            npe, npm = T.tiny_prompt_embeds(seq_len=3, dim=cfg.joint_attention_dim, masked_tail=0, seed=a.seed + 3,
                                            dtype=dt, device=dev)
            self.prompt = dict(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=npe,
                               negative_prompt_embeds_mask=npm, true_cfg_scale=4.0)
        else:
            vae = C.tiny_vae(z_dim=cfg.out_channels, scale_factor=8, dtype=dt, device=dev)
            self.prompt = C.random_prompt_kwargs(cfg.joint_attention_dim, dev, dt, seed=a.seed, length=a.text_tokens,
                                                 neg_length=a.neg_text_tokens, padded=0)
        self.pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                      tokenizer=None, transformer=b.model)
        self.pipe.set_progress_bar_config(disable=True)

    def generate(self, steps: int) -> torch.Tensor:
        a = self.b.args
        gen = torch.Generator("cpu").manual_seed(a.seed)
        with torch.inference_mode():
            return self.pipe(**self.prompt, height=a.pipeline_size, width=a.pipeline_size, num_inference_steps=steps,
                             generator=gen, output_type="pt").images

    def timed(self, runs: int) -> tuple[list[float], torch.Tensor]:
        secs, img = [], None
        for _ in range(runs):
            with C.Timer(self.b.device) as t:
                img = self.generate(self.b.args.pipeline_steps)
            secs.append(t.seconds)
        return secs, img


def section_pipeline(b: Bench, key: str, runs: int) -> None:
    a = b.args
    b.plain()
    p = Pipe(b)
    log(f"  {key}: eager warm-up (1 step) ...")
    p.generate(1)
    log(f"  {key}: eager x{runs} ({a.pipeline_steps} steps, true CFG, {a.pipeline_size}^2) ...")
    eager_s, eager_img = p.timed(runs)
    qwen_absorb.patch(b.model)
    runner = b.graph_on()
    log(f"  {key}: patched + graph mode, first run (captures) ...")
    with C.Timer(b.device) as t:
        first_img = p.generate(a.pipeline_steps)
    graph_s, graph_img = p.timed(runs)
    out = {
        "eager": round(statistics.median(eager_s), 4),
        "graph": round(statistics.median(graph_s), 4),
        "first_call": round(t.seconds, 4),
        "eager_runs_s": [round(x, 4) for x in eager_s],
        "graph_runs_s": [round(x, 4) for x in graph_s],
        "graph_mode": "qwen_absorb.patch(transformer) + cuda_graph.install(transformer)",
        "steps": a.pipeline_steps, "size": a.pipeline_size, "true_cfg_scale": 4.0,
        "text_tokens": [int(p.prompt["prompt_embeds"].shape[1]), int(p.prompt["negative_prompt_embeds"].shape[1])],
        "first_call_images_equal_graph": bool(torch.equal(first_img, graph_img)),
        "images_identical_to_unpatched_eager": bool(torch.equal(eager_img, graph_img)),
        "max_abs_diff_vs_unpatched_eager": float((eager_img.float() - graph_img.float()).abs().max()),
        "runner": runner.describe(),
        "fallbacks": dict(b.fallbacks),
    }
    log(f"  {key}: eager {out['eager']:.3f} s, graph {out['graph']:.3f} s, first call {out['first_call']:.3f} s")
    b.res.set(key, out)
    del p
    b.plain()


# ------------------------------------------------------------------------------------------- markdown


def _f(v: Any, nd: int = 3) -> str:
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def markdown(d: dict[str, Any]) -> str:
    env = d.get("environment") or {}
    cfg = d.get("config") or {}
    lines = [
        "# CUDA-graph mode of the Qwen-Image transformer call"
        + (" (--tiny smoke run, not a benchmark)" if d.get("tiny") else ""),
        "",
        f"- GPU: {d.get('gpu') or 'none (CPU)'}" + (f" ({env.get('gpu_capability')}), driver {env.get('driver')}"
                                                    if d.get("gpu") else ""),
        f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), diffusers {env.get('diffusers')}, "
        f"nvidia-modelopt {env.get('nvidia_modelopt')}, cupy {env.get('cupy')}, "
        f"qwen_absorb {env.get('qwen_absorb_commit')}",
        f"- date: {d.get('date')}",
        f"- model: {cfg.get('num_layers')} layers, random weights, B=1, {cfg.get('text_tokens')} text tokens, "
        f"{'fp32 (--tiny; keys keep the bf16 names)' if d.get('tiny') else 'bf16'} activations, "
        "torch.inference_mode(); graph = qwen_absorb.cuda_graph.install, patched = qwen_absorb.patch",
        f"- method: median of {cfg.get('iters')} calls (CUDA events, synchronized after each) after "
        f"{cfg.get('warmup')} warm-up calls; back-to-back = {cfg.get('b2b')} calls between two events; GPU busy = "
        "sum of kernel durations of one call (torch.profiler); first call timed apart (graph mode: warm-up + capture)",
        "",
        "| case | ms/call (median) | back-to-back ms/call | GPU busy ms | kernels | vs eager | first call s |",
        "|---|---|---|---|---|---|---|",
    ]
    det = d.get("details") or {}
    for k in d.get("keys") or []:
        r = det.get(k)
        if r is None:
            continue
        parts = k.split("_")
        fam = "_".join(parts[:2]) if parts[1].isdigit() else parts[0]  # bf16_512_graph_ms -> bf16_512
        b = d.get(f"{fam}_eager_ms")
        sp = f"{b / r['median_ms']:.3f}x" if b and r.get("median_ms") else ""
        prof = r.get("profile") or {}
        lines.append(f"| {k[:-3]}{' (' + r['note'] + ')' if r.get('note') else ''} | {_f(r['median_ms'])} "
                     f"| {_f(r.get('b2b_ms'))} | {_f(prof.get('gpu_busy_ms'))} | {_f(prof.get('kernels'))} | {sp} "
                     f"| {_f(r.get('first_call_s'), 2)} |")
    ck = [k for k in ("bf16_compile_ms", "bf16_patched_compile_ms", "bf16_compile_graph_ms",
                      "bf16_patched_compile_kernels_ms") if det.get(k)]
    if ck:
        sp = d.get("speedups") or {}
        lines += ["", "compile rows (each compiled from scratch, " + str(det.get("compile_call")) + "): "
                  + "; ".join(f"{k[:-3]} = {det[k].get('how', '?')} ("
                              + (f"compile + first call {_f(det[k]['compile_and_first_call_s'], 1)} s)"
                                 if "compile_and_first_call_s" in det[k] else
                                 f"first call {_f(det[k].get('first_call_s'), 2)} s)")
                              for k in ck),
                  f"ratios: patched_compile_vs_compile {_f(sp.get('patched_compile_vs_compile'))}, "
                  f"compile_graph_vs_compile {_f(sp.get('compile_graph_vs_compile'))}, "
                  f"compile_graph_vs_patched_compile {_f(sp.get('compile_graph_vs_patched_compile'))}, "
                  f"patched_compile_kernels_vs_compile {_f(sp.get('patched_compile_kernels_vs_compile'))}"]
    for name in ("pipeline_bf16_s", "pipeline_fp8_s"):
        p = d.get(name)
        if p:
            lines += ["", f"**{name[:-2]}** ({p['steps']} steps, true CFG {p['true_cfg_scale']}, {p['size']}^2, text "
                          f"{p['text_tokens'][0]}/{p['text_tokens'][1]} tokens; graph mode = {p['graph_mode']}): eager "
                          f"{p['eager']:.3f} s, graph {p['graph']:.3f} s "
                          f"({p['eager'] / p['graph']:.3f}x), first call (captures) {p['first_call']:.3f} s; images "
                          f"identical to unpatched eager: {p['images_identical_to_unpatched_eager']} "
                          f"(max abs diff {p['max_abs_diff_vs_unpatched_eager']:.3g})"]
    if d.get("targets"):
        lines += ["", "| target | measured | required | met |", "|---|---|---|---|"]
        for k, t in d["targets"].items():
            lines.append(f"| {k} | {_f(t['measured'])} | {t['target']} | {t['met']} |")
    if d.get("skipped"):
        lines += [""] + [f"- skipped {k}: {v}" for k, v in d["skipped"].items()]
    fails = {k: v for k, v in (d.get("sections") or {}).items() if str(v).startswith("error")}
    if fails:
        lines += [""] + [f"- section {k}: {v.splitlines()[0]}" for k, v in fails.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny fp32 transformer, small shapes, seconds")
    p.add_argument("--out", default=None, help="output folder (default benchmarks/results; --tiny: a new temp folder)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--time-budget-s", type=float, default=330.0,
                   help="do not start a new section after this many seconds (0: no limit)")
    p.add_argument("--device", default=None, help="default cuda (--tiny: cpu)")
    p.add_argument("--num-layers", type=int, default=None, help="default 60 (--tiny: 2)")
    p.add_argument("--resolution", type=int, default=None, help="main resolution in pixels (default 1024; --tiny: 64)")
    p.add_argument("--extra-resolutions", default=None,
                   help="eager vs graph also at these (default 512,2048; --tiny: 32,128)")
    p.add_argument("--text-tokens", type=int, default=None, help="default 128 (--tiny: 8)")
    p.add_argument("--neg-text-tokens", type=int, default=32, help="negative prompt tokens in the pipeline sections")
    p.add_argument("--warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls, >= 5 (default 7; --tiny: 2)")
    p.add_argument("--iters-fp8", type=int, default=5, help="timed calls in the fp8 section (>= 5)")
    p.add_argument("--b2b", type=int, default=None, help="back-to-back calls (default 5; --tiny: 2)")
    p.add_argument("--pipeline-steps", type=int, default=None, help="default 8 (--tiny: 2)")
    p.add_argument("--pipeline-size", type=int, default=None, help="default 1024 (--tiny: 64)")
    p.add_argument("--pipeline-runs", type=int, default=2, help="timed pipeline runs per mode, bf16")
    p.add_argument("--pipeline-runs-fp8", type=int, default=1, help="timed pipeline runs per mode, fp8 (eager is slow)")
    p.add_argument("--max-graphs", type=int, default=8)
    p.add_argument("--no-profile", action="store_true", help="skip the torch.profiler GPU busy measurement")
    p.add_argument("--compile-kernels", action="store_true",
                   help="section compile: also patch(kernels_under_compile=True) + compile_repeated_blocks()")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    t = a.tiny
    a.device = a.device or ("cpu" if t else "cuda")
    a.num_layers = a.num_layers or (2 if t else 60)
    a.resolution = a.resolution or (64 if t else 1024)
    a.extra_resolutions = [int(x) for x in (a.extra_resolutions or ("32,128" if t else "512,2048")).split(",") if x]
    a.text_tokens = a.text_tokens or (8 if t else 128)
    a.warmup = a.warmup if a.warmup is not None else (1 if t else 2)
    a.iters = a.iters if a.iters is not None else (2 if t else 7)
    a.b2b = a.b2b if a.b2b is not None else (2 if t else 5)
    a.pipeline_steps = a.pipeline_steps or (2 if t else 8)
    a.pipeline_size = a.pipeline_size or (64 if t else 1024)
    if not t and (a.iters < 5 or a.iters_fp8 < 5):
        p.error("--iters and --iters-fp8 must be >= 5 (medians of at least 5 timed calls)")
    if t:
        a.iters_fp8 = min(a.iters_fp8, a.iters)
        a.pipeline_runs = min(a.pipeline_runs, 1)
        a.pipeline_runs_fp8 = min(a.pipeline_runs_fp8, 1)
    a.sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in a.sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    a.sections = [s for s in SECTIONS if s in a.sections]
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.tiny:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention on shared CI machines
    device = C.resolve_device(args.device)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    out_dir = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="cuda_graph_tiny_")) if args.tiny
                                                else ROOT / "benchmarks" / "results")
    env = C.environment(device)
    res = Results(out_dir, env, args)
    log(f"CUDA-graph benchmark on {env['gpu'] or 'CPU'} ({device}); sections {','.join(args.sections)}; "
        f"writing {out_dir / 'cuda_graph.json'}")
    if device.type != "cuda":
        log("NOTE: not on CUDA: graph mode refuses every call (input on cpu) and runs eager; timings are CPU wall "
            "clock. This checks the script, not the speed.")
    skipped = set(SECTIONS) - set(args.sections)
    for s in sorted(skipped):
        res.doc["sections"][s] = "not selected (--sections)"
    res.write()
    bench: Bench | None = None
    code = 0
    for name in args.sections:
        elapsed = time.perf_counter() - t_start
        if args.time_budget_s and elapsed > args.time_budget_s:
            res.doc["sections"][name] = f"skipped: time budget {args.time_budget_s:.0f} s reached ({elapsed:.0f} s)"
            res.doc["skipped"][name] = res.doc["sections"][name]
            log(f"SKIP {name}: time budget reached")
            res.write()
            continue
        if name.endswith("fp8"):
            why = C.quant_unavailable_reason("fp8", device)
            if why:
                res.doc["sections"][name] = f"skipped: {why}"
                res.doc["skipped"][name] = why
                log(f"SKIP {name}: {why}")
                res.write()
                continue
        log(f"section {name}")
        t0 = time.perf_counter()
        try:
            if bench is None:
                bench = Bench(args, device, dtype, res)
            if name == "bf16":
                section_bf16(bench)
            elif name == "compile":
                section_compile(bench)
            elif name == "pipeline_bf16":
                if res.doc.get("fp8_quantized"):
                    raise RuntimeError("the model is already FP8-quantized")
                section_pipeline(bench, "pipeline_bf16_s", args.pipeline_runs)
            elif name == "fp8":
                section_fp8(bench)
            elif name == "pipeline_fp8":
                if not res.doc.get("fp8_quantized"):
                    section_fp8_quantize_only(bench)
                section_pipeline(bench, "pipeline_fp8_s", args.pipeline_runs_fp8)
            res.doc["sections"][name] = f"done in {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001 - record and go on with the next section
            code = 1
            res.doc["sections"][name] = f"error: {type(e).__name__}: {e}\n{traceback.format_exc()}"
            log(f"ERROR in {name}: {type(e).__name__}: {e}")
            if bench is not None:
                with contextlib.suppress(Exception):
                    bench.plain()
        res.doc["total_s"] = round(time.perf_counter() - t_start, 1)
        res.write()
    for k in res.doc["keys"]:
        if res.doc.get(k) is None and k not in res.doc["skipped"]:
            res.doc["skipped"][k] = "not measured (section not run, skipped or failed)"
    res.doc["total_s"] = round(time.perf_counter() - t_start, 1)
    res.write()
    log(f"wrote {out_dir / 'cuda_graph.json'} and {out_dir / 'cuda_graph.md'} ({res.doc['total_s']} s)")
    print(markdown(res.doc))
    return code


def section_fp8_quantize_only(b: Bench) -> None:
    """pipeline_fp8 without the fp8 section: quantize, nothing timed."""
    a = b.args
    b.plain()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        T.fp8_quantize(b.model, b.inputs[a.resolution])
    b.res.doc["fp8_quantized"] = {"how": "qwen_absorb.testing.fp8_quantize (mtq.FP8_DEFAULT_CFG, fake quant)",
                                  "calibration_s": round(time.perf_counter() - t0, 2)}


if __name__ == "__main__":
    sys.exit(main())
