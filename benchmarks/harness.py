"""The one harness of the benchmarks: timing (:func:`measure`, :func:`time_calls`), the profiler's GPU busy
(:func:`profile_call`), memory, models over ``tests/builders.py``, the patch, the LoRA; re-exported from
:mod:`harness_io`: provenance, result files, steps and common arguments. Every script in ``benchmarks/`` imports
this module (``import harness as H``; the scripts put their own folder on ``sys.path``) and nothing from
``examples/``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import importlib.util
import io
import os
import sys
import statistics
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from typing import Any

# ModelOpt builds its FP8 CUDA extension on first use (~60 s): keep it where a later run can reuse it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/qwen_absorb_torch_extensions")

from harness_io import (  # noqa: E402,F401 - re-exported: scripts use ``H.<name>``
    RESULTS, ROOT, STEADY_WARMUP_S, T0, VERSION_KEYS, Bench, Results, Steps, add_int_args, add_steady_warmup_arg,
    dotted_get, environment, finish_args, fmt, git_commit, gpu_file_tag, head, json_safe, log, md_document, md_head,
    md_table, parser, sources_sha256, steady_warmup_s, write_atomic,
)

import torch  # noqa: E402

NEEDS_CUDA = "needs CUDA"


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


def kernel_summary(prof: Any, top: int = 12) -> dict[str, Any]:
    """The kernels of a finished profiler session: device-side events only, GPU user annotations (ranges, not
    kernels) and memcpy/memset left out."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if "memcpy" in e.name.lower() or "memset" in e.name.lower():
            continue
        r = rows.setdefault(e.name, [0, 0.0])
        r[0] += 1
        r[1] += float(e.time_range.elapsed_us())
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


def python_top(fn: Callable[[], Any], by: int = 3, n: int = 40) -> list[dict[str, Any]]:
    """``fn()`` once under cProfile: the Python functions the host spent it in, by cumulative (``by=3``) or own
    (``by=2``) time, those over 2 ms."""
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][by])  # (file, line, name) -> (cc, nc, tt, ct)
    return [{"fn": f"{Path(k[0]).name}:{k[1]}({k[2]})"[:90], "calls": v[1], "self_ms": round(v[2] * 1e3, 2),
             "cum_ms": round(v[3] * 1e3, 2)} for k, v in rows if v[by] > 2e-3][:n]


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


def memory_gib(device: torch.device) -> float | None:
    """``torch.cuda.memory_allocated`` in GiB after gc + synchronize + empty_cache (None off CUDA)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device) / 2**30


# ------------------------------------------------------------------------------------------ models and inputs


@functools.cache
def builders() -> Any:
    """This checkout's ``tests/builders.py`` (random models and inputs), loaded from its file: one_owner.py's worker
    puts an older tree's root first on ``sys.path``, where ``import tests.builders`` would find that tree's folder."""
    spec = importlib.util.spec_from_file_location("qwen_absorb_bench_builders", ROOT / "tests" / "builders.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build_transformer(tiny: bool, num_layers: int, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> torch.nn.Module:
    """``tests/builders.py``'s tiny (CPU) or full-size random transformer, eval mode, on ``device``."""
    T = builders()
    if tiny:
        return T.tiny_transformer(dtype=dtype, num_layers=num_layers, seed=seed).to(device).eval()
    return T.full_size_transformer(num_layers=num_layers, dtype=dtype, device=device, seed=seed).eval()


def inputs(model: torch.nn.Module, side: int, text: int, device: torch.device, dtype: torch.dtype,
           seed: int = 0, timestep: float = 0.5) -> dict[str, Any]:
    """Transformer kwargs: ``side`` x ``side`` image tokens (1024^2 = 64 x 64), ``text`` tokens, B = 1, no mask."""
    return builders().transformer_inputs(model, batch_size=1, height=side, width=side, text_len=text, masked_tail=0,
                                         seed=seed, timestep=timestep, device=device, dtype=dtype)


@contextlib.contextmanager
def in_fp32(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """``model`` upcast to fp32 with TF32 off (for a reference), cast back to bf16 after."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            model.float()  # bf16 -> fp32 -> bf16 is exact
        yield
    finally:
        with torch.no_grad():
            model.to(torch.bfloat16)
        memory_gib(device)


def as_dtype(kw: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {**kw, **{k: kw[k].to(dtype) for k in ("hidden_states", "encoder_hidden_states", "timestep")}}


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
    load_modelopt()
    t0 = time.perf_counter()
    with quiet():
        builders().fp8_quantize(model, calib)
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
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x.clone() if isinstance(x, torch.Tensor) else x


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


def patched(model: torch.nn.Module, **kw: Any) -> Any:
    """:func:`patch` raising its reason (a RuntimeError) instead of returning it."""
    rep, why = patch(model, **kw)
    if rep is None:
        raise RuntimeError(why)
    return rep


def summary(rep: Any) -> dict[str, Any] | None:
    if rep is None:
        return None
    try:
        return json_safe(dict(rep.summary))
    except Exception as e:  # noqa: BLE001
        return {"error": f"report.summary failed: {type(e).__name__}: {e}"}


def fallbacks(rep: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(getattr(rep, "runtime_fallbacks", None) or {}).items()}


def rep_info(rep: Any) -> dict[str, Any]:
    """A patch report's summary, fallbacks and CUDA-graph state, as plain data."""
    return json_safe({"summary": summary(rep), "graph_fallbacks": dict(rep.graph_fallbacks),
                      "runtime_fallbacks": fallbacks(rep), "cuda_graph_mode": rep.cuda_graph_mode,
                      "cuda_graph": rep.cuda_graph})


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


def mag_ratios(model: Any, steps: int, run: Callable[[], Any]) -> list[float]:
    """MagCache's own calibration (eager: it reads tensor values): ``run()`` with ``MagCacheConfig(calibrate=True)``
    on ``model``; the ratios it prints for the "cond" calls."""
    from diffusers.hooks import MagCacheConfig  # noqa: PLC0415

    model.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=steps))
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            run()
    finally:
        model.disable_cache()
    printed = [ln for ln in buf.getvalue().splitlines() if ln.startswith("[") and not ln.startswith("[Mag")]
    return [round(float(x), 5) for x in ast.literal_eval(printed[0])]


# ------------------------------------------------------------------------------------------ the LoRA

# A Lightning-shaped PEFT LoRA: the 12 linears of every block (attention q/k/v/out of both streams, both MLPs).
LORA_TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]


def lora_config(rank: int) -> Any:
    from peft import LoraConfig  # noqa: PLC0415

    return LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=list(LORA_TARGETS))


def lora_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


@torch.no_grad()
def seed_lora(model: torch.nn.Module, rank: int, seed: int) -> None:
    """Seeded LoRA weights: lora_A ~ N(0, 1/r) (PEFT's gaussian init), lora_B ~ N(0, 0.02/sqrt(r)) (not zero)."""
    for i, (n, p) in enumerate(sorted(lora_params(model).items())):
        g = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        p.normal_(0.0, (1.0 / rank) if ".lora_A." in n else 0.02 / rank**0.5, generator=g)
