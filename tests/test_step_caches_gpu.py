"""Issue 40 item 4: diffusers' caches under qwen_absorb's CUDA-graph mode, on a GPU.

    python -m pytest -q -m gpu tests/test_step_caches_gpu.py

- PyramidAttentionBroadcast and MagCache (qwen_absorb.step_caches): true-CFG loops (two cache contexts) over
  three runs separated by ``reset_stateful_hooks``, cache enabled before or after ``patch``: every output equals
  the unpatched model with the same cache, bit for bit; compute and skip steps are replayed. Under PAB the blocks
  run their own fused attention (``attn_cache``: the hook's logic around ``qwen_absorb.attention.run``).
- The same through a QwenImagePipeline (PAB reading ``pipe.current_timestep``, a CUDA tensor: the decision's device
  read happens before the replay, never inside a capture).
- FirstBlockCache and FasterCache: every call eager with its reason, bit for bit.
- A ModelOpt FP8 model under MagCache and PAB: graph mode equals the patched eager model; under PAB, graph mode
  on the fused attention equals a patched twin whose blocks call the PAB-hooked attention module (diffusers' hook
  around diffusers' processor, its linears' gated real-FP8 forwards), the kept attention outputs included.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import dependencies, step_caches
from qwen_absorb.ops import _runtime
from qwen_absorb.plan import PLAN_ATTR

from . import builders as T
from .test_step_caches import _configs as cpu_configs
from .test_step_caches import _with_cache as with_cache

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:  # before any CUDA tensor below
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)
hooks_mod = pytest.importorskip("diffusers.hooks")
PAB_CFG, MAG_CFG = hooks_mod.PyramidAttentionBroadcastConfig, hooks_mod.MagCacheConfig

DEV = "cuda"
GEOMETRY = dict(attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(16, 56, 56))
STEPS = 10
TIMESTEPS = [1000.0 - 95 * i for i in range(STEPS)]


class _Clock:
    t = torch.tensor(1000.0, device=DEV)

    def __call__(self):
        return self.t


def _configs(clock):
    return cpu_configs(clock, STEPS)


def _plans(model):
    return [b.__dict__[PLAN_ATTR] for b in model.transformer_blocks]


def _inputs(model, seed):
    kw = dict(device=DEV, height=8, width=8, text_len=9)
    pos = [T.transformer_inputs(model, seed=seed + i, **kw) for i in range(STEPS)]
    neg = [T.transformer_inputs(model, seed=seed + 100 + i, masked_tail=0, **kw) for i in range(STEPS)]
    return pos, neg


def _loop(model, pos, neg, clock, runs=3):
    outs = []
    with torch.no_grad():
        for _ in range(runs):
            for t, p, n in zip(TIMESTEPS, pos, neg):
                clock.t = torch.tensor(t, device=DEV)
                for name, kw in (("cond", p), ("uncond", n)):
                    with model.cache_context(name):
                        outs.append(model(**kw)[0].clone())
            model._reset_stateful_cache()  # what the pipeline does at the end of every call
    return outs


@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
@pytest.mark.parametrize("which", ["pab_default", "pab_fast", "mag_default", "mag_fast"])
def test_graph_mode_with_cache_bit_identical_to_unpatched(which, order, seed):
    clock = _Clock()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    report, plain = with_cache(model, _configs(clock)[which], order)
    pos, neg = _inputs(model, seed + 1)
    got, want = _loop(model, pos, neg, clock), _loop(plain, pos, neg, clock)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (which, i)
    assert not all(torch.equal(a, b) for a, b in zip(got, got[1:]))
    g = report.cuda_graph
    name = step_caches.kind(model._cache_config)
    assert g["replays"] >= 2 * STEPS and not g["capture_failures"], g
    allowed = {f"{name} cache: first computed step of its state", "cache hook active (enable_cache)",
               f"{name} cache: steps not decided for this call"}
    assert set(g["refusals"]) <= allowed and sum(g["refusals"].values()) <= 4, g["refusals"]
    if name == step_caches.PAB:  # the q/k fusion gives the blocks their own attention: PAB runs around it
        assert all(p.attn_cache and p.own_attention and not p.attn_forwards for p in _plans(model))


@pytest.mark.parametrize("which", ["pab", "mag"])
def test_pipeline_with_cache_under_graphs(which, seed):
    n = 12
    pipes = [T.tiny_pipeline(seed=seed, dtype=torch.bfloat16, transformer=T.tiny_transformer(
        dtype=torch.bfloat16, seed=seed, **GEOMETRY)).to(DEV) for _ in range(2)]
    for p in pipes:
        if which == "pab":
            p.transformer.enable_cache(PAB_CFG(spatial_attention_block_skip_range=2,
                                               current_timestep_callback=lambda p=p: p.current_timestep))
        else:
            p.transformer.enable_cache(MAG_CFG(mag_ratios=[1.0] + [0.99] * (n - 1), num_inference_steps=n))
    report = qwen_absorb.patch(pipes[0], cuda_graph=True)
    dim = pipes[0].transformer.config.joint_attention_dim
    emb, mask = T.tiny_prompt_embeds(seed=seed, dim=dim, dtype=torch.bfloat16, masked_tail=0, device=DEV)
    neg, nmask = T.tiny_prompt_embeds(seed=seed + 1, dim=dim, dtype=torch.bfloat16, masked_tail=0, device=DEV)
    with torch.no_grad():
        for run in range(3):
            a, b = (p(prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                      negative_prompt_embeds_mask=nmask, true_cfg_scale=4.0, height=64, width=64,
                      num_inference_steps=n, output_type="latent",
                      generator=torch.Generator(DEV).manual_seed(seed)).images for p in pipes)
            assert torch.equal(a, b), run
    assert report.cuda_graph["replays"] >= n, report.cuda_graph
    if which == "pab":
        assert all(p.attn_cache and p.own_attention for p in _plans(pipes[0].transformer))


@pytest.mark.parametrize("which", ["fbc", "faster"])
def test_eager_caches_bit_identical_with_reason(which, seed):
    clock = _Clock()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    plain = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph="auto")
    for m in (model, plain):
        m.enable_cache(hooks_mod.FirstBlockCacheConfig(threshold=0.3) if which == "fbc" else
                       hooks_mod.FasterCacheConfig(current_timestep_callback=clock, is_guidance_distilled=True))
    pos, neg = _inputs(model, seed + 1)
    got, want = _loop(model, pos, neg, clock, runs=2), _loop(plain, pos, neg, clock, runs=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    reason = step_caches.refusal(model._cache_config)[0]
    assert report.cuda_graph["replays"] == 0 and report.cuda_graph["refusals"][reason] == len(got)


@pytest.mark.parametrize("which", ["mag_fast", "pab_default"])
def test_fp8_graph_mode_with_cache_bit_identical_to_eager(which, seed):
    """ModelOpt FP8 (PAB: around the blocks' own fused attention, its linears real FP8 GEMMs)."""
    pytest.importorskip("modelopt")
    clock = _Clock()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1, device=DEV, height=8, width=8)])
    eager = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True)
    qwen_absorb.patch(eager, cuda_graph=False)
    for m in (model, eager):
        m.enable_cache(_configs(clock)[which]())
    pos, neg = _inputs(model, seed + 2)
    got, want = _loop(model, pos, neg, clock), _loop(eager, pos, neg, clock)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert report.cuda_graph["replays"] >= 2 * STEPS, report.cuda_graph
    if which.startswith("pab"):
        assert all(p.attn_cache and p.own_attention for p in _plans(model) + _plans(eager))


