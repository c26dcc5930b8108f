#!/usr/bin/env python
"""The LoRA branch of a real-FP8 linear, GEMM by GEMM (issue 18): where its time goes and what the options cost.

For the shapes of a Qwen-Image block at 1024^2 (4096 image rows, 128 text rows, K/N in {3072, 12288}, rank 64):

- ``base``: ``torch._scaled_mm`` with the bias in its epilogue (no LoRA);
- ``add_after``: ``base``, then ``out.addmm_(x @ A.T, B.T, alpha=s)`` (reads and writes the output once more);
- ``accumulate``: ``out.addmm_(x @ A.T, B.T, beta=0, alpha=s)`` first, then the FP8 GEMM adds its product and
  the bias to it in its epilogue (``cublaslt_fp8.scaled_mm(accumulate=True)``, cuBLASLt ``beta = 1``);
- the ``lora_A`` product three ways (``F.linear(x, A)``, ``x @ A.T`` with A.T stored contiguous, ``(A @ x.T).T``).

Each time is per call: the median of 20 replays of a CUDA graph holding 10 calls (no host cost). Exactness: every variant against the fp32
expression ``sa*sb*(a @ w.T) + bias + s*(t @ B.T)``, in units of the output's rounding; ``accumulate`` into a zero
output against ``torch._scaled_mm`` (bit for bit when cuBLASLt picks the same kernel); graph capture; an output
that is a row slice of a joint tensor at an unaligned offset.

    python benchmarks/probe_lora_gemm.py --out benchmarks/results     # ~1 min on the H200
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import cublaslt_fp8 as cublaslt  # noqa: E402

SHAPES = [(4096, 3072, 3072), (4096, 12288, 3072), (4096, 3072, 12288),
          (128, 3072, 3072), (128, 12288, 3072), (128, 3072, 12288)]
A_SHAPES = [(4096, 3072, 192), (4096, 3072, 64), (4096, 12288, 64), (128, 3072, 192), (128, 3072, 64),
            (128, 12288, 64)]
RANK = 64


def _operands(m: int, n: int, k: int, dev: torch.device, gen: torch.Generator) -> dict[str, Any]:
    def rnd(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=dev) * std

    amax_x, amax_w = 4.0, 0.05
    a = (rnd(m, k).clamp(-amax_x, amax_x) * (448 / amax_x)).to(torch.float8_e4m3fn)
    w = (rnd(n, k, std=0.02).clamp(-amax_w, amax_w) * (448 / amax_w)).to(torch.float8_e4m3fn)
    return dict(a=a, w=w, sa=torch.tensor([amax_x / 448], device=dev), sb=torch.tensor([amax_w / 448], device=dev),
                bias=rnd(n, std=0.02).bfloat16(), t=rnd(m, RANK).bfloat16(), B=rnd(n, RANK, std=0.02).bfloat16(),
                s=0.75)


def _base(o: dict[str, Any], out: torch.Tensor, fast: bool = False) -> torch.Tensor:
    return torch._scaled_mm(o["a"], o["w"].t(), scale_a=o["sa"], scale_b=o["sb"], bias=o["bias"],
                            out_dtype=torch.bfloat16, use_fast_accum=fast, out=out)


def _add_after(o: dict[str, Any], out: torch.Tensor, fast: bool = False) -> torch.Tensor:
    _base(o, out, fast)
    return out.addmm_(o["t"], o["B"].t(), alpha=o["s"])


def _accumulate(o: dict[str, Any], out: torch.Tensor, fast: bool = False) -> torch.Tensor:
    out.addmm_(o["t"], o["B"].t(), beta=0, alpha=o["s"])
    if not cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out, fast_accum=fast, accumulate=True):
        raise RuntimeError("cuBLASLt offered no algorithm")
    return out


def _reference(o: dict[str, Any]) -> torch.Tensor:
    y = (o["a"].float() * o["sa"]) @ (o["w"].float() * o["sb"]).t() + o["bias"].float()
    return y + o["s"] * (o["t"].float() @ o["B"].float().t())


def _ulps(y: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Error in units of bf16's spacing at each reference value (max and mean), and the rel. Frobenius error."""
    spacing = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-6).log2().floor().exp2()
    u = (y.float() - ref).abs() / spacing
    return {"max_ulp": float(u.max()), "mean_ulp": float(u.mean()),
            "rel_err": float((y.float() - ref).norm() / ref.norm())}


