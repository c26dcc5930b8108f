"""The one harness of the benchmarks: provenance, timing, GPU busy, result files, steps, common arguments.

Every script in ``benchmarks/`` imports this module (``import harness as H``; the scripts put their own folder on
``sys.path``, nothing else) and nothing from another script or from ``examples/``:

- :func:`environment` GPU, driver, versions, date, git commit and a hash of the ``qwen_absorb`` sources run;
- :func:`time_calls` / :func:`measure` wall (perf_counter) and CUDA-event times of single calls, medians after a
  warm-up; :func:`profile_call` one call under ``torch.profiler``: GPU busy = the sum of its kernels' durations,
  their count, the NCCL part and the kernel table by name; :func:`time_graph` / :func:`copy_rate_tb_s` for ops;
- :class:`Results` one JSON + markdown document, rewritten atomically after every measurement (a killed run keeps
  what was done); a value not measured stays ``null`` with its reason under ``skipped``;
- :class:`Steps` runs named steps under a time budget, records errors and run times, and writes after each;
- :class:`Bench` a runner's arguments, device and environment; :func:`parser` a script's argument parser;
- :func:`add_common_args` / :func:`finish_args` ``--tiny`` (CPU smoke mode, never writes into
  ``benchmarks/results`` unless ``--out`` says so), ``--out``, ``--sections``, ``--budget-s``, ``--device``, ``--seed``;
- model helpers over ``qwen_absorb.testing``: :func:`build_transformer`, :func:`inputs`, :func:`fp8_quantize`,
  :func:`flow_match_denoise` (the step runner), :func:`tiny_vae`, :func:`prompt_kwargs`, :func:`rel_err`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import hashlib
import importlib.metadata as _md
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# ModelOpt builds its FP8 CUDA extension on first use (~60 s): keep it where a later run can reuse it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/qwen_absorb_torch_extensions")

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:  # a checkout that was not pip-installed; PYTHONPATH (the GPU machine) wins
    sys.path.append(str(ROOT))

import torch  # noqa: E402

T0 = time.perf_counter()
NEEDS_CUDA = "needs CUDA"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------ provenance


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def sources_sha256() -> str | None:
    """Hash of the qwen_absorb sources run (the device copy may have no .git, the tree may be dirty)."""
    h = hashlib.sha256()
    try:
        for p in sorted((ROOT / "qwen_absorb").rglob("*")):
            if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".h"):
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes())
    except OSError:
        return None
    return h.hexdigest()[:16]


def environment(device: torch.device | str = "cpu") -> dict[str, Any]:
    """GPU, driver, versions, date and code provenance: recorded with every result."""
    device = torch.device(device)
    cupy = _version("cupy-cuda13x") or _version("cupy-cuda12x") or _version("cupy")
    if cupy is None:
        with contextlib.suppress(Exception):
            import cupy as _cp  # noqa: PLC0415

            cupy = _cp.__version__
    env: dict[str, Any] = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cupy": cupy,
        "diffusers": _version("diffusers"), "transformers": _version("transformers"),
        "modelopt": _version("nvidia-modelopt"), "peft": _version("peft"),
        "qwen_absorb_commit": _run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
        "git_dirty": _run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"]) is not None,
        "sources_sha256": sources_sha256(), "device": str(device), "gpu": None,
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(idx)
        env.update(gpu=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                   l2_mb=round(p.L2_cache_size / 2**20, 1), gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
        with contextlib.suppress(Exception):
            import qwen_absorb  # noqa: PLC0415

            env["kernel_unavailable_reasons"] = list(qwen_absorb.ops.kernel_runtime_reasons(device))
    else:
        env.update(cpu=platform.processor() or platform.machine(), cpu_threads=torch.get_num_threads())
    return env


VERSION_KEYS = ("torch", "cuda", "cupy", "diffusers", "transformers", "modelopt", "peft", "python", "driver",
                "qwen_absorb_commit")


def head(benchmark: str, env: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The first keys of every results document."""
    return {"benchmark": benchmark, "gpu": env.get("gpu"), "date": env.get("date"),
            "versions": {k: env.get(k) for k in VERSION_KEYS}, "environment": env,
            "config": json_safe(config), "tiny": bool(config.get("tiny"))}


