"""Tensor and context parallelism (diffusers 0.42.1) with the patched model, on CPU with gloo.

Two parts:

- Two gloo processes (``tests/parallel_worker.py``, launched once per module as plain subprocesses
  with a hard timeout, rendezvous through a FileStore: no ports, nothing left running on a hang) run
  a tiny transformer single-process, with Ulysses CP (degree 2) and with TP (degree 2), unpatched and
  patched before/after ``enable_parallelism``; the tests below assert on what they report.
  Expected: unpatched parallel == single process up to reduction order; patched parallel ==
  unpatched parallel **bit for bit** (on CPU the fused ops run their references and ``patch()``
  defers no bias of an unquantized model); the fused ops are only ever handed plain tensors.
- Unit tests of :mod:`qwen_absorb.parallel` on DTensors of a 1-process gloo mesh, in this process.

Set ``QWEN_ABSORB_PARALLEL_TIMEOUT`` (seconds, default 180) to change the worker timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from qwen_absorb import parallel as par

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "parallel_worker.py"
WORLD = 2
TIMEOUT = float(os.environ.get("QWEN_ABSORB_PARALLEL_TIMEOUT", "180"))


def _gloo_reason() -> str | None:
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001
        return f"torch.distributed does not import: {e}"
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "the gloo backend is not available in this torch build"
    return None


pytestmark = [pytest.mark.skipif(_gloo_reason() is not None, reason=str(_gloo_reason())), pytest.mark.slow]

TP_AAC_REASON = (
    "issue 12: under diffusers 0.42.1 TP the row-wise projections (attn.to_out.0, attn.to_add_out, "
    "img_mlp.net.2, txt_mlp.net.2) return torch's AsyncCollectiveTensor (a wrapper subclass: data_ptr() is 0, its "
    "all-reduce may still be in flight); the patched block hands it unchanged to the fused ops as the attention / "
    "FFN output `y`. The CPU references cope (torch ops wait first), a raw CUDA kernel reads address 0: the "
    "'illegal memory access'. Fix in the block: `y, why = qwen_absorb.parallel.local_view(y)` before each "
    "residual op (and local_view on a deferred bias), falling back to the diffusers expression when `why`."
)


# ------------------------------------------------------------------------------ the 2-process run


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("QWEN_ABSORB_FORCE_REFERENCE", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if "GLOO_SOCKET_IFNAME" not in env:
        try:  # gloo binds to the address of the host name; fall back to loopback if it does not resolve
            socket.gethostbyname(socket.gethostname())
        except OSError:
            env["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    return env


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Run the two worker processes once; return rank 0's results (see tests/parallel_worker.py)."""
    out = tmp_path_factory.mktemp("parallel")
    store = out / "store"
    logs = [open(out / f"rank{r}.log", "w+") for r in range(WORLD)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--rank", str(r), "--world-size", str(WORLD), "--init-file", str(store),
             "--out", str(out), "--timeout", str(max(TIMEOUT - 5, 10))],
            cwd=REPO, env=_env(), stdout=logs[r], stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    deadline = time.monotonic() + TIMEOUT
    timed_out = False
    try:
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:  # only the processes started here, by handle
            if p.poll() is None:
                p.kill()
                p.wait()

    def tails() -> str:
        parts = []
        for r, f in enumerate(logs):
            f.flush()
            f.seek(0)
            parts.append(f"--- rank {r} (exit {procs[r].returncode})\n{f.read()[-5000:]}")
            f.close()
        return "\n".join(parts)

    if procs[0].returncode == 3 and procs[1].returncode == 3:
        pytest.skip("worker: torch.distributed / gloo unavailable")
    res_file = out / "results.json"
    if timed_out or not res_file.exists() or any(p.returncode != 0 for p in procs):
        pytest.fail(("timed out after %.0f s" % TIMEOUT if timed_out else "worker failed") + "\n" + tails())
    for f in logs:
        f.close()
    return json.loads(res_file.read_text())


def _get(run: dict, key: str) -> dict:
    err = run["errors"].get(key)
    assert err is None, f"{key} raised in the worker:\n{err}"
    return run[key]


MODES = ["cp", "tp"]


