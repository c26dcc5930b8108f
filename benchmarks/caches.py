#!/usr/bin/env python
"""Issue 40 item 4's benchmark: every diffusers cache on the patched FP8 model (CUDA graphs), speed next to error.

One process, one GPU: the 60-layer random full-size transformer, ModelOpt ``FP8_DEFAULT_CFG`` (calibrated on two
random 1024^2 batches), ``patch(model)`` (CUDA graphs). A denoise loop as QwenImagePipeline runs it with precomputed
prompt embeddings and ``output_type="latent"``: 1024^2 (4096 image tokens), 50 FlowMatch Euler steps, true CFG
(a "cond" and an "uncond" call per step, each in its ``cache_context``, combined and renormalised as the pipeline
does; the negative prompt as long as the positive one: PyramidAttentionBroadcast keeps one state per attention
for both calls and hands the cond call's attention to the uncond one). Same seed, same latents for every case.

Cases, in order (the budget ends the list where it runs out): uncached; each cache with diffusers' defaults, then
with one setting a user would pick for speed: MagCache (ratios calibrated first with ``MagCacheConfig(calibrate=True)``
on this model, as its documentation asks), TaylorSeer's defaults, FirstBlockCache (FBC: decided from tensor values
mid-call, so the model call runs eager around CUDA graphs per block, qwen_absorb.cuda_graph.first_block_cache),
PyramidAttentionBroadcast (PAB); last, the same caches on the unpatched model (speed ratio). Per case: ``wall_s``
(the second of two runs, the first capturing: ``first_run_s``), the graph runner's ``replays`` / ``captures`` /
``eager_calls`` / ``refusals`` during the timed run (model calls), under FBC also its block graphs' ``block_replays``
/ ``block_captures`` / ``block_eager_calls`` (block calls), ``latent_rel_err`` of the final latents against the
uncached patched run. FasterCache: not run (its batched-CFG split raises on Qwen-Image).

    source benchmarks/device_env.sh && python3 benchmarks/caches.py --out $OUT     # H200: <= 200 s
    python3 benchmarks/caches.py --out $OUT --cases fbc_default,fbc_fast             # some cases only
    python benchmarks/caches.py --tiny                                                # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402
from qwen_absorb import step_caches  # noqa: E402

COUNTERS = ("replays", "captures", "eager_calls")


class Clock:  # the pipeline's current timestep (PAB's callback reads it, as from ``pipe.current_timestep``)
    t: Any = None

    def __call__(self) -> Any:
        return self.t


def configs(clock: Clock, mag_ratios: list[float] | None, steps: int) -> dict[str, Any]:
    """Case name -> a function making its config (diffusers' defaults, then one a user would pick for speed)."""
    from diffusers.hooks import (FirstBlockCacheConfig, MagCacheConfig,  # noqa: PLC0415
                                 PyramidAttentionBroadcastConfig, TaylorSeerCacheConfig)

    mag = dict(mag_ratios=mag_ratios, num_inference_steps=steps)
    return {  # the whole-call skippers first (the budget may end the list)
        "mag_default": lambda: MagCacheConfig(**mag),
        "mag_fast": lambda: MagCacheConfig(**mag, threshold=0.24, max_skip_steps=5, retention_ratio=0.1),
        "taylorseer_default": lambda: TaylorSeerCacheConfig(),
        "fbc_default": lambda: FirstBlockCacheConfig(),
        "fbc_fast": lambda: FirstBlockCacheConfig(threshold=0.2),
        "pab_default": lambda: PyramidAttentionBroadcastConfig(current_timestep_callback=clock),
        "pab_fast": lambda: PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=3, spatial_attention_timestep_skip_range=(100, 950),
            current_timestep_callback=clock),
    }


