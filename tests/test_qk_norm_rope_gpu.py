"""GPU tests of qk_norm_rope (q/k RMSNorm + RoPE, one kernel) against the diffusers eager chain.

The promise: bit-identical to eager wherever the kernel runs. The fp32 variance order PyTorch uses
is probed once per device (qk_norm_rope.probe_variance_order); the probed order is emulated here in
torch (fp32 adds in the kernel's order), so the order claim is measured directly on the tests' own
inputs. Shares are printed (run with -s). Outputs are poisoned first, so an unwritten element shows up.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage as tq

import qwen_absorb.ops as ops
from qwen_absorb.ops import _runtime

from .ops_helpers import assert_bit_identical, bits, check_graph_replay, check_side_stream, ln_output_stats

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
    pytest.skip(
        f"needs CUDA and CuPy ({_runtime.cupy_unavailable_reason() if torch.cuda.is_available() else 'no CUDA'})",
        allow_module_level=True,
    )

qkr = importlib.import_module("qwen_absorb.ops.qk_norm_rope")  # the package attribute is the function
DEV = "cuda"
DH = 128
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 4096, 24), (2, 77, 24), (1, 1, 1), (3, 5, 7), (2, 3, 1), (1, 17, 3)]
STATS: list[tuple[str, dict]] = []


def poison_allocator(nbytes: int) -> None:
    """Fill the next cached blocks with 0xFF (NaN in every float dtype) and give them back."""
    blocks = [torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=DEV).fill_(0xFF) for _ in range(3)]
    del blocks


def _freqs(L, gen):
    return torch.polar(torch.ones(L, DH // 2, device=DEV), torch.randn(L, DH // 2, generator=gen, device=DEV) * 20)


def _inputs(B, L, H, dtype, gen, scale=3.0):
    x = (torch.randn(B, L, H, DH, generator=gen, device=DEV) * scale + 0.2).to(dtype)
    if x.numel() > 4 * DH:  # a few rows of very different magnitude
        x.view(-1, DH)[1] *= 300
        x.view(-1, DH)[2] *= 1e-3
    w = (torch.randn(DH, generator=gen, device=DEV) * 0.4 + 1).to(dtype)
    return x, w, _freqs(L, gen)


def torch_variance(x):
    """What diffusers' RMSNorm computes on the GPU: [rows] fp32."""
    return x.to(torch.float32).pow(2).mean(-1).reshape(-1)


def probed():
    vo = qkr.probe_variance_order(torch.device(DEV))
    print(f"[qk_norm_rope] probed variance order: {vo}")
    assert vo.order is not None, vo.detail
    return vo


def kernel_order_variance(x):
    """The kernel's variance for the probed order, in torch (bit for bit the kernel's)."""
    return qkr.variance_in_order(x.reshape(-1, DH), probed().order)


def check(got, want, what, x=None, exact_rows=True):
    """The contract (>= 99.9% identical, <= 1 ulp, NaN where eager has NaN), and, given x,
    bit-identity on every row whose variance the kernel order reproduces."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    assert got.is_contiguous(), what
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ ({int((gn != wn).sum())})"
    s = ln_output_stats(got, want)
    if x is not None:
        match = bits(kernel_order_variance(x)) == bits(torch_variance(x))
        s["variance_rows_identical"] = match.float().mean().item() if match.numel() else 1.0
        if exact_rows and match.numel():
            rows_same = ((bits(got) == bits(want)) | wn).reshape(-1, DH).all(-1)
            bad = int((match & ~rows_same).sum())
            assert bad == 0, f"{what}: {bad} rows differ although their variance matches torch's"
    STATS.append((what, s))
    print(f"[qk_norm_rope] {what}: {s}")
    assert s["identical"] == 1.0 and s["max_ulp"] == 0, (what, s)


# ---------------------------------------------------------------------------- the claims


@pytest.mark.parametrize("dtype", DTYPES)
def test_variance_order_is_pytorchs(dtype):
    """The reduction-order claim itself: the probed order == torch's .pow(2).mean(-1), row by row,
    on inputs the probe never saw (from the probed row count on)."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    for B, L, H in SHAPES:
        x, _, _ = _inputs(B, L, H, dtype, gen)
        if B * L * H < probed().min_rows:
            continue
        same = (bits(kernel_order_variance(x)) == bits(torch_variance(x))).float().mean().item()
        print(f"[qk_norm_rope] variance order {dtype} {(B, L, H)}: identical rows {same}")
        assert same == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,L,H", SHAPES)
