"""Graphs under ``enable_model_cpu_offload()`` (issue 39 C), on the CPU with the CUDA-graph fakes.

accelerate's ``CpuOffload`` moves the whole transformer to its device at the first call of a pipeline run and
diffusers moves it back at the end, so within a run the weights stay put: the runner captures once per
signature and replays the other steps; a move between runs changes the weights' addresses, which drops the
graphs and their pool before anything replays. On a GPU the move runs under the pipeline's
``torch.inference_mode()``: ``Module._apply`` sets ``param.data`` to an inference tensor, and a Parameter holding
one still reads a ``_version``. Round 25 captured on every call there: the blocks' watch recorded such a
Parameter's version as -1 and read 1 at every call, so every block decided anew at every call, inside every
capture too, and each capture dropped the other signature's graph. The move is simulated here by
``_apply(clone)`` under ``inference_mode`` (new storages, ``param.data`` replaced, as ``.to()`` does).
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from . import builders as T
from qwen_absorb.block import redecide
from qwen_absorb.cuda_graph import fingerprint
from qwen_absorb.plan import PLAN_ATTR

from . import cuda_graph_fakes

pytest.importorskip("accelerate")

CPU = torch.device("cpu")


_runner = cuda_graph_fakes.runner_of


def _move(t):
    """What accelerate's onload does to the weights under the pipeline's inference_mode: new storages."""
    with torch.inference_mode():
        t._apply(lambda x: x.clone())


def _model_offload(pipe, enable=True):
    if enable:
        pipe.enable_model_cpu_offload(device="cpu")
    for h in pipe._all_hooks:  # diffusers says "cpu:0", which the hook's "already there" check never matches
        h.hook.execution_device = CPU  # (a GPU's "cuda:0" does): as on a GPU, nothing moves during a run


def _run(pipe, seed, steps=4, arm=False):
    return cuda_graph_fakes.run_tiny_pipeline(pipe, seed, steps, arm, inference=True)


def _runs(pipe, seed, n, arm=False):
    outs = []
    for i in range(n):
        _move(pipe.transformer)
        outs.append(_run(pipe, seed, arm=arm))
        _model_offload(pipe, enable=False)  # the hooks diffusers made anew at the end of the run
    return outs


@pytest.mark.parametrize("cuda_graph", ["auto", True])
def test_model_offload_captures_once_per_run_and_replays_the_other_steps(monkeypatch, seed, cuda_graph):
    t = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    pipe = T.tiny_pipeline(dtype=torch.bfloat16, seed=seed, transformer=t)
    twin = T.tiny_pipeline(dtype=torch.bfloat16, seed=seed, transformer=copy.deepcopy(t))
    _model_offload(twin)
    want = _runs(twin, seed, 3)
    _model_offload(pipe)
    report = qwen_absorb.patch(pipe, cuda_graph=cuda_graph)  # graphs in the model-offload hook: the default
    cuda_graph_fakes.install(monkeypatch)
    first_pool = []
    orig_capture = CG.runner.capture

    def spy(*a, **k):  # the pool each capture goes into
        got = orig_capture(*a, **k)
        if got.graph is not None:
            first_pool.append(got.graph.graph.pool)
        return got

    monkeypatch.setattr(CG.runner, "capture", spy)
    outs = _runs(pipe, seed, 3, arm=True)
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    g = report.cuda_graph
    eager = 2 if cuda_graph == "auto" else 0  # "auto" captures a signature at its second call
    # true CFG: two signatures (text lengths 7 and 5); each run captures both once (its weights moved in)
    assert g["captures"] == 6 and g["replays"] == 3 * 8 - 6 - eager, (g, dict(report.graph_fallbacks))
    moved = {r: n for r, n in g["invalidations"].items() if r.startswith("weights moved")}
    assert sum(moved.values()) == 2, g["invalidations"]
    assert not report.graph_fallbacks and not any("cuda_graph" in r for r in report.runtime_fallbacks), (
        report.graph_fallbacks, report.runtime_fallbacks)
    # one pool per run: the dropped graphs took theirs with them
    assert len(set(map(id, first_pool))) == 3 and first_pool[0] is first_pool[1], first_pool
    qwen_absorb.unpatch(pipe)


def test_parameters_moved_under_inference_mode_do_not_make_blocks_decide_per_call(seed):
    """The round-25 cause, without graphs: after an onload under inference_mode, a block decides once, not at
    every call."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1, masked_tail=0)
    qwen_absorb.patch(model, cuda_graph=False)
    _move(model)
    plans = [b.__dict__[PLAN_ATTR] for b in model.transformer_blocks]
    with torch.inference_mode():
        model(**kw)
        gens = [p.rt.generation for p in plans]
        for _ in range(3):
            model(**kw)
    assert [p.rt.generation for p in plans] == gens


