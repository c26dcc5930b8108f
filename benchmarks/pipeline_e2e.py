#!/usr/bin/env python
"""Issue 40's end-to-end benchmark: prompt -> PIL image through a whole ``QwenImagePipeline``, stage by stage.

One process, one GPU: the 60-layer random full-size transformer, the Qwen2.5-VL-7B text encoder (random weights,
bf16), the local tokenizer (real vocabulary size and special tokens, ``pipeline_parts.build_tokenizer``) and the
full VAE (``AutoencoderKLQwenImage()``), 1024^2, batch 1. Each case: one warm-up call, then ``--runs`` (>= 3)
timed calls with the stage split of the median one (``pipeline_parts.call``: encode, denoise, decode,
postprocess, host = denoise minus the transformer's own time, estimated from a timed transformer call at the same
shapes; the call cut into segments), and the peak memory of the case. Cases under 20 steps interleave as many
plain calls (no stage timer, no step callback: the timer's syncs and events cost a few ms): their median wall is
the case's ``e2e_*_s``; 50-step cases report the timed calls' median. Patched cases: ``qwen_absorb.patch(pipe)``
(defaults) and the VAE / text-encoder patches where this build has them (``pipeline_parts.patch_pipeline``); "unpatched"
cases run diffusers as is. Cases, run in this order (the model changes in place: bf16,
then ModelOpt FP8_DEFAULT_CFG, then a fused LoRA):

- ``4step_bf16_unpatched``, ``4step_bf16``: 4 steps, no CFG, Flash's sigmas [1.0, 0.9, 0.75, 0.5];
- ``50step_cfg_bf16_unpatched``: 50 steps, true CFG 4.0 (negative prompt " ");
- ``4step_fp8_unpatched`` (ModelOpt fake quant), ``4step_fp8``; ``*_newlen`` (FP8 patched, bf16 unpatched): each
  call's prompt one of a length not seen before (a user's next prompt: its text length is a new input shape, so
  new CUDA graphs, and new attention plans for anyone); ``50step_cfg_fp8``, ``50step_cfg_fp8_cache`` (the
  best diffusers cache, ``--cache``; its error on the final latents against the uncached FP8 run, same seed);
- ``8step_lora_fused_fp8``: a Lightning-shaped PEFT LoRA (rank 64, 12 linears a block) fused into the FP8 model,
  8 steps, no CFG.
Sections ``vae`` (decode at 1024^2, unpatched and with the pipeline patched, and each decode's error against an
fp32 decode) and ``te`` (``encode_prompt`` time and GPU busy). Writes ``<out>/pipeline_<card>.json`` + ``.md``
(``h200``, ``h100``: ``harness_io.gpu_file_tag``).
``--merge-json`` seeds the document with an earlier part's keys, so that the cases can be split over device calls:

    python benchmarks/pipeline_e2e.py --out $OUT --budget-s 520                             # all: ~7 min on an H200
    python benchmarks/pipeline_e2e.py --out $OUT --cases 4step,8step --sections vae,te      # or in two parts
    python benchmarks/pipeline_e2e.py --out $OUT --cases 50step --merge-json part1.json --sections none  # ~7 min
    python benchmarks/pipeline_e2e.py --tiny                                               # CPU smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402
import pipeline_parts as P  # noqa: E402

import torch  # noqa: E402


FLASH_SIGMAS = [1.0, 0.9, 0.75, 0.5]
CASES = ("4step_bf16_unpatched", "4step_bf16_unpatched_newlen", "4step_bf16", "50step_cfg_bf16_unpatched",
         "4step_fp8_unpatched", "4step_fp8", "4step_fp8_newlen", "50step_cfg_fp8", "50step_cfg_fp8_cache",
         "8step_lora_fused_fp8")
SECTIONS = ("vae", "te", "none")  # "none": cases only
KEYS = tuple(f"e2e_{c}_s" for c in CASES) + (
    "cache_name", "cache_latent_rel_err", "vae_decode_ms", "vae_decode_unpatched_ms", "vae_rel_err_vs_fp32_ratio",
    "te_encode_ms", "te_gpu_busy_ms", "te_prompt_tokens")


def case_args(case: str, a: argparse.Namespace) -> dict[str, Any]:
    steps = int(case.split("step")[0])
    steps = min(steps, 6 if steps == 50 else 3) if a.tiny else steps  # tiny: 6, so that the cache skips steps
    kw: dict[str, Any] = {"prompt": P.PROMPT, "height": a.size, "width": a.size, "num_inference_steps": steps}
    if "cfg" in case:
        kw.update(negative_prompt=" ", true_cfg_scale=4.0)
    else:
        kw["true_cfg_scale"] = 1.0
    if case.startswith("4step"):
        kw["sigmas"] = FLASH_SIGMAS[:steps]
    return kw


class E2E(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        seed_doc = {}
        if a.merge_json and not Path(a.merge_json).is_file():
            H.log(f"--merge-json {a.merge_json}: no such file; this part is written alone")
        elif a.merge_json:
            old = json.loads(Path(a.merge_json).read_text())
            seed_doc = {k: old[k] for k in (*KEYS, "stage_split", "peak_gib", "details", "parts") if k in old}
        self.R = H.Results(a.out, "pipeline_tiny" if a.tiny else f"pipeline_{H.gpu_file_tag(a.device)}", {
            **H.head("benchmarks/pipeline_e2e.py (issue 40)", self.env, {**self.cfg, "prompt": P.PROMPT}),
            **dict.fromkeys(KEYS), "stage_split": {}, "peak_gib": {}, "details": {}, "parts": [], **seed_doc}, markdown)
        self.R.d["parts"] = [*self.R.d.get("parts", []), {"cases": a.cases, "sections": a.sections,
                                                          "date": self.env["date"]}]
        self.steps = H.Steps([self.R], a.budget_s, cleanup=lambda: P.unpatch_pipeline(self.pipe))
        self.transformer_ms: dict[str, float] = {}
        self.calls = self.fresh = 0

    def build(self) -> None:
        a = self.a
        H.load_modelopt()
        model = H.build_transformer(a.tiny, a.num_layers, self.dev, torch.bfloat16, a.seed)
        self.pipe = P.build_pipeline(model, a.tiny, self.dev)
        self.R.put("details.te_parameters", sum(p.numel() for p in self.pipe.text_encoder.parameters()))
        self.R.put("details.build_memory_gib", H.memory_gib(self.dev))
        self.R.put("te_prompt_tokens", len(self.pipe.tokenizer(P.TEMPLATE.format(P.PROMPT)).input_ids) - 34)

    def gen(self, case: str, output_type: str = "pil", same_prompt: bool = False,
            timed: bool = True) -> tuple[float, dict, Any]:
        """One pipeline call, stage-timed (``pipeline_parts.call``) or plain. Each call gets a prompt of its own
        (the patched text encoder's cache would serve a repeated one: a user's next image has a new prompt); the
        negative prompt of true CFG repeats, as it does for a user."""
        kw = case_args(case, self.a)
        self.calls += 0 if same_prompt else 1
        self.fresh += case.endswith("_newlen")
        # three digits: every case's prompts tokenize to one length (9 -> 10 added a token: a new input shape)
        extra = ", in fine detail" * self.fresh if case.endswith("_newlen") else ""
        kw["prompt"] = f"{kw['prompt']}, variation {99 + self.calls}{extra}"
        kw.update(output_type=output_type, generator=torch.Generator("cpu").manual_seed(self.a.seed))
        if timed:
            return P.call(self.pipe, self.dev, **kw)
        with torch.inference_mode():
            H.sync(self.dev)
            t0 = time.perf_counter()
            out = self.pipe(**kw)
            H.sync(self.dev)
        return time.perf_counter() - t0, {}, out

    def transformer_call_ms(self, case: str) -> float | None:
        """One transformer call at the case's shapes, timed alone (the denoise loop's GPU-bound part)."""
        key = ("cfg" if "cfg" in case else "nocfg") + ("_fp8" if "fp8" in case else "_bf16") + \
              ("_unpatched" if "unpatched" in case else "")
        if key not in self.transformer_ms:
            m = self.pipe.transformer
            side = self.a.size // 16
            kw = H.inputs(m, side, self.R.get("te_prompt_tokens") or 64, self.dev, torch.bfloat16, self.a.seed)
            with torch.inference_mode():  # as the pipeline calls it (a grad-mode call of ModelOpt's unpatched
                # attention that raises leaves its SDPA swap in torch for the process: the encoder then fails)
                r = H.time_calls(lambda: m(**kw)[0], self.dev, 1, 3, b2b=4)
            self.transformer_ms[key] = r["median_ms"]
            self.R.put(f"details.transformer_alone.{key}", {k: r.get(k) for k in ("median_ms", "b2b_ms")})
        return self.transformer_ms[key]

    def case(self, case: str) -> None:
        pipe, dev = self.pipe, self.dev
        patched = "unpatched" not in case
        P.unpatch_pipeline(pipe)
        rep = P.patch_pipeline(pipe) if patched else None
        if case.endswith("_cache"):
            self.cache(True)
        try:
            self.gen(case)  # warm-up: captures, compiles, allocator
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            steps = case_args(case, self.a)["num_inference_steps"]
            runs, plain = [], []
            for _ in range(self.a.runs):  # interleaved: clocks and neighbours drift alike for both
                runs.append(self.gen(case))
                if steps < 20:
                    plain.append(self.gen(case, timed=False)[0])
            peak = torch.cuda.max_memory_allocated(dev) / 2**30 if self.cuda else None
        finally:
            if case.endswith("_cache"):
                self.cache(False)
        if case in self.a.profile:
            self.R.put(f"details.profile.{case}", self.profile(case))
        wall, st, _ = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        calls = steps * (2 if "cfg" in case else 1)
        t_ms = None if case.endswith("_cache") else self.transformer_call_ms(case)
        st["transformer_calls"] = calls
        st["host_s"] = None if t_ms is None else round(st["denoise_s"] - calls * t_ms / 1e3, 4)
        self.R.put(f"e2e_{case}_s", round(statistics.median(plain or [r[0] for r in runs]), 4))
        self.R.put(f"stage_split.{case}", st)
        self.R.put(f"peak_gib.{case}", peak and round(peak, 3), None if peak else H.NEEDS_CUDA)
        H.log(f"  {case}: median {statistics.median(r[0] for r in runs):.4f} s timed, "
              f"{statistics.median(plain) if plain else float('nan'):.4f} s plain, split {st}, transformer call "
              f"{t_ms} ms, peak {peak and round(peak, 3)} GiB")  # in the log too: the log always comes back
        self.R.put(f"details.{case}", H.json_safe({
            "runs_s": [round(r[0], 4) for r in runs], "plain_runs_s": [round(x, 4) for x in plain],
            "median_run_wall_s": wall, "transformer_call_ms": t_ms,
            "args": {k: v for k, v in case_args(case, self.a).items() if k != "prompt"},
            "report": None if rep is None else {k: H.summary(v) if k == "transformer" else repr(v)[:300]
                                                  for k, v in rep.items()}}))
        P.unpatch_pipeline(pipe)

    def profile(self, case: str) -> dict[str, Any]:
        """One more call of ``case`` under torch.profiler (CPU activity with stacks, CUDA where there is one): where
        the host time between the steps goes. The call's GPU busy and idle gaps, the host ops by self time, and
        every host op that waits for the device (syncs, device-to-host copies, ``.item()``) with its stack."""
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=acts, with_stack=True) as prof:
            wall = self.gen(case)[0]
        out: dict[str, Any] = {"wall_s": round(wall, 4)}
        if self.cuda:
            out.update(H.kernel_summary(prof, 8))
            out["idle"] = H.idle_summary(prof, wall * 1e3, 12)
        out["host_top"] = [{"name": e.key[:80], "count": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 3)}
                           for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
                           if "threading.py" not in e.key][:25]
        waits: dict[tuple[str, ...], list[float]] = {}  # a waiting op and its Python callers -> count, ms
        for e in prof.events():
            if any(w in e.name for w in ("Synchronize", "_local_scalar_dense", "cudaMemcpy", "aten::nonzero")):
                chain, p = [e.name], e.cpu_parent
                while p is not None and len(chain) < 8:
                    chain += [p.name[:90]] if ".py(" in p.name and "/torch/" not in p.name else []
                    p = p.cpu_parent
                w = waits.setdefault(tuple(chain), [0, 0.0])
                w[0], w[1] = w[0] + 1, w[1] + e.time_range.elapsed_us() / 1e3
        out["waits"] = [{"stack": list(k), "count": v[0], "ms": round(v[1], 3)}
                        for k, v in sorted(waits.items(), key=lambda kv: -kv[1][1])[:20]]
        out.update(self.python_profile(case))
        H.log(f"  profile {case}: {json.dumps(out)[:6000]}")
        return out

    def python_profile(self, case: str) -> dict[str, Any]:
        """One more call under cProfile (the Python functions the host spends the call in, by cumulative time),
        and diffusers' per-call module walks timed on this host: diffusers' own and the mirrored ones."""
        from diffusers import DiffusionPipeline  # noqa: PLC0415

        top = H.python_top(lambda: self.gen(case, timed=False))
        pipe, walks = self.pipe, {}
        for name, dev_fn, free_fn in (
                ("diffusers", lambda: DiffusionPipeline._execution_device.fget(pipe),
                 lambda: DiffusionPipeline.maybe_free_model_hooks(pipe)),
                ("patched", lambda: pipe._execution_device, lambda: pipe.maybe_free_model_hooks())):
            t = {}
            for key, fn in (("execution_device_ms", dev_fn), ("maybe_free_model_hooks_ms", free_fn)):
                fn()
                t0 = time.perf_counter()
                for _ in range(10):
                    fn()
                t[key] = round((time.perf_counter() - t0) * 100, 3)
            walks[name] = t
        walks["modules"] = {k: sum(1 for _ in m.modules()) for k, m in pipe.components.items()
                            if isinstance(m, torch.nn.Module)}
        H.log(f"  walks {case}: {walks}")
        return {"cprofile_top": top, "walks": walks}

    def cache(self, on: bool) -> None:
        """The case's cache: diffusers' config with one setting a user would pick for speed (MagCache: ratios
        from its own calibration run on this pipeline first, as its documentation asks)."""
        from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig  # noqa: PLC0415

        m = self.pipe.transformer
        if getattr(m, "_cache_config", None) is not None:
            m.disable_cache()
        if on and self.a.cache == "magcache" and self.R.get("details.mag_ratios") is None:
            self.calibrate_mag()
        if on:
            steps = case_args("50step_cfg", self.a)["num_inference_steps"]
            m.enable_cache({"fbc": lambda: FirstBlockCacheConfig(threshold=0.2), "taylorseer": TaylorSeerCacheConfig,
                            "magcache": lambda: MagCacheConfig(
                                mag_ratios=self.R.get("details.mag_ratios"), num_inference_steps=steps,
                                threshold=0.24, max_skip_steps=5, retention_ratio=0.1)}[self.a.cache]())
            cfg = m._cache_config  # its settings, without the per-step arrays (ratios: details.mag_ratios)
            shown = {k: v for k, v in vars(cfg).items() if not hasattr(v, "__len__") or isinstance(v, str)}
            self.R.put("cache_name", f"{self.a.cache}: {type(cfg).__name__}({shown})"[:200])

    def calibrate_mag(self) -> None:
        steps = case_args("50step_cfg", self.a)["num_inference_steps"]
        self.R.put("details.mag_ratios", H.mag_ratios(self.pipe.transformer, steps,
                                                      lambda: self.gen("50step_cfg_fp8", "latent", same_prompt=True)))

    def cache_error(self) -> None:
        """The cache's error on the final latents against the uncached run (same seed, same patched model)."""
        P.patch_pipeline(self.pipe)
        ref = self.gen("50step_cfg_fp8", "latent")[2].images.float()  # the cached run below: the same prompt
        self.cache(True)
        try:
            got = self.gen("50step_cfg_fp8_cache", "latent", same_prompt=True)[2].images.float()
        finally:
            self.cache(False)
            P.unpatch_pipeline(self.pipe)
        self.R.put("cache_latent_rel_err", H.rel_err(got, ref))

    def quantize(self) -> None:
        m = self.pipe.transformer
        calib = H.inputs(m, self.a.size // 16, self.R.get("te_prompt_tokens") or 64, self.dev, torch.bfloat16,
                         self.a.seed + 7)
        self.R.put("details.fp8_quantize_s", H.fp8_quantize(m, [calib]))

    def fuse_lora(self) -> None:
        m = self.pipe.transformer
        m.add_adapter(H.lora_config(self.a.rank))
        H.seed_lora(m, self.a.rank, self.a.seed)
        m.fuse_lora(lora_scale=1.0)
        self.R.put("details.lora", {"rank": self.a.rank, "targets": H.LORA_TARGETS, "fused": True})

    def vae(self) -> None:
        pipe, dev, a = self.pipe, self.dev, self.a
        z = pipe.vae.config.z_dim
        f = 2 ** len(pipe.vae.temperal_downsample)
        g = torch.Generator("cpu").manual_seed(a.seed + 3)
        lat = torch.randn(1, z, 1, a.size // f, a.size // f, generator=g).to(dev, torch.bfloat16)
        vae32 = copy.deepcopy(pipe.vae).float()
        with torch.inference_mode():
            ref = vae32.decode(lat.float(), return_dict=False)[0].float()
        del vae32
        out = {}
        for key, patched in (("vae_decode_unpatched_ms", False), ("vae_decode_ms", True)):
            rep = P.patch_pipeline(pipe) if patched else None
            with torch.inference_mode():
                r = H.measure(key, lambda: pipe.vae.decode(lat, return_dict=False)[0], dev, 2, a.iters)
                out[key] = pipe.vae.decode(lat, return_dict=False)[0].float()
            self.R.put(key, round(r["median_ms"], 4))
            b, _ = H.busy(r)
            self.R.put(f"details.{key}", {"gpu_busy_ms": b, "wall_median_ms": r["wall_median_ms"],
                                          "vae_report": None if rep is None else repr(rep.get("vae"))[:300]})
            P.unpatch_pipeline(pipe)
        e_p, e_u = (H.rel_err(out[k], ref) for k in ("vae_decode_ms", "vae_decode_unpatched_ms"))
        self.R.put("details.vae_rel_err_vs_fp32", {"patched": e_p, "unpatched": e_u})
        self.R.put("vae_rel_err_vs_fp32_ratio", H.ratio(e_p, e_u))

    def te(self) -> None:
        """The prompt encoding as ``patch(pipe)`` installs it (its CUDA graphs; the prompt cache off, so that the
        encoder itself is timed), next to diffusers' (``details.te_encode_unpatched_ms``), and their bits."""
        from qwen_absorb import text_encoder as te_room  # noqa: PLC0415

        pipe, dev = self.pipe, self.dev
        outs = {}
        for key, patched in (("te_encode_unpatched", False), ("te_encode", True)):
            if patched:
                te_room.patch(pipe, cache_size=0)
            try:
                r = H.measure(key, lambda: pipe.encode_prompt(P.PROMPT, device=dev), dev, 2, self.a.iters)
                outs[key] = pipe.encode_prompt(P.PROMPT, device=dev)[0]
                graphs = te_room.report_of(pipe).graphs if patched else None
            finally:
                te_room.unpatch(pipe)
            b, why = H.busy(r)
            # where the GPU idles in the profiled call: before its first kernel and after its last (host work,
            # ``idle_outside_span_ms``) or between kernels (``idle_in_span_ms``, a graph's own gaps included)
            self.R.put(f"details.{key}_idle", (r.get("profile") or {}).get("idle"), why)
            if patched:
                self.R.put("te_encode_ms", round(r["median_ms"], 4))
                self.R.put("te_gpu_busy_ms", b and round(b, 4), why)
                self.R.put("details.te_graphs", graphs)
            else:
                self.R.put("details.te_encode_unpatched_ms", round(r["median_ms"], 4))
                self.R.put("details.te_unpatched_gpu_busy_ms", b and round(b, 4), why)
        self.R.put("details.te_bit_identical", torch.equal(outs["te_encode"], outs["te_encode_unpatched"]))
        idle = self.R.get("details.te_encode_idle") or {}
        H.log(f"  te: {self.R.get('details.te_encode_unpatched_ms')} -> {self.R.get('te_encode_ms')} ms, busy "
              f"{self.R.get('te_gpu_busy_ms')}, idle in span {idle.get('idle_in_span_ms')} / outside "
              f"{idle.get('idle_outside_span_ms')} ms, same bits {self.R.get('details.te_bit_identical')}, {graphs}")

    def run(self) -> int:
        s, R, cases = self.steps, self.R, self.a.cases
        if not s("build", self.build, [(R, k) for k in KEYS]):
            return 1
        H.start_profiler(self.dev)
        for sec in (x for x in self.a.sections if x != "none"):
            s(sec, getattr(self, sec), [(R, k) for k in KEYS if k.startswith(sec)])
        fp8_done = False
        for case in cases:
            if "fp8" in case and not fp8_done:
                fp8_done = s("fp8_quantize", self.quantize)
            if case.startswith("8step_lora"):
                s("fuse_lora", self.fuse_lora)
            s(case, lambda c=case: self.case(c), [(R, f"e2e_{case}_s")])
            if case == "50step_cfg_fp8_cache":
                s("cache_error", self.cache_error, [(R, "cache_latent_rel_err")])
        return 0


def markdown(d: dict[str, Any]) -> str:
    rows = [[c, d.get(f"e2e_{c}_s"), *[(d["stage_split"].get(c) or {}).get(k) for k in
                                        ("encode_s", "denoise_s", "host_s", "decode_s", "postprocess_s")],
             d["peak_gib"].get(c)] for c in CASES if d.get(f"e2e_{c}_s") is not None]
    lines = H.md_head("Prompt to PIL image: QwenImagePipeline at 1024^2 (issue 40)", d) + [
        "", "Random full-size weights: 60-layer transformer, Qwen2.5-VL-7B text encoder (bf16), full VAE; local "
        "tokenizer with the real vocabulary. Median of the timed calls after a warm-up call; host = the denoise "
        "loop minus steps x one transformer call timed alone.", "",
        *H.md_table(["case", "wall s", "encode s", "denoise s", "host s", "decode s", "to PIL s", "peak GiB"], rows),
        "", *H.md_table(["key", "value"], [[k, d.get(k)] for k in KEYS[len(CASES):]])]
    return H.md_document(lines, d)


def pick(names: str, choices: tuple[str, ...]) -> list[str]:
    """Comma-separated names or prefixes ("4step", "50step") -> the matching choices, in their order (a full name
    selects itself only: "4step_fp8" is not "4step_fp8_unpatched")."""
    asked = [n.strip() for n in names.split(",") if n.strip()]
    got = [c for c in choices if c in asked or any(n not in choices and c.startswith(n + "_") for n in asked)]
    if not got and asked:
        raise SystemExit(f"--cases: no case matches {asked}; choose from {', '.join(choices)}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, SECTIONS, budget_s=540.0)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated cases or prefixes (4step, 50step, ...)")
    p.add_argument("--num-layers", type=int, default=None, help="default 60 (--tiny: 2)")
    p.add_argument("--size", type=int, default=None, help="image side in pixels (default 1024; --tiny: 64)")
    p.add_argument("--runs", type=int, default=None, help="timed calls per case (default 3; --tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed calls of the VAE and text encoder (default 10)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--cache", choices=("magcache", "taylorseer", "fbc"), default="magcache")
    p.add_argument("--profile", default="", help="comma-separated cases to profile once more after their timing")
    p.add_argument("--merge-json", type=Path, default=None, help="an earlier part's pipeline_<card>.json")
    a = H.finish_args(p, p.parse_args(argv), SECTIONS, "pipeline",
                      {"num_layers": (60, 2), "size": (1024, 64), "runs": (3, 1), "iters": (10, 2)})
    a.cases, a.profile = pick(a.cases, CASES), pick(a.profile, CASES)
    if not a.tiny and a.runs < 3:
        p.error("--runs must be >= 3 (issue 40: medians of at least 3 pipeline calls)")
    return E2E(a).run()


if __name__ == "__main__":
    sys.exit(main())
