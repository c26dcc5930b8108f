"""diffusers' FirstBlockCache under CUDA graphs per block (qwen_absorb.cuda_graph.first_block_cache), on the CPU.

The capture / replay path runs with the stand-ins of tests/cuda_graph_fakes.py (``fake_cuda``): a block's "graph"
replays by running its patched forward on the static buffers and writing into its static output. A true-CFG loop
("cond" and "uncond" calls, prompts of different lengths: two signatures per block) over two runs separated by the
pipeline's state reset; each step's image latents are an anchor drawn fresh, or that anchor plus a fresh 1e-2
perturbation, so the cache computes at every new anchor and skips the steps near it (checked on the unpatched
twin's own decisions). Every output equals the unpatched twin with the same cache, bit for bit; static buffers and
graph outputs are poisoned after every call, so a replay that read a stale input or handed out a static output shows
up. Real replays: tests/test_first_block_cache_graphs_gpu.py.
"""

from __future__ import annotations

import copy
import functools
import importlib

import pytest
import torch

import qwen_absorb
from qwen_absorb import step_caches
from qwen_absorb.block import PatchedForward
from qwen_absorb.cuda_graph import BlockGraphs, GraphedCall
from qwen_absorb.cuda_graph import capture as C
from qwen_absorb.cuda_graph import first_block_cache as FBC

from . import builders as T
from .cuda_graph_fakes import arm, runner_of

hooks_mod = pytest.importorskip("diffusers.hooks")
FBC_CFG = hooks_mod.FirstBlockCacheConfig
P = importlib.import_module("qwen_absorb.patch")
THRESHOLD = 0.2  # a fresh anchor moves the first block's residual by ~1, a perturbation by ~EPS
EPS = 1e-2  # seen in bfloat16 too
ANCHOR_EVERY = 3  # steps 0 and 3 compute (new anchors), 1, 2, 4, 5 skip
STEPS = 6
LAYERS = 3


def _inputs(model, seed):
    """Per step a (cond, uncond) pair of inputs; the prompts differ in length (two signatures per block)."""
    gen = torch.Generator().manual_seed(seed)
    pos = T.transformer_inputs(model, seed=seed + 1)
    neg = T.transformer_inputs(model, seed=seed + 2, text_len=5, masked_tail=0)
    steps = []
    for k in range(STEPS):
        pair = []
        for base in (pos, neg):
            if k % ANCHOR_EVERY == 0:
                anchor = torch.randn(base["hidden_states"].shape, generator=gen)
                base["_anchor"] = anchor
            h = base["_anchor"] + (EPS * torch.randn(base["hidden_states"].shape, generator=gen)
                                   if k % ANCHOR_EVERY else 0.0)
            kw = {k2: v for k2, v in base.items() if k2 != "_anchor"}
            kw["hidden_states"] = h.to(base["hidden_states"].dtype)
            pair.append(kw)
        steps.append(pair)
    return steps


def _head_state(model):
    hook = model.transformer_blocks[0]._diffusers_hook.hooks["fbc_leader_block_hook"]
    return hook.state_manager.get_state()


def _group(model) -> BlockGraphs | None:
    r = runner_of(model)
    f = r._fbc if r is not None else None
    return f.group if f is not None and f.group is not None and f.group.installed else None


def _poison(model):
    """Overwrite every static input and graph output of the model's block graphs (see the module doc)."""
    g = _group(model)
    for r in g.runners if g is not None else ():
        for e in r._graphs.values():
            for x in list(e.statics) + C.tensors_in(e.out):
                if x.is_floating_point() or x.is_complex():
                    x.fill_(float("nan"))
                elif x.dtype == torch.bool:
                    x.logical_not_()
                else:
                    x.fill_(-7)


def _loop(model, steps, runs=2, graphs=True):
    """True CFG as QwenImagePipeline runs it; returns (outputs, whether each call computed the remaining blocks)."""
    outs, computed = [], []
    with torch.no_grad():
        for _ in range(runs):
            for pair in steps:
                for name, kw in zip(("cond", "uncond"), pair):
                    with model.cache_context(name):
                        outs.append(model(**kw)[0].clone())
                        computed.append(_head_state(model).should_compute)
                    if graphs:
                        r = runner_of(model)
                        if r is not None:
                            arm(r)
                        g = _group(model)
                        for br in g.runners if g is not None else ():
                            arm(br)
                        _poison(model)
            model._reset_stateful_cache()  # what the pipeline does at the end of every call
    return outs, computed