def exactness(dev: torch.device, gen: torch.Generator) -> dict[str, Any]:
    r: dict[str, Any] = {}
    for m, n, k in SHAPES:
        o = _operands(m, n, k, dev, gen)
        ref = _reference(o)
        row: dict[str, Any] = {}
        for name, fn in (("add_after", _add_after), ("accumulate", _accumulate)):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)  # poisoned
            row[name] = _ulps(fn(o, out), ref)
        zero = torch.zeros((m, n), dtype=torch.bfloat16, device=dev)
        cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], zero, fast_accum=False, accumulate=True)
        base = _base(o, torch.empty_like(zero))
        row["accumulate_into_zero_equal_to_scaled_mm"] = float((zero == base).float().mean())
        for fast in (False, True):
            mine = torch.full_like(zero, float("nan"))
            cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], mine, fast_accum=fast, accumulate=False)
            row[f"plain_equal_to_scaled_mm{'_fast' if fast else ''}"] = float(
                (mine == _base(o, torch.empty_like(zero), fast)).float().mean())
        row["accumulate_vs_add_after_differing"] = float((_add_after(o, torch.empty_like(zero))
                                                          != _accumulate(o, torch.empty_like(zero))).float().mean())
        r[f"{m}x{n}x{k}"] = row
        H.log(f"  exactness {m}x{n}x{k}: {row}")
    # an output that is a row slice of a joint tensor at an offset that is not 256-byte aligned
    m, n, k, off = 40, 48, 32, 3
    o = _operands(m, n, k, dev, gen)
    joint = torch.full((off + m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    view = joint[off:]
    r["unaligned_view"] = {"alignment": cublaslt._alignment(view.data_ptr()),
                           **_ulps(_accumulate(o, view), _reference(o)),
                           "rows_before_untouched": bool(joint[:off].isnan().all())}
    # capture: the graph replays on new operand values
    o = _operands(4096, 3072, 3072, dev, gen)
    out = torch.empty((4096, 3072), dtype=torch.bfloat16, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _accumulate(o, out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _accumulate(o, out)
    o2 = _operands(4096, 3072, 3072, dev, gen)
    for key in ("a", "w", "bias", "t", "B"):
        o[key].copy_(o2[key])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    eager = _accumulate(o, torch.empty_like(out))
    r["graph_replay_equal_to_eager"] = bool(torch.equal(out, eager))
    H.log(f"  unaligned view {r['unaligned_view']}, graph replay equal {r['graph_replay_equal_to_eager']}")
    return r


REPS = 10  # the op this many times inside one graph: the replay's launch cost spread out


def _t(fn) -> float:
    """us per op: median replay of a graph holding REPS calls of ``fn``, divided by REPS."""
    def many() -> None:
        for _ in range(REPS):
            fn()
    return H.time_graph(many, warmup=3, reps=20)[0] * 1e3 / REPS


def algorithms(dev: torch.device, gen: torch.Generator) -> dict[str, Any]:
    """Every heuristic candidate of cuBLASLt for the plain and the accumulating FP8 GEMM (fast accumulation)."""
    r: dict[str, Any] = {}
    for m, n, k in SHAPES:
        o = _operands(m, n, k, dev, gen)
        out = torch.zeros((m, n), dtype=torch.bfloat16, device=dev)
        row: dict[str, Any] = {"torch_scaled_mm_fast_us": round(_t(lambda: _base(o, out, True)), 2)}
        for acc in (False, True):
            cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out, fast_accum=True, accumulate=acc)
            cnt = cublaslt.algorithm_count(o["a"], o["w"], o["bias"], out, fast_accum=True, accumulate=acc)
            times = []
            for i in range(cnt):
                times.append(round(_t(lambda i=i: cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out,
                                                                    fast_accum=True, accumulate=acc,
                                                                    algo_index=i)), 2))
            row["accumulate_us" if acc else "plain_us"] = times
        r[f"{m}x{n}x{k}"] = row
        H.log(f"  algorithms {m}x{n}x{k}: {row}")
    return r


def host(dev: torch.device, gen: torch.Generator, calls: int = 3000) -> dict[str, Any]:
    """Host time per call (us) of ``torch._scaled_mm`` and of :func:`cublaslt.scaled_mm`, at a shape whose GPU
    time is below either (128 x 3072 x 3072): ``calls`` calls back to back, one synchronisation at the end."""
    import time  # noqa: PLC0415

    o = _operands(128, 3072, 3072, dev, gen)
    out = torch.empty((128, 3072), dtype=torch.bfloat16, device=dev)
    cases = {
        "torch_scaled_mm_us": lambda: torch._scaled_mm(o["a"], o["w"].t(), scale_a=o["sa"], scale_b=o["sb"],
                                                       bias=o["bias"], out_dtype=torch.bfloat16, use_fast_accum=True),
        "cublaslt_scaled_mm_us": lambda: cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"],
                                                            torch.empty((128, 3072), dtype=torch.bfloat16, device=dev),
                                                            fast_accum=True, accumulate=False),
        "cublaslt_scaled_mm_into_us": lambda: cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out,
                                                                 fast_accum=True, accumulate=False),
        "torch_empty_us": lambda: torch.empty((128, 3072), dtype=torch.bfloat16, device=dev),
    }
    r = {}
    for _ in range(2):  # the second round is kept
        for name, fn in cases.items():
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            r[name] = round((time.perf_counter() - t0) * 1e6 / calls, 2)
    H.log(f"  host: {r}")
    return r


