"""GPU tests of the real FP8 path: emitted e4m3 codes, the FP8 GEMMs, patched ModelOpt FP8 models.

The promise: every code an FP8-emitting op writes is bit-identical to "the op's own output in the
tensor dtype, then the reference quantizer" (:func:`qwen_absorb.ops.quantize_fp8_reference`).
Outputs are poisoned first, so an unwritten element shows up.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
import qwen_absorb.ops as ops
from . import builders as T
from qwen_absorb.ops import _runtime
from qwen_absorb.ops.quantize_fp8 import launch as qf8_launch

from .ops_helpers import chunk_views, ln_output_stats, make_index, make_mod_params

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

DEV = "cuda"
FP8_OK = torch.cuda.get_device_capability() >= (8, 9)


def poison(nbytes: int) -> None:
    blocks = [torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=DEV).fill_(0xFF) for _ in range(3)]
    del blocks


def assert_same_codes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same e4m3 bytes; NaN codes (0x7f / 0xff) must sit at the same places (their sign may differ)."""
    assert got.dtype == want.dtype == torch.float8_e4m3fn and got.shape == want.shape, what
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    gn, wn = (g & 0x7F) == 0x7F, (w & 0x7F) == 0x7F
    assert torch.equal(gn, wn), f"{what}: NaN codes at different places ({int((gn != wn).sum())})"
    bad = (g != w) & ~wn
    assert not bad.any(), f"{what}: {int(bad.sum())} of {g.numel()} codes differ"


def _x(shape, dtype, gen, scale=3.0):
    x = (torch.randn(*shape, generator=gen, device=DEV) * scale).to(dtype)
    flat = x.view(-1)
    if flat.numel() >= 6:  # specials and saturation
        flat[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e4, -1e4, 0.0], device=DEV).to(dtype)
    return x


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,L,D", [(1, 4096, 3072), (2, 77, 3072), (1, 5, 64), (2, 3, 40)])
def test_layer_norm_scale_shift_fp8_codes(dtype, B, L, D):
    gen = torch.Generator(device=DEV).manual_seed(B * L + D)
    x = _x((B, L, D), dtype, gen)
    mod = make_mod_params(2 * B, D, dtype, DEV, gen)
    sh, sc, _ = chunk_views(mod)
    index = make_index(B, L, DEV, gen)
    amax = torch.tensor([5.5], device=DEV)
    poison(x.numel() * 4)
    codes, out = ops.layer_norm_scale_shift_fp8(x, shift=sh, scale=sc, fp8_amax=amax, index=index, also_output=True)
    assert_same_codes(codes, ops.quantize_fp8_reference(out, amax), "lnss codes vs own output")
    want = ops.layer_norm_scale_shift_reference(x, shift=sh, scale=sc, index=index)
    s = ln_output_stats(out, want)
    assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, s
    codes_only, none = ops.layer_norm_scale_shift_fp8(x, shift=sh, scale=sc, fp8_amax=amax, index=index)
    assert none is None
    assert_same_codes(codes_only, codes, "codes without the dtype output")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_quant", [False, True])
def test_bias_residual_layer_norm_scale_shift_fp8_codes(dtype, with_quant):
    gen = torch.Generator(device=DEV).manual_seed(7 + with_quant)
    B, L, D = 2, 300, 3072
    h = _x((B, L, D), dtype, gen)
    y = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    bias = torch.randn(D, generator=gen, device=DEV).to(dtype)
    mod = make_mod_params(B, D, dtype, DEV, gen)
    sh, sc, g = chunk_views(mod)
    nq = ops.Fp8PerTensorQuant(torch.tensor(9.5, device=DEV), "cuda_ext") if with_quant else None
    amax = torch.tensor([7.25], device=DEV)
    poison(h.numel() * 4)
    h2, codes, out = ops.bias_residual_layer_norm_scale_shift_fp8(
        h, y, bias=bias, gate=g, shift=sh, scale=sc, fp8_amax=amax, norm_input_quant=nq, also_output=True)
    rh, ro = ops.bias_residual_layer_norm_scale_shift_reference(h, y, bias=bias, gate=g, shift=sh, scale=sc,
                                                                  norm_input_quant=nq)
    assert torch.equal(h2.isnan(), rh.isnan()) and torch.equal(h2[~rh.isnan()], rh[~rh.isnan()])
    assert_same_codes(codes, ops.quantize_fp8_reference(out, amax), "brln codes vs own output")
    s = ln_output_stats(out, ro)
    assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 4096, 12288), (2, 33, 3072), (1, 7, 40)])
