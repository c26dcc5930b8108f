"""Context and tensor parallelism (diffusers 0.42.1) with the patched model: timing and equality, 2 GPUs.

For each mode, ``cp`` (Ulysses, degree = world size) and ``tp`` (degree = world size), on a random
full-size Qwen-Image transformer (60 blocks, bf16, batch 1, 128 text tokens, no text mask) and for
each resolution (1024^2: 4096 image tokens, 2048^2: 16384):

- ``single_ms``: one forward on one GPU (rank 0, the model before ``enable_parallelism``), unpatched
  (``single_patched_ms``: the same, patched);
- ``parallel_unpatched_ms`` / ``parallel_patched_ms``: one forward with the parallelism applied,
  unpatched, then patched with ``qwen_absorb.patch`` (default arguments: bf16, so no bias deferred)
  after ``enable_parallelism``; the time of the slowest rank (ranks start each forward together);
- ``bit_identical``: patched parallel output == unpatched parallel output (``torch.equal``, every
  resolution); ``rel_err_vs_single``: ||patched parallel - one GPU|| / ||one GPU|| (max over the
  resolutions; ``rel_err_unpatched_vs_single`` the same for unpatched parallel).

Medians of ``--iters`` (>= 5) forwards after ``--warmup``. CUDA time is taken with a device
synchronisation around each forward. NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are enforced before NCCL starts.

GPU busy (beside every ``*_ms``, unless ``--no-profile``): after the timed forwards of a configuration, one
more forward under ``torch.profiler`` (CPU + CUDA activity; ranks start it together): ``*_gpu_busy_ms`` =
the sum of the device durations of its kernels (NCCL kernels included, memcpy/memset not), ``*_nccl_ms``
= the part of it in kernels whose name contains "nccl", ``*_kernels`` = the number of kernels; on each
rank its own GPU, reported for the rank with the largest GPU busy (parallel runs). Wall far above GPU
busy: the host is the bottleneck. An NCCL kernel also counts the time its rank waits in it for the
other rank, so the compute part of GPU busy is ``gpu_busy - nccl``. ``None`` off CUDA (``--tiny``).
The profiler (CUPTI) is started once before the first timed forward, so every timing runs in the same
profiler state.

TP patched runs last among the bf16 runs: if the patched block hands a raw kernel an
AsyncCollectiveTensor (issue 12), the CUDA context dies; the results file (written after every
step) then says which run was in progress.

FP8 part (``--dtypes bf16,fp8``, the default; json key ``fp8``): a ModelOpt FP8 per-tensor model
(``mtq.FP8_DEFAULT_CFG``: e4m3 W8A8, max calibration on one forward at ``--calib-resolution``),
``--fp8-num-layers`` blocks (default 60; fewer when ``--time-budget-s`` would not allow them, said
in ``fp8.num_layers_reason``), at ``--fp8-resolutions`` (default 1024):

- ``single``: rank 0, one GPU: ModelOpt fake quant (unpatched) and patched (``fp8_gemm="auto"``: real
  FP8 GEMMs where a linear qualifies); ``rel_err`` patched vs unpatched;
- ``cp``: the same model (unpatched again), then ``enable_parallelism`` (Ulysses): unpatched vs
  patched parallel, ``rel_err`` (real FP8 vs fake quant is never bit-identical: on 60 random blocks
  it is ~0.06 on one GPU too, fp8_gemm.json ``real_vs_fake_rel_diff_forward``);
- ``tp``: diffusers 0.42.1 cannot tensor-parallelise a ModelOpt-quantized model (a 1-block probe
  records the exception in ``fp8.tp.quantize_before_parallelism_error``), so the TP model is
  parallelised first and then quantized and calibrated (ModelOpt calibrates the DTensor weights'
  amax over the whole tensor, equal on every rank: ``amax_agree``); patched, every linear runs as a
  real FP8 GEMM on this rank's shards (qwen_absorb.projection: row-wise outputs sum all-reduced,
  no DTensor); ``rel_err_unpatched_vs_single`` > 0 is TP's own reduction order.

Each records the patch summary (``fp8_gemm_linears``: linears run as real FP8 GEMMs), the
not-real-FP8 reasons and, instead of dying, the exception text of a failed step.

Orders (``orders``, bf16, ``--order-check-layers``, default 4 blocks, 0 = off; runs after the bf16
timings and before the FP8 part): per mode, patch *before* ``enable_parallelism``, run; unpatch,
run; patch again, run: all bit-identical to each other.

    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py                 # H200 x2: ~4-6 min
    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py --dtypes bf16 --num-layers 8  # quicker look
    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py --tiny --out /tmp/pb   # CPU, gloo: the script logic

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/parallel``; with ``--tiny`` the
default is in the temp folder, never benchmarks/results). ``--out`` naming an existing folder
writes ``parallel.json`` / ``parallel.md`` into it.
"""

from __future__ import annotations

import os

_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_ENV_BEFORE = {k: os.environ.get(k) for k in _ENV}
_T_START = __import__("time").monotonic()  # the --time-budget-s clock starts before torch is imported
os.environ.update(_ENV)  # before torch / NCCL read them

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime as _dt  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import kernel_events  # noqa: E402  (benchmarks/kernel_events.py)