# ------------------------------------------------------------------------------------------ timing


def time_calls(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, b2b: int = 0,
               warmup_s: float = 0.0) -> dict[str, Any]:
    """``warmup`` untimed calls, and more until ``warmup_s`` seconds have passed (the H200's clocks follow its
    power and temperature: a case timed right after a pause, e.g. a compile, runs at higher clocks than one timed
    after a busy case; a few seconds of calls bring every case to the same steady state); then ``iters`` calls,
    each between CUDA events and synchronized after it (the time of one call, host work included:
    ``median_ms``), with perf_counter around it (``wall_median_ms``); then ``b2b`` calls back to back between
    two events (``b2b_ms`` per call: host work overlaps the GPU)."""
    cuda = device.type == "cuda"
    t_warm = time.perf_counter()
    n_warm = 0
    while n_warm < warmup or time.perf_counter() - t_warm < warmup_s:
        fn()
        n_warm += 1
        if n_warm >= warmup:
            sync(device)
    sync(device)
    ev: list[float] = []
    wall: list[float] = []
    for _ in range(iters):
        t0 = time.perf_counter()
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ev.append(s.elapsed_time(e))
        else:
            fn()
        wall.append((time.perf_counter() - t0) * 1e3)
    ev = ev or wall
    r: dict[str, Any] = {
        "median_ms": statistics.median(ev), "min_ms": min(ev), "max_ms": max(ev),
        "wall_median_ms": statistics.median(wall), "samples_ms": [round(x, 4) for x in ev],
        "warmup": warmup, "warmup_calls": n_warm, "warmup_s": warmup_s, "iters": iters,
        "timer": "cuda_events" if cuda else "perf_counter",
    }
    if b2b > 0:
        sync(device)
        t0 = time.perf_counter()
        for _ in range(b2b):
            fn()
        sync(device)
        r["b2b_ms"], r["b2b_calls"] = (time.perf_counter() - t0) * 1e3 / b2b, b2b
    return r


