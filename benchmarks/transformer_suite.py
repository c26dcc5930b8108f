#!/usr/bin/env python
"""One device-efficient run of the full 60-layer Qwen-Image transformer: host cost, real FP8, fidelity, kernels.

ONE process builds the random full-size transformer (bf16, ~41 GB) once and modifies it in place (bf16 -> ModelOpt
FP8 fake quant), so the GPU never holds more than ~82 GB. Sections and the documents they write:

``host`` -> ``<out>/host_cost.json`` (merged: keys other scripts write, e.g. ``bench_ops.py --sections host``, are
    kept) + ``.md``: ``"1024"`` / ``"512"`` (4096 / 1024 image tokens) bf16 unpatched vs ``qwen_absorb.patch``
    (default): wall ms, GPU busy ms, kernels per call; ``"fp8_1024"``: ModelOpt FP8 fake quant unpatched vs
    patched with the default (``patched_ms``) and with ``fp8_gemm=False`` (``patched_fake_ms``).
``fp8`` -> ``<out>/fp8_gemm.json`` + ``.md``: at 1024^2 bf16 eager vs FP8 fake quant vs real FP8
    (``fp8_gemm=True``): wall, GPU busy, kernels per call and per block, one block alone (inputs captured in the
    call), the kernel table by name of each case (``profiles``), fidelity against an fp32 reference (one forward and
    the final latents of a 4-step FlowMatch Euler loop), ``use_fast_accum`` both ways, memory (bf16, fake, real,
    real with ``offload_original_weights=True``).
``fidelity`` -> ``<out>/fidelity.json`` + ``.md`` (was benchmarks/fidelity.py): the same fp32 reference; cases bf16
    unpatched / patched, FP8 unpatched / patched with deferred biases (``capabilities={this GPU}``) / with
    ``defer_bias=False``; pass = patched error <= 1.05x unpatched error (the gate of ``gating.VALIDATED_*``).

Method: B = 1, 128 text tokens, bf16 activations, ``torch.inference_mode()``, no text mask. Per case: a first call,
``--warmup`` calls, ``--iters`` timed calls (``--fp8-fake-iters`` for fake quant) between CUDA events, synchronized
after each: the median is the wall time of one call; GPU busy: one more call under torch.profiler, the sum of its
kernels' durations (harness.profile_call). Memory: ``torch.cuda.memory_allocated`` after gc + empty_cache, minus
what was allocated before the model (GB = 1e9 bytes). A killed run keeps what was done; keys not measured are null
with a reason under ``skipped``.

    python benchmarks/transformer_suite.py                          # H200, 60 layers, all sections: ~5-6 min
    python benchmarks/transformer_suite.py --sections fp8           # one section (fidelity: ~3 min)
    python benchmarks/transformer_suite.py --tiny                   # CPU smoke run of the same steps (seconds)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

SECTIONS = ("host", "fp8", "fidelity")
MODEL = {"num_layers": (60, 2), "text_tokens": (128, 8)}  # (default, --tiny)
PASS_RATIO = 1.05


def host_template(n: dict[str, int], txt: int) -> dict[str, Any]:
    res = {k: None for w in ("unpatched", "patched") for k in (f"{w}_ms", f"{w}_gpu_busy_ms", f"{w}_kernels_per_call",
                                                                f"{w}_wall_minus_busy_ms")}
    fp8 = {k: None for w in ("unpatched", "patched", "patched_fake")
           for k in (f"{w}_ms", f"{w}_gpu_busy_ms", f"{w}_kernels_per_call")}
    return {"1024": {"image_tokens": n["1024"], "text_tokens": txt, **res, "samples_ms": {}},
            "512": {"image_tokens": n["512"], "text_tokens": txt, **res, "samples_ms": {}},
            "fp8_1024": {"image_tokens": n["1024"], "text_tokens": txt, **fp8, "patched_fp8_gemm_linears": None,
                         "samples_ms": {}}}


FP8_KEYS = ("bf16_eager_ms", "fp8_fake_ms", "fp8_real_ms", "bf16_eager_gpu_busy_ms", "fp8_fake_gpu_busy_ms",
            "fp8_real_gpu_busy_ms", "fp8_real_block_ms", "fp8_real_ms_per_layer", "fp8_real_kernels_per_block",
            "bf16_patched_kernels_per_block", "fidelity_ratio_forward", "fidelity_ratio_latents", "fp8_real_vs_bf16",
            "fp8_real_vs_fake", "use_fast_accum", "offload_output_identical", "fp8_real_linears",
            "fp8_real_offloaded_ms")
CASES = ("bf16_unpatched", "bf16_patched", "fp8_fake", "fp8_real")


class Suite(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        side = {"1024": 8, "512": 4} if a.tiny else {"1024": 64, "512": 32}
        self.side, n = side, {r: s * s for r, s in side.items()}
        cfg = {**self.cfg, "image_tokens": n, "batch": 1, "dtype": "bf16"}
        meta = H.head("benchmarks/transformer_suite.py", self.env, cfg)
        self.HC = self.F = self.FD = None
        docs = []
        if "host" in a.sections:
            self.HC = H.Results(a.out, "host_cost", {**host_template(n, a.text_tokens), "transformer_suite": meta},
                                host_markdown, merge=True)
            docs.append(self.HC)
        if "fp8" in a.sections:
            self.F = H.Results(a.out, "fp8_gemm", {**meta, **dict.fromkeys(FP8_KEYS), "kernels_per_block": {},
                                                   "block_ms": {}, "kernels_per_call": {}, "fidelity": {},
                                                   "memory_gb": {}, "memory_ratios": {}, "fast_accum": {},
                                                   "profiles": {}, "memory_detail": {}, "samples_ms": {}},
                               fp8_markdown)
            docs.append(self.F)
        if "fidelity" in a.sections:
            self.FD = H.Results(a.out, "fidelity", {**meta, "cases": [], "verdict": None, "patch_reports_summary": {}},
                                fidelity_markdown)
            docs.append(self.FD)
        self.docs = docs
        self.steps = H.Steps(docs, a.budget_s, cleanup=lambda: self.model is not None and qwen_absorb.unpatch(self.model))
        self.model: torch.nn.Module | None = None
        self.ref: tuple[torch.Tensor, torch.Tensor] | None = None
        self.outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cap: dict[str, dict[str, Any]] = {}
        self.mem_base = 0

    def wants(self, *sections: str) -> bool:
        return bool(set(sections) & set(self.a.sections))

    # ------------------------------------------------------------------ measurement helpers
    def measure(self, label: str, kw: dict[str, Any], iters: int | None = None, capture: str | None = None):
        store = self.cap.setdefault(capture, {}) if capture else None
        ctx = H.capture_block_inputs(self.model, self.block_idx, store) if capture else None
        if ctx is not None:  # the first call of the configuration captures one block's inputs
            with ctx, torch.inference_mode():
                self.model(**kw)
        m = self.model
        return H.measure(label, lambda: m(**kw)[0], self.dev, self.a.warmup, iters or self.a.iters)

    def block(self, label: str, capture: str) -> dict[str, Any] | None:
        st = self.cap.pop(capture, {})
        if "kwargs" not in st:
            return None
        blk, args, kw = self.model.transformer_blocks[self.block_idx], st["args"], st["kwargs"]
        return H.measure(f"{label} block {self.block_idx}", lambda: blk(*args, **kw), self.dev, max(3, self.a.warmup),
                         self.a.block_iters)

    def put_host(self, res: str, which: str, r: dict[str, Any], rep: Any = None) -> None:
        if self.HC is None:
            return
        P, (b, why) = f"{res}.{which}", H.busy(r)
        self.HC.put(f"{P}_ms", r["median_ms"])
        self.HC.put(f"{P}_gpu_busy_ms", b, why)
        self.HC.put(f"{P}_kernels_per_call", *H.busy(r, "kernels_per_call"))
        if not res.startswith("fp8"):
            self.HC.put(f"{P}_wall_minus_busy_ms", None if b is None else r["median_ms"] - b, why)
        self.HC.put(f"{res}.samples_ms.{which}", r["samples_ms"])
        if rep is not None:
            self.HC.put(f"{P}_report_summary", H.summary(rep))
            self.HC.put(f"{P}_runtime_fallbacks", H.fallbacks(rep))
        base = self.HC.get(f"{res}.unpatched_ms")
        if which != "unpatched":
            self.HC.put(f"{res}.speedup_{which}_vs_unpatched", H.ratio(base, r["median_ms"]))

    def put_fp8(self, key: str, r: dict[str, Any]) -> None:
        """bf16_eager / fp8_fake / fp8_real call into fp8_gemm.json."""
        if self.F is None:
            return
        self.F.put(f"{key}_ms", r["median_ms"])
        self.F.put(f"{key}_gpu_busy_ms", *H.busy(r))
        self.F.put(f"kernels_per_call.{key}", *H.busy(r, "kernels_per_call"))
        self.F.put(f"samples_ms.{key}", r["samples_ms"])
        self.F.put(f"profiles.{key}", r["profile"])

    def put_block(self, key: str, rb: dict[str, Any] | None) -> None:
        if self.F is None:
            return
        why = "no block inputs captured (the call of this configuration did not run)"
        self.F.put(f"block_ms.{key}", rb and rb["median_ms"], None if rb else why)
        self.F.put(f"kernels_per_block.{key}", *(H.busy(rb, "kernels_per_call") if rb else (None, why)))
        if rb:
            self.F.put(f"profiles.block_{key}", rb["profile"])

    def mem_put(self, key: str, when: str) -> None:
        if self.F is None:
            return
        g = H.memory_gib(self.dev)
        if g is None:
            self.F.put(f"memory_gb.{key}", None, f"{H.NEEDS_CUDA} (torch.cuda.memory_allocated)")
            return
        gb = round(g * 2**30 / 1e9 - self.mem_base, 3)
        self.F.put(f"memory_gb.{key}", gb)
        self.F.put(f"memory_detail.{key}", {"allocated_gb": round(g * 2**30 / 1e9, 3), "when": when,
                                            "reserved_gb": round(torch.cuda.memory_reserved(self.dev) / 1e9, 3)})
        H.log(f"  memory {key}: {gb:.2f} GB ({when})")

    @torch.inference_mode()
    def outputs(self, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward and the latents of the ``--steps`` FlowMatch loop, fp32."""
        kw = H.as_dtype(self.kw32, dtype)
        out = self.model(**kw)[0].float()
        return out, H.flow_match_denoise(self.model, kw, self.noise32.to(dtype), self.a.steps, self.dev)

    def fidelity(self, key: str, case: str | None = None, rep: Any = None, baseline: str | None = None) -> None:
        """Outputs against the fp32 reference: into fp8_gemm.json (``key`` in bf16/fp8_fake/fp8_real) and, with
        ``case``, a fidelity.json case (``baseline``: the unpatched case it is judged against)."""
        if self.ref is None:
            raise RuntimeError("no fp32 reference (its step was skipped or failed)")
        out, lat = self.outputs()
        ef, el = H.rel_err(out, self.ref[0]), H.rel_err(lat, self.ref[1])
        H.log(f"  fidelity {case or key}: rel err forward {ef:.4e}, latents {el:.4e}")
        for k in {key, case} - {None, ""}:
            self.outs[k] = (out, lat)
        if self.F is not None and key:
            self.F.put(f"fidelity.rel_err_forward.{key}", ef)
            self.F.put(f"fidelity.rel_err_latents.{key}", el)
            self.F.put(f"fidelity.finite.{key}", bool(torch.isfinite(out).all() and torch.isfinite(lat).all()))
        if self.FD is None or case is None:
            return
        c: dict[str, Any] = {"case": case, "rel_err_forward": ef, "rel_err_latents": el,
                             "finite": bool(torch.isfinite(out).all() and torch.isfinite(lat).all())}
        if rep is not None:
            s = H.summary(rep) or {}
            c.update(biases_deferred=s.get("biases_deferred"), sites_fused=f"{s.get('sites_fused')}/{s.get('sites')}",
                     kernels_available=getattr(rep, "kernels_available", None))
            self.FD.d["patch_reports_summary"][case] = s
        if baseline is not None and baseline in self.outs:
            b = next(x for x in self.FD.d["cases"] if x["case"] == baseline)
            bo, bl = self.outs[baseline]
            c["vs_unpatched"] = {"baseline": baseline, "forward_rel_diff": H.rel_err(out, bo),
                                 "latents_rel_diff": H.rel_err(lat, bl),
                                 "latents_max_abs_diff": float((lat - bl).abs().max()),
                                 "forward_err_ratio": H.ratio(ef, b["rel_err_forward"]),
                                 "latents_err_ratio": H.ratio(el, b["rel_err_latents"])}
            c["pass"] = bool(c["finite"] and (c["vs_unpatched"]["forward_err_ratio"] or 0) <= PASS_RATIO)
            c["latents_pass"] = bool((c["vs_unpatched"]["latents_err_ratio"] or 0) <= PASS_RATIO)
        self.FD.d["cases"].append(c)
        deferred = [x for x in self.FD.d["cases"] if "deferred" in x["case"]]
        self.FD.d["verdict"] = {
            "all_pass": all(x.get("pass", True) for x in self.FD.d["cases"]),
            "deferral_pass": bool(deferred) and all(x.get("pass") and (x.get("biases_deferred") or 0) > 0
                                                    for x in deferred),
            "capability": self.capability}

    def patched(self, label: str, **kw: Any) -> Any:
        if kw.get("fp8_gemm") is True and not self.cuda:  # --tiny: the real-FP8 path through the CPU capability
            kw.setdefault("capabilities", {"cpu"})
        return H.patched(self.model, **kw)

    # ------------------------------------------------------------------ steps
    def setup(self) -> None:
        a, dev = self.a, self.dev
        H.load_modelopt()
        H.start_profiler(dev)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        self.mem_base = (H.memory_gib(dev) or 0) * 2**30 / 1e9
        self.model = H.build_transformer(a.tiny, a.num_layers, dev, torch.bfloat16, a.seed)
        self.block_idx = min(a.num_layers - 1, a.num_layers // 2)
        self.capability = torch.cuda.get_device_capability(dev) if self.cuda else "cpu"
        self.mem_put("bf16", "bf16 model built")
        s, t = self.side, a.text_tokens
        self.kw32 = H.inputs(self.model, s["1024"], t, dev, torch.float32, a.seed + 1)
        self.noise32 = torch.randn(self.kw32["hidden_states"].shape,
                                   generator=torch.Generator().manual_seed(a.seed + 2)).to(dev)
        self.in1024 = H.as_dtype(self.kw32, torch.bfloat16)
        self.in512 = H.inputs(self.model, s["512"], t, dev, torch.bfloat16, a.seed + 3)
        self.calib = [H.inputs(self.model, s["1024"], t, dev, torch.bfloat16, a.seed + 10 + i, ts)
                      for i, ts in enumerate((0.9, 0.5, 0.1)[: a.calib])]

    def modelopt_warmup(self) -> None:
        """ModelOpt builds (or loads) its FP8 CUDA extension on first use: do it on a 1-block model."""
        if self.cuda:
            tiny = H.build_transformer(True, 1, self.dev, torch.bfloat16)
            kw = H.inputs(tiny, 4, 8, self.dev, torch.bfloat16)
            H.log(f"  ModelOpt FP8 ready in {H.fp8_quantize(tiny, kw)} s")

    def fp32_reference(self) -> None:
        with H.in_fp32(self.model, self.dev):
            self.ref = self.outputs(torch.float32)

    def bf16_unpatched(self) -> None:
        qwen_absorb.unpatch(self.model)
        r = self.measure("bf16 unpatched 1024", self.in1024, capture="bf16_unpatched")
        self.put_host("1024", "unpatched", r)
        self.put_fp8("bf16_eager", r)
        if self.wants("host"):
            self.put_host("512", "unpatched", self.measure("bf16 unpatched 512", self.in512))

    def unpatched_block_fid(self, block_key: str, block_label: str, fid_key: str, fid_label: str) -> None:
        """The unpatched model's single-block time (with the fusion document) and its fidelity run."""
        qwen_absorb.unpatch(self.model)
        if self.F is not None:
            self.put_block(block_key, self.block(block_label, block_key))
        self.fidelity(fid_key, fid_label)

    def bf16_patched(self) -> None:
        rep = self.patched("bf16")
        if self.wants("host", "fp8"):
            r = self.measure("bf16 patched 1024", self.in1024, capture="bf16_patched")
            self.put_host("1024", "patched", r, rep)
            rb = self.block("bf16 patched", "bf16_patched")
            self.put_block("bf16_patched", rb)
            if self.F is not None:
                self.F.put("bf16_patched_kernels_per_block", *H.busy(rb, "kernels_per_call"))
        if self.wants("host"):
            self.put_host("512", "patched", self.measure("bf16 patched 512", self.in512), rep)
        if self.FD is not None:
            self.fidelity("", "bf16 patched", rep, "bf16 unpatched")
        qwen_absorb.unpatch(self.model)

    def fp8_quantize(self) -> None:
        qwen_absorb.unpatch(self.model)
        s = H.fp8_quantize(self.model, self.calib)
        for d in self.docs:
            d.d["fp8_quantization"] = {"config": "mtq.FP8_DEFAULT_CFG (tests/builders.py fp8_quantize)",
                                       "calibration_forwards": len(self.calib), "seconds": s, "in_place": True}
        self.mem_put("fp8_fake", "ModelOpt FP8 fake-quant model")

    def fp8_fake(self) -> None:
        qwen_absorb.unpatch(self.model)
        r = self.measure("fp8 fake unpatched 1024", self.in1024, self.a.fp8_fake_iters, capture="fp8_fake")
        self.put_host("fp8_1024", "unpatched", r)
        self.put_fp8("fp8_fake", r)

    def fp8_real(self) -> None:
        F, a = self.F, self.a
        rep = self.patched("fp8 real", fp8_gemm=True)
        n = (H.summary(rep) or {}).get("fp8_gemm_linears")
        F.put("fp8_real_linears", n)
        r = self.measure("fp8 real (fp8_gemm=True) 1024", self.in1024, capture="fp8_real")
        self.put_fp8("fp8_real", r)
        F.put("fp8_real_ms_per_layer", r["median_ms"] / a.num_layers)
        F.put("fp8_real_vs_bf16", H.ratio(F.get("bf16_eager_ms"), r["median_ms"]), "bf16_eager_ms not measured")
        F.put("fp8_real_vs_fake", H.ratio(F.get("fp8_fake_ms"), r["median_ms"]), "fp8_fake_ms not measured")
        rb = self.block("fp8 real", "fp8_real")
        self.put_block("fp8_real", rb)
        F.put("fp8_real_block_ms", rb and rb["median_ms"], None if rb else "no block inputs captured")
        F.put("fp8_real_kernels_per_block", *H.busy(rb, "kernels_per_call"))
        F.put("fp8_real_block_ms_method", f"median of {a.block_iters} calls of transformer_blocks[{self.block_idx}] "
                                          "alone on inputs captured in the first 1024^2 call")
        self.mem_put("fp8_real_patched", "patched fp8_gemm=True, after calls: bf16 + FP8 weights resident")
        self.fidelity("fp8_real")
        for k in ("forward", "latents"):
            F.put(f"fidelity_ratio_{k}", H.ratio(F.get(f"fidelity.rel_err_{k}.fp8_real"),
                                                 F.get(f"fidelity.rel_err_{k}.fp8_fake")), "fp8_fake not measured")
        if "fp8_fake" in self.outs:
            F.put("fidelity.real_vs_fake_rel_diff_forward", H.rel_err(self.outs["fp8_real"][0],
                                                                      self.outs["fp8_fake"][0]))
        F.put("use_fast_accum", bool(getattr(rep, "use_fast_accum", False)))
        F.put("fp8_real_report_summary", H.summary(rep))
        F.put("fp8_real_runtime_fallbacks", H.fallbacks(rep))
        qwen_absorb.unpatch(self.model)

    def fp8_real_fast_accum(self) -> None:
        F = self.F
        other = not bool(F.get("use_fast_accum"))
        self.patched("fast accum", fp8_gemm=True, use_fast_accum=other)
        F.put("fast_accum.use_fast_accum", other)
        r = self.measure(f"fp8 real use_fast_accum={other} 1024", self.in1024)
        F.put("fast_accum.fp8_real_ms", r["median_ms"])
        F.put("fast_accum.gpu_busy_ms", *H.busy(r))
        F.put("fast_accum.speedup_vs_fp8_real", H.ratio(F.get("fp8_real_ms"), r["median_ms"]))
        F.put("samples_ms.fp8_real_fast_accum", r["samples_ms"])
        out, lat = self.outputs()
        for k, v, ref in (("forward", out, self.ref[0]), ("latents", lat, self.ref[1])):
            e = H.rel_err(v, ref)
            F.put(f"fast_accum.rel_err_{k}", e)
            F.put(f"fast_accum.fidelity_ratio_{k}", H.ratio(e, F.get(f"fidelity.rel_err_{k}.fp8_fake")))
        qwen_absorb.unpatch(self.model)

    def fidelity_fp8_patched(self) -> None:
        caps = {self.capability}
        rep = self.patched("fp8 deferred", capabilities=caps)
        self.fidelity("", "fp8 patched, deferred biases", rep, "fp8 unpatched")
        rep = self.patched("fp8 in GEMM", defer_bias=False)
        self.fidelity("", "fp8 patched, biases in GEMM", rep, "fp8 unpatched")
        qwen_absorb.unpatch(self.model)

    def fp8_patched_host(self, which: str, **kw: Any) -> None:
        rep = self.patched(which, **kw)
        if which == "patched":
            self.HC.put("fp8_1024.patched_fp8_gemm_linears", (H.summary(rep) or {}).get("fp8_gemm_linears"))
        real = bool((H.summary(rep) or {}).get("fp8_gemm_linears"))
        r = self.measure(f"fp8 {which} 1024", self.in1024, self.a.iters if real else self.a.fp8_fake_iters)
        self.put_host("fp8_1024", which, r, rep)
        qwen_absorb.unpatch(self.model)

    def fp8_real_offload(self) -> None:
        F = self.F
        self.patched("offload", fp8_gemm=True, offload_original_weights=True)
        with torch.inference_mode():
            out = self.model(**self.in1024)[0].float()
        if "fp8_real" in self.outs:
            F.put("offload_output_identical", bool(torch.equal(out, self.outs["fp8_real"][0])))
            F.put("offload_output_rel_diff", H.rel_err(out, self.outs["fp8_real"][0]))
        del out
        self.mem_put("fp8_real_offloaded", "patched fp8_gemm=True, offload_original_weights=True, after a call")
        r = self.measure("fp8 real offloaded 1024", self.in1024)
        F.put("fp8_real_offloaded_ms", r["median_ms"])
        F.put("samples_ms.fp8_real_offloaded", r["samples_ms"])
        qwen_absorb.unpatch(self.model)

    def run(self) -> int:
        s, HC, F, FD = self.steps, self.HC, self.F, self.FD
        s.write()
        H.log(f"transformer_suite: sections {','.join(self.a.sections)}, {self.a.num_layers} layers on {self.dev}, "
              f"writing to {self.a.out}")
        if not s("setup", self.setup):
            return self.finish()
        s("modelopt_extension_warmup", self.modelopt_warmup)
        if self.wants("fp8", "fidelity"):
            s("fp32_reference", self.fp32_reference)
        if self.wants("host", "fp8"):
            s("bf16_unpatched", self.bf16_unpatched, [(HC, "1024.unpatched_ms"), (F, "bf16_eager_ms")])
        if self.wants("fp8", "fidelity"):
            s("bf16_unpatched_block_and_fidelity",
              lambda: self.unpatched_block_fid("bf16_unpatched", "bf16 unpatched", "bf16", "bf16 unpatched"))
        s("bf16_patched", self.bf16_patched, [(HC, "1024.patched_ms"), (HC, "512.patched_ms")])
        if not s("fp8_quantize", self.fp8_quantize):
            return self.finish()
        if self.wants("host", "fp8"):
            s("fp8_fake_unpatched", self.fp8_fake, [(HC, "fp8_1024.unpatched_ms"), (F, "fp8_fake_ms")])
        if self.wants("fp8", "fidelity"):
            s("fp8_fake_block_and_fidelity",
              lambda: self.unpatched_block_fid("fp8_fake", "fp8 fake unpatched", "fp8_fake", "fp8 unpatched"))
        if F is not None and s("fp8_real", self.fp8_real, [(F, k) for k in FP8_KEYS if "real" in k]):
            s("fp8_real_fast_accum", self.fp8_real_fast_accum, [(F, "fast_accum.fp8_real_ms")])
        if FD is not None:
            s("fidelity_fp8_patched", self.fidelity_fp8_patched)
        if HC is not None:
            s("fp8_patched_default", lambda: self.fp8_patched_host("patched"), [(HC, "fp8_1024.patched_ms")])
            s("fp8_patched_fake", lambda: self.fp8_patched_host("patched_fake", fp8_gemm=False),
              [(HC, "fp8_1024.patched_fake_ms")])
        if F is not None:
            s("fp8_real_offload", self.fp8_real_offload, [(F, "fp8_real_offloaded_ms"),
                                                          (F, "memory_gb.fp8_real_offloaded")])
        return self.finish()

    def finish(self) -> int:
        if self.F is not None:
            m = self.F.get("memory_gb") or {}
            for k, (x, y) in {"fp8_real_patched_vs_bf16": ("fp8_real_patched", "bf16"),
                              "fp8_real_offloaded_vs_bf16": ("fp8_real_offloaded", "bf16"),
                              "fp8_real_offloaded_vs_fake": ("fp8_real_offloaded", "fp8_fake")}.items():
                self.F.put(f"memory_ratios.{k}", H.ratio(m.get(x), m.get(y)))
            if self.cuda:
                self.F.put("memory_detail.peak_allocated_gb_run_incl_fp32_reference",
                           round(torch.cuda.max_memory_allocated(self.dev) / 1e9 - self.mem_base, 3))
            for k in FP8_KEYS:
                self.F.skip(k, "not measured (its step failed or was skipped: see errors)")
        if self.model is not None:
            qwen_absorb.unpatch(self.model)
        self.steps.write()
        for d in self.docs:
            H.log(f"wrote {d.json} and {d.md.name}")
        return 1 if self.steps.failed else 0


# ------------------------------------------------------------------------------------------ markdown


def _method(d: dict[str, Any]) -> str:
    c = d.get("config") or {}
    return (f"{c.get('num_layers')} layers, B = 1, {c.get('text_tokens')} text tokens, bf16, inference_mode; median "
            f"of {c.get('iters')} calls (fake quant {c.get('fp8_fake_iters')}) after {c.get('warmup')} warm-up, CUDA "
            "events; GPU busy = sum of kernel durations of one call (torch.profiler)")


def host_markdown(doc: dict[str, Any]) -> str:
    meta = doc.get("transformer_suite") or {}
    lines = H.md_head("Host cost of one Qwen-Image transformer call: unpatched vs qwen_absorb.patch",
                      {**meta, "elapsed_s": doc.get("elapsed_s")}, _method(meta))
    rows = []
    for res in ("1024", "512"):
        o = doc.get(res) or {}
        for w in ("unpatched", "patched"):
            rows.append([f"bf16 {w} {res}^2", o.get(f"{w}_ms"), o.get(f"{w}_gpu_busy_ms"), o.get(f"{w}_kernels_per_call"),
                         o.get("speedup_patched_vs_unpatched") if w == "patched" else None])
    o = doc.get("fp8_1024") or {}
    for w, name in (("unpatched", "unpatched"), ("patched", "patched (default)"),
                    ("patched_fake", "patched, fp8_gemm=False")):
        rows.append([f"ModelOpt FP8 {name} 1024^2", o.get(f"{w}_ms"), o.get(f"{w}_gpu_busy_ms"),
                     o.get(f"{w}_kernels_per_call"), o.get(f"speedup_{w}_vs_unpatched")])
    lines += ["", *H.md_table(["case", "wall ms", "GPU busy ms", "kernels/call", "speed-up vs unpatched"], rows)]
    op = {k: v for k, v in doc.items() if k in ("torch_add_us", "op_us", "block_entry_us", "ratio_op_vs_add")}
    if op:
        lines += ["", "Op-level host cost (benchmarks/bench_ops.py --sections host):"]
        lines += [f"- `{k}`: `{json.dumps(v) if isinstance(v, dict) else v}`" for k, v in op.items()]
    return H.md_document(lines, doc)


def fp8_markdown(d: dict[str, Any]) -> str:
    g = lambda p: H.dotted_get(d, p)  # noqa: E731
    n = (d.get("config") or {}).get("num_layers") or 60
    lines = H.md_head("Real FP8 GEMMs (qwen_absorb.patch(fp8_gemm=True)) vs ModelOpt fake quant vs bf16", d,
                      _method(d))
    rows = [[name, g(f"{k}_ms"), g(f"{k}_gpu_busy_ms"), g(f"kernels_per_call.{k}"),
             g(f"{k}_ms") and g(f"{k}_ms") / n] for name, k in (("bf16 eager", "bf16_eager"),
                                                                ("ModelOpt FP8 fake quant", "fp8_fake"),
                                                                ("real FP8 (fp8_gemm=True)", "fp8_real"))]
    lines += ["", *H.md_table(["case (1024^2)", "wall ms", "GPU busy ms", "kernels/call", "ms per layer"], rows),
              "", f"Speed-up of real FP8: {H.fmt(g('fp8_real_vs_bf16'))}x over bf16 eager, "
                  f"{H.fmt(g('fp8_real_vs_fake'))}x over fake quant; {g('fp8_real_linears')} real-FP8 linears.", ""]
    lines += H.md_table(["one block", "median ms", "kernels"],
                        [[k, g(f"block_ms.{k}"), g(f"kernels_per_block.{k}")] for k in CASES])
    lines += ["", *H.md_table(["fidelity vs fp32 (rel err)", "forward", "4-step latents"],
                              [[k, g(f"fidelity.rel_err_forward.{k}"), g(f"fidelity.rel_err_latents.{k}")]
                               for k in ("bf16", "fp8_fake", "fp8_real")]),
              "", f"Ratio real / fake: forward {H.fmt(g('fidelity_ratio_forward'), 4)}, latents "
                  f"{H.fmt(g('fidelity_ratio_latents'), 4)}. use_fast_accum={g('fast_accum.use_fast_accum')}: "
                  f"{H.fmt(g('fast_accum.fp8_real_ms'))} ms, fidelity ratio forward "
                  f"{H.fmt(g('fast_accum.fidelity_ratio_forward'), 4)}, latents "
                  f"{H.fmt(g('fast_accum.fidelity_ratio_latents'), 4)}.", ""]
    lines += H.md_table(["model memory", "GB"], [[k, v] for k, v in (d.get("memory_gb") or {}).items()], 2)
    lines += ["", f"Offloaded: {H.fmt(g('fp8_real_offloaded_ms'))} ms, output identical to non-offloaded: "
                  f"{g('offload_output_identical')}. Runtime fallbacks: `{g('fp8_real_runtime_fallbacks')}`"]
    top = (g("profiles.fp8_real") or {}).get("top_kernels_by_time") or []
    if top:
        lines += ["", "Kernels of one real-FP8 call, by time:", "",
                  *H.md_table(["ms", "count", "kernel"], [[k["ms"], k["count"], f"`{k['name'][:100]}`"] for k in top])]
    return H.md_document(lines, d)


def fidelity_markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("Fidelity of qwen_absorb.patch: full Qwen-Image transformer, random weights", d,
                      f"reference: the model in fp32 (TF32 off); forward + {(d.get('config') or {}).get('steps')}-step "
                      f"FlowMatch Euler latents; pass: patched error <= {PASS_RATIO} x unpatched error (forward)")
    rows = []
    for c in d.get("cases") or []:
        v = c.get("vs_unpatched") or {}
        rows.append([c["case"], c["rel_err_forward"], c["rel_err_latents"], c.get("biases_deferred", "-"),
                     v.get("forward_err_ratio"), v.get("latents_err_ratio"), v.get("latents_rel_diff"),
                     {True: "PASS", False: "FAIL"}.get(c.get("pass"), "-")])
    lines += ["", *H.md_table(["case", "rel err forward", "rel err latents", "deferred", "err ratio fwd",
                               "err ratio latents", "latents rel diff", "pass"], rows, 4),
              "", f"Verdict: `{json.dumps(d.get('verdict'))}`"]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, SECTIONS, budget_s=420.0)
    H.add_int_args(ap, MODEL)
    ap.add_argument("--warmup", type=int, default=2, help="warm-up calls after the first call (>= 2)")
    ap.add_argument("--iters", type=int, default=7, help="timed calls (bf16 and real FP8), >= 5")
    ap.add_argument("--fp8-fake-iters", type=int, default=5, help="timed calls of fake quant (~0.8 s each), >= 5")
    ap.add_argument("--block-iters", type=int, default=20, help="timed calls of a single block")
    ap.add_argument("--steps", type=int, default=4, help="FlowMatch Euler steps of the fidelity loop")
    ap.add_argument("--calib", type=int, default=2, help="FP8 calibration forwards (1-3)")
    a = ap.parse_args(argv)
    if a.warmup < 2 or min(a.iters, a.fp8_fake_iters, a.block_iters) < 5 or not 1 <= a.calib <= 3:
        ap.error("method: --warmup >= 2, --iters / --fp8-fake-iters / --block-iters >= 5, --calib 1-3")
    a = H.finish_args(ap, a, SECTIONS, "transformer_suite", MODEL)
    if a.tiny:
        a.iters = a.fp8_fake_iters = a.block_iters = 5
    return Suite(a).run()


if __name__ == "__main__":
    sys.exit(main())
