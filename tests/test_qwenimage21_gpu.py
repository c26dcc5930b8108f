"""GPU tests of Qwen-Image-2.1 support: the new kernels against their references (the eager torch
expressions, run on the same GPU) bit for bit, and the block runner on a tiny random
``QwenImage21Transformer2DModel`` patched == unpatched on CUDA.

Outputs are poisoned (the caching allocator hands the kernels blocks pre-filled with NaN bits), so
an element a kernel did not write shows up as a NaN where the reference has a number. Each
comparison prints what differs before it fails, so one run says which rounding point is off.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import qwen_absorb.ops as ops
from qwen_absorb import site_runners

from .ops_helpers import (
    bits,
    check_graph_replay,
    check_side_stream,
    extreme_activations,
    misaligned_activations,
    seeded_activations,
    skip_module_without_kernels,
)
from .ops_helpers import poison_allocator as poison
from .qwenimage21_helpers import fallback_counts, installed, model_inputs, run, run_kv, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]
skip_module_without_kernels()

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = 1e-6
SUMMARY: list[str] = []


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit-identical (NaN exactly where the reference has NaN); on failure, the first differences."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if got.dtype == torch.float8_e4m3fn:
        g, w = got.view(torch.uint8), want.view(torch.uint8)
        diff = g != w
    else:
        gn, wn = torch.isnan(got), torch.isnan(want)
        diff = (gn != wn) | ((bits(got) != bits(want)) & ~wn)
    n = int(diff.sum())
    if n:
        idx = diff.nonzero()[:5]
        rows = [(tuple(i.tolist()), got[tuple(i)].item() if got.dtype != torch.float8_e4m3fn else int(g[tuple(i)]),
                 want[tuple(i)].item() if want.dtype != torch.float8_e4m3fn else int(w[tuple(i)])) for i in idx]
        msg = f"{what}: {n} of {got.numel()} elements differ; first (index, kernel, reference): {rows}"
        SUMMARY.append(msg)
        print(msg)
    assert n == 0, what


def _rows(gen, rows, D, dtype, scale=2.0):
    """A [rows, 4D] shared modulation and its four [rows, D] chunks, sliced as diffusers slices it."""
    modulation = (torch.randn(rows, 4 * D, generator=gen, device=DEV) * scale).to(dtype)
    mod1, mod2 = modulation.chunk(2, dim=-1)
    s1, g1 = mod1.chunk(2, dim=-1)
    s2, g2 = mod2.chunk(2, dim=-1)
    return s1, g1, s2, g2


def _mask(gen, L):
    m = torch.rand(L, generator=gen, device=DEV) > 0.5
    if L > 2:
        m[-2:] = True  # the target image's tokens come last
    return m


def same_norm1(x, scale, mask, what: str) -> None:
    """layer_norm_scale == its reference."""
    same(ops.layer_norm_scale(x, scale=scale, target_token_mask=mask),
         ops.layer_norm_scale_reference(x, scale=scale, target_token_mask=mask), f"norm1 {what}")


def same_residual_ops(x, attn, gate, scale, ffn_gate, mask, what: str, clip: bool = False) -> torch.Tensor:
    """tanh_gate_residual_layer_norm_scale (gate, scale) and tanh_gate_residual (ffn_gate) == their
    references on the same inputs; returns the reference new_residual."""
    h, m = ops.tanh_gate_residual_layer_norm_scale(x, attn, gate=gate, scale=scale, target_token_mask=mask,
                                                   clip_fp16=clip)
    rh, rm = ops.tanh_gate_residual_layer_norm_scale_reference(x, attn, gate=gate, scale=scale,
                                                               target_token_mask=mask, clip_fp16=clip)
    same(h, rh, f"new_residual {what}")
    same(m, rm, f"modulated {what}")
    same(ops.tanh_gate_residual(x, attn, gate=ffn_gate, target_token_mask=mask, clip_fp16=clip),
         ops.tanh_gate_residual_reference(x, attn, gate=ffn_gate, target_token_mask=mask, clip_fp16=clip),
         f"residual {what}")
    return rh


# ---------------------------------------------------------------------------- elementwise functions


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_and_silu_match_torch(dtype):
    """Every bf16/fp16 value (fp32: 2^22 random values and specials) through the kernels' tanh and
    SiLU: tanh via residual -0 + tanh(gate) * 1 (exact: adds nothing, multiplies by one), SiLU via
    silu(a) * 1."""
    if dtype == torch.float32:
        gen = torch.Generator(device=DEV).manual_seed(0)
        n = 1 << 22
        v = torch.randn(n, generator=gen, device=DEV) * torch.exp(torch.randn(n, generator=gen, device=DEV) * 3)
        v[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40], device=DEV)
    else:
        v = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device=DEV).to(torch.int16).view(dtype)
    # CuPy compiles every kernel with -ftz=true (appended unconditionally by its NVRTC wrapper): fp32
    # subnormals flush to zero inside the kernels, so subnormal inputs (bf16's and fp32's, |x| < 2^-126;
    # fp16 subnormals are normal fp32 values) and subnormal results are left out here. A documented
    # limitation of every qwen_absorb kernel (README, Limitations); all other values must match exactly.
    tiny = torch.finfo(torch.float32).tiny
    v = v[~((v.float().abs() < tiny) & (v != 0))]
    v = v[~((torch.nn.functional.silu(v.float()).abs() < tiny) & (v != 0))]
    D = v.numel()
    x = torch.ones(1, 1, D, dtype=dtype, device=DEV)
    r = torch.full((1, 1, D), -0.0, dtype=dtype, device=DEV)
    gate = v.reshape(1, D)
    got = ops.tanh_gate_residual(r, x, gate=gate)
    same(got, ops.tanh_gate_residual_reference(r, x, gate=gate), f"tanh {dtype}")
    same(got.reshape(D), torch.tanh(v), f"tanh {dtype} vs torch.tanh")
    a = v.reshape(1, 1, D)
    same(ops.swiglu(a, x), torch.nn.functional.silu(a), f"silu {dtype}")


# ---------------------------------------------------------------------------- the ops


def _cases():
    Ds = [13, 20, 64, 100, 3072, 3080, 4096, 5120]
    Ls = [0, 1, 7, 33, 1000]
    for i, (dtype, D, L) in enumerate(itertools.product(DTYPES, Ds, Ls)):
        B = 1 + i % 2
        with_mask = bool((i // 2) % 2) or B == 2
        yield pytest.param(dtype, B, L, D, with_mask, id=f"{str(dtype)[6:]}-B{B}-L{L}-D{D}-mask{int(with_mask)}")
    yield pytest.param(torch.bfloat16, 2, 4097, 4096, True, id="bfloat16-B2-L4097-D4096-mask1")
    yield pytest.param(torch.float16, 1, 4097, 3072, False, id="float16-B1-L4097-D3072-mask0")


@pytest.mark.parametrize("dtype,B,L,D,with_mask", list(_cases()))
def test_ops_match_references(dtype, B, L, D, with_mask):
    gen = torch.Generator(device=DEV).manual_seed(hash((B, L, D, str(dtype))) % 2**31)
    mask = _mask(gen, L) if with_mask else None
    s1, g1, s2, g2 = _rows(gen, B + 1 if with_mask else B, D, dtype)
    x = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    attn = torch.randn(B, L, D, generator=gen, device=DEV).to(dtype)
    mlp = (torch.randn(B, L, D, generator=gen, device=DEV) * 3).to(dtype)
    a = (torch.randn(B, L, 3 * D, generator=gen, device=DEV) * 3).to(dtype)
    b = torch.randn(B, L, 3 * D, generator=gen, device=DEV).to(dtype)
    amax = torch.tensor(7.25, device=DEV)
    nbytes = 3 * x.numel() * 4

    assert ops.layer_norm_scale_not_supported_reasons(x, scale=s1, target_token_mask=mask) == []
    poison(nbytes)
    same(ops.layer_norm_scale(x, scale=s1, eps=EPS, target_token_mask=mask),
         ops.layer_norm_scale_reference(x, scale=s1, eps=EPS, target_token_mask=mask), "layer_norm_scale")
    for clip in (False, True):
        poison(nbytes)
        h, m2 = ops.tanh_gate_residual_layer_norm_scale(x, attn, gate=g1, scale=s2, eps=EPS, target_token_mask=mask,
                                                        clip_fp16=clip)
        rh, rm2 = ops.tanh_gate_residual_layer_norm_scale_reference(x, attn, gate=g1, scale=s2, eps=EPS,
                                                                     target_token_mask=mask, clip_fp16=clip)
        same(h, rh, f"new_residual clip={clip}")
        same(m2, rm2, f"modulated clip={clip}")
        poison(nbytes)
        same(ops.tanh_gate_residual(rh, mlp, gate=g2, target_token_mask=mask, clip_fp16=clip),
             ops.tanh_gate_residual_reference(rh, mlp, gate=g2, target_token_mask=mask, clip_fp16=clip),
             f"tanh_gate_residual clip={clip}")
    poison(nbytes * 3)
    same(ops.swiglu(a, b), ops.swiglu_reference(a, b), "swiglu")

    # FP8 emission: codes bit-identical to the reference quantizer of the reference output
    poison(nbytes * 3)
    codes, out = ops.swiglu_fp8(a, b, fp8_amax=amax, also_output=(L % 2 == 1))
    ro = ops.swiglu_reference(a, b)
    rc = ops.quantize_fp8_reference(ro, amax)
    same(codes, rc, "swiglu fp8 codes")
    if out is not None:
        same(out, ro, "swiglu fp8 output")
    codes, out = ops.layer_norm_scale_fp8(x, scale=s1, fp8_amax=amax, eps=EPS, target_token_mask=mask,
                                          also_output=True)
    ro = ops.layer_norm_scale_reference(x, scale=s1, eps=EPS, target_token_mask=mask)
    rc = ops.quantize_fp8_reference(ro, amax)
    same(codes, rc, "layer_norm_scale fp8 codes")
    same(out, ro, "layer_norm_scale fp8 output")
    h, codes, none = ops.tanh_gate_residual_layer_norm_scale_fp8(x, attn, gate=g1, scale=s2, fp8_amax=amax, eps=EPS,
                                                                 target_token_mask=mask)
    rh, rm2 = ops.tanh_gate_residual_layer_norm_scale_reference(x, attn, gate=g1, scale=s2, eps=EPS,
                                                                 target_token_mask=mask)
    assert none is None
    same(h, rh, "tanh_gate_residual_layer_norm_scale_fp8 new_residual")
    same(codes, ops.quantize_fp8_reference(rm2, amax), "tanh_gate_residual_layer_norm_scale fp8 codes")
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [1, 3])
def test_misaligned_and_strided_inputs(dtype, offset):
    """A misaligned x (PyTorch's rowwise LayerNorm path for norm1), misaligned modulation rows, the
    strided slice of the cached KV mode, and a swiglu tail that is not a whole vector."""
    gen = torch.Generator(device=DEV).manual_seed(offset)
    B, L, D = 2, 37, 3072
    x, attn = misaligned_activations(B, L, D, dtype, DEV, gen, offset)
    big = (torch.randn(B + 1, 4 * D + 8, generator=gen, device=DEV) * 2).to(dtype)[:, offset: offset + 4 * D]
    mod1, mod2 = big.chunk(2, dim=-1)
    s1, g1 = mod1.chunk(2, dim=-1)
    s2, g2 = mod2.chunk(2, dim=-1)
    mask = _mask(gen, L)
    same_norm1(x, s1, mask, "(misaligned x)")
    same_residual_ops(x, attn, g1, s2, g2, mask, "(misaligned)")
    # the cached KV mode: the target tokens of a longer sequence (a strided view), a mask of all True
    full = torch.randn(B, L + 20, D, generator=gen, device=DEV).to(dtype)
    xs = full[:, 20:]
    ms = torch.ones(L, dtype=torch.bool, device=DEV)
    same_norm1(xs, s1, ms, "(strided)")
    same(ops.tanh_gate_residual(xs, attn, gate=g2, target_token_mask=ms),
         ops.tanh_gate_residual_reference(xs, attn, gate=g2, target_token_mask=ms), "residual (strided)")
    n = 7 * 39 * 3
    a = torch.randn(n + 8, generator=gen, device=DEV).to(dtype)[offset: offset + n].view(1, 7, 117)
    b = torch.randn(1, 7, 117, generator=gen, device=DEV).to(dtype)
    same(ops.swiglu(a, b), ops.swiglu_reference(a, b), "swiglu (misaligned, tail)")
    codes, _ = ops.swiglu_fp8(a, b, fp8_amax=torch.tensor(2.0, device=DEV))
    same(codes, ops.quantize_fp8_reference(ops.swiglu_reference(a, b), torch.tensor(2.0, device=DEV)),
         "swiglu fp8 (misaligned, tail)")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_overflow_and_fp16_clip(dtype):
    gen = torch.Generator(device=DEV).manual_seed(11)
    B, L, D = 2, 64, 3072
    x, attn = extreme_activations(B, L, D, dtype, DEV, gen)
    s1, g1, s2, g2 = _rows(gen, B + 1, D, dtype, scale=4.0)
    g1[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")], device=DEV).to(dtype)
    mask = _mask(gen, L)
    for clip in (False, True):
        rh = same_residual_ops(x, attn, g1, s2, g1, mask, f"clip={clip}", clip=clip)
    if dtype == torch.float16:
        assert torch.isinf(rh).sum() == 0 and torch.isinf(ops.tanh_gate_residual_reference(
            x, attn, gate=g1, target_token_mask=mask)).sum() > 0, "inputs do not exercise the clip"
    same_norm1(x, s1, mask, "")
    same(ops.swiglu(x, attn), ops.swiglu_reference(x, attn), "swiglu")


@pytest.mark.parametrize("D", [16384, 20000])
def test_wide_rows_streaming_variant(D):
    B, L = 2, 9
    gen, x, attn = seeded_activations(D, B, L, D, torch.bfloat16, DEV)
    s1, g1, s2, _ = _rows(gen, B + 1, D, torch.bfloat16)
    mask = _mask(gen, L)
    same_norm1(x, s1, mask, "(wide)")
    same_residual_ops(x, attn, g1, s2, g1, mask, "(wide)")


def _chain(x, attn, a, b, modulation, mask):
    mod1, mod2 = modulation.chunk(2, dim=-1)
    s1, g1 = mod1.chunk(2, dim=-1)
    s2, g2 = mod2.chunk(2, dim=-1)
    m1 = ops.layer_norm_scale(x, scale=s1, target_token_mask=mask)
    h, m2 = ops.tanh_gate_residual_layer_norm_scale(x, attn, gate=g1, scale=s2, target_token_mask=mask)
    y = ops.swiglu(a, b)
    return m1, m2, y, ops.tanh_gate_residual(h, attn, gate=g2, target_token_mask=mask, clip_fp16=True)


def _chain_inputs(seed, B=2, L=200, D=3072):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(B, L, D, generator=gen, device=DEV).bfloat16()
    attn = torch.randn(B, L, D, generator=gen, device=DEV).bfloat16()
    a = torch.randn(B, L, 3 * D, generator=gen, device=DEV).bfloat16()
    b = torch.randn(B, L, 3 * D, generator=gen, device=DEV).bfloat16()
    modulation = torch.randn(B + 1, 4 * D, generator=gen, device=DEV).bfloat16()
    return x, attn, a, b, modulation, _mask(gen, L)


def test_torch_compile_fullgraph_same_numbers():
    torch._dynamo.reset()
    compiled = torch.compile(_chain, fullgraph=True)
    for seed in (1, 2):  # fresh inputs through the same compiled graph
        args = _chain_inputs(seed)
        for i, (got, want) in enumerate(zip(compiled(*args), _chain(*args))):
            same(got, want, f"compiled output {i} (seed {seed})")


def test_cuda_graph_capture_and_replay():
    check_graph_replay(_chain, _chain_inputs(3), _chain_inputs(4))


def test_launch_uses_current_stream():
    check_side_stream(_chain, _chain_inputs(5))


# ---------------------------------------------------------------------------- the patched tiny model


@pytest.fixture
def launches(monkeypatch):
    """Counts the runner's kernel launches per op (proves the kernels, not the references, ran)."""
    counts = {}
    for name in ("ln_scale_launch", "tgrln_launch", "tgr_launch", "swiglu_launch"):
        fn = getattr(site_runners, name)

        def wrapped(*a, _fn=fn, _name=name, **k):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*a, **k)

        monkeypatch.setattr(site_runners, name, wrapped)
    return counts