def _same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), i


def _with_cache(model, order, cuda_graph):
    twin = copy.deepcopy(model)
    if order == "cache-then-patch":
        model.enable_cache(FBC_CFG(threshold=THRESHOLD))
    report = qwen_absorb.patch(model, cuda_graph=cuda_graph)
    if order == "patch-then-cache":
        model.enable_cache(FBC_CFG(threshold=THRESHOLD))
    twin.enable_cache(FBC_CFG(threshold=THRESHOLD))
    return report, twin


def _fallbacks(report, cuda_graph):
    return report.graph_fallbacks if cuda_graph == "auto" else report.runtime_fallbacks


# ---------------------------------------------------------------------------- replays == unpatched


@pytest.mark.parametrize("cuda_graph", ["auto", True])
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_per_block_graphs_equal_unpatched_with_the_same_cache(fake_cuda, order, cuda_graph, seed):
    model = T.tiny_transformer(seed=seed, num_layers=LAYERS)
    report, twin = _with_cache(model, order, cuda_graph)
    steps = _inputs(model, seed + 3)
    want, want_computed = _loop(twin, steps, graphs=False)
    got, computed = _loop(model, steps)
    _same(got, want)
    assert computed == want_computed  # the same decisions, taken by diffusers' hook on the host
    assert True in computed and False in computed, computed  # both kinds of step happened
    assert not all(torch.equal(a, b) for a, b in zip(want, want[1:]))  # fresh inputs, fresh outputs

    g = _group(model)
    assert g is not None and g.shared.fbc and len(g.runners) == LAYERS
    for block, r in zip(model.transformer_blocks, g.runners):
        reg = block._diffusers_hook
        inner = reg._fn_refs[-1].original_forward  # the innermost hook calls the runner, around the patched forward
        assert inner is r and isinstance(r, GraphedCall) and isinstance(r._inner, PatchedForward)
        assert isinstance(block.__dict__["forward"], functools.partial)  # the hooks stay outermost
    d = report.cuda_graph
    fbc = d["first_block_cache"]
    assert fbc["mode"] == "per block" and fbc["installed"] and fbc["blocks"] == LAYERS
    assert not fbc["refusals"] and not fbc["capture_failures"], fbc
    # block 0 runs in every call, the others only where the head computed: two signatures each, the first call of
    # each eager under "auto" (a signature is captured at its second call), then one capture, then replays
    first = 2 if cuda_graph == "auto" else 0
    assert fbc["new_signature_calls"] == first * LAYERS
    for b in fbc["per_block"]:
        calls = len(got) if b["block"] == 0 else sum(computed)
        assert (b["graphs"], b["captures"], b["eager_calls"]) == (2, 2, 0), b
        assert b["replays"] == calls - 2 - first, (b, calls)
    assert d["replays"] == 0 and d["graphs"] == 0  # the whole-model runner: every call eager, around the blocks
    reason = step_caches.refusal(model._cache_config)[0]
    assert "per-block CUDA graphs" in reason
    assert _fallbacks(report, cuda_graph)["cuda_graph: " + reason] == len(got)
    assert d["refusals"] == {reason: len(got)}
    assert "cuda_graph: FirstBlockCache: per-block CUDA graphs" in str(report)
    assert sum(report.handoffs.values()) == 0  # hooked blocks never hand over