def test_kernel_matches_diffusers(dtype, B, L, H):
    gen = torch.Generator(device=DEV).manual_seed(B * 1000 + L + H)
    x, w, f = _inputs(B, L, H, dtype, gen)
    reasons = ops.qk_norm_rope_not_supported_reasons(x, w, f)
    if B * L * H < probed().min_rows:
        assert len(reasons) == 1 and "rows <" in reasons[0], reasons
    else:
        assert reasons == []
    want = ops.qk_norm_rope_reference(x, w, f, 1e-6)
    poison_allocator(x.numel() * x.element_size())
    got = ops.qk_norm_rope(x, w, f)
    check(got, want, f"{dtype} {(B, L, H)}", x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offset", [0, 1])
def test_column_slice_of_fused_qkv(dtype, offset):
    """x = a column slice of a fused [B, L, 3 * H * DH] projection (row stride 3 * H * DH);
    offset 1 misaligns it (scalar loads)."""
    gen = torch.Generator(device=DEV).manual_seed(21 + offset)
    B, L, H = 2, 333, 24
    D = H * DH
    qkv = (torch.randn(B, L, 3 * D + 8, generator=gen, device=DEV) * 2).to(dtype)
    w = (torch.randn(DH, generator=gen, device=DEV) * 0.4 + 1).to(dtype)
    f = _freqs(L, gen)
    for part in range(3):
        x = qkv[..., offset + part * D: offset + (part + 1) * D].unflatten(-1, (-1, DH))
        assert not x.is_contiguous()
        want = ops.qk_norm_rope_reference(x, w, f)
        poison_allocator(x.numel() * 2)
        got = ops.qk_norm_rope(x, w, f)
        check(got, want, f"slice {dtype} offset {offset} part {part}", x)


def test_multi_launch_whole_block():
    """A block's four tensors in one launch, with QwenEmbedRope's own freqs (text freqs are a row
    slice of its table) and separate RMSNorm weights."""
    gen = torch.Generator(device=DEV).manual_seed(31)
    rope = tq.QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    Lt = 77
    img_f, txt_f = rope([(1, 32, 48)], device=torch.device(DEV), max_txt_seq_len=Lt)
    Li = img_f.shape[0]
    B, H = 2, 24
    xs = [(torch.randn(B, L, H, DH, generator=gen, device=DEV) * 2).bfloat16() for L in (Li, Li, Lt, Lt)]
    ws = [(torch.randn(DH, generator=gen, device=DEV) * 0.3 + 1).bfloat16() for _ in range(4)]
    fs = [img_f, img_f, txt_f, txt_f]
    poison_allocator(sum(x.numel() for x in xs) * 2)
    outs = ops.qk_norm_rope_multi(xs, ws, fs, eps=1e-6)
    launched = qkr.launch(xs, ws, fs, [1e-6] * 4)
    for i, (x, w, f, o, o2) in enumerate(zip(xs, ws, fs, outs, launched)):
        want = ops.qk_norm_rope_reference(x, w, f)
        check(o, want, f"multi[{i}]", x)
        assert_bit_identical(o2, o, f"launch[{i}] == multi[{i}]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_inf_inputs(dtype):
    gen = torch.Generator(device=DEV).manual_seed(41)
    x, w, f = _inputs(2, 9, 5, dtype, gen)
    rows = x.view(-1, DH)
    big = torch.finfo(dtype).max
    rows[0, 3] = float("nan")
    rows[1, 0] = float("inf")
    rows[2, 5] = -float("inf")
    rows[3, 7] = big  # its square overflows fp32 only for fp32 inputs
    rows[4].zero_()  # var = 0: rsqrt(eps)
    rows[5, :] = big
    want = ops.qk_norm_rope_reference(x, w, f)
    poison_allocator(x.numel() * 4)
    got = ops.qk_norm_rope(x, w, f)
    assert_bit_identical(got, want, f"specials {dtype}")  # NaN positions included


@pytest.mark.parametrize("order", sorted(qkr.ORDERS))
def test_every_kernel_order_matches_its_emulation(order, monkeypatch):
    """Each ORDER instance of the kernel sums the squares exactly as variance_in_order says (so the
    probe's pick is the kernel's behaviour, whichever order a PyTorch version uses)."""
    idx = torch.cuda.current_device()
    monkeypatch.setitem(qkr._orders, idx, qkr.VarianceOrder(order, 1, "forced by the test"))
    monkeypatch.setattr(qkr, "_fns", {})
    gen = torch.Generator(device=DEV).manual_seed(70 + order)
    B, L, H = 1, 300, 8
    x = torch.randn(B, L, H, DH, generator=gen, device=DEV) * torch.exp(torch.randn(B, L, H, DH, generator=gen, device=DEV))
    w = torch.randn(DH, generator=gen, device=DEV) * 0.3 + 1
    f = _freqs(L, gen)
    var = qkr.variance_in_order(x, order)[..., None]
    want = qkr.rope_reference((x * torch.rsqrt(var + 1e-6)) * w, f)
    poison_allocator(x.numel() * 4)
    got, = qkr.launch([x], [w], [f], [1e-6])
    assert_bit_identical(got, want, f"order {order}")


# ---------------------------------------------------------------------------- the FMA grouping


def test_complex_multiply_grouping_probe():
    """Which grouping of (a+bi)(c+di) reproduces PyTorch's complex<float> multiply: compiles the
    kernel with QA_QKR_CMUL 0/1/2 and prints each one's identical share on fp32 inputs (where a
    last-bit difference shows). Grouping 0 (the default, read off torch's SASS) must be exact."""
    gen = torch.Generator(device=DEV).manual_seed(51)
    x, w, f = _inputs(1, 2048, 24, torch.float32, gen)
    want = ops.qk_norm_rope_reference(x, w, f)
    shares = {}
    try:
        for mode in (0, 1, 2):
            _runtime.set_defines({"QA_QKR_CMUL": mode})
            got = ops.qk_norm_rope(x, w, f)
            shares[mode] = ln_output_stats(got, want)["identical"]
    finally:
        _runtime.set_defines(None)
    print(f"[qk_norm_rope] complex multiply grouping, identical share (fp32): {shares}")
    assert shares[0] == max(shares.values()) and shares[0] == 1.0, shares


# ---------------------------------------------------------------------------- fallbacks, plumbing


def test_mixed_dtype_weight_runs_the_reference():
    gen = torch.Generator(device=DEV).manual_seed(61)
    x, w, f = _inputs(1, 64, 4, torch.bfloat16, gen)
    assert any("weight dtype" in r for r in ops.qk_norm_rope_not_supported_reasons(x, w.float(), f))
    got = ops.qk_norm_rope(x, w.float(), f)
    assert_bit_identical(got, ops.qk_norm_rope_reference(x, w.float(), f), "fp32 weight")


def _chain(xi, ki, wq, wk, fi, xt, kt, wqt, wkt, ft):
    a = ops.qk_norm_rope(xi, wq, fi)
    b = ops.qk_norm_rope_multi([ki, xt, kt], [wk, wqt, wkt], [fi, ft, ft])
    return (a, *b)


def _chain_inputs(seed, Li=1024, Lt=77, B=2, H=24):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    t = lambda L: (torch.randn(B, L, H, DH, generator=gen, device=DEV) * 2).bfloat16()  # noqa: E731
    wt = lambda: (torch.randn(DH, generator=gen, device=DEV) * 0.3 + 1).bfloat16()  # noqa: E731
    return (t(Li), t(Li), wt(), wt(), _freqs(Li, gen), t(Lt), t(Lt), wt(), wt(), _freqs(Lt, gen))


def test_torch_compile_fullgraph_same_numbers():
    torch._dynamo.reset()
    compiled = torch.compile(_chain, fullgraph=True)
    for seed in (1, 2):  # fresh inputs through the same compiled graph
        args = _chain_inputs(seed)
        for got, want in zip(compiled(*args), _chain(*args)):
            assert_bit_identical(got, want, f"compiled, inputs {seed}")


def test_cuda_graph_capture_and_replay():
    check_graph_replay(_chain, _chain_inputs(3), _chain_inputs(4))


def test_launch_uses_current_stream():
    check_side_stream(_chain, _chain_inputs(5))


def test_timing_print():
    """Informational: eager diffusers chain (4 tensors) vs one fused launch, device time per block."""
    args = _chain_inputs(6, Li=4096, Lt=512, B=1)
    xs, ws = [args[0], args[1], args[5], args[6]], [args[2], args[3], args[7], args[8]]
    fs = [args[4], args[4], args[9], args[9]]

    def eager():
        return [qkr.qk_norm_rope_reference(x, w, f) for x, w, f in zip(xs, ws, fs)]

    def fused():
        return qkr.launch(xs, ws, fs, [1e-6] * 4)

    def time(fn, n=50):
        for _ in range(3):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / n * 1000

    print(f"[qk_norm_rope] per block (img 4096 + txt 512 tokens, 24 heads): eager {time(eager):.1f} us, "
          f"fused {time(fused):.1f} us")


@pytest.fixture(scope="module", autouse=True)
def _summary():
    yield
    if STATS:
        worst = min(s["identical"] for _, s in STATS)
        rows = min(s.get("variance_rows_identical", 1.0) for _, s in STATS)
        print(f"\n[qk_norm_rope] {len(STATS)} cases: worst identical share {worst}, "
              f"worst variance-row agreement {rows}, max ulp {max(s['max_ulp'] for _, s in STATS)}")
