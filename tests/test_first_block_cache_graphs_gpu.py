"""diffusers' FirstBlockCache under CUDA graphs per block (qwen_absorb.cuda_graph.first_block_cache), on a GPU.

    python -m pytest -q -m gpu tests/test_first_block_cache_graphs_gpu.py

- bf16: a true-CFG loop ("cond" / "uncond", prompts of different lengths) over two runs separated by the pipeline's
  state reset, cache enabled before or after ``patch``, ``cuda_graph="auto"`` and ``True``: every output equals the
  unpatched model with the same cache, bit for bit, the head hook takes the same decisions, and both kinds of step
  happen (each step's latents a fresh anchor, or that anchor plus a fresh 1e-2 perturbation); every block replays.
- ModelOpt FP8 (real FP8 GEMMs, originals on the host): per-block graphs equal the patched model running the cache
  eager (``cuda_graph=False``).
- The cache disabled: the whole-model graphs capture and replay again, bit for bit; enabled again: a new group.
- Through a QwenImagePipeline: patched (graphs) equals unpatched, with the same cache, over two pipeline calls.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from qwen_absorb import step_caches
from qwen_absorb.block import PatchedForward
from qwen_absorb.ops import _runtime

from . import builders as T
from . import test_first_block_cache_graphs as fbc_cpu

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:  # before any CUDA tensor below
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)
hooks_mod = pytest.importorskip("diffusers.hooks")
FBC_CFG = hooks_mod.FirstBlockCacheConfig
P = importlib.import_module("qwen_absorb.patch")

DEV = "cuda"
GEOMETRY = dict(attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(16, 56, 56))
LAYERS = 3
STEPS = 8
ANCHOR_EVERY = 4  # steps 0 and 4 compute (new anchors), the others skip
THRESHOLD = 0.2  # diffusers' "for speed" setting (benchmarks/caches.py fbc_fast)
EPS = 1e-2


def _model(seed, dtype=torch.bfloat16):
    return T.tiny_transformer(dtype=dtype, seed=seed, num_layers=LAYERS, **GEOMETRY).to(DEV)


def _inputs(model, seed):
    """Per step a (cond, uncond) pair; the prompts differ in length (two signatures per block)."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(device=DEV, height=8, width=8)
    bases = (T.transformer_inputs(model, seed=seed + 1, text_len=9, **kw),
             T.transformer_inputs(model, seed=seed + 2, text_len=6, masked_tail=0, **kw))
    anchors: list = [None, None]
    steps = []
    for k in range(STEPS):
        pair = []
        for j, base in enumerate(bases):
            shape, dtype = base["hidden_states"].shape, base["hidden_states"].dtype
            if k % ANCHOR_EVERY == 0:
                anchors[j] = torch.randn(shape, generator=gen)
            h = anchors[j] + (EPS * torch.randn(shape, generator=gen) if k % ANCHOR_EVERY else 0.0)
            pair.append(dict(base, hidden_states=h.to(DEV, dtype)))
        steps.append(pair)
    return steps


def _loop(model, steps, runs=2):  # the CPU tests' loop, without their fake graphs' arming and poisoning
    return fbc_cpu._loop(model, steps, runs, graphs=False)


def _runner(model):
    g = model.__dict__[P._STATE_ATTR].graph
    return g.runner if isinstance(g, CG.FirstUse) else g


def _group(model):
    f = _runner(model)._fbc
    return f.group if f is not None and f.group is not None and f.group.installed else None


_same = fbc_cpu._same


def _check_group(report, n_calls):
    d = report.cuda_graph
    fbc = d["first_block_cache"]
    assert fbc["installed"] and fbc["mode"] == "per block" and fbc["blocks"] == LAYERS, fbc
    assert not fbc["capture_failures"] and not fbc["refusals"] and not fbc["discarded_replays"], fbc
    # two prompt lengths: two signatures per block (more only if an input's address alignment class differed)
    assert all(b["replays"] > 0 and 2 <= b["graphs"] <= 4 for b in fbc["per_block"]), fbc["per_block"]
    reason = step_caches.refusal(FBC_CFG())[0]
    assert d["refusals"] == {reason: n_calls} and d["replays"] == 0, d


