#!/usr/bin/env python
"""Issue 11 in one run: one patched block vs eager vs torch.compile, and the fused ops vs the copy rate.

Writes ``<out>/fusion.json`` + ``fusion.md`` (default ``benchmarks/results``), re-written after every
measurement so a killed run keeps what was done; every value not measured stays ``null`` with a reason
under ``skipped`` (dotted key -> reason).

section ``block``  A ``--num-layers`` (default 2) transformer at full width (24 heads x 128 = 3072 hidden,
    random weights, ``qwen_absorb.testing.full_size_transformer``), bf16 on CUDA. One transformer call at
    1024^2 (64 x 64 = 4096 image tokens + 128 text tokens, B = 1, no text mask) captures the inputs of
    ``transformer_blocks[0]`` with a forward pre-hook; that block alone is then timed on those inputs:
      eager     unpatched;
      patched   after ``qwen_absorb.patch(model)`` (default arguments);
      compiled  unpatched, ``torch.compile(block)`` (default mode and backend, ``torch._dynamo.config``
                defaults); its first call (compile) is timed apart.
    Per variant (``benchmarks/transformer_suite.py``'s ``measure``): a first call, warm-up calls, then
    ``--block-iters`` (>= 5) calls each between CUDA events and synchronized after it (median: the wall
    time of one call, host work included) -> ``block_wall_ms``; one more call under torch.profiler (CUDA
    activity): the sum of its kernels' device durations -> ``block_gpu_ms`` (GPU busy), their number ->
    ``kernels_per_block`` (memcpy/memset not counted). ``patched_kernels_top``: every kernel of one
    patched call (name, count, us), by time. Also the patch report's summary and per-block
    ``qk_norm_rope_fused``, and each variant's output against eager.
    A block called alone never takes part in a cross-block hand-off (``qwen_absorb.handoff``: inside the
    transformer loop block i's FFN residual op also computes block i+1's norm1); ``block_in_model`` measures
    that case: whole eager / patched transformer calls with L1 and L2 layers (``--in-model-layers``, default
    NUM_LAYERS,NUM_LAYERS+2), per block = difference / (L2 - L1) (the work outside the blocks cancels).
    Order: eager, patched, in-model, compiled (the slow step; ``--ops-before-compile`` moves the ops first).

section ``ops``  ``layer_norm_scale_shift``, ``bias_residual_layer_norm_scale_shift``, ``bias_gate_residual``
    at ``--op-shape`` (default [1,16384,3072]) bf16, called as ``benchmarks/bench_ops.py`` calls them: the
    time of one call = a CUDA-graph replay of K calls over K distinct input sets (K >= ``--op-sets`` and
    large enough that one replay touches >= 3x the L2, so inputs come from HBM) / K, median of
    ``--op-reps`` replays. Bytes moved per call, from the op's signature: every tensor it reads
    (activations and the [B, D] / [D] parameters) and every tensor it writes. Achieved TB/s and
    ``copy_rate_pct`` = achieved / device-to-device copy rate (``bench_ops.copy_rate``, best of a run before
    and after the ops) * 100. ``--ln-variants name=DEFINE:VALUE[,DEFINE:VALUE]`` re-times the ops with the
    kernels rebuilt under those defines (``qwen_absorb.ops._runtime.set_defines``) ->
    ``copy_rate_pct_variants[name][op]``, and checks each op's outputs are bit-identical (torch.equal) to
    the default build's on the same inputs -> ``variant_bit_identical[name][op]``; the defaults are
    restored afterwards (``set_defines(None)``).

compile (not measured here)  The 60-layer 1024^2 ``compile_repeated_blocks()`` numbers come from
    ``benchmarks/cuda_graph_bench.py --sections compile`` of the same device run: ``--compile-json PATH``
    copies its ``bf16_compile_ms`` -> ``compile_1024_ms.compiled`` and ``bf16_patched_compile_ms`` ->
    ``compile_1024_ms.patched_compiled`` (``compile_1024_speedup`` = compiled / patched_compiled,
    ``compile_1024_source`` says where they came from).

Targets (issue 11; judged only on CUDA at the full-size geometry, never on a --tiny run):
    block_gpu_ms.patched <= block_gpu_ms.compiled; kernels_per_block.patched <= 40;
    copy_rate_pct of layer_norm_scale_shift and bias_residual_layer_norm_scale_shift >= 80 at [1,16384,3072];
    compile_1024_speedup >= 1.05.

Keys of fusion.json: block_gpu_ms {eager, patched, compiled}, block_wall_ms {...}, kernels_per_block {...},
block_first_call_s {...}, block_in_model {layers, gpu_ms, wall_ms, kernels: {eager, patched}, calls},
compiled_dynamo, block_details, patched_kernels_top, patch_report {summary, qk_norm_rope_fused, ...},
block_output_vs_eager {...}, copy_rate_tb_s, copy_rate_pct {op}, ops {op: details}, copy_rate_pct_variants,
variant_bit_identical, compile_1024_ms {compiled, patched_compiled}, compile_1024_speedup,
compile_1024_source, targets, gpu, date, versions, environment, config, method, skipped, errors, timings_s.

    python benchmarks/fusion_bench.py                                      # H200: ~1.5-2 min
    python benchmarks/fusion_bench.py --ln-variants packed=QA_LN_PACKED:1 --compile-json OUT/cuda_graph.json
    python benchmarks/fusion_bench.py --tiny --out /tmp/fb                 # CPU smoke run (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks", ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402

import _common as C  # noqa: E402  (examples/_common.py: environment, json_safe, runtime_fallbacks)
import bench_ops as BO  # noqa: E402  (make_sets, time_graph, copy_rate, fused_* call wrappers)
import kernel_events  # noqa: E402
import qwen_absorb  # noqa: E402
from qwen_absorb import testing as T  # noqa: E402
from qwen_absorb.ops import _runtime  # noqa: E402
from transformer_suite import (  # noqa: E402
    _atomic_write, _dumps, capture_block_inputs, log, md_footer, measure, profile_fn, sync,
)

SECTIONS = ("block", "ops")
VARIANTS = ("eager", "patched", "compiled")
OPS = ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift", "bias_gate_residual")
TARGET_OPS = ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift")
FULL_SHAPE = (1, 16384, 3072)
MAX_KERNELS_PER_BLOCK = 40
COPY_PCT_TARGET = 80.0
COMPILE_SPEEDUP_TARGET = 1.05
NEEDS_CUDA = "needs CUDA"


# ------------------------------------------------------------------------------------------- op bytes


def op_bytes(op: str, shape: tuple[int, int, int], esize: int) -> dict[str, Any]:
    """Bytes one call must move, read off the op's signature (every operand read once, every output written
    once): activations [B, L, D], modulation rows [B, D] (shift / scale / gate), bias [D]."""
    B, L, D = shape
    act, row, vec = B * L * D, B * D, D
    if op == "layer_norm_scale_shift":  # reads x, shift, scale; writes out
        reads, writes = {"x": act, "shift": row, "scale": row}, {"out": act}
    elif op == "bias_residual_layer_norm_scale_shift":  # reads residual, x, bias, gate, shift, scale
        reads = {"residual": act, "x": act, "bias": vec, "gate": row, "shift": row, "scale": row}
        writes = {"new_residual": act, "modulated": act}
    elif op == "bias_gate_residual":  # reads residual, x, bias, gate; writes out
        reads, writes = {"residual": act, "x": act, "bias": vec, "gate": row}, {"out": act}
    else:
        raise ValueError(op)
    r, w = sum(reads.values()) * esize, sum(writes.values()) * esize
    return {"bytes": r + w, "read_bytes": r, "write_bytes": w,
            "full_tensors": sum(v == act for v in reads.values()) + len(writes),
            "elements_read": reads, "elements_written": writes}


def op_fn(op: str) -> Callable[..., Any]:
    """bench_ops' wrapper: ``fn(x, r, shift, scale, gate, bias)`` calls the public op as the block does."""
    return getattr(BO, f"fused_{op}")


