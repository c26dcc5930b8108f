#!/usr/bin/env python
"""One transformer block: eager vs patched vs torch.compile, bf16 and ModelOpt FP8; the fused ops vs the copy rate.

Writes ``<out>/fusion.json`` + ``fusion.md`` (default ``benchmarks/results``), rewritten after every measurement.

section ``block``  A ``--num-layers`` (default 2) transformer at full width (3072 hidden, random weights), bf16 on
    CUDA. One transformer call at 1024^2 (4096 image + 128 text tokens, B = 1, no mask) captures the inputs of
    ``transformer_blocks[0]``; that block alone is timed (harness.measure: first call apart, warm-up, ``--block-iters``
    calls between CUDA events, one profiled call) as ``eager``, ``patched`` (``qwen_absorb.patch(model)``),
    ``compiled`` (``torch.compile(block)``) and ``patched_compiled`` -> ``block_wall_ms``, ``block_gpu_ms`` (GPU busy),
    ``kernels_per_block``, ``block_first_call_s``; ``patched_kernels_top`` = the kernel table of one patched call.
    ``block_in_model``: whole transformer calls with L1 and L2 layers (``--in-model-layers``), per block = the
    difference / (L2 - L1): inside the loop, where the cross-block hand-off takes place.
section ``fp8``  (was benchmarks/bench_block.py) the same block after ModelOpt FP8_DEFAULT_CFG: ``fp8_eager``
    (fake quant), ``fp8_patched`` (``defer_bias=False, fp8_gemm=False``), ``fp8_patched_deferred`` (deferred biases,
    capability override where needed), ``fp8_real`` (``fp8_gemm=True``), into the same ``block_*`` dicts.
section ``ops``  the three LayerNorm-family ops at ``--op-shape`` (default [1,16384,3072]) bf16: one call = a CUDA-
    graph replay of K calls over K input sets / K (K >= ``--op-sets``, one replay >= 3x L2); bytes = every operand
    read and output written once; ``copy_rate_pct`` = achieved / device copy rate * 100. ``--ln-variants
    name=DEFINE:VALUE[,...]`` re-times them with the kernels rebuilt under those defines -> ``copy_rate_pct_variants``
    and ``variant_bit_identical`` (outputs torch.equal to the default build's).
``--compile-json`` copies the 60-layer 1024^2 ``compile_repeated_blocks()`` numbers of a result file (``speed.py``'s
    ``speed_h200.json``, or an earlier ``cuda_graph.json``) -> ``compile_1024_ms``, ``compile_1024_speedup``,
    ``compile_1024_source``.

    python benchmarks/fusion_bench.py                                      # H200: ~2-3 min
    python benchmarks/fusion_bench.py --ln-variants packed=QA_LN_PACKED:1 --compile-json OUT/cuda_graph.json
    python benchmarks/fusion_bench.py --tiny                               # CPU smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

SECTIONS = ("block", "fp8", "ops")
BF16 = ("eager", "patched", "compiled", "patched_compiled")
FP8 = ("fp8_eager", "fp8_patched", "fp8_patched_deferred", "fp8_real")
OPS = H.OPS
TARGET_OPS = OPS[:2]
FULL_SHAPE = (1, 16384, 3072)


def op_bytes(op: str, shape: tuple[int, int, int]) -> dict[str, Any]:
    """Bytes one bf16 call moves (every operand read once, every output written once)."""
    B, L, D = shape
    act, row = B * L * D, B * D
    reads = {"layer_norm_scale_shift": [act, row, row], "bias_residual_layer_norm_scale_shift": [act, act, D, row, row, row],
             "bias_gate_residual": [act, act, D, row]}[op]
    writes = {"layer_norm_scale_shift": 1, "bias_residual_layer_norm_scale_shift": 2, "bias_gate_residual": 1}[op]
    return {"bytes": 2 * (sum(reads) + writes * act), "read_bytes": 2 * sum(reads), "write_bytes": 2 * writes * act,
            "full_tensors": sum(v == act for v in reads) + writes}


def op_reasons(op: str, s: tuple) -> list[str]:
    x, r, shift, scale, gate, bias = s
    o = qwen_absorb.ops
    if op == "layer_norm_scale_shift":
        return list(o.layer_norm_scale_shift_not_supported_reasons(x, shift=shift, scale=scale, eps=H.EPS))
    if op == "bias_residual_layer_norm_scale_shift":
        return list(o.bias_residual_layer_norm_scale_shift_not_supported_reasons(
            r, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=H.EPS))
    return list(o.bias_gate_residual_not_supported_reasons(r, x, bias=bias, gate=gate))


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, eq, rest = text.partition("=")
    defines: dict[str, Any] = {}
    for part in rest.split(",") if eq else []:
        k, colon, v = part.partition(":")
        if not colon or not k.strip() or not v.strip():
            break
        defines[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    else:
        if name.strip() and defines:
            return name.strip(), defines
    raise argparse.ArgumentTypeError(f"--ln-variants: expected name=DEFINE:VALUE[,DEFINE:VALUE], got {text!r}")


def compare(a: Any, b: Any) -> dict[str, Any]:
    a, b = (x if isinstance(x, (tuple, list)) else (x,) for x in (a, b))
    return {"identical": len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)),
            "max_abs": max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))}


def derive_targets(d: dict[str, Any]) -> dict[str, Any]:
    cfg = d.get("config") or {}
    judged = str(cfg.get("device", "")).startswith("cuda") and not cfg.get("tiny")
    g, k, w = d.get("block_gpu_ms") or {}, d.get("kernels_per_block") or {}, d.get("block_wall_ms") or {}
    src = d.get("compile_1024_source")
    rows = {
        "block_gpu_ms.patched / block_gpu_ms.compiled <= 1.0": (H.ratio(g.get("patched"), g.get("compiled")),
                                                                 lambda m: m <= 1.0, cfg.get("full_size_block")),
        "kernels_per_block.patched <= 40": (k.get("patched"), lambda m: m <= 40, cfg.get("full_size_block")),
        "block_wall_ms eager / patched >= 1.12": (H.ratio(w.get("eager"), w.get("patched")), lambda m: m >= 1.12,
                                                  cfg.get("full_size_block")),
        "compile_1024_ms.compiled / patched_compiled >= 1.05": (d.get("compile_1024_speedup"), lambda m: m >= 1.05,
                                                                isinstance(src, dict) and src.get("geometry_ok")),
    }
    for op in TARGET_OPS:
        ran = not ((d.get("ops") or {}).get(op) or {}).get("kernel_reasons")
        rows[f"copy_rate_pct.{op} >= 80 at {list(FULL_SHAPE)}"] = (
            (d.get("copy_rate_pct") or {}).get(op), lambda m: m >= 80, ran and cfg.get("op_shape") == list(FULL_SHAPE))
    return {t: {"measured": m, "met": bool(ok(m)) if m is not None and judged and geo else None}
            for t, (m, ok, geo) in rows.items()}


class Bench(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        env = self.env
        cfg = {**vars(a), "device": str(a.device), "out": str(a.out), "op_shape": list(a.op_shape),
               "ln_variants": [f"{n}={d}" for n, d in a.ln_variants]}
        empty = {v: None for v in BF16 + FP8}
        self.R = H.Results(a.out, "fusion", {
            **H.head("benchmarks/fusion_bench.py (one block eager / patched / compiled, bf16 and FP8; the fused "
                     "ops vs the copy rate)", env, cfg),
            "block_gpu_ms": dict(empty), "block_wall_ms": dict(empty), "kernels_per_block": dict(empty),
            "block_first_call_s": dict(empty), "block_output_vs_eager": {}, "patched_kernels_top": None,
            "block_in_model": {}, "patch_report": {}, "compiled_dynamo": {}, "copy_rate_tb_s": None,
            "copy_rate_runs_tb_s": [], "copy_rate_pct": dict.fromkeys(OPS), "ops": {}, "ln_variants": {},
            "copy_rate_pct_variants": {}, "variant_bit_identical": {}, "compile_1024_ms": {},
            "compile_1024_speedup": None, "compile_1024_source": None, "targets": {}, "block_details": {}}, markdown)
        self.steps = H.Steps([self.R], a.budget_s, cleanup=self.cleanup)
        self.model: torch.nn.Module | None = None
        self.outs: dict[str, Any] = {}

    def cleanup(self) -> None:
        from qwen_absorb.ops import _runtime  # noqa: PLC0415

        _runtime.set_defines(None)
        if self.model is not None:
            qwen_absorb.unpatch(self.model)

    def write(self) -> None:
        self.R.d["targets"] = derive_targets(self.R.d)
        self.R.write()

    # ------------------------------------------------------------------ block
    def block_setup(self) -> None:
        a, dev = self.a, self.dev
        H.start_profiler(dev)
        self.model = H.build_transformer(a.tiny, a.num_layers, dev, torch.bfloat16, a.seed)
        cfg, c = self.model.config, self.R.d["config"]
        c["hidden"] = cfg.num_attention_heads * cfg.attention_head_dim
        self.kw = H.inputs(self.model, a.side, a.text_tokens, dev, torch.bfloat16, a.seed + 1)
        store: dict[str, Any] = {}
        with torch.inference_mode(), H.capture_block_inputs(self.model, 0, store):
            self.model(**self.kw)
        self.bargs, self.bkw = store["args"], store["kwargs"]
        img, txt = int(self.bkw["hidden_states"].shape[1]), int(self.bkw["encoder_hidden_states"].shape[1])
        c["block_input_tokens"] = {"image": img, "text": txt}
        c["full_size_block"] = not a.tiny and c["hidden"] == 3072 and img == 4096 and txt == 128
        self.calib = [H.inputs(self.model, a.side, a.text_tokens, dev, torch.bfloat16, a.seed + 10 + i, t)
                      for i, t in enumerate((0.9, 0.5)[: a.calib])]

    def block_case(self, v: str, blk: Any, rep: Any = None, warmup: int | None = None) -> None:
        R = self.R
        r = H.measure(f"block {v}", lambda: blk(*self.bargs, **self.bkw), self.dev, warmup or self.a.warmup,
                      self.a.block_iters)
        R.put(f"block_wall_ms.{v}", round(r["median_ms"], 4))
        R.put(f"block_first_call_s.{v}", r["first_call_s"])
        R.put(f"block_gpu_ms.{v}", *H.busy(r))
        R.put(f"kernels_per_block.{v}", *H.busy(r, "kernels_per_call"))
        R.d["block_details"][v] = r
        with torch.inference_mode():
            out = blk(*self.bargs, **self.bkw)
        base = "fp8_eager" if v.startswith("fp8") else "eager"
        if v == base:
            self.outs[v] = tuple(t.clone() for t in out)
        elif base in self.outs:
            R.put(f"block_output_vs_eager.{v}", compare(out, self.outs[base]))
        if rep is not None:
            R.put(f"patch_report.{v}", {"summary": H.summary(rep), "runtime_fallbacks": H.fallbacks(rep)})
        self.write()

    def compiled(self, v: str, patch_kw: dict[str, Any] | None) -> None:
        from torch._dynamo.utils import counters  # noqa: PLC0415

        qwen_absorb.unpatch(self.model)
        torch._dynamo.reset()
        counters.clear()
        rep = qwen_absorb.patch(self.model, **patch_kw) if patch_kw is not None else None
        kw = {"backend": self.a.compile_backend} if self.a.compile_backend else {}
        self.R.d["config"]["compile_call"] = f"torch.compile(block{''.join(f', {k}={x!r}' for k, x in kw.items())})"
        try:
            self.block_case(v, torch.compile(self.model.transformer_blocks[0], **kw), rep, max(3, self.a.warmup))
            self.R.put(f"compiled_dynamo.{v}", H.dynamo_counters())
        finally:
            torch._dynamo.reset()
            qwen_absorb.unpatch(self.model)

    def block(self) -> None:
        blk = self.model.transformer_blocks[0]
        qwen_absorb.unpatch(self.model)
        self.block_case("eager", blk)
        rep = qwen_absorb.patch(self.model)
        try:
            self.block_case("patched", blk, rep)
            table = H.profile_call(lambda: blk(*self.bargs, **self.bkw), self.dev, top=0)[0]
            self.R.put("patched_kernels_top", table and table["top_kernels_by_time"],
                       None if table else f"{H.NEEDS_CUDA} (torch.profiler)")
            blocks = rep.to_dict().get("blocks") or []
            self.R.put("patch_report.summary", H.summary(rep))
            self.R.put("patch_report.qk_norm_rope_fused", [b.get("qk_norm_rope_fused") for b in blocks])
            self.R.put("patch_report.kernels_available", rep.kernels_available)
            self.R.put("patch_report.kernel_unavailable_reasons", list(rep.kernel_unavailable_reasons))
        finally:
            qwen_absorb.unpatch(self.model)

    def in_model(self) -> None:
        a, R = self.a, self.R
        l1, l2 = a.in_model_layers
        calls: dict[str, dict[str, Any]] = {}
        R.put("block_in_model.layers", [l1, l2])
        for n in (l1, l2):
            model = self.model if n == a.num_layers else H.build_transformer(a.tiny, n, self.dev, torch.bfloat16,
                                                                             a.seed)
            kw = H.inputs(model, a.side, a.text_tokens, self.dev, torch.bfloat16, a.seed + 1)
            try:
                for v in ("eager", "patched"):
                    rep, _ = H.patch(model) if v == "patched" else (qwen_absorb.unpatch(model), None)
                    r = H.measure(f"{n}-layer transformer {v}", lambda m=model: m(**kw)[0], self.dev, a.warmup,
                                  a.block_iters)
                    calls.setdefault(str(n), {})[v] = {"wall_ms": r["median_ms"], "gpu_ms": H.busy(r)[0],
                                                       "kernels": H.busy(r, "kernels_per_call")[0],
                                                       "runtime_fallbacks": H.fallbacks(rep)}
                    R.put("block_in_model.calls", calls)
            finally:
                qwen_absorb.unpatch(model)
                del model
        for v in ("eager", "patched"):
            for key in ("wall_ms", "gpu_ms", "kernels"):
                x, y = calls[str(l1)][v][key], calls[str(l2)][v][key]
                R.put(f"block_in_model.{key}.{v}", None if x is None or y is None else round((y - x) / (l2 - l1), 4),
                      H.NEEDS_CUDA if x is None or y is None else None)

    def fp8(self) -> None:
        blk = self.model.transformer_blocks[0]
        qwen_absorb.unpatch(self.model)
        self.R.d["fp8_quantize_s"] = H.fp8_quantize(self.model, self.calib)
        self.block_case("fp8_eager", blk)
        cap = {torch.cuda.get_device_capability(self.dev) if self.cuda else "cpu"}
        for v, kw in (("fp8_patched", {"defer_bias": False, "fp8_gemm": False}),
                      ("fp8_patched_deferred", {"fp8_gemm": False}), ("fp8_real", {"fp8_gemm": True})):
            rep, why = H.patch(self.model, **kw)
            if rep is not None and v != "fp8_patched" and not (H.summary(rep) or {}).get(
                    "fp8_gemm_linears" if v == "fp8_real" else "biases_deferred"):
                rep, why = H.patch(self.model, capabilities=cap, **kw)  # the validated set may not hold this device
            if rep is None:
                raise RuntimeError(why)
            self.block_case(v, blk, rep)
        qwen_absorb.unpatch(self.model)

    # ------------------------------------------------------------------ ops
    def n_sets(self, op: str) -> int:
        shape = self.a.op_shape
        full = op_bytes(op, shape)["full_tensors"]
        return max(self.a.op_sets, math.ceil(3 * self.l2 / (full * math.prod(shape) * 2)) if self.l2 else 0)

    def time_op(self, op: str, sets: list[tuple]) -> float:
        fn = H.op_call(op)
        run = lambda: [fn(*s) for s in sets]  # noqa: E731
        ms = (H.time_graph(run, reps=self.a.op_reps)[0] if self.cuda
              else H.time_calls(run, self.dev, 1, self.a.op_reps)["median_ms"])
        return ms * 1e3 / len(sets)

    def copy_rate(self, when: str) -> None:
        R = self.R
        if not self.cuda:
            R.put("copy_rate_tb_s", None, f"{H.NEEDS_CUDA} (device-to-device copy)")
            return
        R.d["copy_rate_runs_tb_s"].append({"when": when, "tb_s": round(H.copy_rate_tb_s(), 4)})
        best = max(x["tb_s"] for x in R.d["copy_rate_runs_tb_s"])
        R.put("copy_rate_tb_s", best)
        for op, o in R.d["ops"].items():
            R.put(f"copy_rate_pct.{op}", round(100 * o["tb_s"] / best, 2))
            for name, v in o.get("variants", {}).items():
                R.d["copy_rate_pct_variants"][name][op] = round(100 * v["tb_s"] / best, 2)

    def ops(self, name: str | None = None, defines: dict[str, Any] | None = None) -> None:
        """The default build (``name`` None) or a build variant under ``defines``."""
        from qwen_absorb.ops import _runtime  # noqa: PLC0415

        R, shape = self.R, tuple(self.a.op_shape)
        if name is None:
            self.ref_out: dict[str, tuple] = {}
        else:
            R.d["ln_variants"][name] = defines
            R.d["copy_rate_pct_variants"][name] = dict.fromkeys(OPS)
            R.d["variant_bit_identical"][name] = dict.fromkeys(OPS)
        _runtime.set_defines(defines)
        try:
            for op in OPS:
                sets = H.op_sets(shape, self.n_sets(op), self.dev, self.a.seed + 7)
                info, us = op_bytes(op, shape), self.time_op(op, sets)
                tbs = info["bytes"] / (us * 1e-6) / 1e12
                out = H.op_call(op)(*sets[0])
                out = tuple(t.clone() for t in (out if isinstance(out, tuple) else (out,)))
                rate = R.get("copy_rate_tb_s")
                pct = round(100 * tbs / rate, 2) if rate else None
                if name is None:
                    self.ref_out[op] = out
                    R.d["ops"][op] = {"shape": list(shape), **info, "sets": len(sets), "us": us, "tb_s": round(tbs, 4),
                                      "kernel_reasons": op_reasons(op, sets[0]), "variants": {}}
                    R.put(f"copy_rate_pct.{op}", pct, None if rate else "no copy rate (needs CUDA)")
                else:
                    ref = getattr(self, "ref_out", {}).get(op)
                    same = None if ref is None else all(torch.equal(x, y) for x, y in zip(out, ref))
                    R.d["copy_rate_pct_variants"][name][op] = pct
                    R.d["variant_bit_identical"][name][op] = same
                    if op in R.d["ops"]:
                        R.d["ops"][op]["variants"][name] = {"us": us, "tb_s": round(tbs, 4),
                                                            "bit_identical_to_default": same}
                H.log(f"  [{name or 'default'}] {op:38s} {list(shape)}: {us:9.1f} us, {tbs:6.3f} TB/s")
                del sets
                self.write()
        finally:
            _runtime.set_defines(None)

    def compile_numbers(self) -> None:
        R, path = self.R, self.a.compile_json
        keys = ("compile_1024_ms.compiled", "compile_1024_ms.patched_compiled", "compile_1024_speedup")
        if path is None:
            for k in keys:
                R.skip(k, "measured by speed.py (bf16_compile_ms); pass its speed_h200.json (--compile-json)")
            return
        src = json.loads(Path(path).read_text())
        cfg = src.get("config") or {}
        comp, pc = src.get("bf16_compile_ms"), src.get("bf16_patched_compile_ms")
        R.put("compile_1024_ms.compiled", comp, f"null in {path}")
        R.put("compile_1024_ms.patched_compiled", pc, f"null in {path}")
        R.put("compile_1024_speedup", H.ratio(comp, pc), "a compile_1024_ms value is missing")
        R.put("compile_1024_source", {
            "path": str(path), "gpu": src.get("gpu"), "date": src.get("date"), "num_layers": cfg.get("num_layers"),
            "resolution": cfg.get("resolution"), "geometry_ok": not src.get("tiny") and cfg.get("num_layers") == 60
            and cfg.get("resolution") == 1024 and bool(src.get("gpu")),
            "note": "bf16_compile_ms = unpatched + compile_repeated_blocks(); bf16_patched_compile_ms = patch + "
                    "compile_repeated_blocks(); median wall ms of one 1024^2 call"})

    def run(self) -> int:
        a, s, R = self.a, self.steps, self.R
        self.write()
        H.log(f"fusion_bench: sections {','.join(a.sections)} on {self.dev}, writing {R.json}")
        s("compile_numbers", self.compile_numbers)
        if self.wants_block() and s("block_setup", self.block_setup):
            if "block" in a.sections:
                s("block", self.block, [(R, f"{g}.{v}") for g in ("block_gpu_ms", "block_wall_ms") for v in BF16[:2]])
                if a.in_model_layers:
                    s("block_in_model", self.in_model, [(R, "block_in_model.gpu_ms.patched")])
            if "ops" in a.sections and a.ops_before_compile:
                self.ops_steps()
            if "block" in a.sections:
                s("block_compiled", lambda: self.compiled("compiled", None), [(R, "block_gpu_ms.compiled")])
                s("block_patched_compiled", lambda: self.compiled("patched_compiled", {}),
                  [(R, "block_gpu_ms.patched_compiled")])
            if "fp8" in a.sections:
                s("fp8_block", self.fp8, [(R, f"block_gpu_ms.{v}") for v in FP8])
        if "ops" in a.sections and not (a.ops_before_compile and self.wants_block()):
            self.ops_steps()
        for g in ("block_gpu_ms", "block_wall_ms", "kernels_per_block"):
            for v in BF16 + FP8:
                R.skip(f"{g}.{v}", "not measured (section not selected, or its step failed: see errors)")
        self.model = None
        self.write()
        H.log(f"wrote {R.json} and {R.md.name}")
        return 1 if s.failed else 0

    def wants_block(self) -> bool:
        return bool({"block", "fp8"} & set(self.a.sections))

    def ops_steps(self) -> None:
        s, R = self.steps, self.R
        s("ops_copy_rate_before", lambda: self.copy_rate("before the ops"))
        s("ops_default_build", self.ops, [(R, f"copy_rate_pct.{op}") for op in OPS])
        for name, defines in self.a.ln_variants:
            s(f"ops_variant_{name}", lambda n=name, d=defines: self.ops(n, d))
        s("ops_copy_rate_after", lambda: self.copy_rate("after the ops"))


def markdown(d: dict[str, Any]) -> str:
    cfg = d.get("config") or {}
    tok = cfg.get("block_input_tokens") or {}
    lines = H.md_head("One transformer block: eager / patched / torch.compile, bf16 and FP8; fused ops vs copy", d,
                      f"transformer_blocks[0] of a {cfg.get('num_layers')}-layer model, hidden {cfg.get('hidden')}, "
                      f"{tok.get('image')} image + {tok.get('text')} text tokens, B = 1, bf16; median of "
                      f"{cfg.get('block_iters')} calls after warm-up; GPU busy = sum of kernel durations of one call")
    rows = [[v, d["block_wall_ms"].get(v), d["block_gpu_ms"].get(v), d["kernels_per_block"].get(v),
             d["block_first_call_s"].get(v), (lambda o: "-" if not o else "identical" if o["identical"]
                                              else f"max abs {o['max_abs']:.3g}")(d["block_output_vs_eager"].get(v))]
            for v in BF16 + FP8 if d["block_wall_ms"].get(v) is not None]
    lines += ["", *H.md_table(["variant", "wall ms", "GPU busy ms", "kernels", "first call s", "output vs eager"],
                              rows)]
    im = d.get("block_in_model") or {}
    if im.get("layers"):
        lines += ["", f"Per block inside the transformer loop (calls with {im['layers']} layers, difference / "
                      f"{im['layers'][1] - im['layers'][0]}):", "",
                  *H.md_table(["variant", "wall ms", "GPU busy ms", "kernels"],
                              [[v, (im.get("wall_ms") or {}).get(v), (im.get("gpu_ms") or {}).get(v),
                                (im.get("kernels") or {}).get(v)] for v in ("eager", "patched")])]
    top = d.get("patched_kernels_top") or []
    if top:
        lines += ["", "Kernels of one patched block call, by time:", "",
                  *H.md_table(["ms", "count", "kernel"], [[k["ms"], k["count"], f"`{k['name'][:110]}`"] for k in top])]
    rate = d.get("copy_rate_tb_s")
    lines += ["", f"Fused ops at {cfg.get('op_shape')} bf16, copy rate {H.fmt(rate, 2)} TB/s:", "",
              *H.md_table(["op", "us", "MB moved", "TB/s", "% of copy", "kernel ran"],
                          [[op, o.get("us"), o["bytes"] / 1e6, o.get("tb_s"), d["copy_rate_pct"].get(op),
                            "yes" if not o.get("kernel_reasons") else "no: " + "; ".join(o["kernel_reasons"])]
                           for op, o in (d.get("ops") or {}).items()], 1)]
    for name, per in (d.get("copy_rate_pct_variants") or {}).items():
        same = d["variant_bit_identical"].get(name) or {}
        lines.append(f"- variant {name} `{json.dumps(d['ln_variants'].get(name))}`: "
                     + ", ".join(f"{op} {H.fmt(p, 1)}% (bit-identical: {same.get(op)})" for op, p in per.items()))
    c = d.get("compile_1024_ms") or {}
    lines += ["", f"60 layers at 1024^2, compile_repeated_blocks(): compiled {H.fmt(c.get('compiled'))} ms, patched + "
                  f"compiled {H.fmt(c.get('patched_compiled'))} ms, speed-up {H.fmt(d.get('compile_1024_speedup'))}x",
              "", *H.md_table(["target", "measured", "met"],
                              [[k, t["measured"], str(t["met"])] for k, t in (d.get("targets") or {}).items()])]
    return H.md_document(lines, d)


MODEL = {"layers": (2, 1), "side": (64, 8)}  # the model built (default, --tiny)


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, SECTIONS, budget_s=240.0)
    H.add_model_args(ap, **MODEL)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--block-iters", type=int, default=20, help="timed calls of the block (>= 5)")
    ap.add_argument("--calib", type=int, default=2, help="FP8 calibration forwards (1-2)")
    ap.add_argument("--in-model-layers", default=None, help="L1,L2 (default NUM_LAYERS,NUM_LAYERS+2; 'none': skip)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; --tiny: eager)")
    ap.add_argument("--ops-before-compile", action="store_true", help="time the ops before compiling the block")
    ap.add_argument("--op-shape", default=None, help="B,L,D of the ops (default 1,16384,3072; --tiny: 1,256,3072)")
    ap.add_argument("--op-sets", type=int, default=4, help="distinct input sets per graph replay (at least)")
    ap.add_argument("--op-reps", type=int, default=None, help="timed graph replays per op (default 30; --tiny: 3)")
    ap.add_argument("--ln-variants", nargs="*", default=[], type=parse_variant, metavar="NAME=DEFINE:VALUE",
                    help="kernel build variants to re-time, e.g. packed=QA_LN_PACKED:1")
    ap.add_argument("--compile-json", type=Path, default=None, help="cuda_graph.json of cuda_graph_bench --sections "
                                                                    "compile from the same device run")
    a = ap.parse_args(argv)
    if a.block_iters < 5 or a.warmup < 1:
        ap.error("method: --block-iters >= 5 and --warmup >= 1")
    a = H.finish_args(ap, a, SECTIONS, "fusion_bench")
    t = a.tiny
    H.resolve_model_args(a, **MODEL)
    a.op_reps = a.op_reps or (3 if t else 30)
    a.block_iters = 5 if t else a.block_iters
    if a.compile_backend is None and a.device.type == "cpu":
        a.compile_backend = "eager"
    try:
        a.op_shape = tuple(int(x) for x in (a.op_shape or ("1,256,3072" if t else "1,16384,3072")).split(","))
        lm = None if (a.in_model_layers or "").lower() == "none" else tuple(
            int(x) for x in (a.in_model_layers or f"{a.num_layers},{a.num_layers + 2}").split(","))
        if len(a.op_shape) != 3 or (lm is not None and (len(lm) != 2 or not 1 <= lm[0] < lm[1])):
            raise ValueError
    except ValueError:
        ap.error("--op-shape: B,L,D; --in-model-layers: L1,L2 with 1 <= L1 < L2")
    a.in_model_layers = lm
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
