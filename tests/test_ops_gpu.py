"""GPU tests of the fused CUDA kernels against the eager diffusers expressions (run on the H200).

Outputs are poisoned (the caching allocator hands the kernels blocks pre-filled with NaN bits), so
an element the kernel did not write shows up as a NaN where eager has a number.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import qwen_absorb.ops as ops
from qwen_absorb.ops.fp8 import Fp8PerTensorQuant
from qwen_absorb.quant import norm_input_fp8

from .ops_helpers import (
    EPS,
    assert_bit_identical,
    check_graph_replay,
    check_side_stream,
    chunk_views,
    diffusers_layer_norm,
    diffusers_modulate,
    extreme_activations,
    ln_output_stats,
    make_index,
    make_mod_params,
    misaligned_activations,
    poison_allocator,
    qwen_image_chain,
    seeded_activations,
    skip_module_without_kernels,
)

pytestmark = pytest.mark.gpu
skip_module_without_kernels()

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
BS = [1, 2, 3]
LS = [0, 1, 7, 128, 4096, 4097]
DS = [8, 64, 3072, 3080, 5120]
STATS: list[dict] = []  # LayerNorm-output agreement per case, printed at the end of the session


def check_ln_output(name: str, got: torch.Tensor, want: torch.Tensor, dtype, B: int, L: int, D: int) -> None:
    """A LayerNorm-family output against eager: at least 99.9% bit-identical, at most 1 ulp apart
    (the agreement is recorded in STATS)."""
    s = ln_output_stats(got, want)
    STATS.append({"op": name, "dtype": str(dtype), "B": B, "L": L, "D": D, **s})
    assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, f"{name}: {s}"


def fp64_chain(h, attn, bias, mod1, mod2, index):
    """The same chain in float64 from the same (rounded) inputs: the accuracy yardstick."""
    d = lambda t: None if t is None else t.double()  # noqa: E731
    m1, g1 = diffusers_modulate(torch.nn.functional.layer_norm(d(h), (h.shape[-1],), eps=EPS), d(mod1), index)
    y = d(attn) + d(bias) if bias is not None else d(attn)
    h2 = d(h) + g1 * y
    m2, _ = diffusers_modulate(torch.nn.functional.layer_norm(h2, (h.shape[-1],), eps=EPS), d(mod2), index)
    return m1, h2, m2


def check_accuracy(fused, eager, ref64, what):
    """flash-attention's rule: fused error <= 2 x eager's own error + a tiny atol."""
    keep = torch.isfinite(ref64) & torch.isfinite(eager.double())
    if not keep.any():
        return
    e_err = (eager.double() - ref64)[keep].abs().max().item()
    f_err = (fused.double() - ref64)[keep].abs().max().item()
    assert f_err <= 2 * e_err + 1e-6, f"{what}: fused error {f_err} > 2 x eager error {e_err}"


def _cases():
    """Every (dtype, D, L) with B, bias, index and gate layout rotating through their values."""
    rnd = random.Random(0)
    for i, (dtype, D, L) in enumerate(itertools.product(DTYPES, DS, LS)):
        yield pytest.param(dtype, BS[i % 3], L, D, bool(i % 2), bool((i // 2) % 2), rnd.random() < 0.5,
                           id=f"{str(dtype)[6:]}-B{BS[i % 3]}-L{L}-D{D}-bias{i % 2}-idx{(i // 2) % 2}")


@pytest.mark.parametrize("dtype,B,L,D,with_bias,with_index,gate_3d", list(_cases()))
def test_ops_match_eager(dtype, B, L, D, with_bias, with_index, gate_3d):
    gen = torch.Generator(device=DEV).manual_seed(hash((B, L, D, str(dtype))) % 2**31)
    rows = 2 * B if with_index else B
    index = make_index(B, L, DEV, gen) if with_index else None
    h = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    attn = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    bias = torch.randn(D, generator=gen, device=DEV).to(dtype) if with_bias else None
    mod1 = make_mod_params(rows, D, dtype, DEV, gen)
    mod2 = make_mod_params(rows, D, dtype, DEV, gen)
    sh1, sc1, g1 = chunk_views(mod1, as_3d=gate_3d)
    sh2, sc2, g2 = chunk_views(mod2, as_3d=not gate_3d)

    # eager diffusers
    m1, gate1 = diffusers_modulate(diffusers_layer_norm(h), mod1, index)
    h2 = h + gate1 * ((attn + bias) if with_bias else attn)
    m2, gate2 = diffusers_modulate(diffusers_layer_norm(h2), mod2, index)
    h3 = h2 + gate2 * ((attn + bias) if with_bias else attn)

    nbytes = h.numel() * h.element_size()
    poison_allocator(nbytes)
    assert ops.layer_norm_scale_shift_not_supported_reasons(h, shift=sh1, scale=sc1, index=index) == []
    o1 = ops.layer_norm_scale_shift(h, shift=sh1, scale=sc1, eps=EPS, index=index)
    poison_allocator(nbytes)
    nr, o2 = ops.bias_residual_layer_norm_scale_shift(
        h, attn, bias=bias, gate=g1, shift=sh2, scale=sc2, eps=EPS, index=index
    )
    poison_allocator(nbytes)
    o3 = ops.bias_gate_residual(h2, attn, bias=bias, gate=g2, index=index)
    torch.cuda.synchronize()

    assert_bit_identical(nr, h2, "new_residual")
    assert_bit_identical(o3, h3, "bias_gate_residual")
    for name, got, want in (("layer_norm_scale_shift", o1, m1), ("modulated", o2, m2)):
        check_ln_output(name, got, want, dtype, B, L, D)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: unwritten or extra NaN"
    if L and D >= 64:
        ref_m1, _, ref_m2 = fp64_chain(h, attn, bias, mod1, mod2, index)
        check_accuracy(o1, m1, ref_m1, "layer_norm_scale_shift")
        check_accuracy(o2, m2, ref_m2, "modulated")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [512, 1024, 3072, 6144, 64, 3080])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_outputs_bit_identical_to_eager(dtype, D, with_bias):
    """Every LayerNorm output bit-identical to eager (test_ops_match_eager allows 0.1% at 1 ulp).

    D = 512 ... 6144 are full rows (every thread of the kernel holds NV slots: the variant with the
    reduction's counts folded at compile time and constant vector flags); 64 and 3080 are not."""
    gen = torch.Generator(device=DEV).manual_seed(D + with_bias)
    B, L = 2, 1000
    index = make_index(B, L, DEV, gen)
    h = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    attn = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    bias = torch.randn(D, generator=gen, device=DEV).to(dtype) if with_bias else None
    mod1, mod2 = (make_mod_params(2 * B, D, dtype, DEV, gen) for _ in range(2))
    sh1, sc1, g1 = chunk_views(mod1)
    sh2, sc2, _ = chunk_views(mod2, as_3d=False)
    m1, gate1 = diffusers_modulate(diffusers_layer_norm(h), mod1, index)
    h2 = h + gate1 * ((attn + bias) if with_bias else attn)
    m2, _ = diffusers_modulate(diffusers_layer_norm(h2), mod2, index)
    poison_allocator(h.numel() * h.element_size())
    o1 = ops.layer_norm_scale_shift(h, shift=sh1, scale=sc1, eps=EPS, index=index)
    poison_allocator(h.numel() * h.element_size())
    nr, o2 = ops.bias_residual_layer_norm_scale_shift(h, attn, bias=bias, gate=g1, shift=sh2, scale=sc2, eps=EPS,
                                                      index=index)
    torch.cuda.synchronize()
    assert_bit_identical(nr, h2, "new_residual")
    assert_bit_identical(o1, m1, "layer_norm_scale_shift")
    assert_bit_identical(o2, m2, "bias_residual_layer_norm_scale_shift")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 2, 3, 5])
