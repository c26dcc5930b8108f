"""diffusers' PyramidAttentionBroadcast run by the patched block around its own fused attention
(qwen_absorb.step_caches.run), on the CPU.

- The plan: a PAB hook that is the attention's only hook (diffusers' class, the registry's forward outermost,
  wrapping the class forward) lets the block keep its own attention (``attn_cache``); any other hook, or a forward
  wrapped inside the registry, sends the attention back to its hooked module. The attention residual sites never
  defer the output projections' biases under it: the cached value is the attention's output with its bias.
- Eager: the block runs diffusers' own ``new_forward`` with its attention as the original forward: outputs, every
  state's counter and the cached attention output equal, bit for bit, those of a twin whose blocks call the
  hooked module, over true-CFG loops, two pipeline runs, diffusers' defaults and a speed setting; the block's own
  attention ran once per computed step (counted), diffusers' processor never. A cache stored without its bias is
  caught by the same comparison.
- ModelOpt NVFP4 (bit for bit ModelOpt on the CPU): the patched model with PAB, eager and in graph mode (CPU
  stand-ins for CUDA graphs), equals the unpatched model with the same cache; its NVFP4 block runs its own
  attention, its bf16 blocks the hooked module.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import qwen_absorb
from qwen_absorb import attention, dependencies, nvfp4, step_caches
from qwen_absorb.plan import PLAN_ATTR

from . import builders as T
from .test_step_caches import TIMESTEPS, _Clock, _configs, graph_like  # noqa: F401  (graph_like: a fixture)

pytest.importorskip("modelopt")
hooks_mod = pytest.importorskip("diffusers.hooks")
PAB_CFG = hooks_mod.PyramidAttentionBroadcastConfig
REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}  # real FP8 on the CPU: what gives a block its own attention
LAYERS = 2


def _fp8(seed: int, plain_out: bool = False):
    """A tiny ModelOpt FP8 model; ``plain_out``: its output projections left unquantized (a bias to defer)."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=LAYERS)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1)])
    if plain_out:
        for b in model.transformer_blocks:
            for lin in (b.attn.to_out[0], b.attn.to_add_out):
                lin.input_quantizer.disable()
                lin.weight_quantizer.disable()
    return model


def _plans(model):
    return [b.__dict__[PLAN_ATTR] for b in model.transformer_blocks]


def _inputs(model, seed, n):
    pos = [T.transformer_inputs(model, seed=seed + i) for i in range(n)]
    # as long as the positive prompt: PAB's one state per hook hands the cond call's attention to the uncond one
    neg = [T.transformer_inputs(model, seed=seed + 50 + i, masked_tail=0) for i in range(n)]
    return pos, neg


def _loop(model, pos, neg, clock, runs=2, each=None):
    """True CFG as QwenImagePipeline runs it (a "cond" and an "uncond" call per step, the states reset after a
    run); ``each(model)`` after every call."""
    outs = []
    with torch.no_grad():
        for _ in range(runs):
            for t, p, n in zip(TIMESTEPS, pos, neg):
                clock.t = torch.tensor(t)
                for name, kw in (("cond", p), ("uncond", n)):
                    with model.cache_context(name):
                        outs.append(model(**kw)[0].clone())
                    if each is not None:
                        each(model)
            model._reset_stateful_cache()
    return outs


def _pab_hooks(model):
    return [b.attn._diffusers_hook.hooks[step_caches.PAB_HOOK_NAME] for b in model.transformer_blocks]


def _states(model):
    """Each hook's counter and cached attention output (cloned), as diffusers' state holds them."""
    out = []
    for h in _pab_hooks(model):
        c = h.state.cache
        out.append((h.state.iteration, None if c is None else tuple(x.clone() for x in c)))
    return out


def _same_states(a, b) -> None:
    for (ia, ca), (ib, cb) in zip(a, b, strict=True):
        assert ia == ib
        assert (ca is None) == (cb is None)
        if ca is not None:
            assert len(ca) == len(cb) == 2
            assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(ca, cb))


@pytest.fixture
def counted(monkeypatch):
    """Calls of the block's own attention (``attention.run``) and of diffusers' processor (the hooked module)."""
    n = {"own": 0, "processor": 0}
    real_run = attention.run
    proc_cls = type(T.tiny_transformer(num_layers=1).transformer_blocks[0].attn.processor)
    real_proc = proc_cls.__call__

    def run(*a, **k):
        n["own"] += 1
        return real_run(*a, **k)

    @functools.wraps(real_proc)  # diffusers drops the kwargs its processor's signature does not name
    def proc(self, *a, **k):
        n["processor"] += 1
        return real_proc(self, *a, **k)

    monkeypatch.setattr(attention, "run", run)
    monkeypatch.setattr(proc_cls, "__call__", proc)
    return n


