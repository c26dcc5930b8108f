"""Issue 19: a hooked attention (a diffusers cache hooks every ``attn``) runs as its module, and its ModelOpt
FP8 linears still run as real FP8 GEMMs through gated forwards (:mod:`qwen_absorb.fp8_forward`). CPU, tiny
bf16 ModelOpt FP8 models through the real-FP8 decision path (``fp8_gemm=True, capabilities={"cpu"}``).

The fused attention (``qwen_absorb.attention.run``) is diffusers' processor step for step and both quantize
the same bf16 activations with the same amax, so a pass-through hook on ``attn`` must not change a single
bit; everything outside the hooked-attention call (whole-block fallbacks) must stay ModelOpt's fake quant.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import fp8_forward
from . import builders as T
from qwen_absorb.block import _gated_forwards
from qwen_absorb.plan import PLAN_ATTR

pytest.importorskip("modelopt")

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}
LAYERS = 2
PER_BLOCK = 14  # 8 attention linears, 2 modulations, 4 FFN linears


def _fp8(seed: int):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=LAYERS)
    inp = T.transformer_inputs(model, seed=seed + 1)
    T.fp8_quantize(model, [inp])
    return model, T.transformer_inputs(model, seed=seed + 2)  # fresh inputs, not the calibration ones


def _hook_attn(model, fn=None):
    return [b.attn.register_forward_hook(fn or (lambda m, a, o: None)) for b in model.transformer_blocks]


class _Spy:
    """Counts ``torch._scaled_mm`` calls and the GEMMs of the gated forwards, by (block, path)."""

    def __init__(self, monkeypatch):
        self.total, self.gated = 0, collections.Counter()
        orig_mm, orig_gemm = torch._scaled_mm, fp8_forward.Fp8LinearForward.gemm

        def mm(*a, **k):
            self.total += 1
            return orig_mm(*a, **k)

        def gemm(fwd, codes):
            self.gated[(fwd.index, fwd.path)] += 1
            return orig_gemm(fwd, codes)

        monkeypatch.setattr(torch, "_scaled_mm", mm)
        monkeypatch.setattr(fp8_forward.Fp8LinearForward, "gemm", gemm)

    def reset(self):
        self.total = 0
        self.gated.clear()


def _all_gated(spy, calls=1):
    want = {(i, p): calls for i in range(LAYERS) for p in fp8_forward.ATTN_LINEARS}
    return dict(spy.gated) == want


def _gated_objects(model):
    """The gated forwards the blocks' plans hold (in their linears' slots only during a call: none there now)."""
    assert not any(type(m.__dict__.get("forward")) is fp8_forward.Fp8LinearForward for m in model.modules())
    return [f for b in model.transformer_blocks if (p := b.__dict__.get(PLAN_ATTR)) is not None
            for f in p.rt.attn_fwds.values()]


@pytest.mark.slow
def test_hooked_attention_bit_identical_and_real_fp8(seed, monkeypatch):
    model, inp = _fp8(seed)
    report = qwen_absorb.patch(model, **REAL)
    s = report.summary
    assert s["fp8_gemm_linears"] == PER_BLOCK * LAYERS and s["fp8_forward_linears"] == 8 * LAYERS, str(report)
    assert s["hooked_attention_fp8_blocks"] == 0
    spy = _Spy(monkeypatch)
    want = T.run_transformer(model, inp)
    assert spy.total == PER_BLOCK * LAYERS and not spy.gated  # the fused path: no gated forward ran
    hooks = _hook_attn(model)
    T.run_transformer(model, inp)  # decides anew (the hook is seen)
    assert report.summary["hooked_attention_fp8_blocks"] == LAYERS
    assert "attention hooked now in 2 blocks" in str(report)
    spy.reset()
    out = T.run_transformer(model, inp)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    assert spy.total == PER_BLOCK * LAYERS and _all_gated(spy)
    assert report.summary["rebuilds"] == LAYERS  # once, for the hook; building the gated weights changes nothing
    assert not any("real-FP8 linear" in r for r in report.runtime_fallbacks)
    for h in hooks:
        h.remove()
    T.run_transformer(model, inp)  # decides anew (a first call after deciding recomputes a hand-over)
    spy.reset()
    again = T.run_transformer(model, inp)
    assert torch.equal(again, want) and spy.total == PER_BLOCK * LAYERS and not spy.gated
    # the hooked-attention FP8 weights were released when the plan went back to the fused path
    assert all(f.weight is None for f in _gated_objects(model))


@pytest.mark.slow
def test_hooks_on_attention_and_linears_apply(seed, monkeypatch):
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL)

    # x2 on the attention's outputs == x2 on the output projections' outputs (dropout p=0 follows to_out.0)
    _hook_attn(model, lambda m, a, o: (o[0] * 2, o[1] * 2))
    _hook_attn(twin)
    for b in twin.transformer_blocks:
        for lin in (b.attn.to_out[0], b.attn.to_add_out):
            lin.register_forward_hook(lambda m, a, o: o * 2)
    spy = _Spy(monkeypatch)
    out, want = T.run_transformer(model, inp), T.run_transformer(twin, inp)
    assert torch.equal(out, want)
    assert dict(spy.gated) == {k: 2 for k in ((i, p) for i in range(LAYERS) for p in fp8_forward.ATTN_LINEARS)}

    # a forward hook on attn.to_q sees the real-FP8 output and may replace it
    seen = []

    def on_q(m, a, o):
        fwd = fp8_forward.of(m)
        seen.append(torch.equal(o, fwd.gemm(fwd.quantize(a[0]))))
        return torch.zeros_like(o) if edit else None

    for b in twin.transformer_blocks:
        b.attn.to_q.register_forward_hook(on_q)
    edit = False
    base = T.run_transformer(twin, inp)
    assert base.isfinite().all() and torch.equal(base, want)
    edit = True
    edited = T.run_transformer(twin, inp)
    assert not torch.equal(edited, base)
    assert seen and all(seen) and len(seen) == 2 * LAYERS  # two calls, one to_q per block
    assert twin.transformer_blocks[0].__dict__[PLAN_ATTR].attn_forwards


@pytest.mark.slow
@pytest.mark.parametrize("how", ["grad", "global hook"])
def test_whole_block_fallbacks_stay_fake_quant(seed, monkeypatch, how):
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)  # never patched: ModelOpt's fake quant
    report = qwen_absorb.patch(model, **REAL)
    _hook_attn(model)
    _hook_attn(twin)
    T.run_transformer(model, inp)  # decided with the hook; the gated weights exist now
    spy = _Spy(monkeypatch)
    if how == "grad":
        with torch.enable_grad():
            out, want = model(**inp)[0], twin(**inp)[0]
    else:
        h = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
        try:
            out, want = T.run_transformer(model, inp), T.run_transformer(twin, inp)
        finally:
            h.remove()
    assert torch.equal(out, want)
    assert spy.total == 0 and not spy.gated
    assert not any("real-FP8 linear" in r for r in report.runtime_fallbacks)  # closed gates count nothing


def _steps(model, n, seed):
    base = T.transformer_inputs(model, seed=seed)
    out = []
    for k in range(n):
        kw = dict(base)
        kw["hidden_states"] = base["hidden_states"] + 0.01 * k
        kw["timestep"] = base["timestep"] * (1 - 0.1 * k)
        out.append(kw)
    return out


def _cached(model, steps, spy=None):
    outs, counts = [], []
    with torch.no_grad():
        for kw in steps:
            if spy is not None:
                spy.reset()
            with model.cache_context("cond"):
                outs.append(model(**kw)[0])
            if spy is not None:
                counts.append((sum(spy.gated.values()), spy.total))
    return outs, counts


@pytest.mark.slow
def test_taylorseer_cache(seed, monkeypatch):
    """A TaylorSeer hook alone on ``attn`` is run by the block around its own attention (qwen_absorb.taylorseer):
    no gated forward, every attention linear a real FP8 GEMM on compute steps, none on predict steps."""
    from diffusers import TaylorSeerCacheConfig

    model, _ = _fp8(seed)
    plain = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(plain, **REAL)
    steps = _steps(model, 5, seed + 7)
    spy = _Spy(monkeypatch)
    want = [T.run_transformer(plain, kw) for kw in steps]

    # every step a compute step (warm-up): the block's attention inside the cache == the fused path, bit for bit
    model.enable_cache(TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=10))
    outs, counts = _cached(model, steps, spy)
    assert all(torch.equal(a, b) for a, b in zip(outs, want))
    assert counts[1:] == [(0, PER_BLOCK * LAYERS)] * (len(steps) - 1)  # the first call decides anew
    assert qwen_absorb.patch_report(model).summary["hooked_attention_fp8_blocks"] == 0
    model.disable_cache()

    # compute and predict steps: compute steps run every linear as a real FP8 GEMM, predict steps all but the
    # 8 attention linears; the same cache on the unpatched model (fake quant) agrees to FP8 fidelity
    cfg = TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)
    model.enable_cache(cfg)
    outs, counts = _cached(model, steps, spy)
    model.disable_cache()
    assert set(counts[1:]) == {(0, PER_BLOCK * LAYERS), (0, (PER_BLOCK - 8) * LAYERS)}, counts
    assert counts[1] == (0, (PER_BLOCK - 8) * LAYERS)  # diffusers' schedule decides which: step 1 predicts
    ref = copy.deepcopy(model)
    qwen_absorb.unpatch(ref)
    ref.enable_cache(cfg)
    fake, _ = _cached(ref, steps)
    for a, b in zip(outs, fake):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 5e-2, rel

    # disabled: the fused path again, bit for bit
    spy.reset()
    assert torch.equal(T.run_transformer(model, steps[2]), want[2]) and not spy.gated


@pytest.mark.slow
def test_unpatch_and_copies(seed, monkeypatch):
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    qwen_absorb.patch(model, **REAL)
    _hook_attn(model)
    _hook_attn(twin)
    real = T.run_transformer(model, inp)
    assert len(_gated_objects(model)) == 8 * LAYERS

    dup = copy.deepcopy(model)  # the copy's gated forwards are bound to its own linears
    spy = _Spy(monkeypatch)
    assert torch.equal(T.run_transformer(dup, inp), real) and _all_gated(spy)
    dup_modules = set(map(id, dup.modules()))
    for f in _gated_objects(dup):
        assert id(f.linear) in dup_modules and f.gate == 0

    qwen_absorb.unpatch(model)
    assert not _gated_objects(model)
    after = model.state_dict()
    assert after.keys() == sd.keys() and all(torch.equal(after[k], sd[k]) for k in sd)
    spy.reset()
    assert torch.equal(T.run_transformer(model, inp), T.run_transformer(twin, inp)) and not spy.gated

    report = qwen_absorb.patch(model, **REAL)  # patch again
    assert report.summary["fp8_forward_linears"] == 8 * LAYERS
    assert torch.equal(T.run_transformer(model, inp), real)
    assert report.summary["hooked_attention_fp8_blocks"] == LAYERS


def test_not_installed_where_it_cannot_be_ours(seed):
    model, inp = _fp8(seed)
    report = qwen_absorb.patch(model, fp8_gemm=False)
    assert not _gated_objects(model) and report.summary["fp8_forward_linears"] == 0
    qwen_absorb.unpatch(model)
    report = qwen_absorb.patch(model)  # "auto" on the CPU: installed (the device is decided per call), not able here
    assert report.summary["fp8_forward_linears"] == 0 and "hooked attention" not in str(report)
    _hook_attn(model)
    twin = copy.deepcopy(model)
    qwen_absorb.unpatch(twin)
    assert torch.equal(T.run_transformer(model, inp), T.run_transformer(twin, inp))


def test_gate_is_per_thread(seed):
    import threading

    model, inp = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    _hook_attn(model)
    T.run_transformer(model, inp)  # the gated FP8 weights exist now
    block = model.transformer_blocks[0]
    lin = block.attn.to_k
    x = torch.randn(1, 5, lin.in_features, generator=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)
    fwd = block.__dict__[PLAN_ATTR].rt.attn_fwds["attn.to_k"]
    with torch.no_grad():
        fake = type(lin).forward(lin, x)
        real = fwd.gemm(fwd.quantize(x))
        assert not torch.equal(fake, real)  # the two paths are told apart
        got = {}
        with _gated_forwards(block.__dict__[PLAN_ATTR], block):
            got["here"] = lin(x)
            t = threading.Thread(target=lambda: got.__setitem__("there", torch.no_grad()(lin)(x)))
            t.start()
            t.join()
        got["after"] = lin(x)
    assert torch.equal(got["here"], real) and torch.equal(got["there"], fake) and torch.equal(got["after"], fake)
    assert fwd.gate == 0