def test_cache_disabled_goes_back_to_whole_model_graphs_and_again(fake_cuda, seed):
    """Disabling the cache removes the group at the next model call (each patched forward back in its slot) and
    the whole-model graphs capture and replay again; enabling it again makes a new group."""
    model = T.tiny_transformer(seed=seed, num_layers=LAYERS)
    report, twin = _with_cache(model, "patch-then-cache", True)
    steps = _inputs(model, seed + 3)
    want, _ = _loop(twin, steps, runs=1, graphs=False)
    got, _ = _loop(model, steps, runs=1)
    _same(got, want)
    group = _group(model)
    assert group is not None
    for m in (model, twin):
        m.disable_cache()
    plain = [T.transformer_inputs(model, seed=seed + 40 + i) for i in range(3)]
    with torch.no_grad():
        for kw in plain:
            out = model(**kw)[0]
            arm(runner_of(model))
            assert torch.equal(out, twin(**kw)[0])
    assert not group.installed and _group(model) is None
    for block in model.transformer_blocks:
        assert isinstance(block.__dict__["forward"], PatchedForward)  # no hook, no block runner
    d = report.cuda_graph
    assert d["replays"] == 2 and d["graphs"] == 1, d  # captured at once (cuda_graph=True), then replayed
    assert d["first_block_cache"]["installed"] is False
    assert sum(report.handoffs.values()) > 0  # unhooked blocks hand over again inside the whole-model graph

    for m in (model, twin):
        m.enable_cache(FBC_CFG(threshold=THRESHOLD))
    got, computed = _loop(model, steps, runs=1)
    want, want_computed = _loop(twin, steps, runs=1, graphs=False)
    _same(got, want)
    assert computed == want_computed
    assert _group(model) is not None and _group(model) is not group
    assert report.cuda_graph["first_block_cache"]["installed"] is True


def test_unpatch_and_copies(fake_cuda, seed):
    """unpatch removes the group with the runner (the blocks' hook chains as unpatched); a deep copy of a model
    under the group makes its own group at its first call (the copied block runners replaced)."""
    model = T.tiny_transformer(seed=seed, num_layers=LAYERS)
    report, twin = _with_cache(model, "cache-then-patch", "auto")
    steps = _inputs(model, seed + 3)
    want, _ = _loop(twin, steps, runs=1, graphs=False)
    got, _ = _loop(model, steps, runs=1)
    _same(got, want)
    group = _group(model)

    copied = copy.deepcopy(model)
    # diffusers' cache contexts do not survive a deep copy (unpatched too): the copy's cache is enabled anew, its
    # hooks wrapping the copied block runners
    copied.disable_cache()
    copied.enable_cache(FBC_CFG(threshold=THRESHOLD))
    assert all(isinstance(b._diffusers_hook._fn_refs[-1].original_forward, GraphedCall)
               for b in copied.transformer_blocks)
    twin._reset_stateful_cache()
    want2, _ = _loop(twin, steps, runs=1, graphs=False)
    got2, _ = _loop(copied, steps, runs=1)
    _same(got2, want2)
    g2 = _group(copied)
    assert g2 is not None and g2 is not group and all(r._transformer is b for r, b in
                                                      zip(g2.runners, copied.transformer_blocks))
    assert group.installed  # the original's group is its own

    qwen_absorb.unpatch(model)
    assert not group.installed
    for block in model.transformer_blocks:
        fn = block._diffusers_hook._fn_refs[-1].original_forward
        assert getattr(fn, "__func__", None) is type(block).forward and fn.__self__ is block
    model._reset_stateful_cache()
    twin._reset_stateful_cache()
    got3, _ = _loop(model, steps, runs=1, graphs=False)
    want3, _ = _loop(twin, steps, runs=1, graphs=False)
    _same(got3, want3)


def test_no_group_off_the_gpu_says_why(seed):
    """cuda_graph=True on a model on the CPU (no fakes): no block runner is made, each call runs eager with the
    reason, exactly."""
    model = T.tiny_transformer(seed=seed, num_layers=2)
    report, twin = _with_cache(model, "patch-then-cache", True)
    steps = _inputs(model, seed + 3)[:3]
    got, _ = _loop(model, steps, runs=1, graphs=False)
    want, _ = _loop(twin, steps, runs=1, graphs=False)
    _same(got, want)
    assert _group(model) is None
    assert report.runtime_fallbacks["cuda_graph: " + FBC.NO_GROUP] == len(got)
    fbc = report.cuda_graph["first_block_cache"]
    assert fbc["installed"] is False and fbc["not_made"] == "the model is not on a GPU"
    assert all(isinstance(b._diffusers_hook._fn_refs[-1].original_forward, PatchedForward)
               for b in model.transformer_blocks)