def test_quantize_fp8_and_gelu(dtype, shape):
    gen = torch.Generator(device=DEV).manual_seed(sum(shape))
    x = _x(shape, dtype, gen)
    amax = torch.tensor([11.0], device=DEV)
    assert_same_codes(ops.quantize_fp8(x, amax), ops.quantize_fp8_reference(x, amax), "identity")
    _, codes, act = qf8_launch(x, 0, None, amax, "gelu_tanh", act_out=True)
    assert_same_codes(codes, ops.quantize_fp8_reference(act, amax), "gelu codes vs own output")
    want = torch.nn.functional.gelu(x, approximate="tanh")
    s = ln_output_stats(act, want)
    print(f"GELU(tanh) {dtype} {shape}: identical share {s['identical']:.6f}, max ulp {s['max_ulp']}")
    assert s["identical"] >= 0.999 and s["max_ulp"] <= 1, s
    codes_ref = ops.quantize_fp8_reference(want, amax)
    same = (codes.view(torch.uint8) == codes_ref.view(torch.uint8)).float().mean().item()
    assert same >= 0.9999, same


def test_quantize_fp8_split_strided_attention_layout():
    gen = torch.Generator(device=DEV).manual_seed(3)
    B, S, H, DH, split = 2, 130, 24, 128, 17
    base = torch.randn(B, H, S, DH, generator=gen, device=DEV).bfloat16()
    x = base.permute(0, 2, 1, 3)  # what the native attention backend returns: [B, S, H, DH], strided
    a1, a2 = torch.tensor([3.0], device=DEV), torch.tensor([5.0], device=DEV)
    ca, cb = ops.quantize_fp8_split(x, split, a1, a2)
    flat = x.flatten(2, 3)
    assert_same_codes(ca, ops.quantize_fp8_reference(flat[:, :split], a1), "text part")
    assert_same_codes(cb, ops.quantize_fp8_reference(flat[:, split:], a2), "image part")
    packed = x.contiguous()  # heads side by side: the row kernel skips its per-vector head index
    poison(packed.numel() * 4)
    ca, cb = ops.quantize_fp8_split(packed, split, a1, a2)
    assert_same_codes(ca, ops.quantize_fp8_reference(flat[:, :split], a1), "text part, packed heads")
    assert_same_codes(cb, ops.quantize_fp8_reference(flat[:, split:], a2), "image part, packed heads")
    misaligned = torch.randn(B * S * H * DH + 3, generator=gen, device=DEV).bfloat16()[3:].view(B, S, H * DH)
    ca, cb = ops.quantize_fp8_split(misaligned, split, a1, a2)
    assert_same_codes(cb, ops.quantize_fp8_reference(misaligned[:, split:], a2), "misaligned")


@pytest.mark.skipif(not FP8_OK, reason="FP8 GEMMs need sm_89+")
def test_scaled_mm_projection_matches_fp32_reference():
    from qwen_absorb.plan import BlockPlan, LinearPlan
    from qwen_absorb.projection import fp8_linear
    from qwen_absorb.quant import Fp8Weight

    gen = torch.Generator(device=DEV).manual_seed(5)
    M, K, N = 333, 3072, 1536
    w = torch.randn(N, K, generator=gen, device=DEV).bfloat16() * 0.02
    w_amax, in_amax = w.abs().max().float(), torch.tensor([4.0], device=DEV)
    x = torch.randn(1, M, K, generator=gen, device=DEV).bfloat16()
    weight = Fp8Weight(ops.quantize_fp8_reference(w, w_amax), ops.dequant_scale(w_amax), in_amax, False, torch.bfloat16)
    lp = LinearPlan("x", fp8_gemm=True, weight=weight, input_scale=ops.dequant_scale(in_amax),
                    bias=torch.randn(N, generator=gen, device=DEV).bfloat16())
    codes = ops.quantize_fp8(x, in_amax)
    got = fp8_linear(codes, lp, BlockPlan(0))
    want = ((codes.float() * lp.input_scale) @ (weight.codes.float() * weight.scale).t() + lp.bias.float()).bfloat16()
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert got.shape == (1, M, N) and rel < 4e-3, rel