def op_reasons(op: str, s: tuple) -> list[str]:
    """Why the op's CUDA kernel would not run on this input set (empty: it runs)."""
    x, r, shift, scale, gate, bias = s
    o = qwen_absorb.ops
    if op == "layer_norm_scale_shift":
        return o.layer_norm_scale_shift_not_supported_reasons(x, shift=shift, scale=scale, eps=BO.EPS)
    if op == "bias_residual_layer_norm_scale_shift":
        return o.bias_residual_layer_norm_scale_shift_not_supported_reasons(
            r, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=BO.EPS)
    return o.bias_gate_residual_not_supported_reasons(r, x, bias=bias, gate=gate)


def make_sets(shape: tuple[int, int, int], k: int, device: torch.device, seed: int) -> list[tuple]:
    """``bench_ops.make_sets`` on CUDA (its generator is a CUDA one); the same construction on the CPU."""
    if device.type == "cuda":
        return BO.make_sets(shape, k, torch.Generator(device="cuda").manual_seed(seed))
    gen = torch.Generator().manual_seed(seed)
    B, L, D = shape
    sets = []
    for _ in range(k):
        mod = torch.randn(B, 3 * D, generator=gen).bfloat16()
        shift, scale, gate = (t.unsqueeze(1) for t in mod.chunk(3, dim=-1))
        sets.append((torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16(),
                     shift, scale, gate, torch.randn(D, generator=gen).bfloat16()))
    return sets


def outputs(op: str, s: tuple) -> tuple[torch.Tensor, ...]:
    out = op_fn(op)(*s)
    return tuple(t.clone() for t in (out if isinstance(out, tuple) else (out,)))


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, eq, rest = text.partition("=")
    if not eq or not name.strip() or not rest.strip():
        raise argparse.ArgumentTypeError(f"--ln-variants: expected name=DEFINE:VALUE[,DEFINE:VALUE], got {text!r}")
    defines: dict[str, Any] = {}
    for part in rest.split(","):
        k, colon, v = part.partition(":")
        if not colon or not k.strip() or not v.strip():
            raise argparse.ArgumentTypeError(f"--ln-variants: expected DEFINE:VALUE, got {part!r} in {text!r}")
        v = v.strip()
        try:
            defines[k.strip()] = int(v)
        except ValueError:
            defines[k.strip()] = v
    return name.strip(), defines


# ------------------------------------------------------------------------------------------- results


def _get(d: Any, path: str) -> Any:
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


