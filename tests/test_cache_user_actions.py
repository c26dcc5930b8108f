"""User actions crossed with diffusers' step caches on a patched ModelOpt FP8 model (real FP8 GEMMs through the
H200's decisions, graph mode with the CPU stand-in for CUDA graphs of tests/test_step_caches.py).

Each case: the patched model and a twin patched the same way run a true-CFG loop; then both take the action, the
twin is patched afresh (a fresh decision is the reference for "no stale derived state"), and the next loop of the
patched model must give the twin's bits. Where the action raises in diffusers, the patched model raises the same.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from . import builders as T
from .test_step_caches import _Clock, _configs, _inputs, _loop, graph_like, hooks_mod  # noqa: F401 (a fixture)

peft = pytest.importorskip("peft")
pytest.importorskip("modelopt")

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}
CACHES = {
    "pab": lambda clock: _configs(clock)["pab_fast"](),
    "mag": lambda clock: _configs(clock)["mag_fast"](),
    "fbc": lambda clock: hooks_mod.FirstBlockCacheConfig(threshold=0.3),
    "taylorseer": lambda clock: hooks_mod.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                                max_order=1),
}


def _add_lora(model, seed: int) -> None:
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                      target_modules=["to_q", "to_k", "add_v_proj", "img_mlp.net.2"]),
                      adapter_name="a")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.1)


def _to_fp32(model, pos, neg):
    model.to(torch.float32)
    up = lambda d: {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
                    for k, v in d.items()}
    return [up(d) for d in pos], [up(d) for d in neg]


def _run(model, pos, neg, clock):
    try:
        return _loop(model, pos, neg, clock)
    except Exception as e:  # noqa: BLE001 - compared with the twin's
        return f"{type(e).__name__}: {e}"


@pytest.mark.slow
@pytest.mark.parametrize("action", ["deepcopy", "lora_added", "to_fp32", "unpatch"])
@pytest.mark.parametrize("cache", list(CACHES))
def test_action_after_cached_runs_matches_a_fresh_patch(graph_like, cache, action, seed):
    clock = _Clock()
    model = T.tiny_transformer(seed=seed, num_layers=3, dtype=torch.bfloat16)
    T.fp8_quantize(model, T.transformer_inputs(model, seed=seed))
    twin = copy.deepcopy(model)
    for m in (model, twin):
        m.enable_cache(CACHES[cache](clock))
    report = qwen_absorb.patch(model, cuda_graph=True, **REAL)
    qwen_absorb.patch(twin, cuda_graph=False, **REAL)
    pos, neg = _inputs(model, seed + 1)
    first = _loop(model, pos, neg, clock)
    assert all(torch.equal(a, b) for a, b in zip(first, _loop(twin, pos, neg, clock))), "before the action"
    if action == "deepcopy":
        model, twin = copy.deepcopy(model), copy.deepcopy(twin)
    elif action == "lora_added":
        _add_lora(model, seed)
        _add_lora(twin, seed)
    elif action == "to_fp32":
        pos, neg = _to_fp32(model, pos, neg)
        _to_fp32(twin, pos, neg)
    qwen_absorb.unpatch(twin)
    if action == "unpatch":
        qwen_absorb.unpatch(model)
    else:
        qwen_absorb.patch(twin, cuda_graph=False, **REAL)
    got, want = _run(model, pos, neg, clock), _run(twin, pos, neg, clock)
    if isinstance(want, str) or isinstance(got, str):
        assert got == want
        return
    assert len(got) == len(first)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    assert not bad, (bad[:5], len(got))
    if action != "deepcopy":
        assert any(not torch.equal(a, b) for a, b in zip(got, first)), "the action changed nothing"
    if cache in ("pab", "mag") and action in ("lora_added", "to_fp32"):  # whole-model graphs replayed throughout
        # (FirstBlockCache graphs per block with the model call eager; TaylorSeer's graph steps need CUDA kernels)
        assert report.cuda_graph["replays"] > 0, (report.cuda_graph["refusals"], report.cuda_graph)
