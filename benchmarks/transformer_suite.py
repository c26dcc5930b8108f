#!/usr/bin/env python
"""One device-efficient run of the full 60-layer Qwen-Image transformer: host cost and real FP8 GEMMs.

ONE process builds the random full-size transformer (bf16, ~41 GB) once and measures, side by side:

section ``host`` -> ``<out>/host_cost.json`` (merged: keys this script does not own are kept) + ``host_cost.md``
    ``"1024"`` / ``"512"`` (4096 / 1024 image tokens): bf16 unpatched vs ``qwen_absorb.patch`` (default):
    wall ms, GPU busy ms, kernels per call; ``"fp8_1024"``: ModelOpt FP8 fake quant, unpatched vs patched
    with the patch default (``patched_ms``) and with ``fp8_gemm=False`` (``patched_fake_ms``).

section ``fp8`` -> ``<out>/fp8_gemm.json`` + ``fp8_gemm.md``
    At 1024^2: bf16 eager vs ModelOpt FP8 fake quant (unpatched) vs the same FP8 model patched with
    ``fp8_gemm=True`` (real FP8 ``torch._scaled_mm``): wall, GPU busy, kernels per call and per block, one
    block's time; fidelity against an fp32 reference (one forward, and the final latents of a 4-step
    FlowMatch Euler loop; the method of ``benchmarks/fidelity.py``); model memory (bf16, FP8 fake, real FP8
    patched, real FP8 with ``offload_original_weights=True``).

Order of work (one model, modified in place, so the GPU never holds more than ~82 GB):
    build bf16 -> [fp8] fp32 reference (the same weights upcast in place, TF32 off; bf16 -> fp32 -> bf16 is
    exact) -> bf16 unpatched / patched -> ModelOpt FP8 fake quant in place (calibrated) -> unpatched ->
    [fp8] patched fp8_gemm=True (+ the other use_fast_accum) -> [host] patched default -> [host] patched
    fp8_gemm=False -> [fp8] fp8_gemm=True + offload_original_weights=True (last: it moves weights around).

Method: B = 1, 128 text tokens, bf16 activations, ``torch.inference_mode()``, no text mask (the pipelines pass
None when it is all ones). Per case: one first call (compiles, extension builds, capture of one block's
inputs), ``--warmup`` (>= 2) warm-up calls, then ``--iters`` timed calls (``--fp8-fake-iters`` for the slow
fake-quant cases), each between CUDA events with a synchronize after it (wall time of one call); median
reported. GPU busy: one more call under ``torch.profiler`` (CUDA activity only), the sum of the device
durations of its kernels (memcpy/memset counted apart). Memory: ``torch.cuda.memory_allocated`` after
gc + synchronize + empty_cache, minus what was allocated before the model was built.

Every measurement is written as soon as it exists (JSON re-written atomically), so a killed run keeps what
was done; keys that could not be measured stay ``null`` with a reason under ``skipped``.

    python benchmarks/transformer_suite.py                       # H200, 60 layers: ~4-5 min (incl. ~60 s ModelOpt ext build)
    python benchmarks/transformer_suite.py --sections fp8        # one section
    python benchmarks/transformer_suite.py --tiny --out /tmp/ts  # CPU smoke run of the same code paths (seconds)

``qwen_absorb.patch`` keywords this build may lack (``fp8_gemm``, ``offload_original_weights``) are called
through :func:`call_patch`: a missing keyword is reported as "not available in this build", not a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import hashlib
import inspect
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

# ModelOpt builds its FP8 CUDA extension on first use (~60 s): keep the build under /tmp (a folder that a
# later run on the same machine, or an unpacked archive of it, can reuse). Must be set before modelopt loads.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/qwen_absorb_torch_extensions")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks", ROOT / "examples"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import _common as C  # noqa: E402  (examples/_common.py: json_safe, runtime_fallbacks, git_commit)
import qwen_absorb  # noqa: E402
from bench_block import env_info, sync  # noqa: E402
from fidelity import flow_match_denoise, rel_err  # noqa: E402
from qwen_absorb import testing as T  # noqa: E402

SECTIONS = ("host", "fp8")
HOST_OWNED = ("1024", "512", "fp8_1024", "transformer_suite")  # top-level keys of host_cost.json we write
NEEDS_CUDA = "needs CUDA"
T0 = time.perf_counter()


def md_footer(d: dict[str, Any]) -> list[str]:
    """The closing lines of a results markdown: what was not measured, errors, run time per step."""
    lines: list[str] = []
    if d.get("skipped"):
        lines += ["", "Not measured:"] + [f"- `{k}`: {v}" for k, v in d["skipped"].items()]
    if d.get("errors"):
        lines += ["", "Errors:"] + [f"- {e['step']}: {e['error']}" for e in d["errors"]]
    if d.get("timings_s"):
        lines += ["", f"Run time per step (s): `{json.dumps(d['timings_s'])}`"]
    return lines


def log(msg: str) -> None:
    now = _dt.datetime.now().strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------- results files


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _dumps(obj: Any) -> str:
    return json.dumps(C.json_safe(obj), indent=2) + "\n"


class Doc:
    """One results document. ``put(path, value)`` sets a dotted key; a ``None`` value with a reason is
    recorded under ``skipped``: per object for host_cost.json (``data["1024"]["skipped"]``), top-level with
    the dotted path for fp8_gemm.json."""

    def __init__(self, data: dict[str, Any], per_object_skips: bool):
        self.data = data
        self.per_object = per_object_skips

    def _skips(self, path: str) -> tuple[dict[str, Any], str]:
        head, _, rest = path.partition(".")
        if self.per_object and rest and isinstance(self.data.get(head), dict):
            return self.data[head].setdefault("skipped", {}), rest
        return self.data.setdefault("skipped", {}), path

    def get(self, path: str) -> Any:
        d: Any = self.data
        for k in path.split("."):
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    def put(self, path: str, value: Any, reason: str | None = None) -> None:
        keys = path.split(".")
        d = self.data
        for k in keys[:-1]:
            d = d.setdefault(k, {})
        d[keys[-1]] = value
        skips, rel = self._skips(path)
        if value is None and reason:
            skips[rel] = reason
        elif value is not None:
            skips.pop(rel, None)

    def skip_if_missing(self, path: str, reason: str) -> None:
        if self.get(path) is None:
            skips, rel = self._skips(path)
            skips.setdefault(rel, reason)

    def leaf_paths(self, template: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for k, v in template.items():
            p = f"{prefix}{k}"
            if isinstance(v, dict) and v:
                out += self.leaf_paths(v, p + ".")
            else:
                out.append(p)
        return out


def host_template(n_img: dict[str, int], txt: int) -> dict[str, Any]:
    res = lambda r: {  # noqa: E731
        "image_tokens": n_img[r], "text_tokens": txt,
        "unpatched_ms": None, "patched_ms": None,
        "unpatched_gpu_busy_ms": None, "patched_gpu_busy_ms": None,
        "unpatched_kernels_per_call": None, "patched_kernels_per_call": None,
        "speedup_patched_vs_unpatched": None,
        "unpatched_wall_minus_busy_ms": None, "patched_wall_minus_busy_ms": None,
        "patched_report_summary": None, "patched_runtime_fallbacks": None,
        "samples_ms": {}, "skipped": {},
    }
    return {
        "1024": res("1024"),
        "512": res("512"),
        "fp8_1024": {
            "image_tokens": n_img["1024"], "text_tokens": txt,
            "unpatched_ms": None, "patched_ms": None, "patched_fake_ms": None,
            "unpatched_gpu_busy_ms": None, "patched_gpu_busy_ms": None, "patched_fake_gpu_busy_ms": None,
            "unpatched_kernels_per_call": None, "patched_kernels_per_call": None,
            "patched_fake_kernels_per_call": None,
            "speedup_patched_vs_unpatched": None, "speedup_patched_fake_vs_unpatched": None,
            "patched_report_summary": None, "patched_fake_report_summary": None,
            "patched_runtime_fallbacks": None, "patched_fake_runtime_fallbacks": None,
            "patched_fp8_gemm_linears": None,
            "samples_ms": {}, "skipped": {},
        },
    }


def fp8_template() -> dict[str, Any]:
    return {
        "bf16_eager_ms": None, "fp8_fake_ms": None, "fp8_real_ms": None,
        "bf16_eager_gpu_busy_ms": None, "fp8_fake_gpu_busy_ms": None, "fp8_real_gpu_busy_ms": None,
        "fp8_real_block_ms": None, "fp8_real_block_ms_method": None,
        "fp8_real_ms_per_layer": None,
        "fp8_real_kernels_per_block": None, "bf16_patched_kernels_per_block": None,
        "kernels_per_block": {"bf16_unpatched": None, "bf16_patched": None, "fp8_fake": None, "fp8_real": None},
        "block_ms": {"bf16_unpatched": None, "bf16_patched": None, "fp8_fake": None, "fp8_real": None},
        "kernels_per_call": {"bf16_eager": None, "fp8_fake": None, "fp8_real": None},
        "fidelity_ratio_forward": None, "fidelity_ratio_latents": None,
        "fidelity": {
            "rel_err_forward": {"bf16": None, "fp8_fake": None, "fp8_real": None},
            "rel_err_latents": {"bf16": None, "fp8_fake": None, "fp8_real": None},
            "real_vs_fake_rel_diff_forward": None,
            "finite": {"fp8_fake": None, "fp8_real": None},
        },
        "memory_gb": {"bf16": None, "fp8_fake": None, "fp8_real_patched": None, "fp8_real_offloaded": None},
        "memory_ratios": {"fp8_real_patched_vs_bf16": None, "fp8_real_offloaded_vs_bf16": None,
                          "fp8_real_offloaded_vs_fake": None},
        "fp8_real_vs_bf16": None, "fp8_real_vs_fake": None,
        "use_fast_accum": None, "use_fast_accum_note": None,
        "offload_output_identical": None,
        "fp8_real_report_summary": None, "fp8_real_runtime_fallbacks": None, "fp8_real_linears": None,
        "fp8_real_offloaded_ms": None, "offload_output_rel_diff": None,
        "fast_accum": {"use_fast_accum": None, "fp8_real_ms": None, "gpu_busy_ms": None,
                       "speedup_vs_fp8_real": None, "rel_err_forward": None, "rel_err_latents": None,
                       "fidelity_ratio_forward": None, "fidelity_ratio_latents": None},
        "profiles": {}, "memory_detail": {}, "samples_ms": {},
        "skipped": {},
    }


RATIO_DEFINITIONS = {
    "fp8_real_vs_bf16": "bf16_eager_ms / fp8_real_ms (speed-up of real FP8 over bf16 eager; > 1: real FP8 faster)",
    "fp8_real_vs_fake": "fp8_fake_ms / fp8_real_ms (speed-up of real FP8 over unpatched ModelOpt fake quant)",
    "fidelity_ratio_*": "rel err of real FP8 vs the fp32 reference / rel err of ModelOpt fake quant vs the same "
                        "reference (< 1: real FP8 closer to fp32)",
    "memory_ratios.*": "model footprint ratios (memory_gb values)",
}


class Results:
    def __init__(self, out_dir: Path, sections: list[str], meta: dict[str, Any], n_img: dict[str, int], txt: int):
        self.out_dir = out_dir
        self.sections = sections
        self.meta = meta
        self.host_path = out_dir / "host_cost.json"
        self.fp8_path = out_dir / "fp8_gemm.json"
        self.host = Doc(host_template(n_img, txt), per_object_skips=True) if "host" in sections else None
        self.fp8 = Doc(fp8_template(), per_object_skips=False) if "fp8" in sections else None
        self._host_template = host_template(n_img, txt)
        self._fp8_template = fp8_template()
        if self.host is not None:
            self.host.data["transformer_suite"] = meta
        if self.fp8 is not None:
            self.fp8.data = {"benchmark": "benchmarks/transformer_suite.py (section fp8)", **meta,
                             "ratio_definitions": RATIO_DEFINITIONS, **self.fp8.data}

    def flush(self) -> None:
        if self.host is not None:
            existing: dict[str, Any] = {}
            if self.host_path.exists():
                try:
                    existing = json.loads(self.host_path.read_text())
                    if not isinstance(existing, dict):
                        raise ValueError("not a JSON object")
                except (OSError, ValueError) as e:
                    bak = self.host_path.with_suffix(f".json.unreadable-{int(time.time())}")
                    with contextlib.suppress(OSError):
                        self.host_path.replace(bak)
                    log(f"WARNING: {self.host_path} was unreadable ({e}); moved to {bak.name}")
                    existing = {}
            for k in HOST_OWNED:
                existing[k] = self.host.data[k]
            _atomic_write(self.host_path, _dumps(existing))
            _atomic_write(self.out_dir / "host_cost.md", host_markdown(existing))
        if self.fp8 is not None:
            self.fp8.data.update(self.meta)  # env, config, timings, errors: current values
            _atomic_write(self.fp8_path, _dumps(self.fp8.data))
            _atomic_write(self.out_dir / "fp8_gemm.md", fp8_markdown(self.fp8.data))

    def finalize(self, reason: str) -> None:
        """Every key of the templates present; every null without a reason gets ``reason``."""
        for doc, tmpl in ((self.host, self._host_template), (self.fp8, self._fp8_template)):
            if doc is None:
                continue
            for p in doc.leaf_paths(tmpl):
                if p.split(".")[-1] in ("skipped", "samples_ms", "profiles", "memory_detail"):
                    continue
                if doc.get(p) is None:
                    doc.skip_if_missing(p, reason)
        self.flush()


# ------------------------------------------------------------------------------------------- measurement


def mem_alloc(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def host_rss_gb() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return None


def time_fn(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> dict[str, Any]:
    """``warmup`` untimed calls, then ``iters`` calls each between CUDA events and synchronized after it (the
    wall time of one call, host launch work included); perf_counter around each call as a cross-check."""
    for _ in range(warmup):
        fn()
    sync(device)
    ev, wall = [], []
    for _ in range(iters):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            s.record()
            fn()
            e.record()
            e.synchronize()
            wall.append((time.perf_counter() - t0) * 1e3)
            ev.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            wall.append((time.perf_counter() - t0) * 1e3)
            ev.append(wall[-1])
    return {
        "median_ms": statistics.median(ev), "min_ms": min(ev), "max_ms": max(ev),
        "samples_ms": [round(x, 4) for x in ev], "perf_counter_median_ms": statistics.median(wall),
        "warmup": warmup, "iters": iters, "timer": "cuda_events" if device.type == "cuda" else "perf_counter",
    }


def profile_fn(fn: Callable[[], Any], device: torch.device) -> tuple[dict[str, Any] | None, str | None]:
    """One call under torch.profiler (CUDA activity): kernels, the sum of their device durations (GPU busy),
    memcpy/memset apart, and the kernels that took the most time. ``(None, reason)`` off CUDA.

    Device-side ``FunctionEvent``s (``device_type == DeviceType.CUDA``) carry their GPU interval in
    ``time_range`` (microseconds); ``self_device_time_total`` returns the same for them (torch 2.11-2.13), kept
    as a cross-check. GPU-side user annotations (``is_user_annotation``) are ranges, not kernels: excluded.
    """
    if device.type != "cuda":
        return None, f"{NEEDS_CUDA} (torch.profiler CUDA activity); device is {device.type}"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    kernels = mem_n = 0
    busy_us = mem_us = check_us = 0.0
    names: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        dur = float(e.time_range.elapsed_us())
        low = e.name.lower()
        if "memcpy" in low or "memset" in low:
            mem_n += 1
            mem_us += dur
            continue
        kernels += 1
        busy_us += dur
        with contextlib.suppress(Exception):
            check_us += float(e.self_device_time_total)
        a = names.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += dur
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:12]
    return {
        "kernels_per_call": kernels, "gpu_busy_ms": busy_us / 1e3,
        "gpu_busy_check_ms_self_device_time_total": check_us / 1e3,
        "memops_per_call": mem_n, "memops_ms": mem_us / 1e3,
        "top_kernels_by_time": [{"name": n[:140], "count": int(c), "ms": round(t / 1e3, 4)} for n, (c, t) in top],
    }, None


def _clone_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, tuple):
        return tuple(_clone_tree(v) for v in x)
    if isinstance(x, list):
        return [_clone_tree(v) for v in x]
    if isinstance(x, dict):
        return {k: _clone_tree(v) for k, v in x.items()}
    return x


@contextlib.contextmanager
def capture_block_inputs(model: torch.nn.Module, idx: int, store: dict[str, Any]):
    """Keep a copy of the (args, kwargs) of the first call of ``transformer_blocks[idx]``."""
    blk = model.transformer_blocks[idx]

    def hook(_mod, args, kwargs):
        if "kwargs" not in store:
            store["args"], store["kwargs"] = _clone_tree(args), _clone_tree(kwargs)

    h = blk.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        h.remove()


def measure(label: str, fn: Callable[[], Any], device: torch.device, warmup: int, iters: int,
            capture: tuple[torch.nn.Module, int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """First call (+ optional capture of one block's inputs), then timing, then one profiled call."""
    log(f"  {label}: first call ...")
    with torch.inference_mode():
        t0 = time.perf_counter()
        with capture_block_inputs(*capture) if capture else contextlib.nullcontext():
            fn()
        sync(device)
        first = time.perf_counter() - t0
        r: dict[str, Any] = {"first_call_s": round(first, 3)}
        r.update(time_fn(fn, device, warmup, iters))
        prof, why = profile_fn(fn, device)
    r["profile"] = prof
    r["profile_skipped"] = why
    log(f"  {label}: median {r['median_ms']:.3f} ms (first call {first:.1f} s)"
        + (f", GPU busy {prof['gpu_busy_ms']:.3f} ms, {prof['kernels_per_call']} kernels" if prof else ""))
    return r


def busy(r: dict[str, Any] | None) -> tuple[float | None, str | None]:
    if r is None:
        return None, "not measured"
    p = r.get("profile")
    return (p["gpu_busy_ms"], None) if p else (None, r.get("profile_skipped"))


def kcount(r: dict[str, Any] | None) -> tuple[int | None, str | None]:
    if r is None:
        return None, "not measured"
    p = r.get("profile")
    return (p["kernels_per_call"], None) if p else (None, r.get("profile_skipped"))


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# ------------------------------------------------------------------------------------------- the patch API


def call_patch(model: torch.nn.Module, **kw: Any) -> tuple[Any, str | None]:
    """``qwen_absorb.patch(model, **kw)`` from an unpatched state: ``(report, None)`` or ``(None, reason)``.

    A keyword this build's ``patch`` does not take is "not available in this build" (checked on the
    signature, and on the TypeError if the signature hides it); any other exception is reported, not raised.
    """
    qwen_absorb.unpatch(model)
    try:
        params = inspect.signature(qwen_absorb.patch).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        missing = [k for k in kw if k not in params and not var_kw]
    except (TypeError, ValueError):
        missing = []
    if missing:
        return None, f"not available in this build: qwen_absorb.patch() has no keyword {', '.join(missing)}"
    try:
        return qwen_absorb.patch(model, **kw), None
    except TypeError as e:
        with contextlib.suppress(Exception):
            qwen_absorb.unpatch(model)
        if "keyword" in str(e):
            return None, f"not available in this build: qwen_absorb.patch({_kw(kw)}) raised TypeError: {e}"
        return None, f"qwen_absorb.patch({_kw(kw)}) raised TypeError: {e}"
    except Exception as e:  # e.g. a feature that needs CUDA refusing on CPU
        with contextlib.suppress(Exception):
            qwen_absorb.unpatch(model)
        return None, f"qwen_absorb.patch({_kw(kw)}) raised {type(e).__name__}: {e}"


def _kw(kw: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kw.items())


def report_summary(rep: Any) -> dict[str, Any] | None:
    if rep is None:
        return None
    try:
        return C.json_safe(dict(rep.summary))
    except Exception as e:
        return {"error": f"report.summary failed: {type(e).__name__}: {e}"}


def find_keys(obj: Any, needle: str, path: str = "") -> dict[str, Any]:
    """Every ``key: value`` whose key contains ``needle`` (recursively), by path; lists summarised."""
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{path}.{k}" if path else str(k)
            if needle in str(k).lower() and not isinstance(v, (dict, list)):
                out[p] = v
            out.update(find_keys(v, needle, p))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(find_keys(v, needle, f"{path}[{i}]"))
    return out


def fast_accum(rep: Any, passed: dict[str, Any]) -> tuple[Any, str]:
    """``use_fast_accum`` of the FP8 GEMMs: what the report says (the single value if uniform), else what
    ``patch()`` was given or defaults to (from its signature), said so."""
    attr = getattr(rep, "use_fast_accum", None)
    if isinstance(attr, bool):
        return attr, "report.use_fast_accum"
    try:
        d = rep.to_dict()
    except Exception as e:
        d = {}
        why = f"report.to_dict() failed: {type(e).__name__}: {e}"
    else:
        why = "the patch report does not expose use_fast_accum"
    found = find_keys(d, "fast_accum")
    if not found:
        if "use_fast_accum" in passed:
            return passed["use_fast_accum"], f"{why}; value passed to patch()"
        try:
            p = inspect.signature(qwen_absorb.patch).parameters.get("use_fast_accum")
        except (TypeError, ValueError):
            p = None
        if p is not None and p.default is not inspect.Parameter.empty:
            return p.default, f"{why}; patch() default (use_fast_accum={p.default!r}), not passed here"
        return None, f"{why}; patch() takes no use_fast_accum keyword"
    vals = {json.dumps(v, default=str) for v in found.values()}
    if len(vals) == 1:
        v = next(iter(found.values()))
        return v, f"reported uniformly by {len(found)} report field(s), e.g. {next(iter(found))}"
    return sorted(vals), f"reported with differing values in {len(found)} report fields"


# ------------------------------------------------------------------------------------------- the suite


class Suite:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.sections = args.sections
        self.errors: list[dict[str, str]] = []
        self.timings: dict[str, float] = {}
        self.budget_hit: str | None = None
        self.not_started: list[str] = []
        self.block_why = "not measured"
        self.section_s: dict[str, float] = {}
        self.model: torch.nn.Module | None = None
        self.stage = "none"  # bf16 | fp8_fake (the model is modified in place)

    # ---------------------------------------------------------------- plumbing
    def elapsed(self) -> float:
        return time.perf_counter() - T0

    def over_budget(self) -> bool:
        b = self.args.time_budget_s
        return bool(b) and self.elapsed() > b

    def step(self, name: str, needed_by: set[str], fills: list[tuple[Doc | None, str]], fn: Callable[[], None]) -> bool:
        """Run one step if a selected section needs it and the budget allows; record why not otherwise."""
        fills = [(d, p) for d, p in fills if d is not None]
        if not needed_by & set(self.sections):
            return False
        if self.over_budget():
            why = f"time budget {self.args.time_budget_s:.0f} s reached ({self.elapsed():.0f} s) before step '{name}'"
            self.budget_hit = (f"time budget {self.args.time_budget_s:.0f} s reached; steps not started: "
                               + ", ".join(self.not_started + [name]))
            self.not_started.append(name)
            log(f"SKIP {name}: {why}")
            for d, p in fills:
                d.skip_if_missing(p, why)
            self.R.flush()
            return False
        log(f"step {name} ...")
        t0 = time.perf_counter()
        ok = True
        try:
            fn()
        except Exception as e:
            ok = False
            tb = traceback.format_exc(limit=6)
            self.errors.append({"step": name, "error": f"{type(e).__name__}: {e}", "traceback": tb})
            log(f"ERROR in step {name}: {type(e).__name__}: {e}\n{tb}")
            for d, p in fills:
                d.skip_if_missing(p, f"error in step '{name}': {type(e).__name__}: {e}")
            with contextlib.suppress(Exception):
                if self.model is not None:
                    qwen_absorb.unpatch(self.model)
            if self.cuda:
                gc.collect()
                torch.cuda.empty_cache()
        dt = time.perf_counter() - t0
        self.timings[name] = round(self.timings.get(name, 0.0) + dt, 1)
        sec = "shared" if len(needed_by) > 1 else next(iter(needed_by))
        self.section_s[sec] = round(self.section_s.get(sec, 0.0) + dt, 1)
        log(f"step {name} done in {dt:.1f} s (total {self.elapsed():.0f} s)")
        self.write_meta()
        self.R.flush()
        return ok

    def write_meta(self) -> None:
        self.meta["timings_s"] = dict(self.timings)
        self.meta["elapsed_per_section_s"] = dict(self.section_s)
        self.meta["elapsed_s"] = round(self.elapsed(), 1)
        self.meta["errors"] = self.errors
        self.meta["time_budget_reached"] = self.budget_hit

    def mem_put(self, key: str, label: str) -> None:
        """memory_gb[key] = allocated now minus the baseline before the model existed."""
        if self.R.fp8 is None:
            return
        a = mem_alloc(self.device)
        if a is None:
            self.R.fp8.put(f"memory_gb.{key}", None, f"{NEEDS_CUDA} (torch.cuda.memory_allocated); device is "
                                                   f"{self.device.type}")
            return
        gb = (a - self.mem_base) / 1e9
        self.R.fp8.put(f"memory_gb.{key}", round(gb, 3))
        self.R.fp8.put(f"memory_detail.{key}", {
            "allocated_gb": round(a / 1e9, 3), "baseline_gb": round(self.mem_base / 1e9, 3),
            "reserved_gb": round(torch.cuda.memory_reserved(self.device) / 1e9, 3),
            "host_rss_gb": host_rss_gb(), "when": label,
        })
        log(f"  memory {key}: {gb:.2f} GB ({label})")

    # ---------------------------------------------------------------- inputs and forwards
    def inputs(self, dtype: torch.dtype) -> dict[str, Any]:
        kw = dict(self.inputs32)
        for k in ("hidden_states", "encoder_hidden_states", "timestep"):
            kw[k] = kw[k].to(dtype)
        return kw

    def fwd_fn(self, kw: dict[str, Any]) -> Callable[[], Any]:
        m = self.model
        return lambda: m(**kw)[0]

    @torch.inference_mode()
    def forward(self, dtype: torch.dtype) -> torch.Tensor:
        out = self.model(**self.inputs(dtype))[0]
        sync(self.device)
        return out.float()

    @torch.inference_mode()
    def denoise(self, dtype: torch.dtype) -> torch.Tensor:
        """The FlowMatch Euler loop of benchmarks/fidelity.py (Runner.denoise): no CFG, ``--steps`` steps."""
        return flow_match_denoise(self.model, self.inputs(dtype), self.noise32.to(dtype), self.args.steps, self.device)

    def fidelity(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Forward + latents in bf16; rel errors against the fp32 reference into fp8_gemm.json."""
        if self.ref is None:
            for p in (f"fidelity.rel_err_forward.{key}", f"fidelity.rel_err_latents.{key}"):
                self.R.fp8.skip_if_missing(p, "no fp32 reference (its step was skipped or failed)")
            return None
        try:
            out = self.forward(torch.bfloat16)
            lat = self.denoise(torch.bfloat16)
        except Exception as e:
            why = self.soft_error(f"fidelity {key}", e)
            for p in (f"fidelity.rel_err_forward.{key}", f"fidelity.rel_err_latents.{key}"):
                self.R.fp8.skip_if_missing(p, why)
            return None
        ef, el = rel_err(out, self.ref[0]), rel_err(lat, self.ref[1])
        self.R.fp8.put(f"fidelity.rel_err_forward.{key}", ef)
        self.R.fp8.put(f"fidelity.rel_err_latents.{key}", el)
        if key != "bf16":
            self.R.fp8.put(f"fidelity.finite.{key}", bool(torch.isfinite(out).all() and torch.isfinite(lat).all()))
        log(f"  fidelity {key}: rel err forward {ef:.4e}, latents {el:.4e}")
        return out, lat

    def soft_error(self, what: str, e: BaseException) -> str:
        """Record an error of one part of a step that must not stop the rest of the step."""
        msg = f"{type(e).__name__}: {e}"
        self.errors.append({"step": what, "error": msg, "traceback": traceback.format_exc(limit=6)})
        log(f"ERROR in {what}: {msg}")
        if self.cuda and isinstance(e, torch.cuda.OutOfMemoryError):
            gc.collect()
            torch.cuda.empty_cache()
        return f"error in {what}: {msg}"

    def block_measure(self, label: str, store: dict[str, Any]) -> dict[str, Any] | None:
        """One block alone on its captured inputs; None (reason in ``self.block_why``) if it cannot run."""
        self.block_why = "no block inputs captured (the transformer call of this configuration did not run)"
        if "kwargs" not in store:
            return None
        blk = self.model.transformer_blocks[self.block_idx]
        args, kwargs = store["args"], store["kwargs"]
        try:
            return measure(f"{label} block {self.block_idx}", lambda: blk(*args, **kwargs), self.device,
                           max(3, self.args.warmup), self.args.block_iters)
        except Exception as e:
            self.block_why = self.soft_error(f"{label} single-block measurement", e)
            return None

    # ---------------------------------------------------------------- run
    def run(self) -> int:
        a, dev = self.args, self.device
        try:
            env = env_info(dev)
        except Exception as e:  # bench_block's helper out of step with the package: keep going
            env = {"env_info_error": f"{type(e).__name__}: {e}", **C.environment(dev)}
        env["torch_cuda"] = torch.version.cuda
        env["qwen_absorb_commit_common"] = C.git_commit()
        env["qwen_absorb_tree_sha256"] = tree_sha()
        env["git_dirty"] = git_dirty()
        env["torch_extensions_dir"] = os.environ.get("TORCH_EXTENSIONS_DIR")
        try:
            sig = str(inspect.signature(qwen_absorb.patch))
        except (TypeError, ValueError):
            sig = None
        env["patch_signature"] = sig
        shown = ("gpu", "capability", "driver", "torch", "cuda_runtime", "cupy", "diffusers", "modelopt",
                 "qwen_absorb_commit")
        log(f"env: {json.dumps({k: env.get(k) for k in shown}, default=str)}")
        log(f"qwen_absorb.patch{sig}")
        side = {"1024": 8, "512": 4} if a.tiny else {"1024": 64, "512": 32}
        n_img = {r: s * s for r, s in side.items()}
        self.meta: dict[str, Any] = {
            "env": env,
            "config": {
                "tiny": a.tiny, "device": str(dev), "num_layers": a.num_layers, "sections": a.sections,
                "text_tokens": a.text_tokens, "image_tokens": n_img, "batch": 1, "dtype": "bf16",
                "warmup": a.warmup, "iters": a.iters, "fp8_fake_iters": a.fp8_fake_iters,
                "block_iters": a.block_iters, "steps": a.steps, "calib": a.calib, "seed": a.seed,
                "time_budget_s": a.time_budget_s, "out": str(a.out),
            },
            "method": (
                "B=1, bf16 activations, torch.inference_mode(), no text mask; one first call, then "
                f"{a.warmup} warm-up calls, then N timed calls each between CUDA events and synchronized after it "
                "(median reported; *_ms = wall time of one call). GPU busy: one more call under torch.profiler "
                "(CUDA activity only), sum of the device durations of its kernels (FunctionEvent.time_range of "
                "DeviceType.CUDA events; memcpy/memset and GPU user annotations excluded); kernels per call = "
                "their count. Memory: torch.cuda.memory_allocated after gc + synchronize + empty_cache, minus "
                "the allocation before the model was built (GB = 1e9 bytes). The model is modified in place "
                "(bf16 -> ModelOpt FP8 fake quant), one process, side by side. Shared measurements: "
                "fp8_gemm.json bf16_eager_ms is host_cost.json 1024.unpatched_ms, fp8_fake_ms is "
                "fp8_1024.unpatched_ms (one measurement each)."
                if self.cuda else
                "CPU smoke run (--tiny): perf_counter wall time, no GPU busy / kernels / memory (need CUDA)."
            ),
            "timings_s": {}, "errors": [], "time_budget_reached": None,
        }
        self.R = Results(a.out, a.sections, self.meta, n_img, a.text_tokens)
        H, F = self.R.host, self.R.fp8
        self.R.flush()
        log(f"writing to {a.out}: " + ", ".join(p.name for p, d in ((self.R.host_path, H), (self.R.fp8_path, F)) if d))
        self.print_estimate()

        both, host, fp8 = {"host", "fp8"}, {"host"}, {"fp8"}
        self.ref = None
        self.block_idx = 0
        self.mem_base = 0

        # ---- setup: the model, the inputs, ModelOpt's extension
        def setup():
            if self.cuda:
                # CUPTI is initialised by the first profiler session and may leave launch overhead behind:
                # start it once now so that every timed case below runs in the same profiler state
                x = torch.randn(256, 256, device=dev)
                profile_fn(lambda: x @ x, dev)
                del x
                torch.cuda.reset_peak_memory_stats(dev)
            self.mem_base = mem_alloc(dev) or 0
            t0 = time.perf_counter()
            if a.tiny:
                self.model = T.tiny_transformer(dtype=torch.bfloat16, num_layers=a.num_layers, seed=a.seed).to(dev)
            else:
                self.model = T.full_size_transformer(num_layers=a.num_layers, dtype=torch.bfloat16, device=dev,
                                                     seed=a.seed)
            sync(dev)
            self.stage = "bf16"
            self.block_idx = min(a.num_layers - 1, a.num_layers // 2)
            log(f"  built {a.num_layers}-layer bf16 transformer in {time.perf_counter() - t0:.1f} s")
            self.mem_put("bf16", "bf16 model built")
            if F is not None and self.cuda:
                F.put("memory_detail.bf16_param_bytes_gb", round(param_gb(self.model), 3))
            # the fidelity.py inputs: seed+1 inputs, seed+2 noise, no text mask, fp32 master copy
            self.inputs32 = T.transformer_inputs(self.model, batch_size=1, height=side["1024"], width=side["1024"],
                                                 text_len=a.text_tokens, masked_tail=0, seed=a.seed + 1,
                                                 device=dev, dtype=torch.float32)
            gen = torch.Generator(device="cpu").manual_seed(a.seed + 2)
            self.noise32 = torch.randn(self.inputs32["hidden_states"].shape, generator=gen).to(dev)
            self.in1024 = self.inputs(torch.bfloat16)
            self.in512 = T.transformer_inputs(self.model, batch_size=1, height=side["512"], width=side["512"],
                                              text_len=a.text_tokens, masked_tail=0, seed=a.seed + 3,
                                              device=dev, dtype=torch.bfloat16)
            self.calib = [T.transformer_inputs(self.model, batch_size=1, height=side["1024"], width=side["1024"],
                                               text_len=a.text_tokens, masked_tail=0, seed=a.seed + 10 + i,
                                               timestep=t, device=dev, dtype=torch.bfloat16)
                          for i, t in enumerate((0.9, 0.5, 0.1)[: a.calib])]

        if not self.step("setup", both, [], setup) or self.model is None:
            self.R.finalize("setup failed: see transformer_suite errors")
            return 1

        def modelopt_warmup():
            if not self.cuda:
                log("  (CPU: ModelOpt's CUDA extension is not used)")
                return
            t0 = time.perf_counter()
            tiny = T.tiny_transformer(dtype=torch.bfloat16, num_layers=1, seed=a.seed).to(dev)
            kw = T.transformer_inputs(tiny, height=4, width=4, text_len=8, masked_tail=0, device=dev,
                                      dtype=torch.bfloat16)
            with quiet():
                T.fp8_quantize(tiny, kw)
            with torch.inference_mode():
                tiny(**kw)
            sync(dev)
            del tiny, kw
            log(f"  ModelOpt FP8 fake quant ready (extension build/load) in {time.perf_counter() - t0:.1f} s")

        self.step("modelopt_extension_warmup", both, [], modelopt_warmup)

        # ---- fp32 reference: the same weights upcast in place (exact round trip), TF32 off
        def fp32_reference():
            if self.cuda:
                free, _ = torch.cuda.mem_get_info(dev)
                have = param_gb(self.model) * 1e9  # bf16 bytes, freed while converting
                if free + have < 2 * have + 4e9:
                    raise RuntimeError(f"not enough GPU memory for the fp32 copy in place: {free / 1e9:.1f} GB free, "
                                       f"{2 * have / 1e9:.1f} GB needed for the fp32 weights")
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            try:
                with torch.no_grad():
                    self.model.float()
                sync(dev)
                ref_out = self.forward(torch.float32)
                ref_lat = self.denoise(torch.float32)
                self.ref = (ref_out, ref_lat)
            finally:
                with torch.no_grad():
                    self.model.to(torch.bfloat16)
                if self.cuda:
                    gc.collect()
                    torch.cuda.empty_cache()
            log(f"  fp32 reference: |out| {ref_out.norm():.4e}, |latents| {ref_lat.norm():.4e}")

        self.step("fp32_reference", fp8, [], fp32_reference)

        # ---- bf16 unpatched
        self.cap: dict[str, dict[str, Any]] = {}
        self.res: dict[str, dict[str, Any]] = {}

        def bf16_unpatched():
            qwen_absorb.unpatch(self.model)
            self.cap["bf16_unpatched"] = {}
            r = measure("bf16 unpatched 1024", self.fwd_fn(self.in1024), dev, a.warmup, a.iters,
                        (self.model, self.block_idx, self.cap["bf16_unpatched"]))
            self.res["bf16_unpatched_1024"] = r
            self.put_call(H, "1024", "unpatched", r)
            if F is not None:
                F.put("bf16_eager_ms", r["median_ms"])
                F.put("bf16_eager_gpu_busy_ms", *busy(r))
                F.put("kernels_per_call.bf16_eager", *kcount(r))
                F.put("samples_ms.bf16_eager", r["samples_ms"])
                F.put("profiles.bf16_eager", r["profile"])
            self.R.flush()

        self.step("bf16_unpatched_1024", both, [(H, "1024.unpatched_ms"), (F, "bf16_eager_ms")], bf16_unpatched)

        def bf16_unpatched_512():
            qwen_absorb.unpatch(self.model)
            r = measure("bf16 unpatched 512", self.fwd_fn(self.in512), dev, a.warmup, a.iters)
            self.put_call(H, "512", "unpatched", r)

        self.step("bf16_unpatched_512", host, [(H, "512.unpatched_ms")], bf16_unpatched_512)

        def bf16_unpatched_block_fid():
            qwen_absorb.unpatch(self.model)
            rb = self.block_measure("bf16 unpatched", self.cap.pop("bf16_unpatched", {}))
            self.put_block(F, "bf16_unpatched", rb)
            self.fidelity("bf16")

        self.step("bf16_unpatched_block_and_fidelity", fp8,
                  [(F, "kernels_per_block.bf16_unpatched"), (F, "fidelity.rel_err_forward.bf16")],
                  bf16_unpatched_block_fid)

        # ---- bf16 patched (default)
        def bf16_patched():
            rep, why = call_patch(self.model)
            if rep is None:
                raise RuntimeError(why)
            self.cap["bf16_patched"] = {}
            r = measure("bf16 patched 1024", self.fwd_fn(self.in1024), dev, a.warmup, a.iters,
                        (self.model, self.block_idx, self.cap["bf16_patched"]))
            self.put_call(H, "1024", "patched", r, rep)
            if "host" in self.sections:
                r5 = measure("bf16 patched 512", self.fwd_fn(self.in512), dev, a.warmup, a.iters)
                self.put_call(H, "512", "patched", r5, rep)
            if F is not None:
                rb = self.block_measure("bf16 patched", self.cap.pop("bf16_patched"))
                self.put_block(F, "bf16_patched", rb)
                F.put("bf16_patched_kernels_per_block", *(kcount(rb) if rb else (None, self.block_why)))
            for res in ("1024", "512"):  # runtime fallbacks accumulate while the model runs: read them last
                if H is not None and H.get(f"{res}.patched_ms") is not None:
                    H.put(f"{res}.patched_runtime_fallbacks", C.runtime_fallbacks(rep))
            qwen_absorb.unpatch(self.model)

        self.step("bf16_patched", both, [(H, "1024.patched_ms"), (H, "512.patched_ms"),
                                         (F, "bf16_patched_kernels_per_block")], bf16_patched)
        for res in ("1024", "512"):
            if H is not None:
                H.put(f"{res}.speedup_patched_vs_unpatched",
                      ratio(H.get(f"{res}.unpatched_ms"), H.get(f"{res}.patched_ms")))

        # ---- ModelOpt FP8 fake quant, in place
        def fp8_quantize():
            qwen_absorb.unpatch(self.model)
            t0 = time.perf_counter()
            with quiet():
                T.fp8_quantize(self.model, self.calib)
            sync(dev)
            self.stage = "fp8_fake"
            qs = round(time.perf_counter() - t0, 1)
            self.meta["fp8_quantization"] = {"config": "mtq.FP8_DEFAULT_CFG (qwen_absorb.testing.fp8_quantize)",
                                             "calibration_forwards": len(self.calib), "seconds": qs,
                                             "in_place": True}
            log(f"  quantized (ModelOpt FP8_DEFAULT_CFG, {len(self.calib)} calibration forwards) in {qs} s")
            self.mem_put("fp8_fake", "ModelOpt FP8 fake-quant model (bf16 weights + quantizer state)")

        if not self.step("fp8_quantize", both, [(H, "fp8_1024.unpatched_ms"), (F, "fp8_fake_ms")], fp8_quantize) \
                or self.stage != "fp8_fake":
            self.R.finalize("the FP8 model could not be built (step fp8_quantize skipped or failed)")
            return self.exit_code()

        def fp8_fake_unpatched():
            qwen_absorb.unpatch(self.model)
            self.cap["fp8_fake"] = {}
            r = measure("fp8 fake unpatched 1024", self.fwd_fn(self.in1024), dev, a.warmup, a.fp8_fake_iters,
                        (self.model, self.block_idx, self.cap["fp8_fake"]))
            self.res["fp8_fake"] = r
            if H is not None:
                self.put_fp8_host(H, "unpatched", r)
            if F is not None:
                F.put("fp8_fake_ms", r["median_ms"])
                F.put("fp8_fake_gpu_busy_ms", *busy(r))
                F.put("kernels_per_call.fp8_fake", *kcount(r))
                F.put("samples_ms.fp8_fake", r["samples_ms"])
                F.put("profiles.fp8_fake", r["profile"])

        self.step("fp8_fake_unpatched_1024", both, [(H, "fp8_1024.unpatched_ms"), (F, "fp8_fake_ms")],
                  fp8_fake_unpatched)

        self.fake_out = None

        def fp8_fake_block_fid():
            qwen_absorb.unpatch(self.model)
            rb = self.block_measure("fp8 fake unpatched", self.cap.pop("fp8_fake", {}))
            self.put_block(F, "fp8_fake", rb)
            o = self.fidelity("fp8_fake")
            self.fake_out = o[0] if o else None

        self.step("fp8_fake_block_and_fidelity", fp8,
                  [(F, "kernels_per_block.fp8_fake"), (F, "fidelity.rel_err_forward.fp8_fake")], fp8_fake_block_fid)

        # ---- real FP8 (fp8_gemm=True)
        self.real_out = None
        self.no_real: str | None = None
        real_keys = ["fp8_real_ms", "fp8_real_gpu_busy_ms", "fp8_real_block_ms", "fp8_real_kernels_per_block",
                     "fp8_real_ms_per_layer", "kernels_per_call.fp8_real", "kernels_per_block.fp8_real",
                     "block_ms.fp8_real", "memory_gb.fp8_real_patched", "fidelity.rel_err_forward.fp8_real",
                     "fidelity.rel_err_latents.fp8_real", "fidelity.finite.fp8_real", "fidelity_ratio_forward",
                     "fidelity_ratio_latents", "fp8_real_vs_bf16", "fp8_real_vs_fake", "use_fast_accum",
                     "fidelity.real_vs_fake_rel_diff_forward", "fp8_real_report_summary",
                     "fp8_real_runtime_fallbacks", "fp8_real_linears"]

        def fp8_real():
            rep, why = call_patch(self.model, fp8_gemm=True)
            if rep is not None and (why := no_real_fp8_reason(rep)) is not None:
                F.put("fp8_real_report_summary", report_summary(rep))
                F.put("fp8_real_linears", 0)
                qwen_absorb.unpatch(self.model)
                rep = None
            if rep is None:
                self.no_real = why
                for k in real_keys:
                    F.skip_if_missing(k, why)
                F.put("use_fast_accum_note", why)
                log(f"  SKIP real FP8: {why}")
                return
            self.note_real_linears(F, "fp8_real_linears", rep)
            F.put("fp8_real_report_summary", report_summary(rep))
            self.cap["fp8_real"] = {}
            r = measure("fp8 real (fp8_gemm=True) 1024", self.fwd_fn(self.in1024), dev, a.warmup, a.iters,
                        (self.model, self.block_idx, self.cap["fp8_real"]))
            self.res["fp8_real"] = r
            F.put("fp8_real_ms", r["median_ms"])
            F.put("fp8_real_gpu_busy_ms", *busy(r))
            F.put("kernels_per_call.fp8_real", *kcount(r))
            F.put("samples_ms.fp8_real", r["samples_ms"])
            F.put("profiles.fp8_real", r["profile"])
            F.put("fp8_real_ms_per_layer", r["median_ms"] / a.num_layers)
            F.put("fp8_real_vs_bf16", ratio(F.get("bf16_eager_ms"), r["median_ms"]),
                  "bf16_eager_ms not measured")
            F.put("fp8_real_vs_fake", ratio(F.get("fp8_fake_ms"), r["median_ms"]), "fp8_fake_ms not measured")
            self.R.flush()
            rb = self.block_measure("fp8 real", self.cap.pop("fp8_real"))
            self.put_block(F, "fp8_real", rb)
            self.mem_put("fp8_real_patched", "patched fp8_gemm=True, after calls: bf16 + FP8 weights resident")
            if rb is not None:
                F.put("fp8_real_block_ms", rb["median_ms"])
                F.put("fp8_real_block_ms_method",
                      f"median of {rb['iters']} calls of transformer_blocks[{self.block_idx}] alone (after "
                      f"{rb['warmup']} warm-up calls), with its inputs captured by a forward pre-hook during the "
                      "first 1024^2 transformer call of this configuration (fp8_real_ms_per_layer = the "
                      "full call / num_layers, for comparison)")
                F.put("fp8_real_kernels_per_block", *kcount(rb))
            self.R.flush()
            o = self.fidelity("fp8_real")
            if o is not None:
                self.real_out = o[0]
                F.put("fidelity_ratio_forward", ratio(F.get("fidelity.rel_err_forward.fp8_real"),
                                                      F.get("fidelity.rel_err_forward.fp8_fake")),
                      "fp8_fake fidelity not measured")
                F.put("fidelity_ratio_latents", ratio(F.get("fidelity.rel_err_latents.fp8_real"),
                                                      F.get("fidelity.rel_err_latents.fp8_fake")),
                      "fp8_fake fidelity not measured")
                if self.fake_out is not None:
                    F.put("fidelity.real_vs_fake_rel_diff_forward", rel_err(o[0], self.fake_out))
                log(f"  fidelity ratio real/fake: forward {F.get('fidelity_ratio_forward')}, "
                    f"latents {F.get('fidelity_ratio_latents')}")
            v, note = fast_accum(rep, {"fp8_gemm": True})
            F.put("use_fast_accum", v, note)
            F.put("use_fast_accum_note", note)
            F.put("fp8_real_report_summary", report_summary(rep))
            F.put("fp8_real_runtime_fallbacks", C.runtime_fallbacks(rep))
            qwen_absorb.unpatch(self.model)

        self.step("fp8_real", fp8, [(F, k) for k in real_keys], fp8_real)

        # the other accumulation mode of torch._scaled_mm (speed and fidelity), where patch() takes it
        fa_keys = ["fast_accum.fp8_real_ms", "fast_accum.gpu_busy_ms", "fast_accum.fidelity_ratio_forward",
                   "fast_accum.fidelity_ratio_latents", "fast_accum.use_fast_accum"]

        def fp8_real_fast_accum():
            other = not bool(F.get("use_fast_accum"))
            rep, why = call_patch(self.model, fp8_gemm=True, use_fast_accum=other)
            if rep is None:
                for k in fa_keys:
                    F.skip_if_missing(k, why)
                log(f"  SKIP use_fast_accum={other}: {why}")
                return
            F.put("fast_accum.use_fast_accum", other)
            r = measure(f"fp8 real use_fast_accum={other} 1024", self.fwd_fn(self.in1024), dev, a.warmup, a.iters)
            F.put("fast_accum.fp8_real_ms", r["median_ms"])
            F.put("fast_accum.gpu_busy_ms", *busy(r))
            F.put("fast_accum.speedup_vs_fp8_real", ratio(F.get("fp8_real_ms"), r["median_ms"]))
            F.put("samples_ms.fp8_real_fast_accum", r["samples_ms"])
            self.R.flush()
            if self.ref is not None:
                out = self.forward(torch.bfloat16)
                lat = self.denoise(torch.bfloat16)
                ef, el = rel_err(out, self.ref[0]), rel_err(lat, self.ref[1])
                F.put("fast_accum.rel_err_forward", ef)
                F.put("fast_accum.rel_err_latents", el)
                F.put("fast_accum.fidelity_ratio_forward", ratio(ef, F.get("fidelity.rel_err_forward.fp8_fake")),
                      "fp8_fake fidelity not measured")
                F.put("fast_accum.fidelity_ratio_latents", ratio(el, F.get("fidelity.rel_err_latents.fp8_fake")),
                      "fp8_fake fidelity not measured")
                log(f"  fidelity use_fast_accum={other}: rel err forward {ef:.4e}, latents {el:.4e}")
            else:
                for k in ("fast_accum.fidelity_ratio_forward", "fast_accum.fidelity_ratio_latents"):
                    F.skip_if_missing(k, "no fp32 reference (its step was skipped or failed)")
            qwen_absorb.unpatch(self.model)

        if F is not None and F.get("fp8_real_ms") is not None:
            self.step("fp8_real_fast_accum", fp8, [(F, k) for k in fa_keys], fp8_real_fast_accum)
        elif F is not None:
            for k in fa_keys:
                F.skip_if_missing(k, self.no_real or "real FP8 was not measured")

        # ---- host: FP8 patched with the patch default, and with fp8_gemm=False
        def fp8_patched_default():
            rep, why = call_patch(self.model)
            if rep is None:
                raise RuntimeError(why)
            self.note_real_linears(H, "fp8_1024.patched_fp8_gemm_linears", rep)
            r = measure("fp8 patched (default) 1024", self.fwd_fn(self.in1024), dev, a.warmup,
                        a.iters if is_real(rep) else a.fp8_fake_iters)
            self.put_fp8_host(H, "patched", r, rep)
            H.put("fp8_1024.patched_runtime_fallbacks", C.runtime_fallbacks(rep))
            H.put("fp8_1024.speedup_patched_vs_unpatched",
                  ratio(H.get("fp8_1024.unpatched_ms"), r["median_ms"]))
            qwen_absorb.unpatch(self.model)

        self.step("fp8_patched_default", host, [(H, "fp8_1024.patched_ms")], fp8_patched_default)

        def fp8_patched_fake():
            rep, why = call_patch(self.model, fp8_gemm=False)
            if rep is None:
                for k in ("patched_fake_ms", "patched_fake_gpu_busy_ms", "patched_fake_kernels_per_call",
                          "speedup_patched_fake_vs_unpatched", "patched_fake_report_summary",
                          "patched_fake_runtime_fallbacks"):
                    H.skip_if_missing(f"fp8_1024.{k}", why)
                log(f"  SKIP fp8 patched fp8_gemm=False: {why}")
                return
            r = measure("fp8 patched fp8_gemm=False 1024", self.fwd_fn(self.in1024), dev, a.warmup,
                        a.fp8_fake_iters)
            self.put_fp8_host(H, "patched_fake", r, rep)
            H.put("fp8_1024.patched_fake_runtime_fallbacks", C.runtime_fallbacks(rep))
            H.put("fp8_1024.speedup_patched_fake_vs_unpatched",
                  ratio(H.get("fp8_1024.unpatched_ms"), r["median_ms"]))
            qwen_absorb.unpatch(self.model)

        self.step("fp8_patched_fake", host, [(H, "fp8_1024.patched_fake_ms")], fp8_patched_fake)

        # ---- last (it moves 40 GB of weights to the host and back): real FP8 with the originals offloaded
        def fp8_real_offload():
            rep, why = call_patch(self.model, fp8_gemm=True, offload_original_weights=True)
            if rep is not None and (why := no_real_fp8_reason(rep)) is not None:
                qwen_absorb.unpatch(self.model)
                rep = None
            if rep is None:
                for k in ("memory_gb.fp8_real_offloaded", "offload_output_identical", "fp8_real_offloaded_ms",
                          "memory_ratios.fp8_real_offloaded_vs_bf16", "memory_ratios.fp8_real_offloaded_vs_fake"):
                    F.skip_if_missing(k, why)
                log(f"  SKIP offload: {why}")
                return
            with torch.inference_mode():
                out = self.model(**self.inputs(torch.bfloat16))[0].float()
                sync(dev)
            if self.real_out is not None:  # the fp8_real fidelity forward: same inputs, same patch but offload
                F.put("offload_output_identical", bool(torch.equal(out, self.real_out)))
                F.put("offload_output_rel_diff", rel_err(out, self.real_out))
            else:
                F.skip_if_missing("offload_output_identical", "no fp8_real output to compare with")
            del out
            self.mem_put("fp8_real_offloaded", "patched fp8_gemm=True, offload_original_weights=True, after a call")
            r = measure("fp8 real offloaded 1024", self.fwd_fn(self.in1024), dev, a.warmup, a.iters)
            F.put("fp8_real_offloaded_ms", r["median_ms"])
            F.put("samples_ms.fp8_real_offloaded", r["samples_ms"])
            qwen_absorb.unpatch(self.model)
            if self.cuda:
                F.put("memory_detail.fp8_after_unpatch_of_offloaded_gb",
                      round((mem_alloc(dev) - self.mem_base) / 1e9, 3))

        self.step("fp8_real_offload", fp8, [(F, "memory_gb.fp8_real_offloaded"), (F, "offload_output_identical"),
                                            (F, "fp8_real_offloaded_ms")], fp8_real_offload)
        if F is not None:
            m = F.get("memory_gb") or {}
            F.put("memory_ratios.fp8_real_patched_vs_bf16", ratio(m.get("fp8_real_patched"), m.get("bf16")),
                  "a memory value is missing")
            F.put("memory_ratios.fp8_real_offloaded_vs_bf16", ratio(m.get("fp8_real_offloaded"), m.get("bf16")),
                  "a memory value is missing")
            F.put("memory_ratios.fp8_real_offloaded_vs_fake", ratio(m.get("fp8_real_offloaded"), m.get("fp8_fake")),
                  "a memory value is missing")
            if self.cuda:
                F.put("memory_detail.peak_allocated_gb_run_incl_fp32_reference",
                      round((torch.cuda.max_memory_allocated(dev) - self.mem_base) / 1e9, 3))
        qwen_absorb.unpatch(self.model)
        self.write_meta()
        self.R.finalize(self.budget_hit or "not measured: see transformer_suite errors")
        log(f"done in {self.elapsed():.0f} s; per section (steps shared by both sections apart): "
            f"{json.dumps(self.section_s)}; per step: {json.dumps(self.timings)}")
        for p, d in ((self.R.host_path, H), (self.R.fp8_path, F)):
            if d is not None:
                log(f"wrote {p} and {p.with_suffix('.md').name}")
        return self.exit_code()

    def note_real_linears(self, doc: Doc | None, path: str, rep: Any) -> None:
        """How many linears the report says run as real FP8 (summary ``fp8_gemm_linears``)."""
        if doc is None:
            return
        n = (report_summary(rep) or {}).get("fp8_gemm_linears")
        doc.put(path, n, None if n is not None else "the report summary has no fp8_gemm_linears")
        if n == 0:
            log(f"  WARNING: the patch reports 0 real-FP8 linears ({path}); see the report summary")

    def exit_code(self) -> int:
        return 1 if self.errors else 0

    # ---------------------------------------------------------------- result helpers
    def put_call(self, H: Doc | None, res: str, which: str, r: dict[str, Any], rep: Any = None) -> None:
        if H is None:
            return
        H.put(f"{res}.{which}_ms", r["median_ms"])
        H.put(f"{res}.{which}_gpu_busy_ms", *busy(r))
        H.put(f"{res}.{which}_kernels_per_call", *kcount(r))
        b = busy(r)[0]
        H.put(f"{res}.{which}_wall_minus_busy_ms", None if b is None else r["median_ms"] - b,
              None if b is not None else busy(r)[1])
        H.put(f"{res}.samples_ms.{which}", r["samples_ms"])
        if rep is not None:
            H.put(f"{res}.{which}_report_summary", report_summary(rep))
        self.R.flush()

    def put_fp8_host(self, H: Doc, which: str, r: dict[str, Any], rep: Any = None) -> None:
        H.put(f"fp8_1024.{which}_ms", r["median_ms"])
        H.put(f"fp8_1024.{which}_gpu_busy_ms", *busy(r))
        H.put(f"fp8_1024.{which}_kernels_per_call", *kcount(r))
        H.put(f"fp8_1024.samples_ms.{which}", r["samples_ms"])
        if rep is not None:
            H.put(f"fp8_1024.{which}_report_summary", report_summary(rep))
        self.R.flush()

    def put_block(self, F: Doc | None, key: str, rb: dict[str, Any] | None) -> None:
        if F is None:
            return
        if rb is None:
            why = self.block_why
            F.put(f"kernels_per_block.{key}", None, why)
            F.put(f"block_ms.{key}", None, why)
            return
        F.put(f"block_ms.{key}", rb["median_ms"])
        F.put(f"kernels_per_block.{key}", *kcount(rb))
        F.put(f"profiles.block_{key}", rb["profile"])
        self.R.flush()

    def print_estimate(self) -> None:
        a = self.args
        s = a.num_layers / 60 if not a.tiny else 0.0
        ext_cached = any(Path(os.environ.get("TORCH_EXTENSIONS_DIR", "/nonexistent")).glob("**/*fp8*.so"))
        est = {
            "setup (build, inputs, ModelOpt extension)": 5 + 10 * s + (0 if (ext_cached or not self.cuda) else 60),
            "bf16 1024 unpatched + patched (both sections)": 5 + 15 * s,
            "FP8 quantize + fake unpatched 1024 (both sections)": 5 + 30 * s,
        }
        if "host" in self.sections:
            est["host: bf16 512, FP8 patched default + fp8_gemm=False"] = 5 + 35 * s
        if "fp8" in self.sections:
            est["fp8: fp32 reference, blocks, fidelity x3, real FP8, offload"] = 10 + 60 * s
        total = sum(est.values())
        log("estimate (H200, 60 layers scaled by num_layers; CPU tiny: seconds): "
            + "; ".join(f"{k} ~{v:.0f} s" for k, v in est.items()) + f"; total ~{total:.0f} s"
            + ("" if self.cuda else " (CPU: much less)"))
        self.meta["estimate_s"] = {k: round(v) for k, v in est.items()}


def no_real_fp8_reason(rep: Any) -> str | None:
    """Why a report of ``patch(fp8_gemm=True)`` runs no linear as real FP8 (None: some do, or it cannot tell)."""
    n = (report_summary(rep) or {}).get("fp8_gemm_linears")
    if n is None or n > 0:
        return None
    reasons: dict[str, int] = {}
    try:
        for b in rep.to_dict().get("blocks", []):
            for lp in (b.get("linears") or {}).values():
                for r in (lp.get("fp8_reasons") or [])[:1]:
                    if r != "not ModelOpt-quantized":
                        reasons[r] = reasons.get(r, 0) + 1
    except Exception:
        pass
    top = "; ".join(f"{r} (x{c})" for r, c in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
    return "qwen_absorb.patch(fp8_gemm=True) runs no linear as real FP8 here (report: fp8_gemm_linears = 0)" + (
        f": {top}" if top else "")


def is_real(rep: Any) -> bool:
    """Whether a report says real FP8 GEMMs are in use (heuristic over its summary; only picks the iters)."""
    s = report_summary(rep) or {}
    for k, v in s.items():
        if any(n in k.lower() for n in ("fp8_gemm", "real_fp8", "scaled_mm")):
            if isinstance(v, bool) and v or isinstance(v, (int, float)) and v > 0:
                return True
    return False


def param_gb(model: torch.nn.Module) -> float:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / 1e9


@contextlib.contextmanager
def quiet():
    """ModelOpt prints one line per inserted quantizer group: keep the progress log readable."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield


def tree_sha() -> str | None:
    """Hash of the qwen_absorb sources actually run (the device copy may have no .git; the tree may be dirty)."""
    h = hashlib.sha256()
    pkg = ROOT / "qwen_absorb"
    try:
        for p in sorted(pkg.rglob("*")):
            if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".h"):
                h.update(str(p.relative_to(ROOT)).encode())
                h.update(p.read_bytes())
    except OSError:
        return None
    return h.hexdigest()[:16]


def git_dirty() -> bool | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=10)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except Exception:
        return None


