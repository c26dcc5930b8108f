"""One rank of the CPU (gloo) parallelism checks of tests/test_parallel_cpu.py.

Runs, on a tiny random Qwen-Image transformer and in one process group, every scenario the tests
assert on, so the ~10 s of importing torch + diffusers per process is paid once:

- a single-process reference (every rank computes it; same seed, same weights);
- for ``cp`` (Ulysses, degree = world size) and ``tp`` (degree = world size): unpatched parallel vs
  single; ``qwen_absorb.patch`` (default arguments) applied before and after
  ``enable_parallelism`` vs unpatched parallel (bit-identical expected: on CPU the fused ops run
  their references and no bias is deferred); ``unpatch`` after parallelism; a batch-2
  ``zero_cond_t`` model (per-token modulation, split ``modulate_index``);
- a spy on the three fused ops recording the type, shape and contiguity of every tensor the patched
  block hands them (the contract: plain tensors only; an ``AsyncCollectiveTensor`` or a DTensor reaching
  a raw CUDA kernel is the TP crash of issue 12);
- facts: what the block and its submodules receive and return (types, placements, shapes), and the
  :mod:`qwen_absorb.parallel` helpers applied to the real TP model.

Rank 0 writes ``<out>/results.json``. A scenario that raises is recorded with its traceback and the
others still run. A watchdog dumps all stacks and exits if the worker runs longer than ``--timeout``.

    python tests/parallel_worker.py --rank 0 --world-size 2 --init-file /tmp/x/store --out /tmp/x &
    python tests/parallel_worker.py --rank 1 --world-size 2 --init-file /tmp/x/store --out /tmp/x
    torchrun --nproc_per_node=2 tests/parallel_worker.py --out /tmp/x      # same, via torchrun
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPS = ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift", "bias_gate_residual")
ATOL = 1e-5  # parallel vs single process: different reduction orders (fp32, |out| ~ 1)


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun)")
    p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE (torchrun)")
    p.add_argument("--init-file", default=None, help="FileStore path for init (default: env:// from torchrun)")
    p.add_argument("--out", required=True, help="folder for results.json (rank 0 writes it)")
    p.add_argument("--timeout", type=float, default=150.0, help="watchdog: dump stacks and exit after this")
    p.add_argument("--only", default="", help="comma-separated subset of cp,tp,facts (default: all)")
    a = p.parse_args(argv)
    a.rank = int(os.environ.get("RANK", 0)) if a.rank is None else a.rank
    a.world_size = int(os.environ.get("WORLD_SIZE", 1)) if a.world_size is None else a.world_size
    if a.world_size < 2:
        p.error("needs a world size >= 2")
    return a


# ------------------------------------------------------------------------------------------ helpers


def _desc(t: Any) -> Any:
    import torch  # noqa: PLC0415

    from qwen_absorb import parallel as par  # noqa: PLC0415

    if isinstance(t, torch.Tensor):
        d = {"repr": par.describe_tensor(t), "type": type(t).__name__, "shape": list(t.shape),
             "plain": par.is_plain_tensor(t), "dtensor": par.is_dtensor(t), "async": par.is_async_collective(t)}
        if par.is_dtensor(t):
            d["placements"] = [repr(p) for p in t.placements]
            d["local_shape"] = list(t.to_local().shape)
        else:
            d["contiguous"] = bool(t.is_contiguous())
            d["data_ptr_zero"] = t.data_ptr() == 0 if par.is_plain_tensor(t) or par.is_async_collective(t) else None
        return d
    if isinstance(t, (tuple, list)):
        return [_desc(x) for x in t]
    if isinstance(t, dict):
        return {k: _desc(v) for k, v in t.items()}
    return None if t is None else type(t).__name__


@contextlib.contextmanager
def _op_spy(calls: list):
    """Record every tensor argument handed to a fused op by the patched block.

    Wraps the public ops in ``qwen_absorb.ops`` and every callable that ``qwen_absorb.block`` imported
    from ``qwen_absorb.ops.*`` (kernel launchers and torch references alike: the block hands both the
    same operands, and on a CPU only the references run). Install before ``patch()``.
    """
    import torch  # noqa: PLC0415

    import qwen_absorb.ops as ops_mod  # noqa: PLC0415
    import qwen_absorb.site_runners as runners_mod  # noqa: PLC0415

    saved = []

    def wrap(name, fn):
        def spy(*args, **kwargs):
            rec = {"op": name, "args": {}}
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    rec["args"][f"arg{i}"] = _desc(a)
            for k, v in kwargs.items():
                if isinstance(v, torch.Tensor):
                    rec["args"][k] = _desc(v)
            calls.append(rec)
            return fn(*args, **kwargs)

        spy.__wrapped__ = fn
        return spy

    targets = [(ops_mod, n) for n in OPS if callable(ops_mod.__dict__.get(n))]
    for where in (runners_mod,):  # the op launchers as the site runners import them
        for n, fn in list(where.__dict__.items()):
            mod = getattr(fn, "__module__", "") or ""
            if callable(fn) and not isinstance(fn, type) and mod.startswith("qwen_absorb.ops"):
                targets.append((where, n))
    for mod, name in targets:
        fn = mod.__dict__[name]
        saved.append((mod, name, fn))
        setattr(mod, name, wrap(name, fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


@contextlib.contextmanager
def _tp_spy(counts: dict):
    """Count the linears the patched block ran on their local TP shards (``projection.tp_linear``, as
    imported by ``qwen_absorb.ffn`` and ``qwen_absorb.attention``), per style."""
    import qwen_absorb.attention as attn_mod  # noqa: PLC0415
    import qwen_absorb.ffn as ffn_mod  # noqa: PLC0415

    saved = []
    for mod in (ffn_mod, attn_mod):
        fn = mod.__dict__["tp_linear"]

        def spy(linear, shard, x, _fn=fn):
            counts[shard.style] = counts.get(shard.style, 0) + 1
            return _fn(linear, shard, x)

        saved.append((mod, fn))
        mod.tp_linear = spy
    try:
        yield
    finally:
        for mod, fn in saved:
            mod.tp_linear = fn


class _Ctx:
    def __init__(self, args):
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        self.torch, self.dist = torch, dist
        self.rank, self.world = args.rank, args.world_size
        self.results: dict[str, Any] = {"world_size": self.world, "errors": {}}

    def cfg(self, mode: str):
        from diffusers import ContextParallelConfig, TensorParallelConfig  # noqa: PLC0415

        if mode == "cp":
            return ContextParallelConfig(ulysses_degree=self.world)
        return TensorParallelConfig(tp_degree=self.world)

    def model(self, zero_cond_t: bool = False, dtype=None):
        from tests.builders import tiny_transformer  # noqa: PLC0415

        return tiny_transformer(num_layers=2, zero_cond_t=zero_cond_t, seed=3, dtype=dtype or self.torch.float32)

    def inputs(self, m, batch_size: int = 1):
        from tests.builders import transformer_inputs  # noqa: PLC0415

        # 16 image tokens (x2 with a condition image) and 8 text tokens: divisible by the CP degree 2.
        return transformer_inputs(m, batch_size=batch_size, height=4, width=4, text_len=8, seed=5)

    def run(self, m, inp):
        from tests.builders import run_transformer  # noqa: PLC0415

        out = run_transformer(m, inp)
        # CP's output comes out of an all-gather (an AsyncCollectiveTensor): make it a plain tensor.
        return out.clone() if type(out) is self.torch.Tensor else (out + 0).contiguous()

    def ranks_agree(self, t) -> bool:
        """Every rank got the same full output (TP and CP both replicate the model output)."""
        gathered = [self.torch.empty_like(t) for _ in range(self.world)]
        self.dist.all_gather(gathered, t.contiguous())
        return all(self.torch.equal(g, gathered[0]) for g in gathered)

    def cmp(self, a, b) -> dict[str, Any]:
        torch = self.torch
        return {"equal": bool(torch.equal(a, b)), "max_abs": float((a - b).abs().max()),
                "allclose": bool(torch.allclose(a, b, atol=ATOL, rtol=ATOL)), "shape": list(a.shape)}

    def scenario(self, key: str, fn):
        t0 = time.perf_counter()
        try:
            self.results[key] = fn()
        except Exception as e:  # noqa: BLE001  (recorded; the test reports it)
            self.results[key] = None
            self.results["errors"][key] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-4000:]}"
        # keep the ranks in step between scenarios (a scenario raising on one rank only would
        # otherwise leave the next collective mismatched)
        self.dist.barrier()
        self.results.setdefault("seconds", {})[key] = round(time.perf_counter() - t0, 2)


# ------------------------------------------------------------------------------------------ scenarios


def _mode_scenarios(c: _Ctx, mode: str) -> None:
    import qwen_absorb  # noqa: PLC0415

    m0 = c.model()
    inp = c.inputs(m0)
    single = c.run(m0, inp)

    def unpatched():
        m = c.model()
        m.enable_parallelism(config=c.cfg(mode))
        out = c.run(m, inp)
        c.base = out
        return {**c.cmp(out, single), "ranks_agree": c.ranks_agree(out)}

    c.base = None
    c.scenario(f"{mode}.unpatched_vs_single", unpatched)
    if c.base is None:
        return
    base = c.base

    def patched(order: str):
        def fn():
            m = c.model()
            report = None
            if order == "before":
                report = qwen_absorb.patch(m)
            m.enable_parallelism(config=c.cfg(mode))
            if order == "after":
                report = qwen_absorb.patch(m)
            local: dict = {}
            with _tp_spy(local):
                out = c.run(m, inp)
            res = {**c.cmp(out, base), "ranks_agree": c.ranks_agree(out), "tp_local_linears": local,
                   "blocks_patched": report.summary["blocks_patched"],
                   "biases_deferred": report.summary["biases_deferred"],
                   "runtime_fallbacks": {k: int(v) for k, v in report.runtime_fallbacks.items()}}
            if order == "after":
                qwen_absorb.unpatch(m)
                res["unpatched_again"] = c.cmp(c.run(m, inp), base)
            return res
        return fn

    def deferred():
        """defer_bias=True: row-wise biases leave the GEMM and are added once after the all-reduce."""
        m = c.model()
        m.enable_parallelism(config=c.cfg(mode))
        report = qwen_absorb.patch(m, defer_bias=True, capabilities={"cpu"})
        local: dict = {}
        with _tp_spy(local):
            out = c.run(m, inp)
        return {**c.cmp(out, base), "ranks_agree": c.ranks_agree(out), "tp_local_linears": local,
                "biases_deferred": report.summary["biases_deferred"],
                "runtime_fallbacks": {k: int(v) for k, v in report.runtime_fallbacks.items()}}

    def through_dtensor():
        """Tuning(tp_local=False): every TP linear runs through DTensor, the rest fused."""
        m = c.model()
        m.enable_parallelism(config=c.cfg(mode))
        qwen_absorb.patch(m, tuning=qwen_absorb.Tuning(tp_local=False))
        local: dict = {}
        with _tp_spy(local):
            out = c.run(m, inp)
        return {**c.cmp(out, base), "tp_local_linears": local}

    c.scenario(f"{mode}.patched_before", patched("before"))
    c.scenario(f"{mode}.patched_after", patched("after"))
    c.scenario(f"{mode}.patched_deferred", deferred)

    def fp8_run():
        from tests.builders import fp8_quantize, transformer_inputs  # noqa: PLC0415

        torch = c.torch
        inp16 = transformer_inputs(c.model(dtype=torch.bfloat16), batch_size=1, height=4, width=4, text_len=8, seed=5)

        def quantized(parallel: bool):
            m = c.model(dtype=torch.bfloat16)
            if parallel:
                m.enable_parallelism(config=c.cfg(mode))
            return fp8_quantize(m, inp16)

        def rel(a, b):
            return float((a.float() - b.float()).norm() / b.float().norm())

        single = quantized(False)
        fake1 = c.run(single, inp16)
        qwen_absorb.patch(single, fp8_gemm=True, capabilities={"cpu"})
        real1 = c.run(single, inp16)
        m = quantized(True)
        fake = c.run(m, inp16)
        report = qwen_absorb.patch(m, fp8_gemm=True, capabilities={"cpu"})
        out = c.run(m, inp16)
        return {"fp8_gemm_linears": report.summary["fp8_gemm_linears"],
                "runtime_fallbacks": {k: int(v) for k, v in report.runtime_fallbacks.items()},
                "ranks_agree": c.ranks_agree(out),
                "rel_real_vs_single_real": rel(out, real1), "rel_real_vs_fake": rel(out, fake),
                "rel_single_real_vs_single_fake": rel(real1, fake1), "rel_fake_vs_single_fake": rel(fake, fake1)}

    c.scenario(f"{mode}.fp8_real", fp8_run)
    c.scenario(f"{mode}.patched_through_dtensor", through_dtensor)

    def zero_cond():
        mz = c.model(zero_cond_t=True)
        inpz = c.inputs(mz, batch_size=2)
        ref = c.run(mz, inpz)
        mu = c.model(zero_cond_t=True)
        mu.enable_parallelism(config=c.cfg(mode))
        unp = c.run(mu, inpz)
        mp_ = c.model(zero_cond_t=True)
        mp_.enable_parallelism(config=c.cfg(mode))
        qwen_absorb.patch(mp_)
        pat = c.run(mp_, inpz)
        return {"unpatched_vs_single": c.cmp(unp, ref), "patched_vs_unpatched": c.cmp(pat, unp)}

    c.scenario(f"{mode}.zero_cond_t_b2", zero_cond)

    def spy():
        calls: list = []
        m = c.model(zero_cond_t=True)
        inpz = c.inputs(m, batch_size=2)
        m.enable_parallelism(config=c.cfg(mode))
        with _op_spy(calls):
            qwen_absorb.patch(m)
            c.run(m, inpz)
        bad = sorted({f"{r['op']}({k}): {v['repr']}" for r in calls for k, v in r["args"].items() if not v["plain"]})
        return {"n_calls": len(calls), "non_plain_args": bad, "calls": calls[:6]}

    c.scenario(f"{mode}.op_args", spy)


def _facts(c: _Ctx) -> None:
    """Types / placements / shapes inside block 1, unpatched, under TP and CP; helpers on TP modules."""
    torch = c.torch
    from qwen_absorb import parallel as par  # noqa: PLC0415

    def observe(mode: str):
        m = c.model(zero_cond_t=True)
        inp = c.inputs(m, batch_size=2)
        m.enable_parallelism(config=c.cfg(mode))
        blk = m.transformer_blocks[1]
        seen: dict[str, Any] = {}
        hooks = []

        def out_hook(name):
            def h(mod, args, kwargs, out):
                seen[name] = {"in": _desc(list(args) + [v for v in kwargs.values() if isinstance(v, torch.Tensor)]),
                              "out": _desc(out)}
            return h

        for name in ("img_mod", "txt_mod", "img_norm1", "txt_norm1", "attn", "attn.to_q", "attn.to_out.0",
                     "attn.to_add_out", "img_mlp", "img_mlp.net.0", "img_mlp.net.2", "txt_mlp.net.2"):
            hooks.append(blk.get_submodule(name).register_forward_hook(out_hook(name), with_kwargs=True))

        def attn_pre(mod, args, kwargs):
            seen["attn.kwargs"] = _desc({k: v for k, v in kwargs.items() if k != "hidden_states"})
        hooks.append(blk.attn.register_forward_pre_hook(attn_pre, with_kwargs=True))

        # the Partial DTensor a row-wise linear computes before its output hook all-reduces it
        def partial_hook(mod, args, out):
            x = args[0]
            loc = out.to_local() if par.is_dtensor(out) else None
            info = {"out": _desc(out)}
            if loc is not None and par.is_dtensor(x):
                mm = x.to_local() @ mod.weight.to_local().t()
                b = mod.bias.to_local()
                info["local_is_xW_plus_b_over_N"] = bool(torch.allclose(loc, mm + b / c.world, atol=1e-6))
                info["local_is_xW_plus_b"] = bool(torch.allclose(loc, mm + b, atol=1e-6))
                info["local_is_xW"] = bool(torch.allclose(loc, mm, atol=1e-6))
            seen["attn.to_out.0 before output hook"] = info
        if mode == "tp":
            hooks.append(blk.attn.to_out[0].register_forward_hook(partial_hook, prepend=True))

        def view_hook(mod, args, out):
            v, why = par.local_view(out)
            seen["local_view(to_add_out output)"] = {"ok": v is not None, "why": why, "view": _desc(v)}
        hooks.append(blk.attn.to_add_out.register_forward_hook(view_hook))
        c.run(m, inp)
        for h in hooks:
            h.remove()
        res = {"observed": seen}
        if mode == "tp":
            names = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                     "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                     "txt_mlp.net.0.proj", "txt_mlp.net.2", "img_mod.1", "txt_mod.1"]
            res["projection_tp_style"] = {n: par.projection_tp_style(blk.get_submodule(n)) for n in names}
            res["tp_defer_refusals"] = {n: par.tp_defer_refusals(blk.get_submodule(n)) for n in names}
            b, why = par.local_view(blk.attn.to_out[0].bias)
            res["local_view(to_out.0.bias)"] = {"ok": b is not None, "why": why, "view": _desc(b)}
            w, why = par.local_view(blk.attn.to_out[0].weight)
            res["local_view(to_out.0.weight)"] = {"ok": w is not None, "why": why}
            w, why = par.local_view(blk.attn.to_q.weight)
            res["local_view(to_q.weight)"] = {"ok": w is not None, "why": why}
            res["params"] = {n: par.describe_tensor(p) for n, p in blk.named_parameters()}
        res["parallel_kind"] = par.parallel_kind(m)
        return res

    c.scenario("facts.tp", lambda: observe("tp"))
    c.scenario("facts.cp", lambda: observe("cp"))


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = _parse(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    if not dist.is_available() or not dist.is_gloo_available():
        print("torch.distributed / gloo unavailable", file=sys.stderr)
        return 3
    init = dict(backend="gloo", timeout=datetime.timedelta(seconds=max(10.0, args.timeout / 3)))
    if args.init_file:
        init.update(init_method=Path(args.init_file).resolve().as_uri(), rank=args.rank, world_size=args.world_size)
    dist.init_process_group(**init)

    import logging  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    warnings.filterwarnings("ignore")
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    from qwen_absorb.parallel import allow_cpu_parallelism  # noqa: PLC0415

    c = _Ctx(args)
    c.results["seconds"] = {"startup": round(time.perf_counter() - t_start, 2)}
    import diffusers.hooks.tensor_parallel as tpmod  # noqa: PLC0415

    state = lambda: {"device_count": torch.accelerator.device_count(),  # noqa: E731
                     "cpu_tp_allowed": "cpu" in tpmod._SUPPORTED_TP_DEVICES}
    before = state()
    with allow_cpu_parallelism():
        inside = state()
    c.results["allow_cpu_parallelism"] = {"before": before, "inside": inside, "after": state()}
    only = {s for s in args.only.split(",") if s} or {"cp", "tp", "facts"}
    with allow_cpu_parallelism(), torch.no_grad():
        for mode in ("cp", "tp"):
            if mode in only:
                _mode_scenarios(c, mode)
        if "facts" in only:
            _facts(c)
    if args.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(c.results, indent=1, default=str) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
