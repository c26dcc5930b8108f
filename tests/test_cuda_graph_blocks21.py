"""Issue 21, item 5: CUDA graphs per block for Qwen-Image-2.1 (qwen_absorb.cuda_graph.attach.install_blocks / shared), on the CPU.

The capture / replay path runs with the stand-ins of tests/cuda_graph_fakes.py (``fake_cuda``): a block's "graph"
replays by running its patched forward on the static buffers and writing into its static output. Outputs are
compared with ``torch.equal`` against an unpatched twin (same seed), on inputs drawn fresh per call; static
buffers and graph outputs are poisoned after every call, so a replay that read a stale input or handed out a
static output shows up. Real replays: tests/test_cuda_graph_blocks21_gpu.py.
"""

from __future__ import annotations

import collections
import copy
import gc
import importlib
import json
import pickle
import threading
import weakref

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from qwen_absorb.qwenimage21 import Patched21Forward
from qwen_absorb.cuda_graph import capture as C

from .cuda_graph_fakes import arm
from .qwenimage21_helpers import model_inputs, run, run_kv, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
P = importlib.import_module("qwen_absorb.patch")  # the module (qwen_absorb.patch is also the function)

PREFIX = "cuda_graph: "
CASES = [{"batch_size": 1}, {"batch_size": 2, "cond": True, "pad": 1}]


def _pair(seed, dtype=torch.bfloat16, layers=3, **kw):
    """(model, unpatched twin with the same weights)."""
    return (tiny_model(dtype=dtype, seed=seed, layers=layers, gain=4.0, **kw),
            tiny_model(dtype=dtype, seed=seed, layers=layers, gain=4.0, **kw))


def _group(model):
    return model.__dict__[P._STATE_ATTR].graph


def _call(model, inp, **kw):
    """A model call; every block graph it captured gets its (fake) replay right away."""
    out = run(model, inp, **kw)
    group = _group(model)
    if group is not None:
        for r in group.runners:
            arm(r)
    return out


def _poison(group):
    """Overwrite every static input and graph output: the next replay must copy its inputs anew, and no output
    handed out may be one of these buffers."""
    for r in group.runners:
        for g in r._graphs.values():
            for x in list(g.statics) + C.tensors_in(g.out):
                if x.dtype == torch.bool:
                    x.logical_not_()
                else:
                    x.fill_(float("nan"))


def _graphs(group):
    return [g for r in group.runners for g in r._graphs.values()]


def _seed(s):
    return s % 100_000


# ---------------------------------------------------------------------------- replays == unpatched


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replays_are_bit_identical_to_unpatched(fake_cuda, dtype, case, seed):
    model, twin = _pair(_seed(seed), dtype)
    report = qwen_absorb.patch(model, cuda_graph=True)
    group = _group(model)
    assert isinstance(group, CG.BlockGraphs) and len(group.runners) == 3
    assert all(isinstance(b.__dict__["forward"], CG.GraphedCall) and b.__dict__["forward"]._inner is rec.installed
               for b, rec in zip(model.transformer_blocks, model.__dict__[P._STATE_ATTR].records))
    a = [model_inputs(model, seed=seed + i, **case) for i in range(3)]  # one signature, fresh values
    b = [model_inputs(model, seed=seed + 10 + i, target=(2, 4), **case) for i in range(2)]  # another
    order = [a[0], a[1], b[0], a[2], b[1], a[0]]
    seen = {"model": [], "twin": []}  # every block output, kept (a hook on the block runs outside its graph)
    for name, m in (("model", model), ("twin", twin)):
        for blk in m.transformer_blocks:
            blk.register_forward_hook(lambda mod, args, out, k=name: seen[k].append(out))
    outs = []
    for inp in order:
        outs.append(_call(model, inp))
        _poison(group)
    want = [run(twin, inp) for inp in order]
    for i, (o, w) in enumerate(zip(outs, want)):  # compared after all calls: no output was overwritten since
        assert torch.equal(o, w), i
    assert len(seen["model"]) == len(seen["twin"]) == 3 * len(order)
    for i, (o, w) in enumerate(zip(seen["model"], seen["twin"])):
        assert torch.equal(o, w), f"block output {i}"  # never a graph's static output (poisoned since)
    assert not torch.equal(want[0], want[1])  # fresh inputs, fresh outputs: a stale replay would be caught
    d = report.cuda_graph
    assert d["mode"] == "per block" and d["blocks"] == 3
    assert (d["captures"], d["graphs"], d["replays"], d["eager_calls"]) == (6, 6, 12, 0), d
    assert d["per_block"] == [{"block": i, "graphs": 2, "captures": 2, "replays": 4, "eager_calls": 0}
                              for i in range(3)]
    assert not [k for k in report.runtime_fallbacks if k.startswith(PREFIX)], report.runtime_fallbacks
    assert "CUDA graphs per block (cuda_graph=True): 6 kept over 3 blocks, 6 captured, 12 replays" in str(report)
    json.dumps(report.to_dict())
    qwen_absorb.unpatch(model)
    assert torch.equal(run(model, a[1]), want[1])


