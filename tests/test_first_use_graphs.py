"""CUDA graphs decided at a model's first call on a GPU (issues 39 C and 41 item 4), on the CPU with fakes.

A model patched on the CPU gets a :class:`qwen_absorb.cuda_graph.FirstUse` in its forward slot: calls on the CPU
pass through uncounted; the first call on a graph device installs the runner (the fakes of
tests/cuda_graph_fakes.py make the CPU one: "moved to a faked GPU"), which then captures and replays.
"""

from __future__ import annotations

import collections
import copy
import logging

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from . import builders as T

from . import cuda_graph_fakes


def _model(seed, layers=2):
    model = T.tiny_transformer(seed=seed, num_layers=layers)
    return model, [T.transformer_inputs(model, seed=seed + 1 + i, masked_tail=0) for i in range(2)]


_runner = cuda_graph_fakes.runner_of


def _calls(model, kw, n):
    outs = []
    for _ in range(n):
        outs.append(T.run_transformer(model, kw))
        r = _runner(model)
        if r is not None:
            cuda_graph_fakes.arm(r)
    return outs


def test_patched_on_cpu_decides_at_first_gpu_call(monkeypatch, seed):
    model, (kw, _) = _model(seed)
    twin = copy.deepcopy(model)
    want = T.run_transformer(twin, kw)
    report = qwen_absorb.patch(model)  # auto, on the CPU: nothing decided yet
    pending = model.__dict__["forward"]
    assert isinstance(pending, CG.FirstUse) and pending.runner is None
    assert all(torch.equal(o, want) for o in _calls(model, kw, 3))
    assert not report.graph_fallbacks and report.cuda_graph["decided"] is False  # CPU calls: not counted
    assert "CUDA graphs (cuda_graph='auto'): decided at the first call on a GPU" in str(report)
    assert model.__dict__["forward"] is pending
    cuda_graph_fakes.install(monkeypatch)  # the model now "sits on a GPU"
    outs = _calls(model, kw, 4)  # eager (first sight), capture, replays
    assert all(torch.equal(o, want) for o in outs)
    runner = _runner(model)
    assert runner is not None and pending.runner is runner and model.__dict__["forward"] is runner
    g = report.cuda_graph
    assert g["captures"] == 1 and g["replays"] == 2, g
    assert not report.graph_fallbacks
    qwen_absorb.unpatch(model)
    assert "forward" not in model.__dict__
    assert torch.equal(T.run_transformer(model, kw), want)


def test_refused_at_first_gpu_call_warns_once_with_the_reason(monkeypatch, seed, caplog):
    model, (kw, kw2) = _model(seed)
    report = qwen_absorb.patch(model)
    model.transformer_blocks[0].img_mlp.register_forward_hook(lambda m, a, o: None)
    T.run_transformer(model, kw)  # CPU: no decision, no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "CUDA graph" in r.getMessage()]
    cuda_graph_fakes.install(monkeypatch)
    with caplog.at_level(logging.INFO, logger="qwen_absorb"):
        for k in (kw, kw2, kw):
            T.run_transformer(model, k)
    warned = [r for r in caplog.records
              if r.levelno == logging.WARNING and "CUDA graphs cannot be used" in r.getMessage()]
    assert len(warned) == 1 and "forward hook on a submodule" in warned[0].getMessage()
    assert report.graph_fallbacks == collections.Counter({"cuda_graph: forward hook on a submodule": 3})
    assert report.cuda_graph["replays"] == 0


def test_unpatch_before_and_after_the_decision(monkeypatch, seed):
    model, (kw, _) = _model(seed)
    qwen_absorb.patch(model)
    qwen_absorb.unpatch(model)
    assert "forward" not in model.__dict__
    qwen_absorb.patch(model)
    cuda_graph_fakes.install(monkeypatch)
    _calls(model, kw, 2)
    assert _runner(model) is not None
    qwen_absorb.unpatch(model)
    assert "forward" not in model.__dict__ and _runner(model) is None


def test_explicit_false_and_true_are_unchanged(monkeypatch, seed):
    model, _ = _model(seed)
    qwen_absorb.patch(model, cuda_graph=False)
    assert "forward" not in model.__dict__
    qwen_absorb.patch(model, cuda_graph=True)  # True: installed at once, wherever the model is
    assert isinstance(model.__dict__["forward"], CG.GraphedCall)
    qwen_absorb.unpatch(model)


