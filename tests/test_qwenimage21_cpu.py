"""CPU tests of Qwen-Image-2.1 support: the new ops' references against diffusers' eager
expressions (bit for bit, fresh random inputs), their validation, and the block runner on a tiny
random ``QwenImage21Transformer2DModel`` (patched == unpatched, bit for bit).

On CPU the runner runs the ops' torch references, so these tests pin down the runner's structure
(argument order, per-token rows, the fp16 clip, attention and KV cache untouched, fallbacks); the
kernels are checked against the same references on the GPU (tests/test_qwenimage21_gpu.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21SwiGLUFeedForward,
    QwenImage21TransformerBlock,
    _select_modulation_rows,
)

import qwen_absorb.ops as ops
from qwen_absorb import qwenimage21
from qwen_absorb.plan import BlockPlan, decide

from .ops_helpers import assert_bit_identical
from .qwenimage21_helpers import fallback_counts, installed, model_inputs, run, run_kv, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


# ---------------------------------------------------------------------------- the ops


def _block_inputs(gen, B, L, D, dtype, with_mask, magnitude=1.0):
    rows = B + 1 if with_mask else B
    x = torch.randn(B, L, D, generator=gen).to(dtype)
    attn = (torch.randn(B, L, D, generator=gen) * magnitude).to(dtype)
    mlp = (torch.randn(B, L, D, generator=gen) * magnitude).to(dtype)
    modulation = (torch.randn(rows, 4 * D, generator=gen) * 2).to(dtype)  # the shared [rows, 4D] tensor
    mask = (torch.rand(L, generator=gen) > 0.5) if with_mask else None
    return x, attn, mlp, modulation, mask


def _diffusers_chain(x, attn, mlp_out, modulation, mask):
    """QwenImage21TransformerBlock.forward's elementwise math, literally (its own _modulate)."""
    ln = torch.nn.LayerNorm(x.shape[-1], elementwise_affine=False, eps=EPS)
    mod1, mod2 = modulation.chunk(2, dim=-1)
    m1, g1 = QwenImage21TransformerBlock._modulate(None, ln(x), mod1, mask)
    h = x + g1.tanh() * attn
    m2, g2 = QwenImage21TransformerBlock._modulate(None, ln(h), mod2, mask)
    h3 = h + g2.tanh() * mlp_out
    if h3.dtype == torch.float16:
        h3 = h3.clip(-65504, 65504)
    return m1, h, m2, h3


def _chunks(modulation):
    mod1, mod2 = modulation.chunk(2, dim=-1)
    s1, g1 = mod1.chunk(2, dim=-1)
    s2, g2 = mod2.chunk(2, dim=-1)
    return s1, g1, s2, g2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [False, True])