def test_auto_on_a_gpu_model_installs_no_block_graphs(fake_cuda, monkeypatch, seed):
    """"auto" on a model on a GPU (the decision device claimed as CUDA here) leaves the blocks eager, with the
    measured reason in the report; cuda_graph=True still installs them."""
    model, twin = _pair(_seed(seed))
    monkeypatch.setattr(P, "_decision_device", lambda t: torch.device("cuda"))
    report = qwen_absorb.patch(model)
    assert _group(model) is None and report.cuda_graph is None
    assert report.cuda_graph_refused == P.GRAPHS_21_AUTO and "per-block graphs were no faster" in str(report)
    assert all(isinstance(b.__dict__["forward"], Patched21Forward) for b in model.transformer_blocks)
    inp = model_inputs(model, seed=seed)
    assert torch.equal(_call(model, inp), run(twin, inp))
    report = qwen_absorb.patch(model, cuda_graph=True)
    assert _group(model) is not None and report.cuda_graph_refused is None
    qwen_absorb.unpatch(model)


@pytest.mark.slow
def test_cuda_graph_false_and_auto_on_cpu_install_nothing(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    inp = model_inputs(model, seed=seed)
    for mode in (False, "auto"):
        report = qwen_absorb.patch(model, cuda_graph=mode)
        assert _group(model) is None and report.cuda_graph is None and report.cuda_graph_refused is None
        assert all(isinstance(b.__dict__["forward"], Patched21Forward) for b in model.transformer_blocks)
        assert torch.equal(run(model, inp), run(twin, inp))
        if mode == "auto":
            assert "CUDA graphs: off (cuda_graph='auto' leaves Qwen-Image-2.1 blocks eager" in str(report)
        qwen_absorb.unpatch(model)


# ---------------------------------------------------------------------------- what the runners share


@pytest.mark.slow
def test_one_pool_one_lock_one_static_per_argument_position(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    qwen_absorb.patch(model, cuda_graph=True)
    group = _group(model)
    sh = group.shared
    sigs = [model_inputs(model, seed=seed, batch_size=2, cond=True, pad=1),
            model_inputs(model, seed=seed + 1, batch_size=2, cond=True, pad=1, target=(2, 4))]
    for inp in sigs + sigs:
        assert torch.equal(_call(model, inp), run(twin, inp))
    graphs = _graphs(group)
    assert len(graphs) == 6
    assert len({id(g.graph.pool) for g in graphs}) == 1 and list(sh.pools.values()) == [graphs[0].graph.pool]
    assert all(r._lock is sh.lock and r._pools is sh.pools and r._streams is sh.streams for r in group.runners)
    by_sig = collections.defaultdict(list)
    for r in group.runners:
        for key, g in r._graphs.items():
            by_sig[key].append(g)
    assert len(by_sig) == 2
    for gs in by_sig.values():
        first = gs[0]
        # hidden_states, modulation, rotary_emb, target_token_mask, key_valid: one buffer each, for every block
        assert len(first.statics) == 5
        assert all(len(g.statics) == len(first.statics) and all(s is t for s, t in zip(g.statics, first.statics))
                   for g in gs)
        spans = sorted((s.untyped_storage().data_ptr(), s.untyped_storage().data_ptr() + s.untyped_storage().nbytes())
                       for s in first.statics)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two tensors of one call share memory"
        outs = [x.data_ptr() for g in gs for x in C.tensors_in(g.out)]
        assert len(set(outs)) == len(outs)  # one output per graph
    # 5 per signature, not 5 per block and signature; the modulation ([B + 1, 4D]) is one buffer for both
    unique = {id(s): s for g in graphs for s in g.statics}
    assert len(unique) == 9 and sum(len(g.statics) for g in graphs) == 30
    d = group.describe()["shared"]
    assert d["pools"] == 1 and d["static_inputs"] == 9
    assert d["static_input_bytes"] == sum(s.untyped_storage().nbytes() for s in unique.values())


@pytest.mark.slow
def test_statics_of_one_call_never_alias(fake_cuda):
    """Tensors of equal metadata at two positions of one call (the same tensor twice, too) get two buffers;
    the next call of that shape gets the same two again."""
    sh = CG.Shared()
    x = torch.randn(4, 8)
    a = sh.statics([x, x, x.clone()])
    assert len({s.data_ptr() for s in a}) == 3
    b = sh.statics([torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)])
    assert all(s is t for s, t in zip(a, b))
    c = sh.statics([torch.randn(4, 9)])  # another shape at position 0: its own buffer
    assert c[0] is not a[0] and c[0].shape == (4, 9)
    del a, b, c
    gc.collect()
    assert sh.describe()["static_inputs"] == 0  # held by the graphs only


@pytest.mark.slow
def test_inference_mode_and_no_grad_calls_keep_their_own_statics(fake_cuda, seed):
    """Graphs captured under torch.inference_mode() read inference tensors; a no_grad call of the same shapes
    (another signature: the mode is keyed) must not be handed those buffers (no copy outside inference mode may
    write them)."""
    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    ins = [model_inputs(model, seed=seed + i) for i in range(3)]
    for inp in ins:
        with torch.inference_mode():
            assert torch.equal(_call(model, inp), run(twin, inp))
        assert torch.equal(_call(model, inp), run(twin, inp))
    d = report.cuda_graph
    assert (d["captures"], d["replays"], d["shared"]["static_inputs"]) == (6, 12, 10), d  # 5 buffers per mode


def test_a_second_thread_runs_eager(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    inp = model_inputs(model, seed=seed)
    want = run(twin, inp)
    for _ in range(2):
        assert torch.equal(_call(model, inp), want)
    got = []
    with _group(model).shared.lock:  # "another thread" is inside the shared buffers
        t = threading.Thread(target=lambda: got.append(run(model, inp)))
        t.start()
        t.join()
    assert torch.equal(got[0], want)
    assert report.runtime_fallbacks[PREFIX + "another thread is using the CUDA-graph runner"] == 3
    assert torch.equal(_call(model, inp), want) and report.cuda_graph["replays"] == 6


def test_stream_order_between_streams():
    """A replay on another stream than the last waits for that one (the shared buffers), on the same it does not."""
    class S:
        waited: list = []

        def __init__(self, name):
            self.name = name

        def __eq__(self, other):
            return isinstance(other, S) and other.name == self.name

        def wait_stream(self, other):
            S.waited.append((self.name, other.name))

    cur = {"s": S("a")}
    real = torch.cuda.current_stream
    torch.cuda.current_stream = lambda *a: cur["s"]
    try:
        sh, dev = CG.Shared(), torch.device("cuda", 0)
        sh.order(dev)
        sh.order(dev)
        cur["s"] = S("b")
        sh.order(dev)
        sh.order(dev)
        cur["s"] = S("a")
        sh.order(dev)
    finally:
        torch.cuda.current_stream = real
    assert S.waited == [("b", "a"), ("a", "b")]


def test_pool_handle_kept_while_a_block_holds_graphs(fake_cuda, seed):
    """A handle is reused only while some block still holds a graph captured into it; once the group has none,
    the next capture starts a new pool (the allocator refuses a handle whose graphs are all gone)."""
    model, twin = _pair(_seed(seed))
    qwen_absorb.patch(model, cuda_graph=True)
    group = _group(model)
    inp = model_inputs(model, seed=seed)
    _call(model, inp)
    pool = _graphs(group)[0].graph.pool
    group.runners[0].invalidate("test")
    assert list(group.shared.pools.values()) == [pool]
    assert torch.equal(_call(model, inp), run(twin, inp))
    assert {id(g.graph.pool) for g in _graphs(group)} == {id(pool)}
    group.invalidate("all")
    assert group.shared.pools == {} and group.describe()["graphs"] == 0
    assert torch.equal(_call(model, inp), run(twin, inp))
    assert {id(g.graph.pool) for g in _graphs(group)} == {id(group.shared.pools[next(iter(group.shared.pools))])}
    assert _graphs(group)[0].graph.pool is not pool


# ---------------------------------------------------------------------------- refusals


@pytest.mark.slow
def test_kv_cache_flex_grad_training_and_thread_refusals_are_counted_and_exact(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    fb = report.runtime_fallbacks
    extract, cached = model_inputs(model, seed=seed, cond=True), model_inputs(model, seed=seed + 1, cond=True)
    assert all(torch.equal(x, y) for x, y in zip(run_kv(model, extract, cached), run_kv(twin, extract, cached)))
    assert fb[PREFIX + "unsupported argument type"] == 6  # layer_cache in extract and cached mode, 3 blocks each
    inp = model_inputs(model, seed=seed + 2)
    with torch.enable_grad():
        out, want = model(**inp, return_dict=False)[0], twin(**inp, return_dict=False)[0]
    assert torch.equal(out.detach(), want.detach()) and fb[PREFIX + "grad enabled"] == 3
    model.train()
    twin.train()
    assert torch.equal(run(model, inp), run(twin, inp)) and fb[PREFIX + "module in training mode"] == 3
    model.eval()
    twin.eval()
    assert report.cuda_graph["captures"] == 0 and report.cuda_graph["refusals"] == {
        "unsupported argument type": 6, "grad enabled": 3, "module in training mode": 3}
    assert torch.equal(_call(model, inp), run(twin, inp)) and report.cuda_graph["captures"] == 3


@pytest.mark.slow
def test_flex_block_mask_is_refused(fake_cuda, seed):
    model, twin = _pair(_seed(seed), layers=2, flex=True)
    report = qwen_absorb.patch(model, cuda_graph=True)
    inp = model_inputs(model, seed=seed, cond=True)
    for _ in range(2):
        assert torch.equal(_call(model, inp), run(twin, inp))
    assert report.cuda_graph["captures"] == 0
    assert report.runtime_fallbacks[PREFIX + "unsupported argument type"] == 4


@pytest.mark.slow
def test_hooks_on_the_block_its_submodules_and_the_transformer(fake_cuda, seed):
    """A torch hook on the block itself runs outside its graph (replays go on, the hook sees and may edit the
    output); one on a submodule runs inside (that block runs eager); a diffusers hook on the block, or an
    offloading hook on the transformer around it, refuses too (and drops the graphs: offloading wants the
    memory back)."""
    from accelerate.hooks import ModelHook as AccelerateHook
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module
    from diffusers.hooks import HookRegistry, ModelHook

    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    fb = report.runtime_fallbacks
    inp = model_inputs(model, seed=seed)
    for _ in range(2):
        assert torch.equal(_call(model, inp), run(twin, inp))
    replays = report.cuda_graph["replays"]
    handles = [m.transformer_blocks[1].register_forward_hook(lambda mod, a, o: o * 2) for m in (model, twin)]
    assert torch.equal(_call(model, inp), run(twin, inp))
    assert report.cuda_graph["replays"] == replays + 3
    handles += [m.transformer_blocks[0].img_norm2.register_forward_hook(lambda mod, a, o: o + 1) for m in (model, twin)]
    for _ in range(2):
        assert torch.equal(_call(model, inp), run(twin, inp))
    assert fb[PREFIX + "forward hook on a submodule"] == 2
    for h in handles:
        h.remove()
    registry = HookRegistry.check_if_exists_or_initialize(model.transformer_blocks[2])
    registry.register_hook(ModelHook(), "probe")
    assert torch.equal(_call(model, inp), run(twin, inp)) and fb[PREFIX + "diffusers hook active"] == 1
    registry.remove_hook("probe")
    add_hook_to_module(model, AccelerateHook())
    assert torch.equal(_call(model, inp), run(twin, inp)) and fb[PREFIX + "offloading hook"] == 3
    assert report.cuda_graph["graphs"] == 0
    remove_hook_from_module(model)
    for _ in range(2):
        assert torch.equal(_call(model, inp), run(twin, inp))
    assert report.cuda_graph["graphs"] == 3
    qwen_absorb.unpatch(model)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)


@pytest.mark.slow
def test_a_cache_enabled_on_the_transformer_refuses_the_blocks(fake_cuda, seed):
    """diffusers' enable_cache (TaylorSeer hooks every attn): the transformer's cache config refuses every block
    call (and drops the graphs), bit-identical to the unpatched model with the same cache; graphs come back after
    disable_cache()."""
    from diffusers.hooks import TaylorSeerCacheConfig

    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    ins = [model_inputs(model, seed=seed + i) for i in range(3)]
    for inp in ins[:2]:
        assert torch.equal(_call(model, inp), run(twin, inp))
    for m in (model, twin):
        m.enable_cache(TaylorSeerCacheConfig())
    for inp in ins:
        with model.cache_context("cond"):
            out = _call(model, inp)
        with twin.cache_context("cond"):
            assert torch.equal(out, run(twin, inp))
    assert report.runtime_fallbacks[PREFIX + "cache hook active (enable_cache)"] == 9
    assert report.cuda_graph["graphs"] == 0
    for m in (model, twin):
        m.disable_cache()
    for inp in ins:
        assert torch.equal(_call(model, inp), run(twin, inp))
    assert report.cuda_graph["graphs"] == 3 and report.cuda_graph["replays"] == 3 + 6


# ---------------------------------------------------------------------------- the fingerprint


@pytest.mark.slow
@pytest.mark.parametrize("change", ["load_state_dict", "load_state_dict(assign=True)", "processor", "param.data"])
def test_a_change_drops_the_graphs_and_stays_exact(fake_cuda, change, seed):
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor

    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    ins = [model_inputs(model, seed=seed + i) for i in range(4)]
    for inp in ins[:2]:
        assert torch.equal(_call(model, inp), run(twin, inp))
    other = tiny_model(dtype=torch.bfloat16, seed=_seed(seed) + 1, layers=3, gain=4.0).state_dict()
    for m in (model, twin):
        if change == "load_state_dict":
            m.load_state_dict(other)
        elif change == "load_state_dict(assign=True)":
            m.load_state_dict({k: v.clone() for k, v in other.items()}, assign=True)
        elif change == "processor":
            m.transformer_blocks[1].attn.set_processor(QwenImage21AttnProcessor())
        else:
            w = m.transformer_blocks[0].img_mlp.out.weight
            w.data = w.data * 2
    captures = report.cuda_graph["captures"]
    for inp in ins[2:]:
        assert torch.equal(_call(model, inp), run(twin, inp)), change
    d = report.cuda_graph
    assert d["invalidations"], d
    assert d["captures"] > captures and d["replays"] > 3, d
    # seen after the launch (that replay discarded): in-place writes in every block, a processor replaced in one
    # (the scan holds the old processor); moved or replaced tensors are seen before it (never launched)
    assert d["discarded_replays"] == {"load_state_dict": 3, "processor": 1}.get(change, 0), d


@pytest.mark.slow
def test_real_fp8_blocks_replay_exactly_and_a_quantizer_switch_drops(fake_cuda, seed):
    pytest.importorskip("modelopt")
    from . import builders as T

    base = tiny_model(dtype=torch.bfloat16, seed=_seed(seed), layers=2)
    T.fp8_quantize(base, [model_inputs(base, seed=seed), model_inputs(base, cond=True, seed=seed + 1)])
    model, twin = base, copy.deepcopy(base)
    real = {"fp8_gemm": True, "capabilities": {"cpu"}}
    report = qwen_absorb.patch(model, cuda_graph=True, **real)
    qwen_absorb.patch(twin, cuda_graph=False, **real)
    assert report.summary["fp8_gemm_linears"] == 14
    ins = [model_inputs(model, seed=seed + 2 + i, cond=True) for i in range(3)]
    for inp in ins:
        assert torch.equal(_call(model, inp), run(twin, inp))
        _poison(_group(model))
    assert report.cuda_graph["replays"] == 4
    for m in (model, twin):
        m.transformer_blocks[1].img_mlp.out.input_quantizer.disable()
    for inp in ins:
        assert torch.equal(_call(model, inp), run(twin, inp))
    d = report.cuda_graph
    # the switch (named in the reason's detail); the FP8 forward it feeds may have rebuilt first (its generation)
    assert any("'_disabled': False -> True" in k for k in d["invalidations"]), d["invalidations"]
    assert d["per_block"][1]["captures"] == 2 and d["per_block"][0]["captures"] == 1, d


# ---------------------------------------------------------------------------- lifetime


def test_unpatch_frees_graphs_pool_and_statics_with_a_kept_report(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    report = qwen_absorb.patch(model, cuda_graph=True)
    inp = model_inputs(model, seed=seed, batch_size=2, cond=True, pad=1)
    for _ in range(3):
        _call(model, inp)
    group = _group(model)
    entry = _graphs(group)[0]
    dead = {"graph": weakref.ref(entry.graph), "static input": weakref.ref(entry.statics[0]),
            "static output": weakref.ref(C.tensors_in(entry.out)[0]), "shared": weakref.ref(group.shared),
            "runner": weakref.ref(group.runners[0]), "group": weakref.ref(group)}
    del entry, group
    qwen_absorb.unpatch(model)
    gc.collect()
    alive = [name for name, r in dead.items() if r() is not None]
    assert not alive, alive
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)
    assert torch.equal(run(model, inp), run(twin, inp))
    d = report.cuda_graph
    json.dumps(d)
    assert d["mode"] == "per block" and d["captures"] == 3 and d["replays"] == 6
    assert not report.active and "CUDA graphs per block" in str(report)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and report.cuda_graph["replays"] == 6  # the report keeps plain data only


def test_copies_get_their_own_group(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    qwen_absorb.patch(model, cuda_graph=True)
    inp = model_inputs(model, seed=seed)
    want = run(twin, inp)
    for _ in range(2):
        _call(model, inp)
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        g, g0 = _group(copied), _group(model)
        assert g is not g0 and g.shared is not g0.shared and g.describe()["graphs"] == 0
        assert [r._transformer for r in g.runners] == list(copied.transformer_blocks)
        assert all(b.__dict__["forward"] is r and r._shared is g.shared for b, r in zip(copied.transformer_blocks,
                                                                                       g.runners))
        assert g.shared._parent() is copied
        for _ in range(3):
            assert torch.equal(_call(copied, inp), want)
        assert g.describe()["replays"] == 6 and g0.describe()["replays"] == 3
        qwen_absorb.unpatch(copied)
        assert all("forward" not in b.__dict__ for b in copied.transformer_blocks)
        assert torch.equal(run(copied, inp), want)
    assert torch.equal(_call(model, inp), want) and _group(model).describe()["replays"] == 6


def test_a_copied_graphed_block_added_is_stripped_and_patched_anew(fake_cuda, seed):
    model, twin = _pair(_seed(seed))
    qwen_absorb.patch(model, cuda_graph=True)
    inp = model_inputs(model, seed=seed)
    _call(model, inp)
    for m in (model, twin):
        m.transformer_blocks.append(copy.deepcopy(m.transformer_blocks[0]))
    stale = model.transformer_blocks[3].__dict__["forward"]
    assert isinstance(stale, CG.GraphedCall)
    report = qwen_absorb.patch(model, cuda_graph=True)  # the blocks changed: unpatch, patch anew
    assert report.summary["blocks_patched"] == 4 and len(_group(model).runners) == 4
    assert model.transformer_blocks[3].__dict__["forward"] is not stale
    for _ in range(2):
        assert torch.equal(_call(model, inp), run(twin, inp))
    assert report.cuda_graph["replays"] == 4
    qwen_absorb.unpatch(model)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)


def test_install_blocks_arguments(fake_cuda, seed):
    model = tiny_model(seed=_seed(seed), layers=2)
    fb = collections.Counter()
    with pytest.raises(ValueError, match="indices"):
        CG.install_blocks(list(model.transformer_blocks), fallbacks=fb, indices=[0])
    with pytest.raises(TypeError, match="shared"):
        CG.install(model.transformer_blocks[0], fallbacks=fb, shared=object())
    own = CG.install(model.transformer_blocks[0], fallbacks=fb)  # a runner of its own: left out of the group
    group = CG.install_blocks(list(model.transformer_blocks), fallbacks=fb, parent=model)
    assert group.runners == [model.transformer_blocks[1].__dict__["forward"]] and group.indices == [1]
    assert "BlockGraphs on 1 blocks" in repr(group)
    group.remove()
    own.remove()
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)
    assert group.describe()["installed"] is False and not group.installed


def test_install_blocks_failing_midway_removes_the_runners_it_installed(fake_cuda, monkeypatch, seed):
    model = tiny_model(seed=_seed(seed), layers=3)
    real, cleared = CG.attach.install, []

    def install(block, **kw):
        if block is model.transformer_blocks[2]:
            raise RuntimeError("install failed")
        return real(block, **kw)

    monkeypatch.setattr(CG.attach, "install", install)
    monkeypatch.setattr(CG.Shared, "clear", lambda self: cleared.append(self))
    with pytest.raises(RuntimeError, match="install failed"):
        CG.install_blocks(list(model.transformer_blocks), fallbacks=collections.Counter(), parent=model)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks) and len(cleared) == 1