def kernel_events(prof: Any) -> Iterator[tuple[str, float]]:
    """``(name, us)`` of every kernel of a finished profiler session: device-side events only, GPU user
    annotations (ranges, not kernels) and memcpy/memset left out."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if "memcpy" in e.name.lower() or "memset" in e.name.lower():
            continue
        yield e.name, float(e.time_range.elapsed_us())


def kernel_summary(prof: Any, top: int = 12) -> dict[str, Any]:
    rows: dict[str, list[float]] = {}
    for name, us in kernel_events(prof):
        r = rows.setdefault(name, [0, 0.0])
        r[0] += 1
        r[1] += us
    busy = sum(v[1] for v in rows.values())
    table = sorted(rows.items(), key=lambda kv: -kv[1][1])
    return {
        "gpu_busy_ms": busy / 1e3, "kernels_per_call": int(sum(v[0] for v in rows.values())),
        "nccl_ms": sum(v[1] for k, v in rows.items() if "nccl" in k.lower()) / 1e3,
        "top_kernels_by_time": [{"name": n[:160], "count": int(c), "ms": round(us / 1e3, 4)}
                                for n, (c, us) in table[: top or None]],
    }


def idle_summary(prof: Any, wall_ms: float, top: int = 8) -> dict[str, Any]:
    """Where a profiled call's GPU idles: ``span_ms`` from its first device activity (kernels, copies) to its
    last, ``idle_in_span_ms`` = span minus the union of those activities (gaps between kernels, a launch that
    falls behind), ``idle_outside_span_ms`` = the call's CUDA-event wall minus its span (host work before the
    first launch and after the last), and the ``largest_gaps`` with the activities around them."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    acts = sorted((float(e.time_range.start), float(e.time_range.end), e.name) for e in prof.events()
                  if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    if not acts:
        return {}
    gaps: list[tuple[float, str, str]] = []
    end, last = acts[0][1], acts[0][2]
    covered = acts[0][1] - acts[0][0]
    for a0, a1, name in acts[1:]:
        if a0 > end:
            gaps.append((a0 - end, last, name))
            covered += a1 - a0
        elif a1 > end:
            covered += a1 - end
        if a1 >= end:
            end, last = a1, name
    span = end - acts[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {"profiled_wall_ms": round(wall_ms, 4), "span_ms": round(span / 1e3, 4),
            "idle_in_span_ms": round((span - covered) / 1e3, 4),
            "idle_outside_span_ms": round(wall_ms - span / 1e3, 4), "gaps": len(gaps),
            "gaps_over_5us": sum(g[0] > 5 for g in gaps),
            "largest_gaps": [{"us": round(g, 1), "after": a[:90], "before": b[:90]} for g, a, b in gaps[:top]]}


def profile_call(fn: Callable[[], Any], device: torch.device, top: int = 12,
                 cpu_activity: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    """One call under torch.profiler (CUDA activity): :func:`kernel_summary` and :func:`idle_summary` (under
    ``idle``), or ``(None, reason)``."""
    if device.type != "cuda":
        return None, f"{NEEDS_CUDA} (torch.profiler CUDA activity); device is {device.type}"
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu_activity else [])
    try:
        sync(device)
        with profile(activities=acts) as prof:
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            fn()
            t1.record()
            sync(device)
        s = kernel_summary(prof, top)
        s["idle"] = idle_summary(prof, t0.elapsed_time(t1))
    except Exception as e:  # noqa: BLE001 - a profiler problem must not cost the timings
        return None, f"profiler failed: {type(e).__name__}: {e}"
    return (s, None) if s["kernels_per_call"] else (None, "the profiler saw no kernels")


def start_profiler(device: torch.device) -> None:
    """CUPTI starts with the first profiler session and may leave launch overhead behind: start it once before
    any timing, so that every timed case runs in the same profiler state."""
    if device.type == "cuda":
        x = torch.randn(256, 256, device=device)
        profile_call(lambda: x @ x, device)


def measure(label: str, fn: Callable[[], Any], device: torch.device, warmup: int, iters: int, b2b: int = 0,
            profile: bool = True, warmup_s: float = 0.0) -> dict[str, Any]:
    """First call (timed apart: compiles, builds, graph captures), :func:`time_calls`, one profiled call."""
    log(f"  {label}: first call ...")
    with torch.inference_mode():
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        r: dict[str, Any] = {"first_call_s": round(time.perf_counter() - t0, 4)}
        r.update(time_calls(fn, device, warmup, iters, b2b, warmup_s))
        r["profile"], r["profile_skipped"] = profile_call(fn, device) if profile else (None, "not requested")
    p = r["profile"]
    log(f"  {label}: median {r['median_ms']:.3f} ms (wall {r['wall_median_ms']:.3f})"
        + (f", GPU busy {p['gpu_busy_ms']:.3f} ms, {p['kernels_per_call']} kernels" if p else "")
        + f" (first call {r['first_call_s']:.2f} s)")
    return r


def busy(r: dict[str, Any] | None, key: str = "gpu_busy_ms") -> tuple[Any, str | None]:
    """``(value, None)`` or ``(None, reason)`` of a :func:`measure` result's profile entry."""
    if r is None:
        return None, "not measured"
    p = r.get("profile")
    return (p[key], None) if p else (None, r.get("profile_skipped") or "not profiled")


def time_graph(fn_all: Callable[[], Any], warmup: int = 5, reps: int = 30) -> tuple[float, list[float]]:
    """Median ms of one replay of a CUDA graph that runs ``fn_all()`` once (launch overhead removed)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn_all()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn_all()
    for _ in range(warmup):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), times


def graph_us_per_call(fn: Callable[[], Any], calls: int = 10) -> float:
    """Median us of one ``fn()`` inside a CUDA graph holding ``calls`` of them (:func:`time_graph`), 2 decimals."""
    ms, _ = time_graph(lambda: [fn() for _ in range(calls)])
    return round(ms * 1000.0 / calls, 2)


def copy_rate_tb_s(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy rate (bytes read + written), best of an eager loop and a graph replay."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    eager = time_calls(lambda: dst.copy_(src), torch.device("cuda"), 10, 20)["median_ms"]
    graph, _ = time_graph(lambda: dst.copy_(src), warmup=10, reps=20)
    return 2 * nbytes / (min(eager, graph) * 1e-3) / 1e12


def memory_gib(device: torch.device) -> float | None:
    """``torch.cuda.memory_allocated`` in GiB after gc + synchronize + empty_cache (None off CUDA)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 2**30


# ------------------------------------------------------------------------------------------ result files


def json_safe(obj: Any) -> Any:
    """inf/nan -> strings, tensors, dtypes, paths, counters -> plain data, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    return str(obj)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def dotted_get(d: Any, path: str) -> Any:
    for k in path.split("."):
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


class Bench:
    """What every benchmark's runner starts from: its arguments ``a``, device, environment (provenance of
    the result files) and the GPU's L2 size in bytes (0 where unknown)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.dev = a, a.device
        self.cuda = self.dev.type == "cuda"
        self.env = environment(self.dev)
        self.l2 = int(self.env.get("l2_mb", 0) * 2**20)


