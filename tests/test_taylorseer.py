"""Issue 19: diffusers' TaylorSeer cache run by the patched block (qwen_absorb.taylorseer), on the CPU.

- The plan: a TaylorSeer hook that is the attention's only hook lets the block keep its own attention
  (``attn_cache``); any other hook on ``attn`` still sends the attention to its module.
- Eager: the block runs diffusers' own decision, update and prediction around its attention, bit for bit what
  the hooked module computes (a twin whose blocks run the hooked module), over compute and predict steps, two
  cache contexts and a pipeline reset.
- Graph-mode steps (:class:`~qwen_absorb.taylorseer.GraphSteps`) driven by hand: decided before the call, run
  on kept factors with diffusers' expressions (the CPU has no kernels), the states' Python side applied after:
  the same outputs and the same states as diffusers' own path.

Tiny bf16 ModelOpt FP8 models through the real-FP8 decision path (``fp8_gemm=True, capabilities={"cpu"}``):
on the CPU that is what gives the block its own attention.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import dependencies, step_caches, taylorseer
from . import builders as T
from qwen_absorb.ops import taylor_seer as ts_ops
from qwen_absorb.plan import PLAN_ATTR

pytest.importorskip("modelopt")
diffusers_hooks = pytest.importorskip("diffusers.hooks")
TaylorSeerCacheConfig = diffusers_hooks.TaylorSeerCacheConfig

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}
LAYERS = 2


def _fp8(seed: int):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=LAYERS)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1)])
    return model


def _steps(model, n: int, seed: int) -> list[dict]:
    return [T.transformer_inputs(model, seed=seed + i) for i in range(n)]


def _loop(model, steps, contexts=("cond", "uncond"), drive=None) -> list[torch.Tensor]:
    """A denoising loop: each step calls the model once per context (true CFG); ``drive`` (GraphSteps) decides
    the steps before each call as the graph runner does."""
    outs = []
    with torch.no_grad():
        for kw in steps:
            for name in contexts:
                with model.cache_context(name):
                    if drive is None:
                        outs.append(model(**kw)[0])
                    else:
                        hooks = [taylorseer.supported_hook(b.attn) for b in model.transformer_blocks]
                        s = drive.begin(hooks, torch.device("cpu"))
                        with s:
                            outs.append(model(**kw)[0])
                        s.apply()
    return outs


def _plans(model):
    return [b.__dict__[PLAN_ATTR] for b in model.transformer_blocks]


def _states(model, name):
    out = []
    for b in model.transformer_blocks:
        sm = taylorseer.supported_hook(b.attn).state_manager
        st = sm._state_cache.get(name)
        facs = None if st is None else {i: {k: v.clone() for k, v in f.items()} for i, f in st.taylor_factors.items()}
        out.append(None if st is None else (st.current_step, st.last_update_step, facs))
    return out


def _same_states(a, b):
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None
            continue
        assert x[:2] == y[:2]
        assert x[2].keys() == y[2].keys()
        for i in x[2]:
            assert x[2][i].keys() == y[2][i].keys()
            assert all(torch.equal(x[2][i][k], y[2][i][k]) for k in x[2][i])


def test_plan_runs_a_taylorseer_hook_itself(seed):
    model = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    inp = T.transformer_inputs(model, seed=seed + 3)
    assert not any(p.attn_cache for p in _plans(model))
    model.enable_cache(TaylorSeerCacheConfig())
    with model.cache_context("cond"):
        T.run_transformer(model, inp)  # the watch sees the hooks: the blocks decide again
    assert all(p.attn_cache and p.own_attention and not p.attn_forwards for p in _plans(model))
    # a torch hook next to it: the attention runs as its module again (the hooks must see it)
    handles = [b.attn.register_forward_hook(lambda m, a, o: None) for b in model.transformer_blocks]
    with model.cache_context("cond"):
        T.run_transformer(model, inp)
    assert not any(p.attn_cache for p in _plans(model)) and all(p.attn_forwards for p in _plans(model))
    for h in handles:
        h.remove()
    # the inactive ("skip") mode, and lite mode, stay the hooked module's
    model.disable_cache()
    model.enable_cache(TaylorSeerCacheConfig(skip_predict_identifiers=[r"^transformer_blocks.*attn"]))
    with model.cache_context("cond"):
        T.run_transformer(model, inp)
    assert not any(p.attn_cache for p in _plans(model))
    model.disable_cache()
    with model.cache_context("cond"):
        T.run_transformer(model, inp)
    assert not any(p.attn_cache for p in _plans(model))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dict(cache_interval=2, disable_cache_before_step=1),
    dict(cache_interval=3, disable_cache_before_step=2, max_order=2, taylor_factors_dtype=torch.float32),
])
def test_eager_block_run_matches_the_hooked_module(seed, monkeypatch, cfg):
    model = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL)
    config = TaylorSeerCacheConfig(**cfg)
    model.enable_cache(config)
    twin.enable_cache(config)
    steps = _steps(model, 7, seed + 11)
    got = _loop(model, steps)
    assert all(p.attn_cache for p in _plans(model))
    st_model = _states(model, "uncond")
    with monkeypatch.context() as m:
        m.setattr(dependencies, "attention_cache", lambda block: False)  # the twin's blocks call the hooked module
        want = _loop(twin, steps)
        assert not any(p.attn_cache for p in _plans(twin))
        _same_states(st_model, _states(twin, "uncond"))
    assert len(got) == 14 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(got, got[2:]))  # fresh inputs: a stale output would show


@pytest.mark.slow
@pytest.mark.parametrize("max_order,fdtype", [(1, torch.bfloat16), (2, torch.float32)])
def test_graph_steps_match_diffusers_own_path(seed, max_order, fdtype):
    model = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL)
    config = TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2, max_order=max_order,
                                   taylor_factors_dtype=fdtype)
    model.enable_cache(config)
    twin.enable_cache(config)
    steps = _steps(model, 8, seed + 21)
    drive = taylorseer.GraphSteps()
    for run in range(2):  # a second pipeline call: diffusers resets its states, the kept factors stay
        got = _loop(model, steps, drive=drive)
        want = _loop(twin, steps)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), run
        for name in ("cond", "uncond"):
            _same_states(_states(model, name), _states(twin, name))
        kept = [taylorseer._record(taylorseer.supported_hook(b.attn), "cond") for b in model.transformer_blocks]
        assert all(r is not None for r in kept)
        st = taylorseer.supported_hook(model.transformer_blocks[0].attn).state_manager._state_cache["cond"]
        assert st.taylor_factors[0][0] is kept[0].bufs[0][0]  # the state holds the kept factors themselves
        serials = [r.serial for r in kept]
        model._reset_stateful_cache()
        twin._reset_stateful_cache()
    assert serials == [taylorseer._record(taylorseer.supported_hook(b.attn), "cond").serial
                       for b in model.transformer_blocks]  # the same factors across pipeline calls


@pytest.mark.slow
def test_graph_steps_adopt_factors_of_eager_calls(seed):
    """Calls the runner left eager (diffusers' own update made new tensors) are copied into the kept factors
    before a step reads them."""
    model = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL)
    config = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)
    model.enable_cache(config)
    twin.enable_cache(config)
    steps = _steps(model, 6, seed + 31)
    drive = taylorseer.GraphSteps()
    got = _loop(model, steps[:3]) + _loop(model, steps[3:], drive=drive) + _loop(model, steps[:2])
    want = _loop(twin, steps[:3]) + _loop(twin, steps[3:]) + _loop(twin, steps[:2])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.slow
def test_step_keys_and_refusals(seed):
    model = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    model.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    inp = T.transformer_inputs(model, seed=seed + 41)
    drive = taylorseer.GraphSteps()
    hooks = [taylorseer.supported_hook(b.attn) for b in model.transformer_blocks]
    keys = []
    with torch.no_grad():
        for _ in range(6):
            with model.cache_context("cond"):
                s = drive.begin(hooks, torch.device("cpu"))
                keys.append((s.key, s.capturable, s.writes))
                with s:
                    model(**inp)
                s.apply()
    # diffusers' schedule (interval 2, warm-up 1): compute, predict, compute, predict, ... Step 0: first update,
    # no kept factors yet (not capturable); 1: predict from order 0 only; 2: compute, differencing order 0;
    # 3: predict from orders 0 and 1; 4 and 5: the kinds of 2 and 3 again (the same graphs serve them)
    assert [k[1] for k in keys] == [False, True, True, True, True, True]
    assert [k[2] for k in keys] == [True, False, True, False, True, False]
    assert keys[2][0] == keys[4][0] and keys[3][0] == keys[5][0] and len({keys[i][0] for i in (1, 2, 3)}) == 3
    assert all(k[:2] == (False, 1) for k in keys[1][0])
    assert all(k[:2] == (True, 1) for k in keys[2][0])
    assert all(k[:2] == (False, 2) for k in keys[3][0])
    # predicting without an update raises as diffusers does
    model._reset_stateful_cache()
    with model.cache_context("cond"):
        for h in hooks:
            st = h.state_manager.get_state()
            st.current_step = 4  # the next is a predict step (past warm-up, off the interval), with no update
        s = drive.begin(hooks, torch.device("cpu"))
        with s, torch.no_grad(), pytest.raises(ValueError, match="Cannot predict"):
            model(**inp)


def test_reference_expressions_are_diffusers(seed):
    """ops.taylor_seer's references against diffusers' own TaylorSeerState, on random factors."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerState

    g = torch.Generator().manual_seed(seed)
    st = TaylorSeerState(taylor_factors_dtype=torch.float32, max_order=2)
    bufs = [torch.empty(3, 16) for _ in range(3)]
    feats = []
    for step in (0, 2, 5):
        x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
        feats.append(x)
        nprev = min(2, len(st.taylor_factors.get(0, {}))) if st.last_update_step is not None else 0
        delta = step - st.last_update_step if st.last_update_step is not None else 0
        st.current_step = step
        st.update((x,))
        ts_ops.update_reference_(x, bufs, nprev, delta)
        assert all(torch.equal(bufs[k], st.taylor_factors[0][k]) for k in st.taylor_factors[0])
    st.current_step = 8
    assert torch.equal(ts_ops.predict_reference(bufs, 3, 3, torch.bfloat16), st.predict()[0])
    assert ts_ops.predict_coefficients(3, 3) == [3.0, 4.5] and ts_ops.update_coefficients(4) == [0.25]


def test_unpatch_releases_nothing_it_did_not_make(seed):
    """Without graph mode no factors are kept: unpatch leaves diffusers' states and hooks as they are."""
    model = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    model.enable_cache(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))
    steps = _steps(model, 3, seed + 51)
    _loop(model, steps, contexts=("cond",))
    hooks = [taylorseer.supported_hook(b.attn) for b in model.transformer_blocks]
    assert all(taylorseer._record(h, "cond") is None for h in hooks)
    qwen_absorb.unpatch(model)
    assert all(taylorseer.supported_hook(b.attn) is h for b, h in zip(model.transformer_blocks, hooks))


