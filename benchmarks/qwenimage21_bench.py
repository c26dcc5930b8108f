#!/usr/bin/env python
"""Issue 21's device benchmark: Qwen-Image-2.1, bf16 patched vs unpatched at 1024^2 and 2048^2, ModelOpt FP8 at 1024^2.

ONE process, one H200: the 32-layer random full-size ``QwenImage21Transformer2DModel`` (diffusers' default config,
~7.1 B parameters, bf16; ``tests/builders.py``'s ``random_qwenimage21_transformer``), text-to-image inputs as
QwenImage21Pipeline passes them (``qwenimage21_inputs`` there): 128 text tokens, no condition image,
no KV cache, no padding (mask None), B = 1; the target image is 64 x 64 = 4096 latent tokens at 1024^2 and
128 x 128 = 16384 at 2048^2 (16x VAE, latents unpatched). "patched" = ``qwen_absorb.patch(model)`` with the library
defaults. Steps, in order (keys of ``<out>/qwenimage21_h200.json``):

1. build the bf16 model and the inputs;
2. unpatched: ``bf16_eager_1024_ms``, ``bf16_eager_2048_ms`` (outputs kept);
3. ``qwen_absorb.patch(model)``: ``bf16_patched_1024_ms``, ``bf16_patched_2048_ms``; ``bf16_bit_identical``: the
   patched outputs equal the unpatched ones exactly (``torch.equal``) at both sizes; unpatched after;
4. the fp32 reference: the same weights upcast in place (TF32 off), fp32 inputs, one forward at 1024^2, cast back
   (bf16 -> fp32 -> bf16 is exact);
5. ModelOpt ``FP8_DEFAULT_CFG`` in place (``harness.fp8_quantize``), calibrated on ``--calib`` random inputs;
   unpatched (fake quant): ``fp8_fake_quant_1024_ms``; patched: ``fp8_patched_1024_ms``, ``fp8_real_linears``
   (``report.summary["fp8_gemm_linears"]``: what the patch runs as real FP8 GEMMs);
   ``fidelity_ratio_forward`` = rel err (patched FP8 vs the fp32 reference) / rel err (fake quant vs the same),
   rel err = ||y - y_ref|| / ||y_ref|| over the target-image tokens the pipeline reads.

Every timed case (harness.measure): a first call (timed apart), ``--warmup`` calls, ``--iters`` (>= 5) calls between
CUDA events, synchronized after each (``<case>_ms``: the median), perf_counter around each (``<case>_wall_ms``),
one call under torch.profiler (``<case>_gpu_busy_ms``: the sum of its kernel durations). Memory per mode:
``memory_gib.<mode>.allocated`` (``torch.cuda.memory_allocated`` after gc, the mode's model resident) and ``.peak``
(``max_memory_allocated`` since the mode started). The document is rewritten after every step.

    python benchmarks/qwenimage21_bench.py --out DIR         # H200: ~2-3 min (+~60 s ModelOpt's extension build)
    python benchmarks/qwenimage21_bench.py --size tiny       # CPU smoke run of every step on a tiny model (seconds)

Issue 21 targets (judged in the markdown): bf16 patched bit-identical to unpatched and >= 1.25x unpatched eager at
1024^2 and 2048^2; FP8 patched >= 1.8x bf16 unpatched eager at 1024^2 with fidelity_ratio_forward <= 1.05.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

T = H.builders()

SIZES = ("1024", "2048")
TIMED = ("bf16_eager_1024_ms", "bf16_patched_1024_ms", "bf16_eager_2048_ms", "bf16_patched_2048_ms",
         "fp8_fake_quant_1024_ms", "fp8_patched_1024_ms")
RATIOS = {  # top-level keys: numerator / denominator
    "bf16_speedup_1024": ("bf16_eager_1024_ms", "bf16_patched_1024_ms"),
    "bf16_speedup_2048": ("bf16_eager_2048_ms", "bf16_patched_2048_ms"),
    "fp8_speedup_vs_bf16_eager_1024": ("bf16_eager_1024_ms", "fp8_patched_1024_ms"),
    "fp8_speedup_vs_fake_quant_1024": ("fp8_fake_quant_1024_ms", "fp8_patched_1024_ms"),
    "bf16_gpu_busy_speedup_1024": ("bf16_eager_1024_gpu_busy_ms", "bf16_patched_1024_gpu_busy_ms"),
    "bf16_gpu_busy_speedup_2048": ("bf16_eager_2048_gpu_busy_ms", "bf16_patched_2048_gpu_busy_ms"),
}
TARGETS = {  # name: (key, op, target), issue 21 "Targets"
    "bf16_bit_identical": ("bf16_bit_identical", "==", True),
    "bf16_speedup_1024": ("bf16_speedup_1024", ">=", 1.25),
    "bf16_speedup_2048": ("bf16_speedup_2048", ">=", 1.25),
    "fp8_speedup_vs_bf16_eager_1024": ("fp8_speedup_vs_bf16_eager_1024", ">=", 1.8),
    "fidelity_ratio_forward": ("fidelity_ratio_forward", "<=", 1.05),
}
# extra cases beside the defaults (patch options named), in the table when measured
EXTRA = ("bf16_patched_eager_1024_ms", "bf16_patched_graph_1024_ms", "fp8_patched_eager_1024_ms",
         "fp8_patched_graph_1024_ms")
KEYS = ("bf16_bit_identical", "bf16_bit_identical_1024", "bf16_bit_identical_2048", "fidelity_ratio_forward",
        "fp8_real_linears", *TIMED, *(k.replace("_ms", "_wall_ms") for k in TIMED),
        *(k.replace("_ms", "_gpu_busy_ms") for k in TIMED), *RATIOS)


class Doc(H.Results):
    def write(self) -> None:  # ratios and verdicts follow every measurement
        d = self.d
        for k, (a, b) in RATIOS.items():
            d[k] = H.ratio(d.get(a), d.get(b))
        for k, (key, op, target) in TARGETS.items():
            m = d.get(key)
            met = None
            if m is not None and not d["tiny"]:
                met = m == target if op == "==" else (m >= target if op == ">=" else m <= target)
            d["targets"][k] = {"measured": m, "target": f"{op} {target}", "met": met}
        super().write()


def quantized_linears(model: torch.nn.Module) -> int:
    """Linears in the blocks that ModelOpt gave an enabled weight quantizer (what could run as real FP8)."""
    return sum(1 for m in model.transformer_blocks.modules()
               if isinstance(m, torch.nn.Linear) and getattr(getattr(m, "weight_quantizer", None), "is_enabled", False))


class Bench(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        self.side = dict(zip(SIZES, a.sides))
        cfg = {**self.cfg, "batch": 1, "image_tokens": {s: n * n for s, n in self.side.items()},
               "patch_kwargs": "none (library defaults: qwen_absorb.patch(model))",
               "attention_processor": "diffusers' default (QwenImage21AttnProcessor, per-segment SDPA)"}
        self.R = Doc(a.out, a.name, {
            **H.head("benchmarks/qwenimage21_bench.py (issue 21: Qwen-Image-2.1)", self.env, cfg),
            **dict.fromkeys(KEYS), "fp8_modelopt_linears": None, "fp8_quantized_block_linears": None,
            "memory_gib": {}, "fidelity": {}, "bit_identical": {}, "targets": {}, "reports": {}, "details": {}},
            markdown)
        self.steps = H.Steps([self.R], a.budget_s, cleanup=self.cleanup)
        self.model: torch.nn.Module | None = None
        self.kw: dict[str, dict[str, Any]] = {}
        self.outs: dict[str, torch.Tensor] = {}
        self.ref: torch.Tensor | None = None

    def cleanup(self) -> None:
        if self.model is not None:
            qwen_absorb.unpatch(self.model)

    # ------------------------------------------------------------------ helpers
    def memory(self, mode: str) -> None:
        """The mode's resident memory (after gc) and its peak since the previous call."""
        peak = H.peak_memory_gib(self.dev)
        alloc = H.memory_gib(self.dev)
        self.R.put(f"memory_gib.{mode}", {"allocated": alloc and round(alloc, 3), "peak": peak and round(peak, 3)})
        if alloc is None:
            self.R.d["skipped"].setdefault("memory_gib", f"{H.NEEDS_CUDA} (torch.cuda memory statistics): every "
                                                         "mode's allocated / peak is null")
        else:
            H.log(f"  memory {mode}: allocated {alloc:.2f} GiB, peak {peak:.2f} GiB")

    @torch.inference_mode()
    def output(self, size: str) -> torch.Tensor:
        out = self.model(**self.kw[size])[0].clone()  # clone: a graph replay may hand back its static buffer
        H.sync(self.dev)
        return out

    def case(self, key: str, size: str, rep: Any = None, fake: bool = False) -> None:
        a = self.a
        H.peak_memory_gib(self.dev)  # reset: the peak below is this mode's
        kw = self.kw[size]
        r = H.measure(key[:-3], lambda: self.model(**kw)[0], self.dev, a.fake_warmup if fake else a.warmup,
                      a.fake_iters if fake else a.iters, warmup_s=0.0 if fake else a.warmup_s)
        self.R.put(key, round(r["median_ms"], 4))
        self.R.put(key.replace("_ms", "_wall_ms"), round(r["wall_median_ms"], 4))
        b, why = H.busy(r)
        self.R.put(key.replace("_ms", "_gpu_busy_ms"), b and round(b, 4), why)
        p = r["profile"] or {}
        self.R.put(f"details.{key}", H.json_safe({
            **{k: r[k] for k in ("first_call_s", "wall_median_ms", "min_ms", "max_ms", "samples_ms", "warmup", "iters",
                                 "timer")},
            "kernels_per_call": p.get("kernels_per_call"), "top_kernels": (p.get("top_kernels_by_time") or [])[:8],
            **({"report": H.rep_info(rep)} if rep is not None else {})}))
        self.outs[key[:-3]] = self.output(size)
        self.memory(key[:-3])

    def patch(self, label: str, **kw: Any) -> Any:
        t0 = time.perf_counter()
        rep = qwen_absorb.patch(self.model, **kw)  # the library defaults unless a case names an option
        H.sync(self.dev)
        self.R.put(f"details.patch_s.{label}", round(time.perf_counter() - t0, 3))
        self.R.put(f"reports.{label}", H.rep_info(rep))
        H.log(f"  patched ({label}): {H.summary(rep)}")
        return rep

    # ------------------------------------------------------------------ steps
    def build(self) -> None:
        a = self.a
        H.load_modelopt()  # before any model exists (harness.load_modelopt)
        H.start_profiler(self.dev)
        tiny = T.QWENIMAGE21_TINY_CONFIG if a.tiny else {}
        t0 = time.perf_counter()
        self.model = T.random_qwenimage21_transformer(
            **{**tiny, "num_layers": a.num_layers}, dtype=torch.bfloat16, device=self.dev, seed=a.seed)
        H.sync(self.dev)
        self.R.put("details.build_s", round(time.perf_counter() - t0, 2))
        self.R.put("details.parameters", sum(p.numel() for p in self.model.parameters()))
        self.R.put("details.model_config", dict(self.model.config))
        for size, n in self.side.items():
            self.kw[size] = T.qwenimage21_inputs(self.model, height=n, width=n, text_len=a.text_tokens, seed=a.seed + 1,
                                                 device=self.dev, dtype=torch.bfloat16)
        self.kw32 = H.as_dtype(self.kw["1024"], torch.float32)
        self.n_img = self.side["1024"] ** 2
        self.memory("build")

    def bf16_patched(self, size: str) -> None:
        m = self.model
        if qwen_absorb.patch_report(m) is None:
            self.rep_bf16 = self.patch("bf16_patched")
        self.case(f"bf16_patched_{size}_ms", size, self.rep_bf16)
        eager = self.outs.get(f"bf16_eager_{size}")
        if eager is None:
            return self.R.put(f"bf16_bit_identical_{size}", None, f"no unpatched {size} output (its step failed)")
        got = self.outs[f"bf16_patched_{size}"]
        same = bool(torch.equal(got, eager))
        diff = (got.float() - eager.float()).abs()
        self.R.put(f"bf16_bit_identical_{size}", same)
        self.R.put(f"bit_identical.{size}", {"identical": same, "max_abs_diff": diff.max().item(),
                                             "mismatched_elements": int((got != eager).sum()),
                                             "elements": got.numel(), "shape": list(got.shape)})
        checked = [self.R.get(f"bf16_bit_identical_{s}") for s in SIZES]
        self.R.put("bf16_bit_identical", all(c for c in checked if c is not None))
        self.R.put("details.bf16_bit_identical_sizes", [s for s, c in zip(SIZES, checked) if c is not None])
        H.log(f"  bit-identical at {size}: {same} (max abs diff {diff.max().item():.3e})")

    def fp32_reference(self) -> None:
        qwen_absorb.unpatch(self.model)
        for s in SIZES:  # the bf16 outputs are compared already
            self.outs.pop(f"bf16_patched_{s}", None)
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        H.peak_memory_gib(self.dev)
        try:
            with torch.no_grad():
                torch.nn.Module.to(self.model, torch.float32)  # nn.Module's cast: no diffusers fp32-modules warning
            with torch.inference_mode():
                self.ref = self.model(**self.kw32)[0].float()
            H.sync(self.dev)
        finally:
            with torch.no_grad():
                torch.nn.Module.to(self.model, torch.bfloat16)
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        self.memory("fp32_reference_1024")
        self.R.put("fidelity.reference", "the unquantized weights upcast to fp32, fp32 inputs, TF32 off, 1024^2; "
                                         "rel err over the target-image tokens")

    def fp8_quantize(self) -> None:
        qwen_absorb.unpatch(self.model)
        a = self.a
        calib = [T.qwenimage21_inputs(self.model, height=self.side["1024"], width=self.side["1024"],
                                      text_len=a.text_tokens, timestep=t, seed=a.seed + 10 + i, device=self.dev,
                                      dtype=torch.bfloat16) for i, t in enumerate((0.9, 0.5)[: a.calib])]
        s = H.fp8_quantize(self.model, calib)
        self.R.put("details.fp8_quantization", {
            "how": "mtq.FP8_DEFAULT_CFG (tests/builders.py fp8_quantize), in place after the bf16 cases, "
                   f"calibrated on {len(calib)} random 1024^2 inputs (seeds other than the timing input's)", "s": s})
        self.R.put("fp8_quantized_block_linears", quantized_linears(self.model))
        self.memory("fp8_quantize")

    def rel_err(self, key: str) -> float | None:
        out = self.outs.get(key)
        if out is None or self.ref is None:
            return None
        n = self.n_img
        e = H.rel_err(out[:, -n:].float(), self.ref[:, -n:])
        self.R.put(f"fidelity.rel_err_{key}", e)
        self.R.put(f"fidelity.rel_err_full_sequence_{key}", H.rel_err(out.float(), self.ref))
        H.log(f"  rel err {key}: {e:.4e}")
        return e

    def fp8_fake(self) -> None:
        qwen_absorb.unpatch(self.model)
        self.case("fp8_fake_quant_1024_ms", "1024", fake=True)
        self.rel_err("fp8_fake_quant_1024")

    def fp8_patched(self) -> None:
        rep = self.patch("fp8_patched")
        s = H.summary(rep) or {}
        n = s.get("fp8_gemm_linears")
        self.R.put("fp8_real_linears", n, None if n is not None else "the report summary has no 'fp8_gemm_linears'")
        self.R.put("fp8_modelopt_linears", s.get("modelopt_linears"))
        self.case("fp8_patched_1024_ms", "1024", rep)
        ep, ef = self.rel_err("fp8_patched_1024"), self.R.get("fidelity.rel_err_fp8_fake_quant_1024")
        why = None if ep is not None and ef is not None else "no fp32 reference or no fake-quant output"
        self.R.put("fidelity_ratio_forward", H.ratio(ep, ef), why)
        qwen_absorb.unpatch(self.model)

    def option_case(self, key: str, **kw: Any) -> None:
        """An extra case beside the defaults: ``patch(model, **kw)``: ``cuda_graph=False`` (the eager patched
        call, what the per-block graphs of ``"auto"`` win) or ``cuda_graph=True`` (captured at first sight)."""
        qwen_absorb.unpatch(self.model)
        rep = self.patch(key[:-3], **kw)
        self.case(key, "1024", rep)
        qwen_absorb.unpatch(self.model)

    def run(self) -> int:
        s, R = self.steps, self.R
        R.write()
        a = self.a
        H.log(f"qwenimage21: {a.num_layers} layers, target tokens {R.d['config']['image_tokens']} + {a.text_tokens} "
              f"text on {self.dev}; writing {R.json}")
        if not s("build", self.build, [(R, k) for k in KEYS]):
            return self.finish()
        for size in SIZES:
            s(f"bf16_eager_{size}", lambda size=size: self.case(f"bf16_eager_{size}_ms", size),
              [(R, f"bf16_eager_{size}_ms")])
        for size in SIZES:
            s(f"bf16_patched_{size}", lambda size=size: self.bf16_patched(size),
              [(R, f"bf16_patched_{size}_ms"), (R, f"bf16_bit_identical_{size}")])
        s("bf16_patched_eager_1024", lambda: self.option_case("bf16_patched_eager_1024_ms", cuda_graph=False),
          [(R, "bf16_patched_eager_1024_ms")])
        s("bf16_patched_graph_1024", lambda: self.option_case("bf16_patched_graph_1024_ms", cuda_graph=True),
          [(R, "bf16_patched_graph_1024_ms")])
        s("fp32_reference", self.fp32_reference, [(R, "fidelity_ratio_forward")])
        if s("fp8_quantize", self.fp8_quantize, [(R, k) for k in TIMED[4:]]):
            s("fp8_fake_quant_1024", self.fp8_fake, [(R, "fp8_fake_quant_1024_ms")])
            s("fp8_patched_1024", self.fp8_patched, [(R, "fp8_patched_1024_ms"), (R, "fp8_real_linears"),
                                                     (R, "fidelity_ratio_forward")])
            s("fp8_patched_eager_1024", lambda: self.option_case("fp8_patched_eager_1024_ms", cuda_graph=False),
              [(R, "fp8_patched_eager_1024_ms")])
            s("fp8_patched_graph_1024", lambda: self.option_case("fp8_patched_graph_1024_ms", cuda_graph=True),
              [(R, "fp8_patched_graph_1024_ms")])
        return self.finish()

    def finish(self) -> int:
        self.cleanup()
        for k in KEYS:
            if k in RATIOS:
                self.R.skip(k, f"needs {RATIOS[k][0]} and {RATIOS[k][1]}")
            else:
                self.R.skip(k, "not measured (its step failed or was skipped: see errors)")
        self.R.write()
        H.log(f"wrote {self.R.json} and {self.R.md.name}")
        print(markdown(self.R.d))
        return 1 if self.steps.failed else 0