class Results:
    """``<out>/<name>.json`` + ``.md``. ``put("a.b", v)`` sets a dotted key; ``put(k, None, reason)`` and
    ``skip(k, reason)`` record why under ``skipped``. ``markdown(data) -> str`` renders the .md. With
    ``merge=True`` the keys already in the file that this run does not write are kept."""

    def __init__(self, out: Path, name: str, data: dict[str, Any], markdown: Callable[[dict[str, Any]], str],
                 merge: bool = False) -> None:
        self.json, self.md = out / f"{name}.json", out / f"{name}.md"
        self.markdown = markdown
        self.d: dict[str, Any] = {"skipped": {}, "errors": [], "timings_s": {}, **data}
        if merge and self.json.exists():
            with contextlib.suppress(OSError, ValueError):
                old = json.loads(self.json.read_text())
                self.d = {**old, **self.d} if isinstance(old, dict) else self.d

    def get(self, path: str) -> Any:
        return dotted_get(self.d, path)

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
        self.d["elapsed_s"] = round(time.perf_counter() - T0, 1)
        write_atomic(self.json, json.dumps(json_safe(self.d), indent=2) + "\n")
        write_atomic(self.md, self.markdown(self.d))


class Steps:
    """Named steps under a time budget: a step that would start after ``budget_s`` is skipped (its keys get the
    reason), an exception is recorded (``errors``) instead of ending the run; every document is written after
    each step. ``cleanup`` runs after a failed step (e.g. unpatch, free GPU memory)."""

    def __init__(self, docs: list[Results], budget_s: float | None, cleanup: Callable[[], None] | None = None):
        self.docs, self.budget_s, self.cleanup = docs, budget_s, cleanup
        self.failed = 0
        self.not_started: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - T0

    def __call__(self, name: str, fn: Callable[[], Any], fills: list[tuple[Results | None, str]] = ()) -> bool:
        fills = [(d, p) for d, p in fills if d is not None]
        if self.budget_s and self.elapsed() > self.budget_s:
            why = f"time budget {self.budget_s:.0f} s reached ({self.elapsed():.0f} s) before step '{name}'"
            self.not_started.append(name)
            log(f"SKIP {name}: {why}")
            for d, p in fills:
                d.skip(p, why)
            for d in self.docs:
                d.d["time_budget_reached"] = f"{why}; steps not started: {', '.join(self.not_started)}"
            self.write()
            return False
        log(f"step {name} ...")
        t0 = time.perf_counter()
        ok = True
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded; the next step runs
            ok, self.failed = False, self.failed + 1
            msg, tb = f"{type(e).__name__}: {e}", traceback.format_exc(limit=8)
            log(f"ERROR in step {name}: {msg}\n{tb}")
            for d in self.docs:
                d.d["errors"].append({"step": name, "error": msg, "traceback": tb})
            for d, p in fills:
                d.skip(p, f"error in step '{name}': {msg}")
            if self.cleanup is not None:
                with contextlib.suppress(Exception):
                    self.cleanup()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        dt = time.perf_counter() - t0
        for d in self.docs:
            d.d["timings_s"][name] = round(d.d["timings_s"].get(name, 0.0) + dt, 1)
        log(f"step {name} done in {dt:.1f} s (total {self.elapsed():.0f} s)")
        self.write()
        return ok

    def write(self) -> None:
        for d in self.docs:
            d.write()


# ------------------------------------------------------------------------------------------ markdown


def fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, float):
        return str(v)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{nd}f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"