# ------------------------------------------------------------------------------------------- markdown


def _f(v: Any, nd: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int,)):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.{nd}f}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"
    return str(v)


def _env_lines(meta: dict[str, Any]) -> list[str]:
    env, cfg = meta.get("env", {}), meta.get("config", {})
    gpu = env.get("gpu") or f"CPU ({env.get('cpu')})"
    return [
        f"- GPU: {gpu}"
        + (f", capability {env.get('capability')}, driver {env.get('driver')}" if env.get("gpu") else ""),
        f"- torch {env.get('torch')} (CUDA {env.get('cuda_runtime')}), cupy {env.get('cupy')}, diffusers "
        f"{env.get('diffusers')}, modelopt {env.get('modelopt')}, qwen_absorb {env.get('qwen_absorb_commit')}"
        f" (dirty: {env.get('git_dirty')}, sources sha256 {env.get('qwen_absorb_tree_sha256')})",
        f"- date: {env.get('date')}; {cfg.get('num_layers')} layers, B = 1, {cfg.get('text_tokens')} text tokens, "
        f"bf16, torch.inference_mode()" + (" - **--tiny smoke run: not a benchmark**" if cfg.get("tiny") else ""),
        f"- method: {meta.get('method')}",
    ]


def _skips(obj: dict[str, Any], prefix: str = "") -> list[str]:
    return [f"- `{prefix}{k}`: {v}" for k, v in (obj.get("skipped") or {}).items()]