def test_op_references_equal_diffusers(dtype, with_mask, seed):
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    B = 2 if with_mask else rnd.choice([1, 2])
    L, D = rnd.choice([1, 7, 33]), rnd.choice([8, 13, 64])
    x, attn, mlp_out, modulation, mask = _block_inputs(gen, B, L, D, dtype, with_mask)
    m1, h, m2, h3 = _diffusers_chain(x, attn, mlp_out, modulation, mask)
    s1, g1, s2, g2 = _chunks(modulation)

    assert_bit_identical(ops.layer_norm_scale(x, scale=s1, eps=EPS, target_token_mask=mask), m1, "norm1")
    nh, nm = ops.tanh_gate_residual_layer_norm_scale(x, attn, gate=g1, scale=s2, eps=EPS, target_token_mask=mask)
    assert_bit_identical(nh, h, "attn residual")
    assert_bit_identical(nm, m2, "norm2")
    out = ops.tanh_gate_residual(h, mlp_out, gate=g2, target_token_mask=mask, clip_fp16=True)
    assert_bit_identical(out, h3, "ffn residual")
    # the cross-block form: FFN residual (clipped) + the next block's norm1
    nh3, nm3 = ops.tanh_gate_residual_layer_norm_scale(h, mlp_out, gate=g2, scale=s1, eps=EPS, target_token_mask=mask,
                                                       clip_fp16=True)
    assert_bit_identical(nh3, h3, "ffn residual (cross-block)")
    next_m1, _ = QwenImage21TransformerBlock._modulate(
        None, torch.nn.functional.layer_norm(h3, (D,), eps=EPS), modulation.chunk(2, dim=-1)[0], mask)
    assert_bit_identical(nm3, next_m1, "next norm1 (cross-block)")

    a = torch.randn(B, L, 3 * D, generator=gen).to(dtype) * 3
    b = torch.randn(B, L, 3 * D, generator=gen).to(dtype)
    ffn = QwenImage21SwiGLUFeedForward(D, 3 * D)
    assert_bit_identical(ops.swiglu(a, b), ffn.activation_fn(a) * b, "swiglu")
    amax = torch.tensor(rnd.uniform(0.5, 20.0))
    codes, o = ops.swiglu_fp8(a, b, fp8_amax=amax, also_output=True)
    assert_bit_identical(o, ffn.activation_fn(a) * b, "swiglu_fp8 output")
    assert torch.equal(codes.view(torch.uint8), ops.quantize_fp8_reference(o, amax).view(torch.uint8))
    codes, none = ops.layer_norm_scale_fp8(x, scale=s1, fp8_amax=amax, eps=EPS, target_token_mask=mask)
    assert none is None and torch.equal(codes.view(torch.uint8), ops.quantize_fp8_reference(m1, amax).view(torch.uint8))
    nh, codes, nm = ops.tanh_gate_residual_layer_norm_scale_fp8(
        x, attn, gate=g1, scale=s2, fp8_amax=amax, eps=EPS, target_token_mask=mask, also_output=True)
    assert_bit_identical(nm, m2, "norm2 (fp8 variant)")
    assert torch.equal(codes.view(torch.uint8), ops.quantize_fp8_reference(m2, amax).view(torch.uint8))


def test_select_rows_is_diffusers_where():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(3, 8, generator=gen).bfloat16()
    mask = torch.tensor([False, True, True, False, True])
    from qwen_absorb.ops._target_rows import select_rows

    assert torch.equal(select_rows(p, mask), _select_modulation_rows(p, mask))
    assert torch.equal(select_rows(p[:2], None), _select_modulation_rows(p[:2], None))
    # what the kernels' row choice means: target tokens -> their sample's row, the others -> the last row
    sel = select_rows(p, mask)
    for b in range(2):
        for i, m in enumerate(mask.tolist()):
            assert torch.equal(sel[b, i], p[b] if m else p[2])