@pytest.mark.parametrize("mode", MODES)
def test_unpatched_parallel_matches_single_process(run, mode):
    r = _get(run, f"{mode}.unpatched_vs_single")
    assert r["allclose"], r  # same math, different reduction order (TP all-reduce, Ulysses)
    assert r["ranks_agree"], "the ranks disagree on the (replicated) model output"


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("mode", MODES)
def test_patched_parallel_is_bit_identical_to_unpatched_parallel(run, mode, order):
    r = _get(run, f"{mode}.patched_{order}")
    assert r["blocks_patched"] == 2 and r["biases_deferred"] == 0, r
    assert r["equal"], f"patched {order} enable_parallelism differs from unpatched {mode}: max |diff| {r['max_abs']}"
    assert r["ranks_agree"]
    if order == "after":
        assert r["unpatched_again"]["equal"], "unpatch() under parallelism did not restore the unpatched output"
    # TP: every linear of both blocks ran on its local shards, none through DTensor (8 column-wise:
    # q/k/v x 2 streams + 2 FFN up; 4 row-wise: 2 attention outputs + 2 FFN down); CP has no sharded linear
    want = {"colwise": 16, "rowwise": 8} if mode == "tp" else {}
    assert r["tp_local_linears"] == want, r
    assert not [k for k in r["runtime_fallbacks"] if "DTensor" in k], r["runtime_fallbacks"]


def test_tp_deferred_rowwise_biases_are_added_once_after_the_all_reduce(run):
    """defer_bias=True under TP: the local GEMM runs without the row-wise bias, the fused op adds the
    full bias to the all-reduced sum (unpatched adds b / N before it: equal up to rounding)."""
    r = _get(run, "tp.patched_deferred")
    assert r["biases_deferred"] > 0, r
    assert r["tp_local_linears"] == {"colwise": 16, "rowwise": 8}, r
    assert r["allclose"] and r["ranks_agree"], r  # a bias added twice or lost would be far off


@pytest.mark.parametrize("mode", MODES)
def test_modelopt_fp8_real_gemms_under_parallelism(run, mode):
    """ModelOpt FP8 quantized after enable_parallelism, patched with real FP8 GEMMs (CPU _scaled_mm):
    every linear of both blocks runs as a real FP8 GEMM (under TP: on its local shards, the row-wise
    outputs all-reduced). CP: bit-identical to the same patched model on one process. TP: the split
    sums add less than half the error FP8 itself has against fake quant, and the error against TP's
    fake quant is the one-process error (a lost or doubled bias, or a missing all-reduce, is far off)."""
    r = _get(run, f"{mode}.fp8_real")
    assert r["fp8_gemm_linears"] == 28 and r["ranks_agree"], r
    assert not [k for k in r["runtime_fallbacks"] if "DTensor" in k], r["runtime_fallbacks"]
    fp8_err = r["rel_single_real_vs_single_fake"]
    assert 0 < fp8_err < 0.05, r
    if mode == "cp":
        assert r["rel_real_vs_single_real"] == 0.0, r
    else:
        assert r["rel_real_vs_single_real"] < 0.5 * fp8_err, r
    assert r["rel_real_vs_fake"] <= 2 * fp8_err + 1e-3, r


def test_tp_through_dtensor_switch(run):
    """Tuning(tp_local=False): the TP linears run through DTensor (the comparison the benchmark
    makes); still bit-identical."""
    r = _get(run, "tp.patched_through_dtensor")
    assert r["tp_local_linears"] == {} and r["equal"], r


@pytest.mark.parametrize("mode", MODES)
def test_per_token_modulation_batch2(run, mode):
    """zero_cond_t (Edit-2511): per-token modulate_index, which CP splits at every block; batch 2."""
    r = _get(run, f"{mode}.zero_cond_t_b2")
    assert r["unpatched_vs_single"]["allclose"], r
    assert r["patched_vs_unpatched"]["equal"], r


@pytest.mark.parametrize(
    "mode", ["cp", "tp"]
)
def test_fused_ops_are_handed_plain_tensors(run, mode):
    """The contract that keeps raw kernels safe: no DTensor / AsyncCollectiveTensor reaches a fused op."""
    r = _get(run, f"{mode}.op_args")
    assert r["n_calls"] > 0, ("the worker's op spy saw no fused-op call: qwen_absorb.block no longer calls "
                              "functions imported from qwen_absorb.ops.*; update _op_spy in tests/parallel_worker.py")
    assert r["non_plain_args"] == [], "tensor subclasses handed to fused ops:\n" + "\n".join(r["non_plain_args"])