def test_capturing_asks_no_device_count(monkeypatch):
    """The graph runner asks ``capturing()`` on every call: an initialized CUDA answers it (it implies an
    available one), without ``torch.cuda.is_available()`` (a device count, ~0.4 us a call)."""

    def asked():
        raise AssertionError("asked")

    monkeypatch.setattr(torch.cuda, "is_available", asked)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", asked)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert taylorseer.capturing() is False
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for now in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda now=now: now)
        assert taylorseer.capturing() is now


def test_kernel_layout_matches_the_c_struct():
    """ops.taylor_seer packs TaylorSeerParams by its layout string: field for field, the pointer array included."""
    import re
    from pathlib import Path

    src = (Path(ts_ops.__file__).parent / "csrc" / "taylor_seer.cu").read_text()
    orders = int(re.search(r"#define QA_TS_MAX_ORDERS (\d+)", src).group(1))
    assert orders == ts_ops.MAX_ORDER + 1
    body = re.search(r"struct TaylorSeerParams\s*\{(.*?)\};", src, re.S).group(1)
    kinds = ""
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = decl.strip()
        if decl:
            n = orders if "[QA_TS_MAX_ORDERS]" in decl else 1 + decl.count(",")
            kinds += ("P" if "*" in decl else "q" if decl.startswith("qa_i64") else "i") * n
    expanded = "".join(c * int(k or 1) for k, c in re.findall(r"(\d*)([A-Za-z])", ts_ops._LAYOUT))
    assert kinds == expanded == "P" * (3 + orders) + "q"