def test_fp16_clip_and_rounding_points():
    """The fp16 clip is applied (inf -> 65504, NaN stays), and tanh/1+scale are rounded in the dtype."""
    h = torch.tensor([[[60000.0, -60000.0, float("nan"), 1.0]]], dtype=torch.float16)
    y = torch.tensor([[[60000.0, -60000.0, 1.0, 1.0]]], dtype=torch.float16)
    g = torch.full((1, 4), 5.0, dtype=torch.float16)
    out = ops.tanh_gate_residual(h, y, gate=g, clip_fp16=True)
    assert out[0, 0, 0].item() == 65504 and out[0, 0, 1].item() == -65504 and out[0, 0, 2].isnan()
    assert torch.isinf(ops.tanh_gate_residual(h, y, gate=g)).sum() == 2  # without the clip: overflow
    bf = torch.randn(2, 64, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    gate = torch.randn(2, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    eager = ops.tanh_gate_residual(bf, bf, gate=gate)
    one_rounding = (bf.float() + gate.float().tanh()[:, None] * bf.float()).bfloat16()
    assert not torch.equal(eager, one_rounding)


def _args():
    x = torch.randn(2, 3, 8)
    return x, torch.randn(2, 8), torch.tensor([True, False, True])


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda x, p, m: ops.layer_norm_scale(x[0], scale=p), ValueError, "x must have shape"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=p, target_token_mask=m), ValueError, r"B \+ 1 rows"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=torch.randn(3, 8), target_token_mask=m.long()), TypeError,
         "must be a bool"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=torch.randn(3, 8), target_token_mask=m[:2]), ValueError,
         r"shape \[L\]"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=p.bfloat16()), TypeError, "scale has dtype"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=p.unsqueeze(1)), ValueError, "scale must have shape"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=torch.randn(8, 2).t()), ValueError, "stride 1"),
        (lambda x, p, m: ops.layer_norm_scale(x, scale=p, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda x, p, m: ops.tanh_gate_residual(x, x[:, :2], gate=p), ValueError, "residual has shape"),
        (lambda x, p, m: ops.tanh_gate_residual(x, x, gate=p, clip_fp16=1), TypeError, "clip_fp16 must be a bool"),
        (lambda x, p, m: ops.tanh_gate_residual_layer_norm_scale(x, x.double(), gate=p, scale=p), TypeError,
         "x has dtype"),
        (lambda x, p, m: ops.tanh_gate_residual_layer_norm_scale(x, x, gate=p, scale=p[:1]), ValueError,
         "scale must have shape"),
        (lambda x, p, m: ops.swiglu(x, x[:, :2]), ValueError, "b has shape"),
        (lambda x, p, m: ops.swiglu(x, x.bfloat16()), TypeError, "b has dtype"),
        (lambda x, p, m: ops.swiglu(x.int(), x.int()), TypeError, "a has dtype"),
        (lambda x, p, m: ops.swiglu_fp8(x, x, fp8_amax=torch.ones(2)), ValueError, "fp8_amax"),
        (lambda x, p, m: ops.swiglu([1.0], x), TypeError, "a must be a torch.Tensor"),
    ],
)
def test_validation_errors_name_the_argument(call, exc, match):
    x, p, m = _args()
    with pytest.raises(exc, match=match):
        call(x, p, m)


def test_not_supported_reasons_are_data(monkeypatch):
    x, p, m = _args()
    assert "cpu" in ops.layer_norm_scale_not_supported_reasons(x, scale=p)[0]
    r = ops.swiglu_not_supported_reasons(x, x, force_reference=True)
    assert any("forced" in s for s in r)
    r = ops.tanh_gate_residual_not_supported_reasons(x.clone().requires_grad_(), x, gate=p)
    assert any("autograd" in s for s in r)
    r = ops.tanh_gate_residual_layer_norm_scale_not_supported_reasons(x, x, gate=p, scale=p)
    assert r and not any("autograd" in s for s in r)
    assert len(ops.all_kernel_expressions()) > 300


def test_custom_ops_compile_fullgraph_on_cpu():
    gen = torch.Generator().manual_seed(5)
    B, L, D = 2, 9, 32
    x, attn, mlp_out, modulation, mask = _block_inputs(gen, B, L, D, torch.bfloat16, True)
    a = torch.randn(B, L, 3 * D, generator=gen).bfloat16()

    def chain(x, attn, a, modulation, mask):
        s1, g1, s2, g2 = _chunks(modulation)
        m1 = ops.layer_norm_scale(x, scale=s1, target_token_mask=mask)
        h, m2 = ops.tanh_gate_residual_layer_norm_scale(x, attn, gate=g1, scale=s2, target_token_mask=mask)
        y = ops.swiglu(a, a)
        return m1, m2, ops.tanh_gate_residual(h, attn, gate=g2, target_token_mask=mask, clip_fp16=True), y

    torch._dynamo.reset()
    compiled = torch.compile(chain, fullgraph=True, backend="eager")
    for got, want in zip(compiled(x, attn, a, modulation, mask), chain(x, attn, a, modulation, mask)):
        assert_bit_identical(got, want, "compiled chain")


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 16, dtype=torch.bfloat16)
        p = torch.empty(3, 16, dtype=torch.bfloat16)
        m = torch.empty(5, dtype=torch.bool)
        out = torch.ops.qwen_absorb.tanh_gate_residual_layer_norm_scale(x, x, p, p, 1e-6, m, True, torch.empty(1))
        assert [tuple(t.shape) for t in out] == [(2, 5, 16), (2, 5, 16), (2, 5, 16)]
        assert out[2].dtype == torch.float8_e4m3fn
        out = torch.ops.qwen_absorb.layer_norm_scale(x, p, 1e-6, m, None)
        assert tuple(out[1].shape) == (0,)
        assert tuple(torch.ops.qwen_absorb.swiglu(x, x, None)[0].shape) == (2, 5, 16)


