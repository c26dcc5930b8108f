"""The benchmarks' provenance, result documents, markdown and common arguments (no timing, no models);
:mod:`harness` re-exports its names, so scripts use ``import harness as H`` only.

:class:`Results` is rewritten atomically after every measurement (a killed run keeps what was done; a value not
measured stays ``null`` with its reason under ``skipped``); :class:`Steps` runs named steps under a time budget;
``--tiny`` (:func:`finish_args`) never writes into ``benchmarks/results`` unless ``--out`` says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import hashlib
import importlib.metadata as _md
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:  # a checkout that was not pip-installed; PYTHONPATH (the GPU machine) wins
    sys.path.append(str(ROOT))

import torch  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


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


def git_commit(root: Path = ROOT) -> str | None:
    return _run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"])


def sources_sha256(root: Path = ROOT) -> str | None:
    """Hash of the qwen_absorb sources run (the device copy may have no .git, the tree may be dirty)."""
    h = hashlib.sha256()
    try:
        for p in sorted((root / "qwen_absorb").rglob("*")):
            if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".h"):
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    except OSError:
        return None
    return h.hexdigest()[:16]


def qwen_absorb_version() -> str | None:
    """The package version of the qwen_absorb that runs (the device copy may have no .git): its metadata where
    it was installed, else the ``version`` line of the checkout's pyproject.toml."""
    v = _version("qwen_absorb") or _version("qwen-absorb")
    if v is None:
        with contextlib.suppress(OSError):
            for line in (ROOT / "pyproject.toml").read_text().splitlines():
                if line.strip().startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"\'')
    return v


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
        "qwen_absorb_commit": git_commit(),
        "qwen_absorb_version": qwen_absorb_version(),
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
                "qwen_absorb_commit", "qwen_absorb_version")


def gpu_file_tag(device: torch.device | str = "cuda") -> str:
    """``h200`` / ``h100`` / ``b200``...: the results file's name says the card it was measured on (``gpu``
    where the name tells none)."""
    name = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else ""
    found = re.search(r"\b([A-Z]{1,2}\d{2,3})\b", name)
    return found.group(1).lower() if found else "gpu"


def head(benchmark: str, env: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """The first keys of every results document."""
    return {"benchmark": benchmark, "gpu": env.get("gpu"), "date": env.get("date"),
            "versions": {k: env.get(k) for k in VERSION_KEYS}, "environment": env,
            "config": json_safe(config), "tiny": bool(config.get("tiny"))}


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
    the result files), ``cfg`` (the arguments as recorded) and the GPU's L2 size in bytes (0 where unknown)."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.dev = a, a.device
        self.cuda = self.dev.type == "cuda"
        self.env = environment(self.dev)
        self.cfg = {**vars(a), "device": str(a.device), "out": str(a.out)}
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
            msg, tb = f"{type(e).__name__}: {e}", traceback.format_exc(limit=-10)  # the innermost frames: where it raised
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
    if not isinstance(v, float) or not math.isfinite(v):
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
             f"{env.get('qwen_absorb_commit') or env.get('qwen_absorb_version')} (dirty: {env.get('git_dirty')}, "
             f"sources {env.get('sources_sha256')})",
             f"- date: {d.get('date')}; run time {fmt(d.get('elapsed_s'), 1)} s"]
    return lines + ([f"- method: {method}"] if method else [])


def md_document(lines: list[str], d: dict[str, Any]) -> str:
    """A result document's markdown: its lines, then what was not measured, the errors, the budget, the step times."""
    lines = list(lines)
    if d.get("skipped"):
        lines += ["", "Not measured:"] + [f"- `{k}`: {v}" for k, v in d["skipped"].items()]
    if d.get("errors"):
        lines += ["", "Errors:"] + [f"- {e['step']}: {e['error']}" for e in d["errors"]]
    if d.get("time_budget_reached"):
        lines += ["", f"Time budget: {d['time_budget_reached']}"]
    if d.get("timings_s"):
        lines += ["", f"Run time per step (s): `{json.dumps(d['timings_s'])}`"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ arguments


def parser(doc: str, sections: tuple[str, ...] = (), budget_s: float = 0.0,
           description: str | None = None) -> argparse.ArgumentParser:
    """A script's argument parser: its docstring as help (first line as description, unless given) and the
    common arguments ``--tiny``, ``--out``, ``--sections`` (where there are sections), ``--budget-s``,
    ``--device``, ``--seed``."""
    ap = argparse.ArgumentParser(description=description or doc.split("\n")[0], epilog=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return ap


def add_int_args(ap: argparse.ArgumentParser, defaults: dict[str, tuple[int, int]], tiny: str = "--tiny") -> None:
    """``--<name>`` integers of ``{name: (default, --tiny default)}``; :func:`finish_args` fills them in."""
    for k, (full, small) in defaults.items():
        ap.add_argument("--" + k.replace("_", "-"), type=int, default=None, help=f"default {full} ({tiny}: {small})")


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


def finish_args(ap: argparse.ArgumentParser, a: argparse.Namespace, sections: tuple[str, ...] = (),
                tiny_prefix: str = "bench", defaults: dict[str, tuple[int, int]] | None = None) -> argparse.Namespace:
    """Resolve --sections, --device (exit 2 with a clear line where CUDA is missing), --out and the
    :func:`add_int_args` ``defaults`` the command line left out."""
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
        subject = RESULTS / tiny_prefix  # results are filed by subject (results/README.md)
        a.out = Path(tempfile.mkdtemp(prefix=f"{tiny_prefix}_tiny_")) if a.tiny else (
            subject if subject.is_dir() else RESULTS)
    a.out = Path(a.out).resolve()
    if a.tiny and a.device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: threads only contend on a shared host
    for k, v in (defaults or {}).items():
        if getattr(a, k) is None:
            setattr(a, k, v[a.tiny])
    return a
