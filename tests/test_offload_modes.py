"""diffusers' offload modes and layerwise casting with a patched transformer, on the CPU (issue 39 C).

Each pipeline runs patched against an unpatched twin in the same mode (accelerate's and diffusers' hooks take
the CPU as their execution device), for a bf16 transformer and a ModelOpt FP8 one (real FP8 GEMMs on the CPU:
``capabilities={"cpu"}``). With the CUDA-graph fakes (tests/cuda_graph_fakes.py) the CPU is a graph device:
model offload replays graphs, group offloading (weights streamed during the call) and layerwise casting
(weights cast anew in every call) are refused with their reasons.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from . import builders as T

from . import cuda_graph_fakes

pytest.importorskip("accelerate")

CPU = torch.device("cpu")
MODES = ("model", "group_block", "group_leaf", "layerwise")


def _transformer(kind, seed):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    if kind.startswith("fp8"):
        pytest.importorskip("modelopt.torch.quantization")
        T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1 + i) for i in range(2)])
    return model


def _pipe(transformer, seed):
    return T.tiny_pipeline(dtype=torch.bfloat16, seed=seed, transformer=transformer)


def _model_offload(pipe, enable=True):
    """``enable_model_cpu_offload`` (which the pipeline enables anew after every run: ``enable=False`` only
    fixes the new hooks' device)."""
    if enable:
        pipe.enable_model_cpu_offload(device="cpu")
    for h in pipe._all_hooks:  # diffusers says "cpu:0", which the hook's "already there" check never matches
        h.hook.execution_device = CPU  # (a GPU's "cuda:0" does): as on a GPU, the model moves once per run


def _offload(pipe, mode):
    if mode == "model":
        _model_offload(pipe)
    elif mode.startswith("group"):
        kind = "block_level" if mode == "group_block" else "leaf_level"
        extra = {"num_blocks_per_group": 1} if kind == "block_level" else {}
        pipe.transformer.enable_group_offload(onload_device=CPU, offload_device=CPU, offload_type=kind, **extra)
    else:
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)


def _run(pipe, seed, steps=3, arm=False):
    return cuda_graph_fakes.run_tiny_pipeline(pipe, seed, steps, arm, inference=False)


_runner = cuda_graph_fakes.runner_of


def _patch(pipe, kind, **more):
    # fp8: real FP8 GEMMs (never bit-identical to ModelOpt's fake quantization); fp8_module: the linears run as
    # ModelOpt's modules, everything else fused: bit-identical to the unpatched model
    kw = {"fp8": {"fp8_gemm": True, "capabilities": {"cpu"}}, "fp8_module": {"fp8_gemm": False}}.get(kind, {})
    return qwen_absorb.patch(pipe, **kw, **more)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16", "fp8_module", "fp8"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("patch_first", [False, True])