# ---------------------------------------------------------------------------------------------- the graph runner


def _capture_once(inner, transformer, call, desc, streams, pools, statics=None):
    """A CPU stand-in for ``cuda_graph.capture.capture`` with a CUDA graph's semantics: the warm-up runs the call,
    the capture itself runs nothing, a replay runs the captured forward again on the static inputs (the fakes of
    tests/cuda_graph_fakes.py execute the capture too, which would update the cache's factors twice)."""
    from qwen_absorb.cuda_graph import capture as C
    from qwen_absorb.cuda_graph.signature import thaw_call

    from .cuda_graph_fakes import FakeGraph

    statics = [x.clone() for x in call.tensors]
    warm = inner(*thaw_call(call.spec, statics)[0], **thaw_call(call.spec, statics)[1])
    out = C.map_tensors(warm, torch.Tensor.clone)
    graph = FakeGraph()

    def replay():
        args, kwargs = thaw_call(call.spec, statics)
        for dst, src in zip(C.tensors_in(out), C.tensors_in(inner(*args, **kwargs))):
            dst.copy_(src)

    graph.fn = replay
    return C.Captured(warm, C.Graph(graph, statics, out, [], desc, 0.0), None, 0)


def _graph_loop(model, steps, neg, runs=2):
    outs = []
    with torch.no_grad():
        for _ in range(runs):
            for kw, nk in zip(steps, neg):
                for name, k in (("cond", kw), ("uncond", nk)):
                    with model.cache_context(name):
                        outs.append(model(**k)[0].clone())
            model._reset_stateful_cache()
    return outs