def test_weights_moved_drop_the_graphs_and_their_memory_before_a_replay(monkeypatch, seed):
    from accelerate import cpu_offload_with_hook

    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1, masked_tail=0)
    want = T.run_transformer(copy.deepcopy(model), kw)
    cpu_offload_with_hook(model, CPU)
    cuda_graph_fakes.install(monkeypatch)
    report = qwen_absorb.patch(model, cuda_graph=True)
    runner = _runner(model)
    assert runner is not None and model.__dict__["_old_forward"] is runner
    assert torch.equal(T.run_transformer(model, kw), want)  # captured
    cuda_graph_fakes.arm(runner)
    assert torch.equal(T.run_transformer(model, kw), want) and runner.replays == 1
    graphs = [weakref.ref(e.graph) for e in runner._graphs.values()]
    statics = [weakref.ref(s) for e in runner._graphs.values() for s in e.statics]
    launched = _trap(runner)  # a replay now would read the freed weights: it must never launch
    _move(model)
    out = T.run_transformer(model, kw)
    assert torch.equal(out, want) and not launched
    assert all(r() is None for r in graphs + statics), "the dropped graphs or their static buffers are still held"
    assert runner.captures == 2 and len(runner._graphs) == 1
    assert any(r.startswith("weights moved") for r in report.cuda_graph["invalidations"])
    qwen_absorb.unpatch(model)


def _trap(runner):
    launched = []
    for entry in runner._graphs.values():
        entry.graph.fn = lambda: launched.append(1)
    return launched


def test_a_capture_that_changes_the_model_is_not_kept(monkeypatch, seed):
    """A block deciding anew inside the capture records its rebuild instead of running it: such a graph is not
    kept, the call's answer is the warm-up's, and the block decides again at its next eager call."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1, masked_tail=0)
    want = T.run_transformer(copy.deepcopy(model), kw)
    report = qwen_absorb.patch(model, cuda_graph=True)
    cuda_graph_fakes.install(monkeypatch)
    rt = model.transformer_blocks[0].__dict__[PLAN_ATTR].rt
    begin = cuda_graph_fakes.FakeGraph.capture_begin

    def decide_inside(self, *a, **k):
        rt.generation += 1  # what decide() does
        return begin(self, *a, **k)

    monkeypatch.setattr(cuda_graph_fakes.FakeGraph, "capture_begin", decide_inside)
    assert torch.equal(T.run_transformer(model, kw), want)
    runner = _runner(model)
    assert runner.captures == 0 and not runner._graphs and runner.capture_failures["RuntimeError"] == 1
    assert rt.device is None  # decides again at the next eager call
    assert torch.equal(T.run_transformer(model, kw), want)
    assert rt.device == CPU
    assert report.runtime_fallbacks["cuda_graph: capture failed (this signature runs eager)"] == 2
    qwen_absorb.unpatch(model)


@pytest.mark.parametrize("keeps", [True, False])
def test_model_offload_scans_the_model_once_per_run(monkeypatch, seed, keeps):
    """The weights moved in: the first call scans, and that scan stays, whether the blocks keep their decisions
    across the move (the default) or decide anew (in the capture's warm-up; its generations taken anew); the H100
    profile of an 8-step run spent 0.9 s in two scans."""
    t = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    pipe = T.tiny_pipeline(dtype=torch.bfloat16, seed=seed, transformer=t)
    _model_offload(pipe)
    report = qwen_absorb.patch(pipe, cuda_graph=True, tuning=qwen_absorb.Tuning(move_keeps_decisions=keeps))
    cuda_graph_fakes.install(monkeypatch)
    scans, init = [], fingerprint.Scan.__init__

    def counted(self, *a, **k):
        scans.append(self)
        init(self, *a, **k)

    monkeypatch.setattr(fingerprint.Scan, "__init__", counted)
    rt = t.transformer_blocks[0].__dict__[PLAN_ATTR].rt
    for n in (1, 2, 3):
        gen = rt.generation
        _runs(pipe, seed, 1, arm=True)
        assert (rt.generation == gen) is keeps, "the block did not take the path under test"
        assert len(scans) == n, n
    assert report.cuda_graph["captures"] == 6 and report.cuda_graph["replays"] == 3 * 8 - 6
    qwen_absorb.unpatch(pipe)


def test_a_scan_outlives_a_decision_only_when_the_decision_gives_the_same_facts(monkeypatch, seed):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    qwen_absorb.patch(model, cuda_graph=False)
    block = model.transformer_blocks[0]
    plan = block.__dict__[PLAN_ATTR]
    scan = fingerprint.Scan(model)
    redecide(plan, block, CPU, "test")
    assert scan.moved() is not None and scan.redecided() and scan.changed() is None
    redecide(plan, block, CPU, "test")
    monkeypatch.setattr(fingerprint, "derived_only_sources", lambda p, m: [m.attn.to_q.weight])
    assert not scan.redecided() and scan.moved() is not None  # another source: a new scan
    monkeypatch.undo()
    assert scan.redecided()
    plan.rt.generation += 1
    plan.attn_cache = not plan.attn_cache  # another cache decision: a new scan
    assert not scan.redecided()
    plan.attn_cache = not plan.attn_cache
    block.attn.to_k.weight.data = block.attn.to_k.weight.data.clone()  # weights moved too: a new scan
    assert not scan.redecided()
    qwen_absorb.unpatch(model)
