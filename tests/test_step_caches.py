"""Issue 40 item 4: diffusers' PyramidAttentionBroadcast and MagCache under graph mode (qwen_absorb.step_caches),
FirstBlockCache and FasterCache eager with their reasons, on the CPU.

- The decisions: before every call of a true-CFG loop, :func:`step_caches.begin` predicts each state's step and
  the state after the call; the call then runs diffusers' own hooks, which must agree (compute flags and every
  plain attribute), across two pipeline runs.
- Graph mode with CPU stand-ins for CUDA graphs that behave like one: a replay runs the captured kind of step
  on the kept tensors and no hook's Python; the runner applies the predicted state. Every output equals the
  unpatched model with the same cache, step by step, cache before or after ``patch``, over runs separated by
  ``reset_stateful_hooks``; later runs replay.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import step_caches

from . import builders as T

hooks_mod = pytest.importorskip("diffusers.hooks")
PAB_CFG, MAG_CFG = hooks_mod.PyramidAttentionBroadcastConfig, hooks_mod.MagCacheConfig
STEPS = 6
TIMESTEPS = [1000.0 - 170 * i for i in range(STEPS)]  # 1000, 830, 660, 490, 320, 150


class _Clock:  # the pipeline's current timestep, as QwenImagePipeline exposes it (a 0-d tensor)
    t = torch.tensor(1000.0)

    def __call__(self):
        return self.t


def _configs(clock, steps=STEPS):
    """Each cache's diffusers defaults and a setting a user would pick for speed (tests/test_step_caches_gpu.py too)."""
    return {
        "pab_default": lambda: PAB_CFG(current_timestep_callback=clock),  # diffusers picks spatial range 2
        "pab_fast": lambda: PAB_CFG(spatial_attention_block_skip_range=3,
                                    spatial_attention_timestep_skip_range=(100, 950), current_timestep_callback=clock),
        "mag_default": lambda: MAG_CFG(mag_ratios=[1.0] + [0.99] * (steps - 1), num_inference_steps=steps),
        "mag_fast": lambda: MAG_CFG(mag_ratios=[1.0] + [0.98] * (steps - 1), num_inference_steps=steps,
                                    threshold=0.2, max_skip_steps=4, retention_ratio=0.1),
    }


def _with_cache(model, make, order):
    """``model`` patched (graph mode) with the cache ``make()`` enabled before or after the patch, and its unpatched
    twin with the same cache (also tests/test_step_caches_gpu.py): (report, twin)."""
    twin = copy.deepcopy(model)
    if order == "cache-then-patch":
        model.enable_cache(make())
    report = qwen_absorb.patch(model, cuda_graph=True)
    if order == "patch-then-cache":
        model.enable_cache(make())
    twin.enable_cache(make())
    return report, twin


def _inputs(model, seed):
    pos = [T.transformer_inputs(model, seed=seed + i) for i in range(STEPS)]
    # the negative prompt as long as the positive one: PAB's state is one per hook, shared by cond and uncond, and
    # diffusers hands the cond call's attention to the uncond one (a shorter prompt would not fit it)
    neg = [T.transformer_inputs(model, seed=seed + 50 + i, masked_tail=0) for i in range(STEPS)]
    return pos, neg


def _loop(model, pos, neg, clock, runs=2, each=None):
    """True CFG as QwenImagePipeline runs it: per step a "cond" and an "uncond" call; the states reset after a run."""
    outs = []
    with torch.no_grad():
        for _ in range(runs):
            for t, p, n in zip(TIMESTEPS, pos, neg):
                clock.t = torch.tensor(t)
                for name, kw in (("cond", p), ("uncond", n)):
                    with model.cache_context(name):
                        if each is not None:
                            each(model)
                        outs.append(model(**kw)[0].clone())
            model._reset_stateful_cache()
    return outs


def _hooks(model):
    return [h for m in model.modules() for h in step_caches.owned(m)]


@pytest.mark.parametrize("which", ["pab_default", "pab_fast", "mag_default", "mag_fast"])
def test_decisions_match_diffusers(which, seed):
    """The predicted step and state after it against diffusers' hooks running the call (unpatched model)."""
    clock = _Clock()
    model = T.tiny_transformer(seed=seed, num_layers=3)
    model.enable_cache(_configs(clock)[which]())
    pos, neg = _inputs(model, seed + 1)
    seen = []

    def check(m):
        steps = step_caches.begin(m._cache_config, _hooks(m))
        if isinstance(steps, str):  # MagCache before its hooks set a context: only without cache_context
            raise AssertionError(steps)
        seen.append([s.compute for s in steps.steps])
        pending.append(steps)

    pending: list = []
    with torch.no_grad():
        for _ in range(2):
            for t, p, n in zip(TIMESTEPS, pos, neg):
                clock.t = torch.tensor(t)
                for name, kw in (("cond", p), ("uncond", n)):
                    with model.cache_context(name):
                        check(model)
                        model(**kw)
                    for s in pending.pop().steps:
                        for k, v in s.post.items():
                            got = getattr(s.state, k)
                            assert type(got) is type(v) and (torch.equal(got, v) if isinstance(v, torch.Tensor)
                                                             else got == v), (which, k, got, v)
                        if which.startswith("pab"):  # diffusers' PAB state keeps the output it computed
                            kept = s.kept.bufs[0] if s.kept is not None else None
                            assert s.compute == (s.state.cache[0] is not kept)
            model._reset_stateful_cache()
    flat = [c for call in seen for c in call]
    assert any(flat) and not all(flat), which  # both kinds of step happen