def test_tp_facts(run):
    """What the block sees under diffusers 0.42.1 TP (documented in qwen_absorb/parallel.py)."""
    f = _get(run, "facts.tp")
    obs = f["observed"]
    # the block's own inputs and the modulation are plain, full-size tensors
    assert obs["img_norm1"]["in"][0]["plain"] and obs["img_norm1"]["in"][0]["shape"] == [2, 32, 64]
    assert obs["img_mod"]["out"]["plain"]
    # column-wise: plain local output, sharded on the hidden dim (heads / N)
    assert obs["attn.to_q"]["out"]["plain"] and obs["attn.to_q"]["out"]["shape"] == [2, 32, 32]
    # row-wise: Partial(sum) before the output hook, then an AsyncCollectiveTensor of the full shape
    pre = obs["attn.to_out.0 before output hook"]
    assert pre["out"]["placements"] == ["Partial(sum)"], pre
    assert pre["local_is_xW_plus_b_over_N"] or pre["local_is_xW_plus_b"], pre
    for name in ("attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2"):
        o = obs[name]["out"]
        assert o["async"] and o["data_ptr_zero"] and o["shape"][-1] == 64, (name, o)
    view = obs["local_view(to_add_out output)"]
    assert view["ok"] and view["view"]["plain"] and view["view"]["shape"] == [2, 8, 64]
    # the helpers on the real TP modules
    styles = f["projection_tp_style"]
    assert {k for k, v in styles.items() if v == "rowwise"} == {
        "attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2"}
    assert styles["img_mod.1"] is None and styles["attn.to_q"] == "colwise"
    assert all(f["tp_defer_refusals"][k] == [] for k in ("attn.to_out.0", "attn.to_add_out", "img_mlp.net.2"))
    assert f["tp_defer_refusals"]["attn.to_q"]
    assert f["local_view(to_out.0.bias)"]["ok"] and f["local_view(to_out.0.bias)"]["view"]["shape"] == [64]
    assert not f["local_view(to_out.0.weight)"]["ok"] and "dim 1" in f["local_view(to_out.0.weight)"]["why"]
    assert f["parallel_kind"] == "tp"


def test_cp_facts(run):
    f = _get(run, "facts.cp")
    obs = f["observed"]
    # rank-local sequences (32 image tokens and 8 text tokens over 2 ranks), plain tensors everywhere
    assert obs["img_norm1"]["in"][0]["shape"] == [2, 16, 64] and obs["txt_norm1"]["in"][0]["shape"] == [2, 4, 64]
    assert obs["img_mod"]["in"][0]["shape"] == [4, 64]  # temb is not split (2B rows: zero_cond_t)
    for name in ("attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2"):
        assert obs[name]["out"]["plain"], (name, obs[name])
    assert f["parallel_kind"] == "cp"


def test_allow_cpu_parallelism_is_undone(run):
    a = run["allow_cpu_parallelism"]
    assert a["inside"]["device_count"] >= 1 and a["inside"]["cpu_tp_allowed"]
    assert a["after"] == a["before"]