# ---------------------------------------------------------------------------- patched models


def _fp8_model(seed=0, zero_cond_t=False, layers=2):
    model = T.tiny_transformer(dtype=torch.bfloat16, zero_cond_t=zero_cond_t, num_layers=layers, seed=seed).to(DEV)
    calib = [T.transformer_inputs(model, batch_size=2, seed=seed + 1)]
    calib = [{k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in c.items()} for c in calib]
    T.fp8_quantize(model, calib)
    return model


def _inputs(model, seed, batch_size=2, **kw):
    inp = T.transformer_inputs(model, batch_size=batch_size, seed=seed, **kw)
    return {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in inp.items()}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.skipif(not FP8_OK, reason="FP8 GEMMs need sm_89+")
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_patched_real_fp8_tiny_model(zero_cond_t):
    model = _fp8_model(seed=11, zero_cond_t=zero_cond_t)
    inp = _inputs(model, 12)
    fake = T.run_transformer(model, inp)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    report = qwen_absorb.patch(model, fp8_gemm=True)
    assert report.summary["fp8_gemm_linears"] == 28, str(report)
    assert report.summary["fp8_emitting_sites"] == 8
    real = T.run_transformer(model, inp)
    assert _rel(real, fake) < 0.03
    # block 0's FFN residual emitted block 1's norm1 FP8 codes (cross-block hand-off)
    assert report.summary["cross_block_handoffs_taken"] == 1, str(report)
    assert not any("cross-block" in r for r in report.runtime_fallbacks), report.runtime_fallbacks
    # without the hand-off: the same numbers
    qwen_absorb.patch(model, fp8_gemm=True, cross_block=False)
    assert torch.equal(T.run_transformer(model, inp), real)
    # kernels vs the references of the same path: the same codes, the same GEMMs
    qwen_absorb.patch(model, fp8_gemm=True, force_reference=True)
    ref_path = T.run_transformer(model, inp)
    assert _rel(real, ref_path) < 1e-3, _rel(real, ref_path)
    same = (real == ref_path).float().mean().item()
    print(f"real FP8, kernels vs references: {same:.6f} identical")
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inp), fake)
    sd2 = model.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)


@pytest.mark.skipif(not FP8_OK, reason="FP8 GEMMs need sm_89+")
def test_real_fp8_offload_original_weights_and_cuda_graph():
    model = _fp8_model(seed=21)
    inp = _inputs(model, 22, batch_size=1, masked_tail=0)  # diffusers' mask handling syncs: no mask in capture
    fake = T.run_transformer(model, inp)
    qwen_absorb.patch(model, fp8_gemm=True)
    real = T.run_transformer(model, inp)
    qwen_absorb.patch(model, fp8_gemm=True, offload_original_weights=True)
    assert model.transformer_blocks[0].attn.to_q.weight.device.type == "cpu"
    assert torch.equal(T.run_transformer(model, inp), real)
    # CUDA-graph capture of the patched FP8 call replays the same numbers
    with torch.inference_mode():
        model(**inp)
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            model(**inp)
            with torch.cuda.graph(g):
                out = model(**inp)[0]
        torch.cuda.current_stream().wait_stream(s)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, real)
    qwen_absorb.unpatch(model)
    assert model.transformer_blocks[0].attn.to_q.weight.device.type == "cuda"
    assert torch.equal(T.run_transformer(model, inp), fake)