def _capture_like_a_graph(latest, wrap):
    """A CPU stand-in for ``cuda_graph.capture.capture`` with a CUDA graph's semantics for the step caches: the
    warm-up and the capture run through the runner's staging; a replay runs the captured kind of step on the kept
    tensors (the current call's states set to the capture's, then put back: no Python effect) and writes the
    kept tensors as the graph's copies do."""
    from qwen_absorb.cuda_graph import capture as C
    from qwen_absorb.cuda_graph.signature import thaw_call

    from .cuda_graph_fakes import FakeGraph

    def capture(inner, transformer, call, desc, streams, pools, statics=None):
        statics = [x.clone() for x in call.tensors]
        args, kwargs = thaw_call(call.spec, statics)
        warm = inner(*args, **kwargs)
        inner(*args, **kwargs)  # the capture (its ops executed here: the same values again)
        cap, raw = latest.pop("steps", None), latest.pop("inner", inner)  # (no steps: a call without a cache)
        befores = [s.before for s in cap.steps] if cap is not None else []
        out = C.map_tensors(warm, torch.Tensor.clone)
        graph = FakeGraph()

        def replay():
            if cap is None:
                fresh = raw(*thaw_call(call.spec, statics)[0], **thaw_call(call.spec, statics)[1])
                for dst, src in zip(C.tensors_in(out), C.tensors_in(fresh)):
                    dst.copy_(src)
                return
            now = latest["now"]
            assert now.key == cap.key
            held = [s.snapshot() for s in now.steps]
            for s, b in zip(now.steps, befores):
                s.restore(b)
            baked = step_caches.Steps(now.steps, cap.shadows, "replay")  # the capture's timestep comparisons
            args, kwargs = thaw_call(call.spec, statics)
            fresh = wrap(baked, raw)(*args, **kwargs)
            for s, h in zip(now.steps, held):
                s.restore(h)
            for dst, src in zip(C.tensors_in(out), C.tensors_in(fresh)):
                dst.copy_(src)

        graph.fn = replay
        return C.Captured(warm, C.Graph(graph, statics, out, [], desc, 0.0), None, 0)

    return capture


@pytest.fixture
def graph_like(fake_cuda, monkeypatch):
    from qwen_absorb.cuda_graph import runner as R

    latest: dict = {}
    wrap, begin = step_caches.Steps.wrap, step_caches.begin

    def spy_wrap(self, inner):
        latest.update(steps=self, inner=inner)
        return wrap(self, inner)

    def spy_begin(*a):
        out = begin(*a)
        latest["now"] = out
        return out

    monkeypatch.setattr(step_caches.Steps, "wrap", spy_wrap)
    monkeypatch.setattr(step_caches, "begin", spy_begin)
    monkeypatch.setattr(R, "capture", _capture_like_a_graph(latest, wrap))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["cache-then-patch", "patch-then-cache"])
@pytest.mark.parametrize("which", ["pab_default", "pab_fast", "mag_default", "mag_fast"])
def test_graph_mode_matches_unpatched(graph_like, which, order, seed):
    clock = _Clock()
    model = T.tiny_transformer(seed=seed, num_layers=3)
    report, twin = _with_cache(model, _configs(clock)[which], order)
    pos, neg = _inputs(model, seed + 1)
    got = _loop(model, pos, neg, clock, runs=3)
    want = _loop(twin, pos, neg, clock, runs=3)
    assert len(got) == 3 * 2 * STEPS
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), (which, i)
    assert not all(torch.equal(a, b) for a, b in zip(got, got[1:]))  # fresh inputs: a stale output would show
    g = report.cuda_graph
    name = step_caches.kind(model._cache_config)
    assert g["replays"] >= 2 * STEPS and g["captures"] >= 2, g
    allowed = {f"{name} cache: first computed step of its state", "cache hook active (enable_cache)",
               f"{name} cache: steps not decided for this call", "first scan"}
    assert set(g["refusals"]) <= allowed, g["refusals"]
    kept = [h for h in _hooks(model) if h in step_caches._kept]
    assert kept
    qwen_absorb.unpatch(model)
    assert not any(h in step_caches._kept for h in kept)  # unpatch releases the kept tensors
    # unpatched, diffusers' hooks go on from the states graph mode left
    assert all(torch.equal(a, b) for a, b in zip(_loop(model, pos, neg, clock, 1), _loop(twin, pos, neg, clock, 1)))