# ------------------------------------------------------------------------------ helpers, 1 process


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = tmp_path_factory.mktemp("pg1") / "store"
    dist.init_process_group("gloo", init_method=store.as_uri(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_plain_tensors_are_not_subclasses():
    t = torch.randn(2, 3, 4)
    for x in (t, nn.Parameter(t)):
        assert par.is_plain_tensor(x) and not par.is_dtensor(x) and not par.is_async_collective(x)
        v, why = par.local_view(x)
        assert v is x and why is None
    for x in (None, 3, "a"):
        assert not par.is_dtensor(x) and not par.is_plain_tensor(x)
        assert par.local_view(x)[0] is None


def test_checks_never_import_torch_distributed_tensor(monkeypatch):
    """The hot-path checks look the classes up in sys.modules; they never import them."""
    for m in ("torch.distributed.tensor", "torch.distributed._functional_collectives"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    t = torch.zeros(1)
    sub = t.as_subclass(type("Sub", (torch.Tensor,), {}))
    assert not par.is_dtensor(sub) and not par.is_async_collective(sub)
    assert par.local_view(sub)[0] is None and "subclass" in par.local_view(sub)[1]
    assert par.local_view(t)[0] is t
    assert "torch.distributed.tensor" not in sys.modules
    assert "torch.distributed._functional_collectives" not in sys.modules


def test_local_view_of_dtensors(mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: PLC0415

    x = torch.randn(2, 4, 8)
    rep = distribute_tensor(x, mesh, [Replicate()])
    assert par.is_dtensor(rep) and not par.is_plain_tensor(rep)
    v, why = par.local_view(rep)
    assert why is None and par.is_plain_tensor(v) and torch.equal(v, x)

    for dim in (2, -1):
        v, why = par.local_view(distribute_tensor(x, mesh, [Shard(dim)]))
        assert v is None and "sharded on dim 2" in why
    v, why = par.local_view(distribute_tensor(x, mesh, [Shard(1)]), shard_ok_dims=(1,))
    assert why is None and torch.equal(v, x)  # token-dim shard, explicitly accepted by the caller
    v, why = par.local_view(DTensor.from_local(x, mesh, [Partial()]))
    assert v is None and "Partial" in why
    p = nn.Parameter(distribute_tensor(x[0, 0], mesh, [Replicate()]))
    assert par.is_dtensor(p) and torch.equal(par.local_view(p)[0], x[0, 0])
    assert "DTensor" in par.describe_tensor(rep) and "Replicate" in par.describe_tensor(rep)


def test_local_view_waits_for_async_collective(mesh):
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415

    x = torch.randn(2, 4, 8)
    act = funcol.all_reduce(x, "sum", mesh)  # 1 rank: the sum is x
    assert par.is_async_collective(act) and not par.is_dtensor(act) and not par.is_plain_tensor(act)
    assert act.data_ptr() == 0  # the reason a raw kernel must never get one
    v, why = par.local_view(act)
    assert why is None and par.is_plain_tensor(v) and v.data_ptr() != 0 and torch.equal(v, x)


def _mlp(mesh, row_kwargs=None):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(**(row_kwargs or {}))})


class _Wrapper(nn.Module):  # a PEFT-like wrapper
    def __init__(self, base):
        super().__init__()
        self.base_layer = base


def test_projection_tp_style_and_defer_refusals(mesh):
    m = _mlp(mesh)
    assert par.projection_tp_style(m[0]) == "colwise"
    assert par.projection_tp_style(m[2]) == "rowwise"
    assert par.projection_tp_style(_Wrapper(m[2])) == "rowwise"
    assert par.projection_tp_style(nn.Linear(4, 4)) is None
    assert par.tp_defer_refusals(m[2]) == []
    assert par.tp_defer_refusals(nn.Linear(4, 4)) == []
    assert any("column-wise" in r for r in par.tp_defer_refusals(m[0]))
    out = m(torch.randn(2, 3, 8))
    assert out.shape == (2, 3, 8)


def test_defer_refused_when_rowwise_output_is_not_reduced(mesh):
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    assert any("output stays" in r for r in par.tp_defer_refusals(_mlp(mesh, {"output_layouts": Shard(1)})[2]))
    # a DTensor output (use_local_output=False) is still reduced: fine, local_view takes it
    assert par.tp_defer_refusals(_mlp(mesh, {"output_layouts": Replicate(), "use_local_output": False})[2]) == []


def test_parallel_kind():
    from types import SimpleNamespace  # noqa: PLC0415

    assert par.parallel_kind(nn.Linear(2, 2)) is None
    m = nn.Linear(2, 2)
    m._parallel_config = SimpleNamespace(tensor_parallel_config=object(), context_parallel_config=None)
    assert par.parallel_kind(m) == "tp"
    m._parallel_config = SimpleNamespace(tensor_parallel_config=None, context_parallel_config=object())
    assert par.parallel_kind(m) == "cp"



def test_auto_leaves_rowwise_tp_biases_in_the_gemm(mesh):
    """Measured on 2 H200s (benchmarks/results/parallel/parallel.md): the FP8 model under TP ran slower with its
    row-wise biases deferred, so defer_bias="auto" keeps them in the GEMM (decided at plan time, said in
    the report); True still defers."""
    from qwen_absorb import gating  # noqa: PLC0415

    mlp = _mlp(mesh)
    auto = gating.tp_bias_refusals(mlp[2], "auto")
    assert any("defer_bias='auto' leaves row-wise biases" in r for r in auto), auto
    assert gating.tp_bias_refusals(mlp[2], True) == []
    assert any("column-wise" in r for r in gating.tp_bias_refusals(mlp[0], True))
    assert gating.tp_bias_refusals(nn.Linear(4, 4), "auto") == []  # no tensor parallelism: nothing to refuse


# ------------------------------------------------------------------------------ local TP shards


def test_tp_shard_recognises_torch_default_styles(mesh):
    """Column- and row-wise Linears of torch's default styles are run on their shards; the record is
    reused while nothing changes and dropped when a hook is added or the parameters are replaced."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    m = _mlp(mesh)
    col, why = par.tp_shard(m[0])
    assert why is None and col.style == "colwise" and col.world == 1
    row, why = par.tp_shard(m[2])
    assert why is None and row.style == "rowwise"
    assert par.tp_shard(m[2])[0] is row  # cached
    assert par.tp_shard(nn.Linear(4, 4)) == (None, None)  # plain weight: not TP, nothing to say
    # the local bias: column-wise its shard, row-wise b / N (cached per value), none while shadowed
    assert torch.equal(col.local_bias(m[0]), m[0].bias.to_local())
    assert torch.equal(row.local_bias(m[2]), m[2].bias.to_local() / 1)
    object.__setattr__(m[2], "bias", None)
    assert row.local_bias(m[2]) is None
    m[2].__dict__.pop("bias")
    # a user's hook makes the module's own call necessary
    h = m[2].register_forward_hook(lambda mod, args, out: out)
    rec, why = par.tp_shard(m[2])
    assert rec is None and "forward hooks" in why
    h.remove()
    assert par.tp_shard(m[2])[0] is not None
    # non-default layouts and DTensor outputs are refused with the reason
    for kw, words in (({"output_layouts": Shard(1)}, "output layouts"),
                      ({"use_local_output": False}, "use_local_output")):
        rec, why = par.tp_shard(_mlp(mesh, kw)[2])
        assert rec is None and words in why, why
    rec, why = par.tp_shard(_mlp(mesh, {"input_layouts": Replicate()})[2])
    assert rec is None and "input layouts" in why


def test_tp_linear_equals_the_dtensor_module(mesh):
    """projection.tp_linear (local F.linear + all-reduce) == the TP module's call, bit for bit."""
    from qwen_absorb.projection import tp_linear, wait  # noqa: PLC0415

    torch.manual_seed(0)
    m = _mlp(mesh)
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        h_ref = m[0](x)
        y_ref = m[2](h_ref)
        h, work = tp_linear(m[0], par.tp_shard(m[0])[0], x)
        assert work is None and type(h) is torch.Tensor and torch.equal(h, h_ref)
        y, work = tp_linear(m[2], par.tp_shard(m[2])[0], h)
        works = [work]
        wait(works)
        assert works == [] and type(y) is torch.Tensor and torch.equal(y, par.local_view(y_ref)[0])


def test_attention_and_ffn_take_the_tp_path_only_under_tp(mesh):
    """Without TP (plain weights, or a wrapper without a weight of its own) the patched block keeps
    diffusers' attention processor and FeedForward module; with sharded weights it takes the local path."""
    import qwen_absorb  # noqa: PLC0415
    from . import builders as T  # noqa: PLC0415
    from qwen_absorb.block import _tp_attention  # noqa: PLC0415
    from qwen_absorb.ffn import _tp_ffn  # noqa: PLC0415
    from qwen_absorb.plan import PLAN_ATTR  # noqa: PLC0415

    model = T.tiny_transformer(num_layers=1)
    qwen_absorb.patch(model)
    block = model.transformer_blocks[0]
    plan = block.__dict__[PLAN_ATTR]
    assert plan.tp_reasons == {"attn": [], "img_mlp": [], "txt_mlp": []}
    x = torch.randn(1, 4, block.img_mlp.net[0].proj.in_features)
    assert not _tp_attention(plan, block.attn, None)
    assert _tp_ffn(plan, "img_mlp", block.img_mlp, x, []) is None
    block.attn.to_q = _Wrapper(block.attn.to_q)  # PEFT-like: no weight of its own
    assert not _tp_attention(plan, block.attn, None)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

    block.attn.to_q = block.attn.to_q.base_layer
    parallelize_module(block, mesh, {"attn.to_q": ColwiseParallel(), "img_mlp.net.0.proj": ColwiseParallel(),
                                     "img_mlp.net.2": RowwiseParallel()})
    assert _tp_attention(plan, block.attn, None) and not _tp_attention(plan, block.attn, {"x": 1})
    works: list = []
    with torch.no_grad():
        y = _tp_ffn(plan, "img_mlp", block.img_mlp, x, works)
        ref = par.local_view(block.img_mlp(x))[0]
    assert y is not None and len(works) == 1
    works[0].wait()
    assert torch.equal(y, ref)
