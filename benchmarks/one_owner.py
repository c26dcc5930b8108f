#!/usr/bin/env python
"""Issue 38's acceptance: the key speed rows of this tree next to those of the tree before the work, one device run.

Each tree runs in its own process (``--worker``), its root first on ``sys.path`` so that ``import qwen_absorb``
loads that tree's package (checked: the worker records the file it imported); the harness and the models are this
tree's, so both trees run the same code around the library. ``--before-root`` is an older checkout (e.g.
``git worktree add .devrun/before 69357ce``); it runs first, then this tree, on the same GPU. Per worker, one
process, 1024^2 (4096 image + 128 text tokens), B = 1:

- ``bf16_default``: the 60-layer random full-size transformer in bf16, ``qwen_absorb.patch(model)`` (defaults);
- ``fp8_default``: the same model with ModelOpt ``FP8_DEFAULT_CFG`` in place (calibrated on ``--calib`` inputs),
  ``patch(model)``;
- ``fp8_lora``: a PEFT LoRA added to it (rank ``--rank`` 64, the 12 linears of every block, seeded weights:
  ``harness.lora_config`` / ``seed_lora``, as ``fp8_lora.py``), ``patch(model)``;
- ``qwenimage21_fp8``: the 32-layer random Qwen-Image-2.1 transformer, ModelOpt FP8 in place, ``patch(model)``
  (``qwenimage21_bench.py``'s model and inputs).

Per case: ``<case>_ms`` the median of ``--iters`` (>= 5) synchronized calls between CUDA events after warm-up
(``harness.measure``), ``<case>_wall_ms`` (perf_counter), ``<case>_gpu_busy_ms`` (kernel sum of one profiled call),
``<case>_mem_gib`` (``memory_allocated`` after ``gc.collect()``, patched) and ``<case>_peak_gib``; the before
tree's under ``before_<key>``; ``ratios`` this / before. Writes ``<out>/one_owner_h200.json`` + ``.md``.

    python benchmarks/one_owner.py --before-root .devrun/before --out $OUT   # H200: ~5 min (+55 s ModelOpt build)
    python benchmarks/one_owner.py --tiny --before-root .                    # CPU smoke run (~1 min)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if "--worker" in sys.argv:  # the tree under test first: its qwen_absorb is the one imported below
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--tree") + 1]).resolve()))
sys.path.insert(0, str(HERE))
import harness as H  # noqa: E402

import torch  # noqa: E402

CASES = ("bf16_default", "fp8_default", "fp8_lora", "qwenimage21_fp8")
STATS = ("ms", "wall_ms", "gpu_busy_ms", "mem_gib", "peak_gib")
KEYS = tuple(f"{c}_{s}" for c in CASES for s in STATS)


# ------------------------------------------------------------------------------------------ the worker


def timed_patched(model: torch.nn.Module, kw: dict[str, Any], a: argparse.Namespace, label: str) -> dict[str, Any]:
    """``qwen_absorb.patch(model)`` with defaults, then :func:`harness.measure`, memory while patched, unpatch."""
    import qwen_absorb  # noqa: PLC0415 - the tree's package (sys.path switched at the top)

    dev = a.device
    gc.collect()
    H.peak_memory_gib(dev)  # reset
    rep = qwen_absorb.patch(model)
    try:
        r = H.measure(label, lambda: model(**kw)[0], dev, a.warmup, a.iters, warmup_s=a.warmup_s)
        mem = H.memory_gib(dev)
        peak = H.peak_memory_gib(dev, reset=False)
        summary = H.summary(rep)
    finally:
        qwen_absorb.unpatch(model)
    busy, _ = H.busy(r)
    return {"ms": r["median_ms"], "wall_ms": r["wall_median_ms"], "gpu_busy_ms": busy, "mem_gib": mem,
            "peak_gib": peak, "first_call_s": r["first_call_s"], "samples_ms": r["samples_ms"],
            "kernels_per_call": (r["profile"] or {}).get("kernels_per_call"), "summary": summary}


def worker(a: argparse.Namespace) -> dict[str, Any]:
    import qwen_absorb  # noqa: PLC0415
    T = H.builders()  # this tree's builders, whichever tree's package runs

    dev, out = a.device, {"cases": {}, "errors": {}}
    out["qwen_absorb_file"] = qwen_absorb.__file__
    out["qwen_absorb_version"] = getattr(qwen_absorb, "__version__", None)
    out["environment"] = H.environment(dev)
    H.load_modelopt()
    H.start_profiler(dev)

    def case(name: str, fn: Any) -> None:
        H.log(f"[{a.tree}] {name} ...")
        try:
            out["cases"][name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the next case runs
            out["errors"][name] = f"{type(e).__name__}: {e}"
            H.log(f"[{a.tree}] ERROR {name}: {out['errors'][name]}")

    model = H.build_transformer(a.tiny, a.num_layers, dev, torch.bfloat16, a.seed)
    kw = H.inputs(model, a.side, a.text_tokens, dev, torch.bfloat16, a.seed + 1)
    calib = [H.inputs(model, a.side, a.text_tokens, dev, torch.bfloat16, a.seed + 10 + i, t)
             for i, t in enumerate((0.9, 0.5)[: a.calib])]
    case("bf16_default", lambda: timed_patched(model, kw, a, "bf16_default"))
    out["fp8_quantize_s"] = H.fp8_quantize(model, calib)
    case("fp8_default", lambda: timed_patched(model, kw, a, "fp8_default"))

    def lora() -> dict[str, Any]:
        model.add_adapter(H.lora_config(a.rank))
        H.seed_lora(model, a.rank, a.seed)
        return timed_patched(model, kw, a, "fp8_lora")

    case("fp8_lora", lora)
    del model, kw, calib
    H.memory_gib(dev)

    def qwenimage21() -> dict[str, Any]:
        tiny = T.QWENIMAGE21_TINY_CONFIG if a.tiny else {}
        m = T.random_qwenimage21_transformer(**{**tiny, "num_layers": a.num_layers21}, dtype=torch.bfloat16,
                                             device=dev, seed=a.seed)
        kw21, cal21 = (T.qwenimage21_inputs(m, height=a.side, width=a.side, text_len=a.text_tokens, timestep=t,
                                            seed=a.seed + s, device=dev, dtype=torch.bfloat16)
                       for s, t in ((1, 0.5), (10, 0.9)))
        out["qwenimage21_fp8_quantize_s"] = H.fp8_quantize(m, [cal21])
        return timed_patched(m, kw21, a, "qwenimage21_fp8")

    case("qwenimage21_fp8", qwenimage21)
    return out


# ------------------------------------------------------------------------------------------ the parent


def run_tree(a: argparse.Namespace, root: Path, argv: list[str]) -> dict[str, Any]:
    if not (root / "qwen_absorb" / "__init__.py").is_file():
        return {"cases": {}, "errors": {"tree": f"no qwen_absorb package under {root}"}, "exit_code": None}
    fd, path = tempfile.mkstemp(prefix="one_owner_", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tree", str(root), "--worker-json", path,
           *argv]
    H.log(f"worker for {root}: {' '.join(cmd[2:])}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    try:
        code = subprocess.run(cmd, env=env, timeout=a.worker_timeout_s).returncode
    except subprocess.TimeoutExpired:
        code = f"killed after {a.worker_timeout_s:g} s (--worker-timeout-s)"
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        d = {"cases": {}, "errors": {"worker": f"exit code {code}, no result file"}}
    Path(path).unlink(missing_ok=True)
    d["exit_code"] = code
    got = d.get("qwen_absorb_file")
    if got and not Path(got).resolve().is_relative_to(root.resolve()):
        d["errors"]["tree"] = f"the worker imported {got}, not the package under {root}"
    return d


def tree_info(root: Path, d: dict[str, Any]) -> dict[str, Any]:
    return {"root": str(root), "qwen_absorb_file": d.get("qwen_absorb_file"), "errors": d.get("errors"),
            "exit_code": d.get("exit_code"), "sources_sha256": H.sources_sha256(root),
            "commit": H.git_commit(root) or f"no git here (version {d.get('qwen_absorb_version')})",
            **{k: d.get(k) for k in ("fp8_quantize_s", "qwenimage21_fp8_quantize_s")},
            "cases": {c: {k: v for k, v in r.items() if k not in STATS} for c, r in d.get("cases", {}).items()}}


def parent(a: argparse.Namespace, argv: list[str]) -> int:
    trees = ([("before_", Path(a.before_root).resolve())] if a.before_root else []) + [("", H.ROOT)]
    runs = {prefix: run_tree(a, root, argv) for prefix, root in trees}
    env = runs[""].get("environment") or H.environment("cpu")
    R = H.Results(a.out, "one_owner_tiny" if a.tiny else "one_owner_h200", {
        **H.head("benchmarks/one_owner.py (issue 38 acceptance)", env, {**vars(a), "device": str(a.device),
                                                                        "out": str(a.out)}),
        **dict.fromkeys(KEYS), **dict.fromkeys(f"before_{k}" for k in KEYS), "ratios": {}, "trees": {}}, markdown)
    for prefix, root in trees:
        d = runs[prefix]
        for c in CASES:
            r = d["cases"].get(c)
            for s in STATS:
                err = d["errors"].get(c) or d["errors"].get("worker") or d["errors"].get("tree")
                why = (err or "not measured") if r is None else None
                v = None if r is None else r.get(s)
                R.put(f"{prefix}{c}_{s}", None if v is None else round(v, 4), why or "needs CUDA")
        R.put(f"trees.{prefix.rstrip('_') or 'current'}", tree_info(root, d))
    if not a.before_root:
        for k in KEYS:
            R.put(f"before_{k}", None, "no --before-root given")
    R.d["ratios"] = {c: H.ratio(R.get(f"{c}_ms"), R.get(f"before_{c}_ms")) for c in CASES}
    R.write()
    failed = [p for p, d in runs.items() if d["exit_code"] or d["errors"]]
    return 1 if failed else 0


def markdown(d: dict[str, Any]) -> str:
    rows = [[c, *(d.get(f"{p}{c}_{s}") for s in ("ms", "wall_ms", "gpu_busy_ms", "mem_gib", "peak_gib")
                  for p in ("before_", "")), (d.get("ratios") or {}).get(c)] for c in CASES]
    trees = d.get("trees") or {}
    lines = H.md_head("One decision owner: the key speed rows, before and after (issue 38)", d) + [
        "", f"- before: `{(trees.get('before') or {}).get('root')}` ({(trees.get('before') or {}).get('commit')}); "
        f"this tree: {(trees.get('current') or {}).get('commit')}; each in its own process, same GPU, one run",
        "- ms: median of synchronized calls between CUDA events; wall: perf_counter; busy: kernel sum of one "
        "profiled call; mem: memory_allocated after gc while patched; peak: max_memory_allocated of the case", "",
        *H.md_table(["case", "before ms", "ms", "before wall", "wall", "before busy", "busy", "before mem GiB",
                     "mem GiB", "before peak", "peak", "this / before"], rows, nd=2)]
    lines += [f"\n`{n}` errors: {t.get('errors')}" for n, t in trees.items() if t.get("errors")]
    return H.md_document(lines, d)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = H.parser(__doc__, budget_s=0.0)
    p.add_argument("--before-root", type=Path, default=None, help="the older checkout (its qwen_absorb/ is imported)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, default=H.ROOT, help=argparse.SUPPRESS)
    p.add_argument("--worker-json", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-timeout-s", type=float, default=280.0, help="kill a tree's worker after this long")
    defaults = {"num_layers": (60, 2), "num_layers21": (32, 2), "side": (64, 4), "text_tokens": (128, 8),
                "warmup": (2, 1), "iters": (7, 2), "calib": (1, 1), "rank": (64, 4)}
    H.add_int_args(p, defaults)
    H.add_steady_warmup_arg(p)
    a = H.finish_args(p, p.parse_args(argv), tiny_prefix="one_owner", defaults=defaults)
    a.warmup_s = 1.0 if a.warmup_s is None and not a.tiny else H.steady_warmup_s(a)
    if not a.tiny and a.iters < 5:
        p.error("--iters must be >= 5 (medians of at least 5 calls)")
    if a.worker:
        d = worker(a)
        H.write_atomic(a.worker_json, json.dumps(H.json_safe(d)) + "\n")
        return 0
    forward = [x for x in argv if not x.startswith("--before-root") and x != str(a.before_root)]
    return parent(a, forward + ["--out", str(a.out)] * ("--out" not in forward))


if __name__ == "__main__":
    sys.exit(main())
