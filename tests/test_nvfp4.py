"""NVFP4 on CPU: the fake-quantization reference against ModelOpt's own NVFP4 arithmetic, its edge policy,
and an NVFP4 linear run by qwen_absorb.nvfp4 against the ModelOpt linear itself (bit for bit)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from qwen_absorb import nvfp4  # noqa: E402
from . import builders as T  # noqa: E402
from qwen_absorb.hf_export import import_modelopt  # noqa: E402
from qwen_absorb.ops import quantize_nvfp4, quantize_nvfp4_reference  # noqa: E402
from qwen_absorb.ops.quantize_nvfp4 import INV_GLOBAL_DIVISOR  # noqa: E402


def _rand(shape, seed=0, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _modelopt_roundtrip(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's own NVFP4 arithmetic that runs on CPU: NVFP4QTensor.quantize then dequantize (its export)."""
    qt_mod = import_modelopt("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    s2 = amax.float() * INV_GLOBAL_DIVISOR  # the second-level scale as torch computes amax / 2688 on CUDA
    qt, scale, s2 = qt_mod.NVFP4QTensor.quantize(w.float(), 16, weights_scaling_factor_2=s2)
    return qt.dequantize(dtype=torch.float32, scale=scale, double_scale=s2, block_sizes={-1: 16}).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_equals_modelopt_nvfp4_arithmetic(dtype):
    # random rows whose blocks all have scales in e4m3's normal range (where ModelOpt's export and its
    # fake quantization agree by construction: no clamp, no 1e-5 floor)
    w = _rand((96, 256), seed=1, dtype=dtype)
    amax = w.float().abs().amax()
    ref = quantize_nvfp4_reference(w, amax)
    mo = _modelopt_roundtrip(w, amax)
    assert ref.dtype == dtype and ref.shape == w.shape
    assert torch.equal(ref, mo)
    assert not torch.equal(ref, w)  # it quantized something
    # idempotent on its own output (what lets a loaded export share its weight)
    assert torch.equal(quantize_nvfp4_reference(ref, amax), ref)


def test_reference_follows_the_triton_kernel_at_the_edges():
    x = _rand((3, 40), seed=2)  # D = 40: a partial last block (8 elements, zero-padded)
    amax = torch.tensor(4.0)
    x[0, :16] = 0.0  # a zero block: scale floor -> 1.0, zeros stay zeros
    x[1, 3] = float("nan")
    x[1, 20] = float("inf")
    x[2, 0] = -0.0
    x[2, 1] = -1e-3  # rounds to zero: +0, as Triton's 0 - v gives
    y = quantize_nvfp4_reference(x, amax)
    assert torch.equal(y[0, :16], torch.zeros(16, dtype=x.dtype))
    gs = 4.0 * INV_GLOBAL_DIVISOR
    # the NaN block: its max skips the NaN, the NaN itself becomes -6 * scale
    blk = x[1, :16].float()
    bmax = blk[~blk.isnan()].abs().max()
    s = torch.tensor(float(bmax) / (6 * gs)).clamp(max=448).to(torch.float8_e4m3fn).float() * gs
    assert y[1, 3].item() == pytest.approx(-6 * float(s), rel=1e-2)
    # the inf block saturates its scale to 448 * gs and inf to 6 * scale
    assert y[1, 20].item() == pytest.approx(6 * 448 * gs, rel=1e-2)
    assert not torch.signbit(y[2, :2].float()).any() and (y[2, :2] == 0).all()
    # a partial block is the zero-padded block's first elements
    padded = torch.nn.functional.pad(x.float(), (0, 8)).to(x.dtype)
    assert torch.equal(quantize_nvfp4_reference(padded, amax)[:, :40], y)


def test_public_op_runs_the_reference_on_cpu_and_checks_inputs():
    x = _rand((2, 5, 64), seed=3)
    amax = x.float().abs().amax()
    assert torch.equal(quantize_nvfp4(x, amax), quantize_nvfp4_reference(x, amax))
    assert quantize_nvfp4.__module__.endswith("quantize_nvfp4")
    with pytest.raises(ValueError):
        quantize_nvfp4(x, torch.ones(2))
    with pytest.raises(TypeError):
        quantize_nvfp4(x.to(torch.int32), amax)


def _nvfp4_model(num_layers=4, dtype=torch.bfloat16, seed=0):
    from qwen_absorb import modelopt_recipe as recipe  # noqa: PLC0415

    model = T.tiny_transformer(num_layers=num_layers, dtype=dtype, seed=seed)
    inputs = T.transformer_inputs(model)
    recipe.quantize(model, recipe.nvfp4_recipe_config(model, keep_first=1, keep_last=1),
                    lambda m: T.run_transformer(m, inputs))
    return model, inputs


def test_modelopt_nvfp4_model_runs_on_cpu_with_the_reference_kernel():
    model, inputs = _nvfp4_model()
    names = nvfp4.nvfp4_linear_names(model)
    assert names and all(n.startswith(("transformer_blocks.1.", "transformer_blocks.2.")) for n in names)
    with pytest.raises(AssertionError):  # ModelOpt alone has no CPU NVFP4 path
        T.run_transformer(model, inputs)
    with nvfp4.modelopt_fake_quant_on_cpu():
        y = T.run_transformer(model, inputs)
    assert torch.isfinite(y).all()
    with pytest.raises(AssertionError):  # restored afterwards
        T.run_transformer(model, inputs)


def test_nvfp4_linear_is_bit_identical_to_the_modelopt_linear():
    model, _ = _nvfp4_model()
    modules = dict(model.named_modules())
    g = torch.Generator().manual_seed(5)
    for name in nvfp4.nvfp4_linear_names(model):
        lin = modules[name]
        x = (torch.randn(2, 9, lin.in_features, generator=g) * 2).bfloat16()
        with nvfp4.modelopt_fake_quant_on_cpu(), torch.no_grad():
            want = lin(x)
            runner = nvfp4.Nvfp4Linear(lin, use_kernel=False)
            got = runner(x)
        assert torch.equal(got, want), name
        assert not runner.shares_weight and runner.extra_bytes() == lin.weight.numel() * 2  # bf16 originals
        # the weight is remade when it changes, not before
        w0 = runner.weight()
        assert runner.weight() is w0
        with torch.no_grad():
            lin.weight.mul_(1.5)
        with nvfp4.modelopt_fake_quant_on_cpu(), torch.no_grad():
            assert torch.equal(runner(x), lin(x))
        assert runner.weight() is not w0


def test_nvfp4_linear_refuses_what_it_does_not_reproduce():
    model, _ = _nvfp4_model()
    lin = model.transformer_blocks[0].attn.to_q  # a kept (bf16) block
    assert nvfp4.nvfp4_linear_reasons(lin)
    with pytest.raises(ValueError, match="not a ModelOpt W4A4 NVFP4 linear"):
        nvfp4.Nvfp4Linear(lin, use_kernel=False)
    fp8 = copy.deepcopy(model.transformer_blocks[1].attn.to_q)
    fp8.input_quantizer.disable()
    assert any("input quantizer" in r for r in nvfp4.nvfp4_linear_reasons(fp8))


def test_patched_nvfp4_model_is_bit_identical_to_modelopt_and_follows_weight_changes():
    import qwen_absorb  # noqa: PLC0415

    model, inputs = _nvfp4_model()
    with nvfp4.modelopt_fake_quant_on_cpu():
        want = T.run_transformer(model, inputs)
    qwen_absorb.patch(model, capabilities={"cpu"})
    try:
        plan = getattr(model.transformer_blocks[1], "_qwen_absorb_plan")
        # every NVFP4 linear of the block has a runner, and reads its input from the op that produces it (NVFP4 rows)
        assert {n for n, m in model.transformer_blocks[1].named_modules() if m in plan.nvfp4} >= {
            "attn.to_q", "attn.to_out.0", "attn.to_add_out", "img_mod.1", "txt_mod.1", "img_mlp.net.2"}
        assert all(lp.quant == "nvfp4" for lp in plan.linears.values())
        # their projections keep their biases in the GEMM (deferral would round differently from ModelOpt)
        block1 = model.transformer_blocks[1]
        runs = [sp for sp in plan.sites if sp.projection and block1.get_submodule(sp.projection) in plan.nvfp4]
        assert runs and all(not sp.bias_deferred and "NVFP4 runner" in sp.defer_reasons[0] for sp in runs)
        got = T.run_transformer(model, inputs)  # no ModelOpt NVFP4 call: it would fail on CPU
        assert torch.equal(got, want)
        with torch.no_grad():  # a weight edited after patch: the plan's watch remakes the fake-quantized weight
            model.transformer_blocks[1].txt_mlp.net[2].weight.mul_(-1)
        with nvfp4.modelopt_fake_quant_on_cpu():
            qwen_absorb.unpatch(model)
            want2 = T.run_transformer(model, inputs)
            qwen_absorb.patch(model, capabilities={"cpu"})
        with torch.no_grad():
            model.transformer_blocks[1].txt_mlp.net[2].weight.mul_(-1)
        assert torch.equal(T.run_transformer(model, inputs), want)
        with torch.no_grad():
            model.transformer_blocks[1].txt_mlp.net[2].weight.mul_(-1)
        assert torch.equal(T.run_transformer(model, inputs), want2)
    finally:
        qwen_absorb.unpatch(model)
    assert not torch.equal(want2, want)