def md_table(header: list[str], rows: list[list[Any]], nd: int = 3) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(fmt(c, nd) if not isinstance(c, str) else c for c in r) + " |" for r in rows]


def md_head(title: str, d: dict[str, Any], method: str | None = None) -> list[str]:
    """Title and the provenance lines (GPU, versions, commit, date) of a results document."""
    env = d.get("environment") or {}
    gpu = (f"{env['gpu']} ({env.get('capability')}), driver {env.get('driver')}" if env.get("gpu")
           else f"none (CPU: {env.get('cpu')})")
    lines = [f"# {title}" + (" (--tiny smoke run, not a benchmark)" if d.get("tiny") else ""), "",
             f"- GPU: {gpu}",
             f"- torch {env.get('torch')} (CUDA {env.get('cuda')}), cupy {env.get('cupy')}, diffusers "
             f"{env.get('diffusers')}, modelopt {env.get('modelopt')}, peft {env.get('peft')}; qwen_absorb "
             f"{env.get('qwen_absorb_commit')} (dirty: {env.get('git_dirty')}, sources {env.get('sources_sha256')})",
             f"- date: {d.get('date')}; run time {fmt(d.get('elapsed_s'), 1)} s"]
    return lines + ([f"- method: {method}"] if method else [])


def md_document(lines: list[str], d: dict[str, Any]) -> str:
    """A result document's markdown: its lines, then :func:`md_footer`."""
    return "\n".join(lines + md_footer(d)) + "\n"


def md_footer(d: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if d.get("skipped"):
        lines += ["", "Not measured:"] + [f"- `{k}`: {v}" for k, v in d["skipped"].items()]
    if d.get("errors"):
        lines += ["", "Errors:"] + [f"- {e['step']}: {e['error']}" for e in d["errors"]]
    if d.get("time_budget_reached"):
        lines += ["", f"Time budget: {d['time_budget_reached']}"]
    if d.get("timings_s"):
        lines += ["", f"Run time per step (s): `{json.dumps(d['timings_s'])}`"]
    return lines


# ------------------------------------------------------------------------------------------ arguments


def parser(doc: str, sections: tuple[str, ...] = (), budget_s: float = 0.0,
           description: str | None = None) -> argparse.ArgumentParser:
    """A script's argument parser: its docstring as help (first line as description, unless given) and
    :func:`add_common_args`."""
    ap = argparse.ArgumentParser(description=description or doc.split("\n")[0], epilog=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, sections, budget_s)
    return ap


def add_common_args(ap: argparse.ArgumentParser, sections: tuple[str, ...] = (), budget_s: float = 0.0) -> None:
    ap.add_argument("--tiny", action="store_true",
                    help="CPU smoke run on a tiny model (seconds; never writes into benchmarks/results unless --out)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default benchmarks/results; --tiny: a new temp folder)")
    if sections:
        ap.add_argument("--sections", default=",".join(sections), help=f"comma-separated subset of {','.join(sections)}")
    ap.add_argument("--budget-s", "--time-budget-s", dest="budget_s", type=float, default=budget_s,
                    help=f"do not start a new step after this many seconds (0: no limit; default {budget_s:.0f})")
    ap.add_argument("--device", default=None, help="default cuda (--tiny: cpu)")
    ap.add_argument("--seed", type=int, default=0)


STEADY_WARMUP_S = 3.0


def add_steady_warmup_arg(ap: argparse.ArgumentParser) -> None:
    """``--warmup-s``: keep warming each timed case up until this many seconds passed (:func:`time_calls`)."""
    ap.add_argument("--warmup-s", type=float, default=None,
                    help=f"warm each timed case up for at least this many seconds, so that every case is timed at "
                         f"steady clocks (default {STEADY_WARMUP_S:g}; --tiny: 0)")


def steady_warmup_s(a: argparse.Namespace) -> float:
    """The ``--warmup-s`` of a parsed namespace: its value, else 0 for ``--tiny`` and :data:`STEADY_WARMUP_S`."""
    v = getattr(a, "warmup_s", None)
    return float(v) if v is not None else (0.0 if getattr(a, "tiny", False) else STEADY_WARMUP_S)


def add_model_args(ap: argparse.ArgumentParser, layers: tuple[int, int], side: tuple[int, int] | None = None,
                   text: tuple[int, int] = (128, 8)) -> None:
    """--num-layers, --side (image tokens per side; omitted where ``side`` is None) and --text-tokens, each
    given as (default, --tiny default); :func:`resolve_model_args` fills them in after parsing."""
    ap.add_argument("--num-layers", type=int, default=None, help=f"blocks (default {layers[0]}; --tiny: {layers[1]})")
    if side is not None:
        ap.add_argument("--side", type=int, default=None, help=f"image tokens per side (default {side[0]} = "
                                                               f"{16 * side[0]}^2; --tiny: {side[1]})")
    ap.add_argument("--text-tokens", type=int, default=None, help=f"default {text[0]} (--tiny: {text[1]})")


def resolve_model_args(a: argparse.Namespace, layers: tuple[int, int], side: tuple[int, int] | None = None,
                       text: tuple[int, int] = (128, 8)) -> None:
    """The defaults of :func:`add_model_args` (the same arguments) where the command line left them out."""
    a.num_layers = a.num_layers or layers[a.tiny]
    if side is not None:
        a.side = a.side or side[a.tiny]
    a.text_tokens = a.text_tokens or text[a.tiny]


def finish_args(ap: argparse.ArgumentParser, a: argparse.Namespace, sections: tuple[str, ...] = (),
                tiny_prefix: str = "bench") -> argparse.Namespace:
    """Resolve --sections, --device (exit 2 with a clear line where CUDA is missing) and --out."""
    if sections:
        asked = {s.strip() for s in a.sections.split(",") if s.strip()}
        bad = asked - set(sections)
        if bad or not asked:
            ap.error(f"--sections: choose from {','.join(sections)} (got {sorted(bad) or 'nothing'})")
        a.sections = [s for s in sections if s in asked]
    a.device = torch.device(a.device or ("cpu" if a.tiny else "cuda"))
    if a.device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"CUDA is not available (torch {torch.__version__}): this benchmark runs on a GPU; "
                 "use --tiny for the CPU smoke run")
    if a.out is None:
        a.out = Path(tempfile.mkdtemp(prefix=f"{tiny_prefix}_tiny_")) if a.tiny else RESULTS
    a.out = Path(a.out).resolve()
    if a.tiny and a.device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only contend on a shared host
    return a