@pytest.mark.skipif(not FP8_OK, reason="FP8 GEMMs need sm_89+")
@pytest.mark.parametrize("mode", ["auto", False])
def test_real_fp8_under_compile_repeated_blocks(mode):
    model = _fp8_model(seed=31)
    inp = _inputs(model, 32)
    qwen_absorb.patch(model, fp8_gemm=True, kernels_under_compile=mode)
    eager = T.run_transformer(model, inp)
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=mode == "auto")
    out = T.run_transformer(model, inp)
    if mode == "auto":
        # each patched block is one opaque op running the eager patched forward: its kernels, its bits
        assert torch.equal(out, eager), _rel(out, eager)
    else:
        # traced: Inductor fuses the elementwise chains without eager's intermediate roundings, which
        # flips some FP8 codes: compiled and eager agree to the FP8 path's own accuracy, not bit for bit.
        assert _rel(out, eager) < 0.03, _rel(out, eager)
    assert qwen_absorb.patch_report(model).summary["fp8_gemm_linears"] > 0
    torch._dynamo.reset()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_patched_model_on_second_gpu_while_first_is_current():
    """Issue 9 item 9: the launch must enter the tensor's device context."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=41).to("cuda:1")
    inp = {k: (v.to("cuda:1") if torch.is_tensor(v) else v) for k, v in T.transformer_inputs(model, seed=42).items()}
    ref = T.run_transformer(model, inp)
    torch.cuda.set_device(0)
    report = qwen_absorb.patch(model)
    assert report.kernels_available
    out = T.run_transformer(model, inp)
    assert torch.equal(out, ref)
    assert not any("reference" in r for r in report.runtime_fallbacks)


def test_patch_on_cpu_then_to_cuda_decides_for_cuda():
    """Issue 7: decisions follow the device the blocks run on."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=51)
    report = qwen_absorb.patch(model)
    assert not report.kernels_available and report.device == "cpu"
    model.to(DEV)
    inp = _inputs(model, 52)
    out = T.run_transformer(model, inp)
    assert report.kernels_available and report.device.startswith("cuda"), str(report)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inp), out)


def test_deepcopy_of_patched_gpu_model_is_independent():
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=61).to(DEV)
    inp = _inputs(model, 62)
    ref = T.run_transformer(model, inp)
    qwen_absorb.patch(model)
    twin = copy.deepcopy(model)
    assert torch.equal(T.run_transformer(twin, inp), ref)
    assert qwen_absorb.patch_report(twin) is not qwen_absorb.patch_report(model)


def test_fp8_model_with_leaf_group_offloading():
    """Issue 9 item 5: the fused path reads the norm quantizers' amax wherever offloading left it."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=71)
    calib = [T.transformer_inputs(model, batch_size=2, seed=72)]
    T.fp8_quantize(model.to(DEV), [{k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in c.items()} for c in calib])
    model.to("cpu")
    model.enable_group_offload(onload_device=torch.device(DEV), offload_device=torch.device("cpu"),
                               offload_type="leaf_level")
    inp = _inputs(model, 73)
    ref = T.run_transformer(model, inp)
    report = qwen_absorb.patch(model)
    out = T.run_transformer(model, inp)
    assert _rel(out, ref) < 0.03, _rel(out, ref)  # deferral (sm_90 validated) moves roundings only
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inp), ref)
    assert report.summary["blocks_patched"] == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_patched_bf16_head_dim_128_is_bit_identical(dtype):
    """A head_dim-128 model (the real geometry): the patched model, with the fused q/k RMSNorm + RoPE
    (on where the probed variance order matches), stays bit-identical to diffusers."""
    model = T.tiny_transformer(dtype=dtype, seed=81, attention_head_dim=128, num_attention_heads=2,
                               axes_dims_rope=(16, 56, 56)).to(DEV)
    inp = _inputs(model, 82, height=8, width=8, text_len=20)
    ref = T.run_transformer(model, inp)
    report = qwen_absorb.patch(model)
    assert report.summary["qk_norm_rope_fused_blocks"] == 2, str(report)
    out = T.run_transformer(model, inp)
    # block 0 hands block 1 its norm1 (bf16); fp16 blocks do not take part (diffusers clips the output)
    assert report.summary["cross_block_handoffs_taken"] == (1 if dtype == torch.bfloat16 else 0), str(report)
    same = (out == ref).float().mean().item()
    print(f"patched {dtype} head_dim 128 vs diffusers: {same:.6f} identical")
    assert torch.equal(out, ref)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inp), ref)
