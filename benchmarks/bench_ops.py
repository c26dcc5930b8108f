#!/usr/bin/env python
"""The fused ops alone: GPU time against eager and torch.compile, host cost per call, and tools for the kernels.

section ``ops`` -> ``<out>/bench_ops.json`` + ``.md``: ``layer_norm_scale_shift``, ``bias_residual_layer_norm_scale_shift``,
    ``bias_gate_residual`` in bf16 at [1,4096,3072], [2,4096,3072], [1,16384,3072], [1,256,3072]: eager expression vs
    ``torch.compile(expression)`` vs qwen_absorb. Each time is a CUDA-graph replay of K calls over K distinct input
    sets (K such that one replay touches >= 3x the L2: inputs come from HBM) / K, median of replays. Bytes: the
    full [B, L, D] tensors each op reads and writes (2, 4, 3). The device copy rate is measured before and after.
section ``host`` -> merged into ``<out>/host_cost.json`` (was benchmarks/host_cost.py): at [1,128,3072] bf16 the GPU
    work of a call is a few us, so N calls (then one synchronize) / N is the host cost of one call: ``torch_add_us``
    (the yardstick), ``op_us`` (the public, validating ops), ``block_entry_us`` (the checked-once ``launch`` entries
    the patched block calls), ``ratio_*`` (each / torch_add_us). Cases interleaved over ``--rounds``, median.

Tools: ``--sweep`` times kernel build variants (compile-time defines) first; ``--ncu`` runs one call of each op at
[1,16384,3072] and exits (was profile_ops.py), for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy -k regex:"layer_norm|bias_gate" \\
        python benchmarks/bench_ops.py --ncu

``--probe-ln-order`` compiles both FMA groupings of the Welford combine (``QA_WELFORD_MEAN_ORDER`` 0/1) and prints the
share of LayerNorm outputs bit-identical to torch (was probe_layer_norm_order.py).

    python benchmarks/bench_ops.py                   # H200: ~1.5 min (both sections)
    python benchmarks/bench_ops.py --tiny            # CPU smoke run: the torch references at a small shape
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402

SECTIONS = ("ops", "host")
SHAPES = [(1, 4096, 3072), (2, 4096, 3072), (1, 16384, 3072), (1, 256, 3072)]
FULL_TENSORS = {"layer_norm_scale_shift": 2, "bias_residual_layer_norm_scale_shift": 4, "bias_gate_residual": 3}


def time_op(fn: Any, sets: list[tuple], device: torch.device, reps: int) -> float:
    """us of one call: a graph replay of one call per set / K on CUDA, a perf_counter loop on the CPU."""
    run = lambda: [fn(*s) for s in sets]  # noqa: E731
    ms = H.time_graph(run, reps=reps)[0] if device.type == "cuda" else H.time_calls(run, device, 1, reps)["median_ms"]
    return ms * 1e3 / len(sets)


class Bench(H.Bench):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__(a)
        env = self.env
        cfg = {**vars(a), "device": str(a.device), "out": str(a.out)}
        self.docs = []
        self.O = self.HC = None
        if "ops" in a.sections:
            self.O = H.Results(a.out, "bench_ops", {**H.head("benchmarks/bench_ops.py (section ops)", env, cfg),
                                                    "env": env, "rows": [], "targets": [], "sweep": []}, ops_markdown)
            self.docs.append(self.O)
        if "host" in a.sections:
            self.HC = H.Results(a.out, "host_cost", {"op_level_source": "benchmarks/bench_ops.py --sections host",
                                                     "op_level_env": env}, host_markdown, merge=True)
            self.docs.append(self.HC)
        self.steps = H.Steps(self.docs, a.budget_s)

    def shapes(self) -> list[tuple[int, int, int]]:
        return [(1, 64, 64), (2, 64, 64)] if self.a.tiny else SHAPES

    def n_sets(self, op: str, shape: tuple[int, int, int]) -> int:
        return max(2, math.ceil(3 * self.l2 / (FULL_TENSORS[op] * math.prod(shape) * 2))) if self.l2 else 2

    def copy_rate(self) -> None:
        if self.cuda:
            self.O.d.setdefault("copy_rate_runs_tb_s", []).append(H.copy_rate_tb_s())

    def sweep(self) -> None:
        from qwen_absorb.ops import _runtime  # noqa: PLC0415

        variants = {"layer_norm_scale_shift": [("QA_LN_MIN_BLOCKS", v) for v in (1, 8, 10, 12)],
                    "bias_residual_layer_norm_scale_shift": [("QA_LN_MIN_BLOCKS", v) for v in (1, 8, 10, 12)],
                    "bias_gate_residual": [("QA_BGR_MIN_BLOCKS", v) for v in (1, 12, 16)]}
        try:
            for shape in [(1, 16384, 3072), (1, 4096, 3072)]:
                for op, vs in variants.items():
                    sets = H.op_sets(shape, self.n_sets(op, shape), self.dev, 1)
                    for name, val in vs:
                        _runtime.set_defines({name: val})
                        us = time_op(H.op_call(op), sets, self.dev, self.a.reps)
                        self.O.d["sweep"].append({"op": op, "shape": list(shape), "variant": f"{name}={val}", "us": us})
                        H.log(f"sweep {op:38s} {shape} {name}={val}: {us:8.1f} us")
        finally:
            _runtime.set_defines(None)

    def ops(self) -> None:
        rows = self.O.d["rows"]
        for shape in self.shapes():
            nbytes = math.prod(shape) * 2
            for op, n_full in FULL_TENSORS.items():
                k = self.n_sets(op, shape)
                sets = H.op_sets(shape, k, self.dev, 0)
                eager = H.op_call(op, "eager")
                impls = {"eager": eager, "torch.compile": torch.compile(eager, dynamic=False,
                                                                         **({} if self.cuda else {"backend": "eager"})),
                         "qwen_absorb": H.op_call(op)}
                for impl, fn in impls.items():
                    us = time_op(fn, sets, self.dev, self.a.reps)
                    tbs = n_full * nbytes / (us * 1e-6) / 1e12
                    rows.append({"op": op, "shape": list(shape), "impl": impl, "us": us, "tb_s": tbs,
                                 "bytes": n_full * nbytes, "sets_rotated": k})
                    H.log(f"{op:40s} {str(shape):18s} {impl:14s} {us:9.1f} us {tbs:6.2f} TB/s")
                del sets
                self.O.write()

    def derive(self) -> None:
        d = self.O.d
        rate = max(d.get("copy_rate_runs_tb_s") or [0.0]) or None
        d["copy_rate_tb_s"] = rate
        d["l2_note"] = f"{self.l2 // 2**20} MiB L2, input sets rotated so one replay touches >= 3x L2"
        d["timing"] = "CUDA graph of K calls over K input sets, median of replays, per-call time = replay / K"
        for r in d["rows"]:
            r["pct_of_copy"] = 100 * r["tb_s"] / rate if rate else None
        big = list(self.shapes()[2] if len(self.shapes()) > 2 else self.shapes()[0])
        d["targets"] = []
        for op in FULL_TENSORS:
            by = {(tuple(r["shape"]), r["impl"]): r for r in d["rows"] if r["op"] == op}
            q = by.get((tuple(big), "qwen_absorb"))
            if q and q["pct_of_copy"] is not None:
                d["targets"].append({"op": op, "check": f">= 80% of copy rate at {big}", "value": q["pct_of_copy"],
                                     "pass": q["pct_of_copy"] >= 80})
            for shape in self.shapes():
                q, c = by.get((shape, "qwen_absorb")), by.get((shape, "torch.compile"))
                if q and c:
                    limit = 1.05 if op == "bias_gate_residual" else 1.0
                    d["targets"].append({"op": op, "check": f"vs torch.compile at {list(shape)} (time ratio <= {limit})",
                                         "value": q["us"] / c["us"], "pass": q["us"] / c["us"] <= limit})

    def host(self) -> None:
        from qwen_absorb.ops.bias_gate_residual import launch as bgr  # noqa: PLC0415
        from qwen_absorb.ops.bias_residual_layer_norm_scale_shift import launch as brln  # noqa: PLC0415
        from qwen_absorb.ops.layer_norm_scale_shift import launch as lnss  # noqa: PLC0415
        from qwen_absorb.ops.quantize_fp8 import launch as qf8  # noqa: PLC0415
        import qwen_absorb.ops as ops  # noqa: PLC0415

        a, dev, D = self.a, self.dev, 3072
        g = torch.Generator(device=dev).manual_seed(0)
        x, r = (torch.randn(1, 128, D, generator=g, device=dev).bfloat16() for _ in range(2))
        sh, sc, gt, sh2, sc2, gt2 = (c.unsqueeze(1) for c in torch.randn(1, 6 * D, generator=g, device=dev)
                                     .bfloat16().chunk(6, dim=-1))
        rows = [c.squeeze(1) for c in (sh, sc, gt)]
        bias, amax = torch.randn(D, generator=g, device=dev).bfloat16(), torch.tensor([4.0], device=dev)
        cases = {
            "torch_add": lambda: torch.add(x, r),
            "op:layer_norm_scale_shift": lambda: ops.layer_norm_scale_shift(x, shift=sh, scale=sc),
            "op:bias_residual_layer_norm_scale_shift": lambda: ops.bias_residual_layer_norm_scale_shift(
                r, x, bias=bias, gate=gt, shift=sh2, scale=sc2),
            "op:bias_gate_residual": lambda: ops.bias_gate_residual(r, x, bias=bias, gate=gt2),
            "op:quantize_fp8": lambda: ops.quantize_fp8(x, amax),
            "entry:layer_norm_scale_shift": lambda: lnss(x, rows[0], rows[1], 1e-6, None),
            "entry:layer_norm_scale_shift_fp8": lambda: lnss(x, rows[0], rows[1], 1e-6, None, out=False, fp8_amax=amax),
            "entry:bias_residual_layer_norm_scale_shift": lambda: brln(r, x, bias, rows[2], rows[0], rows[1], 1e-6,
                                                                       None, None, 0),
            "entry:bias_gate_residual": lambda: bgr(r, x, bias, rows[2], None),
            "entry:quantize_fp8": lambda: qf8(x, 0, None, amax),
            "F.layer_norm": lambda: torch.nn.functional.layer_norm(x, (D,), eps=1e-6),
        }
        samples: dict[str, list[float]] = {c: [] for c in cases}
        broken: dict[str, str] = {}
        for _ in range(a.rounds):  # interleaved: slow drifts of a shared host hit all cases alike
            for name, fn in cases.items():
                if name in broken:
                    continue
                try:
                    for _ in range(20):
                        fn()
                    H.sync(dev)
                    t0 = time.perf_counter()
                    for _ in range(a.calls):
                        fn()
                    H.sync(dev)
                    samples[name].append((time.perf_counter() - t0) / a.calls * 1e6)
                except Exception as e:  # noqa: BLE001 - e.g. a CUDA-only entry point on the CPU
                    broken[name] = f"{type(e).__name__}: {e}"
        us = {c: statistics.median(v) for c, v in samples.items() if v}
        add = us["torch_add"]
        HC = self.HC
        HC.d.update(shape=[1, 128, D], dtype="bfloat16", calls=a.calls, rounds=a.rounds, torch_add_us=round(add, 2),
                    f_layer_norm_us=round(us["F.layer_norm"], 2))
        for pre, key in (("op:", "op_us"), ("entry:", "block_entry_us")):
            HC.d[key] = {c[len(pre):]: round(v, 2) for c, v in us.items() if c.startswith(pre)}
            HC.d[f"ratio_{key.replace('_us', '')}_vs_add"] = {c: round(v / add, 2) for c, v in HC.d[key].items()}
        HC.d["samples_us"] = {c: [round(s, 2) for s in v] for c, v in samples.items()}
        for c, why in broken.items():
            HC.skip(f"host_cases.{c}", why)

    def run(self) -> int:
        s, O, HC = self.steps, self.O, self.HC
        s.write()
        if O is not None:
            s("copy_rate_before", self.copy_rate)
            if self.a.sweep:
                s("sweep", self.sweep)
            s("ops", self.ops, [(O, "rows")])
            s("copy_rate_after", self.copy_rate)
            self.derive()
        if HC is not None:
            s("host", self.host, [(HC, "torch_add_us")])
        s.write()
        for d in self.docs:
            H.log(f"wrote {d.json} and {d.md.name}")
        return 1 if s.failed else 0


def ops_markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("The fused ops vs eager and torch.compile (bf16)", d, d.get("timing"))
    lines += ["", f"Device copy rate measured in this run: **{H.fmt(d.get('copy_rate_tb_s'), 2)} TB/s** (read + "
                  f"write); {d.get('l2_note')}.", ""]
    by = {(r["op"], tuple(r["shape"]), r["impl"]): r for r in d.get("rows") or []}
    rows = []
    for op in FULL_TENSORS:
        for shape in sorted({tuple(r["shape"]) for r in d.get("rows") or []}):
            e, c, q = (by.get((op, shape, i)) for i in ("eager", "torch.compile", "qwen_absorb"))
            if e and c and q:
                rows.append([op, str(list(shape)), e["us"], c["us"], q["us"], q["tb_s"], q.get("pct_of_copy"),
                             f"{c['us'] / q['us']:.2f}x"])
    lines += H.md_table(["op", "shape", "eager us", "torch.compile us", "qwen_absorb us", "TB/s", "% of copy",
                         "vs compile"], rows, 1)
    lines += ["", *H.md_table(["target", "op", "value", "pass"],
                              [[t["check"], t["op"], t["value"], "yes" if t["pass"] else "**no**"]
                               for t in d.get("targets") or []])]
    return H.md_document(lines, d)


def host_markdown(d: dict[str, Any]) -> str:
    env = d.get("op_level_env") or {}
    lines = H.md_head("Host cost of the fused ops and of one transformer call",
                      {"environment": env, "date": env.get("date"), "elapsed_s": d.get("elapsed_s")})
    lines += ["", f"torch.add: {H.fmt(d.get('torch_add_us'), 2)} us per call at {d.get('shape')} bf16", ""]
    rows = [[k, v, (d.get("ratio_op_vs_add") or {}).get(k)] for k, v in (d.get("op_us") or {}).items()]
    rows += [[f"entry: {k}", v, (d.get("ratio_block_entry_vs_add") or {}).get(k)]
             for k, v in (d.get("block_entry_us") or {}).items()]
    lines += H.md_table(["call", "us", "vs torch.add"], rows, 2)
    for res in ("1024", "512", "fp8_1024"):
        o = d.get(res) or {}
        if o.get("unpatched_ms") is not None:
            lines.append(f"- transformer {res}: unpatched {H.fmt(o.get('unpatched_ms'))} ms, patched "
                         f"{H.fmt(o.get('patched_ms'))} ms (benchmarks/transformer_suite.py --sections host)")
    return H.md_document(lines, d)


def ncu() -> int:
    sets = H.op_sets((1, 16384, 3072), 1, torch.device("cuda"), 0)[0]
    for op in H.OPS:
        H.op_call(op)(*sets)
    torch.cuda.synchronize()
    return 0


def probe_ln_order() -> int:
    from qwen_absorb.ops import _runtime, layer_norm_scale_shift  # noqa: PLC0415

    results: dict[str, dict[str, float]] = {}
    try:
        for order in (0, 1):
            _runtime.set_defines({"QA_WELFORD_MEAN_ORDER": order})
            row = results.setdefault(f"order{order}", {})
            for dtype in (torch.float32, torch.bfloat16):
                for D in (64, 3072, 3080, 5120):
                    g = torch.Generator(device="cuda").manual_seed(D)
                    x = (torch.randn(4, 1024, D, generator=g, device="cuda") * 3 + 1).to(dtype)
                    zero = torch.zeros(4, 1, D, device="cuda", dtype=dtype)
                    got = layer_norm_scale_shift(x, shift=zero, scale=zero)
                    want = torch.nn.functional.layer_norm(x, (D,), eps=1e-6)
                    row[f"{str(dtype)[6:]}-D{D}"] = (got == want).float().mean().item()
    finally:
        _runtime.set_defines(None)
    print(json.dumps(results, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, SECTIONS)
    ap.add_argument("--reps", type=int, default=None, help="timed graph replays per case (default 30; --tiny: 3)")
    ap.add_argument("--quick", action="store_true", help="8 replays per case")
    ap.add_argument("--sweep", action="store_true", help="time kernel build variants first (tuning)")
    ap.add_argument("--calls", type=int, default=2000, help="host section: calls per round")
    ap.add_argument("--rounds", type=int, default=7, help="host section: rounds (median)")
    ap.add_argument("--ncu", action="store_true", help="one call of each op at [1,16384,3072], for ncu; then exit")
    ap.add_argument("--probe-ln-order", action="store_true", help="the Welford FMA-grouping probe; then exit")
    a = ap.parse_args(argv)
    a = H.finish_args(ap, a, SECTIONS, "bench_ops")
    if (a.ncu or a.probe_ln_order) and a.device.type != "cuda":
        ap.error("--ncu / --probe-ln-order run the CUDA kernels: they need a GPU")
    if a.ncu:
        return ncu()
    if a.probe_ln_order:
        return probe_ln_order()
    a.reps = a.reps or (3 if a.tiny else 8 if a.quick else 30)
    if a.tiny:
        a.calls, a.rounds = min(a.calls, 50), min(a.rounds, 2)
    torch.backends.cuda.matmul.allow_tf32 = False
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