def test_offload_mode_matches_the_unpatched_pipeline(kind, mode, patch_first, seed):
    t = _transformer(kind, seed)
    pipe, twin = _pipe(t, seed), _pipe(copy.deepcopy(t), seed)
    _offload(twin, mode)
    try:
        want = _run(twin, seed)
    except Exception as e:  # a mode diffusers + ModelOpt cannot run unpatched: the patched pipeline fails alike
        if patch_first:
            _patch(pipe, kind)
            _offload(pipe, mode)
        else:
            _offload(pipe, mode)
            _patch(pipe, kind)
        with pytest.raises(type(e)):
            _run(pipe, seed)
        pytest.skip(f"{mode} fails unpatched too: {type(e).__name__}: {str(e)[:120]}")
    if patch_first:
        report = _patch(pipe, kind)
        _offload(pipe, mode)
    else:
        _offload(pipe, mode)
        report = _patch(pipe, kind)
    out = _run(pipe, seed)
    if kind == "fp8":  # real FP8 against fake quantization: close; against the resident patched pipeline: equal
        assert _rel(out, want) < 0.03, _rel(out, want)
        if mode == "model":
            resident = _pipe(copy.deepcopy(t), seed)
            _patch(resident, kind)
            assert torch.equal(out, _run(resident, seed))
    else:
        assert torch.equal(out, want), (mode, kind, (out.float() - want.float()).abs().max())
    assert not any("deciding anew failed" in r for r in report.runtime_fallbacks), report.runtime_fallbacks
    qwen_absorb.unpatch(pipe)
    assert torch.equal(_run(pipe, seed), want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_model_offload_replays_graphs(monkeypatch, kind, seed):
    """Against the same pipeline patched, eager, with model offload."""
    t = _transformer(kind, seed)
    pipe, twin = _pipe(t, seed), _pipe(copy.deepcopy(t), seed)
    _model_offload(twin)
    qwen_absorb.patch(twin, cuda_graph=False, **({"fp8_gemm": True, "capabilities": {"cpu"}} if kind == "fp8" else {}))
    want = _run(twin, seed, steps=4)
    _model_offload(pipe)
    report = _patch(pipe, kind)  # graphs in the model-offload hook: the default (gating.Tuning.model_offload_graphs)
    cuda_graph_fakes.install(monkeypatch)
    out = _run(pipe, seed, steps=4, arm=True)
    assert torch.equal(out, want)
    g = report.cuda_graph
    # true CFG: two signatures (text lengths 7 and 5), each eager once, captured once, then replayed
    assert g["captures"] == 2 and g["replays"] == 4, (g, report.graph_fallbacks)
    assert isinstance(pipe.transformer.__dict__["_old_forward"], CG.GraphedCall)  # inside accelerate's hook
    _model_offload(pipe, enable=False)
    out2 = _run(pipe, seed, steps=4, arm=True)  # the next run: diffusers put new hooks around the runner
    assert torch.equal(out2, want)
    assert report.cuda_graph["replays"] > 4, (report.cuda_graph["invalidations"], report.graph_fallbacks)
    assert not report.graph_fallbacks, report.graph_fallbacks


@pytest.mark.parametrize("mode", ["group_block", "group_leaf", "layerwise"])
def test_modes_that_stream_or_recast_weights_refuse_graphs_with_a_reason(monkeypatch, mode, seed, caplog):
    t = _transformer("bf16", seed)
    pipe = _pipe(t, seed)
    _offload(pipe, mode)
    report = _patch(pipe, "bf16")
    cuda_graph_fakes.install(monkeypatch)
    with caplog.at_level(logging.INFO, logger="qwen_absorb"):
        _run(pipe, seed, arm=True)
    assert report.cuda_graph["replays"] == 0 and report.cuda_graph["captures"] == 0
    want = "offloading hook" if mode.startswith("group") else "layerwise casting hook"
    assert sum(n for r, n in report.graph_fallbacks.items() if want in r) == 6, report.graph_fallbacks
    warned = [r for r in caplog.records
              if r.levelno == logging.WARNING and "CUDA graphs cannot be used" in r.getMessage()]
    assert len(warned) == 1 and want in warned[0].getMessage()
    why = "weights move during the call" if mode.startswith("group") else "weights are cast anew inside every call"
    assert why in warned[0].getMessage(), warned[0].getMessage()


class _OnlyInsideTheCall:
    """A diffusers hook named as group offloading names its own: the module's tensor ``attr`` holds its values only
    while the module runs (NaN otherwise), as leaf-level offloading keeps it in host memory outside the call."""

    def __init__(self, module, attr="weight"):
        from diffusers.hooks import HookRegistry, ModelHook  # noqa: PLC0415

        real = getattr(module, attr).data
        poison = torch.full_like(real, float("nan"))

        class Hook(ModelHook):
            def pre_forward(self, m, *args, **kwargs):
                getattr(m, attr).data = real
                return args, kwargs

            def post_forward(self, m, output):
                getattr(m, attr).data = poison
                return output

        getattr(module, attr).data = poison
        HookRegistry.check_if_exists_or_initialize(module).register_hook(Hook(), "group_offloading")


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_weights_that_exist_only_inside_their_module_call_are_not_read_around_it(kind, seed):
    """The fused path reads some tensors without calling their modules (the q/k RMSNorm weights, the amax of the
    linears' input quantizers an FP8-emitting site reads); with a hook that brings them in only around that call
    (leaf-level group offloading: on the H200 a kernel was given host memory and faulted), each block runs
    diffusers' forward and says why: the twin's bits (NaN where a poisoned tensor was read)."""
    model = _transformer(kind, seed)
    twin = copy.deepcopy(model)
    for m in (model, twin):
        for block in m.transformer_blocks:
            for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
                _OnlyInsideTheCall(getattr(block.attn, name))
            if kind == "fp8":
                for lin in (block.attn.to_q, block.img_mlp.net[0].proj):
                    _OnlyInsideTheCall(lin.input_quantizer, "_amax")
    kw = T.transformer_inputs(model, seed=seed + 1)
    want = T.run_transformer(twin, kw)
    assert torch.isfinite(want).all()
    report = qwen_absorb.patch(model, cuda_graph=False,
                               **({"fp8_gemm": True, "capabilities": {"cpu"}} if kind == "fp8" else {}))
    got = T.run_transformer(model, kw)
    assert torch.equal(got, want)
    why = [r for r in report.runtime_fallbacks if "offloading hook inside the block" in r]
    fallbacks = report.runtime_fallbacks
    assert why and sum(fallbacks[r] for r in why) == len(model.transformer_blocks), fallbacks
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, kw), want)