# ---------------------------------------------------------------------------- the block runner


@pytest.fixture(scope="module")
def models():
    return {dtype: tiny_model(dtype=dtype, seed=11, gain=4.0) for dtype in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["text_target", "condition_batch2_padded"])
def test_runner_equals_unpatched(models, dtype, case, seed):
    model = models[dtype]
    if case == "text_target":
        inputs = model_inputs(model, batch_size=1, seed=seed, target=(2, 6))
    else:
        inputs = model_inputs(model, batch_size=2, cond=True, pad=2, seed=seed, target=(2, 2))
    ref = run(model, inputs)
    with installed(model, "cpu") as decisions:
        out = run(model, inputs)
    assert_bit_identical(out, ref, f"{case} {dtype}")
    assert all(_fused(d) == ("norm1", "attn_residual", "norm2", "swiglu", "ffn_residual") for d in decisions)
    assert all(not d.kernels and any("cpu" in r for r in d.kernel_reasons) for d in decisions)
    assert fallback_counts(decisions) == {}
    assert all(d.rt.counter for d in decisions)  # every block ran the fused path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runner_without_causal_condition(dtype, seed):
    """causal_condition=False: every token modulates from its own sample's row (no mask, B rows)."""
    model = tiny_model(dtype=dtype, seed=seed % 1000, gain=4.0, causal_condition=False)
    inputs = model_inputs(model, batch_size=2, cond=True, pad=1, seed=seed)
    ref = run(model, inputs)
    with installed(model, "cpu") as decisions:
        assert_bit_identical(run(model, inputs), ref, "causal_condition=False")
    assert fallback_counts(decisions) == {} and all(d.rt.counter for d in decisions)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,flex", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                        (torch.float32, True)])
def test_runner_kv_cache_extract_then_cached(dtype, flex, seed):
    model = tiny_model(dtype=dtype, seed=seed % 1000, flex=flex, gain=4.0)
    prefill = model_inputs(model, batch_size=2, cond=True, pad=1, seed=seed, target=(2, 2), timestep=0.9)
    decode = model_inputs(model, batch_size=2, cond=True, pad=1, seed=seed, target=(2, 2), timestep=0.4)
    ref_a, ref_b = run_kv(model, prefill, decode)
    with installed(model, "cpu") as decisions:
        out_a, out_b = run_kv(model, prefill, decode)
        plain = run(model, decode)  # no cache: the whole sequence
    assert_bit_identical(out_a, ref_a, "extract")
    assert_bit_identical(out_b, ref_b, "cached")
    assert_bit_identical(plain, run(model, decode), "no cache")
    assert fallback_counts(decisions) == {}


def test_runner_falls_back_with_reasons(models, seed):
    model = models[torch.float32]
    inputs = model_inputs(model, batch_size=2, cond=True, pad=1, seed=seed)
    ref = run(model, inputs)
    with installed(model, "cpu") as decisions:
        with torch.enable_grad():
            out = model(**inputs, return_dict=False)[0]
        assert_bit_identical(out.detach(), ref, "grad enabled")
        assert any("grad enabled" in k for k in fallback_counts(decisions))
        # a hook added after deciding: that site runs its module, counted
        h = model.transformer_blocks[0].img_norm2.register_forward_hook(lambda m, a, o: None)
        try:
            assert_bit_identical(run(model, inputs), ref, "hook added later")
        finally:
            h.remove()
        assert any("img_norm2 changed or hooked" in k for k in fallback_counts(decisions))
        g = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
        try:
            assert_bit_identical(run(model, inputs), ref, "global hook")
        finally:
            g.remove()
        assert any("global module forward hook" in k for k in fallback_counts(decisions))