def test_deepcopy_of_a_pending_model_decides_on_its_own(monkeypatch, seed):
    model, (kw, _) = _model(seed)
    want = T.run_transformer(model, kw)
    qwen_absorb.patch(model)
    copied = copy.deepcopy(model)
    assert isinstance(copied.__dict__["forward"], CG.FirstUse)
    assert copied.__dict__["forward"] is not model.__dict__["forward"]
    cuda_graph_fakes.install(monkeypatch)
    assert all(torch.equal(o, want) for o in _calls(copied, kw, 3))
    assert _runner(copied) is not None and isinstance(model.__dict__["forward"], CG.FirstUse)
    assert qwen_absorb.patch_report(copied).cuda_graph["replays"] == 1


def test_model_offload_hook_added_after_patch_keeps_graphs(monkeypatch, seed):
    """accelerate's CpuOffload (what ``enable_model_cpu_offload`` puts on the transformer) wraps the pending
    decision; the runner goes inside the hook, where the model is resident during the call, and replays."""
    from accelerate import cpu_offload_with_hook

    model, (kw, _) = _model(seed)
    twin = copy.deepcopy(model)
    want = T.run_transformer(twin, kw)
    report = qwen_absorb.patch(model)  # graphs in the model-offload hook: the default (gating.Tuning)
    _, hook = cpu_offload_with_hook(model, "cpu")
    assert isinstance(model.__dict__["_old_forward"], CG.FirstUse)
    cuda_graph_fakes.install(monkeypatch)
    assert all(torch.equal(o, want) for o in _calls(model, kw, 4))
    assert isinstance(model.__dict__["_old_forward"], CG.GraphedCall)
    g = report.cuda_graph
    assert g["captures"] == 1 and g["replays"] == 2 and not report.graph_fallbacks, (g, report.graph_fallbacks)
    hook.remove()  # accelerate puts what it wrapped back as the instance forward
    qwen_absorb.unpatch(model)
    assert model.forward.__func__ is type(model).forward and "_old_forward" not in model.__dict__
    assert torch.equal(T.run_transformer(model, kw), want)


def test_patch_under_model_offload_installs_inside_the_hook(monkeypatch, seed):
    from accelerate import cpu_offload_with_hook

    model, (kw, _) = _model(seed)
    want = T.run_transformer(copy.deepcopy(model), kw)
    cpu_offload_with_hook(model, "cpu")
    cuda_graph_fakes.install(monkeypatch)
    # turned off, graphs are refused there, with the reason
    report = qwen_absorb.patch(model, tuning=qwen_absorb.Tuning(model_offload_graphs=False))
    assert all(torch.equal(o, want) for o in _calls(model, kw, 4))
    assert report.cuda_graph["replays"] == 0
    assert any("model_offload_graphs=False" in str(r) for r in report.graph_fallbacks), report.graph_fallbacks
    qwen_absorb.unpatch(model)
    report = qwen_absorb.patch(model)  # the default
    assert isinstance(model.__dict__.get("_old_forward"), (CG.FirstUse, CG.GraphedCall))
    assert all(torch.equal(o, want) for o in _calls(model, kw, 4))
    assert report.cuda_graph["replays"] == 2 and not report.graph_fallbacks, (report.cuda_graph,
                                                                              report.graph_fallbacks)
    qwen_absorb.unpatch(model)


@pytest.mark.parametrize("wrapped_later", [False, True])
def test_other_offload_hooks_still_refuse(monkeypatch, wrapped_later, seed):
    """An accelerate hook that is not a whole-model CpuOffload (device alignment: sequential offload) moves
    weights during the call: refused, with the reason."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model, (kw, _) = _model(seed)
    if not wrapped_later:
        add_hook_to_module(model, AlignDevicesHook(execution_device="cpu"))
    report = qwen_absorb.patch(model)
    if wrapped_later:
        add_hook_to_module(model, AlignDevicesHook(execution_device="cpu"))
    cuda_graph_fakes.install(monkeypatch)
    _calls(model, kw, 3)
    assert report.cuda_graph["replays"] == 0
    assert report.graph_fallbacks["cuda_graph: offloading hook"] == 3, report.graph_fallbacks


def test_the_forward_slot_keeps_diffusers_signature(monkeypatch, seed):
    """``inspect.signature(model.forward)`` of a patched model is diffusers' before and after the first GPU call (the
    ``FirstUse`` stand-in, then the runner): callers that pass only the arguments it names (ModelOpt's HF export
    makes its dummy call so) called ``model()`` with none and failed."""
    import inspect

    model, calls = _model(seed)
    want = inspect.signature(model.forward)
    assert "hidden_states" in want.parameters
    qwen_absorb.patch(model)
    assert type(model.__dict__["forward"]) is CG.FirstUse
    assert inspect.signature(model.forward) == want
    cuda_graph_fakes.install(monkeypatch)  # "moved to a faked GPU": the first call installs the runner
    _calls(model, calls[0], 1)
    assert _runner(model) is not None and inspect.signature(model.forward) == want