@pytest.mark.parametrize("cuda_graph", ["auto", True])
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
def test_bf16_per_block_graphs_equal_unpatched(order, cuda_graph, seed):
    model = _model(seed)
    report, twin = fbc_cpu._with_cache(model, order, cuda_graph)  # (the same threshold)
    steps = _inputs(model, seed + 3)
    got, computed = _loop(model, steps)
    want, want_computed = _loop(twin, steps)
    _same(got, want)
    assert computed == want_computed and True in computed and False in computed, computed
    assert not all(torch.equal(a, b) for a, b in zip(want, want[1:]))
    _check_group(report, len(got))
    for block, r in zip(model.transformer_blocks, _group(model).runners):
        assert block._diffusers_hook._fn_refs[-1].original_forward is r and isinstance(r._inner, PatchedForward)


def test_fp8_per_block_graphs_equal_the_patched_eager_model(seed):
    pytest.importorskip("modelopt")
    model = _model(seed)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1, device=DEV, height=8, width=8)])
    eager = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True)
    qwen_absorb.patch(eager, cuda_graph=False)
    assert report.summary["fp8_gemm_linears"] > 0
    for m in (model, eager):
        m.enable_cache(FBC_CFG(threshold=THRESHOLD))
    steps = _inputs(model, seed + 3)
    got, computed = _loop(model, steps)
    want, want_computed = _loop(eager, steps)
    _same(got, want)
    assert computed == want_computed and True in computed and False in computed, computed
    _check_group(report, len(got))


def test_disabled_cache_goes_back_to_whole_model_graphs(seed):
    model = _model(seed)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True)
    for m in (model, twin):
        m.enable_cache(FBC_CFG(threshold=THRESHOLD))
    steps = _inputs(model, seed + 3)
    got, _ = _loop(model, steps, runs=1)
    want, _ = _loop(twin, steps, runs=1)
    _same(got, want)
    group = _group(model)
    for m in (model, twin):
        m.disable_cache()
    with torch.no_grad():
        for i in range(3):
            kw = T.transformer_inputs(model, seed=seed + 40 + i, device=DEV, height=8, width=8)
            assert torch.equal(model(**kw)[0], twin(**kw)[0]), i
    assert not group.installed and _group(model) is None
    assert all(isinstance(b.__dict__["forward"], PatchedForward) for b in model.transformer_blocks)
    d = report.cuda_graph
    assert d["replays"] >= 2 and d["graphs"] >= 1 and d["first_block_cache"]["installed"] is False, d
    for m in (model, twin):
        m.enable_cache(FBC_CFG(threshold=THRESHOLD))
    got, _ = _loop(model, steps, runs=1)
    want, _ = _loop(twin, steps, runs=1)
    _same(got, want)
    assert _group(model) is not None and _group(model) is not group


def test_pipeline_with_first_block_cache_under_block_graphs(seed):
    n = 10
    pipes = [T.tiny_pipeline(seed=seed, dtype=torch.bfloat16, transformer=T.tiny_transformer(
        dtype=torch.bfloat16, seed=seed, num_layers=LAYERS, **GEOMETRY)).to(DEV) for _ in range(2)]
    for p in pipes:
        p.transformer.enable_cache(FBC_CFG(threshold=THRESHOLD))
    report = qwen_absorb.patch(pipes[0])  # "auto"
    dim = pipes[0].transformer.config.joint_attention_dim
    emb, mask = T.tiny_prompt_embeds(seed=seed, dim=dim, dtype=torch.bfloat16, masked_tail=0, device=DEV)
    neg, nmask = T.tiny_prompt_embeds(seq_len=5, seed=seed + 1, dim=dim, dtype=torch.bfloat16, masked_tail=0,
                                      device=DEV)
    with torch.no_grad():
        for run in range(2):
            a, b = (p(prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                      negative_prompt_embeds_mask=nmask, true_cfg_scale=4.0, height=64, width=64,
                      num_inference_steps=n, output_type="latent",
                      generator=torch.Generator(DEV).manual_seed(seed)).images for p in pipes)
            assert torch.equal(a, b), run
    fbc = report.cuda_graph["first_block_cache"]
    assert fbc["installed"] and fbc["replays"] > 0 and not fbc["capture_failures"], fbc