class Results:
    """fusion.json as a dict; ``put(dotted, value, reason)``; a None value with a reason goes to ``skipped``."""

    def __init__(self, out_dir: Path, head: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.d: dict[str, Any] = {
            **head,
            "block_gpu_ms": {v: None for v in VARIANTS},
            "block_wall_ms": {v: None for v in VARIANTS},
            "kernels_per_block": {v: None for v in VARIANTS},
            "block_first_call_s": {v: None for v in VARIANTS},
            "block_output_vs_eager": {"patched": None, "compiled": None},
            "patched_kernels_top": None,
            "block_in_model": {"layers": None, "gpu_ms": {"eager": None, "patched": None},
                               "wall_ms": {"eager": None, "patched": None},
                               "kernels": {"eager": None, "patched": None}, "calls": None},
            "patch_report": {"summary": None, "qk_norm_rope_fused": None, "qk_norm_rope_reasons": None,
                             "kernels_available": None, "kernel_unavailable_reasons": None,
                             "runtime_fallbacks": None},
            "compiled_dynamo": None,
            "copy_rate_tb_s": None,
            "copy_rate_runs_tb_s": [],
            "copy_rate_pct": {op: None for op in OPS},
            "ops": {},
            "ln_variants": {},
            "copy_rate_pct_variants": {},
            "variant_bit_identical": {},
            "compile_1024_ms": {"compiled": None, "patched_compiled": None},
            "compile_1024_speedup": None,
            "compile_1024_source": None,
            "targets": {},
            "block_details": {},
            "skipped": {},
            "errors": [],
            "timings_s": {},
            "elapsed_s": None,
            "time_budget_reached": None,
        }

    def get(self, path: str) -> Any:
        return _get(self.d, path)

    def put(self, path: str, value: Any, reason: str | None = None) -> None:
        keys = path.split(".")
        d = self.d
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
        if value is None and reason:
            self.d["skipped"][path] = reason
        elif value is not None:
            self.d["skipped"].pop(path, None)

    def skip(self, path: str, reason: str) -> None:
        if self.get(path) is None:
            self.d["skipped"].setdefault(path, reason)

    def write(self) -> None:
        derive_targets(self.d)
        _atomic_write(self.out_dir / "fusion.json", _dumps(self.d))
        _atomic_write(self.out_dir / "fusion.md", markdown(self.d))


def derive_targets(d: dict[str, Any]) -> None:
    cfg = d.get("config") or {}
    on_cuda = str(cfg.get("device", "")).startswith("cuda")
    full_block = bool(cfg.get("full_size_block"))
    full_ops = list(cfg.get("op_shape") or []) == list(FULL_SHAPE)
    src = d.get("compile_1024_source")
    compile_ok = isinstance(src, dict) and bool(src.get("geometry_ok"))

    def verdict(measured: Any, ok: Callable[[Any], bool], judged: bool, why: str) -> dict[str, Any]:
        out: dict[str, Any] = {"measured": measured}
        if cfg.get("tiny"):
            out["met"], out["why_not_judged"] = None, "--tiny smoke run"
        elif measured is None:
            out["met"], out["why_not_judged"] = None, "not measured"
        elif not judged:
            out["met"], out["why_not_judged"] = None, why
        else:
            out["met"] = bool(ok(measured))
        return out

    g = d.get("block_gpu_ms") or {}
    rel = (g["patched"] / g["compiled"]) if g.get("patched") is not None and g.get("compiled") else None
    block_why = "not on CUDA at the full-size geometry (3072 hidden, 4096 + 128 tokens)"
    t = {
        "block_patched_gpu_vs_compiled": {
            "target": "block_gpu_ms.patched / block_gpu_ms.compiled <= 1.0",
            **verdict(None if rel is None else round(rel, 4), lambda m: m <= 1.0, on_cuda and full_block, block_why)},
        "block_patched_kernels": {
            "target": f"kernels_per_block.patched <= {MAX_KERNELS_PER_BLOCK}",
            **verdict((d.get("kernels_per_block") or {}).get("patched"), lambda m: m <= MAX_KERNELS_PER_BLOCK,
                      on_cuda and full_block, block_why)},
    }
    for op in TARGET_OPS:
        t[f"copy_rate_pct.{op}"] = {
            "target": f"copy_rate_pct.{op} >= {COPY_PCT_TARGET:.0f} at {list(FULL_SHAPE)} bf16",
            **verdict((d.get("copy_rate_pct") or {}).get(op), lambda m: m >= COPY_PCT_TARGET, on_cuda and full_ops,
                      f"op shape {cfg.get('op_shape')} is not {list(FULL_SHAPE)} or not on CUDA")}
        kr = ((d.get("ops") or {}).get(op) or {}).get("kernel_reasons")
        if kr and t[f"copy_rate_pct.{op}"].get("met") is not None:
            t[f"copy_rate_pct.{op}"].update(met=None, why_not_judged="the CUDA kernel did not run: " + "; ".join(kr))
    t["compile_1024_speedup"] = {
        "target": f"compile_1024_ms.compiled / compile_1024_ms.patched_compiled >= {COMPILE_SPEEDUP_TARGET}",
        **verdict(d.get("compile_1024_speedup"), lambda m: m >= COMPILE_SPEEDUP_TARGET, compile_ok,
                  "the --compile-json run is not 60 layers at 1024^2 on CUDA (see compile_1024_source)")}
    d["targets"] = t


# ------------------------------------------------------------------------------------------- markdown


def _f(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown(d: dict[str, Any]) -> str:
    env, cfg = d.get("environment") or {}, d.get("config") or {}
    tok = cfg.get("block_input_tokens") or {}
    on_cuda = str(cfg.get("device", "")).startswith("cuda")
    lines = [
        "# Issue 11: fused block vs eager vs torch.compile, fused ops vs the copy rate"
        + (" (--tiny smoke run, not a benchmark)" if cfg.get("tiny") else ""),
        "",
        f"- GPU: {d.get('gpu') or 'none (CPU)'}" + (f" ({env.get('gpu_capability')}, {env.get('sms')} SMs, "
                                                    f"L2 {env.get('l2_mb')} MiB), driver {env.get('driver')}"
                                                    if d.get("gpu") else ""),
        f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), diffusers {env.get('diffusers')}, "
        f"cupy {env.get('cupy')}, qwen_absorb {env.get('qwen_absorb_commit')}",
        f"- date: {d.get('date')}; run time {_f(d.get('elapsed_s'), 1)} s",
        "",
        "## One transformer block",
        "",
        f"`transformer_blocks[0]` of a {cfg.get('num_layers')}-layer transformer, hidden {cfg.get('hidden')} "
        f"({cfg.get('heads')} heads x {cfg.get('head_dim')}), {tok.get('image')} image + {tok.get('text')} text "
        f"tokens, B = 1, bf16, inputs captured from one {16 * (cfg.get('side') or 0)}^2 transformer call. Wall = "
        f"median of {cfg.get('block_iters')} calls ({'CUDA events' if on_cuda else 'perf_counter'}) after warm-up; "
        "GPU busy = sum of the kernel durations of one call (torch.profiler); kernels = their count "
        "(memcpy/memset excluded).",
        "",
        "| variant | wall ms | GPU busy ms | kernels | first call s | output vs eager |",
        "|---|---|---|---|---|---|",
    ]
    names = {"eager": "eager (unpatched)", "patched": "qwen_absorb.patch", "compiled": "torch.compile(block)"}
    for v in VARIANTS:
        ov = (d.get("block_output_vs_eager") or {}).get(v)
        ovs = "" if v == "eager" else ("-" if not ov else
                                       ("identical" if ov.get("identical") else f"max abs {ov.get('max_abs'):.3g}"))
        lines.append(f"| {names[v]} | {_f(d['block_wall_ms'].get(v))} | {_f(d['block_gpu_ms'].get(v))} | "
                     f"{_f(d['kernels_per_block'].get(v))} | {_f(d['block_first_call_s'].get(v), 2)} | {ovs} |")
    pr = d.get("patch_report") or {}
    if pr.get("summary"):
        lines += ["", f"Patch report summary: `{json.dumps(pr['summary'])}`",
                  f"qk_norm_rope_fused per block: `{json.dumps(pr.get('qk_norm_rope_fused'))}`"
                  + (f"; reasons: `{json.dumps(pr.get('qk_norm_rope_reasons'))}`"
                     if any(pr.get("qk_norm_rope_reasons") or []) else "")]
        if pr.get("runtime_fallbacks"):
            lines.append(f"Runtime fallbacks: `{json.dumps(pr['runtime_fallbacks'])}`")
    dyn = d.get("compiled_dynamo")
    if dyn:
        lines.append(f"torch.compile(block): `{json.dumps(dyn)}`")
    im = d.get("block_in_model") or {}
    if im.get("layers"):
        l1, l2 = im["layers"]
        lines += ["", f"Per block inside the transformer loop (whole calls with {l2} and {l1} layers, difference / "
                      f"{l2 - l1}; there a patched block may take its norm1 from the previous block's residual op):",
                  "", "| variant | wall ms / block | GPU busy ms / block | kernels / block |", "|---|---|---|---|"]
        for v in ("eager", "patched"):
            lines.append(f"| {names[v]} | {_f((im.get('wall_ms') or {}).get(v))} | "
                         f"{_f((im.get('gpu_ms') or {}).get(v))} | {_f((im.get('kernels') or {}).get(v), 1)} |")
        hand = ((im.get("calls") or {}).get(str(l2)) or {}).get("patched", {}).get("handoff")
        if hand:
            lines.append(f"\n{l2}-layer patched call, cross-block hand-off: `{json.dumps(hand)}`")
    top = d.get("patched_kernels_top")
    if top:
        lines += ["", "Kernels of one patched block call, by time:", "", "| us | count | kernel |", "|---|---|---|"]
        lines += [f"| {k['us']:.1f} | {k['count']} | `{k['name'][:110]}` |" for k in top]
    lines += ["", "## Fused ops", ""]
    ops = d.get("ops") or {}
    if ops:
        lines += [
            f"Shape {cfg.get('op_shape')} bf16; time of one call = "
            f"{'CUDA-graph replay' if on_cuda else 'CPU wall time (torch reference)'} of K calls over K input sets / "
            f"K, median of {cfg.get('op_reps')} replays; copy rate {_f(d.get('copy_rate_tb_s'), 2)} TB/s (read + "
            "write, best of the runs before and after the ops). Bytes: every operand read and output written once.",
            "",
            "| op | us | MB moved | TB/s | % of copy | K sets | kernel ran |",
            "|---|---|---|---|---|---|---|",
        ]
        for op in OPS:
            o = ops.get(op)
            if not o:
                continue
            lines.append(f"| {op} | {_f(o.get('us'), 1)} | {o['bytes'] / 1e6:.1f} | {_f(o.get('tb_s'), 2)} | "
                         f"{_f(d['copy_rate_pct'].get(op), 1)} | {o.get('sets')} | "
                         f"{'yes' if not o.get('kernel_reasons') else 'no: ' + '; '.join(o['kernel_reasons'])} |")
    vs = d.get("copy_rate_pct_variants") or {}
    if vs:
        lines += ["", "| build variant (defines) | " + " | ".join(OPS) + " |", "|---|" + "---|" * len(OPS)]
        for name, per in vs.items():
            bi = (d.get("variant_bit_identical") or {}).get(name) or {}
            same = {True: "bit-identical", False: "DIFFERS", None: "-"}
            cells = [f"{_f(per.get(op), 1)}% ({same[bi.get(op)]})" for op in OPS]
            defs = json.dumps((d.get("ln_variants") or {}).get(name))
            lines.append(f"| {name} `{defs}` | " + " | ".join(cells) + " |")
    c = d.get("compile_1024_ms") or {}
    src = d.get("compile_1024_source")
    lines += ["", "## 60 layers at 1024^2 with compile_repeated_blocks()", "",
              f"compiled {_f(c.get('compiled'))} ms, patched + compiled {_f(c.get('patched_compiled'))} ms, "
              f"speed-up {_f(d.get('compile_1024_speedup'))}x"
              + (f" (from `{src.get('path')}`: {src.get('note')})" if isinstance(src, dict) else "")]
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for k, t in (d.get("targets") or {}).items():
        met = t.get("met")
        verdict = "PASS" if met else "FAIL" if met is False else f"not judged: {t.get('why_not_judged')}"
        lines.append(f"| {t['target']} | {_f(t.get('measured'))} | {verdict} |")
    return "\n".join(lines + md_footer(d)) + "\n"


# ------------------------------------------------------------------------------------------- measuring


def kernel_table(fn: Callable[[], Any], device: torch.device) -> list[dict[str, Any]] | None:
    """Every kernel of one call of ``fn`` under torch.profiler (CUDA activity): name, count, us; by time."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    rows: dict[str, list[float]] = {}
    for name, us in kernel_events.kernels(prof):
        r = rows.setdefault(name, [0, 0.0])
        r[0] += 1
        r[1] += us
    return [{"name": n[:200], "count": int(c), "us": round(us, 2)}
            for n, (c, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])]


def compare(a: Any, b: Any) -> dict[str, Any]:
    """Block outputs (tuples of tensors) against the eager ones."""
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    same = all(torch.equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    mx = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
    return {"identical": bool(same), "max_abs": mx}


def dynamo_counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {k: dict(counters[k]) for k in ("stats", "frames") if k in counters}
    gb = counters.get("graph_break") or {}
    out["graph_breaks"] = int(sum(gb.values()))
    if gb:
        out["graph_break_reasons"] = {str(k)[:200]: int(v) for k, v in list(gb.items())[:5]}
    for k in counters:
        if "recompil" in k:
            out[k] = dict(counters[k])
    return out


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.dev = torch.device(args.device)
        self.cuda = self.dev.type == "cuda"
        self.t0 = time.perf_counter()
        self.budget_hit: list[str] = []
        env = C.environment(self.dev)
        if self.cuda:
            p = torch.cuda.get_device_properties(self.dev)
            env["sms"], env["l2_mb"] = p.multi_processor_count, round(p.L2_cache_size / 2**20, 1)
            env["kernel_unavailable_reasons"] = qwen_absorb.ops.kernel_runtime_reasons(self.dev)
        self.l2 = int(env.get("l2_mb", 0) * 2**20)
        cfg = dict(vars(args))
        cfg["out"] = str(args.out)
        cfg["op_shape"] = list(args.op_shape)
        cfg["ln_variants"] = [f"{n}={d}" for n, d in args.ln_variants]
        cfg["compile_json"] = str(args.compile_json) if args.compile_json else None
        head = {
            "benchmark": "benchmarks/fusion_bench.py (issue 11: one patched block vs eager vs torch.compile; fused "
                         "ops vs the copy rate; 60-layer compile numbers copied from cuda_graph_bench)",
            "gpu": env.get("gpu"), "date": env.get("date"),
            "versions": {k: env.get(k) for k in ("torch", "torch_cuda", "diffusers", "transformers", "cupy",
                                                 "python", "qwen_absorb_commit", "driver", "gpu_capability")},
            "environment": env,
            "config": cfg,
            "method": {
                "block": "transformer_suite.measure: first call (timed apart; compiled: includes the compile), "
                         f"{args.warmup} warm-up calls, {args.block_iters} timed calls each between CUDA events and "
                         "synchronized after it (median = block_wall_ms); one more call under torch.profiler: "
                         "sum of kernel device durations (block_gpu_ms), their count (kernels_per_block), "
                         "memcpy/memset excluded. Inputs of transformer_blocks[0] captured by a forward pre-hook "
                         "in one unpatched transformer call; torch.inference_mode(). block_in_model: the same "
                         "measurement of whole transformer calls with L1 and L2 layers, (L2 - L1)-block difference "
                         "per block (inside the transformer loop, where cross-block hand-offs can happen).",
                "ops": "bench_ops.time_graph: a CUDA graph of K calls over K distinct input sets (K >= "
                       f"{args.op_sets}, one replay touches >= 3x L2), median of {args.op_reps} replays / K; "
                       "bytes = every operand read + every output written once (op_bytes); copy rate: "
                       "bench_ops.copy_rate (1 GiB device copy, read + write), best of the runs before and after.",
                "compile": "copied from cuda_graph_bench.py's cuda_graph.json (--compile-json)",
            } if self.cuda else "CPU smoke run: perf_counter wall times; GPU busy, kernels, copy rate need CUDA",
        }
        self.R = Results(args.out, head)
        self.model: torch.nn.Module | None = None

    # ---------------------------------------------------------------- plumbing
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def step(self, name: str, fills: list[str], fn: Callable[[], None]) -> bool:
        b = self.a.time_budget_s
        if b and self.elapsed() > b:
            why = f"time budget {b:.0f} s reached ({self.elapsed():.0f} s) before step '{name}'"
            self.budget_hit.append(name)
            self.R.d["time_budget_reached"] = f"time budget {b:.0f} s reached; steps not started: " + ", ".join(
                self.budget_hit)
            for p in fills:
                self.R.skip(p, why)
            log(f"SKIP {name}: {why}")
            self.R.write()
            return False
        log(f"step {name} ...")
        t0 = time.perf_counter()
        ok = True
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - record, go on with the next step
            ok = False
            tb = traceback.format_exc(limit=8)
            self.R.d["errors"].append({"step": name, "error": f"{type(e).__name__}: {e}", "traceback": tb})
            log(f"ERROR in step {name}: {type(e).__name__}: {e}\n{tb}")
            for p in fills:
                self.R.skip(p, f"error in step '{name}': {type(e).__name__}: {e}")
            if self.model is not None:
                with contextlib.suppress(Exception):
                    qwen_absorb.unpatch(self.model)
            with contextlib.suppress(Exception):
                _runtime.set_defines(None)
            if self.cuda:
                gc.collect()
                torch.cuda.empty_cache()
        dt = time.perf_counter() - t0
        self.R.d["timings_s"][name] = round(dt, 1)
        self.R.d["elapsed_s"] = round(self.elapsed(), 1)
        log(f"step {name} done in {dt:.1f} s (total {self.elapsed():.0f} s)")
        self.R.write()
        return ok

    # ---------------------------------------------------------------- block section
    def block_setup(self) -> None:
        a, dev = self.a, self.dev
        if self.cuda:  # start CUPTI once, so every profiled case runs in the same profiler state
            x = torch.randn(256, 256, device=dev)
            profile_fn(lambda: x @ x, dev)
            del x
        t0 = time.perf_counter()
        self.model = self.build(a.num_layers)
        sync(dev)
        cfg = self.model.config
        c = self.R.d["config"]
        c["heads"], c["head_dim"] = cfg.num_attention_heads, cfg.attention_head_dim
        c["hidden"] = cfg.num_attention_heads * cfg.attention_head_dim
        log(f"  built a {a.num_layers}-layer transformer (hidden {c['hidden']}) in {time.perf_counter() - t0:.1f} s")
        inputs = T.transformer_inputs(self.model, batch_size=1, height=a.side, width=a.side, text_len=a.text_tokens,
                                      masked_tail=0, seed=a.seed + 1, device=dev, dtype=torch.bfloat16)
        store: dict[str, Any] = {}
        qwen_absorb.unpatch(self.model)
        with torch.inference_mode(), capture_block_inputs(self.model, 0, store):
            self.model(**inputs)
        sync(dev)
        if "kwargs" not in store:
            raise RuntimeError("the pre-hook of transformer_blocks[0] saw no call")
        self.bargs, self.bkw = store["args"], store["kwargs"]
        hs = self.bkw.get("hidden_states", self.bargs[0] if self.bargs else None)
        ehs = self.bkw.get("encoder_hidden_states", self.bargs[1] if len(self.bargs) > 1 else None)
        img, txt = int(hs.shape[1]), int(ehs.shape[1])
        c["block_input_tokens"] = {"image": img, "text": txt}
        c["full_size_block"] = (not a.tiny and c["hidden"] == 3072 and img == 4096 and txt == 128)
        del inputs
        self.outs: dict[str, Any] = {}

    def block_call(self, blk: Any) -> Callable[[], Any]:
        args, kw = self.bargs, self.bkw
        return lambda: blk(*args, **kw)

    def block_put(self, v: str, r: dict[str, Any]) -> None:
        R = self.R
        R.put(f"block_wall_ms.{v}", round(r["median_ms"], 4))
        R.put(f"block_first_call_s.{v}", r.get("first_call_s"))
        p = r.get("profile")
        why = r.get("profile_skipped") or "profiler gave nothing"
        R.put(f"block_gpu_ms.{v}", round(p["gpu_busy_ms"], 4) if p else None, None if p else why)
        R.put(f"kernels_per_block.{v}", p["kernels_per_call"] if p else None, None if p else why)
        R.d["block_details"][v] = r

    def block_output(self, v: str, blk: Any) -> None:
        with torch.inference_mode():
            out = blk(*self.bargs, **self.bkw)
        sync(self.dev)
        if v == "eager":
            self.outs["eager"] = tuple(t.clone() for t in out)
        elif "eager" in self.outs:
            self.R.put(f"block_output_vs_eager.{v}", compare(out, self.outs["eager"]))
        else:
            self.R.skip(f"block_output_vs_eager.{v}", "no eager output (its step failed or was skipped)")

    def block_eager(self) -> None:
        qwen_absorb.unpatch(self.model)
        blk = self.model.transformer_blocks[0]
        r = measure("block eager", self.block_call(blk), self.dev, self.a.warmup, self.a.block_iters)
        self.block_put("eager", r)
        self.block_output("eager", blk)

    def block_patched(self) -> None:
        R = self.R
        qwen_absorb.patch(self.model)
        try:
            rep = qwen_absorb.patch_report(self.model)
            blk = self.model.transformer_blocks[0]
            r = measure("block patched", self.block_call(blk), self.dev, self.a.warmup, self.a.block_iters)
            self.block_put("patched", r)
            self.block_output("patched", blk)
            top = kernel_table(self.block_call(blk), self.dev)
            R.put("patched_kernels_top", top, None if top is not None else f"{NEEDS_CUDA} (torch.profiler)")
            try:
                blocks = rep.to_dict().get("blocks") or []
            except Exception as e:  # noqa: BLE001 - the report's serialiser must not cost the timings
                log(f"  report.to_dict() failed ({type(e).__name__}: {e}); reading the block plans directly")
                blocks = [{"qk_norm_rope_fused": getattr(b, "qk_fused", None),
                           "qk_norm_rope_reasons": list(getattr(b, "qk_reasons", None) or [])} for b in rep.blocks]
            R.put("patch_report.summary", C.json_safe(dict(qwen_absorb.patch_report(self.model).summary)))
            R.put("patch_report.qk_norm_rope_fused", [b.get("qk_norm_rope_fused") for b in blocks])
            R.put("patch_report.qk_norm_rope_reasons", [b.get("qk_norm_rope_reasons") for b in blocks])
            R.put("patch_report.kernels_available", rep.kernels_available)
            R.put("patch_report.kernel_unavailable_reasons", list(rep.kernel_unavailable_reasons))
            R.put("patch_report.runtime_fallbacks", C.runtime_fallbacks(rep))
            log(f"  patch report: {json.dumps(R.get('patch_report.summary'))}")
        finally:
            qwen_absorb.unpatch(self.model)

    def block_compiled(self) -> None:
        a = self.a
        qwen_absorb.unpatch(self.model)
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        blk = self.model.transformer_blocks[0]
        kw = {"backend": a.compile_backend} if a.compile_backend else {}
        self.R.d["config"]["compile_call"] = f"torch.compile(block{''.join(f', {k}={v!r}' for k, v in kw.items())})"
        cblk = torch.compile(blk, **kw)
        try:
            r = measure("block compiled", self.block_call(cblk), self.dev, max(3, a.warmup), a.block_iters)
            self.block_put("compiled", r)
            self.block_output("compiled", cblk)
            self.R.put("compiled_dynamo", dynamo_counters())
        finally:
            del cblk
            torch._dynamo.reset()

    def build(self, num_layers: int) -> torch.nn.Module:
        a = self.a
        if a.tiny:
            return T.tiny_transformer(dtype=torch.bfloat16, num_layers=num_layers, seed=a.seed).to(self.dev)
        return T.full_size_transformer(num_layers=num_layers, dtype=torch.bfloat16, device=self.dev, seed=a.seed)

    def block_in_model(self) -> None:
        """Per-block cost inside the transformer's own loop (where the patch may hand block i+1's norm1 over from
        block i's FFN residual op, which a block called alone never does): whole transformer calls with L1 and L2
        layers, (L2 - L1) blocks = the difference (the work outside the blocks is the same in both)."""
        a, R, dev = self.a, self.R, self.dev
        l1, l2 = a.in_model_layers
        R.put("block_in_model.layers", [l1, l2])
        calls: dict[str, dict[str, Any]] = {}
        for n in (l1, l2):
            model = self.model if n == a.num_layers else self.build(n)
            inputs = T.transformer_inputs(model, batch_size=1, height=a.side, width=a.side, text_len=a.text_tokens,
                                          masked_tail=0, seed=a.seed + 1, device=dev, dtype=torch.bfloat16)
            try:
                for v in ("eager", "patched"):
                    qwen_absorb.unpatch(model)
                    rep = qwen_absorb.patch(model) if v == "patched" else None
                    r = measure(f"{n}-layer transformer {v}", lambda m=model, kw=inputs: m(**kw)[0], dev, a.warmup,
                                a.block_iters)
                    p = r.get("profile")
                    calls.setdefault(str(n), {})[v] = {
                        "wall_ms": round(r["median_ms"], 4),
                        "gpu_ms": round(p["gpu_busy_ms"], 4) if p else None,
                        "kernels": p["kernels_per_call"] if p else None,
                        "profile_skipped": r.get("profile_skipped"),
                    }
                    if rep is not None:
                        summ = dict(rep.summary)
                        calls[str(n)][v]["handoff"] = {k: summ.get(k) for k in summ if "cross_block" in k}
                        calls[str(n)][v]["runtime_fallbacks"] = C.runtime_fallbacks(rep)
                    R.put("block_in_model.calls", calls)
                    R.write()
            finally:
                qwen_absorb.unpatch(model)
                if model is not self.model:
                    del model, inputs
                    gc.collect()
                    if self.cuda:
                        torch.cuda.empty_cache()
        k = l2 - l1
        for v in ("eager", "patched"):
            for key, nd in (("wall_ms", 4), ("gpu_ms", 4), ("kernels", 2)):
                x, y = calls[str(l1)][v][key], calls[str(l2)][v][key]
                why = calls[str(l2)][v].get("profile_skipped") or "not measured"
                R.put(f"block_in_model.{key}.{v}", round((y - x) / k, nd) if x is not None and y is not None else None,
                      None if x is not None and y is not None else why)

    def block_cleanup(self) -> None:
        if self.model is not None:
            qwen_absorb.unpatch(self.model)
        self.model = None
        self.bargs = self.bkw = None
        self.outs = {}
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- ops section
    def time_op(self, op: str, sets: list[tuple]) -> dict[str, Any]:
        fn = op_fn(op)
        k = len(sets)
        if self.cuda:
            ms, samples = BO.time_graph(lambda: [fn(*s) for s in sets], reps=self.a.op_reps)
            timer = "cuda_graph_replay"
        else:
            for s in sets:
                fn(*s)
            samples = []
            for _ in range(self.a.op_reps):
                t0 = time.perf_counter()
                for s in sets:
                    fn(*s)
                samples.append((time.perf_counter() - t0) * 1e3)
            ms = statistics.median(samples)
            timer = "perf_counter (CPU: the torch reference, not the kernel)"
        return {"us": ms * 1e3 / k, "replay_ms_median": ms, "replay_ms_samples": [round(x, 4) for x in samples],
                "timer": timer}

    def n_sets(self, op: str) -> int:
        shape = self.a.op_shape
        tensor_bytes = math.prod(shape) * 2
        full = op_bytes(op, shape, 2)["full_tensors"]
        return max(self.a.op_sets, math.ceil(3 * self.l2 / (full * tensor_bytes)) if self.l2 else 0)

    def ops_copy_rate(self, when: str) -> None:
        R = self.R
        if not self.cuda:
            R.put("copy_rate_tb_s", None, f"{NEEDS_CUDA} (device-to-device copy)")
            return
        rate = BO.copy_rate()
        R.d["copy_rate_runs_tb_s"].append({"when": when, "tb_s": round(rate, 4)})
        best = max(x["tb_s"] for x in R.d["copy_rate_runs_tb_s"])
        R.put("copy_rate_tb_s", best)
        log(f"  copy rate ({when}): {rate:.3f} TB/s; best {best:.3f}")
        for op in OPS:  # keep the percentages on the best copy rate measured so far
            o = R.d["ops"].get(op)
            if o and o.get("tb_s") is not None:
                R.put(f"copy_rate_pct.{op}", round(100 * o["tb_s"] / best, 2))
        for name, per in R.d["copy_rate_pct_variants"].items():
            for op, pct in per.items():
                tbs = ((R.d["ops"].get(op) or {}).get("variants") or {}).get(name, {}).get("tb_s")
                if tbs is not None:
                    per[op] = round(100 * tbs / best, 2)

    def ops_default(self) -> None:
        a, R = self.a, self.R
        shape = tuple(a.op_shape)
        self.ref_out: dict[str, tuple] = {}
        _runtime.set_defines(None)
        for op in OPS:
            k = self.n_sets(op)
            sets = make_sets(shape, k, self.dev, a.seed + 7)
            info = op_bytes(op, shape, 2)
            reasons = op_reasons(op, sets[0])
            t = self.time_op(op, sets)
            tbs = info["bytes"] / (t["us"] * 1e-6) / 1e12
            self.ref_out[op] = outputs(op, sets[0])
            R.d["ops"][op] = {"shape": list(shape), "dtype": "bf16", **info, "sets": k, "tb_s": round(tbs, 4),
                              "kernel_reasons": reasons, **t, "variants": {}}
            rate = R.get("copy_rate_tb_s")
            R.put(f"copy_rate_pct.{op}", round(100 * tbs / rate, 2) if rate else None,
                  None if rate else f"{NEEDS_CUDA} (no copy rate)" if not self.cuda else "copy rate not measured")
            log(f"  {op:38s} {list(shape)}: {t['us']:9.1f} us, {tbs:6.3f} TB/s"
                + (f", {R.get('copy_rate_pct.' + op):.1f}% of copy" if rate else "")
                + (f"  (reference: {'; '.join(reasons)})" if reasons else ""))
            del sets
            R.write()

    def ops_variant(self, name: str, defines: dict[str, Any]) -> None:
        a, R = self.a, self.R
        shape = tuple(a.op_shape)
        R.d["ln_variants"][name] = defines
        R.d["copy_rate_pct_variants"][name] = {op: None for op in OPS}
        R.d["variant_bit_identical"][name] = {op: None for op in OPS}
        try:
            _runtime.set_defines(defines)
            for op in OPS:
                k = self.n_sets(op)
                sets = make_sets(shape, k, self.dev, a.seed + 7)  # the same inputs as the default build's
                info = op_bytes(op, shape, 2)
                t = self.time_op(op, sets)
                tbs = info["bytes"] / (t["us"] * 1e-6) / 1e12
                out = outputs(op, sets[0])
                ref = getattr(self, "ref_out", {}).get(op)
                same = (None if ref is None else
                        bool(len(out) == len(ref) and all(torch.equal(x, y) for x, y in zip(out, ref))))
                rate = R.get("copy_rate_tb_s")
                R.d["copy_rate_pct_variants"][name][op] = round(100 * tbs / rate, 2) if rate else None
                R.d["variant_bit_identical"][name][op] = same
                if ref is None:
                    R.skip(f"variant_bit_identical.{name}.{op}", "no default-build output (its step failed)")
                if not rate:
                    R.skip(f"copy_rate_pct_variants.{name}.{op}",
                           f"{NEEDS_CUDA} (no copy rate)" if not self.cuda else "copy rate not measured")
                if op in R.d["ops"]:
                    R.d["ops"][op]["variants"][name] = {"us": t["us"], "tb_s": round(tbs, 4),
                                                        "bit_identical_to_default": same, "sets": k}
                log(f"  [{name}] {op:38s}: {t['us']:9.1f} us, {tbs:6.3f} TB/s, bit-identical to default: {same}")
                del sets, out
                R.write()
        finally:
            _runtime.set_defines(None)

    # ---------------------------------------------------------------- compile numbers from cuda_graph_bench
    def compile_from_json(self) -> None:
        R, path = self.R, self.a.compile_json
        keys = ("compile_1024_ms.compiled", "compile_1024_ms.patched_compiled", "compile_1024_speedup")
        if path is None:
            for k in keys:
                R.skip(k, "measured by benchmarks/cuda_graph_bench.py --sections compile (60 layers, 1024^2); pass "
                          "its cuda_graph.json with --compile-json to copy the numbers here")
            return
        try:
            src = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            for k in keys:
                R.skip(k, f"--compile-json {path}: unreadable ({type(e).__name__}: {e})")
            return
        cfg = src.get("config") or {}
        geometry_ok = (not src.get("tiny") and cfg.get("num_layers") == 60 and cfg.get("resolution") == 1024
                       and bool(src.get("gpu")))
        comp, pc = src.get("bf16_compile_ms"), src.get("bf16_patched_compile_ms")
        skipped = src.get("skipped") or {}
        R.put("compile_1024_ms.compiled", comp,
              f"null in {path}: {skipped.get('bf16_compile_ms', 'not measured there')}")
        why_pc = skipped.get("bf16_patched_compile_ms", "not measured there (an older cuda_graph_bench?)")
        R.put("compile_1024_ms.patched_compiled", pc, f"null in {path}: {why_pc}")
        sp = comp / pc if isinstance(comp, (int, float)) and isinstance(pc, (int, float)) and pc else None
        R.put("compile_1024_speedup", round(sp, 4) if sp is not None else None,
              None if sp is not None else "a compile_1024_ms value is missing")
        R.put("compile_1024_source", {
            "path": str(path), "benchmark": src.get("benchmark"), "gpu": src.get("gpu"), "date": src.get("date"),
            "num_layers": cfg.get("num_layers"), "resolution": cfg.get("resolution"), "tiny": src.get("tiny"),
            "geometry_ok": geometry_ok,
            "gpu_busy_ms": {"compiled": src.get("bf16_compile_gpu_busy_ms"),
                            "patched_compiled": src.get("bf16_patched_compile_gpu_busy_ms")},
            "compile_call": (src.get("details") or {}).get("compile_call"),
            "note": "cuda_graph_bench.py section compile: bf16_compile_ms = unpatched + compile_repeated_blocks(); "
                    "bf16_patched_compile_ms = qwen_absorb.patch(model) + compile_repeated_blocks(); median wall ms "
                    "of one 1024^2 call (CUDA events)" + ("" if geometry_ok else
                                                          "; NOT 60 layers at 1024^2 on a GPU: target not judged"),
        })
        log(f"  compile numbers from {path}: compiled {comp} ms, patched + compiled {pc} ms, speed-up {sp}")

    # ---------------------------------------------------------------- run
    def run(self) -> int:
        a, R = self.a, self.R
        R.write()
        log(f"fusion_bench: sections {','.join(a.sections)}, device {self.dev}{' (tiny)' if a.tiny else ''}, "
            f"writing {a.out / 'fusion.json'}")
        block_keys = ([f"{g}.{v}" for g in ("block_gpu_ms", "block_wall_ms", "kernels_per_block") for v in VARIANTS]
                      + ["patched_kernels_top", "patch_report.summary"])
        self.step("compile_numbers", [], self.compile_from_json)
        if "block" in a.sections:
            if self.step("block_setup", block_keys, self.block_setup):
                self.step("block_eager", [k for k in block_keys if k.endswith(".eager")], self.block_eager)
                self.step("block_patched", [k for k in block_keys if "patched" in k or k.startswith("patch")],
                          self.block_patched)
                if not a.in_model_layers:
                    for g in ("gpu_ms", "wall_ms", "kernels"):
                        for v in ("eager", "patched"):
                            R.skip(f"block_in_model.{g}.{v}", "not requested (--in-model-layers none)")
                else:
                    self.step("block_in_model", [f"block_in_model.{g}.{v}" for g in ("gpu_ms", "kernels")
                                                 for v in ("eager", "patched")], self.block_in_model)
                if not a.ops_before_compile:
                    self.step("block_compiled", [k for k in block_keys if k.endswith(".compiled")], self.block_compiled)
        else:
            for k in block_keys:
                R.skip(k, "section block not selected (--sections)")
        if "ops" in a.sections:
            ops_keys = [f"copy_rate_pct.{op}" for op in OPS]
            self.step("ops_copy_rate_before", ["copy_rate_tb_s"], lambda: self.ops_copy_rate("before the ops"))
            self.step("ops_default_build", ops_keys, self.ops_default)
            for name, defines in a.ln_variants:
                self.step(f"ops_variant_{name}", [f"copy_rate_pct_variants.{name}.{op}" for op in OPS],
                          lambda n=name, d=defines: self.ops_variant(n, d))
            self.step("ops_copy_rate_after", ["copy_rate_tb_s"], lambda: self.ops_copy_rate("after the ops"))
        else:
            for op in OPS:
                R.skip(f"copy_rate_pct.{op}", "section ops not selected (--sections)")
            R.skip("copy_rate_tb_s", "section ops not selected (--sections)")
        if "block" in a.sections and a.ops_before_compile and self.model is not None:
            self.step("block_compiled", [f"{g}.compiled" for g in ("block_gpu_ms", "block_wall_ms",
                                                                    "kernels_per_block")], self.block_compiled)
        self.block_cleanup()
        for p in ([f"{g}.{v}" for g in ("block_gpu_ms", "block_wall_ms", "kernels_per_block") for v in VARIANTS]
                  + [f"copy_rate_pct.{op}" for op in OPS]):
            R.skip(p, "not measured (its step was skipped or failed: see errors)")
        R.d["elapsed_s"] = round(self.elapsed(), 1)
        R.write()
        log(f"wrote {a.out / 'fusion.json'} and fusion.md in {self.elapsed():.0f} s")
        print(markdown(R.d))
        return 1 if R.d["errors"] else 0


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default benchmarks/results; --tiny: a new temp folder)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny model (seconds; not a benchmark)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--time-budget-s", type=float, default=240.0,
                    help="do not start a new step after this many seconds (0: no limit); default 240")
    ap.add_argument("--device", default=None, help="default cuda (--tiny: cpu)")
    ap.add_argument("--num-layers", type=int, default=None, help="layers of the model built (default 2; --tiny: 1)")
    ap.add_argument("--side", type=int, default=None,
                    help="latent tokens per side of the image (default 64: 4096 tokens = 1024^2; --tiny: 8)")
    ap.add_argument("--text-tokens", type=int, default=None, help="default 128 (--tiny: 8)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up calls of the block after its first call")
    ap.add_argument("--block-iters", type=int, default=20, help="timed calls of the block (>= 5)")
    ap.add_argument("--in-model-layers", default=None,
                    help="L1,L2: per-block cost inside the transformer loop = (call with L2 layers - call with L1) / "
                         "(L2 - L1), eager and patched (default NUM_LAYERS,NUM_LAYERS+2; 'none' to skip)")
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend of the compiled block (default: torch's default, inductor; "
                         "--tiny on the CPU: eager, no compiler toolchain needed)")
    ap.add_argument("--ops-before-compile", action="store_true",
                    help="time the ops before compiling the block (the compile is the slow step)")
    ap.add_argument("--op-shape", default=None, help="B,L,D of the ops (default 1,16384,3072; --tiny: 1,256,3072)")
    ap.add_argument("--op-sets", type=int, default=4, help="distinct input sets per graph replay (at least)")
    ap.add_argument("--op-reps", type=int, default=None, help="timed graph replays per op (default 30; --tiny: 3)")
    ap.add_argument("--ln-variants", nargs="*", default=[], type=parse_variant, metavar="NAME=DEFINE:VALUE",
                    help="kernel build variants to re-time, e.g. packed=QA_LN_PACKED:1 (several defines: "
                         "name=A:1,B:2)")
    ap.add_argument("--compile-json", type=Path, default=None,
                    help="cuda_graph.json of `cuda_graph_bench.py --sections compile` from the same device run")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    asked = {s.strip() for s in a.sections.split(",") if s.strip()}
    bad = asked - set(SECTIONS)
    if bad or not asked:
        ap.error(f"--sections: choose from {','.join(SECTIONS)} (got {sorted(bad) or 'nothing'})")
    a.sections = [s for s in SECTIONS if s in asked]
    names = [n for n, _ in a.ln_variants]
    if len(set(names)) != len(names):
        ap.error(f"--ln-variants: duplicate names {names}")
    if a.block_iters < 5 or a.warmup < 1:
        ap.error("method: --block-iters >= 5 and --warmup >= 1")
    t = a.tiny
    a.device = a.device or ("cpu" if t else "cuda")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"CUDA is not available (torch {torch.__version__}); use --tiny for a CPU smoke run")
    a.num_layers = a.num_layers or (1 if t else 2)
    a.side = a.side or (8 if t else 64)
    a.text_tokens = a.text_tokens or (8 if t else 128)
    if (a.in_model_layers or "").strip().lower() == "none":
        a.in_model_layers = None
    else:
        try:
            lm = [int(x) for x in (a.in_model_layers or f"{a.num_layers},{a.num_layers + 2}").split(",")]
            if len(lm) != 2 or not 1 <= lm[0] < lm[1]:
                raise ValueError
        except ValueError:
            ap.error(f"--in-model-layers: expected L1,L2 with 1 <= L1 < L2 (got {a.in_model_layers!r})")
        a.in_model_layers = tuple(lm)
    a.op_reps = a.op_reps or (3 if t else 30)
    if a.compile_backend is None and t and not a.device.startswith("cuda"):
        a.compile_backend = "eager"
    try:
        a.op_shape = tuple(int(x) for x in (a.op_shape or ("1,256,3072" if t else "1,16384,3072")).split(","))
        if len(a.op_shape) != 3 or min(a.op_shape) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--op-shape: expected B,L,D (got {a.op_shape!r})")
    results = (ROOT / "benchmarks" / "results").resolve()
    if a.out is None:
        a.out = Path(tempfile.mkdtemp(prefix="fusion_bench_tiny_")) if t else results
    a.out = a.out.resolve()
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only contend
    return Bench(args).run()


if __name__ == "__main__":
    sys.exit(main())
