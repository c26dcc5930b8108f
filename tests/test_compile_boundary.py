"""A patched Qwen-Image block under torch.compile is one opaque op around its eager patched forward
(qwen_absorb.compile_boundary, issue 19): bit-identical to the eager patched model, one graph for all the
blocks, fullgraph=True also with ModelOpt modules, and the per-call checks (weights, hooks) still run."""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import compile_boundary
from . import builders as T
from qwen_absorb.block import patched_forward

LAYERS = 3
REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def op_calls(monkeypatch):
    """How often the op ran the eager patched forward."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return patched_forward(*args, **kwargs)

    monkeypatch.setattr(compile_boundary, "_forward", counted)
    return calls


def _stats() -> dict:
    from torch._dynamo.utils import counters

    return {**dict(counters["stats"]), "graph_breaks": sum(counters["graph_break"].values())}


def _model(seed: int, quantized: bool = False):
    model = T.tiny_transformer(seed=seed, num_layers=LAYERS)
    inp = T.transformer_inputs(model, seed=seed + 1)
    if quantized:
        T.fp8_quantize(model, [inp])
    return model, inp


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_patched_blocks_are_the_eager_patched_blocks(seed, backend, op_calls):
    from torch._dynamo.utils import counters

    model, inp = _model(seed)
    ref = T.run_transformer(model, inp)
    qwen_absorb.patch(model)
    eager = T.run_transformer(model, inp)
    counters.clear()
    model.compile_repeated_blocks(backend=backend, fullgraph=True)
    out = T.run_transformer(model, inp)
    out2 = T.run_transformer(model, inp)
    assert torch.equal(out, eager) and torch.equal(out2, eager) and torch.equal(out, ref)
    st = _stats()
    assert st["unique_graphs"] == 1 and st["graph_breaks"] == 0, st  # one graph serves every block
    assert len(op_calls) == 2 * LAYERS and set(map(id, op_calls)) == set(map(id, model.transformer_blocks))


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{"capabilities": {"cpu"}}, REAL])
def test_modelopt_model_compiles_fullgraph(seed, kwargs):
    """ModelOpt's modules cannot be traced (the traced path calls them behind graph breaks); inside the op
    they run eagerly, so fullgraph=True works and the result is the eager patched one, bit for bit."""
    model, inp = _model(seed, quantized=True)
    qwen_absorb.patch(model, **kwargs)
    eager = T.run_transformer(model, inp)
    model.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
    assert torch.equal(T.run_transformer(model, inp), eager)


def test_compiled_blocks_follow_a_weight_load(seed):
    """The op runs the per-call checks: a checkpoint loaded after compiling rebuilds the FP8 weights, as on a
    twin that loaded it before being patched (the traced forward never checked)."""
    model, inp = _model(seed, quantized=True)
    twin = copy.deepcopy(model)
    other, _ = _model(seed + 7, quantized=True)
    sd = other.state_dict()
    report = qwen_absorb.patch(model, **REAL)
    model.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
    before = T.run_transformer(model, inp)
    model.load_state_dict(sd)
    out = T.run_transformer(model, inp)
    twin.load_state_dict(sd)
    qwen_absorb.patch(twin, **REAL)
    want = T.run_transformer(twin, inp)
    assert torch.equal(out, want) and not torch.equal(out, before)
    assert report.rebuilds


def test_compiled_blocks_honour_a_hook_added_after_compiling(seed):
    model, inp = _model(seed)
    twin = copy.deepcopy(model)
    seen = {"patched": 0, "twin": 0}

    def hook(tag):
        def fn(mod, args, out):
            seen[tag] += 1
            return out * 1.5  # an editing hook on a linear the fused path would otherwise bypass the bias of
        return fn

    qwen_absorb.patch(model)
    model.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
    T.run_transformer(model, inp)
    model.transformer_blocks[1].attn.to_out[0].register_forward_hook(hook("patched"))
    out = T.run_transformer(model, inp)
    twin.transformer_blocks[1].attn.to_out[0].register_forward_hook(hook("twin"))
    want = T.run_transformer(twin, inp)
    assert torch.equal(out, want) and seen == {"patched": 1, "twin": 1}


@pytest.mark.slow
def test_unpatch_after_compiling_runs_diffusers(seed):
    model, inp = _model(seed)
    ref = T.run_transformer(model, inp)
    qwen_absorb.patch(model)
    model.compile_repeated_blocks(backend="aot_eager")
    T.run_transformer(model, inp)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inp), ref)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [False, True])
def test_traced_modes_do_not_use_the_op(seed, mode, op_calls):
    model, inp = _model(seed)
    ref = T.run_transformer(model, inp)
    qwen_absorb.patch(model, kernels_under_compile=mode)
    model.compile_repeated_blocks(backend="aot_eager")
    out = T.run_transformer(model, inp)
    assert not op_calls
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.slow
def test_joint_attention_kwargs_are_traced(seed, op_calls):
    """The LoRA ``scale`` is taken by the transformer (the blocks get {}: the op carries the call); other
    attention kwargs reach the blocks, and what the op cannot carry is traced instead of dropped."""
    model, inp = _model(seed)
    qwen_absorb.patch(model)
    kws = ({"scale": 1.0}, {"unused_by_the_processor": 1})
    eager = [T.run_transformer(model, {**inp, "attention_kwargs": kw}) for kw in kws]
    model.compile_repeated_blocks(backend="aot_eager")
    for kw, want, n in zip(kws, eager, (LAYERS, 0)):
        op_calls.clear()
        assert torch.equal(T.run_transformer(model, {**inp, "attention_kwargs": kw}), want)
        assert len(op_calls) == n, kw


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_kernels_under_compile_is_checked(bad):
    model, _ = _model(0)
    with pytest.raises(ValueError, match="kernels_under_compile"):
        qwen_absorb.patch(model, kernels_under_compile=bad)