@pytest.mark.slow
def test_graph_runner_replays_cache_steps(fake_cuda, monkeypatch, seed):
    """Graph mode with the cache (CPU stand-ins for graphs, steps on diffusers' expressions): every call of a
    second pipeline run replays, predict and compute steps alike, and every output equals the same cache run
    without graph mode, over two contexts and two pipeline runs."""
    from qwen_absorb.cuda_graph import runner as R

    monkeypatch.setattr(R, "capture", _capture_once)
    monkeypatch.setattr(taylorseer, "graph_reasons", lambda device: [])  # the CPU has no kernels: references
    model = _fp8(seed)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True, **REAL)
    qwen_absorb.patch(twin, cuda_graph=False, **REAL)
    config = TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2)
    model.enable_cache(config)
    twin.enable_cache(config)
    steps = _steps(model, 7, seed + 61)
    neg = [T.transformer_inputs(model, seed=seed + 71 + i, text_len=5, masked_tail=0) for i in range(7)]
    got = _graph_loop(model, steps, neg)
    want = _graph_loop(twin, steps, neg)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    g = report.cuda_graph
    # kinds of step per context: first update, update, prediction (3 x 2 contexts); the second run replays all
    assert g["captures"] == 6 and g["graphs"] == 6 and g["replays"] >= 14, g
    assert set(g["refusals"]) <= {"TaylorSeer cache: first update of its factors", "cache hook active (enable_cache)",
                                  "TaylorSeer cache: steps not decided for this call"}, g["refusals"]
    hooks = [taylorseer.supported_hook(b.attn) for b in model.transformer_blocks]
    assert all(taylorseer._record(h, n) is not None for h in hooks for n in ("cond", "uncond"))
    qwen_absorb.unpatch(model)
    assert all(taylorseer._record(h, n) is None for h in hooks for n in ("cond", "uncond"))