# ------------------------------------------------------------------------------------------ models and inputs


def build_transformer(tiny: bool, num_layers: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> torch.nn.Module:
    """``qwen_absorb.testing``'s tiny (CPU) or full-size random transformer, eval mode, on ``device``."""
    from qwen_absorb import testing as T  # noqa: PLC0415

    if tiny:
        return T.tiny_transformer(dtype=dtype, num_layers=num_layers, seed=seed).to(device).eval()
    return T.full_size_transformer(num_layers=num_layers, dtype=dtype, device=device, seed=seed).eval()


def inputs(model: torch.nn.Module, side: int, text: int, device: torch.device, dtype: torch.dtype,
           seed: int = 0, timestep: float = 0.5) -> dict[str, Any]:
    """Transformer kwargs: ``side`` x ``side`` image tokens (1024^2 = 64 x 64), ``text`` tokens, B = 1, no mask."""
    from qwen_absorb import testing as T  # noqa: PLC0415

    return T.transformer_inputs(model, batch_size=1, height=side, width=side, text_len=text, masked_tail=0,
                                seed=seed, timestep=timestep, device=device, dtype=dtype)


def as_dtype(kw: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    out = dict(kw)
    for k in ("hidden_states", "encoder_hidden_states", "timestep"):
        out[k] = kw[k].to(dtype)
    return out


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """ModelOpt prints one line per inserted quantizer group: keep the progress log readable."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def load_modelopt() -> Any:
    """Import ModelOpt here, before any model exists: its first (lazy) import keeps the importing frame alive,
    and a frame holding a model would keep that model resident after ``del`` (issue 18)."""
    import modelopt.torch.quantization as mtq  # noqa: PLC0415

    return mtq


def fp8_quantize(model: torch.nn.Module, calib: dict[str, Any] | list[dict[str, Any]]) -> float:
    """ModelOpt ``FP8_DEFAULT_CFG`` (fake quant), calibrated on ``calib``, in place; returns the seconds."""
    from qwen_absorb import testing as T  # noqa: PLC0415

    load_modelopt()
    t0 = time.perf_counter()
    with quiet():
        T.fp8_quantize(model, calib)
    sync(next(model.parameters()).device)
    return round(time.perf_counter() - t0, 1)


def flow_match_denoise(model: Any, kw: dict[str, Any], latents: torch.Tensor, steps: int,
                       device: torch.device) -> torch.Tensor:
    """The step runner: a FlowMatch Euler loop (no CFG) from ``latents``, as QwenImagePipeline runs the
    transformer; ``kw`` holds the other inputs (copied). Returns the fp32 latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: PLC0415

    kw = dict(kw)
    sched = FlowMatchEulerDiscreteScheduler()
    sched.set_timesteps(steps, device=device)
    dtype = latents.dtype
    with torch.inference_mode():
        for t in sched.timesteps:
            kw["hidden_states"] = latents
            kw["timestep"] = (t.expand(latents.shape[0]) / 1000).to(dtype)
            latents = sched.step(model(**kw)[0], t, latents, return_dict=False)[0]
    sync(device)
    return latents.float()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    d = out.double() - ref.double()
    return (d.norm() / ref.double().norm().clamp_min(1e-300)).item()


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def tiny_vae(z_dim: int, scale_factor: int = 8, dtype: torch.dtype = torch.bfloat16,
             device: torch.device | str = "cpu") -> torch.nn.Module:
    """A tiny random Qwen-Image VAE with ``z_dim`` latent channels and a 4x or 8x spatial factor."""
    from diffusers import AutoencoderKLQwenImage  # noqa: PLC0415

    dim_mult, down = ([1, 2, 4], [False, True]) if scale_factor == 4 else ([1, 2, 4, 4], [False, True, True])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        vae = AutoencoderKLQwenImage(base_dim=24, z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=1,
                                     temperal_downsample=down, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim)
    return vae.to(device=device, dtype=dtype).eval()


def prompt_kwargs(dim: int, device: torch.device, dtype: torch.dtype, seed: int = 0, length: int = 128,
                  neg_length: int = 32) -> dict[str, Any]:
    """Precomputed prompt and negative prompt embeddings (masks all ones), true CFG on (scale 4)."""
    g = torch.Generator().manual_seed(seed + 1234)
    pe, npe = torch.randn(1, length, dim, generator=g), torch.randn(1, neg_length, dim, generator=g)
    return {"prompt_embeds": pe.to(device, dtype), "prompt_embeds_mask": torch.ones(1, length, dtype=torch.long,
                                                                                    device=device),
            "negative_prompt_embeds": npe.to(device, dtype),
            "negative_prompt_embeds_mask": torch.ones(1, neg_length, dtype=torch.long, device=device),
            "true_cfg_scale": 4.0}


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


@contextlib.contextmanager
def capture_block_inputs(model: torch.nn.Module, idx: int, store: dict[str, Any]) -> Iterator[None]:
    """Keep a copy of the (args, kwargs) of the first call of ``transformer_blocks[idx]``."""
    def hook(_mod: Any, args: Any, kwargs: Any) -> None:
        if "kwargs" not in store:
            store["args"], store["kwargs"] = _clone(args), _clone(kwargs)

    h = model.transformer_blocks[idx].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        h.remove()


# ------------------------------------------------------------------------------------------ the fused ops

OPS = ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift", "bias_gate_residual")
EPS = 1e-6


def op_sets(shape: tuple[int, int, int], k: int, device: torch.device, seed: int = 0) -> list[tuple]:
    """``k`` distinct bf16 input sets ``(x, residual, shift, scale, gate, bias)`` of the fused ops."""
    gen = torch.Generator(device=device).manual_seed(seed)
    B, L, D = shape
    sets = []
    for _ in range(k):
        shift, scale, gate = (t.unsqueeze(1) for t in torch.randn(B, 3 * D, generator=gen, device=device)
                              .bfloat16().chunk(3, dim=-1))
        sets.append((torch.randn(shape, generator=gen, device=device).bfloat16(),
                     torch.randn(shape, generator=gen, device=device).bfloat16(), shift, scale, gate,
                     torch.randn(D, generator=gen, device=device).bfloat16()))
    return sets


def op_call(op: str, impl: str = "qwen_absorb") -> Callable[..., Any]:
    """``fn(x, r, shift, scale, gate, bias)``: the public fused op as the block calls it, or (``impl="eager"``)
    diffusers' eager expression it replaces."""
    import qwen_absorb.ops as o  # noqa: PLC0415

    ln = torch.nn.functional.layer_norm
    calls = {
        ("layer_norm_scale_shift", "eager"): lambda x, r, sh, sc, g, b: ln(x, x.shape[-1:], eps=EPS) * (1 + sc) + sh,
        ("layer_norm_scale_shift", "qwen_absorb"):
            lambda x, r, sh, sc, g, b: o.layer_norm_scale_shift(x, shift=sh, scale=sc, eps=EPS),
        ("bias_residual_layer_norm_scale_shift", "eager"):
            lambda x, r, sh, sc, g, b: (lambda h: (h, ln(h, h.shape[-1:], eps=EPS) * (1 + sc) + sh))(r + g * (x + b)),
        ("bias_residual_layer_norm_scale_shift", "qwen_absorb"):
            lambda x, r, sh, sc, g, b: o.bias_residual_layer_norm_scale_shift(r, x, bias=b, gate=g, shift=sh,
                                                                              scale=sc, eps=EPS),
        ("bias_gate_residual", "eager"): lambda x, r, sh, sc, g, b: r + g * (x + b),
        ("bias_gate_residual", "qwen_absorb"): lambda x, r, sh, sc, g, b: o.bias_gate_residual(r, x, bias=b, gate=g),
    }
    return calls[(op, impl)]


# ------------------------------------------------------------------------------------------ the patch


def patch(model: torch.nn.Module, fresh: bool = True, **kw: Any) -> tuple[Any, str | None]:
    """``qwen_absorb.patch(model, **kw)`` (from an unpatched state unless ``fresh=False``, where a patched model
    is re-patched as a user would): ``(report, None)`` or ``(None, reason)``, never an exception.
    ``cuda_graph`` is False unless given: the cases named "patched" here are the eager patched call (the
    library default, ``cuda_graph="auto"``, is measured by benchmarks/speed.py as its own case)."""
    import qwen_absorb  # noqa: PLC0415

    kw.setdefault("cuda_graph", False)
    if fresh:
        qwen_absorb.unpatch(model)
    try:
        return qwen_absorb.patch(model, **kw), None
    except Exception as e:  # noqa: BLE001 - e.g. a keyword this build lacks, a feature refusing on CPU
        with contextlib.suppress(Exception):
            qwen_absorb.unpatch(model)
        return None, f"qwen_absorb.patch({', '.join(f'{k}={v!r}' for k, v in kw.items())}) raised " \
                     f"{type(e).__name__}: {e}"


def summary(rep: Any) -> dict[str, Any] | None:
    if rep is None:
        return None
    try:
        return json_safe(dict(rep.summary))
    except Exception as e:  # noqa: BLE001
        return {"error": f"report.summary failed: {type(e).__name__}: {e}"}


def fallbacks(rep: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(getattr(rep, "runtime_fallbacks", None) or {}).items()}


def dynamo_counters() -> dict[str, Any]:
    """Dynamo's counters since the last ``counters.clear()``: graphs, graph breaks (with reasons), recompiles."""
    from torch._dynamo.utils import counters  # noqa: PLC0415

    out: dict[str, Any] = {k: dict(counters[k]) for k in ("stats", "frames") if k in counters}
    gb = counters.get("graph_break") or {}
    out["graph_breaks"] = int(sum(gb.values()))
    if gb:
        out["graph_break_reasons"] = {str(k)[:200]: int(v) for k, v in list(gb.items())[:5]}
    out.update({k: dict(counters[k]) for k in counters if "recompil" in k})
    return out


def peak_memory_gib(device: torch.device, reset: bool = True) -> float | None:
    """``torch.cuda.max_memory_allocated`` in GiB since the last reset (None off CUDA); resets it unless told not."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    if reset:
        torch.cuda.reset_peak_memory_stats(device)
    return peak