@pytest.mark.parametrize("which", ["pab_default", "pab_fast"])
def test_fp8_pab_graphs_on_the_fused_attention_bit_identical_to_the_hooked_module(monkeypatch, which, seed):
    """PAB under graphs on the blocks' own fused attention (FP8 GEMMs, fused q/k) against a patched eager twin whose
    blocks call the hooked attention module (diffusers' PAB hook, its processor, the linears' gated real-FP8
    forwards): every output, and after every call each state's counter and kept attention output, bit for bit."""
    pytest.importorskip("modelopt")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89+")
    clock = _Clock()
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, **GEOMETRY).to(DEV)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1, device=DEV, height=8, width=8)])
    hooked = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True, fp8_gemm=True)
    qwen_absorb.patch(hooked, cuda_graph=False, fp8_gemm=True)
    for m in (model, hooked):
        m.enable_cache(_configs(clock)[which]())
    pos, neg = _inputs(model, seed + 2)

    def states(m):
        out = []
        for b in m.transformer_blocks:
            st = b.attn._diffusers_hook.hooks[step_caches.PAB_HOOK_NAME].state
            out.append((st.iteration, None if st.cache is None else tuple(x.clone() for x in st.cache)))
        return out

    seen: list = []

    def loop(m, each):
        outs = []
        with torch.no_grad():
            for _ in range(3):
                for t, p, n in zip(TIMESTEPS, pos, neg):
                    clock.t = torch.tensor(t, device=DEV)
                    for name, kw in (("cond", p), ("uncond", n)):
                        with m.cache_context(name):
                            outs.append(m(**kw)[0].clone())
                        each(m)
                m._reset_stateful_cache()
        return outs

    got = loop(model, lambda m: seen.append(states(m)))
    assert all(p.attn_cache and p.own_attention and not p.attn_forwards for p in _plans(model))
    it = iter(seen)

    def same(m):
        for (i, c), (j, d) in zip(next(it), states(m), strict=True):
            assert i == j and (c is None) == (d is None)
            assert c is None or all(torch.equal(x, y) for x, y in zip(c, d, strict=True))

    with monkeypatch.context() as mp:
        mp.setattr(dependencies, "attention_cache", lambda block: False)  # the twin's blocks call the hooked module
        want = loop(hooked, same)
        assert not any(p.attn_cache for p in _plans(hooked)) and all(p.attn_forwards for p in _plans(hooked))
    assert len(got) == 3 * 2 * STEPS
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (which, i)
    assert not all(torch.equal(a, b) for a, b in zip(got, got[1:]))
    g = report.cuda_graph
    assert g["replays"] >= 2 * STEPS and not g["capture_failures"], g
    assert report.summary["fp8_gemm_linears"] == 14 * len(model.transformer_blocks)
