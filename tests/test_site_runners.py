"""Runners chosen at plan time (issue 38): each site's runner is looked up once from its row's ``Site.op`` in
:mod:`qwen_absorb.site_runners` and stored with its mode on the site's plan; the per-call path calls what the plan
holds and decides nothing again. On CPU the references run: patched outputs equal unpatched bit for bit."""

from __future__ import annotations

import pytest
import torch

import qwen_absorb
from qwen_absorb import gating
from qwen_absorb import plan as plan_mod
from qwen_absorb import site_runners as R
from . import builders as T
from qwen_absorb.plan import PLAN_ATTR
from qwen_absorb.sites import QWENIMAGE, QWENIMAGE21

QI_OPS = sorted({s.op for s in QWENIMAGE.sites.values()})
QI21_OPS = sorted({s.op for s in QWENIMAGE21.sites.values()})
BETWEEN = ("quantize_fp8", "quantize_fp8_split")  # the launches between sites (FP8 consumers)


def _spy(monkeypatch, names, calls, as_mode=None):
    """Replace the site runners ``names`` by recording wrappers (``(name, mode)``); ``as_mode``: the mode the real
    runner is called with (the planned mode is still recorded)."""
    spies = {}
    for name in names:
        real = getattr(R, name)

        def spy(mode, *a, _real=real, _name=name, **k):
            calls.append((_name, mode))
            return _real(mode if as_mode is None else as_mode, *a, **k)

        spies[name] = spy
        monkeypatch.setattr(R, name, spy)
    return spies


def _plans(model):
    return [b.__dict__[PLAN_ATTR] for b in model.transformer_blocks]


@pytest.mark.parametrize("cross_block", [False, True])
def test_each_site_runs_its_planned_runner_once(monkeypatch, cross_block, seed):
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, batch_size=2, seed=seed + 1)
    ref = T.run_transformer(model, inputs)
    calls: list = []
    spies = _spy(monkeypatch, QI_OPS, calls)
    qwen_absorb.patch(model, cross_block=cross_block)
    for p in _plans(model):
        for sp, s in zip(p.sites, QWENIMAGE.sites.values()):
            assert sp.key == s.key and sp.run is spies[s.op]  # the row's op, looked up at plan time
            assert (sp.mode, sp.runner) == (R.REFERENCE, "reference")
    # nothing decides per call: no device / kernel / site decision after the patch
    decided = []
    for name in ("decide", "_kernel_reasons", "_decide_site"):
        real = getattr(plan_mod, name)
        monkeypatch.setattr(plan_mod, name, lambda *a, _r=real, _n=name, **k: decided.append(_n) or _r(*a, **k))
    for _ in range(2):
        calls.clear()
        out = T.run_transformer(model, inputs)
        assert torch.equal(out, ref)
        n = len(model.transformer_blocks)
        # cross-block: block i's FFN residual and block i+1's norm1 as one residual + norm op per stream
        handed = 2 * (n - 1) if cross_block else 0
        assert sorted(calls) == sorted(
            [("layer_norm_scale_shift", R.REFERENCE)] * (2 * n - handed)
            + [("bias_residual_layer_norm_scale_shift", R.REFERENCE)] * (2 * n + handed)
            + [("bias_gate_residual", R.REFERENCE)] * (2 * n - handed)), calls
    assert decided == []