def test_decide_names_what_it_cannot_fuse(models, seed):
    model = tiny_model(dtype=torch.bfloat16, seed=3)
    blocks = model.transformer_blocks
    D = blocks[0].img_norm1.normalized_shape[0]
    blocks[0].img_norm1 = torch.nn.LayerNorm(D, eps=1e-6).bfloat16()  # affine
    with torch.no_grad():
        blocks[0].img_norm1.weight.uniform_(0.5, 1.5)
    blocks[1].img_mlp.register_forward_pre_hook(lambda m, a: None)
    blocks[1].img_norm2.register_forward_hook(lambda m, a, o: None)
    inputs = model_inputs(model, batch_size=2, cond=True, pad=2, seed=seed)
    ref = run(model, inputs)
    with installed(model, "cpu") as (d0, d1):
        out = run(model, inputs)
    assert_bit_identical(out, ref, "partially fused")
    assert _fused(d0) == ("attn_residual", "norm2", "swiglu", "ffn_residual")
    assert any("img_norm1" in r and "affine" in r for r in d0.site("img", "norm1").reasons)
    assert _fused(d1) == ("norm1", "attn_residual", "ffn_residual")
    assert any("img_mlp has a hook" in r for r in d1.site("img", "swiglu").reasons)
    assert any("img_norm2" in r and "hook" in r for r in d1.site("img", "norm2").reasons)
    assert fallback_counts([d0, d1]) == {}

    del blocks[0]._modules["attn"]  # no attention: the block runs diffusers' forward (which then fails)
    other = BlockPlan(index=0)
    decide(other, blocks[0], torch.device("cpu"))
    assert other.reasons and _fused(other) == () and "no attn module" in other.reasons[0]


def test_runner_per_call_arguments_diffusers_would_broadcast(models, seed):
    """Arguments the fused ops do not take run diffusers' forward (same result, same errors)."""
    model = models[torch.float32]
    block = model.transformer_blocks[0]
    d = BlockPlan(index=0)
    decide(d, block, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    D = block.img_norm1.normalized_shape[0]
    x = torch.randn(2, 5, D, generator=gen)
    mod = torch.randn(3, 4 * D, generator=gen)
    mask = torch.tensor([False, False, True, True, True])
    with torch.no_grad():
        got = qwenimage21.patched_forward(block, d, x, mod, None, None, mask)
        assert torch.equal(got, block(x, mod, None, None, mask))
        mod1 = torch.randn(1, 4 * D, generator=gen)  # one row broadcast over the batch
        assert torch.equal(qwenimage21.patched_forward(block, d, x, mod1), block(x, mod1))
        with pytest.raises(RuntimeError):  # a non-bool mask: diffusers' torch.where raises, and so do we
            qwenimage21.patched_forward(block, d, x, mod, None, None, mask.long())
    assert any("broadcast" in k for k in d.rt.counter)


def test_plan_is_plain_data(models):
    """A 2.1 block's plan pickles and deep-copies (a patched model must), its counts with it."""
    import copy
    import pickle

    block = models[torch.bfloat16].transformer_blocks[0]
    d = BlockPlan(index=0)
    decide(d, block, torch.device("cpu"))
    d.rt.counter["example"] += 1
    for c in (copy.deepcopy(d), pickle.loads(pickle.dumps(d))):
        assert _fused(c) == _fused(d) and c.rt.counter == {"example": 1} and c.qk_reasons == d.qk_reasons


def _fused(plan) -> tuple:
    return tuple(s.site for s in plan.sites if s.fused)