def markdown(d: dict[str, Any]) -> str:
    c, det, mem = d.get("config") or {}, d.get("details") or {}, d.get("memory_gib") or {}
    toks = c.get("image_tokens") or {}
    lines = H.md_head("Qwen-Image-2.1: patched vs unpatched, bf16 and ModelOpt FP8 (issue 21)", d,
                      f"{c.get('num_layers')}-layer random QwenImage21Transformer2DModel, {c.get('text_tokens')} text "
                      f"tokens + {toks.get('1024')} (1024^2) / {toks.get('2048')} (2048^2) target tokens, B = 1, bf16, "
                      f"no mask, no KV cache; patched = qwen_absorb.patch(model) (defaults); median of "
                      f"{c.get('iters')} timed calls after {c.get('warmup')} warm-up, continued to "
                      f"{c.get('warmup_s')} s (steady clocks; fake quant: "
                      f"{c.get('fake_iters')} after {c.get('fake_warmup')}); ms = CUDA events around one "
                      "synchronized call, wall = perf_counter, GPU busy = kernel time of one profiled call")
    rows = []
    for k in (*TIMED, *(k for k in EXTRA if d.get(k) is not None)):
        size = "2048" if "2048" in k else "1024"
        busy = d.get(k.replace("_ms", "_gpu_busy_ms"))
        rows.append([k[:-3], d.get(k), d.get(k.replace("_ms", "_wall_ms")), busy, H.ratio(d.get(k), busy),
                     (det.get(k) or {}).get("kernels_per_call"), (det.get(k) or {}).get("first_call_s"),
                     H.ratio(d.get(f"bf16_eager_{size}_ms"), d.get(k)),
                     (mem.get(k[:-3]) or {}).get("allocated"), (mem.get(k[:-3]) or {}).get("peak")])
    targets = [[k, t["measured"], t["target"], str(t["met"])] for k, t in (d.get("targets") or {}).items()]
    lines += ["", *H.md_table(["case", "ms", "wall ms", "GPU busy ms", "ms/busy", "kernels", "first call s",
                               "vs bf16 eager", "allocated GiB", "peak GiB"], rows)]
    bi, f = d.get("bit_identical") or {}, d.get("fidelity") or {}
    lines += ["", f"bf16 patched bit-identical to unpatched: {d.get('bf16_bit_identical')} ("
              + ", ".join(f"{s}: {v.get('identical')}, max abs diff {H.fmt(v.get('max_abs_diff'))}, "
                          f"{v.get('mismatched_elements')}/{v.get('elements')} elements differ" for s, v in bi.items())
              + ")",
              f"Fidelity at 1024^2 vs fp32 (target tokens): FP8 patched {H.fmt(f.get('rel_err_fp8_patched_1024'), 5)}, "
              f"fake quant {H.fmt(f.get('rel_err_fp8_fake_quant_1024'), 5)}, fidelity_ratio_forward "
              f"{H.fmt(d.get('fidelity_ratio_forward'), 4)}",
              f"Real FP8 linears (report summary fp8_gemm_linears): {d.get('fp8_real_linears')} of "
              f"{d.get('fp8_modelopt_linears')} ModelOpt linears the report counts; "
              f"{d.get('fp8_quantized_block_linears')} block linears carry an enabled ModelOpt weight quantizer",
              "", "Memory (GiB; allocated after gc with the mode's model resident, peak since the mode started): "
              + ", ".join(f"{m} {H.fmt(v.get('allocated'))} / {H.fmt(v.get('peak'))}" for m, v in mem.items()),
              "", *H.md_table(["target (issue 21)", "measured", "required", "met"], targets, 4)]
    lines += [f"\n`{n}`: graph_fallbacks {r.get('graph_fallbacks')}, runtime_fallbacks {r.get('runtime_fallbacks')}, "
              f"cuda_graph {r.get('cuda_graph_mode')}, summary `{r.get('summary')}`"
              for n, r in (d.get("reports") or {}).items()]
    return H.md_document(lines, d)