MODEL_SHAPES = {
    "D32": dict(heads=2, head_dim=16, axes=(4, 6, 6)),
    "D100": dict(heads=5, head_dim=20, axes=(4, 8, 8)),  # D % 8 != 0: element-wise residual path
    "D128": dict(heads=4, head_dim=32, axes=(8, 12, 12)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(MODEL_SHAPES))
def test_patched_tiny_model_bit_identical(dtype, shape, launches):
    model = tiny_model(dtype=dtype, device=DEV, seed=7, gain=4.0, **MODEL_SHAPES[shape])
    cases = {
        "text_target": model_inputs(model, batch_size=1, seed=1, target=(2, 6)),
        "condition_batch2_padded": model_inputs(model, batch_size=2, cond=True, pad=2, seed=2, target=(4, 3)),
    }
    refs = {k: run(model, v) for k, v in cases.items()}
    prefill = model_inputs(model, batch_size=2, cond=True, pad=1, seed=3, target=(2, 2), timestep=0.9)
    decode = model_inputs(model, batch_size=2, cond=True, pad=1, seed=3, target=(2, 2), timestep=0.4)
    ref_kv = run_kv(model, prefill, decode)
    with installed(model, DEV) as decisions:
        outs = {k: run(model, v) for k, v in cases.items()}
        out_kv = run_kv(model, prefill, decode)
    for k in cases:
        same(outs[k], refs[k], f"{shape} {dtype} {k}")
    same(out_kv[0], ref_kv[0], f"{shape} {dtype} kv extract")
    same(out_kv[1], ref_kv[1], f"{shape} {dtype} kv cached")
    assert all(d.kernels and [s.site for s in d.sites if s.runner == "kernel"]
               == ["norm1", "attn_residual", "norm2", "swiglu", "ffn_residual"]
               for d in decisions), [(d.kernel_reasons, [s.reasons for s in d.sites]) for d in decisions]
    assert fallback_counts(decisions, allowed=()) == {}
    calls = 4 * len(model.transformer_blocks)  # forward calls per block
    assert launches == {n: calls for n in ("ln_scale_launch", "tgrln_launch", "tgr_launch", "swiglu_launch")}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_patched_tiny_model_flex_processor(dtype, launches):
    model = tiny_model(dtype=dtype, device=DEV, seed=8, gain=4.0, flex=True)
    prefill = model_inputs(model, batch_size=2, cond=True, pad=2, seed=4, target=(2, 2), timestep=0.8)
    decode = model_inputs(model, batch_size=2, cond=True, pad=2, seed=4, target=(2, 2), timestep=0.3)
    ref = run_kv(model, prefill, decode)
    with installed(model, DEV) as decisions:
        out = run_kv(model, prefill, decode)
    same(out[0], ref[0], f"flex {dtype} extract")
    same(out[1], ref[1], f"flex {dtype} cached")
    assert fallback_counts(decisions, allowed=()) == {} and launches


@pytest.mark.parametrize("dtype", DTYPES)
def test_patched_tiny_model_without_causal_condition(dtype, launches):
    """causal_condition=False: no target_token_mask, B modulation rows (each token its sample's row)."""
    model = tiny_model(dtype=dtype, device=DEV, seed=10, gain=4.0, causal_condition=False, **MODEL_SHAPES["D128"])
    inputs = model_inputs(model, batch_size=2, cond=True, pad=2, seed=7, target=(4, 3))
    ref = run(model, inputs)
    with installed(model, DEV) as decisions:
        same(run(model, inputs), ref, f"causal_condition=False {dtype}")
    assert fallback_counts(decisions, allowed=()) == {} and launches["tgr_launch"] == len(model.transformer_blocks)


def test_patched_tiny_model_under_torch_compile():
    """torch.compile of the patched model (Dynamo traces the runner; the fused ops are custom ops
    that launch the kernels when the graph runs)."""
    model = tiny_model(dtype=torch.bfloat16, device=DEV, seed=9, gain=4.0, **MODEL_SHAPES["D128"])
    inputs = model_inputs(model, batch_size=2, cond=True, pad=1, seed=5, target=(2, 2))
    inputs2 = model_inputs(model, batch_size=2, cond=True, pad=1, seed=6, target=(2, 2))
    ref, ref2 = run(model, inputs), run(model, inputs2)
    with installed(model, DEV):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="eager")
        same(run(compiled, inputs), ref, "compiled patched model")
        same(run(compiled, inputs2), ref2, "compiled patched model, new inputs")
    torch._dynamo.reset()


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    print(f"\n[qwenimage21 gpu] {len(SUMMARY)} comparisons differed")
    for line in SUMMARY:
        print("  ", line)