def test_plan_runs_a_pab_hook_itself(seed):
    clock = _Clock()
    model = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    inp = T.transformer_inputs(model, seed=seed + 3)
    assert not any(p.attn_cache for p in _plans(model))
    model.enable_cache(_configs(clock)["pab_default"]())
    T.run_transformer(model, inp)  # the watch sees the hooks: the blocks decide again
    assert all(p.attn_cache and p.own_attention and not p.attn_forwards for p in _plans(model))
    assert all(p.attn_cache_kind == step_caches.PAB for p in _plans(model))
    assert all(step_caches.attention_hook(b.attn) is h for b, h in zip(model.transformer_blocks, _pab_hooks(model)))
    # a torch hook next to it: the attention runs as its module again (the hook must see it)
    handles = [b.attn.register_forward_hook(lambda m, a, o: None) for b in model.transformer_blocks]
    T.run_transformer(model, inp)
    assert not any(p.attn_cache for p in _plans(model)) and all(p.attn_forwards for p in _plans(model))
    for h in handles:
        h.remove()
    T.run_transformer(model, inp)
    assert all(p.attn_cache for p in _plans(model))
    # a second diffusers hook on attn: its module
    attn = model.transformer_blocks[0].attn
    reg = attn._diffusers_hook
    reg.register_hook(hooks_mod.ModelHook(), "another")
    T.run_transformer(model, inp)
    assert step_caches.attention_hook(attn) is None and not _plans(model)[0].attn_cache and _plans(model)[1].attn_cache
    reg.remove_hook("another", recurse=False)
    T.run_transformer(model, inp)
    assert all(p.attn_cache for p in _plans(model))
    # a forward the user put on attn before the cache: the registry wraps it, the block's path would skip it
    model.disable_cache()
    attn.forward = lambda *a, _f=attn.forward, **k: _f(*a, **k)
    model.enable_cache(_configs(clock)["pab_default"]())
    T.run_transformer(model, inp)
    assert step_caches.attention_hook(attn) is None and not _plans(model)[0].attn_cache and _plans(model)[1].attn_cache
    model.disable_cache()  # (diffusers puts the user's forward back)
    del attn.forward
    T.run_transformer(model, inp)
    assert not any(p.attn_cache or p.attn_cache_kind for p in _plans(model))
    model.enable_cache(hooks_mod.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    with model.cache_context("cond"):
        T.run_transformer(model, inp)
    assert all(p.attn_cache and p.attn_cache_kind == "TaylorSeer" for p in _plans(model))


@pytest.mark.parametrize("step", ["pre_forward", "post_forward"])
def test_a_pab_hook_class_with_a_step_of_its_own_is_not_run_by_the_block(monkeypatch, step):
    """The block calls neither of the hook's steps: a PAB class defining one leaves the attention its hooked
    module (``attention_hook`` None)."""
    model = T.tiny_transformer(num_layers=1)
    model.enable_cache(_configs(_Clock())["pab_default"]())
    attn = model.transformer_blocks[0].attn
    hook = step_caches.attention_hook(attn)
    assert hook is _pab_hooks(model)[0]
    monkeypatch.setattr(type(hook), step, lambda self, module, *a, **k: a, raising=False)
    assert step_caches.attention_hook(attn) is None


def test_attention_residual_keeps_its_bias_under_pab(seed):
    """Output projections that are not FP8 GEMMs and ``defer_bias=True``: deferred without a cache, never while
    PAB hooks the attention (a cached attention output without its bias is not what diffusers' module returns)."""
    clock = _Clock()
    model = _fp8(seed, plain_out=True)
    qwen_absorb.patch(model, defer_bias=True, **REAL)
    inp = T.transformer_inputs(model, seed=seed + 3)
    T.run_transformer(model, inp)
    assert all(p.own_attention and p.deferred("img.attn_residual") == "attn.to_out.0"
               and p.deferred("txt.attn_residual") == "attn.to_add_out" for p in _plans(model))
    model.enable_cache(_configs(clock)["pab_default"]())
    T.run_transformer(model, inp)
    for p in _plans(model):
        assert p.attn_cache and p.deferred("img.attn_residual") is None and p.deferred("txt.attn_residual") is None


@pytest.mark.parametrize("which", ["pab_default", "pab_fast"])
def test_eager_block_run_matches_the_hooked_module(counted, monkeypatch, which, seed):
    clock = _Clock()
    model = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL)
    for m in (model, twin):
        m.enable_cache(_configs(clock)[which]())
    pos, neg = _inputs(model, seed + 11, len(TIMESTEPS))
    counted.update(own=0, processor=0)  # (the calibration ran the processor)
    seen: list = []
    got = _loop(model, pos, neg, clock, each=lambda m: seen.append(_states(m)))
    own, computed = counted["own"], counted["processor"]
    assert all(p.attn_cache for p in _plans(model))
    assert computed == 0  # never diffusers' attention
    counted["own"] = 0
    with monkeypatch.context() as mp:
        mp.setattr(dependencies, "attention_cache", lambda block: False)  # the twin's blocks call the hooked module
        it = iter(seen)
        want = _loop(twin, pos, neg, clock, each=lambda m: _same_states(next(it), _states(m)))
        assert not any(p.attn_cache for p in _plans(twin)) and all(p.attn_forwards for p in _plans(twin))
    assert counted["own"] == 0 and counted["processor"] == own  # one own attention per step diffusers computed
    calls = len(got) * LAYERS
    assert 0 < own < calls  # computed and skipped steps both happened
    assert len(got) == 2 * 2 * len(TIMESTEPS) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(got, got[1:]))  # fresh inputs: a stale output would show