def host_markdown(doc: dict[str, Any]) -> str:
    meta = doc.get("transformer_suite") or {}
    lines = ["# Host cost of one Qwen-Image transformer call: unpatched vs qwen_absorb.patch", ""]
    lines += _env_lines(meta)
    lines += [
        "",
        "Wall = median of one call between CUDA events, synchronized after it. GPU busy = sum of kernel durations "
        "of one call (torch.profiler). Wall - busy is what the GPU spent waiting on the host (launch-bound share).",
        "",
        "| case | image tokens | wall ms | GPU busy ms | wall - busy ms | kernels/call | speed-up vs unpatched |",
        "|---|---|---|---|---|---|---|",
    ]
    for res in ("1024", "512"):
        o = doc.get(res) or {}
        for w in ("unpatched", "patched"):
            sp = o.get("speedup_patched_vs_unpatched") if w == "patched" else None
            lines.append(f"| bf16 {w} {res}^2 | {o.get('image_tokens')} | {_f(o.get(f'{w}_ms'))} | "
                         f"{_f(o.get(f'{w}_gpu_busy_ms'))} | {_f(o.get(f'{w}_wall_minus_busy_ms'))} | "
                         f"{_f(o.get(f'{w}_kernels_per_call'))} | {_f(sp) + 'x' if sp else ''} |")
    o = doc.get("fp8_1024") or {}
    for w, name, sk in (("unpatched", "unpatched", None), ("patched", "patched (patch default)",
                                                           "speedup_patched_vs_unpatched"),
                        ("patched_fake", "patched, fp8_gemm=False (fake quant)", "speedup_patched_fake_vs_unpatched")):
        sp = o.get(sk) if sk else None
        ms, b = o.get(f"{w}_ms"), o.get(f"{w}_gpu_busy_ms")
        lines.append(f"| ModelOpt FP8 {name} 1024^2 | {o.get('image_tokens')} | {_f(ms)} | {_f(b)} | "
                     f"{_f(ms - b) if ms is not None and b is not None else '-'} | "
                     f"{_f(o.get(f'{w}_kernels_per_call'))} | {_f(sp) + 'x' if sp else ''} |")
    lines.append("")
    for res in ("1024", "512", "fp8_1024"):
        o = doc.get(res) or {}
        for k in ("patched_report_summary", "patched_fake_report_summary"):
            if o.get(k):
                lines.append(f"- {res} {k}: `{json.dumps(o[k])}`")
        for k in ("patched_runtime_fallbacks", "patched_fake_runtime_fallbacks"):
            if o.get(k):
                lines.append(f"- {res} {k}: `{json.dumps(o[k])}`")
    sk = [s for res in ("1024", "512", "fp8_1024") for s in _skips(doc.get(res) or {}, f"{res}.")]
    if sk:
        lines += ["", "Not measured:"] + sk
    other = {k: v for k, v in doc.items() if k not in HOST_OWNED}
    if other:
        lines += ["", "## Other keys in host_cost.json (not written by transformer_suite.py)", ""]
        for k, v in other.items():
            lines.append(f"- `{k}`: " + (_f(v) if not isinstance(v, (dict, list)) else f"`{json.dumps(v)[:300]}`"))
    if meta.get("errors"):
        lines += ["", "Errors:"] + [f"- {e['step']}: {e['error']}" for e in meta["errors"]]
    if meta.get("timings_s"):
        lines += ["", f"Run time per step (s): `{json.dumps(meta['timings_s'])}`"]
    return "\n".join(lines) + "\n"