def test_block_runner_refuses_without_its_cache_hook(fake_cuda, seed):
    """A block of the group whose FirstBlockCache hook is gone (the cache disabled, no model call since) runs eager,
    refused rather than graphed: an unhooked block could take part in the cross-block hand-off."""
    model = T.tiny_transformer(seed=seed, num_layers=2)
    report, twin = _with_cache(model, "patch-then-cache", True)
    steps = _inputs(model, seed + 3)
    _loop(model, steps[:1], runs=1)
    seen: dict = {}  # block 1's keyword arguments in a model call (the unpatched twin's)
    handle = twin.transformer_blocks[1].register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    with torch.no_grad(), twin.cache_context("cond"):
        twin(**steps[0][0])
    handle.remove()
    group = _group(model)
    for m in (model, twin):
        m.disable_cache()
    block, r = model.transformer_blocks[1], group.runners[1]
    assert block.__dict__["forward"] is r  # diffusers put the hook's original forward back: our runner
    with torch.no_grad():
        got, want = block(**seen), twin.transformer_blocks[1](**seen)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    why = "FirstBlockCache hooks gone (their per-block graphs wait for the model call to remove them)"
    assert r.describe()["refusals"] == {why: 1}, r.describe()["refusals"]
    assert report.runtime_fallbacks["cuda_graph: " + why] == 1


@pytest.mark.slow
def test_fp8_per_block_graphs_equal_the_patched_eager_model(fake_cuda, seed):
    """A ModelOpt FP8 model (real FP8 GEMMs, their originals kept aside): per-block graphs under the cache equal the
    patched model running it eager; each block runner allows exactly its own block's host originals off the GPU."""
    pytest.importorskip("modelopt")
    from qwen_absorb import host_originals

    real = dict(fp8_gemm=True, capabilities={"cpu"})
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=2)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1)])
    eager = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True, **real)
    qwen_absorb.patch(eager, cuda_graph=False, **real)
    for m in (model, eager):
        m.enable_cache(FBC_CFG(threshold=THRESHOLD))
    steps = _inputs(model, seed + 3)
    got, computed = _loop(model, steps)
    want, want_computed = _loop(eager, steps, graphs=False)
    _same(got, want)
    assert computed == want_computed and True in computed and False in computed, computed
    assert report.summary["fp8_gemm_linears"] > 0  # real FP8 GEMMs inside the block graphs
    g = _group(model)
    fbc = report.cuda_graph["first_block_cache"]
    assert fbc["replays"] > 0 and not fbc["refusals"] and not fbc["capture_failures"], fbc
    per_block = [r._host_tensors() for r in g.runners]
    every = host_originals.host_weights(model)
    assert every and sum(map(len, per_block)) == len(every)
    for block, held in zip(model.transformer_blocks, per_block):
        own = {id(p) for p in block.parameters()}
        assert all(id(w) in own for w in held)


@pytest.mark.slow
def test_pipeline_under_model_offload(monkeypatch, seed):
    """A QwenImagePipeline with ``enable_model_cpu_offload()`` (the whole-model runner inside accelerate's hook, as
    in tests/test_offload_graphs.py): the block runners are not refused for that hook, and three pipeline runs (the
    weights moved in before each) equal the unpatched pipeline with the same cache."""
    pytest.importorskip("accelerate")
    from . import cuda_graph_fakes

    cpu = torch.device("cpu")

    def offload(pipe, enable=True):
        if enable:
            pipe.enable_model_cpu_offload(device="cpu")
        for h in pipe._all_hooks:  # as on a GPU: nothing moves during a run (see tests/test_offload_graphs.py)
            h.hook.execution_device = cpu

    def runs(pipe, n, armed):
        outs = []
        for _ in range(n):
            with torch.inference_mode():
                pipe.transformer._apply(lambda x: x.clone())  # the onload: new storages
            outs.append(cuda_graph_fakes.run_tiny_pipeline(pipe, seed, 4, armed, inference=True))
            offload(pipe, enable=False)
        return outs

    t = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    pipe = T.tiny_pipeline(dtype=torch.bfloat16, seed=seed, transformer=t)
    twin = T.tiny_pipeline(dtype=torch.bfloat16, seed=seed, transformer=copy.deepcopy(t))
    for p in (pipe, twin):
        p.transformer.enable_cache(FBC_CFG(threshold=THRESHOLD))
    offload(twin)
    want = runs(twin, 3, False)
    offload(pipe)
    report = qwen_absorb.patch(pipe, cuda_graph=True)
    cuda_graph_fakes.install(monkeypatch)
    got = runs(pipe, 3, True)
    _same(got, want)
    fbc = report.cuda_graph["first_block_cache"]
    assert fbc["installed"] and fbc["replays"] > 0 and not fbc["refusals"], fbc
    qwen_absorb.unpatch(pipe)