def speed(dev: torch.device, gen: torch.Generator) -> dict[str, Any]:
    r: dict[str, Any] = {}
    for m, n, k in SHAPES:
        o = _operands(m, n, k, dev, gen)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
        row = {}
        for name, fn in (("base", _base), ("add_after", _add_after), ("accumulate", _accumulate)):
            row[f"{name}_us"] = _t(lambda fn=fn: fn(o, out))
            row[f"{name}_fast_us"] = _t(lambda fn=fn: fn(o, out, True))
        lora = torch.empty_like(out)
        row["b_product_only_us"] = _t(lambda: lora.addmm_(o["t"], o["B"].t(), beta=0, alpha=o["s"]))
        row["add_only_us"] = _t(lambda: out.addmm_(o["t"], o["B"].t(), alpha=o["s"]))
        r[f"{m}x{n}x{k}"] = {key: round(v, 2) for key, v in row.items()}
        H.log(f"  speed {m}x{n}x{k}: {r[f'{m}x{n}x{k}']}")
    for m, k, rank in A_SHAPES:
        x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
        a = (torch.randn(rank, k, generator=gen, device=dev) * 0.02).bfloat16()
        at = a.t().contiguous()
        row = {
            "linear_us": _t(lambda: torch.nn.functional.linear(x, a)),
            "mm_At_contiguous_us": _t(lambda: torch.mm(x, at)),
            "transposed_us": _t(lambda: torch.mm(a, x.t()).t()),
        }
        ref = torch.nn.functional.linear(x, a)
        row["mm_At_equal"] = bool(torch.equal(torch.mm(x, at), ref))
        row["transposed_equal"] = bool(torch.equal(torch.mm(a, x.t()).t(), ref))
        r[f"A {m}x{k}x{rank}"] = {key: round(v, 2) if isinstance(v, float) else v for key, v in row.items()}
        H.log(f"  lora_A {m}x{k}x{rank}: {r[f'A {m}x{k}x{rank}']}")
    return r


