"""Context and tensor parallelism (diffusers 0.42.1) with the patched model: timing and equality, 2 GPUs.

For each mode, ``cp`` (Ulysses, degree = world size) and ``tp`` (degree = world size), on a random full-size
Qwen-Image transformer (60 blocks, bf16, batch 1, 128 text tokens, no text mask), per resolution (1024^2: 4096 image
tokens, 2048^2: 16384):

- ``single_ms`` / ``single_patched_ms``: one forward on one GPU (rank 0, before ``enable_parallelism``), unpatched /
  patched;
- ``parallel_unpatched_ms`` / ``parallel_patched_ms``: with the parallelism applied, unpatched, then patched with
  ``qwen_absorb.patch`` after ``enable_parallelism``; the slowest rank's time (ranks start each forward together);
- ``bit_identical``: patched parallel == unpatched parallel (``torch.equal``); ``rel_err_vs_single`` (and
  ``rel_err_unpatched_vs_single``): ||parallel - one GPU|| / ||one GPU||, max over the resolutions.

Medians of ``--iters`` (>= 5) forwards after ``--warmup``, a device synchronisation around each. NVLink multicast
stays off: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before NCCL starts. GPU busy (unless
``--no-profile``): one more forward under torch.profiler: ``*_gpu_busy_ms`` (kernels incl. NCCL), ``*_nccl_ms`` (the
NCCL part: it includes a rank's wait for the other), ``*_kernels``; parallel: the rank with the largest GPU busy.

FP8 part (``--dtypes bf16,fp8``; json key ``fp8``): ModelOpt FP8_DEFAULT_CFG, max calibration on one forward at
``--calib-resolution``, ``--fp8-num-layers`` blocks (fewer when ``--budget-s`` would not allow them:
``fp8.num_layers_reason``): ``single`` (fake quant vs patched on rank 0), ``cp`` (the same model, then
``enable_parallelism``), ``tp`` (diffusers cannot tensor-parallelise a quantized model, see
``fp8.tp.quantize_before_parallelism_error``: parallelised first, then quantized; every linear runs as a real FP8 GEMM
on this rank's shards). Each records the patch summary, the real-FP8 linears and the reasons of the others.

Orders (``orders``, bf16, ``--order-check-layers`` blocks, 0 = off): per mode, patch before ``enable_parallelism``,
run; unpatch, run; patch again, run: all bit-identical.

    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py                 # H200 x2: ~4-6 min
    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py --dtypes bf16 --num-layers 8  # quicker look
    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py --tiny          # CPU, gloo: the script logic

Writes ``<out>/parallel.json`` + ``.md`` (default ``benchmarks/results``; ``--tiny``: a temp folder); ``--name``
changes the file name (e.g. ``parallel_check``).
"""

from __future__ import annotations

import os

_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_ENV_BEFORE = {k: os.environ.get(k) for k in _ENV}
os.environ.update(_ENV)  # before torch / NCCL read them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import Counter  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as H  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import qwen_absorb  # noqa: E402

