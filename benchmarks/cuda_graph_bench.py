#!/usr/bin/env python
"""CUDA-graph mode (``qwen_absorb.cuda_graph``) for the Qwen-Image transformer call: eager vs graph replay.

One process builds the random full-size transformer (60 layers, bf16, ~41 GB) once and measures, B = 1, 128 text
tokens (no mask), ``torch.inference_mode()``:

section ``bf16``           1024^2: unpatched eager, graph (unpatched), patched eager, patched + graph; 512^2 and
                           2048^2: unpatched eager vs patched + graph
section ``compile``        1024^2, ``compile_repeated_blocks()``: unpatched; ``qwen_absorb.patch`` + compile
                           (recompiled from scratch); graph mode on top of that; with ``--compile-kernels`` also
                           ``patch(kernels_under_compile=True)`` + compile
section ``pipeline_bf16``  QwenImagePipeline around the same transformer (tiny random 8x VAE, precomputed prompt
                           embeddings of 128 / 32 tokens), 1024^2, 8 steps, true CFG: unpatched eager vs patched +
                           graph mode (its first call, which captures, timed apart)
section ``fp8``            the model quantized in place (ModelOpt FP8_DEFAULT_CFG, fake quant), 1024^2: unpatched
                           eager, graph (unpatched), patched + graph
section ``pipeline_fp8``   the pipeline again on the FP8 model

"graph" = ``qwen_absorb.cuda_graph.install`` on the transformer; "patched" = ``qwen_absorb.patch(model)``. Per case
(harness.measure): a first call (graph mode: warm-up + capture), ``--warmup`` calls, ``--iters`` (>= 5) calls
between CUDA events (median: the wall time of one call), ``--b2b`` calls back to back (throughput), GPU busy of one
call. Keys of ``<out>/cuda_graph.json`` (written after every measurement; null with a reason under ``skipped``):

    bf16_eager_ms  bf16_graph_ms (patched + graph)  bf16_graph_unpatched_ms  bf16_patched_ms  bf16_compile_ms
    bf16_patched_compile_ms  bf16_compile_graph_ms  bf16_patched_compile_kernels_ms  bf16_512_eager_ms
    bf16_512_graph_ms  bf16_2048_eager_ms  bf16_2048_graph_ms  fp8_eager_ms  fp8_graph_ms  fp8_graph_unpatched_ms
    <each>_gpu_busy_ms  pipeline_bf16_s / pipeline_fp8_s: {eager, graph, first_call}  gpu  date  versions  speedups
    (> 1: the second faster; compile_graph_vs_compile, patched_compile_vs_compile, ...)  targets

    python benchmarks/cuda_graph_bench.py                          # H200: ~5-6 min (+60 s ModelOpt ext build once)
    python benchmarks/cuda_graph_bench.py --sections compile       # H200: ~3-4 min (two cold compiles + graph)
    python benchmarks/cuda_graph_bench.py --tiny                   # CPU smoke run of the same code paths (seconds)
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb.cuda_graph import install  # noqa: E402

SECTIONS = ("bf16", "compile", "pipeline_bf16", "fp8", "pipeline_fp8")
TARGETS = {"bf16_graph_vs_eager": ("bf16_graph_ms", 1.10), "compile_graph_vs_compile": ("bf16_compile_graph_ms", 1.05),
           "patched_compile_vs_compile": ("bf16_patched_compile_ms", 1.05), "fp8_graph_vs_eager": ("fp8_graph_ms", 2.5)}
SPEEDUPS = {"bf16_graph_vs_eager": ("bf16_eager_ms", "bf16_graph_ms"),
            "bf16_graph_unpatched_vs_eager": ("bf16_eager_ms", "bf16_graph_unpatched_ms"),
            "bf16_patched_vs_eager": ("bf16_eager_ms", "bf16_patched_ms"),
            "compile_graph_vs_compile": ("bf16_compile_ms", "bf16_compile_graph_ms"),
            "patched_compile_vs_compile": ("bf16_compile_ms", "bf16_patched_compile_ms"),
            "compile_graph_vs_patched_compile": ("bf16_patched_compile_ms", "bf16_compile_graph_ms"),
            "patched_compile_kernels_vs_compile": ("bf16_compile_ms", "bf16_patched_compile_kernels_ms"),
            "compile_vs_eager": ("bf16_eager_ms", "bf16_compile_ms"),
            "fp8_graph_vs_eager": ("fp8_eager_ms", "fp8_graph_ms"),
            "fp8_graph_unpatched_vs_eager": ("fp8_eager_ms", "fp8_graph_unpatched_ms")}


def keys(extra: list[int]) -> list[str]:
    out = ["bf16_eager_ms", "bf16_graph_ms", "bf16_graph_unpatched_ms", "bf16_patched_ms", "bf16_compile_ms",
           "bf16_patched_compile_ms", "bf16_compile_graph_ms", "bf16_patched_compile_kernels_ms"]
    return out + [f"bf16_{r}_{m}_ms" for r in extra for m in ("eager", "graph")] + [
        "fp8_eager_ms", "fp8_graph_ms", "fp8_graph_unpatched_ms"]


def derive(d: dict[str, Any]) -> None:
    sp = {k: H.ratio(d.get(a), d.get(b)) for k, (a, b) in SPEEDUPS.items()}
    for r in d["config"]["extra_resolutions"]:
        sp[f"bf16_{r}_graph_vs_eager"] = H.ratio(d.get(f"bf16_{r}_eager_ms"), d.get(f"bf16_{r}_graph_ms"))
    for name in ("pipeline_bf16_s", "pipeline_fp8_s"):
        p = d.get(name) or {}
        sp[name.replace("_s", "_graph_vs_eager")] = H.ratio(p.get("eager"), p.get("graph"))
    d["speedups"] = {k: (round(v, 4) if v is not None else None) for k, v in sp.items()}
    for k, (key, target) in TARGETS.items():
        m, note = d["speedups"].get(k), (d["details"].get(key) or {}).get("note")
        why = "--tiny smoke run" if d.get("tiny") else note
        d["targets"][k] = {"target": target, "measured": m, "met": None if m is None or why else m >= target,
                           **({"why_not_judged": why} if why else {})}


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.dev = a, a.device
        self.dtype = torch.float32 if a.tiny else torch.bfloat16
        env = H.environment(self.dev)
        cfg = {**vars(a), "device": str(a.device), "out": str(a.out)}
        ks = keys(a.extra_resolutions)
        self.R = H.Results(a.out, "cuda_graph", {
            **H.head("benchmarks/cuda_graph_bench.py (CUDA-graph mode of the transformer call)", env, cfg), "keys": ks,
            **dict.fromkeys(ks), **dict.fromkeys(k.replace("_ms", "_gpu_busy_ms") for k in ks),
            "pipeline_bf16_s": None, "pipeline_fp8_s": None, "speedups": {}, "targets": {}, "details": {},
            "sections": {}}, markdown)
        self.steps = H.Steps([self.R], a.budget_s, cleanup=self.plain)
        self.model: torch.nn.Module | None = None
        self.runner = None
        self.fallbacks: collections.Counter = collections.Counter()

    def write(self) -> None:
        derive(self.R.d)
        self.R.write()

    # ------------------------------------------------------------------ state switches
    def ensure_model(self) -> None:
        if self.model is None:
            a = self.a
            self.model = H.build_transformer(a.tiny, a.num_layers, self.dev, self.dtype, a.seed)
            self.inputs = {r: H.inputs(self.model, max(1, r // 16), a.text_tokens, self.dev, self.dtype, a.seed)
                           for r in sorted({a.resolution, *a.extra_resolutions})}

    def graph_on(self) -> Any:
        self.graph_off()
        self.fallbacks = collections.Counter()
        self.runner = install(self.model, fallbacks=self.fallbacks, max_graphs=self.a.max_graphs)
        return self.runner

    def graph_off(self) -> None:
        if self.runner is not None:
            self.runner.remove()
            self.runner = None
        H.memory_gib(self.dev)

    def plain(self) -> None:
        """Unpatched, uncompiled, no graph mode."""
        self.graph_off()
        if self.model is not None:
            qwen_absorb.unpatch(self.model)
            for m in self.model.modules():
                if getattr(m, "_compiled_call_impl", None) is not None:
                    m._compiled_call_impl = None
        torch._dynamo.reset()

    def run_case(self, key: str, r: int, graph: bool, iters: int | None = None) -> dict[str, Any]:
        a, kw = self.a, self.inputs[r]
        runner = self.graph_on() if graph else None
        try:
            out = H.measure(key, lambda: self.model(**kw), self.dev, a.warmup, iters or a.iters, a.b2b,
                            not a.no_profile)
            if runner is not None:
                d = runner.describe()
                out["graph"], out["fallbacks"] = d, dict(self.fallbacks)
                if d["replays"] == 0:
                    out["note"] = "graph mode did not replay: " + (
                        ", ".join(f"{k} x{v}" for k, v in d["refusals"].items()) or "no reason given")
        finally:
            if graph:
                self.graph_off()
        self.R.d["details"][key] = out
        self.R.put(key, round(out["median_ms"], 4))
        b, why = H.busy(out)
        self.R.put(key.replace("_ms", "_gpu_busy_ms"), b and round(b, 4), why)
        self.write()
        return out

    # ------------------------------------------------------------------ sections
    def bf16(self) -> None:
        a = self.a
        self.plain()
        self.run_case("bf16_eager_ms", a.resolution, graph=False)
        self.run_case("bf16_graph_unpatched_ms", a.resolution, graph=True)
        for r in a.extra_resolutions:
            self.run_case(f"bf16_{r}_eager_ms", r, graph=False)
        rep = qwen_absorb.patch(self.model)
        self.R.d["details"]["patch_report"] = {"kernels_available": rep.kernels_available,
                                               "kernel_unavailable_reasons": list(rep.kernel_unavailable_reasons)}
        self.run_case("bf16_patched_ms", a.resolution, graph=False)
        self.run_case("bf16_graph_ms", a.resolution, graph=True)
        for r in a.extra_resolutions:
            self.run_case(f"bf16_{r}_graph_ms", r, graph=True)
        self.plain()

    def compiled(self, key: str, patch_kw: dict[str, Any] | None, how: str) -> None:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        self.plain()
        left = [n for n, m in self.model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
        if left:
            raise RuntimeError(f"plain() left {len(left)} compiled module(s), e.g. {left[:3]}")
        counters.clear()
        rep = qwen_absorb.patch(self.model, **patch_kw) if patch_kw is not None else None
        t0 = time.perf_counter()
        self.model.compile_repeated_blocks(**({"backend": "eager"} if self.a.tiny else {}))
        wrap_s = time.perf_counter() - t0
        d = self.run_case(key, self.a.resolution, graph=False)
        d.update(compile_and_first_call_s=round(wrap_s + d["first_call_s"], 2), how=how, dynamo=H.dynamo_counters())
        if rep is not None:
            d.update(patch_summary=H.summary(rep), runtime_fallbacks=H.fallbacks(rep))
        self.write()

    def compile(self) -> None:
        call = "compile_repeated_blocks(backend='eager')" if self.a.tiny else "compile_repeated_blocks()"
        self.R.d["details"]["compile_call"] = call
        self.compiled("bf16_compile_ms", None, f"unpatched + {call}")
        self.compiled("bf16_patched_compile_ms", {}, f"qwen_absorb.patch(model) + {call}")
        self.run_case("bf16_compile_graph_ms", self.a.resolution, graph=True)  # on top of the patched compiled model
        self.R.d["details"]["bf16_compile_graph_ms"]["how"] = f"qwen_absorb.patch(model) + {call} + cuda_graph"
        if self.a.compile_kernels:
            self.compiled("bf16_patched_compile_kernels_ms", {"kernels_under_compile": True},
                          f"qwen_absorb.patch(model, kernels_under_compile=True) + {call}")
        else:
            self.R.skip("bf16_patched_compile_kernels_ms", "not requested (--compile-kernels)")
        self.plain()

    def quantize(self) -> None:
        if not self.R.d.get("fp8_quantized"):
            self.plain()
            s = H.fp8_quantize(self.model, self.inputs[self.a.resolution])
            self.R.d["fp8_quantized"] = {"how": "qwen_absorb.testing.fp8_quantize (mtq.FP8_DEFAULT_CFG, fake quant)",
                                         "calibration_s": s}

    def fp8(self) -> None:
        a = self.a
        self.quantize()
        self.run_case("fp8_eager_ms", a.resolution, graph=False, iters=a.iters_fp8)
        self.run_case("fp8_graph_unpatched_ms", a.resolution, graph=True, iters=a.iters_fp8)
        qwen_absorb.patch(self.model)
        self.run_case("fp8_graph_ms", a.resolution, graph=True, iters=a.iters_fp8)
        self.plain()

    def pipeline(self, key: str, runs: int) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline  # noqa: PLC0415

        a, dev, dt = self.a, self.dev, self.dtype
        self.plain()
        cfg = self.model.config
        vae = H.tiny_vae(cfg.out_channels, 4 if a.tiny else 8, dt, dev)
        prompt = H.prompt_kwargs(cfg.joint_attention_dim, dev, dt, a.seed, 7 if a.tiny else a.text_tokens,
                                 3 if a.tiny else a.neg_text_tokens)
        pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
                                 tokenizer=None, transformer=self.model)
        pipe.set_progress_bar_config(disable=True)

        def generate(steps: int) -> tuple[float, torch.Tensor]:
            H.sync(dev)
            t0 = time.perf_counter()
            with torch.inference_mode():
                img = pipe(**prompt, height=a.pipeline_size, width=a.pipeline_size, num_inference_steps=steps,
                           generator=torch.Generator("cpu").manual_seed(a.seed), output_type="pt").images
            H.sync(dev)
            return time.perf_counter() - t0, img

        generate(1)  # eager warm-up
        eager = [generate(a.pipeline_steps) for _ in range(runs)]
        qwen_absorb.patch(self.model)
        runner = self.graph_on()
        first_s, first_img = generate(a.pipeline_steps)
        graph = [generate(a.pipeline_steps) for _ in range(runs)]
        e_img, g_img = eager[-1][1], graph[-1][1]
        self.R.put(key, {
            "eager": round(statistics.median(t for t, _ in eager), 4),
            "graph": round(statistics.median(t for t, _ in graph), 4), "first_call": round(first_s, 4),
            "eager_runs_s": [round(t, 4) for t, _ in eager], "graph_runs_s": [round(t, 4) for t, _ in graph],
            "graph_mode": "qwen_absorb.patch(transformer) + cuda_graph.install(transformer)",
            "steps": a.pipeline_steps, "size": a.pipeline_size, "true_cfg_scale": prompt["true_cfg_scale"],
            "text_tokens": [int(prompt["prompt_embeds"].shape[1]), int(prompt["negative_prompt_embeds"].shape[1])],
            "first_call_images_equal_graph": bool(torch.equal(first_img, g_img)),
            "images_identical_to_unpatched_eager": bool(torch.equal(e_img, g_img)),
            "max_abs_diff_vs_unpatched_eager": float((e_img.float() - g_img.float()).abs().max()),
            "runner": runner.describe(), "fallbacks": dict(self.fallbacks)})
        self.plain()

    def run(self) -> int:
        a, s = self.a, self.steps
        self.write()
        H.log(f"cuda_graph_bench on {self.R.d['gpu'] or 'CPU'}; sections {','.join(a.sections)}; writing {self.R.json}")
        if self.dev.type != "cuda":
            H.log("NOTE: not on CUDA: graph mode refuses every call and runs eager; this checks the script only")
        H.start_profiler(self.dev)
        s("build", self.ensure_model)
        ks = self.R.d["keys"]
        fills = {"bf16": [k for k in ks if k.startswith("bf16") and "compile" not in k],
                 "compile": [k for k in ks if "compile" in k], "fp8": [k for k in ks if k.startswith("fp8")],
                 "pipeline_bf16": ["pipeline_bf16_s"], "pipeline_fp8": ["pipeline_fp8_s"]}
        fns = {"bf16": self.bf16, "compile": self.compile, "fp8": self.fp8,
               "pipeline_bf16": lambda: self.pipeline("pipeline_bf16_s", a.pipeline_runs),
               "pipeline_fp8": lambda: (self.quantize(), self.pipeline("pipeline_fp8_s", a.pipeline_runs_fp8))}
        for name in SECTIONS:
            if name not in a.sections:
                self.R.d["sections"][name] = "not selected (--sections)"
                continue
            if name == "pipeline_bf16" and self.R.d.get("fp8_quantized"):
                self.R.d["sections"][name] = "skipped: the model is already FP8-quantized"
                continue
            ok = self.model is not None and s(name, fns[name], [(self.R, k) for k in fills[name]])
            self.R.d["sections"][name] = "done" if ok else "skipped or failed (see skipped / errors)"
        for k in ks:
            self.R.skip(k, "not measured (section not run, skipped or failed)")
        self.plain()
        self.write()
        H.log(f"wrote {self.R.json} and {self.R.md.name}")
        return 1 if s.failed else 0


def markdown(d: dict[str, Any]) -> str:
    cfg = d.get("config") or {}
    lines = H.md_head("CUDA-graph mode of the Qwen-Image transformer call", d,
                      f"{cfg.get('num_layers')} layers, B = 1, {cfg.get('text_tokens')} text tokens, "
                      f"{'fp32 (--tiny)' if d.get('tiny') else 'bf16'}; median of {cfg.get('iters')} calls (CUDA "
                      f"events) after {cfg.get('warmup')} warm-up; back-to-back = {cfg.get('b2b')} calls; GPU busy "
                      "= sum of kernel durations of one call; first call apart (graph mode: warm-up + capture)")
    det, rows = d.get("details") or {}, []
    for k in d.get("keys") or []:
        r = det.get(k)
        if r is None:
            continue
        parts = k.split("_")
        base = d.get(f"{'_'.join(parts[:2]) if parts[1].isdigit() else parts[0]}_eager_ms")
        p = r.get("profile") or {}
        rows.append([k[:-3] + (f" ({r['note']})" if r.get("note") else ""), r["median_ms"], r.get("b2b_ms"),
                     p.get("gpu_busy_ms"), p.get("kernels_per_call"),
                     f"{H.fmt(H.ratio(base, r['median_ms']))}x", r.get("first_call_s")])
    lines += ["", *H.md_table(["case", "ms/call", "back-to-back ms/call", "GPU busy ms", "kernels", "vs eager",
                               "first call s"], rows)]
    for name in ("pipeline_bf16_s", "pipeline_fp8_s"):
        p = d.get(name)
        if p:
            lines += ["", f"**{name[:-2]}** ({p['steps']} steps, true CFG, {p['size']}^2): eager {H.fmt(p['eager'])} s, "
                          f"graph {H.fmt(p['graph'])} s ({H.fmt(H.ratio(p['eager'], p['graph']))}x), first call "
                          f"{H.fmt(p['first_call'])} s; images identical to unpatched eager: "
                          f"{p['images_identical_to_unpatched_eager']}"]
    lines += ["", *H.md_table(["target", "measured", "required", "met"],
                              [[k, t["measured"], t["target"], str(t["met"])] for k, t in d["targets"].items()])]
    return "\n".join(lines + H.md_footer(d)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    H.add_common_args(p, SECTIONS, budget_s=330.0)
    p.add_argument("--num-layers", type=int, default=None, help="default 60 (--tiny: 2)")
    p.add_argument("--resolution", type=int, default=None, help="main resolution in pixels (default 1024; --tiny: 64)")
    p.add_argument("--extra-resolutions", default=None, help="eager vs graph also at (default 512,2048; --tiny: 32,128)")
    p.add_argument("--text-tokens", type=int, default=None, help="default 128 (--tiny: 8)")
    p.add_argument("--neg-text-tokens", type=int, default=32, help="negative prompt tokens (pipelines)")
    p.add_argument("--warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls, >= 5 (default 7; --tiny: 2)")
    p.add_argument("--iters-fp8", type=int, default=5, help="timed calls in the fp8 section (>= 5)")
    p.add_argument("--b2b", type=int, default=None, help="back-to-back calls (default 5; --tiny: 2)")
    p.add_argument("--pipeline-steps", type=int, default=None, help="default 8 (--tiny: 2)")
    p.add_argument("--pipeline-size", type=int, default=None, help="default 1024 (--tiny: 64)")
    p.add_argument("--pipeline-runs", type=int, default=2, help="timed pipeline runs per mode, bf16")
    p.add_argument("--pipeline-runs-fp8", type=int, default=1, help="timed pipeline runs per mode, fp8")
    p.add_argument("--max-graphs", type=int, default=8)
    p.add_argument("--no-profile", action="store_true", help="skip the GPU busy measurement")
    p.add_argument("--compile-kernels", action="store_true",
                   help="section compile: also patch(kernels_under_compile=True) + compile_repeated_blocks()")
    a = p.parse_args(argv)
    a = H.finish_args(p, a, SECTIONS, "cuda_graph")
    t = a.tiny
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
        a.iters_fp8, a.pipeline_runs, a.pipeline_runs_fp8 = min(a.iters_fp8, a.iters), 1, 1
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
