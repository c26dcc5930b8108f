"""Issue 19: diffusers' TaylorSeer cache under qwen_absorb's CUDA-graph mode, on a GPU.

    python -m pytest -q -m gpu tests/test_taylorseer_gpu.py

- The step kernels (``ops.taylor_seer``) against diffusers' own ``TaylorSeerState`` on CUDA, bit for bit: every
  module dtype / factor dtype pair, orders 1 to 3, step sizes and offsets that are not powers of two, sizes
  that are not multiples of a vector.
- Whole-model graph mode with the cache, true-CFG loops (two cache contexts) over two pipeline calls: the
  outputs equal the unpatched model with the same cache (bf16) or the patched eager model (ModelOpt FP8),
  graphs are replayed for compute and predict steps, and unpatch frees the kept factors.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import qwen_absorb
from qwen_absorb import taylorseer
from . import builders as T
from qwen_absorb.ops import taylor_seer as ts_ops
from qwen_absorb.plan import PLAN_ATTR

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
diffusers_hooks = pytest.importorskip("diffusers.hooks")
TaylorSeerCacheConfig = diffusers_hooks.TaylorSeerCacheConfig

DEV = "cuda"
GEOMETRY = dict(attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(16, 56, 56))  # q/k fusion: own attention


def _kernels_or_skip():
    why = taylorseer.graph_reasons(torch.device(DEV))
    if why:
        pytest.skip(why[0])


@pytest.mark.parametrize("d", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("f", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("max_order", [1, 2, 3])
def test_step_kernels_bit_identical_to_diffusers(seed, d, f, max_order):
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    _kernels_or_skip()
    g = torch.Generator(device="cpu").manual_seed(seed)
    shape = (2, 37, 129)  # not a multiple of any vector width
    st = TaylorSeerState(taylor_factors_dtype=f, max_order=max_order)
    bufs = [torch.full(shape, float("nan"), dtype=f, device=DEV) for _ in range(max_order + 1)]
    coef = torch.empty(ts_ops.MAX_ORDER, dtype=torch.float32, device=DEV)
    last = None
    for step in (0, 1, 3, 8, 15):  # deltas 1, 2, 5, 7
        x = (torch.randn(shape, generator=g) * 10 ** torch.randint(-3, 3, shape, generator=g)).to(d).to(DEV)
        x.view(-1)[::97] = -0.0
        nprev = 0 if last is None else min(max_order, len(st.taylor_factors[0]))
        st.current_step = step
        st.update((x,))
        c = ts_ops.update_coefficients(step - last) if last is not None else []
        coef[: len(c)] = torch.tensor(c, dtype=torch.float32)
        ts_ops.update_(x, bufs, nprev, coef)
        for k, want in st.taylor_factors[0].items():
            assert torch.equal(bufs[k].view(torch.uint8), want.contiguous().view(torch.uint8)), (step, k)
        last = step
        for offset in (1, 2, 3, 4):
            st.current_step = step + offset
            want = st.predict()[0]
            n = len(st.taylor_factors[0])
            c = ts_ops.predict_coefficients(offset, n)
            coef[: len(c)] = torch.tensor(c, dtype=torch.float32)
            got = ts_ops.predict(bufs, n, coef, d)
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), offset
        st.current_step = step


def _loop(model, steps, neg_steps, runs=2):
    outs = []
    with torch.no_grad():
        for _ in range(runs):
            for kw, neg in zip(steps, neg_steps):
                with model.cache_context("cond"):
                    outs.append(model(**kw)[0].clone())
                with model.cache_context("uncond"):
                    outs.append(model(**neg)[0].clone())
            model._reset_stateful_cache()  # what the pipeline does at the end of every call
    return outs


def _inputs(model, seed, n):
    steps = [T.transformer_inputs(model, seed=seed + i, device=DEV, height=8, width=8, text_len=9) for i in range(n)]
    neg = [T.transformer_inputs(model, seed=seed + 100 + i, device=DEV, height=8, width=8, text_len=5,
                                masked_tail=0) for i in range(n)]
    return steps, neg


CONFIGS = [dict(cache_interval=5, disable_cache_before_step=3),
           dict(cache_interval=3, disable_cache_before_step=2, max_order=2, taylor_factors_dtype=torch.float32)]


def _same_under_cache(model, ref, config, seed, n):
    """The cache on both models, a true-CFG loop over two pipeline calls: the outputs, bit for bit."""
    model.enable_cache(config)
    ref.enable_cache(config)
    steps, neg = _inputs(model, seed, n)
    got = _loop(model, steps, neg)
    assert all(torch.equal(a, b) for a, b in zip(got, _loop(ref, steps, neg)))
    return got, steps, neg


@pytest.mark.parametrize("cfg", CONFIGS)
def test_graph_mode_with_cache_bit_identical_to_unpatched(seed, cfg):
    _kernels_or_skip()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    plain = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True)
    got, steps, neg = _same_under_cache(model, plain, TaylorSeerCacheConfig(**cfg), seed + 1, 12)
    assert not all(torch.equal(a, b) for a, b in zip(got, got[2:]))
    g = report.cuda_graph
    assert g["replays"] >= 24, g  # most calls of the second run replay, predict and compute steps alike
    # eager calls: each context's first update (no kept factors yet), and the first call after enable_cache
    # (the blocks decide anew to run the cache: refused, then found mid-call); nothing else
    first = {"TaylorSeer cache: first update of its factors": 2, "cache hook active (enable_cache)": 1,
             "TaylorSeer cache: steps not decided for this call": 1}
    assert set(g["refusals"]) <= set(first) and all(v <= first[k] for k, v in g["refusals"].items()), g["refusals"]
    assert all(b.__dict__[PLAN_ATTR].attn_cache for b in model.transformer_blocks)
    hooks = [taylorseer.supported_hook(b.attn) for b in model.transformer_blocks]
    assert all(taylorseer._record(h, "cond") is not None for h in hooks)
    qwen_absorb.unpatch(model)
    gc.collect()
    assert all(taylorseer._record(h, "cond") is None for h in hooks)
    # unpatched, the model goes on with diffusers' own hooks on the same states
    after = zip(_loop(model, steps[:4], neg[:4], 1), _loop(plain, steps[:4], neg[:4], 1))
    assert all(torch.equal(a, b) for a, b in after)


def test_fp8_graph_mode_with_cache_bit_identical_to_eager(seed):
    pytest.importorskip("modelopt")
    _kernels_or_skip()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1, device=DEV, height=8, width=8)])
    eager = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True)
    qwen_absorb.patch(eager, cuda_graph=False)
    _same_under_cache(model, eager, TaylorSeerCacheConfig(cache_interval=4, disable_cache_before_step=2), seed + 2, 10)
    assert report.cuda_graph["replays"] >= 20, report.cuda_graph
    assert report.summary["fp8_gemm_linears"] == 14 * 2


def test_a_hook_on_a_fused_qk_norm_still_runs_under_the_cache(seed):
    """With the cache run inside the block, the attention's q/k norms are still fused: a user's hook on one of
    them sends the q/k chain back to the modules (the hook runs on every computed step), exact throughout."""
    _kernels_or_skip()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    plain = copy.deepcopy(model)
    qwen_absorb.patch(model, cuda_graph=False)
    seen = {id(model): 0, id(plain): 0}
    for m in (model, plain):
        m.transformer_blocks[1].attn.norm_q.register_forward_hook(
            lambda mod, a, o, k=id(m): seen.__setitem__(k, seen[k] + 1))
    _same_under_cache(model, plain, TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2), seed + 3, 6)
    # steps 0, 1 (warm-up) and 3 compute: 3 of 6, x 2 contexts x 2 pipeline calls, patched as unpatched
    assert seen[id(model)] == seen[id(plain)] == 12, seen
    assert not model.transformer_blocks[1].__dict__[PLAN_ATTR].qk_fused
    assert model.transformer_blocks[0].__dict__[PLAN_ATTR].qk_fused