DEFAULTS = {"num_layers": (32, 2), "text_tokens": (128, 8), "warmup": (3, 1), "iters": (5, 2), "fake_warmup": (1, 1),
            "fake_iters": (5, 2), "calib": (2, 1)}  # (full, tiny)


def main(argv: list[str] | None = None) -> int:
    p = H.parser(__doc__, budget_s=240.0, description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=("full", "tiny"), default="full",
                   help="full: the 32-layer full-size model on the GPU; tiny: the CPU smoke run (= --tiny)")
    p.add_argument("--name", default=None, help="file name stem (default qwenimage21_h200; tiny: qwenimage21_tiny)")
    p.add_argument("--sides", default=None,
                   help="target latent tokens per side of the '1024' and '2048' cases (default 64,128; tiny: 4,8)")
    H.add_int_args(p, DEFAULTS, "tiny")
    H.add_steady_warmup_arg(p)
    a = p.parse_args(argv)
    a.tiny = a.tiny or a.size == "tiny"
    a.size = "tiny" if a.tiny else "full"
    a = H.finish_args(p, a, tiny_prefix="qwenimage21", defaults=DEFAULTS)
    a.warmup_s = H.steady_warmup_s(a)
    a.name = a.name or ("qwenimage21_tiny" if a.tiny else "qwenimage21_h200")
    try:
        a.sides = [int(x) for x in (a.sides or ("4,8" if a.tiny else "64,128")).split(",")]
    except ValueError:
        p.error(f"--sides: two integers, e.g. 64,128 (got {a.sides!r})")
    if len(a.sides) != 2 or any(n <= 0 or (n * n) % 4 for n in a.sides):
        p.error(f"--sides: two sides whose squares are multiples of 4 (got {a.sides})")
    if not a.tiny and (a.iters < 5 or a.fake_iters < 5 or a.warmup < 1):
        p.error("--iters and --fake-iters >= 5, --warmup >= 1 (medians of at least 5 calls after warm-up)")
    if not 1 <= a.calib <= 2:
        p.error("--calib: 1 or 2 calibration forwards")
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
