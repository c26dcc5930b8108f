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

TP patched runs last: if the patched block hands a raw kernel an AsyncCollectiveTensor (issue 12),
the CUDA context dies; the results file then says which run was in progress.

    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py                 # H200 x2: ~3-5 min
    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py --num-layers 8  # quicker look
    torchrun --nproc_per_node=2 benchmarks/parallel_bench.py --tiny --out /tmp/pb   # CPU, gloo: the script logic

Writes ``<out>.json`` and ``<out>.md`` (default ``benchmarks/results/parallel``; with ``--tiny`` the
default is in the temp folder, never benchmarks/results). ``--out`` naming an existing folder
writes ``parallel.json`` / ``parallel.md`` into it.
"""

from __future__ import annotations

import os

_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_ENV_BEFORE = {k: os.environ.get(k) for k in _ENV}
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FULL_HEADS = 24
TEXT_LEN = 128


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
    heads = 2 if a.tiny else FULL_HEADS
    if "tp" in a.modes and heads % world:
        p.error(f"tp: the world size {world} must divide the {heads} heads")
    if "cp" in a.modes:
        bad = [r for r in a.resolutions if ((r // unit) ** 2) % world]
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


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------------------------ measurement


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

    def say(self, *x) -> None:
        if self.rank == 0:
            print(*x, flush=True)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def model(self):
        from qwen_absorb import testing as T  # noqa: PLC0415

        gc.collect()
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        if self.a.tiny:
            m = T.tiny_transformer(dtype=self.dtype, num_layers=self.a.num_layers, seed=self.a.seed)
        else:
            m = T.full_size_transformer(num_layers=self.a.num_layers, dtype=self.dtype, device=self.device,
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

    def timed(self, m, inp, parallel: bool) -> tuple[float, Any]:
        """(median ms of this rank, or of the slowest rank when ``parallel``; last output)."""
        out = None
        for _ in range(self.a.warmup):
            out = self.forward(m, inp)
        times = []
        for _ in range(self.a.iters):
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
                r = {"single_ms": ms, "out": out.cpu()}
                if not self.a.no_single_patched:
                    qwen_absorb.patch(m)
                    r["single_patched_ms"], outp = self.timed(m, inp, parallel=False)
                    r["single_patched_bit_identical"] = bool(self.torch.equal(outp.cpu(), r["out"]))
                    qwen_absorb.unpatch(m)
                res_out[res] = r
                self.say(f"single {res}: {ms:.1f} ms" + (f", patched {r['single_patched_ms']:.1f} ms"
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
            r["resolutions"][str(res)] = {"single_ms": single.get(res, {}).get("single_ms"),
                                          "single_patched_ms": single.get(res, {}).get("single_patched_ms"),
                                          "parallel_unpatched_ms": ms, "ranks_agree_unpatched": self.ranks_agree(out)}
            self.say(f"{mode} {res}: unpatched {ms:.1f} ms")
        progress(mode, r, "patched run in progress (a crash here leaves this status)")
        report = qwen_absorb.patch(m)
        bit = True
        for res in self.a.resolutions:
            inp = self.inputs(m, res)
            ms, out = self.timed(m, inp, parallel=True)
            row = r["resolutions"][str(res)]
            row["parallel_patched_ms"] = ms
            row["ranks_agree_patched"] = self.ranks_agree(out)
            row["bit_identical"] = bool(self.torch.equal(out, outs[res]))
            row["max_abs_patched_vs_unpatched"] = float((out.float() - outs[res].float()).abs().max())
            bit &= row["bit_identical"]
            if res in single:
                ref = single[res]["out"].to(self.device)
                row["rel_err_vs_single"] = self.rel_err(out, ref)
                row["rel_err_unpatched_vs_single"] = self.rel_err(outs[res], ref)
            self.say(f"{mode} {res}: patched {ms:.1f} ms, bit-identical {row['bit_identical']}")
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


# ------------------------------------------------------------------------------------------ output


def markdown(data: dict[str, Any]) -> str:
    e = data["env"]
    lines = [
        "# Context / tensor parallelism with qwen_absorb (benchmarks/parallel_bench.py)",
        "",
        f"{e.get('gpu') or e.get('cpu')} x {e['world_size']}, {e['date']}; torch {e['torch']} (CUDA {e['cuda_runtime']}), "
        f"diffusers {e['diffusers']}, cupy {e['cupy']}, NCCL {e.get('nccl')}, driver {e.get('driver')}, "
        f"commit {e['qwen_absorb_commit']}; NCCL_NVLS_ENABLE={e['env']['NCCL_NVLS_ENABLE']}, "
        f"TORCH_SYMM_MEM_DISABLE_MULTICAST={e['env']['TORCH_SYMM_MEM_DISABLE_MULTICAST']}.",
        "",
        f"Model: {data['config']['model']}; batch 1, {data['config']['text_len']} text tokens, "
        f"mask {data['config']['mask']}; medians of {data['config']['iters']} forwards after "
        f"{data['config']['warmup']} warm-up; parallel times are the slowest rank's.",
        "",
    ]
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
                  f"runtime fallbacks: {r.get('runtime_fallbacks') or 'none'}", "",
                  "| resolution | 1 GPU ms | 1 GPU patched ms | parallel ms | parallel patched ms | parallel speed-up "
                  "| patched speed-up | bit-identical |",
                  "|---|---|---|---|---|---|---|---|"]
        for res, x in r.get("resolutions", {}).items():
            s, pu, pp = x.get("single_ms"), x.get("parallel_unpatched_ms"), x.get("parallel_patched_ms")
            lines.append(f"| {res}^2 | {_f(s)} | {_f(x.get('single_patched_ms'))} | {_f(pu)} | {_f(pp)} | "
                         f"{_f(s / pu if s and pu else None, '.2f')}x | {_f(pu / pp if pu and pp else None, '.3f')}x | "
                         f"{x.get('bit_identical')} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def main(argv=None) -> int:
    a = parse_args(argv)
    b = Bench(a)
    import torch  # noqa: PLC0415

    from qwen_absorb.parallel import allow_cpu_parallelism  # noqa: PLC0415

    data: dict[str, Any] = {
        "env": env_info(b.device, b.world),
        "config": {"model": ("tiny" if a.tiny else "full-size random") + f" transformer, {a.num_layers} blocks, "
                            f"{str(b.dtype)[6:]}", "num_layers": a.num_layers, "resolutions": a.resolutions,
                   "text_len": a.text_len, "mask": a.mask, "warmup": a.warmup, "iters": a.iters, "tiny": a.tiny},
    }
    data["gpu"], data["world_size"], data["date"] = data["env"]["gpu"], b.world, data["env"]["date"]
    data["versions"] = {k: data["env"][k] for k in ("torch", "cuda_runtime", "diffusers", "modelopt", "cupy")}
    data["versions"]["nccl"] = data["env"].get("nccl")

    def write() -> None:
        if b.rank == 0:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.with_suffix(".json").write_text(json.dumps(data, indent=2, default=str) + "\n")
            a.out.with_suffix(".md").write_text(markdown(data))

    def progress(mode, r, status) -> None:
        data[mode] = {**r, "status": status}
        write()

    b.say(f"parallel_bench: {data['config']['model']}, world {b.world}, {b.device.type}, modes {a.modes}, "
          f"resolutions {a.resolutions}")
    rc = 0
    ctx = allow_cpu_parallelism() if a.tiny else contextlib.nullcontext()
    with ctx:
        single = b.single()
        for mode in a.modes:
            try:
                data[mode] = b.mode(mode, single, progress)
            except Exception as e:  # noqa: BLE001  (recorded; a CUDA fault usually kills the process instead)
                data.setdefault(mode, {})["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
                data[mode]["status"] = "failed"
                rc = 1
                b.say(f"{mode} failed: {type(e).__name__}: {e}")
                break  # the ranks may be out of step after a failure
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
