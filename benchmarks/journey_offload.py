#!/usr/bin/env python
"""Issue 39's offload keys: a patched FP8 pipeline resident, under ``enable_model_cpu_offload()`` and under group
offloading, 8 steps with true CFG at 1024^2.

One process, one GPU: the 60-layer random full-size transformer in bf16, ModelOpt ``FP8_DEFAULT_CFG`` in place
(calibrated on two random calls), the full VAE (``pipeline_parts.build_vae``), no text encoder: the prompt and
negative prompt embeddings (128 and 32 tokens) are given, on the GPU (under accelerate's model offload they must
be: the hook moves a call's inputs only when it moves the model, see .devrun/readme_offload.md). The transformer is
patched once with the defaults (graphs inside the model-offload hook, originals on the host, graphs decided at the
first call on the GPU) and stays patched through the three modes, in this order:

- ``resident``: the pipeline on the GPU; a warm-up run, then ``--runs`` timed runs: ``resident_8step_s`` (median),
  then one run under torch.profiler for ``details.<section>.gpu_busy_s`` (as in every section but the last);
- ``offload_model``: ``pipe.enable_model_cpu_offload()``; a warm-up run, then timed runs: ``offload_model_8step_s``,
  ``offload_model_peak_gib`` (``max_memory_allocated`` over the timed runs), ``offload_model_graph_replays`` (graph
  replays during the timed runs, from the runner's counters: it sits inside accelerate's hook, captures each
  signature once per run, after the hook moved the weights in, and replays the other steps);
- ``offload_model_redecide``, ``offload_model_host_codes``, ``offload_model_pageable``: the same mode patched again
  with ``Tuning(move_keeps_decisions=False)`` (each return decides every block anew, as before round 35), with
  ``Tuning(host_fp8_codes=True)`` (each return copies the FP8 codes back from the host, kept at the first
  departure; off by default since round 34) and with ``pinned_staging=False`` (the originals cross from pageable
  memory at each rebuild), then the defaults back: ``details.<section>_8step_s``;
- ``offload_group``: hooks removed, ``transformer.enable_group_offload(block_level, 1 block per group,
  use_stream=True)``, the VAE on the GPU; one timed run (no warm-up: each run streams every weight 16 times):
  ``offload_group_8step_s``, its peak and graph refusals (expected: "offloading hook").

A run: ``pipe(prompt_embeds=..., true_cfg_scale=4.0, height=1024, width=1024, num_inference_steps=8,
output_type="pt")``, synchronized, wall seconds. Writes ``<out>/journey_offload_<card>.json`` + ``.md`` (``h200``,
``h100``: ``harness_io.gpu_file_tag``; ``journey.py --offload-json`` merges its keys).

    python benchmarks/journey_offload.py --out $OUT          # H200: about 3 min (+55 s ModelOpt's first build)
    python benchmarks/journey_offload.py --tiny              # CPU smoke run (offload modes with a CPU device)
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import pipeline_parts as P  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

SECTIONS = ("resident", "offload_model", "offload_model_redecide", "offload_model_host_codes", "offload_model_pageable",
            "offload_group")
KEYS = ("offload_model_8step_s", "offload_model_graph_replays", "offload_model_peak_gib", "offload_group_8step_s",
        "resident_8step_s")
VARIANTS = {  # the Tuning of the model-offload sections patched again
    "offload_model_redecide": {"move_keeps_decisions": False},  # each return decides every block anew (< round 35)
    "offload_model_host_codes": {"host_fp8_codes": True},  # each return copies the FP8 codes back from the host
    "offload_model_pageable": {"pinned_staging": False},  # the originals cross from pageable memory at a rebuild
}


class OffloadJourney(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.R = H.Results(a.out, "journey_offload_tiny" if a.tiny else f"journey_offload_{H.gpu_file_tag(a.device)}", {
            **H.head("benchmarks/journey_offload.py (issue 39)", self.env, self.cfg), **dict.fromkeys(KEYS),
            "details": {}}, markdown)
        self.steps = H.Steps([self.R], a.budget_s)
        self.pipe: Any = None
        self.report: Any = None

    # ------------------------------------------------------------------ building

    def build(self) -> None:
        a = self.a
        H.load_modelopt()
        model = H.build_transformer(a.tiny, a.num_layers, self.dev, torch.bfloat16, a.seed)
        calib = [H.inputs(model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 10 + i) for i in range(2)]
        self.R.put("details.fp8_quantize_s", H.fp8_quantize(model, calib))
        del calib
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline  # noqa: PLC0415
        # Qwen-Image's scheduler config and the VAE, no text encoder (embeddings given)
        self.pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**P.SCHEDULER), transformer=model,
                                      vae=P.build_vae(a.tiny, self.dev), text_encoder=None, tokenizer=None)
        self.pipe.set_progress_bar_config(disable=True)
        self.report = qwen_absorb.patch(self.pipe)
        self.R.put("details.patch_gib", H.memory_gib(self.dev))
        dim = model.config.joint_attention_dim
        prompts = H.prompt_kwargs(dim, self.dev, torch.bfloat16, a.seed, a.text_tokens, max(4, a.text_tokens // 4))
        self.call_kw = {**prompts,
                        "height": a.size, "width": a.size, "num_inference_steps": a.pipeline_steps, "output_type": "pt"}

    # ------------------------------------------------------------------ measuring

    def run_once(self) -> float:
        H.sync(self.dev)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.pipe(**self.call_kw, generator=torch.Generator().manual_seed(self.a.seed))
        H.sync(self.dev)
        wall = time.perf_counter() - t0
        if self.a.tiny:  # the hooks diffusers made anew at the end of the run (see _tiny_hooks)
            self._tiny_hooks()
        return wall

    def graph(self) -> dict[str, Any]:
        """The graph runner's counters (``GraphedCall.describe()``, wherever a hook put the runner)."""
        from qwen_absorb import cuda_graph  # noqa: PLC0415

        t = self.pipe.transformer
        for slot in ("forward", "_old_forward"):
            r = t.__dict__.get(slot)
            if isinstance(r, (cuda_graph.GraphedCall, cuda_graph.FirstUse)):
                return r.describe()
        return dict(self.report.cuda_graph or {})

    def timed(self, name: str, runs: int, warmup: int, busy: bool = True) -> dict[str, Any]:
        """Median wall of ``runs`` runs, their peak and graph counters; with ``busy``, one more run under
        torch.profiler for its GPU busy time (the sum of kernel durations; the weights' copies are not kernels)."""
        for _ in range(warmup):
            self.run_once()
        gc.collect()
        H.peak_memory_gib(self.dev)  # reset
        before = self.graph()
        walls = [self.run_once() for _ in range(runs)]
        after = self.graph()
        peak = H.peak_memory_gib(self.dev, reset=False)
        d = {"runs_s": [round(w, 3) for w in walls], "median_s": round(statistics.median(walls), 3),
             "peak_gib": peak and round(peak, 3),
             "graph_replays": after.get("replays", 0) - before.get("replays", 0),
             "graph_captures": after.get("captures", 0) - before.get("captures", 0),
             "graph_invalidations": {r: n - before.get("invalidations", {}).get(r, 0)
                                     for r, n in after.get("invalidations", {}).items()},
             "graph_capture_failures": after.get("capture_failures", {}),
             "graph_fallbacks": dict(self.report.graph_fallbacks), "rebuilds": dict(self.report.rebuilds),
             "runtime_fallbacks": dict(self.report.runtime_fallbacks)}
        if busy:
            prof, why = H.profile_call(self.run_once, self.dev, top=8)
            d["gpu_busy_s"] = prof and round(prof["gpu_busy_ms"] / 1e3, 3)
            d["profile"] = prof or why
        self.R.put(f"details.{name}", H.json_safe(d))
        H.log(f"{name}: {d['median_s']} s median of {runs}, peak {d['peak_gib']} GiB, "
              f"{d['graph_replays']} replays, fallbacks {d['graph_fallbacks']}")
        return d

    def resident(self) -> None:
        d = self.timed("resident", self.a.runs, 1)
        self.R.put("resident_8step_s", d["median_s"])

    def offload_model(self) -> None:
        self.pipe.enable_model_cpu_offload(device="cpu" if self.a.tiny else self.dev)
        if self.a.tiny:
            self._tiny_hooks()
        gc.collect()
        self.R.put("details.offload_model_idle_gib", H.memory_gib(self.dev))  # between runs: nothing on the GPU
        d = self.timed("offload_model", self.a.runs, 1)
        self.R.put("offload_model_8step_s", d["median_s"])
        self.R.put("offload_model_graph_replays", d["graph_replays"])
        self.R.put("offload_model_peak_gib", d["peak_gib"], H.NEEDS_CUDA)
        # two more runs under cProfile: where the host spends a run, functions by own and by cumulative time
        self.R.put("details.offload_model_profile", {"self": H.python_top(self.run_once, by=2, n=25),
                                                     "cumulative": H.python_top(self.run_once, by=3, n=60)})
        if self.cuda:
            self.R.put("details.h2d_gb_per_s", h2d_rates(self.dev))

    def variant(self, name: str) -> None:
        """The model-offload mode with the ``Tuning`` of :data:`VARIANTS` (patch() again: decided anew), then the
        default back."""
        self.report = qwen_absorb.patch(self.pipe, tuning=qwen_absorb.Tuning(**VARIANTS[name]))
        d = self.timed(name, self.a.runs, 1)
        self.R.put(f"details.{name}_8step_s", d["median_s"])
        self.report = qwen_absorb.patch(self.pipe)

    def _tiny_hooks(self) -> None:
        """diffusers says "cpu:0", which the hook's "already there" check never matches (a GPU's "cuda:0" does):
        the CPU device instead, so that the model moves once per run, as on a GPU."""
        for h in getattr(self.pipe, "_all_hooks", None) or ():
            h.hook.execution_device = self.dev

    def offload_group(self) -> None:
        self.pipe.remove_all_hooks()
        self.pipe.vae.to(self.dev)
        t = self.pipe.transformer
        t.enable_group_offload(onload_device=self.dev, offload_device=torch.device("cpu"), offload_type="block_level",
                               num_blocks_per_group=1, use_stream=self.cuda)
        d = self.timed("offload_group", 1, 0, busy=False)  # a run streams every weight 16 times: ~46 s
        self.R.put("offload_group_8step_s", d["median_s"])

    def run(self) -> int:
        s, R = self.steps, self.R
        if not s("build", self.build, [(R, k) for k in KEYS]):
            return 1
        fills = {"resident": ["resident_8step_s"], "offload_model": list(KEYS[:3]), "offload_group": [KEYS[3]]}
        for sec in self.a.sections:
            fn = functools.partial(self.variant, sec) if sec in VARIANTS else getattr(self, sec)
            s(sec, fn, [(R, k) for k in fills.get(sec, [])])
        R.put("details.report", str(self.report)[:3000])
        R.write()
        return 1 if R.d["errors"] else 0