PROFILE_KEYS = ("gpu_busy_ms", "nccl_ms", "kernels")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = H.parser(__doc__, description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="parallel", help="results file name (default parallel)")
    p.add_argument("--num-layers", type=int, default=None, help="blocks (default 60; --tiny: 2)")
    p.add_argument("--resolutions", default=None, help="comma-separated pixels (default 1024,2048; --tiny: 64,128)")
    p.add_argument("--modes", default="cp,tp", help="comma-separated subset of cp,tp")
    p.add_argument("--warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed forwards (default 7, >= 5; --tiny: 3)")
    p.add_argument("--text-len", type=int, default=None, help="text tokens (default 128; --tiny: 8)")
    p.add_argument("--mask", action="store_true", help="pad the text: a mask with 2 masked tokens")
    p.add_argument("--no-single-patched", action="store_true", help="skip the patched one-GPU run")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled forwards (GPU busy stays None)")
    p.add_argument("--dtypes", default="bf16,fp8", help="comma-separated subset of bf16,fp8")
    p.add_argument("--fp8-num-layers", type=int, default=None, help="FP8 part: blocks (default 60; --tiny: 2)")
    p.add_argument("--fp8-resolutions", default=None, help="FP8 part: pixels (default 1024; --tiny: 64)")
    p.add_argument("--fp8-warmup", type=int, default=1)
    p.add_argument("--fp8-iters", type=int, default=None, help="FP8 part: default 5 (>= 5; --tiny: 2)")
    p.add_argument("--calib-resolution", type=int, default=None, help="FP8 calibration pixels (default 512)")
    p.add_argument("--order-check-layers", type=int, default=None, help="blocks of the order check (default 4; 0: off)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or world < 2:
        p.error("launch with torchrun --nproc_per_node=2 (one process per GPU)")
    t, unit = a.tiny, 8 if a.tiny else 16
    a.modes, a.dtypes = [m for m in a.modes.split(",") if m], [d for d in a.dtypes.split(",") if d]
    if not a.modes or set(a.modes) - {"cp", "tp"} or not a.dtypes or set(a.dtypes) - {"bf16", "fp8"}:
        p.error("--modes: a subset of cp,tp; --dtypes: a subset of bf16,fp8")
    try:
        a.resolutions = [int(r) for r in (a.resolutions or ("64,128" if t else "1024,2048")).split(",") if r]
        a.fp8_resolutions = [int(r) for r in (a.fp8_resolutions or ("64" if t else "1024")).split(",") if r]
    except ValueError:
        p.error("--resolutions / --fp8-resolutions: comma-separated integers")
    a.calib_resolution = a.calib_resolution or (32 if t else 512)
    if any(r < unit or r % unit for r in a.resolutions + a.fp8_resolutions + [a.calib_resolution]):
        p.error(f"resolutions must be positive multiples of {unit}")
    a.num_layers = a.num_layers or (2 if t else 60)
    a.fp8_num_layers = a.fp8_num_layers or (2 if t else 60)
    a.warmup = a.warmup if a.warmup is not None else (1 if t else 2)
    a.iters = a.iters or (3 if t else 7)
    a.fp8_iters = a.fp8_iters or (2 if t else 5)
    a.text_len = a.text_len or (8 if t else 128)
    a.order_check_layers = a.order_check_layers if a.order_check_layers is not None else (2 if t else 4)
    if not t and min(a.iters, a.fp8_iters) < 5:
        p.error("--iters / --fp8-iters must be >= 5 (>= 1 with --tiny)")
    if "tp" in a.modes and (2 if t else 24) % world:
        p.error(f"tp: the world size {world} must divide the heads")
    if "cp" in a.modes and (any(((r // unit) ** 2) % world for r in a.resolutions) or a.text_len % world):
        p.error(f"cp: image tokens and --text-len must be divisible by the world size {world}")
    if not t and torch.cuda.is_available() and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE",
                                                                                              world)):
        p.error(f"{world} processes but {torch.cuda.device_count()} GPUs on this node")
    a.device = None if t else "cuda"
    return H.finish_args(p, a, tiny_prefix="parallel")


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if a.tiny:
            self.dev, self.dtype = torch.device("cpu"), torch.float32
            torch.set_num_threads(1)
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        else:
            self.dev, self.dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank))), torch.bfloat16
            torch.cuda.set_device(self.dev)
            dist.init_process_group("nccl", device_id=self.dev, timeout=datetime.timedelta(minutes=10))
        self.profile_skipped: list[str] = []
        self.profile_cost: list[tuple[float, int]] = []
        if not a.no_profile:
            H.start_profiler(self.dev)

    def say(self, msg: str) -> None:
        if self.rank == 0:
            H.log(msg)

    def model(self, n: int | None = None) -> torch.nn.Module:
        H.memory_gib(self.dev)
        m = H.build_transformer(self.a.tiny, n or self.a.num_layers, self.dev, self.dtype, self.a.seed)
        ps = list(m.parameters())
        s = torch.stack([p.detach().float().sum() for p in ps[:: max(1, len(ps) // 64)]])
        if not self.agree(s):  # CP needs the same weights on every rank (TP broadcasts rank 0's)
            for p in ps:
                dist.broadcast(p.data, 0)
        return m

    def inputs(self, m: torch.nn.Module, res: int) -> dict[str, Any]:
        from qwen_absorb import testing as T  # noqa: PLC0415

        side = res // (8 if self.a.tiny else 16)
        return T.transformer_inputs(m, height=side, width=side, text_len=self.a.text_len,
                                    masked_tail=2 if self.a.mask else 0, seed=self.a.seed, device=self.dev,
                                    dtype=self.dtype)

    def forward(self, m: torch.nn.Module, kw: dict[str, Any]) -> torch.Tensor:
        from qwen_absorb.parallel import local_view  # noqa: PLC0415

        with torch.inference_mode():
            out = m(**kw)[0]
        v, why = local_view(out)  # CP's all-gathered output is an AsyncCollectiveTensor: wait for it
        if v is None:
            raise RuntimeError(f"model output is not a full local tensor: {why}")
        return v

    def agree(self, t: torch.Tensor) -> bool:
        g = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(g, t.contiguous())
        return all(torch.equal(x, g[0]) for x in g)

    def timed(self, m: torch.nn.Module, kw: dict[str, Any], parallel: bool, fp8: bool = False):
        """(median ms: this rank's, or the slowest rank's when ``parallel``; the last output)."""
        a = self.a
        out = None
        for _ in range(a.fp8_warmup if fp8 else a.warmup):
            out = self.forward(m, kw)
        times = []
        for _ in range(a.fp8_iters if fp8 else a.iters):
            if parallel:
                dist.barrier()
            H.sync(self.dev)
            t0 = time.perf_counter()
            out = self.forward(m, kw)
            H.sync(self.dev)
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        if parallel:
            t = torch.tensor(ms, dtype=torch.float64, device=self.dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            ms = float(t)
        return ms, out.detach().clone()

    def profiled(self, m: torch.nn.Module, kw: dict[str, Any], parallel: bool, prefix: str) -> dict[str, Any]:
        keys = [f"{prefix}_{k}" for k in PROFILE_KEYS]
        if self.a.no_profile:
            return dict.fromkeys(keys)
        if parallel:
            dist.barrier()
        t0 = time.monotonic()
        p, why = H.profile_call(lambda: self.forward(m, kw), self.dev, cpu_activity=True)
        self.profile_cost.append((time.monotonic() - t0, len(m.transformer_blocks)))
        vals = (p["gpu_busy_ms"], p["nccl_ms"], p["kernels_per_call"]) if p else None
        if parallel:  # the rank with the largest GPU busy
            t = torch.tensor([*vals, 1.0] if vals else [0.0] * 4, dtype=torch.float64, device=self.dev)
            g = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(g, t)
            rows = [x.tolist() for x in g]
            vals = tuple(max(rows, key=lambda r: r[0])[:3]) if all(r[3] for r in rows) else None
            why = why or (None if vals else "not measured on every rank")
        if why and why not in self.profile_skipped:
            self.profile_skipped.append(why)
        return dict.fromkeys(keys) if vals is None else dict(zip(keys, (round(vals[0], 3), round(vals[1], 3),
                                                                          int(vals[2]))))

    def config(self, mode: str) -> Any:
        from diffusers import ContextParallelConfig, TensorParallelConfig  # noqa: PLC0415

        return TensorParallelConfig(tp_degree=self.world) if mode == "tp" else ContextParallelConfig(
            ulysses_degree=self.world)

    # ------------------------------------------------------------------ bf16
    def single(self) -> dict[int, dict[str, Any]]:
        res_out: dict[int, dict[str, Any]] = {}
        m = self.model()
        if self.rank == 0:
            for res in self.a.resolutions:
                kw = self.inputs(m, res)
                ms, out = self.timed(m, kw, False)
                r = {"single_ms": ms, **self.profiled(m, kw, False, "single"), "out": out.cpu()}
                if not self.a.no_single_patched:
                    qwen_absorb.patch(m)
                    r["single_patched_ms"], outp = self.timed(m, kw, False)
                    r.update(self.profiled(m, kw, False, "single_patched"))
                    r["single_patched_bit_identical"] = bool(torch.equal(outp.cpu(), r["out"]))
                    qwen_absorb.unpatch(m)
                res_out[res] = r
                self.say(f"single {res}: {ms:.1f} ms, patched {r.get('single_patched_ms')}")
        del m
        dist.barrier()
        return res_out

    def parallel(self, mode: str, m: torch.nn.Module, single: dict[int, dict[str, Any]], r: dict[str, Any],
                 resolutions: list[int], write: Any, fp8: bool = False) -> None:
        """Unpatched vs patched on ``m`` (parallelism applied) at each resolution, into ``r``."""
        outs = {}
        rows = r.setdefault("resolutions", {})
        for res in resolutions:
            kw = self.inputs(m, res)
            ms, outs[res] = self.timed(m, kw, True, fp8)
            s = single.get(res, {})
            rows[str(res)] = {**{f"{b}_{k}": s.get(f"{b}_{k}") for b in ("single", "single_patched")
                                 for k in ("ms", *PROFILE_KEYS)},
                              "parallel_unpatched_ms": ms, **self.profiled(m, kw, True, "parallel_unpatched"),
                              "ranks_agree_unpatched": self.agree(outs[res])}
            self.say(f"{'fp8 ' if fp8 else ''}{mode} {res}: unpatched {ms:.1f} ms")
        r["status"] = "patched run in progress (a crash here leaves this status)"
        write()
        report = qwen_absorb.patch(m)
        for res in resolutions:
            kw, row, s = self.inputs(m, res), rows[str(res)], single.get(res, {})
            ms, out = self.timed(m, kw, True, fp8)
            row.update(parallel_patched_ms=ms, **self.profiled(m, kw, True, "parallel_patched"),
                       ranks_agree_patched=self.agree(out), bit_identical=bool(torch.equal(out, outs[res])),
                       rel_err=H.rel_err(out, outs[res]),
                       max_abs_patched_vs_unpatched=float((out.float() - outs[res].float()).abs().max()))
            if "out" in s:
                row["rel_err_vs_single"] = H.rel_err(out, s["out"].to(self.dev))
                row["rel_err_unpatched_vs_single"] = H.rel_err(outs[res], s["out"].to(self.dev))
            if "out_patched" in s:
                row["rel_err_vs_single_patched"] = H.rel_err(out, s["out_patched"].to(self.dev))
            self.say(f"{'fp8 ' if fp8 else ''}{mode} {res}: patched {ms:.1f} ms, bit-identical {row['bit_identical']}")
        vals = list(rows.values())
        r["bit_identical"] = all(x["bit_identical"] for x in vals)
        r["rel_err"] = max(x["rel_err"] for x in vals)
        for k in ("rel_err_vs_single", "rel_err_unpatched_vs_single", "rel_err_vs_single_patched"):
            if all(k in x for x in vals):
                r[k] = max(x[k] for x in vals)
        r.update(fp8_report(report))
        r["status"] = "done"
        write()

    def mode(self, mode: str, single: dict[int, dict[str, Any]], r: dict[str, Any], write: Any) -> None:
        m = self.model()
        m.enable_parallelism(config=self.config(mode))
        r["config"] = f"{type(self.config(mode)).__name__}(degree={self.world})"
        self.parallel(mode, m, single, r, self.a.resolutions, write)
        del m
        dist.barrier()

    def orders(self, o: dict[str, Any], write: Any) -> int:
        L, res, rc = self.a.order_check_layers, self.a.resolutions[0], 0
        o.update(num_layers=L, resolution=res, sequence="patch, enable_parallelism, run; unpatch, run; patch, run")
        for mode in self.a.modes:
            r = o[mode] = {"status": "running"}
            write()
            try:
                m = self.model(L)
                kw = self.inputs(m, res)
                qwen_absorb.patch(m)
                m.enable_parallelism(config=self.config(mode))
                a_ = self.forward(m, kw).clone()
                qwen_absorb.unpatch(m)
                b_ = self.forward(m, kw).clone()
                report = qwen_absorb.patch(m)
                c_ = self.forward(m, kw).clone()
                r.update(patched_before_eq_unpatched=bool(torch.equal(a_, b_)),
                         patched_after_eq_unpatched=bool(torch.equal(c_, b_)), ranks_agree=self.agree(c_),
                         biases_deferred=report.summary["biases_deferred"], runtime_fallbacks=H.fallbacks(report))
                r.update(bit_identical=r["patched_before_eq_unpatched"] and r["patched_after_eq_unpatched"],
                         status="done")
                del m
            except Exception as e:  # noqa: BLE001
                rc, r["status"], r["error"] = 1, "failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            self.say(f"orders {mode}: {r['status']}, bit-identical {r.get('bit_identical')}")
            write()
            dist.barrier()
        return rc

    # ------------------------------------------------------------------ FP8
    def quantize(self, m: torch.nn.Module) -> float:
        return H.fp8_quantize(m, self.inputs(m, self.a.calib_resolution))

    def fp8_single(self, m: torch.nn.Module, r: dict[str, Any], write: Any) -> dict[int, dict[str, Any]]:
        single: dict[int, dict[str, Any]] = {}
        rows = r.setdefault("resolutions", {})
        if self.rank == 0:
            for res in self.a.fp8_resolutions:
                kw = self.inputs(m, res)
                ms, out = self.timed(m, kw, False, True)
                rows[str(res)] = {"single_ms": ms, **self.profiled(m, kw, False, "single")}
                single[res] = {**rows[str(res)], "out": out.cpu()}
                write()
            report = qwen_absorb.patch(m)
            try:
                for res in self.a.fp8_resolutions:
                    kw, row = self.inputs(m, res), rows[str(res)]
                    ms, out = self.timed(m, kw, False, True)
                    ref = single[res]["out"].to(self.dev)
                    prof = self.profiled(m, kw, False, "single_patched")
                    row.update(single_patched_ms=ms, **prof, rel_err=H.rel_err(out, ref),
                               bit_identical=bool(torch.equal(out, ref)))
                    single[res].update(single_patched_ms=ms, **prof, out_patched=out.cpu())
                    self.say(f"fp8 single {res}: fake quant {single[res]['single_ms']:.1f} ms, patched {ms:.1f} ms")
                r.update(fp8_report(report))
            finally:
                qwen_absorb.unpatch(m)
            r["rel_err"] = max(x["rel_err"] for x in rows.values())
        r["status"] = "done"
        write()
        return single

    def tp_quantize_before_probe(self) -> str | None:
        """A 1-block model quantized, then tensor-parallelised: the exception text, or None if it works."""
        m = H.build_transformer(True, 1, self.dev, self.dtype, self.a.seed)
        self.quantize_tiny(m)
        try:
            m.enable_parallelism(config=self.config("tp"))
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        del m
        dist.barrier()
        return err

    def quantize_tiny(self, m: torch.nn.Module) -> None:
        from qwen_absorb import testing as T  # noqa: PLC0415

        H.fp8_quantize(m, T.transformer_inputs(m, height=4, width=4, text_len=8, masked_tail=0, device=self.dev,
                                               dtype=self.dtype))

    def fp8(self, fp: dict[str, Any], write: Any) -> int:
        rc, L = 0, fp["num_layers"]

        def failed(where: str, r: dict[str, Any], e: Exception) -> None:
            nonlocal rc
            rc, r["status"] = 1, f"failed in {where}"
            r["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            self.say(f"fp8 {where} failed: {type(e).__name__}: {e}")
            write()
            dist.barrier()

        single: dict[int, dict[str, Any]] = {}
        m = None
        try:
            t0 = time.perf_counter()
            m = self.model(L)
            fp["build_s"] = round(time.perf_counter() - t0, 1)
            fp["calibration_s"] = self.quantize(m)
            amax = [q.amax.detach().float().reshape(-1)[:1] for n, q in m.named_modules()
                    if n.endswith("_quantizer") and getattr(q, "amax", None) is not None]
            fp["amax_agree_between_ranks"] = not amax or self.agree(torch.cat(amax).to(self.dev))
            single = self.fp8_single(m, fp.setdefault("single", {"status": "running"}), write)
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            failed("single", fp.setdefault("single", {}), e)
        if "cp" in self.a.modes and m is not None:
            cp = fp["cp"] = {"config": f"ContextParallelConfig(degree={self.world})",
                             "order": "quantize + calibrate, enable_parallelism, patch"}
            try:
                m.enable_parallelism(config=self.config("cp"))
                self.parallel("cp", m, single, cp, self.a.fp8_resolutions, write, fp8=True)
            except Exception as e:  # noqa: BLE001
                failed("cp", cp, e)
        del m
        dist.barrier()
        if "tp" in self.a.modes:
            tp = fp["tp"] = {"config": f"TensorParallelConfig(degree={self.world})"}
            try:
                tp["quantize_before_parallelism_error"] = err = self.tp_quantize_before_probe()
                m = self.model(L)
                if err is None:
                    tp["order"] = "quantize + calibrate, enable_parallelism, patch"
                    self.quantize(m)
                    m.enable_parallelism(config=self.config("tp"))
                else:
                    tp["order"] = ("enable_parallelism, quantize + calibrate (ModelOpt quantizes the rank-local "
                                   "shards), patch: quantizing first fails in diffusers' parallelize_module")
                    m.enable_parallelism(config=self.config("tp"))
                    tp["calibration_s"] = self.quantize(m)
                self.parallel("tp", m, single, tp, self.a.fp8_resolutions, write, fp8=True)
                del m
            except Exception as e:  # noqa: BLE001
                failed("tp", tp, e)
            dist.barrier()
        return rc


def fp8_report(report: Any) -> dict[str, Any]:
    """Patch summary, runtime fallbacks, real-FP8 linears by path and the not-real-FP8 reasons (counts over blocks)."""
    real, why = Counter(), Counter()
    for b in report.blocks:
        for lp in b.linears.values():
            if lp.fp8_gemm:
                real[lp.path] += 1
            for r in () if lp.fp8_gemm else lp.fp8_reasons or ():
                if r != "not ModelOpt-quantized":
                    why[f"{lp.path}: {r}"] += 1
    return {"patch_summary": H.summary(report), "fp8_gemm_linears": report.summary.get("fp8_gemm_linears"),
            "fp8_gemm_paths": dict(real), "fp8_reasons": dict(why), "runtime_fallbacks": H.fallbacks(report)}


def fp8_layers(a: argparse.Namespace, data: dict[str, Any], cost: list[tuple[float, int]]) -> tuple[int, str]:
    """FP8 blocks that fit the time left of ``--budget-s``: per block ~90 bf16-forward equivalents at the measured
    one-GPU bf16 time per block (3 ms if not measured) + 0.8 s of build / quantize / patch + the profiled forwards."""
    if not a.budget_s:
        return a.fp8_num_layers, "as requested (no --budget-s)"
    left = a.budget_s - (time.perf_counter() - H.T0)
    row = (data.get("cp") or data.get("tp") or {}).get("resolutions", {}).get(str(a.fp8_resolutions[0])) or {}
    per_fwd = row["single_ms"] / 1e3 / a.num_layers if row.get("single_ms") else 0.003
    per_block = (a.fp8_warmup + a.fp8_iters) / 6 * 15 * len(a.fp8_resolutions) * per_fwd * (
        a.fp8_resolutions[0] / 1024) ** 2 + 0.8
    if not a.no_profile:
        c = [s / n for s, n in cost if n]
        per_block += (2 * statistics.fmean(c) if c else 0.03) * (2 + 2 * len(a.modes)) * len(a.fp8_resolutions)
    n = min(a.fp8_num_layers, int(left / per_block))
    why = f"{left:.0f} s left of --budget-s {a.budget_s:.0f}, estimated {per_block:.2f} s per block"
    return n, ("as requested; " + why) if n == a.fp8_num_layers else f"reduced from {a.fp8_num_layers}: {why}"


def markdown(d: dict[str, Any]) -> str:
    c = d.get("config") or {}
    lines = H.md_head(f"Context / tensor parallelism with qwen_absorb ({d.get('world_size')} ranks)", d,
                      f"{c.get('model')}; batch 1, {c.get('text_len')} text tokens, mask {c.get('mask')}; medians of "
                      f"{c.get('iters')} forwards after {c.get('warmup')} warm-up; parallel: the slowest rank; in "
                      "brackets GPU busy ms (torch.profiler, NCCL included; the rank with the largest)")
    env = d.get("environment") or {}
    lines.append(f"- NCCL {env.get('nccl')}, {env.get('nccl_env')}")

    def wb(x: dict[str, Any], p: str) -> str:
        b = x.get(f"{p}_gpu_busy_ms")
        return H.fmt(x.get(f"{p}_ms"), 1) + ("" if b is None else f" ({H.fmt(b, 1)})")

    def table(r: dict[str, Any]) -> list[str]:
        rows = [[f"{res}^2", *(wb(x, p) for p in ("single", "single_patched", "parallel_unpatched",
                                                   "parallel_patched")),
                 f"{H.fmt(x.get('parallel_unpatched_nccl_ms'), 1)} / {H.fmt(x.get('parallel_patched_nccl_ms'), 1)}",
                 f"{H.fmt(H.ratio(x.get('parallel_unpatched_ms'), x.get('parallel_patched_ms')))}x",
                 str(x.get("bit_identical")), x.get("rel_err"), x.get("rel_err_vs_single")]
                for res, x in (r.get("resolutions") or {}).items()]
        return H.md_table(["resolution", "1 GPU ms", "1 GPU patched ms", "parallel ms", "parallel patched ms",
                           "NCCL ms unp. / patched", "patched speed-up", "bit-identical", "rel err patched vs unp.",
                           "rel err vs 1 GPU"], rows)

    for mode in ("cp", "tp"):
        r = d.get(mode)
        if r:
            lines += ["", f"## {mode}: {r.get('config', '')} ({r.get('status')})", "", *table(r),
                      "", f"runtime fallbacks: {r.get('runtime_fallbacks') or 'none'}"]
            lines += ["```", r["error"][-2000:], "```"] if "error" in r else []
    fp = d.get("fp8") or {}
    if fp:
        lines += ["", "## ModelOpt FP8", "", f"{fp.get('model')}; blocks: {fp.get('num_layers_reason')}; status "
                                             f"{fp.get('status')}; amax equal on all ranks: "
                                             f"{fp.get('amax_agree_between_ranks')}"]
        for name in ("single", "cp", "tp"):
            r = fp.get(name)
            if r:
                lines += ["", f"### {name}: {r.get('config', 'one GPU, rank 0')}; {r.get('order', '')} "
                              f"({r.get('status')}); real FP8 linears {r.get('fp8_gemm_linears')}", "", *table(r)]
                why = Counter()
                for k, n in (r.get("fp8_reasons") or {}).items():
                    why[k.split(": ", 1)[-1]] += n
                if why:
                    lines.append("- not real FP8 (linear-blocks per reason): "
                                 + "; ".join(f"{k} ({n})" for k, n in why.most_common()))
                if r.get("quantize_before_parallelism_error"):
                    lines.append(f"- quantize before enable_parallelism: `{r['quantize_before_parallelism_error']}`")
                lines += ["```", r["error"][-2000:], "```"] if "error" in r else []
    o = d.get("orders") or {}
    if o:
        lines += ["", f"## Call orders ({o.get('num_layers')} blocks at {o.get('resolution')}^2: {o.get('sequence')})"]
        lines += [f"- {m}: bit_identical **{o[m].get('bit_identical')}** ({o[m].get('status')})" for m in ("cp", "tp")
                  if isinstance(o.get(m), dict)]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    b = Bench(a)
    from qwen_absorb.parallel import allow_cpu_parallelism  # noqa: PLC0415

    env = H.environment(b.dev)
    env.update(world_size=b.world, nccl_env={k: os.environ.get(k) for k in _ENV},
               env_overridden={k: v for k, v in _ENV_BEFORE.items() if v is not None and v != _ENV[k]},
               nccl=".".join(map(str, torch.cuda.nccl.version())) if b.dev.type == "cuda" else None)
    cfg = {"model": f"{'tiny' if a.tiny else 'full-size random'} transformer, {a.num_layers} blocks, "
                    f"{str(b.dtype)[6:]}", **{k: v for k, v in vars(a).items() if k not in ("device", "out")}}
    R = H.Results(a.out, a.name, {**H.head("benchmarks/parallel_bench.py", env, cfg), "world_size": b.world,
                                  "env": env}, markdown)
    R.d["config"]["profile_skipped"] = b.profile_skipped

    def write() -> None:
        if b.rank == 0:
            R.write()

    b.say(f"parallel_bench: {cfg['model']}, world {b.world}, modes {a.modes}, resolutions {a.resolutions}")
    rc, broken = 0, None
    with allow_cpu_parallelism() if a.tiny else contextlib.nullcontext():
        if "bf16" in a.dtypes:
            single = b.single()
            for mode in a.modes:
                r = R.d[mode] = {"status": "running"}
                t0 = time.perf_counter()
                try:
                    b.mode(mode, single, r, write)
                    r["wall_s"] = round(time.perf_counter() - t0, 1)
                except Exception as e:  # noqa: BLE001 (recorded; a CUDA fault usually kills the process instead)
                    r.update(status="failed", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}")
                    rc, broken = 1, f"the bf16 {mode} run failed (the ranks may be out of step)"
                    break
                write()
            del single
        if a.order_check_layers:
            if broken:
                R.d["orders"] = {"status": f"skipped: {broken}"}
            else:
                rc |= b.orders(R.d.setdefault("orders", {}), write)
        if "fp8" in a.dtypes:
            if broken:
                R.d["fp8"] = {"status": f"skipped: {broken}"}
            else:
                H.load_modelopt()
                if b.dev.type == "cuda":  # build / load ModelOpt's FP8 extension, rank 0 first, outside the timings
                    for r in range(b.world):
                        if b.rank == r:
                            b.quantize_tiny(H.build_transformer(True, 1, b.dev, b.dtype))
                        dist.barrier()
                nw = list(fp8_layers(a, R.d, b.profile_cost))
                dist.broadcast_object_list(nw, src=0)  # rank 0's estimate for every rank
                fp = R.d["fp8"] = {"num_layers": nw[0], "num_layers_requested": a.fp8_num_layers,
                                   "num_layers_reason": nw[1], "resolutions": a.fp8_resolutions,
                                   "model": f"{nw[0]} blocks, ModelOpt FP8_DEFAULT_CFG, max calibration on one forward "
                                            f"at {a.calib_resolution}^2"}
                if nw[0] < 1:
                    fp["status"] = "skipped: no time left in --budget-s"
                else:
                    rc |= b.fp8(fp, write)
                    fp["status"] = "done" if not any("error" in (fp.get(k) or {}) for k in ("single", "cp", "tp")) \
                        else "done with failures"
        write()
    b.say(f"wrote {R.json} and {R.md.name}")
    with contextlib.suppress(Exception):
        dist.barrier()
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