def test_a_cache_stored_without_its_bias_is_caught(monkeypatch, seed):
    """The comparison of the states above fails where the block stores something else than diffusers' module
    returns: the attention residual's bias forced into deferral (the attention then returns no bias)."""
    clock = _Clock()
    model = _fp8(seed, plain_out=True)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, defer_bias=True, **REAL)
    qwen_absorb.patch(twin, defer_bias=True, **REAL)
    for m in (model, twin):
        m.enable_cache(_configs(clock)["pab_default"]())
    pos, neg = _inputs(model, seed + 21, 1)
    T.run_transformer(model, pos[0])  # decided with the hooks
    model._reset_stateful_cache()
    for p in _plans(model):
        for sp in p.sites:
            if sp.site == "attn_residual":
                sp.bias_deferred = True  # what the plan refuses
    seen: dict = {"model": [], "twin": []}
    _loop(model, pos, neg, clock, runs=1, each=lambda m: seen["model"].append(_states(m)))
    monkeypatch.setattr(dependencies, "attention_cache", lambda block: False)
    _loop(twin, pos, neg, clock, runs=1, each=lambda m: seen["twin"].append(_states(m)))
    (st, twin_st), = zip(seen["model"][-1:], seen["twin"][-1:])  # after the uncond call (a computed step)
    with pytest.raises(AssertionError):
        _same_states(st, twin_st)
    # each cached output differs from diffusers' by its projection's bias
    for (_, c), (_, d), b in zip(st, twin_st, model.transformer_blocks, strict=True):
        assert not torch.equal(c[0], d[0]) and not torch.equal(c[1], d[1])
        assert torch.allclose(c[0] + b.attn.to_out[0].bias, d[0], atol=0.05, rtol=0.02)
        assert torch.allclose(c[1] + b.attn.to_add_out.bias, d[1], atol=0.05, rtol=0.02)


def _nvfp4(seed: int):
    """Three tiny blocks, ModelOpt NVFP4 in the middle one only (its own attention on the CPU), bf16 around it."""
    from qwen_absorb import modelopt_recipe as recipe  # noqa: PLC0415

    model = T.tiny_transformer(num_layers=3, dtype=torch.bfloat16, seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    recipe.quantize(model, recipe.nvfp4_recipe_config(model, keep_first=1, keep_last=1),
                    lambda m: T.run_transformer(m, inputs))
    return model


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("which", ["pab_default", "pab_fast"])
def test_nvfp4_with_pab_bit_identical_to_unpatched(request, counted, which, graphs, seed):
    if graphs:
        request.getfixturevalue("graph_like")
    clock = _Clock()
    model = _nvfp4(seed)
    plain = copy.deepcopy(model)
    model.enable_cache(_configs(clock)[which]())
    report = qwen_absorb.patch(model, cuda_graph=graphs, capabilities={"cpu"})
    plain.enable_cache(_configs(clock)[which]())
    pos, neg = _inputs(model, seed + 31, len(TIMESTEPS))
    got = _loop(model, pos, neg, clock, runs=3)
    assert [p.attn_cache for p in _plans(model)] == [False, True, False]
    assert counted["own"] > 0
    with nvfp4.modelopt_fake_quant_on_cpu():  # ModelOpt's NVFP4 fake quantization has no CPU path of its own
        want = _loop(plain, pos, neg, clock, runs=3)
    assert len(got) == 3 * 2 * len(TIMESTEPS)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (which, graphs, i)
    assert not all(torch.equal(a, b) for a, b in zip(got, got[1:]))
    if graphs:
        g = report.cuda_graph
        assert g["replays"] >= 2 * len(TIMESTEPS) and g["captures"] >= 2, g
        assert set(g["refusals"]) <= {"PyramidAttentionBroadcast cache: first computed step of its state",
                                      "PyramidAttentionBroadcast cache: steps not decided for this call"}, g