def _markdown(d: dict[str, Any]) -> str:
    lines = H.md_head("The LoRA branch of a real-FP8 linear, GEMM by GEMM (issue 18)", d,
                      "rank 64, bf16 output, per-tensor e4m3; times: median of 20 replays of a CUDA graph of 10 calls, "
                      "per call (us)")
    sp = d.get("speed") or {}
    rows = [[k] + [v.get(c) for c in ("base_us", "add_after_us", "accumulate_us", "b_product_only_us", "add_only_us",
                                      "base_fast_us", "add_after_fast_us", "accumulate_fast_us")]
            for k, v in sp.items() if not k.startswith("A ")]
    lines += ["", *H.md_table(["M x N x K", "base", "add after", "accumulate", "B product alone", "addmm alone",
                               "base fast", "add after fast", "accumulate fast"], rows, 2)]
    rows = [[k[2:]] + [v.get(c) for c in ("linear_us", "mm_At_contiguous_us", "transposed_us", "mm_At_equal",
                                          "transposed_equal")] for k, v in sp.items() if k.startswith("A ")]
    lines += ["", "lora_A product (us):", "", *H.md_table(["M x K x rank", "F.linear", "x @ A.T stored",
                                                          "(A @ x.T).T", "stored equal", "transposed equal"], rows, 2)]
    ex = d.get("exactness") or {}
    rows = [[k, v["add_after"]["max_ulp"], v["accumulate"]["max_ulp"], v["add_after"]["rel_err"],
             v["accumulate"]["rel_err"], v["accumulate_into_zero_equal_to_scaled_mm"]]
            for k, v in ex.items() if isinstance(v, dict) and "add_after" in v]
    lines += ["", "Against the fp32 expression (ulp of bf16 at each value):", "",
              *H.md_table(["M x N x K", "add after max ulp", "accumulate max ulp", "add after rel", "accumulate rel",
                           "accumulate into 0 == _scaled_mm"], rows, 4)]
    al = d.get("algorithms") or {}
    rows = [[k, v.get("torch_scaled_mm_fast_us"), " ".join(map(str, v.get("plain_us", []))),
             " ".join(map(str, v.get("accumulate_us", [])))] for k, v in al.items()]
    lines += ["", "cuBLASLt's heuristic candidates, fast accumulation (us, in the heuristic's order):", "",
              *H.md_table(["M x N x K", "torch._scaled_mm", "plain (beta 0)", "accumulate (beta 1)"], rows, 2)]
    lines += ["", f"- host time per call (us): `{d.get('host')}`"]
    lines += ["", f"- unaligned joint view: `{ex.get('unaligned_view')}`",
              f"- graph replay equal to eager: {ex.get('graph_replay_equal_to_eager')}"]
    return H.md_document(lines, d)


def main() -> int:
    ap = H.parser(__doc__)
    a = H.finish_args(ap, ap.parse_args(), tiny_prefix="probe_lora_gemm")
    if a.device.type != "cuda":
        H.log("needs CUDA")
        return 3
    b = H.Bench(a)
    res = H.Results(a.out, "lora_gemm_h200", H.head("probe_lora_gemm", b.env, {"rank": RANK}), _markdown)
    gen = torch.Generator(device=a.device).manual_seed(a.seed)
    steps = H.Steps([res], a.budget_s)
    steps("exactness", lambda: res.put("exactness", exactness(a.device, gen)))
    steps("speed", lambda: res.put("speed", speed(a.device, gen)))
    steps("algorithms", lambda: res.put("algorithms", algorithms(a.device, gen)))
    steps("host", lambda: res.put("host", host(a.device, gen)))
    return 1 if steps.failed else 0


if __name__ == "__main__":
    sys.exit(main())