@pytest.mark.slow
def test_switching_caches_under_graph_mode(graph_like, seed):
    """disable_cache / enable_cache of another kind between runs: exact throughout, and the new cache replays."""
    clock = _Clock()
    model = T.tiny_transformer(seed=seed, num_layers=3)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True)
    pos, neg = _inputs(model, seed + 1)
    for which in ("pab_fast", "mag_fast", "mag_default", None, "pab_default", "pab_fast"):
        replays = report.cuda_graph["replays"]
        for m in (model, twin):
            if m._cache_config is not None:
                m.disable_cache()
            if which is not None:
                m.enable_cache(_configs(clock)[which]())
        got, want = _loop(model, pos, neg, clock), _loop(twin, pos, neg, clock)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), which
        assert report.cuda_graph["replays"] - replays >= STEPS, (which, report.cuda_graph)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["pab", "mag"])
def test_pipeline_under_graph_mode(graph_like, which, seed):
    """A tiny QwenImagePipeline, true CFG, as the unpatched pipeline over two calls: PAB reading
    ``pipe.current_timestep`` (a tensor), MagCache ending its run with the pipeline's steps."""
    n = 8
    pipes = [T.tiny_pipeline(seed=seed, dtype=torch.bfloat16) for _ in range(2)]
    for p in pipes:
        if which == "pab":
            p.transformer.enable_cache(PAB_CFG(spatial_attention_block_skip_range=2,
                                               spatial_attention_timestep_skip_range=(100, 990),
                                               current_timestep_callback=lambda p=p: p.current_timestep))
        else:
            p.transformer.enable_cache(MAG_CFG(mag_ratios=[1.0] + [0.99] * (n - 1), num_inference_steps=n))
    report = qwen_absorb.patch(pipes[0], cuda_graph=True)
    emb, mask = T.tiny_prompt_embeds(seed=seed, dtype=torch.bfloat16, masked_tail=0)
    neg, nmask = T.tiny_prompt_embeds(seed=seed + 1, dtype=torch.bfloat16, masked_tail=0)  # as long (PAB)
    for run in range(2):
        a, b = (p(prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                  negative_prompt_embeds_mask=nmask, true_cfg_scale=4.0, height=32, width=32,
                  num_inference_steps=n, output_type="pt", generator=torch.Generator().manual_seed(seed)).images
                for p in pipes)
        assert torch.equal(a, b), run
    assert report.cuda_graph["replays"] > n, report.cuda_graph


@pytest.mark.parametrize("which", ["fbc", "faster"])
def test_eager_caches_are_exact_and_say_why(fake_cuda, which, seed):
    """FirstBlockCache and FasterCache: every call eager under graph mode, with the reason, as unpatched."""
    clock = _Clock()
    model = T.tiny_transformer(seed=seed, num_layers=3)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph="auto")  # eager calls counted in report.graph_fallbacks
    if which == "fbc":
        make = lambda: hooks_mod.FirstBlockCacheConfig(threshold=0.5)  # noqa: E731
    else:  # batched CFG off: QwenImagePipeline calls cond and uncond apart
        make = lambda: hooks_mod.FasterCacheConfig(  # noqa: E731
            current_timestep_callback=clock, is_guidance_distilled=True)
    model.enable_cache(make())
    twin.enable_cache(make())
    pos, neg = _inputs(model, seed + 1)
    got, want = _loop(model, pos, neg, clock), _loop(twin, pos, neg, clock)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    reason = step_caches.refusal(model._cache_config)[0]
    g = report.cuda_graph
    assert g["replays"] == 0 and g["refusals"].get(reason) == len(got), g["refusals"]
    assert any(reason in k for k in report.graph_fallbacks), report.graph_fallbacks
    assert step_caches.kind(model._cache_config) is None


def test_faster_cache_with_batched_cfg_raises_as_unpatched(seed):
    """FasterCache's CFG split does not apply to Qwen-Image (one prompt per call): diffusers raises, patched or not."""
    clock = _Clock()
    errors = []
    for patched in (False, True):
        model = T.tiny_transformer(seed=seed, num_layers=2)
        if patched:
            qwen_absorb.patch(model)
        model.enable_cache(hooks_mod.FasterCacheConfig(current_timestep_callback=clock))
        pos, neg = _inputs(model, seed + 1)
        with pytest.raises(Exception) as e:
            _loop(model, pos, neg, clock, runs=1)
        errors.append(type(e.value))
    assert errors[0] is errors[1]