@pytest.mark.slow
def test_graph_runner_refusals_under_caches(fake_cuda, monkeypatch, seed):
    """Without the step kernels (the CPU) a TaylorSeer cache runs eager, with the reason; FirstBlockCache (decides
    from tensor values inside the call) is refused with its own; both exact."""
    from diffusers import FirstBlockCacheConfig

    model = _fp8(seed)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, cuda_graph=True, **REAL)
    qwen_absorb.patch(twin, cuda_graph=False, **REAL)
    steps = _steps(model, 4, seed + 81)
    for config in (TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
                   FirstBlockCacheConfig(threshold=0.2)):
        model.enable_cache(config)
        twin.enable_cache(config)
        got = _loop(model, steps)
        want = _loop(twin, steps)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        model.disable_cache()
        twin.disable_cache()
    r = report.cuda_graph["refusals"]
    assert any(k.startswith("TaylorSeer cache: tensors are on cpu") for k in r), r
    assert r.get(step_caches.refusal(FirstBlockCacheConfig())[0], 0) >= 8, r  # (tests/test_step_caches.py)
    assert report.cuda_graph["replays"] == 0


@pytest.mark.slow
def test_a_raising_call_leaves_the_states_as_diffusers_does(fake_cuda, monkeypatch, seed):
    """A forward that raises inside a block (a user's KeyboardInterrupt, an OOM) in graph mode: the runner decided
    every hook's step (advancing its counter) before the call, so it must leave each state as diffusers' own hooks
    leave it: a block that finished its step applied, a block whose forward raised with its counter advanced and
    its factors untouched, a block never reached with its counter back. Then the cache goes on exactly as the
    same cache without graph mode that raised at the same place: every later output and state equal."""
    from qwen_absorb import attention
    from qwen_absorb.cuda_graph import runner as R

    monkeypatch.setattr(R, "capture", _capture_once)
    monkeypatch.setattr(taylorseer, "graph_reasons", lambda device: [])
    model = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, cuda_graph=True, **REAL)
    qwen_absorb.patch(twin, cuda_graph=False, **REAL)
    config = TaylorSeerCacheConfig(cache_interval=3, disable_cache_before_step=2)
    model.enable_cache(config)
    twin.enable_cache(config)
    armed: dict = {}
    run = attention.run

    def raising(attn, *a, **k):
        if armed.pop(id(attn), False):
            raise RuntimeError("injected")
        return run(attn, *a, **k)

    monkeypatch.setattr(attention, "run", raising)
    # (step, context, block): a first update that raises in the second block (the first one finished), and the
    # warm-up of a capture that raises in the first block (the second one never reached)
    raises = {(0, "cond"): 1, (1, "uncond"): 0}
    steps = _steps(model, 7, seed + 91)
    n_raised = 0
    with torch.no_grad():
        for i, kw in enumerate(steps):
            for name in ("cond", "uncond"):
                outs = []
                for m in (model, twin):
                    b = raises.get((i, name))
                    if b is not None:
                        armed[id(m.transformer_blocks[b].attn)] = True
                    with m.cache_context(name):
                        try:
                            outs.append(m(**kw)[0].clone())
                        except RuntimeError as e:
                            assert "injected" in str(e)
                            outs.append(None)
                if outs[0] is None or outs[1] is None:
                    assert outs[0] is None and outs[1] is None, (i, name)
                    n_raised += 1
                else:
                    assert torch.equal(outs[0], outs[1]), (i, name)
                _same_states(_states(model, name), _states(twin, name))
    assert n_raised == 2 and not armed
    assert model.forward.replays > 0  # graph mode did replay the steps after the raises
