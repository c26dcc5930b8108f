#!/usr/bin/env python
"""Issue 39's benchmark: the checkpoints users can get, in the memory they have (all keys but the offload ones).

One process, one GPU, the 60-layer random full-size transformer at 1024^2 (4096 image + 128 text tokens), B = 1;
each timed case is ``harness.measure`` (median of ``--iters`` >= 5 synchronized calls after warm-up); a model's
memory is ``memory_allocated`` after ``gc.collect()``. Sections, in order:

- ``fp8``: ``bf16_model_gib`` (built), ``bf16_patched_ms`` (``patch(model)``); ModelOpt ``FP8_DEFAULT_CFG`` in
  place; ``fp8_default_ms`` / ``fp8_default_model_gib`` (``patch(model)``, today's defaults) and
  ``fp8_prev_default_ms`` (``patch(model, offload_original_weights=False)``, the previous default);
- ``pipeline``: ``pipeline_resident_peak_gib``: a whole ``QwenImagePipeline`` resident on the GPU (the FP8
  transformer patched with defaults, the Qwen2.5-VL-7B text encoder in bf16, random weights, the full VAE;
  ``pipeline_parts``), one 1024^2 true-CFG call after a warm-up call: ``max_memory_allocated``;
- ``nvfp4``: a fresh bf16 model, ``mtq.quantize(..., modelopt_recipe.nvfp4_recipe_config(model))`` (ModelOpt's
  ``NVFP4_DEFAULT_CFG`` with NVIDIA's export layout: blocks 0, 1, 58, 59 in bf16), calibrated; ``nvfp4_fake_ms``
  (ModelOpt's fake quantization, unpatched); exported (``modelopt_recipe.export_hf``) and loaded back
  (``modelopt_recipe.load_hf_export``: ``nvfp4_export_loaded``); on the loaded model ``nvfp4_patched_ms``,
  ``nvfp4_model_gib`` (patched), and ``nvfp4_bit_identical_to_fake``: the patched outputs, eager
  (``cuda_graph=False``) and default (graphs), equal to the loaded model's unpatched fake-quant output.
Any step that fails records its error string under its keys (``errors``) and the next runs. The offload keys come
from ``journey_offload.py``'s JSON where present: ``--offload-json``, else ``<out>/`` or ``benchmarks/results/``
``journey_offload_h200.json``.
Writes ``<out>/journey_h200.json`` + ``.md``.

    python benchmarks/journey.py --out $OUT --sections fp8,pipeline         # H200: ~4 min (+55 s ModelOpt build)
    python benchmarks/journey.py --out $OUT --sections nvfp4 --merge-json part1/journey_h200.json   # ~5 min
    python benchmarks/journey.py --tiny                               # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import pipeline_parts as P  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

SECTIONS = ("fp8", "pipeline", "nvfp4")
KEYS = ("bf16_model_gib", "bf16_patched_ms", "fp8_default_model_gib", "fp8_default_ms", "fp8_prev_default_ms",
        "nvfp4_export_loaded", "nvfp4_fake_ms", "nvfp4_patched_ms", "nvfp4_bit_identical_to_fake", "nvfp4_model_gib",
        "pipeline_resident_peak_gib")
OFFLOAD_KEYS = ("offload_model_8step_s", "offload_model_graph_replays", "offload_model_peak_gib",
                "offload_group_8step_s", "resident_8step_s")
TARGETS = {"fp8_default_model_gib": ("<=", 21), "fp8_default_over_prev_default": ("<=", 1.03),
           "nvfp4_patched_over_bf16_patched": ("<=", 1.15), "pipeline_resident_peak_gib": ("<=", 40)}


class Journey(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        part = {}  # an earlier part's keys (another device call), kept where this part does not measure them
        if a.merge_json is not None and Path(a.merge_json).is_file():
            old = json.loads(Path(a.merge_json).read_text())
            part = {k: old[k] for k in (*KEYS, "details") if old.get(k) is not None}
        self.R = H.Results(a.out, "journey_tiny" if a.tiny else "journey_h200", {
            **H.head("benchmarks/journey.py (issue 39)", self.env, self.cfg), **dict.fromkeys(KEYS),
            **dict.fromkeys(OFFLOAD_KEYS), "ratios": {}, "targets": {}, "details": {}, **part}, markdown)
        self.steps = H.Steps([self.R], a.budget_s, cleanup=self.cleanup)
        self.model: torch.nn.Module | None = None
        self.pipe = None
        self.fp8_ready = False

    def cleanup(self) -> None:
        for m in (self.model, getattr(self.pipe, "transformer", None)):
            if m is not None:
                qwen_absorb.unpatch(m)

    def free(self) -> None:
        self.cleanup()
        self.model = self.pipe = None
        H.memory_gib(self.dev)

    def timed(self, key: str, model: torch.nn.Module, kw: dict[str, Any], iters: int | None = None,
              **patch_kw: Any) -> torch.Tensor:
        """``key``: the median ms of ``model(**kw)`` patched with ``patch_kw`` (``None``: unpatched); returns
        one output (for bit comparisons). The model stays patched (its memory is read after)."""
        if patch_kw.pop("unpatched", False):
            rep = None
        else:
            qwen_absorb.unpatch(model)
            rep = qwen_absorb.patch(model, **patch_kw)
        r = H.measure(key, lambda: model(**kw)[0], self.dev, self.a.warmup, iters or self.a.iters,
                      warmup_s=self.a.warmup_s)
        self.R.put(key, round(r["median_ms"], 4))
        b, _ = H.busy(r)
        self.R.put(f"details.{key.split('.')[-1]}", {"wall_median_ms": r["wall_median_ms"], "gpu_busy_ms": b,
                                      "first_call_s": r["first_call_s"], "samples_ms": r["samples_ms"],
                                      "report": None if rep is None else H.summary(rep)})
        with torch.inference_mode():
            return model(**kw)[0].clone()

    def mem(self, key: str) -> None:
        g = H.memory_gib(self.dev)
        self.R.put(key, None if g is None else round(g, 3), H.NEEDS_CUDA)

    def build(self) -> None:
        a = self.a
        self.free()
        self.fp8_ready = False
        self.model = H.build_transformer(a.tiny, a.num_layers, self.dev, torch.bfloat16, a.seed)
        self.kw = H.inputs(self.model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 1)
        self.calib = [H.inputs(self.model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 10 + i, t)
                      for i, t in enumerate((0.9, 0.5)[: a.calib])]

    # ------------------------------------------------------------------ fp8
    def bf16(self) -> None:
        self.build()
        self.mem("bf16_model_gib")
        self.timed("bf16_patched_ms", self.model, self.kw)
        qwen_absorb.unpatch(self.model)

    def fp8(self) -> None:
        self.R.put("details.fp8_quantize_s", H.fp8_quantize(self.model, self.calib))
        self.fp8_ready = True
        self.timed("fp8_default_ms", self.model, self.kw)
        self.mem("fp8_default_model_gib")
        self.timed("fp8_prev_default_ms", self.model, self.kw, offload_original_weights=False)
        self.mem("details.fp8_prev_default_model_gib")
        qwen_absorb.unpatch(self.model)

    # ------------------------------------------------------------------ pipeline
    def pipeline(self) -> None:
        a = self.a
        if self.model is None or not self.fp8_ready:  # the fp8 section did not run (or failed)
            self.build()
            H.fp8_quantize(self.model, self.calib)
        model, self.model = self.model, None
        self.kw = self.calib = None
        gc.collect()
        self.pipe = P.build_pipeline(model, a.tiny, self.dev)
        reps = P.patch_pipeline(self.pipe)
        call = dict(prompt=P.PROMPT, negative_prompt=" ", true_cfg_scale=4.0, height=a.size, width=a.size,
                     num_inference_steps=a.pipeline_steps, generator=torch.Generator("cpu").manual_seed(a.seed))
        P.call(self.pipe, self.dev, **call)  # warm-up: captures, allocator
        H.memory_gib(self.dev)
        H.peak_memory_gib(self.dev)  # reset
        wall, stages, _ = P.call(self.pipe, self.dev, **call)
        peak = H.peak_memory_gib(self.dev, reset=False)
        self.R.put("pipeline_resident_peak_gib", peak and round(peak, 3), H.NEEDS_CUDA)
        self.R.put("details.pipeline", H.json_safe({
            "wall_s": wall, "stages": stages, "steps": a.pipeline_steps, "size": a.size,
            "resident_gib": H.memory_gib(self.dev), "reports": {k: repr(v)[:300] for k, v in reps.items()}}))
        P.unpatch_pipeline(self.pipe)
        self.free()

    # ------------------------------------------------------------------ nvfp4
    def nvfp4(self) -> None:
        from qwen_absorb import nvfp4  # noqa: PLC0415

        # ModelOpt has no CPU path for NVFP4 fake quantization: on CPU its reference stands in (tiny runs)
        with contextlib.nullcontext() if self.cuda else nvfp4.modelopt_fake_quant_on_cpu():
            self.nvfp4_steps()

    def nvfp4_steps(self) -> None:
        from qwen_absorb import modelopt_recipe as recipe  # noqa: PLC0415

        a = self.a
        self.build()
        keep = {"keep_first": 1, "keep_last": 1} if a.tiny else {}  # full: NVIDIA's layout (0, 1, 58, 59 in bf16)
        cfg = recipe.nvfp4_recipe_config(self.model, **keep)
        batches = self.calib

        def loop(m: torch.nn.Module) -> None:
            with torch.no_grad():
                for kw in batches:
                    m(**kw)

        with H.quiet():
            recipe.quantize(self.model, cfg, loop)
        self.timed("nvfp4_fake_ms", self.model, self.kw, iters=a.fake_iters, unpatched=True)
        folder = Path(tempfile.mkdtemp(prefix="journey_nvfp4_", dir=a.export_dir))
        try:
            recipe.export_hf(self.model, folder)
            self.model = None
            H.memory_gib(self.dev)
            self.model = recipe.load_hf_export(folder, dtype=torch.bfloat16, device=self.dev)
            self.R.put("nvfp4_export_loaded", True)
            self.R.put("details.nvfp4_export_gib", round(sum(f.stat().st_size for f in folder.rglob("*")) / 2**30, 3))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.mem("details.nvfp4_loaded_unpatched_gib")
        with torch.inference_mode():
            fake = self.model(**self.kw)[0].clone()
        eager = self.timed("details.nvfp4_patched_eager_ms", self.model, self.kw, cuda_graph=False)
        graph = self.timed("nvfp4_patched_ms", self.model, self.kw)
        self.mem("nvfp4_model_gib")
        same = {"eager": torch.equal(eager, fake), "graph": torch.equal(graph, fake)}
        self.R.put("details.nvfp4_bit_identical", {**same, "max_abs_diff_graph": (graph.float() - fake.float())
                                                   .abs().max().item()})
        self.R.put("nvfp4_bit_identical_to_fake", same["eager"] and same["graph"])
        self.free()

    # ------------------------------------------------------------------ run
    def merge_offload(self) -> None:
        found = [p for p in (self.a.offload_json, self.a.out / "journey_offload_h200.json",
                             H.RESULTS / "journey_offload_h200.json") if p is not None and Path(p).is_file()]
        path = found[0] if found else (self.a.offload_json or self.a.out / "journey_offload_h200.json")
        if not found:
            return self.R.d["skipped"].update({k: f"no {path}" for k in OFFLOAD_KEYS if self.R.get(k) is None})
        off = json.loads(Path(path).read_text())
        for k in OFFLOAD_KEYS:
            self.R.put(k, off.get(k), f"not in {path}")
        self.R.put("details.offload_source", {"file": str(path), "date": off.get("date"), "gpu": off.get("gpu")})

    def verdicts(self) -> None:
        d = self.R.d
        d["ratios"] = {"fp8_default_over_prev_default": H.ratio(d.get("fp8_default_ms"), d.get("fp8_prev_default_ms")),
                       "nvfp4_patched_over_bf16_patched": H.ratio(d.get("nvfp4_patched_ms"), d.get("bf16_patched_ms")),
                       "nvfp4_fake_over_nvfp4_patched": H.ratio(d.get("nvfp4_fake_ms"), d.get("nvfp4_patched_ms"))}
        for k, (op, t) in TARGETS.items():
            m = d["ratios"].get(k, d.get(k))
            d["targets"][k] = {"measured": m, "target": f"{op} {t}", "met": None if m is None or d["tiny"] else m <= t}

    def run(self) -> int:
        s, R, secs = self.steps, self.R, self.a.sections
        fill = {"fp8": KEYS[:5], "pipeline": KEYS[10:], "nvfp4": KEYS[5:10]}
        if "fp8" in secs:
            s("bf16", self.bf16, [(R, k) for k in KEYS[:2]])
            s("fp8", self.fp8, [(R, k) for k in KEYS[2:5]])
        for sec in ("pipeline", "nvfp4"):
            if sec in secs:
                s(sec, getattr(self, sec), [(R, k) for k in fill[sec]])
        self.merge_offload()
        self.verdicts()
        R.write()
        return 1 if R.d["errors"] else 0


def markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("The journey: checkpoints, memory, pipelines (issue 39)", d) + [
        "", "60-layer random full-size transformer, 1024^2, B = 1; ms: median of synchronized calls after warm-up; "
        "GiB: memory_allocated after gc (peak: max_memory_allocated).", "",
        *H.md_table(["key", "value"], [[k, d.get(k)] for k in (*KEYS, *OFFLOAD_KEYS)]), "",
        *H.md_table(["target", "measured", "required", "met"],
                    [[k, t["measured"], t["target"], str(t["met"])] for k, t in (d.get("targets") or {}).items()])]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, SECTIONS, budget_s=540.0)
    defaults = {"num_layers": (60, 4), "side": (64, 4), "text_tokens": (128, 8), "warmup": (2, 1), "iters": (7, 2),
                "fake_iters": (5, 2), "calib": (1, 1), "size": (1024, 64), "pipeline_steps": (4, 2)}
    H.add_int_args(p, defaults)
    H.add_steady_warmup_arg(p)
    p.add_argument("--merge-json", type=Path, default=None, help="an earlier part's journey_h200.json to extend")
    p.add_argument("--offload-json", type=Path, default=None, help="journey_offload.py's JSON to merge")
    p.add_argument("--export-dir", default=None, help="where the NVFP4 export is written (default: the temp dir)")
    a = H.finish_args(p, p.parse_args(argv), SECTIONS, "journey", defaults)
    a.warmup_s = 1.0 if a.warmup_s is None and not a.tiny else H.steady_warmup_s(a)
    if not a.tiny and min(a.iters, a.fake_iters) < 5:
        p.error("--iters and --fake-iters must be >= 5 (issue 39: medians of at least 5)")
    return Journey(a).run()


if __name__ == "__main__":
    sys.exit(main())
