#!/usr/bin/env python
"""Issue 19's speed benchmark: the library defaults against unpatched, compiled and torchao, one process, one GPU.

60-layer random full-size transformer, 1024^2 (4096 image + 128 text tokens), B = 1, no text mask, bf16. Per call
case (harness.measure): first call, ``--warmup`` calls continued for ``--warmup-s`` seconds (3: the clocks reach
their steady state under load, whatever ran before), ``--iters`` (>= 5) timed calls between CUDA events,
synchronized after each (median: wall ms of one call); GPU busy: sum of kernel durations of one profiled call,
whose idle time is attributed in the details (``idle``: gaps inside its span, wall outside it).
default = ``qwen_absorb.patch(model)`` (``cuda_graph="auto"``), eager = ``cuda_graph=False``. Sections, in order:
bf16 (unpatched, default, eager); compile (unpatched + ``compile_repeated_blocks(fullgraph=True)``); fp8 (fp32
reference of the same weights, a copy with ModelOpt FP8_DEFAULT_CFG calibrated on the timing input: fake quant
(``--fake-iters`` calls, ~0.8 s each), default, eager, default + ``compile_repeated_blocks()``, fidelity ratio);
torchao (a bf16 copy, ``quantize_(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))`` on the Linears
in transformer_blocks + ``compile_repeated_blocks()``); pipeline (QwenImagePipeline on the same transformer, random
prompt embeddings, 1024^2, ``output_type="latent"``, a ``--warmup-steps`` warm-up run per mode (with the cache a
whole run, reported as ``first_run_s``): bf16 unpatched 50 steps true CFG 4.0, + ``--cache``; then the transformer
quantized in place and patched (one model resident per mode): the first 50-step call (captures included), 50
steps, + cache, 8 steps cfg 1.0; peak memory per mode).
Writes ``<out>/speed_h200.json`` + ``.md`` after every step: target keys, ``ratios``, ``targets`` (verdicts),
``reports`` (summary, graph/runtime fallbacks of the default patched models), ``details``, gpu, date, versions.

    python benchmarks/speed.py --out DIR       # H200: ~6 min (+~55 s ModelOpt extension build on a fresh machine)
    python benchmarks/speed.py --tiny          # CPU smoke run of every step on a tiny model (~40 s)
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

SECTIONS = ("bf16", "compile", "fp8", "torchao", "pipeline")
CALLS = ("bf16_eager_ms", "bf16_patched_ms", "bf16_patched_eager_ms", "bf16_compile_ms", "bf16_patched_compiled_ms",
         "fp8_fake_ms",
         "fp8_patched_ms", "fp8_patched_eager_ms", "fp8_patched_compiled_ms", "torchao_fp8_compile_ms")
PIPES = ("pipe_bf16_50step_s", "pipe_bf16_cache_s", "pipe_fp8_first_call_s", "pipe_fp8_50step_s", "pipe_fp8_cache_s",
         "pipe_fp8_8step_s")
TARGETS = {  # name: (numerator, denominator, op, target), issue 19 "Targets"; name without denominator: the value
    "fp8_patched_over_bf16_eager": ("fp8_patched_ms", "bf16_eager_ms", "<=", 0.50),
    "torchao_fp8_compile_over_fp8_patched": ("torchao_fp8_compile_ms", "fp8_patched_ms", ">=", 1.8),
    "bf16_eager_over_bf16_patched": ("bf16_eager_ms", "bf16_patched_ms", ">=", 1.45),
    "bf16_compile_over_bf16_patched": ("bf16_compile_ms", "bf16_patched_ms", ">=", 1.15),
    "bf16_patched_wall_over_gpu_busy": ("bf16_patched_ms", "bf16_patched_gpu_busy_ms", "<=", 1.05),
    "fp8_patched_wall_over_gpu_busy": ("fp8_patched_ms", "fp8_patched_gpu_busy_ms", "<=", 1.05),
    "fp8_patched_compiled_over_fp8_patched": ("fp8_patched_compiled_ms", "fp8_patched_ms", "<=", 1.03),
    "fidelity_ratio_forward": ("fidelity_ratio_forward", None, "<=", 1.05),
    "pipe_bf16_50step_over_fp8_50step": ("pipe_bf16_50step_s", "pipe_fp8_50step_s", ">=", 1.95),
    "pipe_bf16_cache_over_fp8_cache": ("pipe_bf16_cache_s", "pipe_fp8_cache_s", ">=", 1.8)}
RATIOS = {"fp8_patched_eager_over_bf16_eager": ("fp8_patched_eager_ms", "bf16_eager_ms"),
          "bf16_patched_compiled_over_bf16_patched": ("bf16_patched_compiled_ms", "bf16_patched_ms"),
          "fp8_patched_eager_over_fp8_patched": ("fp8_patched_eager_ms", "fp8_patched_ms"),
          "bf16_patched_eager_over_bf16_patched": ("bf16_patched_eager_ms", "bf16_patched_ms"),
          "pipe_bf16_cache_over_bf16_50step": ("pipe_bf16_cache_s", "pipe_bf16_50step_s"),
          "pipe_fp8_cache_over_fp8_50step": ("pipe_fp8_cache_s", "pipe_fp8_50step_s")}
IDLE = ("profiled_wall_ms", "idle_in_span_ms", "idle_outside_span_ms")  # harness.idle_summary


class Doc(H.Results):
    def write(self) -> None:  # ratios and verdicts follow every measurement
        d = self.d
        d["ratios"].update({k: H.ratio(d.get(a), d.get(b)) for k, (a, b) in RATIOS.items()})
        for k, (a, b, op, target) in TARGETS.items():
            m = d.get(a) if b is None else H.ratio(d.get(a), d.get(b))
            d["ratios"][k] = m
            d["targets"][k] = {"measured": m, "target": f"{op} {target}",
                               "met": None if m is None or d["tiny"] else (m <= target if op == "<=" else m >= target)}
        super().write()


def uncompile(model: torch.nn.Module) -> None:
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
    torch._dynamo.reset()


class Speed(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        cfg = {**self.cfg, "image_tokens": a.side ** 2, "batch": 1}
        self.R = Doc(a.out, "speed_tiny" if a.tiny else "speed_h200", {
            **H.head("benchmarks/speed.py (issue 19)", self.env, cfg), **dict.fromkeys(CALLS),
            **dict.fromkeys(k.replace("_ms", "_gpu_busy_ms") for k in CALLS), "fidelity_ratio_forward": None,
            **dict.fromkeys(PIPES), "peak_memory_gib": {}, "ratios": {}, "targets": {}, "reports": {},
            "fidelity": {}, "details": {}}, markdown)
        self.steps = H.Steps([self.R], a.budget_s, cleanup=self.cleanup)
        self.model = self.q = self.ref = self.pipe = None
        self.outs: dict[str, torch.Tensor] = {}
        self.fp8_pipe = False

    def cleanup(self) -> None:
        for m in (self.model, self.q):
            if m is not None:
                qwen_absorb.unpatch(m)
                uncompile(m)
                if getattr(m, "_cache_config", None) is not None:
                    m.disable_cache()

    def case(self, key: str, model: torch.nn.Module, rep: Any = None, keep: str | None = None, **extra: Any) -> None:
        a, kw, fake = self.a, self.kw, key == "fp8_fake_ms"
        r = H.measure(key[:-3], lambda: model(**kw)[0], self.dev, 1 if fake else a.warmup, a.fake_iters if fake
                      else a.iters, warmup_s=0.0 if fake else a.warmup_s)
        self.R.put(key, round(r["median_ms"], 4))
        b, why = H.busy(r)
        self.R.put(key.replace("_ms", "_gpu_busy_ms"), b and round(b, 4), why)
        p = r["profile"] or {}
        self.R.put(f"details.{key}", H.json_safe({
            **{k: r[k] for k in ("first_call_s", "wall_median_ms", "min_ms", "max_ms", "samples_ms", "warmup", "iters")},
            "kernels_per_call": p.get("kernels_per_call"), "top_kernels": (p.get("top_kernels_by_time") or [])[:8],
            "warmup_calls": r.get("warmup_calls"), "idle": p.get("idle"),
            **({"report": H.rep_info(rep)} if rep is not None else {}), **extra}))
        if keep:
            with torch.inference_mode():
                self.outs[keep] = model(**kw)[0].float()

    def compiled(self, key: str, model: torch.nn.Module, rep: Any = None, **ckw: Any) -> None:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        uncompile(model)
        counters.clear()
        if self.a.tiny:
            ckw["backend"] = "eager"  # Inductor's C++ build would take minutes on a shared CPU host
        model.compile_repeated_blocks(**ckw)
        try:
            self.case(key, model, rep, how=f"compile_repeated_blocks({', '.join(f'{k}={v!r}' for k, v in ckw.items())})")
            self.R.put(f"details.{key}.dynamo", H.dynamo_counters())
        finally:
            uncompile(model)

    # ------------------------------------------------------------------ steps
    def build(self) -> None:
        a = self.a
        self.model = H.build_transformer(a.tiny, a.num_layers, self.dev, torch.bfloat16, a.seed)
        self.kw32 = H.inputs(self.model, a.side, a.text_tokens, self.dev, torch.float32, a.seed + 1)
        self.kw = H.as_dtype(self.kw32, torch.bfloat16)

    def bf16(self, key: str) -> None:
        m = self.model
        qwen_absorb.unpatch(m)
        if key == "bf16_compile_ms":
            return self.compiled(key, m, fullgraph=True)
        if key == "bf16_patched_compiled_ms":  # each patched block one opaque op (kernels_under_compile="auto")
            try:
                return self.compiled(key, m, H.patched(m, cuda_graph="auto"), fullgraph=True)
            finally:
                qwen_absorb.unpatch(m)
        rep = None if key == "bf16_eager_ms" else H.patched(m, cuda_graph=key == "bf16_patched_ms" and "auto")
        self.case(key, m, rep)
        if key == "bf16_patched_ms":
            self.R.put("reports.bf16_patched", H.rep_info(rep))
        qwen_absorb.unpatch(m)

    def fp32_reference(self) -> None:
        qwen_absorb.unpatch(self.model)
        with H.in_fp32(self.model, self.dev), torch.inference_mode():
            self.ref = self.model(**self.kw32)[0].float()

    def fp8_quantize(self) -> None:
        self.q = copy.deepcopy(self.model)
        self.R.put("fp8_quantization", {"how": "mtq.FP8_DEFAULT_CFG (tests/builders.py fp8_quantize) on a copy, "
                                               "calibrated on the timing input", "s": H.fp8_quantize(self.q, self.kw)})

    def fp8(self, key: str) -> None:
        q = self.q
        if q is None:
            raise RuntimeError("no FP8 model (step fp8_quantize skipped or failed)")
        qwen_absorb.unpatch(q)
        if key == "fp8_fake_ms":
            return self.case(key, q, keep="fake")
        rep = H.patched(q, cuda_graph=key != "fp8_patched_eager_ms" and "auto")
        if key == "fp8_patched_compiled_ms":
            self.compiled(key, q, rep, fullgraph=True)
        else:
            self.case(key, q, rep, keep="patched" if key == "fp8_patched_ms" else None)
        if key == "fp8_patched_ms":
            self.R.put("reports.fp8_patched", H.rep_info(rep))
            if self.ref is not None and "fake" in self.outs:
                ep, ef = (H.rel_err(self.outs[k], self.ref) for k in ("patched", "fake"))
                self.R.put("fidelity", {"rel_err_forward_fp8_patched": ep, "rel_err_forward_fp8_fake": ef,
                                        "reference": "the unquantized model in fp32, fp32 inputs, TF32 off"})
                self.R.put("fidelity_ratio_forward", H.ratio(ep, ef))
            else:
                self.R.put("fidelity_ratio_forward", None, "no fp32 reference or no fake-quant output")
        qwen_absorb.unpatch(q)

    def torchao(self) -> None:
        try:
            import torchao  # noqa: PLC0415
            from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_  # noqa
        except Exception as e:  # noqa: BLE001
            return self.R.put("torchao_fp8_compile_ms", None, f"torchao import failed: {type(e).__name__}: {e}")
        if not self.cuda:
            return self.R.put("torchao_fp8_compile_ms", None, f"{H.NEEDS_CUDA} (torchao FP8 needs sm_89+)")
        qwen_absorb.unpatch(self.model)
        t = copy.deepcopy(self.model)
        try:
            inside = {id(m) for m in t.transformer_blocks.modules()}
            quantize_(t, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()),
                      filter_fn=lambda m, _n: isinstance(m, torch.nn.Linear) and id(m) in inside)
            self.R.put("torchao", {"version": torchao.__version__, "linears": len(
                [m for m in t.transformer_blocks.modules() if isinstance(m, torch.nn.Linear)])})
            self.compiled("torchao_fp8_compile_ms", t)
        finally:
            del t
            H.memory_gib(self.dev)

    def generate(self, steps: int, cfg: bool = True, mode: str | None = None) -> float:
        a, dev, pr = self.a, self.dev, self.prompt
        kw = dict(pr) if cfg else {"prompt_embeds": pr["prompt_embeds"], "prompt_embeds_mask": pr["prompt_embeds_mask"],
                                   "true_cfg_scale": 1.0}
        gc.collect()
        H.peak_memory_gib(dev)  # reset
        H.sync(dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.pipe(**kw, height=a.pipeline_size, width=a.pipeline_size, num_inference_steps=steps,
                      generator=torch.Generator("cpu").manual_seed(a.seed), output_type="latent")
        H.sync(dev)
        dt = time.perf_counter() - t0
        if mode and self.cuda:
            peak = torch.cuda.max_memory_allocated(dev) / 2**30
            gc.collect()
            self.R.put(f"peak_memory_gib.{mode}", {"max_memory_allocated": round(peak, 3),
                                                   "memory_allocated": round(torch.cuda.memory_allocated(dev) / 2**30, 3)})
        elif mode:
            self.R.put(f"peak_memory_gib.{mode}", None, f"{H.NEEDS_CUDA} (torch.cuda.max_memory_allocated)")
        H.log(f"  pipeline {mode or 'warm-up'}: {steps} steps, cfg {kw['true_cfg_scale']}: {dt:.2f} s")
        return dt

    def set_cache(self, on: bool) -> str | None:
        from diffusers import FirstBlockCacheConfig, TaylorSeerCacheConfig  # noqa: PLC0415

        if getattr(self.model, "_cache_config", None) is not None:
            self.model.disable_cache()
        if on:
            self.model.enable_cache({"fbc": lambda: FirstBlockCacheConfig(threshold=0.2),
                                     "taylorseer": TaylorSeerCacheConfig}[self.a.cache]())
        return repr(self.model._cache_config) if on else None

    def pipe_case(self, key: str, cfg: bool = True, cache: bool = False, warm: bool = True, runs: int = 1,
                  reserve_s: float = 0.0) -> None:
        """One pipeline mode: a warm-up run (``--warmup-steps``; with the cache a whole run of ``--steps``, the
        same for bf16 and FP8: the cache's step kinds (compute, predict) only all occur in a long run, and graph
        mode captures each kind once; that first run is reported as ``first_run_s``), then the timed runs."""
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline  # noqa: PLC0415

        a, mode, steps = self.a, key[5:-2], self.a.steps if cfg else self.a.fast_steps
        if self.pipe is None:
            c = self.model.config
            self.prompt = H.prompt_kwargs(c.joint_attention_dim, self.dev, torch.bfloat16, a.seed, a.text_tokens,
                                          a.neg_text_tokens)
            self.pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder=None, tokenizer=None,
                                          vae=H.tiny_vae(c.out_channels, 4 if a.tiny else 8, torch.bfloat16, self.dev),
                                          transformer=self.model)
            self.pipe.set_progress_bar_config(disable=True)
        if mode.startswith("fp8") and not self.fp8_pipe:
            raise RuntimeError("the FP8 pipeline model is not ready (step pipe_fp8_first_call skipped or failed)")
        how = self.set_cache(cache)
        try:
            first = None
            if warm:
                first = self.generate(steps if cache else a.warmup_steps, cfg)
            times = [self.generate(steps, cfg, mode)]
            while len(times) < runs and self.steps.elapsed() + times[0] + reserve_s < (a.budget_s or 1e9):
                times.append(self.generate(steps, cfg, mode))
            rep = qwen_absorb.patch_report(self.model)
            self.R.put(key, round(statistics.median(times), 4))
            self.R.put(f"details.{key}", H.json_safe({
                "runs_s": [round(t, 4) for t in times], "steps": steps, "true_cfg_scale": 4.0 if cfg else 1.0,
                "cache": how, "warmup": f"one {steps if cache else a.warmup_steps}-step run" if warm else "none",
                "first_run_s": round(first, 4) if first is not None and cache else None,
                "model": "FP8 patched (defaults)" if rep else "bf16 unpatched", "report": rep and H.rep_info(rep)}))
        finally:
            self.set_cache(False)

    def pipe_fp8_first_call(self) -> None:
        self.set_cache(False)
        qwen_absorb.unpatch(self.model)
        s = H.fp8_quantize(self.model, self.kw)  # in place: the bf16 pipeline runs are done
        t0 = time.perf_counter()
        H.patched(self.model, cuda_graph="auto")
        self.fp8_pipe = True
        self.R.put("pipe_fp8_model", {"quantize_s": s, "patch_s": round(time.perf_counter() - t0, 3), "how":
                                      "transformer quantized in place (same calibration), qwen_absorb.patch(pipe)"})
        self.pipe_case("pipe_fp8_first_call_s", warm=False)

    def run(self) -> int:
        a, s, R = self.a, self.steps, self.R
        H.load_modelopt()  # before any model exists (harness.load_modelopt)
        R.write()
        H.log(f"speed on {R.d['gpu'] or 'CPU'}; sections {','.join(a.sections)}; writing {R.json}")
        H.start_profiler(self.dev)
        if not s("build", self.build):
            return 1
        pipe50 = dict(runs=a.pipeline_runs)
        plan = [*(("bf16" if "compile" not in k else "compile", k, lambda k=k: self.bf16(k)) for k in CALLS[:5]),
                ("fp8", "fp32_reference", self.fp32_reference), ("fp8", "fp8_quantize", self.fp8_quantize),
                *(("fp8", k, lambda k=k: self.fp8(k)) for k in CALLS[5:9]),
                ("torchao", "torchao_fp8_compile_ms", self.torchao),
                ("pipeline", "pipe_bf16_50step_s", lambda: self.pipe_case("pipe_bf16_50step_s", reserve_s=150, **pipe50)),
                ("pipeline", "pipe_bf16_cache_s", lambda: self.pipe_case("pipe_bf16_cache_s", cache=True)),
                ("pipeline", "pipe_fp8_first_call_s", self.pipe_fp8_first_call),
                ("pipeline", "pipe_fp8_50step_s", lambda: self.pipe_case("pipe_fp8_50step_s", warm=False, reserve_s=40,
                                                                         **pipe50)),
                ("pipeline", "pipe_fp8_cache_s", lambda: self.pipe_case("pipe_fp8_cache_s", cache=True)),
                ("pipeline", "pipe_fp8_8step_s", lambda: self.pipe_case("pipe_fp8_8step_s", cfg=False))]
        for sec, name, fn in plan:
            if sec in a.sections:
                s(name.removesuffix("_ms").removesuffix("_s"), fn,
                  [(R, name)] + ([(R, "fidelity_ratio_forward")] if name == "fp8_patched_ms" else []))
            if name == "fp8_patched_compiled_ms":
                self.q, self.outs = None, {}  # the FP8 copy is not needed after the fp8 section
                H.memory_gib(self.dev)
        for k in (*CALLS, "fidelity_ratio_forward", *PIPES):
            R.skip(k, "not measured (section not selected, skipped or failed)")
        self.cleanup()
        R.write()
        H.log(f"wrote {R.json} and {R.md.name}")
        return 1 if s.failed else 0


def markdown(d: dict[str, Any]) -> str:
    c, det, mem = d.get("config") or {}, d.get("details") or {}, d.get("peak_memory_gib") or {}
    lines = H.md_head("Speed of the library defaults vs peers (issue 19)", d,
                      f"{c.get('num_layers')} layers, {c.get('image_tokens')} image + {c.get('text_tokens')} text "
                      f"tokens, B = 1, bf16, no mask; median of {c.get('iters')} timed calls after {c.get('warmup')} "
                      f"warm-up, continued to {c.get('warmup_s')} s (steady clocks; fp8_fake: {c.get('fake_iters')} "
                      "calls after 1, ~0.8 s a call); ms = CUDA events around one synchronized call; GPU busy = kernel time of one profiled call; default = "
                      "qwen_absorb.patch(model), cuda_graph='auto'")
    rows = [[k[:-3], d.get(k), d.get(k[:-3] + "_gpu_busy_ms"), H.ratio(d.get(k), d.get(k[:-3] + "_gpu_busy_ms")),
             (det.get(k) or {}).get("kernels_per_call"), (det.get(k) or {}).get("first_call_s"),
             H.ratio(d.get("bf16_eager_ms"), d.get(k)),  # the profiled call's wall, where its GPU idled
             *(((det.get(k) or {}).get("idle") or {}).get(i) for i in IDLE)] for k in CALLS]
    f = d.get("fidelity") or {}
    lines += ["", *H.md_table(["case", "ms", "GPU busy ms", "wall/busy", "kernels", "first call s", "vs bf16 eager",
                               "profiled: wall ms", "idle in span", "idle outside span"], rows), "",
              f"Fidelity (forward vs fp32): default FP8 {H.fmt(f.get('rel_err_forward_fp8_patched'))}"
              f", fake quant {H.fmt(f.get('rel_err_forward_fp8_fake'))}, ratio {H.fmt(d.get('fidelity_ratio_forward'))}",
              "", f"Pipeline: QwenImagePipeline {c.get('pipeline_size')}^2, latents out, cache `{c.get('cache')}` "
              "(calls graph mode refuses run eager: graph_fallbacks in the details)", "",
              *H.md_table(["run", "s", "runs s", "first run s", "steps", "cfg", "cache", "peak GiB", "allocated GiB"], [
                  [k, d.get(k), str((det.get(k) or {}).get("runs_s")), (det.get(k) or {}).get("first_run_s") or "-",
                   (det.get(k) or {}).get("steps"),
                   (det.get(k) or {}).get("true_cfg_scale"), ((det.get(k) or {}).get("cache") or "-")[:60],
                   (mem.get(k[5:-2]) or {}).get("max_memory_allocated"), (mem.get(k[5:-2]) or {}).get("memory_allocated")]
                  for k in PIPES]), "",
              *H.md_table(["target (issue 19)", "measured", "required", "met"],
                          [[k, t["measured"], t["target"], str(t["met"])] for k, t in (d.get("targets") or {}).items()])]
    lines += [f"\n`{n}`: graph_fallbacks {r.get('graph_fallbacks')}, runtime_fallbacks {r.get('runtime_fallbacks')}, "
              f"summary `{r.get('summary')}`" for n, r in (d.get("reports") or {}).items()]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, SECTIONS, budget_s=500.0, description=__doc__.split("\n\n")[0])
    defaults = {"num_layers": (60, 2), "side": (64, 8), "text_tokens": (128, 8), "neg_text_tokens": (32, 4),
                "warmup": (2, 1), "iters": (7, 2), "fake_iters": (3, 1), "pipeline_size": (1024, 64), "steps": (50, 3),
                "fast_steps": (8, 2), "warmup_steps": (3, 1)}
    H.add_int_args(p, defaults)
    H.add_steady_warmup_arg(p)
    p.add_argument("--pipeline-runs", type=int, default=2, help="timed runs of the 50-step modes, budget allowing")
    p.add_argument("--cache", choices=("taylorseer", "fbc"), default="taylorseer",
                   help="taylorseer: TaylorSeerCacheConfig() (diffusers' defaults: a fixed schedule, no host sync, the "
                        "same skips in bf16 and FP8); fbc: FirstBlockCacheConfig(threshold=0.2) (decides on the host)")
    a = H.finish_args(p, p.parse_args(argv), SECTIONS, "speed", defaults)
    a.warmup_s = H.steady_warmup_s(a)
    if not a.tiny and a.iters < 5:
        p.error("--iters must be >= 5 (medians of at least 5 timed calls)")
    return Speed(a).run()


if __name__ == "__main__":
    sys.exit(main())