def fp8_markdown(d: dict[str, Any]) -> str:
    g = lambda path: Doc(d, False).get(path)  # noqa: E731
    lines = ["# Real FP8 GEMMs (qwen_absorb.patch(fp8_gemm=True)) vs ModelOpt fake quant vs bf16", ""]
    lines += _env_lines(d)
    lines += [
        "",
        f"Full transformer call at 1024^2 ({((d.get('config') or {}).get('image_tokens') or {}).get('1024')} image "
        f"tokens + {(d.get('config') or {}).get('text_tokens')} text tokens):",
        "",
        "| case | wall ms | GPU busy ms | kernels/call | ms per layer (call / layers) |",
        "|---|---|---|---|---|",
    ]
    n = (d.get("config") or {}).get("num_layers") or 60
    for name, ms, b, k in (("bf16 eager (unpatched)", "bf16_eager_ms", "bf16_eager_gpu_busy_ms", "bf16_eager"),
                           ("ModelOpt FP8 fake quant (unpatched)", "fp8_fake_ms", "fp8_fake_gpu_busy_ms", "fp8_fake"),
                           ("real FP8 (patched, fp8_gemm=True)", "fp8_real_ms", "fp8_real_gpu_busy_ms", "fp8_real")):
        v = g(ms)
        lines.append(f"| {name} | {_f(v)} | {_f(g(b))} | {_f(g('kernels_per_call.' + k))} | "
                     f"{_f(v / n if v is not None else None)} |")
    lines += [
        "",
        f"Speed-up of real FP8 (wall, other / real): {_f(g('fp8_real_vs_bf16'))}x over bf16 eager, "
        f"{_f(g('fp8_real_vs_fake'))}x over ModelOpt fake quant.",
        "",
        f"One block (transformer_blocks[{(d.get('config') or {}).get('num_layers', 60) // 2}], captured inputs):",
        "",
        "| block | median ms | kernels |",
        "|---|---|---|",
    ]
    for k, name in (("bf16_unpatched", "bf16 unpatched"), ("bf16_patched", "bf16 patched"),
                    ("fp8_fake", "FP8 fake quant unpatched"), ("fp8_real", "real FP8 patched")):
        lines.append(f"| {name} | {_f(g('block_ms.' + k))} | {_f(g('kernels_per_block.' + k))} |")
    lines += [
        "",
        f"fp8_real_block_ms = {_f(g('fp8_real_block_ms'))}: {g('fp8_real_block_ms_method') or '-'}",
        "",
        "Fidelity against the fp32 reference (same weights upcast, TF32 off; relative L2 error):",
        "",
        "| case | forward | 4-step latents |",
        "|---|---|---|",
    ]
    for k, name in (("bf16", "bf16"), ("fp8_fake", "ModelOpt FP8 fake quant"), ("fp8_real", "real FP8")):
        lines.append(f"| {name} | {_f(g('fidelity.rel_err_forward.' + k))} | "
                     f"{_f(g('fidelity.rel_err_latents.' + k))} |")
    lines += [
        "",
        f"Ratio real / fake: forward {_f(g('fidelity_ratio_forward'), 4)}, latents "
        f"{_f(g('fidelity_ratio_latents'), 4)}; real vs fake forward rel diff "
        f"{_f(g('fidelity.real_vs_fake_rel_diff_forward'))}.",
        "",
        "| model memory (GB, allocated) | GB |",
        "|---|---|",
    ]
    for k, name in (("bf16", "bf16"), ("fp8_fake", "ModelOpt FP8 fake quant"),
                    ("fp8_real_patched", "real FP8 patched (bf16 + FP8 weights)"),
                    ("fp8_real_offloaded", "real FP8, offload_original_weights=True")):
        lines.append(f"| {name} | {_f(g('memory_gb.' + k), 2)} |")
    mr = d.get("memory_ratios") or {}
    lines += [
        "",
        "Memory ratios: " + ", ".join(f"{k} {_f(v)}" for k, v in mr.items()),
        f"Offloaded output identical to non-offloaded real FP8: {_f(g('offload_output_identical'))} (rel diff "
        f"{_f(g('offload_output_rel_diff'))}); "
        f"offloaded call {_f(g('fp8_real_offloaded_ms'))} ms.",
        "",
        f"use_fast_accum: {_f(g('use_fast_accum'))} ({g('use_fast_accum_note') or '-'}). With "
        f"use_fast_accum={_f(g('fast_accum.use_fast_accum'))}: {_f(g('fast_accum.fp8_real_ms'))} ms "
        f"({_f(g('fast_accum.speedup_vs_fp8_real'))}x), GPU busy {_f(g('fast_accum.gpu_busy_ms'))} ms, fidelity "
        f"ratio vs fake: forward {_f(g('fast_accum.fidelity_ratio_forward'), 4)}, latents "
        f"{_f(g('fast_accum.fidelity_ratio_latents'), 4)}.",
        f"Real-FP8 linears (report summary fp8_gemm_linears): {_f(g('fp8_real_linears'))}.",
        f"Real FP8 patch report summary: `{json.dumps(g('fp8_real_report_summary'))}`; runtime fallbacks: "
        f"`{json.dumps(g('fp8_real_runtime_fallbacks'))}`",
    ]
    return "\n".join(lines + md_footer(d)) + "\n"


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="host,fp8", help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--num-layers", type=int, default=None, help="blocks (default 60; --tiny: 2)")
    ap.add_argument("--time-budget-s", type=float, default=360.0,
                    help="do not start a new step after this many seconds (0: no limit); default 360")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default benchmarks/results; --tiny: a new temp folder)")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU: the same code paths in seconds")
    ap.add_argument("--device", default=None, help="default cuda (--tiny: cpu)")
    ap.add_argument("--text-tokens", type=int, default=None, help="default 128 (--tiny: 8)")
    ap.add_argument("--warmup", type=int, default=2, help="warm-up calls after the first call (>= 2)")
    ap.add_argument("--iters", type=int, default=7, help="timed calls (bf16 and real FP8), >= 5")
    ap.add_argument("--fp8-fake-iters", type=int, default=5, help="timed calls of fake-quant FP8 (~0.78 s each), >= 5")
    ap.add_argument("--block-iters", type=int, default=20, help="timed calls of a single block")
    ap.add_argument("--steps", type=int, default=4, help="FlowMatch Euler steps of the fidelity loop")
    ap.add_argument("--calib", type=int, default=2, help="FP8 calibration forwards (1-3)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    asked = {x.strip() for x in a.sections.split(",") if x.strip()}
    a.sections = [s for s in SECTIONS if s in asked]
    bad = asked - set(SECTIONS)
    if bad or not a.sections:
        ap.error(f"--sections: choose from {','.join(SECTIONS)} (got {sorted(bad) or 'nothing'})")
    if a.warmup < 2 or a.iters < 5 or a.fp8_fake_iters < 5 or a.block_iters < 5:
        ap.error("method: --warmup >= 2, --iters / --fp8-fake-iters / --block-iters >= 5")
    if not 1 <= a.calib <= 3:
        ap.error("--calib: 1 to 3")
    if a.tiny:  # a smoke run: the minimum the method allows
        a.iters, a.fp8_fake_iters, a.block_iters = (min(v, 5) for v in (a.iters, a.fp8_fake_iters, a.block_iters))
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    a.num_layers = a.num_layers or (2 if a.tiny else 60)
    a.text_tokens = a.text_tokens or (8 if a.tiny else 128)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"CUDA is not available (torch {torch.__version__}); use --tiny for a CPU smoke run")
    results = (ROOT / "benchmarks" / "results").resolve()
    if a.out is None:
        a.out = Path(tempfile.mkdtemp(prefix="transformer_suite_tiny_")) if a.tiny else results
    a.out = a.out.resolve()
    if a.tiny and (a.out == results or results in a.out.parents):
        ap.error(f"--tiny never writes under {results}: pass another --out")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny ops: threads only contend (seconds instead of a minute on a busy host)
    log(f"transformer_suite: sections {','.join(args.sections)}, {args.num_layers} layers, device {args.device}"
        f"{' (tiny)' if args.tiny else ''}, time budget {args.time_budget_s:.0f} s, out {args.out}")
    return Suite(args).run()


if __name__ == "__main__":
    sys.exit(main())