FULL_HEADS = 24
TEXT_LEN = 128
PROFILE_KEYS = ("gpu_busy_ms", "nccl_ms", "kernels")  # suffixes of the profiled forward's keys: single_gpu_busy_ms ...
PROFILE_S_PER_BLOCK = 0.03  # profiled forward + event parsing, s per block, until measured (budget estimate)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU (gloo), 2-block tiny model: checks the script in seconds")
    p.add_argument("--num-layers", type=int, default=None, help="blocks (default 60; --tiny: 2)")
    p.add_argument("--resolutions", default=None, help="comma-separated pixels (default 1024,2048; --tiny: 64,128)")
    p.add_argument("--modes", default="cp,tp", help="comma-separated subset of cp,tp (default both)")
    p.add_argument("--warmup", type=int, default=None, help="default 2 (--tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="timed forwards, median (default 7, >= 5; --tiny: 3)")
    p.add_argument("--text-len", type=int, default=None, help=f"text tokens (default {TEXT_LEN}; --tiny: 8)")
    p.add_argument("--mask", action="store_true", help="pad the text: pass a mask with 2 masked tokens")
    p.add_argument("--no-single-patched", action="store_true", help="skip the patched one-GPU run")
    p.add_argument("--no-profile", action="store_true",
                   help="skip the profiled forwards (the *_gpu_busy_ms / *_nccl_ms / *_kernels keys stay None)")
    p.add_argument("--dtypes", default="bf16,fp8", help="comma-separated subset of bf16,fp8 (default both)")
    p.add_argument("--fp8-num-layers", type=int, default=None, help="FP8 part: blocks (default 60; --tiny: 2)")
    p.add_argument("--fp8-resolutions", default=None, help="FP8 part: pixels (default 1024; --tiny: 64)")
    p.add_argument("--fp8-warmup", type=int, default=None, help="FP8 part: default 1")
    p.add_argument("--fp8-iters", type=int, default=None, help="FP8 part: default 5 (>= 5; --tiny: 2)")
    p.add_argument("--calib-resolution", type=int, default=None,
                   help="FP8 part: pixels of the one calibration forward (default 512; --tiny: 32)")
    p.add_argument("--order-check-layers", type=int, default=None,
                   help="blocks of the patch-order check (default 4; --tiny: 2; 0: skip)")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="wall-clock budget: the FP8 part gets fewer blocks (or is skipped) to end inside it")
    p.add_argument("--out", default=None, help="output path prefix or existing folder (see above)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or world < 2:
        p.error("launch with torchrun --nproc_per_node=2 (one process per GPU)")
    a.modes = [m for m in a.modes.split(",") if m]
    if not a.modes or any(m not in ("cp", "tp") for m in a.modes):
        p.error("--modes: a comma-separated subset of cp,tp")
    a.num_layers = a.num_layers if a.num_layers is not None else (2 if a.tiny else 60)
    if not 1 <= a.num_layers <= 60:
        p.error("--num-layers must be in 1..60")
    try:
        a.resolutions = [int(r) for r in (a.resolutions or ("64,128" if a.tiny else "1024,2048")).split(",") if r]
    except ValueError:
        p.error("--resolutions: comma-separated integers")
    unit = 8 if a.tiny else 16  # pixels per image token (VAE x patch)
    if not a.resolutions or any(r < unit or r % unit for r in a.resolutions):
        p.error(f"--resolutions must be positive multiples of {unit}")
    a.warmup = a.warmup if a.warmup is not None else (1 if a.tiny else 2)
    a.iters = a.iters if a.iters is not None else (3 if a.tiny else 7)
    a.text_len = a.text_len or (8 if a.tiny else TEXT_LEN)
    if a.warmup < 0 or a.iters < 1 or (not a.tiny and a.iters < 5):
        p.error("--iters must be >= 5 (>= 1 with --tiny), --warmup >= 0")
    a.dtypes = [d for d in a.dtypes.split(",") if d]
    if not a.dtypes or any(d not in ("bf16", "fp8") for d in a.dtypes):
        p.error("--dtypes: a comma-separated subset of bf16,fp8")
    a.fp8_num_layers = a.fp8_num_layers if a.fp8_num_layers is not None else (2 if a.tiny else 60)
    if not 1 <= a.fp8_num_layers <= 60:
        p.error("--fp8-num-layers must be in 1..60")
    try:
        a.fp8_resolutions = [int(r) for r in (a.fp8_resolutions or ("64" if a.tiny else "1024")).split(",") if r]
    except ValueError:
        p.error("--fp8-resolutions: comma-separated integers")
    a.calib_resolution = a.calib_resolution or (32 if a.tiny else 512)
    if not a.fp8_resolutions or any(r < unit or r % unit for r in a.fp8_resolutions + [a.calib_resolution]):
        p.error(f"--fp8-resolutions / --calib-resolution must be positive multiples of {unit}")
    a.fp8_warmup = a.fp8_warmup if a.fp8_warmup is not None else 1
    a.fp8_iters = a.fp8_iters if a.fp8_iters is not None else (2 if a.tiny else 5)
    if a.fp8_warmup < 0 or a.fp8_iters < 1 or (not a.tiny and a.fp8_iters < 5):
        p.error("--fp8-iters must be >= 5 (>= 1 with --tiny), --fp8-warmup >= 0")
    a.order_check_layers = a.order_check_layers if a.order_check_layers is not None else (2 if a.tiny else 4)
    if not 0 <= a.order_check_layers <= 60:
        p.error("--order-check-layers must be in 0..60")
    heads = 2 if a.tiny else FULL_HEADS
    if "tp" in a.modes and heads % world:
        p.error(f"tp: the world size {world} must divide the {heads} heads")
    if "cp" in a.modes:
        bad = [r for r in a.resolutions + (a.fp8_resolutions if "fp8" in a.dtypes else [])
               if ((r // unit) ** 2) % world]
        if bad or a.text_len % world:
            p.error(f"cp: image tokens (resolution/{unit})^2 and --text-len must be divisible by the world size {world}")
    import torch  # noqa: PLC0415

    if not a.tiny:
        if not torch.cuda.is_available():
            p.error("no CUDA device: run on GPUs, or pass --tiny for the CPU check of the script")
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
            p.error(f"{world} processes but {torch.cuda.device_count()} GPUs on this node")
    if a.out is None:
        a.out = (Path(tempfile.gettempdir()) / "qwen_absorb_parallel_tiny") if a.tiny else \
            (ROOT / "benchmarks" / "results" / "parallel")
    else:
        a.out = Path(a.out)
        if a.out.is_dir():
            a.out = a.out / "parallel"
    return a


# ------------------------------------------------------------------------------------------ environment


def env_info(device, world: int) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    def version(mod: str) -> str | None:
        try:
            return getattr(__import__(mod), "__version__", "?")
        except Exception:  # noqa: BLE001
            return None

    info: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "world_size": world,
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        "diffusers": version("diffusers"), "modelopt": version("modelopt"), "cupy": version("cupy"),
        "qwen_absorb_commit": _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "qwen_absorb_dirty": _run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "qwen_absorb"]) is not None,
        "qwen_absorb_sources_sha256": _sources_sha256(),
        "env": {k: os.environ.get(k) for k in _ENV},
        "env_overridden": {k: v for k, v in _ENV_BEFORE.items() if v is not None and v != _ENV[k]},
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
        import qwen_absorb  # noqa: PLC0415

        info["kernel_unavailable_reasons"] = qwen_absorb.ops.kernel_runtime_reasons(device)
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
    return info


def _sources_sha256() -> str:
    """sha256 (first 16 hex digits) over qwen_absorb's .py / .cu / .cuh files: which code was measured."""
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256()
    for f in sorted((ROOT / "qwen_absorb").rglob("*")):
        if f.suffix in (".py", ".cu", ".cuh") and f.is_file():
            h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------------ measurement


def kernel_totals(prof) -> tuple[float, float, int]:
    """(GPU busy ms, its NCCL part ms, kernels) of a finished torch.profiler session: the device-side events
    (benchmarks/kernel_events.py), each ``time_range`` summed; NCCL = kernel names containing "nccl" (any case). The
    approach of transformer_suite.profile_fn and cuda_graph_bench.gpu_busy (not imported: importing those
    modules loads the examples, qwen_absorb's CUDA-graph module and sets TORCH_EXTENSIONS_DIR, and neither
    separates NCCL)."""
    busy_us = nccl_us = 0.0
    n = 0
    for name, dur in kernel_events.kernels(prof):
        n += 1
        busy_us += dur
        if "nccl" in name.lower():
            nccl_us += dur
    return busy_us / 1e3, nccl_us / 1e3, n


def _single_keys(s: dict[str, Any]) -> dict[str, Any]:
    """The one-GPU keys of a parallel row: single_ms, single_gpu_busy_ms, ..., single_patched_kernels."""
    return {f"{b}_{k}": s.get(f"{b}_{k}") for b in ("single", "single_patched") for k in ("ms", *PROFILE_KEYS)}


def _busy(row: dict[str, Any], prefix: str) -> str:
    """`` (GPU busy 90.1 ms, NCCL 30.2 ms, 1234 kernels)`` for the log; empty when not measured."""
    b = row.get(f"{prefix}_gpu_busy_ms")
    if b is None:
        return ""
    return f" (GPU busy {b:.1f} ms, NCCL {row[f'{prefix}_nccl_ms']:.1f} ms, {row[f'{prefix}_kernels']} kernels)"


class Bench:
    def __init__(self, a: argparse.Namespace):
        import datetime  # noqa: PLC0415

        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        self.a, self.torch, self.dist = a, torch, dist
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        if a.tiny:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.world))
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
            self.dtype = torch.float32
        else:
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            dist.init_process_group("nccl", device_id=self.device, timeout=datetime.timedelta(minutes=10))
            self.dtype = torch.bfloat16
        self.data: dict[str, Any] = {}
        self.profile_skipped: list[str] = []  # why GPU busy is None (each reason once)
        self.profile_cost: list[tuple[float, int]] = []  # (s, blocks) of each profiled forward: the budget estimate
        if self.device.type == "cuda" and not a.no_profile:
            # CUPTI is initialised by the first profiler session and may leave launch overhead behind: start it
            # once now, so that every timed forward runs in the same profiler state (as transformer_suite does)
            from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

            x = torch.randn(256, 256, device=self.device)
            with contextlib.suppress(Exception), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
                x @ x
                self.sync()
            del x

    def say(self, *x) -> None:
        if self.rank == 0:
            print(*x, flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def model(self, num_layers: int | None = None):
        from qwen_absorb import testing as T  # noqa: PLC0415

        num_layers = num_layers or self.a.num_layers
        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        if self.a.tiny:
            m = T.tiny_transformer(dtype=self.dtype, num_layers=num_layers, seed=self.a.seed)
        else:
            m = T.full_size_transformer(num_layers=num_layers, dtype=self.dtype, device=self.device,
                                        seed=self.a.seed)
        self._same_weights(m)
        return m

    def _same_weights(self, m) -> None:
        """CP needs identical weights on every rank (TP broadcasts rank 0's): check, else broadcast."""
        torch = self.torch
        s = torch.stack([p.detach().float().sum() for p in list(m.parameters())[:: max(1, len(list(m.parameters())) // 64)]])
        g = [torch.empty_like(s) for _ in range(self.world)]
        self.dist.all_gather(g, s)
        if not all(torch.equal(x, g[0]) for x in g):
            self.say("weights differ between ranks: broadcasting rank 0's")
            for p in m.parameters():
                self.dist.broadcast(p.data, 0)

    def inputs(self, m, res: int):
        from qwen_absorb import testing as T  # noqa: PLC0415

        side = res // (8 if self.a.tiny else 16)
        return T.transformer_inputs(m, height=side, width=side, text_len=self.a.text_len,
                                    masked_tail=2 if self.a.mask else 0, seed=self.a.seed, device=self.device,
                                    dtype=self.dtype)

    def forward(self, m, inp):
        from qwen_absorb.parallel import local_view  # noqa: PLC0415

        with self.torch.inference_mode():
            out = m(**inp)[0]
        v, why = local_view(out)  # CP's all-gathered output is an AsyncCollectiveTensor: wait for it
        if v is None:
            raise RuntimeError(f"model output is not a full local tensor: {why}")
        return v

    def timed(self, m, inp, parallel: bool, warmup: int | None = None, iters: int | None = None) -> tuple[float, Any]:
        """(median ms of this rank, or of the slowest rank when ``parallel``; last output)."""
        out = None
        for _ in range(self.a.warmup if warmup is None else warmup):
            out = self.forward(m, inp)
        times = []
        for _ in range(self.a.iters if iters is None else iters):
            if parallel:
                self.dist.barrier()
            self.sync()
            t0 = time.perf_counter()
            out = self.forward(m, inp)
            self.sync()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        if parallel:
            t = self.torch.tensor(ms, dtype=self.torch.float64, device=self.device)
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
            ms = float(t)
        return ms, out.detach().clone()

    def profiled(self, m, inp, parallel: bool, prefix: str) -> dict[str, Any]:
        """One more forward under torch.profiler (CPU + CUDA activity): ``{prefix}_gpu_busy_ms`` (sum of the
        kernels' device durations, NCCL included), ``{prefix}_nccl_ms`` (its NCCL-kernel part),
        ``{prefix}_kernels`` (count), this rank's GPU; ``parallel``: the values of the rank with the largest
        GPU busy (ranks start together). All None with --no-profile, off CUDA, or if the profiler fails."""
        keys = [f"{prefix}_{k}" for k in PROFILE_KEYS]
        if self.a.no_profile:
            return dict.fromkeys(keys)
        from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

        torch, cuda = self.torch, self.device.type == "cuda"
        vals, why, prof = None, None, None
        if parallel:
            self.dist.barrier()
        self.sync()
        t0 = time.monotonic()
        try:
            prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            prof.start()
        except Exception as e:  # noqa: BLE001  (a profiler problem must not cost the timings)
            prof, why = None, f"profiler failed to start: {type(e).__name__}: {e}"
        try:
            self.forward(m, inp)  # its own failure is the run's, not the profiler's: raised
            self.sync()
        finally:
            if prof is not None:
                try:
                    prof.stop()
                except Exception as e:  # noqa: BLE001
                    prof, why = None, f"profiler failed to stop: {type(e).__name__}: {e}"
        if prof is not None and not cuda:
            why = f"no CUDA device ({self.device.type}): no CUDA activity in torch.profiler"
        elif prof is not None:
            try:
                vals = kernel_totals(prof)
                if vals[2] == 0:
                    vals, why = None, "the profiler saw no kernels"
            except Exception as e:  # noqa: BLE001
                why = f"profiler events unreadable: {type(e).__name__}: {e}"
        del prof
        self.profile_cost.append((time.monotonic() - t0, len(m.transformer_blocks)))
        if parallel:
            t = torch.tensor([*vals, 1.0] if vals else [0.0] * 4, dtype=torch.float64, device=self.device)
            g = [torch.empty_like(t) for _ in range(self.world)]
            self.dist.all_gather(g, t)
            rows = [x.tolist() for x in g]
            if all(r[3] for r in rows):
                vals = tuple(max(rows, key=lambda r: r[0])[:3])
            else:
                vals, why = None, why or "not measured on every rank"
        if why and why not in self.profile_skipped:
            self.profile_skipped.append(why)
        if vals is None:
            return dict.fromkeys(keys)
        return dict(zip(keys, (round(vals[0], 3), round(vals[1], 3), int(vals[2]))))

    def ranks_agree(self, t) -> bool:
        g = [self.torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(g, t.contiguous())
        return all(self.torch.equal(x, g[0]) for x in g)

    @staticmethod
    def rel_err(a_, b_) -> float:
        a32, b32 = a_.float(), b_.float()
        return float((a32 - b32).norm() / b32.norm().clamp_min(1e-30))

    # ---------------------------------------------------------------------------------------- phases

    def single(self) -> dict[int, dict[str, Any]]:
        """Rank 0: one-GPU times and outputs per resolution (outputs kept on the CPU)."""
        import qwen_absorb  # noqa: PLC0415

        res_out: dict[int, dict[str, Any]] = {}
        m = self.model()
        if self.rank == 0:
            for res in self.a.resolutions:
                inp = self.inputs(m, res)
                ms, out = self.timed(m, inp, parallel=False)
                r = {"single_ms": ms, **self.profiled(m, inp, False, "single"), "out": out.cpu()}
                if not self.a.no_single_patched:
                    qwen_absorb.patch(m)
                    r["single_patched_ms"], outp = self.timed(m, inp, parallel=False)
                    r.update(self.profiled(m, inp, False, "single_patched"))
                    r["single_patched_bit_identical"] = bool(self.torch.equal(outp.cpu(), r["out"]))
                    qwen_absorb.unpatch(m)
                res_out[res] = r
                self.say(f"single {res}: {ms:.1f} ms{_busy(r, 'single')}"
                         + (f", patched {r['single_patched_ms']:.1f} ms{_busy(r, 'single_patched')}"
                            if "single_patched_ms" in r else ""))
        del m
        self.dist.barrier()
        return res_out

    def mode(self, mode: str, single: dict[int, dict[str, Any]], progress) -> dict[str, Any]:
        import qwen_absorb  # noqa: PLC0415
        from diffusers import ContextParallelConfig, TensorParallelConfig  # noqa: PLC0415

        cfg = TensorParallelConfig(tp_degree=self.world) if mode == "tp" else \
            ContextParallelConfig(ulysses_degree=self.world)
        m = self.model()
        m.enable_parallelism(config=cfg)
        r: dict[str, Any] = {"config": repr(cfg).split("(")[0] + f"(degree={self.world})", "resolutions": {}}
        outs = {}
        for res in self.a.resolutions:
            inp = self.inputs(m, res)
            ms, out = self.timed(m, inp, parallel=True)
            outs[res] = out
            row = {**_single_keys(single.get(res, {})), "parallel_unpatched_ms": ms,
                   **self.profiled(m, inp, True, "parallel_unpatched"), "ranks_agree_unpatched": self.ranks_agree(out)}
            r["resolutions"][str(res)] = row
            self.say(f"{mode} {res}: unpatched {ms:.1f} ms{_busy(row, 'parallel_unpatched')}")
        progress(mode, r, "patched run in progress (a crash here leaves this status)")
        report = qwen_absorb.patch(m)
        bit = True
        for res in self.a.resolutions:
            inp = self.inputs(m, res)
            ms, out = self.timed(m, inp, parallel=True)
            row = r["resolutions"][str(res)]
            row["parallel_patched_ms"] = ms
            row.update(self.profiled(m, inp, True, "parallel_patched"))
            row["ranks_agree_patched"] = self.ranks_agree(out)
            row["bit_identical"] = bool(self.torch.equal(out, outs[res]))
            row["max_abs_patched_vs_unpatched"] = float((out.float() - outs[res].float()).abs().max())
            bit &= row["bit_identical"]
            if res in single:
                ref = single[res]["out"].to(self.device)
                row["rel_err_vs_single"] = self.rel_err(out, ref)
                row["rel_err_unpatched_vs_single"] = self.rel_err(outs[res], ref)
            self.say(f"{mode} {res}: patched {ms:.1f} ms{_busy(row, 'parallel_patched')}, "
                     f"bit-identical {row['bit_identical']}")
        rows = r["resolutions"].values()
        r["bit_identical"] = bit
        if single:
            r["rel_err_vs_single"] = max(x["rel_err_vs_single"] for x in rows)
            r["rel_err_unpatched_vs_single"] = max(x["rel_err_unpatched_vs_single"] for x in rows)
        r["patch_summary"] = {k: v for k, v in report.summary.items() if isinstance(v, (int, float, str, bool))}
        r["runtime_fallbacks"] = {k: int(v) for k, v in report.runtime_fallbacks.items()}
        r["status"] = "done"
        del m
        self.dist.barrier()
        return r

    # ---------------------------------------------------------------------------------------- FP8

    def fp8_timed(self, m, inp, parallel: bool):
        return self.timed(m, inp, parallel, warmup=self.a.fp8_warmup, iters=self.a.fp8_iters)

    def fp8_quantize(self, m) -> float:
        """ModelOpt FP8 (FP8_DEFAULT_CFG), calibrated on one forward at --calib-resolution; seconds taken."""
        from qwen_absorb import testing as T  # noqa: PLC0415

        self.sync()
        t0 = time.perf_counter()
        T.fp8_quantize(m, self.inputs(m, self.a.calib_resolution))
        self.sync()
        return time.perf_counter() - t0

    def amax_agree(self, m) -> bool:
        """Every rank calibrated the same amax (CP: each rank quantizes with its own copy)."""
        torch = self.torch
        vals = [q.amax.detach().float().reshape(-1)[:1] for n, q in m.named_modules()
                if n.endswith("_quantizer") and getattr(q, "amax", None) is not None]
        if not vals:
            return True
        return self.ranks_agree(torch.cat(vals).to(self.device))

    @staticmethod
    def fp8_report(report) -> dict[str, Any]:
        """Patch summary, real-FP8 linears by path, not-real-FP8 reasons by path (counts over blocks)."""
        from collections import Counter  # noqa: PLC0415

        real, why = Counter(), Counter()
        for b in report.blocks:
            for lp in b.linears.values():
                if lp.fp8_gemm:
                    real[lp.path] += 1
                else:
                    for r in lp.fp8_reasons or ():
                        if r != "not ModelOpt-quantized":
                            why[f"{lp.path}: {r}"] += 1
        summary = {k: v for k, v in report.summary.items()
                   if isinstance(v, (int, float, str, bool)) or k == "quantized_projections"}
        return {"patch_summary": summary, "fp8_gemm_linears": report.summary.get("fp8_gemm_linears"),
                "fp8_gemm_paths": dict(real), "fp8_reasons": dict(why),
                "runtime_fallbacks": {k: int(v) for k, v in report.runtime_fallbacks.items()}}

    def fp8_single(self, m, fp: dict[str, Any], write) -> dict[int, dict[str, Any]]:
        """Rank 0: one-GPU FP8, fake quant vs patched (real FP8 GEMMs where they qualify)."""
        import qwen_absorb  # noqa: PLC0415

        single: dict[int, dict[str, Any]] = {}
        r: dict[str, Any] = {"resolutions": {}, "status": "running"}
        fp["single"] = r
        write()
        if self.rank == 0:
            for res in self.a.fp8_resolutions:
                inp = self.inputs(m, res)
                ms, out = self.fp8_timed(m, inp, parallel=False)
                row = {"single_ms": ms, **self.profiled(m, inp, False, "single")}
                r["resolutions"][str(res)] = row
                single[res] = {**row, "out": out.cpu()}
                self.say(f"fp8 single {res}: fake quant {ms:.1f} ms{_busy(row, 'single')}")
                write()
            report = qwen_absorb.patch(m)
            try:
                for res in self.a.fp8_resolutions:
                    inp = self.inputs(m, res)
                    ms, out = self.fp8_timed(m, inp, parallel=False)
                    ref = single[res]["out"].to(self.device)
                    row = r["resolutions"][str(res)]
                    prof = self.profiled(m, inp, False, "single_patched")
                    row.update(single_patched_ms=ms, **prof, rel_err=self.rel_err(out, ref),
                               max_abs=float((out.float() - ref.float()).abs().max()),
                               bit_identical=bool(self.torch.equal(out, ref)))
                    single[res].update(single_patched_ms=ms, **prof)
                    single[res]["out_patched"] = out.cpu()
                    self.say(f"fp8 single {res}: patched {ms:.1f} ms{_busy(row, 'single_patched')}, "
                             f"rel err {row['rel_err']:.3g}")
                r.update(self.fp8_report(report))
                r["report"] = str(report)[:4000]
            finally:
                qwen_absorb.unpatch(m)
            r["rel_err"] = max(x["rel_err"] for x in r["resolutions"].values())
        r["status"] = "done"
        write()
        return single

    def fp8_parallel(self, mode: str, m, single, r: dict[str, Any], write) -> None:
        """Unpatched vs patched parallel FP8 on ``m`` (already parallelised and quantized)."""
        import qwen_absorb  # noqa: PLC0415

        outs = {}
        r.setdefault("resolutions", {})
        for res in self.a.fp8_resolutions:
            inp = self.inputs(m, res)
            ms, out = self.fp8_timed(m, inp, parallel=True)
            outs[res] = out
            s = single.get(res, {})
            row = {**_single_keys(s), "parallel_unpatched_ms": ms,
                   **self.profiled(m, inp, True, "parallel_unpatched"), "ranks_agree_unpatched": self.ranks_agree(out)}
            if "out" in s:
                row["rel_err_unpatched_vs_single"] = self.rel_err(out, s["out"].to(self.device))
            r["resolutions"][str(res)] = row
            self.say(f"fp8 {mode} {res}: unpatched {ms:.1f} ms{_busy(row, 'parallel_unpatched')}")
        r["status"] = "patched run in progress (a crash here leaves this status)"
        write()
        report = qwen_absorb.patch(m)
        for res in self.a.fp8_resolutions:
            inp = self.inputs(m, res)
            ms, out = self.fp8_timed(m, inp, parallel=True)
            row = r["resolutions"][str(res)]
            s = single.get(res, {})
            row.update(parallel_patched_ms=ms, **self.profiled(m, inp, True, "parallel_patched"),
                       ranks_agree_patched=self.ranks_agree(out),
                       bit_identical=bool(self.torch.equal(out, outs[res])), rel_err=self.rel_err(out, outs[res]),
                       max_abs=float((out.float() - outs[res].float()).abs().max()))
            if "out" in s:
                row["rel_err_vs_single"] = self.rel_err(out, s["out"].to(self.device))
            if "out_patched" in s:
                row["rel_err_vs_single_patched"] = self.rel_err(out, s["out_patched"].to(self.device))
            self.say(f"fp8 {mode} {res}: patched {ms:.1f} ms{_busy(row, 'parallel_patched')}, "
                     f"rel err vs unpatched {row['rel_err']:.3g}")
        rows = list(r["resolutions"].values())
        r["bit_identical"] = all(x["bit_identical"] for x in rows)
        r["rel_err"] = max(x["rel_err"] for x in rows)
        for k in ("rel_err_vs_single", "rel_err_unpatched_vs_single", "rel_err_vs_single_patched"):
            if all(k in x for x in rows):
                r[k] = max(x[k] for x in rows)
        r.update(self.fp8_report(report))
        r["report"] = str(report)[:4000]
        r["status"] = "done"
        write()

    def load_modelopt_fp8_extension(self) -> float | None:
        """Load (or build) ModelOpt's FP8 fake-quant CUDA extension, rank 0 first; its seconds (None on CPU)."""
        if self.device.type != "cuda":
            return None
        t0 = time.perf_counter()
        for r in range(self.world):
            if self.rank == r:
                with contextlib.suppress(Exception):
                    from modelopt.torch.quantization.extensions import get_cuda_ext_fp8  # noqa: PLC0415

                    get_cuda_ext_fp8(raise_if_failed=False)
            self.dist.barrier()
        return round(time.perf_counter() - t0, 1)

    def tp_quantize_before_probe(self) -> str | None:
        """A 1-block model quantized, then tensor-parallelised: the exception text, or None if it works."""
        from diffusers import TensorParallelConfig  # noqa: PLC0415

        from qwen_absorb import testing as T  # noqa: PLC0415

        m = T.tiny_transformer(dtype=self.dtype, num_layers=1, seed=self.a.seed).to(self.device)
        T.fp8_quantize(m, T.transformer_inputs(m, height=4, width=4, text_len=8, masked_tail=0,
                                               device=self.device, dtype=self.dtype))
        try:
            m.enable_parallelism(config=TensorParallelConfig(tp_degree=self.world))
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        del m
        self.dist.barrier()
        return err

    def fp8(self, fp: dict[str, Any], write) -> int:
        """The FP8 part; every step's exception is recorded in ``fp`` (returns 1 if any failed)."""
        from diffusers import ContextParallelConfig, TensorParallelConfig  # noqa: PLC0415

        rc = 0
        L = fp["num_layers"]

        def failed(where: str, r: dict[str, Any], e: Exception) -> None:
            nonlocal rc
            rc = 1
            r["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            r["status"] = f"failed in {where}"
            self.say(f"fp8 {where} failed: {type(e).__name__}: {e}")
            write()
            self.dist.barrier()  # both ranks usually fail at the same step; keep them in step

        # one model: quantized before enable_parallelism, timed on one GPU (rank 0), then CP
        single: dict[int, dict[str, Any]] = {}
        m = None
        cp: dict[str, Any] = {"config": f"ContextParallelConfig(degree={self.world})",
                              "order": "quantize + calibrate, enable_parallelism, patch"}
        try:
            t0 = time.perf_counter()
            m = self.model(L)
            fp["build_s"] = round(time.perf_counter() - t0, 1)
            fp["calibration_s"] = round(self.fp8_quantize(m), 1)
            fp["amax_agree_between_ranks"] = self.amax_agree(m)
            self.say(f"fp8: {L} blocks built in {fp['build_s']} s, quantized + calibrated in {fp['calibration_s']} s")
            write()
            single = self.fp8_single(m, fp, write)
            self.dist.barrier()
        except Exception as e:  # noqa: BLE001
            failed("single", fp.setdefault("single", {}), e)
        if "cp" in self.a.modes and m is not None:
            fp["cp"] = cp
            try:
                m.enable_parallelism(config=ContextParallelConfig(ulysses_degree=self.world))
                self.fp8_parallel("cp", m, single, cp, write)
            except Exception as e:  # noqa: BLE001
                failed("cp", cp, e)
        del m
        self.dist.barrier()
        if "tp" in self.a.modes:
            tp: dict[str, Any] = {"config": f"TensorParallelConfig(degree={self.world})"}
            fp["tp"] = tp
            m = None
            try:
                tp["quantize_before_parallelism_error"] = err = self.tp_quantize_before_probe()
                m = self.model(L)
                if err is None:
                    tp["order"] = "quantize + calibrate, enable_parallelism, patch"
                    self.fp8_quantize(m)
                    m.enable_parallelism(config=TensorParallelConfig(tp_degree=self.world))
                else:
                    tp["order"] = ("enable_parallelism, quantize + calibrate (ModelOpt quantizes the rank-local "
                                   "shards), patch: quantizing first fails in diffusers' parallelize_module")
                    m.enable_parallelism(config=TensorParallelConfig(tp_degree=self.world))
                    tp["calibration_s"] = round(self.fp8_quantize(m), 1)
                write()
                self.fp8_parallel("tp", m, single, tp, write)
            except Exception as e:  # noqa: BLE001
                failed("tp", tp, e)
            del m
            self.dist.barrier()
        return rc

    # ---------------------------------------------------------------------------------------- orders

    def orders(self, write, data: dict[str, Any]) -> int:
        """Per mode: patch before enable_parallelism, run; unpatch, run; patch again, run (bit-identical)."""
        import qwen_absorb  # noqa: PLC0415
        from diffusers import ContextParallelConfig, TensorParallelConfig  # noqa: PLC0415

        L, res = self.a.order_check_layers, self.a.resolutions[0]
        o: dict[str, Any] = {"num_layers": L, "resolution": res,
                             "sequence": "patch, enable_parallelism, run; unpatch, run; patch, run"}
        data["orders"] = o
        rc = 0
        for mode in self.a.modes:
            r: dict[str, Any] = {"status": "running"}
            o[mode] = r
            write()
            try:
                cfg = TensorParallelConfig(tp_degree=self.world) if mode == "tp" else \
                    ContextParallelConfig(ulysses_degree=self.world)
                m = self.model(L)
                inp = self.inputs(m, res)
                qwen_absorb.patch(m)
                m.enable_parallelism(config=cfg)
                a_ = self.forward(m, inp).clone()
                qwen_absorb.unpatch(m)
                b_ = self.forward(m, inp).clone()
                report = qwen_absorb.patch(m)
                c_ = self.forward(m, inp).clone()
                r.update(patched_before_eq_unpatched=bool(self.torch.equal(a_, b_)),
                         patched_after_eq_unpatched=bool(self.torch.equal(c_, b_)),
                         ranks_agree=self.ranks_agree(c_), biases_deferred=report.summary["biases_deferred"],
                         runtime_fallbacks={k: int(v) for k, v in report.runtime_fallbacks.items()})
                r["bit_identical"] = r["patched_before_eq_unpatched"] and r["patched_after_eq_unpatched"]
                r["status"] = "done"
                self.say(f"orders {mode}: bit-identical {r['bit_identical']}")
                del m
            except Exception as e:  # noqa: BLE001
                rc = 1
                r["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
                r["status"] = "failed"
                self.say(f"orders {mode} failed: {type(e).__name__}: {e}")
            write()
            self.dist.barrier()
        return rc


# ------------------------------------------------------------------------------------------ output


def markdown(data: dict[str, Any]) -> str:
    e = data["env"]
    lines = [
        "# Context / tensor parallelism with qwen_absorb (benchmarks/parallel_bench.py)",
        "",
        f"{e.get('gpu') or e.get('cpu')} x {e['world_size']}, {e['date']}; torch {e['torch']} (CUDA {e['cuda_runtime']}), "
        f"diffusers {e['diffusers']}, cupy {e['cupy']}, NCCL {e.get('nccl')}, driver {e.get('driver')}, "
        f"commit {e['qwen_absorb_commit']}" + (f" + uncommitted qwen_absorb changes (sources sha256 "
                                                f"{e.get('qwen_absorb_sources_sha256')})" if e.get("qwen_absorb_dirty")
                                                else "") + f"; NCCL_NVLS_ENABLE={e['env']['NCCL_NVLS_ENABLE']}, "
        f"TORCH_SYMM_MEM_DISABLE_MULTICAST={e['env']['TORCH_SYMM_MEM_DISABLE_MULTICAST']}.",
        "",
        f"Model: {data['config']['model']}; batch 1, {data['config']['text_len']} text tokens, "
        f"mask {data['config']['mask']}; medians of {data['config']['iters']} forwards after "
        f"{data['config']['warmup']} warm-up; parallel times are the slowest rank's. " + _busy_note(data),
        "",
    ]
    for note in data.get("notes", []):  # free text added when results of several runs are merged
        lines += [note, ""]
    for mode in ("cp", "tp"):
        r = data.get(mode)
        if r is None:
            continue
        lines += [f"## {mode}: {r.get('config', '')}", ""]
        if r.get("status") != "done":
            lines += [f"**Did not finish**: {r.get('status')}", ""]
        if "error" in r:
            lines += ["```", r["error"][-2000:], "```", ""]
        lines += [f"bit_identical (patched vs unpatched parallel): **{r.get('bit_identical')}**; "
                  f"rel_err_vs_single: {_f(r.get('rel_err_vs_single'), '.3g')} "
                  f"(unpatched: {_f(r.get('rel_err_unpatched_vs_single'), '.3g')}); "
                  f"runtime fallbacks: {r.get('runtime_fallbacks') or 'none'}", ""]
        rows = r.get("resolutions", {})
        busy = _has_busy(rows.values())
        gb = " (GPU busy)" if busy else ""
        extra = " parallel NCCL ms, unpatched / patched | parallel kernels, unpatched / patched |" if busy else ""
        lines += [f"| resolution | 1 GPU ms{gb} | 1 GPU patched ms{gb} | parallel ms{gb} | parallel patched ms{gb} |"
                  f"{extra} parallel speed-up | patched speed-up | bit-identical |",
                  "|---" * (10 if busy else 8) + "|"]
        for res, x in rows.items():
            s, pu, pp = x.get("single_ms"), x.get("parallel_unpatched_ms"), x.get("parallel_patched_ms")
            cells = [f"{res}^2"] + [_wb(x, k) for k in ("single", "single_patched", "parallel_unpatched",
                                                          "parallel_patched")]
            if busy:
                cells += [_pair(x, "parallel_unpatched_nccl_ms", "parallel_patched_nccl_ms"),
                          _pair(x, "parallel_unpatched_kernels", "parallel_patched_kernels", "d")]
            cells += [f"{_f(s / pu if s and pu else None, '.2f')}x", f"{_f(pu / pp if pu and pp else None, '.3f')}x",
                      str(x.get("bit_identical"))]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += _markdown_fp8(data.get("fp8"))
    o = data.get("orders")
    if o:
        lines += ["## Call orders (unquantized model)", "",
                  f"{o.get('num_layers')} blocks at {o.get('resolution')}^2: {o.get('sequence', '')}; "
                  f"outputs compared bit for bit. {o.get('status', '')}", ""]
        for mode in ("cp", "tp"):
            r = o.get(mode)
            if r:
                lines.append(f"- {mode}: bit_identical **{r.get('bit_identical')}** (patched before = unpatched: "
                             f"{r.get('patched_before_eq_unpatched')}, patched after = unpatched: "
                             f"{r.get('patched_after_eq_unpatched')}, ranks agree {r.get('ranks_agree')}); "
                             f"{r.get('status')}" + (f": `{r['error'].splitlines()[0]}`" if "error" in r else ""))
        lines.append("")
    return "\n".join(lines) + "\n"


def _markdown_fp8(fp: dict[str, Any] | None) -> list[str]:
    if not fp:
        return []
    lines = ["## ModelOpt FP8", ""]
    if "num_layers" not in fp:
        return lines + [f"{fp.get('status')}", ""]
    lines += [f"Model: {fp['model']}; blocks: {fp['num_layers_reason']}; medians of {fp['iters']} forwards after "
              f"{fp['warmup']} warm-up; patched = `qwen_absorb.patch(m)` (fp8_gemm=\"auto\": real FP8 GEMMs "
              f"where a linear qualifies); rel err = patched vs unpatched (ModelOpt fake quant) in the same mode. "
              f"ModelOpt FP8 extension load {fp.get('modelopt_fp8_extension_load_s', '-')} s, "
              f"build {fp.get('build_s', '-')} s, quantize + calibrate {fp.get('calibration_s', '-')} s, amax "
              f"equal on all ranks: {fp.get('amax_agree_between_ranks')}. Status: {fp.get('status', 'running')}.", ""]
    busy = _has_busy(x for name in ("single", "cp", "tp") for x in (fp.get(name) or {}).get("resolutions", {}).values())
    gb = " (GPU busy)" if busy else ""
    lines += [f"| run | resolution | 1 GPU fake quant ms{gb} | 1 GPU patched ms{gb} | parallel unpatched ms{gb} | "
              f"parallel patched ms{gb} | " + ("NCCL ms, unpatched / patched | kernels, unpatched / patched | "
                                               if busy else "")
              + "patched speed-up | rel err patched vs unpatched | rel err vs 1 GPU (unpatched / patched) | "
              "real FP8 linears |", "|---" * (12 if busy else 10) + "|"]
    for name in ("single", "cp", "tp"):
        r = fp.get(name)
        if not r:
            continue
        for res, x in r.get("resolutions", {}).items():
            s, sp = x.get("single_ms"), x.get("single_patched_ms")
            pu, pp = x.get("parallel_unpatched_ms"), x.get("parallel_patched_ms")
            base, new = (s, sp) if name == "single" else (pu, pp)
            u, p = ("single", "single_patched") if name == "single" else ("parallel_unpatched", "parallel_patched")
            cells = [name, f"{res}^2"] + [_wb(x, k) for k in ("single", "single_patched", "parallel_unpatched",
                                                                "parallel_patched")]
            if busy:
                cells += [_pair(x, f"{u}_nccl_ms", f"{p}_nccl_ms"), _pair(x, f"{u}_kernels", f"{p}_kernels", "d")]
            cells += [f"{_f(base / new if base and new else None, '.2f')}x", _f(x.get("rel_err"), ".3g"),
                      f"{_f(x.get('rel_err_unpatched_vs_single'), '.3g')} / {_f(x.get('rel_err_vs_single'), '.3g')}",
                      str(r.get("fp8_gemm_linears", "-"))]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name in ("single", "cp", "tp"):
        r = fp.get(name)
        if not r:
            continue
        how = "; ".join(x for x in (r.get("config", "one GPU, rank 0"), r.get("order")) if x)
        ps = r.get("patch_summary") or {}
        lines.append(f"- **{name}** ({how}): status {r.get('status')}; "
                     f"real FP8 GEMMs: {_paths(r.get('fp8_gemm_paths'))}; biases deferred "
                     f"{ps.get('biases_deferred', '-')}/{ps.get('biases_deferrable_sites', '-')}; runtime fallbacks: "
                     f"{r.get('runtime_fallbacks') or 'none'}")
        if r.get("quantize_before_parallelism_error"):
            lines.append(f"  - quantize before `enable_parallelism` (1-block probe): "
                         f"`{r['quantize_before_parallelism_error']}`")
        why = r.get("fp8_reasons") or {}
        if why:
            short = {}
            for k, n in why.items():
                reason = k.split(": ", 1)[-1]
                short[reason] = short.get(reason, 0) + n
            lines.append("  - linears not run as real FP8 (linear-blocks per reason): "
                         + "; ".join(f"{k} ({n})" for k, n in sorted(short.items(), key=lambda kv: -kv[1])))
        if "error" in r:
            lines += ["", "```", r["error"][-2000:], "```"]
    lines.append("")
    return lines


def _paths(counts: dict[str, int] | None) -> str:
    """``{"attn.to_q": 60, ...}`` -> ``attn.to_q, ... (x60 each)``."""
    if not counts:
        return "none"
    if len(set(counts.values())) == 1:
        return f"{', '.join(counts)} (x{next(iter(counts.values()))} each)"
    return ", ".join(f"{k} x{v}" for k, v in counts.items())


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def _wb(x: dict[str, Any], prefix: str) -> str:
    """Wall ms with the GPU busy ms in brackets: ``153.5 (90.1)``; just the wall ms when busy is unknown."""
    b = x.get(f"{prefix}_gpu_busy_ms")
    return _f(x.get(f"{prefix}_ms")) + ("" if b is None else f" ({_f(b)})")


def _pair(x: dict[str, Any], k1: str, k2: str, fmt: str = ".1f") -> str:
    return f"{_f(x.get(k1), fmt)} / {_f(x.get(k2), fmt)}"


def _has_busy(rows) -> bool:
    return any(v is not None for x in rows for k, v in x.items() if k.endswith("_gpu_busy_ms"))


def _busy_note(data: dict[str, Any]) -> str:
    c = data["config"]
    if "gpu_busy" not in c:  # results written before GPU busy was measured
        return ""
    if str(c["gpu_busy"]).startswith("off"):
        return "GPU busy: not measured (--no-profile)."
    why = "; ".join(c.get("profile_skipped") or [])
    rows = [x for k in ("cp", "tp") for x in (data.get(k) or {}).get("resolutions", {}).values()]
    rows += [x for k in ("single", "cp", "tp") for x in ((data.get("fp8") or {}).get(k) or {}).get("resolutions",
                                                                                                 {}).values()]
    if not _has_busy(rows):
        return f"GPU busy: not measured ({why or 'no profiled forward finished'})."
    return ("In brackets: GPU busy ms, the sum of the kernel durations of one more forward under torch.profiler "
            "(NCCL kernels included; an NCCL kernel also counts the wait for the other rank, so the compute part "
            "is GPU busy - NCCL); parallel: the rank with the largest GPU busy. Wall far above GPU busy: the host "
            "is the bottleneck." + (f" Missing for some runs: {why}." if why else ""))


def fp8_layers(a: argparse.Namespace, data: dict[str, Any],
               profile_cost: list[tuple[float, int]] | None = None) -> tuple[int, str]:
    """FP8 blocks that fit the time left (``--time-budget-s``), and why that many.

    Estimate per block: 90 bf16-forward equivalents (fake quant ~4.4x bf16; single, CP and TP,
    unpatched and patched, warm-up included) at the measured one-GPU bf16 time per block at the
    first FP8 resolution (3 ms per block if not measured: 60-block bf16 at 1024^2 is ~175 ms on one
    H200), plus 0.8 s of building, quantizing, calibrating and patching, plus (unless --no-profile)
    the profiled forwards (one per run and resolution): 2x the mean measured seconds per block of the
    earlier ones (``profile_cost``: (s, blocks) each; fake quant has more ops), else PROFILE_S_PER_BLOCK.
    """
    want = a.fp8_num_layers
    if a.time_budget_s is None:
        return want, "as requested (no --time-budget-s)"
    left = a.time_budget_s - (time.monotonic() - _T_START)
    per_fwd_block = 0.003
    row = (data.get("cp") or data.get("tp") or {}).get("resolutions", {}).get(str(a.fp8_resolutions[0]))
    if row and row.get("single_ms"):
        per_fwd_block = row["single_ms"] / 1e3 / a.num_layers
    forwards = (a.fp8_warmup + a.fp8_iters) / 6 * 15 * len(a.fp8_resolutions)
    per_block = forwards * per_fwd_block * (a.fp8_resolutions[0] / 1024) ** 2 + 0.8
    if not a.no_profile:
        cost = [s / blocks for s, blocks in profile_cost or () if blocks]
        per_profile = 2 * statistics.fmean(cost) if cost else PROFILE_S_PER_BLOCK
        per_block += per_profile * (2 + 2 * len(a.modes)) * len(a.fp8_resolutions)
    n = min(want, int(left / per_block))
    why = (f"{left:.0f} s left of --time-budget-s {a.time_budget_s:.0f}, estimated {per_block:.2f} s per block")
    return n, ("as requested; " + why) if n == want else f"reduced from {want}: {why}"


def main(argv=None) -> int:
    a = parse_args(argv)
    b = Bench(a)
    import torch  # noqa: PLC0415

    from qwen_absorb.parallel import allow_cpu_parallelism  # noqa: PLC0415

    data: dict[str, Any] = {
        "env": env_info(b.device, b.world),
        "config": {"model": ("tiny" if a.tiny else "full-size random") + f" transformer, {a.num_layers} blocks, "
                            f"{str(b.dtype)[6:]}", "num_layers": a.num_layers, "resolutions": a.resolutions,
                   "text_len": a.text_len, "mask": a.mask, "warmup": a.warmup, "iters": a.iters, "tiny": a.tiny,
                   "dtypes": a.dtypes, "time_budget_s": a.time_budget_s,
                   "gpu_busy": "off (--no-profile)" if a.no_profile else
                   "after the timed forwards of each run, one more forward under torch.profiler (CPU + CUDA "
                   "activity): *_gpu_busy_ms = sum of its kernels' device durations (NCCL kernels included, "
                   "memcpy/memset not), *_nccl_ms = the NCCL kernels' part (it includes a rank's waiting for the "
                   "other inside the collective), *_kernels = their count; parallel: the rank with the largest "
                   "GPU busy",
                   "profile_skipped": b.profile_skipped},
    }
    data["gpu"], data["world_size"], data["date"] = data["env"]["gpu"], b.world, data["env"]["date"]
    data["versions"] = {k: data["env"][k] for k in ("torch", "cuda_runtime", "diffusers", "modelopt", "cupy")}
    data["versions"]["nccl"] = data["env"].get("nccl")

    def write() -> None:
        if b.rank == 0:
            data["elapsed_s"] = round(time.monotonic() - _T_START, 1)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
            a.out.with_suffix(".md").write_text(markdown(data))

    def progress(mode, r, status) -> None:
        data[mode] = {**r, "status": status}
        write()

    b.say(f"parallel_bench: {data['config']['model']}, world {b.world}, {b.device.type}, modes {a.modes}, "
          f"resolutions {a.resolutions}, dtypes {a.dtypes}")
    rc = 0
    broken = None
    ctx = allow_cpu_parallelism() if a.tiny else contextlib.nullcontext()
    with ctx:
        if "bf16" in a.dtypes:
            t0 = time.monotonic()
            single = b.single()
            data["config"]["single_s"] = round(time.monotonic() - t0, 1)
            for mode in a.modes:
                t0 = time.monotonic()
                try:
                    data[mode] = b.mode(mode, single, progress)
                    data[mode]["wall_s"] = round(time.monotonic() - t0, 1)
                except Exception as e:  # noqa: BLE001  (recorded; a CUDA fault usually kills the process instead)
                    data.setdefault(mode, {})["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
                    data[mode]["status"] = "failed"
                    rc = 1
                    broken = f"the bf16 {mode} run failed (the ranks may be out of step)"
                    b.say(f"{mode} failed: {type(e).__name__}: {e}")
                    break  # the ranks may be out of step after a failure
                write()
            del single
        if a.order_check_layers and broken:
            data["orders"] = {"status": f"skipped: {broken}"}
        elif a.order_check_layers:
            rc |= b.orders(write, data)
        if "fp8" in a.dtypes and broken:
            data["fp8"] = {"status": f"skipped: {broken}"}
        elif "fp8" in a.dtypes:
            ext_s = b.load_modelopt_fp8_extension()  # its first build (~1 min) is not counted in the FP8 timings
            n, why = fp8_layers(a, data, b.profile_cost)
            nw = [n, why]  # rank 0's estimate for every rank (one-GPU times and profile costs are rank 0's)
            b.dist.broadcast_object_list(nw, src=0)
            n, why = nw
            fp: dict[str, Any] = {
                "num_layers": n, "num_layers_requested": a.fp8_num_layers, "num_layers_reason": why,
                "resolutions": a.fp8_resolutions, "calib_resolution": a.calib_resolution,
                "warmup": a.fp8_warmup, "iters": a.fp8_iters,
                "model": ("tiny" if a.tiny else "full-size random") + f" transformer, {n} blocks, "
                         f"{str(b.dtype)[6:]}, ModelOpt FP8 per-tensor (mtq.FP8_DEFAULT_CFG, e4m3 W8A8, max "
                         f"calibration on one forward at {a.calib_resolution}^2)",
                "patch_args": {"fp8_gemm": "auto", "defer_bias": "auto"},
                "modelopt_fp8_extension_load_s": ext_s,
                "metrics": "rel_err: ||patched - unpatched|| / ||unpatched|| (real FP8 GEMMs vs ModelOpt fake "
                           "quant, same mode); rel_err_vs_single: patched parallel vs one-GPU fake quant",
            }
            data["fp8"] = fp
            b.say(f"fp8: {n} blocks ({why})")
            if n < 1:
                fp["status"] = "skipped: no time left in --time-budget-s"
            else:
                t0 = time.monotonic()
                rc |= b.fp8(fp, write)
                fp["wall_s"] = round(time.monotonic() - t0, 1)
                fp["status"] = "done" if not any("error" in fp.get(k, {}) for k in ("single", "cp", "tp")) \
                    else "done with failures"
            write()
    write()
    if b.rank == 0:
        print(markdown(data))
        print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.md')}", flush=True)
    with contextlib.suppress(Exception):
        b.dist.barrier()
        b.dist.destroy_process_group()
    del torch
    return rc


if __name__ == "__main__":
    sys.exit(main())