class Caches(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.R = H.Results(a.out, "caches_tiny" if a.tiny else f"caches_{H.gpu_file_tag(a.device)}", {
            **H.head("benchmarks/caches.py (issue 40 item 4)", self.env, self.cfg), "uncached_s": None,
            "uncached_unpatched_s": None, "mag_ratios": None, "cases": {}, "faster_cache": (
                "not run: its denoiser hook splits batched cond/uncond inputs, QwenImagePipeline calls them apart "
                "(raises on Qwen-Image, patched or not); with is_guidance_distilled=True its attention "
                "approximation runs eager, exact")}, markdown)
        self.steps = H.Steps([self.R], a.budget_s, cleanup=self.cleanup)
        self.clock = Clock()
        self.model: torch.nn.Module | None = None
        self.report: Any = None
        self.ref: torch.Tensor | None = None
        self.run_s = 0.0  # the last timed run (the budget's estimate of the next)

    def cleanup(self) -> None:
        if self.model is not None:
            with contextlib.suppress(Exception):
                self.model.disable_cache()

    def build(self) -> None:
        a = self.a
        self.model = H.build_transformer(a.tiny, a.num_layers, self.dev, torch.bfloat16, a.seed)
        calib = [H.inputs(self.model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 10 + i, t)
                 for i, t in enumerate((0.9, 0.5))]
        self.R.put("timings_s.fp8_quantize", H.fp8_quantize(self.model, calib))
        self.pos = H.inputs(self.model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 1)
        self.neg = H.inputs(self.model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 2)
        g = torch.Generator("cpu").manual_seed(a.seed)
        self.latents = torch.randn(self.pos["hidden_states"].shape, generator=g).to(self.dev, torch.bfloat16)
        self.report = qwen_absorb.patch(self.model)

    def denoise(self) -> torch.Tensor:
        """One 50-step true-CFG loop as QwenImagePipeline's (scheduler, combination, renormalisation)."""
        from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: PLC0415

        m, steps, scale = self.model, self.a.steps, 4.0
        sched = FlowMatchEulerDiscreteScheduler()
        sched.set_timesteps(steps, device=self.dev)
        latents = self.latents.clone()
        pos, neg = dict(self.pos), dict(self.neg)
        with torch.inference_mode():
            for t in sched.timesteps:
                self.clock.t = t
                ts = (t.expand(latents.shape[0]) / 1000).to(latents.dtype)
                outs = []
                for name, kw in (("cond", pos), ("uncond", neg)):
                    kw["hidden_states"], kw["timestep"] = latents, ts
                    with m.cache_context(name):
                        outs.append(m(**kw)[0])
                comb = outs[1] + scale * (outs[0] - outs[1])
                noise = comb * (torch.norm(outs[0], dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
                latents = sched.step(noise, t, latents, return_dict=False)[0]
            m._reset_stateful_cache()  # what the pipeline does at the end of a call (maybe_free_model_hooks)
        H.sync(self.dev)
        return latents.float()

    def counters(self) -> dict[str, Any]:
        g = self.report.cuda_graph if self.report is not None else None
        if not g:
            return {}
        fbc = g.get("first_block_cache") or {}  # FirstBlockCache's per-block graphs (block calls)
        return {**{k: g.get(k, 0) for k in COUNTERS}, **{"block_" + k: fbc.get(k, 0) for k in COUNTERS},
                "refusals": dict(g.get("refusals") or {})}

    def timed(self, runs: int) -> tuple[list[float], torch.Tensor, dict[str, Any]]:
        times, out, before = [], None, {}
        for i in range(runs):
            if i == runs - 1:
                before = self.counters()
            t0 = time.perf_counter()
            out = self.denoise()
            times.append(time.perf_counter() - t0)
        after = self.counters()
        delta = {k: after[k] - before[k] for k in (*COUNTERS, *("block_" + c for c in COUNTERS)) if k in after}
        if after:
            delta["refusals"] = {k: v - before["refusals"].get(k, 0) for k, v in after["refusals"].items()
                                 if v != before["refusals"].get(k, 0)}
        self.run_s = times[-1]
        return times, out, delta

    def fits(self, runs: int) -> str | None:
        """Why a case of ``runs`` runs would end past the budget (None: it fits)."""
        b = self.a.budget_s
        left = b - self.steps.elapsed() if b else None
        if left is not None and runs * self.run_s * 1.3 > left:
            return f"time budget: {left:.0f} s left, a run takes ~{self.run_s:.1f} s"
        return None

    def uncached(self) -> None:
        times, self.ref, delta = self.timed(2)
        self.R.put("uncached_s", round(times[-1], 3))
        self.R.put("details.uncached", {"first_run_s": round(times[0], 3), **delta})

    def calibrate(self) -> None:
        self.R.put("mag_ratios", H.mag_ratios(self.model, self.a.steps, self.denoise))

    def case(self, name: str, make: Any, patched: bool = True) -> None:
        # two runs where graphs are captured in the first (FBC: its blocks' graphs); one where every call runs eager
        cfg = make()
        graphed = step_caches.refusal(cfg) is None or step_caches.is_fbc_config(cfg)
        runs = 2 if patched and graphed else 1
        why = self.fits(runs)
        key = f"cases.{name}." + ("wall_s" if patched else "unpatched_wall_s")
        if why:
            return self.R.skip(key, why)
        self.model.enable_cache(make())
        try:
            times, out, delta = self.timed(runs)
        finally:
            self.model.disable_cache()
        err = H.rel_err(out, self.ref) if self.ref is not None else None
        if patched:
            self.R.put(f"cases.{name}", {"wall_s": round(times[-1], 3), "first_run_s": round(times[0], 3),
                                         "latent_rel_err": err, "config": repr(make()), **delta})
        else:
            self.R.put(key, round(times[-1], 3))
            self.R.put(f"cases.{name}.unpatched_latent_rel_err", err)
            self.R.put(f"cases.{name}.patched_speedup", H.ratio(times[-1], self.R.get(f"cases.{name}.wall_s")))

    def unpatched(self) -> None:
        qwen_absorb.unpatch(self.model)
        self.report = None
        why = self.fits(1)
        if why:
            return self.R.skip("uncached_unpatched_s", why)
        times, _, _ = self.timed(1)
        self.R.put("uncached_unpatched_s", round(times[-1], 3))

    def run(self) -> int:
        s, R = self.steps, self.R
        if not s("build", self.build, [(R, "uncached_s")]) or not s("uncached", self.uncached, [(R, "uncached_s")]):
            R.write()
            return 1
        made = configs(self.clock, None, self.a.steps)
        if self.a.cases:
            made = {k: v for k, v in made.items() if k in self.a.cases.split(",")}
        for name in made:
            if name.startswith("mag") and R.get("mag_ratios") is None:
                if not s("mag_calibrate", self.calibrate, [(R, "mag_ratios")]):
                    continue
                made = {k: v for k, v in configs(self.clock, R.get("mag_ratios"), self.a.steps).items() if k in made}
            s(name, lambda n=name: self.case(n, made[n]), [(R, f"cases.{name}.wall_s")])
        s("unpatched", self.unpatched, [(R, "uncached_unpatched_s")])
        if self.report is None and R.get("uncached_unpatched_s") is not None:
            for name in made:
                if R.get(f"cases.{name}.wall_s") is not None:
                    s(f"{name}_unpatched", lambda n=name: self.case(n, made[n], False),
                      [(R, f"cases.{name}.unpatched_wall_s")])
        R.put("elapsed_s", round(s.elapsed(), 1))
        R.write()
        return 1 if R.d["errors"] else 0


def markdown(d: dict[str, Any]) -> str:
    rows = [["uncached", d.get("uncached_s"), None, 0.0, None, None, None, None]]
    for n, c in (d.get("cases") or {}).items():
        rows.append([n, c.get("wall_s"), c.get("first_run_s"), c.get("latent_rel_err"), c.get("replays"),
                     c.get("eager_calls"), c.get("block_replays") or None, c.get("unpatched_wall_s")])
    lines = H.md_head("diffusers' caches on the patched FP8 model, under CUDA graphs (issue 40 item 4)", d) + [
        "", "60-layer random full-size FP8 transformer, 1024^2, 50 steps true CFG (100 calls), precomputed prompt "
        "embeddings, latents out; wall s of the second of two runs; error: relative L2 of the final latents against "
        "the uncached run (same seed).", "",
        *H.md_table(["case", "wall s", "first run s", "latent rel err", "replays", "eager calls",
                     "block replays (FBC)", "unpatched s"], rows), "",
        f"- uncached, unpatched: {d.get('uncached_unpatched_s')} s",
        f"- FasterCache: {d.get('faster_cache')}"]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, (), budget_s=175.0)
    p.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    defaults = {"num_layers": (60, 2), "side": (64, 4), "text_tokens": (128, 8), "steps": (50, 8)}
    H.add_int_args(p, defaults)
    return Caches(H.finish_args(p, p.parse_args(argv), (), "caches", defaults)).run()


if __name__ == "__main__":
    sys.exit(main())