def test_misaligned_storage_offsets(dtype, offset):
    gen = torch.Generator(device=DEV).manual_seed(offset)
    B, L, D = 2, 37, 3072
    h, attn = misaligned_activations(B, L, D, dtype, DEV, gen, offset)
    bias = torch.randn(D + 8, generator=gen, device=DEV).to(dtype)[offset: offset + D]
    mod = make_mod_params(B, 2 * D, dtype, DEV, gen)[:, offset: offset + 3 * D]  # odd row offsets
    sh, sc, g = chunk_views(mod)
    m, gate = diffusers_modulate(diffusers_layer_norm(h), mod, None)
    h2 = h + gate * (attn + bias)
    m2, _ = diffusers_modulate(diffusers_layer_norm(h2), mod, None)
    poison_allocator(h.numel() * h.element_size())
    o1 = ops.layer_norm_scale_shift(h, shift=sh, scale=sc)
    nr, o2 = ops.bias_residual_layer_norm_scale_shift(h, attn, bias=bias, gate=g, shift=sh, scale=sc)
    o3 = ops.bias_gate_residual(h, attn, bias=bias, gate=g)
    assert_bit_identical(nr, h2, "new_residual")
    assert_bit_identical(o3, h2, "bias_gate_residual")
    for name, got, want in (("layer_norm_scale_shift(misaligned x)", o1, m), ("modulated(misaligned)", o2, m2)):
        check_ln_output(name, got, want, dtype, B, L, D)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_and_large_magnitudes(dtype):
    """NaN/Inf propagate like eager; large values exercise overflow and bf16 midpoint ties."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    B, L, D = 2, 64, 3072
    h, attn = extreme_activations(B, L, D, dtype, DEV, gen)
    mod = make_mod_params(B, D, dtype, DEV, gen, magnitude=3.0)
    sh, sc, g = chunk_views(mod)
    bias = torch.randn(D, generator=gen, device=DEV).to(dtype)
    m, gate = diffusers_modulate(diffusers_layer_norm(h), mod, None)
    h2 = h + gate * (attn + bias)
    m2, _ = diffusers_modulate(diffusers_layer_norm(h2), mod, None)
    o1 = ops.layer_norm_scale_shift(h, shift=sh, scale=sc)
    nr, o2 = ops.bias_residual_layer_norm_scale_shift(h, attn, bias=bias, gate=g, shift=sh, scale=sc)
    assert_bit_identical(nr, h2, "new_residual")
    assert_bit_identical(ops.bias_gate_residual(h, attn, bias=bias, gate=g), h2, "bias_gate_residual")
    for got, want in ((o1, m), (o2, m2)):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        s = ln_output_stats(got, want)
        assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_midpoint_ties_round_like_two_eager_roundings(dtype):
    """residual + gate * (x + bias) where rounding x + bias first creates an exact tie.

    With p the precision, x = 2^-p (half an ulp of 1) and bias = 2^-2p: x + bias needs p + 1 bits and
    ties to even (down to x); 1 + x then ties to even (down to 1). One fp32 evaluation rounded once
    gives 1 + ulp instead. Mixed with random values so most elements are ordinary.
    """
    p = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    D = 1024
    gen = torch.Generator(device=DEV).manual_seed(5)
    residual = torch.randn(1, 8, D, generator=gen, device=DEV).to(dtype)
    x = torch.randn(1, 8, D, generator=gen, device=DEV).to(dtype)
    bias = torch.randn(D, generator=gen, device=DEV).to(dtype)
    gate = torch.randn(1, D, generator=gen, device=DEV).to(dtype)
    tie = torch.arange(D, device=DEV) % 3 == 0
    residual[:, :, tie] = 1.0
    x[:, :, tie] = 2.0 ** -p
    bias[tie] = 2.0 ** (-2 * p)
    gate[:, tie] = 1.0
    want = residual + gate.unsqueeze(1) * (x + bias)
    assert bool((want[:, :, tie] == 1.0).all())
    got = ops.bias_gate_residual(residual, x, bias=bias, gate=gate)
    assert_bit_identical(got, want, "ties")
    single_rounding = (residual.float() + gate.float().unsqueeze(1) * (x.float() + bias.float())).to(dtype)
    assert not torch.equal(want, single_rounding), "test inputs do not exercise the double rounding"
    nr, _ = ops.bias_residual_layer_norm_scale_shift(residual, x, bias=bias, gate=gate, shift=gate, scale=gate)
    assert_bit_identical(nr, want, "ties (new_residual)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_norm_input_quant_matches_modelopt(dtype):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.nn import TensorQuantizer

    gen = torch.Generator(device=DEV).manual_seed(21)
    B, L, D = 2, 300, 3072
    h = (torch.randn(B, L, D, generator=gen, device=DEV) * 4).to(dtype)
    attn = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    bias = torch.randn(D, generator=gen, device=DEV).to(dtype)
    mod = make_mod_params(B, D, dtype, DEV, gen)
    sh, sc, g = chunk_views(mod)
    q = TensorQuantizer(mtq.config.QuantizerAttributeConfig(num_bits=(4, 3), axis=None)).to(DEV)
    q.amax = torch.tensor(9.5, device=DEV)
    h2 = h + g * (attn + bias)
    norm_in = q(h2)
    m2, _ = diffusers_modulate(diffusers_layer_norm(norm_in), mod, None)
    assert_bit_identical(norm_input_fp8(q)[0].reference(h2), norm_in, "fp8 reference")
    poison_allocator(h.numel() * h.element_size())
    nr, o2 = ops.bias_residual_layer_norm_scale_shift(
        h, attn, bias=bias, gate=g, shift=sh, scale=sc, norm_input_quant=norm_input_fp8(q)[0]
    )
    assert_bit_identical(nr, h2, "new_residual (never quantized)")
    check_ln_output("modulated(fp8 norm input)", o2, m2, dtype, B, L, D)
    # both ModelOpt formulas, explicitly
    for formula in ("cuda_ext", "eager"):
        fq = Fp8PerTensorQuant(q.amax, formula)
        want = diffusers_modulate(diffusers_layer_norm(fq.reference(h2)), mod, None)[0]
        got = ops.bias_residual_layer_norm_scale_shift(h, attn, bias=bias, gate=g, shift=sh, scale=sc, norm_input_quant=fq)[1]
        s = ln_output_stats(got, want)
        assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, (formula, s)


@pytest.mark.parametrize("D", [16384, 20000])
def test_wide_rows_streaming_variant(D):
    B, L = 1, 33
    gen, h, attn = seeded_activations(D, B, L, D, torch.bfloat16, DEV)
    mod = make_mod_params(B, D, torch.bfloat16, DEV, gen)
    sh, sc, g = chunk_views(mod)
    m, gate = diffusers_modulate(diffusers_layer_norm(h), mod, None)
    h2 = h + gate * attn
    m2, _ = diffusers_modulate(diffusers_layer_norm(h2), mod, None)
    nr, o2 = ops.bias_residual_layer_norm_scale_shift(h, attn, bias=None, gate=g, shift=sh, scale=sc)
    assert_bit_identical(nr, h2, "new_residual")
    assert_bit_identical(ops.bias_gate_residual(h, attn, bias=None, gate=g), h2, "bgr")
    for got, want in ((ops.layer_norm_scale_shift(h, shift=sh, scale=sc), m), (o2, m2)):
        s = ln_output_stats(got, want)
        assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, s


_chain = qwen_image_chain


def _chain_inputs(seed=0, B=2, L=200, D=3072):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(B, L, D, generator=gen, device=DEV).bfloat16()
    attn = torch.randn(B, L, D, generator=gen, device=DEV).bfloat16()
    bias = torch.randn(D, generator=gen, device=DEV).bfloat16()
    mod = make_mod_params(2 * B, 2 * D, torch.bfloat16, DEV, gen)
    return h, attn, bias, mod, make_index(B, L, DEV, gen)


def test_torch_compile_fullgraph_same_numbers():
    torch._dynamo.reset()
    compiled = torch.compile(_chain, fullgraph=True)
    args = _chain_inputs(1)
    for got, want in zip(compiled(*args), _chain(*args)):
        assert_bit_identical(got, want, "compiled")
    args = _chain_inputs(2)  # fresh inputs through the same compiled graph
    for got, want in zip(compiled(*args), _chain(*args)):
        assert_bit_identical(got, want, "compiled, second inputs")


def test_cuda_graph_capture_and_replay():
    check_graph_replay(_chain, _chain_inputs(3), _chain_inputs(4))


def test_launch_uses_current_stream():
    check_side_stream(_chain, _chain_inputs(5))


@pytest.fixture(scope="module", autouse=True)
def _layer_norm_agreement_summary():
    """Reports, at the end of the module, the LayerNorm-output agreement of the cases above (the
    checks themselves are in the tests)."""
    yield
    if not STATS:
        return
    worst = min(s["identical"] for s in STATS)
    exact = sum(s["identical"] == 1.0 for s in STATS)
    print(f"\nLN-output agreement: {exact}/{len(STATS)} cases bit-identical; worst identical share {worst:.6f}; "
          f"max ulp {max(s['max_ulp'] for s in STATS)}")
    for s in STATS:
        if s["identical"] < 1.0:
            print("  not bit-identical:", s)