def test_planned_kernel_mode_reaches_every_runner(monkeypatch, seed):
    """With the plan deciding kernels (forced here on CPU), every site runner and every FP8 quantization between
    sites is called in KERNEL mode, decided once; the spies run the references under it, so the output is the
    reference-planned patch's, bit for bit."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    T.fp8_quantize(model, T.transformer_inputs(model, seed=seed + 3))
    for b in model.transformer_blocks:  # in KERNEL mode norm1's input quantizer would run inside the kernel only
        for n in ("img_norm1", "txt_norm1"):
            getattr(b, n).input_quantizer.disable()
    inputs = T.transformer_inputs(model, seed=seed + 1)
    kw = dict(fp8_gemm=True, capabilities={"cpu"}, defer_bias=False, tuning=gating.Tuning(qk_fusion=False))
    qwen_absorb.patch(model, **kw)
    assert any(lp.fp8_gemm for p in _plans(model) for lp in p.linears.values())
    want = T.run_transformer(model, inputs)
    qwen_absorb.unpatch(model)
    calls: list = []
    _spy(monkeypatch, QI_OPS + list(BETWEEN), calls, as_mode=R.REFERENCE)
    monkeypatch.setattr(plan_mod, "_kernel_reasons", lambda device, options: [])
    qwen_absorb.patch(model, **kw)
    assert all(p.kernels and {sp.mode for sp in p.sites} == {R.KERNEL} for p in _plans(model))
    assert torch.equal(T.run_transformer(model, inputs), want)
    assert {m for _, m in calls} == {R.KERNEL}, calls
    assert set(QI_OPS) | {"quantize_fp8", "quantize_fp8_split"} == {n for n, _ in calls}, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("variant", ["default", "force_reference", "tuning"])
def test_patched_tiny_model_bit_identical(dtype, zero_cond_t, variant, seed):
    model = T.tiny_transformer(dtype=dtype, zero_cond_t=zero_cond_t, seed=seed)
    cases = [T.transformer_inputs(model, batch_size=2, seed=seed + 1),
             T.transformer_inputs(model, batch_size=1, masked_tail=0, seed=seed + 2, height=2, width=6)]
    refs = [T.run_transformer(model, c) for c in cases]
    kw = {"force_reference": {"force_reference": True},
          "tuning": {"tuning": gating.Tuning(qk_fusion=False, joint_outputs=False, lanes=frozenset())}}.get(variant, {})
    qwen_absorb.patch(model, **kw)
    assert all(sp.run is getattr(R, sp_row.op) for p in _plans(model)
               for sp, sp_row in zip(p.sites, QWENIMAGE.sites.values()))
    for c, r in zip(cases, refs):
        assert torch.equal(T.run_transformer(model, c), r)
    if zero_cond_t:  # modulate_index reached the fused sites (no per-call fallback)
        assert not any("modulate_index" in k for k in qwen_absorb.patch_report(model).runtime_fallbacks)
    qwen_absorb.unpatch(model)
    for c, r in zip(cases, refs):
        assert torch.equal(T.run_transformer(model, c), r)


def test_compiled_references_are_the_planned_runners(monkeypatch, seed):
    """kernels_under_compile=True: under torch.compile the fused sites trace their references (the same runners,
    REFERENCE mode); the output is the eager one."""
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    ref = T.run_transformer(model, inputs)
    calls: list = []
    _spy(monkeypatch, QI_OPS, calls)
    qwen_absorb.patch(model, kernels_under_compile=True, cuda_graph=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    with torch.no_grad():
        out = compiled(**inputs)[0]
    torch._dynamo.reset()
    assert torch.equal(out, ref)
    assert calls and {m for _, m in calls} == {R.REFERENCE}


# ---------------------------------------------------------------------------- Qwen-Image-2.1


def test_qwenimage21_sites_run_their_planned_runners(monkeypatch):
    from .qwenimage21_helpers import model_inputs, run, tiny_model  # noqa: PLC0415

    model = tiny_model(seed=3)
    inp = model_inputs(model, batch_size=2, cond=True, pad=1, seed=4, target=(2, 2))
    want = run(model, inp)
    calls: list = []
    spies = _spy(monkeypatch, QI21_OPS, calls)
    qwen_absorb.patch(model, cuda_graph=False)
    for blk in model.transformer_blocks:
        p = blk.__dict__["forward"].plan  # the Patched21Forward in the block's forward slot
        assert [sp.run for sp in p.sites] == [spies[s.op] for s in QWENIMAGE21.sites.values()]
        assert {sp.mode for sp in p.sites} == {R.REFERENCE}
    got = run(model, inp)
    assert torch.equal(got, want)
    n = len(model.transformer_blocks)
    assert sorted(calls) == sorted(
        [("layer_norm_scale", R.REFERENCE)] * n + [("tanh_gate_residual_layer_norm_scale", R.REFERENCE)] * n
        + [("swiglu", R.REFERENCE)] * n + [("tanh_gate_residual", R.REFERENCE)] * n), calls