def h2d_rates(dev: torch.device, n: int = 2**30) -> dict[str, float]:
    """Host-to-GPU copy rates (GB/s) of one buffer from pageable memory, from torch's pinned allocator, and from a
    plain host tensor page-locked where it lives (``cudaHostRegister``: no power-of-two rounding)."""
    dst, out = torch.empty(n, dtype=torch.uint8, device=dev), {}
    for name in ("pageable", "pinned", "registered"):
        src = torch.ones(n, dtype=torch.uint8, pin_memory=name == "pinned")
        rt = torch.cuda.cudart()
        if name == "registered" and int(rt.cudaHostRegister(src.data_ptr(), n, 0)) != 0:
            out[name] = None
            continue
        copy = functools.partial(dst.copy_, src, non_blocking=name != "pageable")
        out[name] = round(n / 1e6 / H.time_calls(copy, dev, warmup=1, iters=3)["wall_median_ms"], 2)
        if name == "registered":
            rt.cudaHostUnregister(src.data_ptr())
    return out


def markdown(d: dict[str, Any]) -> str:
    det = d.get("details", {})
    cols = ("median_s", "gpu_busy_s", "peak_gib", "graph_replays", "graph_fallbacks")
    rows = [[name, *((det.get(name) or {}).get(c) for c in cols)] for name in SECTIONS]
    lines = H.md_head("Offloaded pipelines keep graphs (issue 39 C)", d) + [
        "", "Patched FP8 (ModelOpt FP8_DEFAULT_CFG, defaults) 60-layer random transformer, full VAE, prompt "
        "embeddings given, 1024^2, 8 steps, true CFG 4.0; seconds: one synchronized pipeline run.", "",
        *H.md_table(["key", "value"], [[k, d.get(k)] for k in KEYS]), "",
        *H.md_table(["mode", "median s", "GPU busy s", "peak GiB", "graph replays", "graph refusals"], rows)]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, SECTIONS, budget_s=220.0)
    defaults = {"num_layers": (60, 2), "side": (64, 4), "text_tokens": (128, 8), "size": (1024, 64),
                "pipeline_steps": (8, 3), "runs": (3, 1)}
    H.add_int_args(p, defaults)
    return OffloadJourney(H.finish_args(p, p.parse_args(argv), SECTIONS, "journey", defaults)).run()


if __name__ == "__main__":
    sys.exit(main())
