"""CPU tests of qk_norm_rope: the reference IS diffusers' q/k RMSNorm + apply_rotary_emb_qwen, the
public op's validation, reasons and dispatch, the custom op (fake shapes, torch.compile), and the
launcher's host-side packing (with a recording stand-in for the kernel)."""

from __future__ import annotations

import importlib
import struct

import pytest
import torch
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers import transformer_qwenimage as tq

import qwen_absorb.ops as ops

from .ops_helpers import assert_bit_identical

qkr = importlib.import_module("qwen_absorb.ops.qk_norm_rope")  # the package attribute is the function

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DH = 128


def _freqs(L, gen, dh=DH):
    return torch.polar(torch.ones(L, dh // 2), torch.randn(L, dh // 2, generator=gen) * 3)


def _inputs(B, L, H, dtype, gen, wdtype=None, dh=DH):
    x = (torch.randn(B, L, H, dh, generator=gen) * 2 + 0.3).to(dtype)
    w = (torch.randn(dh, generator=gen) * 0.5 + 1).to(wdtype or dtype)
    return x, w, _freqs(L, gen, dh)


def _diffusers(x, w, f, eps=1e-6):
    norm = RMSNorm(x.shape[-1], eps=eps, elementwise_affine=True)
    with torch.no_grad():
        norm.weight = torch.nn.Parameter(w.clone(), requires_grad=False)
        return tq.apply_rotary_emb_qwen(norm(x), f, use_real=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("wdtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 3), (1, 1, 1), (3, 5, 24)])
def test_reference_equals_diffusers_modules(dtype, wdtype, shape):
    gen = torch.Generator().manual_seed(sum(shape) + DTYPES.index(dtype))
    x, w, f = _inputs(*shape, dtype, gen, wdtype)
    want = _diffusers(x, w, f)
    got = ops.qk_norm_rope_reference(x, w, f, 1e-6)
    assert got.dtype == want.dtype == w.dtype
    assert_bit_identical(got, want, f"{dtype} weight {w.dtype}")


def test_reference_equals_attention_processor(monkeypatch):
    """Through diffusers' own QwenDoubleStreamAttnProcessor2_0: the q/k it hands to the attention
    are cat([ref(txt_q), ref(img_q)]) of the projections, with QwenEmbedRope's real freqs."""
    torch.manual_seed(0)
    heads, dim = 2, 2 * DH
    block = tq.QwenImageTransformerBlock(dim, heads, DH).to(torch.bfloat16).eval()
    attn = block.attn
    with torch.no_grad():
        for n in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
            n.weight.copy_(torch.randn(DH) * 0.3 + 1)
    rope = tq.QwenEmbedRope(theta=10000, axes_dim=[16, 56, 56], scale_rope=True)
    B, Li, Lt = 2, 4 * 6, 9
    img_f, txt_f = rope([(1, 4, 6)], device="cpu", max_txt_seq_len=Lt)
    assert img_f.dtype == txt_f.dtype == torch.complex64 and img_f.shape == (Li, DH // 2)
    hs = torch.randn(B, Li, dim).bfloat16()
    enc = torch.randn(B, Lt, dim).bfloat16()
    seen = {}

    def capture(q, k, v, **kw):
        seen["q"], seen["k"] = q, k
        return v

    monkeypatch.setattr(tq, "dispatch_attention_fn", capture)
    with torch.no_grad():
        attn.processor(attn, hs, enc, image_rotary_emb=(img_f, txt_f))
        uf = lambda t: t.unflatten(-1, (-1, DH))  # noqa: E731
        q = [uf(attn.add_q_proj(enc)), uf(attn.to_q(hs))]
        k = [uf(attn.add_k_proj(enc)), uf(attn.to_k(hs))]
        eps = attn.norm_q.eps
        got = ops.qk_norm_rope_multi(
            [q[1], k[1], q[0], k[0]],
            [attn.norm_q.weight, attn.norm_k.weight, attn.norm_added_q.weight, attn.norm_added_k.weight],
            [img_f, img_f, txt_f, txt_f], eps=eps,
        )
    assert_bit_identical(torch.cat([got[2], got[0]], dim=1), seen["q"], "joint query")
    assert_bit_identical(torch.cat([got[3], got[1]], dim=1), seen["k"], "joint key")


@pytest.mark.parametrize("dtype", DTYPES)
def test_op_on_cpu_is_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    x, w, f = _inputs(2, 5, 3, dtype, gen)
    assert_bit_identical(ops.qk_norm_rope(x, w, f), ops.qk_norm_rope_reference(x, w, f), "op")
    # a column slice of a fused [B, L, 3 * H * DH] projection (row stride 3 * H * DH)
    fused = (torch.randn(2, 5, 3 * 3 * DH, generator=gen)).to(dtype)
    view = fused[..., 3 * DH: 6 * DH].unflatten(-1, (-1, DH))
    assert not view.is_contiguous()
    out = ops.qk_norm_rope(view, w, f)
    assert out.is_contiguous()
    assert_bit_identical(out, ops.qk_norm_rope_reference(view.contiguous(), w, f), "view")


def test_multi_on_cpu_is_the_reference():
    gen = torch.Generator().manual_seed(4)
    xi, wi, fi = _inputs(2, 12, 3, torch.bfloat16, gen)
    xt, wt, ft = _inputs(2, 5, 3, torch.bfloat16, gen)
    outs = ops.qk_norm_rope_multi([xi, xi * 2, xt], [wi, wi, wt], [fi, fi, ft], eps=[1e-6, 1e-5, 1e-6])
    wants = [ops.qk_norm_rope_reference(xi, wi, fi, 1e-6), ops.qk_norm_rope_reference(xi * 2, wi, fi, 1e-5),
             ops.qk_norm_rope_reference(xt, wt, ft, 1e-6)]
    for i, (g, w) in enumerate(zip(outs, wants)):
        assert_bit_identical(g, w, f"multi[{i}]")


def _args():
    gen = torch.Generator().manual_seed(1)
    return _inputs(1, 3, 2, torch.bfloat16, gen)


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda x, w, f: (x[0], w, f), ValueError, r"x must have shape \[B, L, H, DH\]"),
        (lambda x, w, f: (x.int(), w, f), TypeError, "x has dtype"),
        (lambda x, w, f: (x[..., :3], w[:3], f), ValueError, "even head dim"),
        (lambda x, w, f: ("x", w, f), TypeError, "x must be a torch.Tensor"),
        (lambda x, w, f: (x, w[:64], f), ValueError, r"weight must have shape \[DH\]"),
        (lambda x, w, f: (x, w.int(), f), TypeError, "weight has dtype"),
        (lambda x, w, f: (x, None, f), TypeError, "weight must be a torch.Tensor"),
        (lambda x, w, f: (x, w, torch.view_as_real(f)), TypeError, "freqs must be a complex tensor"),
        (lambda x, w, f: (x, w, f[:2]), ValueError, r"freqs must have shape \[L, DH/2\]"),
        (lambda x, w, f: (x, w, f.to(torch.device("meta"))), ValueError, "freqs is on meta"),
        (lambda x, w, f: (x, w.to(torch.device("meta")), f), ValueError, "weight is on meta"),
    ],
)
def test_validation_errors_name_the_argument(mutate, exc, match):
    x, w, f = mutate(*_args())
    with pytest.raises(exc, match=match):
        ops.qk_norm_rope(x, w, f)
    with pytest.raises(exc, match=match):
        ops.qk_norm_rope_not_supported_reasons(x, w, f)


def test_validation_of_eps_and_multi_lists():
    x, w, f = _args()
    with pytest.raises(ValueError, match="eps must be >= 0"):
        ops.qk_norm_rope(x, w, f, eps=-1.0)
    with pytest.raises(TypeError, match="eps must be a float"):
        ops.qk_norm_rope(x, w, f, eps="1e-6")
    with pytest.raises(ValueError, match="same length"):
        ops.qk_norm_rope_multi([x, x], [w], [f, f])
    with pytest.raises(ValueError, match="1 to 4 tensors"):
        ops.qk_norm_rope_multi([x] * 5, [w] * 5, [f] * 5)
    with pytest.raises(ValueError, match="eps must be one float or 2 floats"):
        ops.qk_norm_rope_multi([x, x], [w, w], [f, f], eps=[1e-6])
    with pytest.raises(ValueError, match=r"weights\[1\] must have shape"):
        ops.qk_norm_rope_multi([x, x], [w, w[:2]], [f, f])
    with pytest.raises(TypeError, match="xs must be a list or tuple"):
        ops.qk_norm_rope_multi(x, [w], [f])


def test_not_supported_reasons_are_data(monkeypatch):
    x, w, f = _args()
    r = ops.qk_norm_rope_not_supported_reasons(x, w, f)
    assert r == ["tensors are on cpu, the kernels need CUDA"]
    gen = torch.Generator().manual_seed(2)
    x64, w64, f64 = _inputs(1, 3, 2, torch.bfloat16, gen, dh=64)
    assert any("head dim 64" in s for s in ops.qk_norm_rope_not_supported_reasons(x64, w64, f64))
    assert any("weight dtype" in s for s in ops.qk_norm_rope_not_supported_reasons(x, w.float(), f))
    assert any("complex64" in s for s in ops.qk_norm_rope_not_supported_reasons(x, w, f.to(torch.complex128)))
    assert any("unit stride inside a head" in s
               for s in ops.qk_norm_rope_not_supported_reasons(x.transpose(2, 3).contiguous().transpose(2, 3), w, f))
    assert any("fp32" in s for s in ops.qk_norm_rope_not_supported_reasons(x, w, f, eps=1e39))
    assert any("force_reference" in s for s in ops.qk_norm_rope_not_supported_reasons(x, w, f, force_reference=True))
    monkeypatch.setenv(ops.FORCE_REFERENCE_ENV, "1")
    assert any(ops.FORCE_REFERENCE_ENV in s for s in ops.qk_norm_rope_not_supported_reasons(x, w, f))
    xg = x.float().requires_grad_()
    assert any("autograd" in s for s in ops.qk_norm_rope_not_supported_reasons(xg, w.float(), f))


def test_mixed_dtype_weight_gives_the_weight_dtype():
    x, w, f = _args()
    out = ops.qk_norm_rope(x, w.float(), f)
    assert out.dtype == torch.float32
    assert_bit_identical(out, _diffusers(x, w.float(), f), "bf16 x, fp32 weight")


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 3, DH, dtype=torch.bfloat16)
        xv = torch.empty(2, 5, 3 * 3 * DH, dtype=torch.bfloat16)[..., :3 * DH].unflatten(-1, (-1, DH))
        w = torch.empty(DH, dtype=torch.bfloat16)
        f = torch.empty(5, DH // 2, dtype=torch.complex64)
        outs = torch.ops.qwen_absorb.qk_norm_rope([x, xv, x], [w, w, w.float()], [f, f, f], [1e-6] * 3)
        assert [tuple(o.shape) for o in outs] == [(2, 5, 3, DH)] * 3
        assert [o.dtype for o in outs] == [torch.bfloat16, torch.bfloat16, torch.float32]
        assert all(o.is_contiguous() for o in outs)


def test_custom_op_compile_fullgraph_on_cpu():
    gen = torch.Generator().manual_seed(5)
    xi, wi, fi = _inputs(2, 6, 3, torch.bfloat16, gen)
    xt, wt, ft = _inputs(2, 4, 3, torch.bfloat16, gen)

    def chain(xi, wi, fi, xt, wt, ft):
        a = ops.qk_norm_rope(xi, wi, fi)
        b = ops.qk_norm_rope_multi([xi, xt], [wi, wt], [fi, ft])
        return a, b[0], b[1]

    torch._dynamo.reset()
    compiled = torch.compile(chain, fullgraph=True, backend="eager")
    for got, want in zip(compiled(xi, wi, fi, xt, wt, ft), chain(xi, wi, fi, xt, wt, ft)):
        assert_bit_identical(got, want, "compiled")
    gm = torch._dynamo.export(chain)(xi, wi, fi, xt, wt, ft).graph_module
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("qk_norm_rope" in t for t in targets), targets


def test_layout_matches_the_c_struct():
    # QkNormRopeJob: 4 pointers, 4 int64, 4 int32, float, int32 = 88 bytes; the params end in njobs
    assert struct.calcsize("@" + qkr.JOB_LAYOUT) == 88
    assert struct.calcsize("@" + qkr.LAYOUT) == 4 * 88 + 4
    src = (qkr.rt.CSRC / qkr.CU).read_text()
    assert f"#define QA_QKR_WARPS {qkr.WARPS} " in src and f"#define QA_QKR_MAX_JOBS {qkr.MAX_JOBS}" in src


def test_kernel_expressions_are_listed():
    mine = qkr.all_kernel_expressions()
    assert len(mine) == 3 * (len(qkr.ORDERS) + len(qkr.WIDE_ORDERS)) and set(mine) <= set(ops.all_kernel_expressions())
    assert set(qkr.WIDE_ORDERS) <= set(qkr.ORDERS)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, *values):
        struct.pack("@" + qkr.LAYOUT, *values)  # the values fit the layout
        self.calls.append((grid, values))


def _inject(monkeypatch, rec, per_lane=4):
    """The launcher cache entry launch() would build for CPU tensors (device -1): the recorder, elements per lane."""
    monkeypatch.setitem(qkr._fns, (torch.bfloat16, -1, qkr.ROWS_PER_WARP, True), (rec, per_lane))


@pytest.mark.parametrize("order,wide,expected", [
    (10, True, "qk_norm_rope_wide_kernel<QaBF16, 10, 4>"), (0, True, "qk_norm_rope_wide_kernel<QaBF16, 0, 4>"),
    (1, True, "qk_norm_rope_kernel<QaBF16, 1, 4>"), (13, True, "qk_norm_rope_kernel<QaBF16, 13, 4>"),
    (10, False, "qk_norm_rope_kernel<QaBF16, 10, 4>"),
])
def test_launch_picks_the_wide_form_where_it_implements_the_order(monkeypatch, order, wide, expected):
    """The wide kernel (8 elements per lane) for the orders of 4-element lane groups (0, 10), the 4-element
    kernel otherwise or with ``wide=False`` (Tuning(qk_wide=False)); the vector flags follow the lane width."""
    monkeypatch.setattr(qkr, "_fns", {})
    monkeypatch.setattr(qkr, "probe_variance_order", lambda dev: qkr.VarianceOrder(order, 1, "forced by the test"))
    built, rec = [], _Recorder()
    monkeypatch.setattr(qkr.rt, "function", lambda cu, expr, dev: built.append(expr) or expr)
    monkeypatch.setattr(qkr.rt, "Launcher", lambda fn, block, layout, dev: rec)
    gen = torch.Generator().manual_seed(8)
    fused = torch.randn(1, 6, 2 * 3 * DH + 8, generator=gen).bfloat16()
    x = fused[..., 4: 4 + 3 * DH].unflatten(-1, (-1, DH))  # 8-byte aligned rows, not 16-byte aligned
    w, f = torch.randn(DH, generator=gen).bfloat16(), _freqs(6, gen)
    qkr.launch([x], [w], [f], [1e-6], wide=wide)
    qkr.launch([x], [w], [f], [1e-6], wide=wide)
    assert built == [expected]  # compiled once, cached
    flags = rec.calls[0][1][13]
    assert flags & 1 == (0 if "wide" in expected else 1)


def test_launch_packs_jobs(monkeypatch):
    """The host side of launch(), with the kernel replaced by a recorder (CPU tensors: device -1)."""
    rec = _Recorder()
    _inject(monkeypatch, rec)
    gen = torch.Generator().manual_seed(6)
    xi, wi, fi = _inputs(1, 6, 3, torch.bfloat16, gen)
    fused = torch.randn(2, 5, 3 * 3 * DH, generator=gen).bfloat16()
    xt = fused[..., 3 * DH + 1: 6 * DH + 1].unflatten(-1, (-1, DH))  # misaligned view: scalar loads
    wt = torch.randn(DH, generator=gen).bfloat16()
    ft = _freqs(5, gen)
    outs = qkr.launch([xi, xt], [wi, wt], [fi, ft], [1e-6, 2e-6])
    assert [tuple(o.shape) for o in outs] == [(1, 6, 3, DH), (2, 5, 3, DH)]
    (grid, v), = rec.calls
    n = len(qkr.JOB_LAYOUT.replace("4P", "PPPP").replace("4q", "qqqq").replace("4i", "iiii"))
    jobs = [v[i * n:(i + 1) * n] for i in range(qkr.MAX_JOBS)]
    assert v[-1] == 2
    rows0, rows1 = 1 * 6 * 3, 2 * 5 * 3
    per = qkr.WARPS * qkr.ROWS_PER_WARP  # rows per block
    assert grid == -(-rows0 // per) + -(-rows1 // per)
    j0, j1 = jobs[0], jobs[1]
    assert j0[:4] == (xi.data_ptr(), wi.data_ptr(), fi.data_ptr(), outs[0].data_ptr())
    assert j0[4:8] == (*xi.stride()[:3], 2 * DH // 2)
    assert j0[8:12] == (6, 3, rows0, 0)
    assert j1[4:8] == (*xt.stride()[:3], DH) and j1[8:12] == (5, 3, rows1, -(-rows0 // per))
    assert j1[12] == 2e-6
    assert j1[13] & 1 == 0 and (j1[13] >> 1) & 1 == (wt.data_ptr() % 8 == 0)
    assert all(j[10] == 0 and j[11] == grid for j in jobs[2:])  # padding jobs: no rows


def test_launch_writes_into_joint_rows(monkeypatch):
    """``into``: the jobs' output pointers are the given views (the text and image rows of one joint tensor)."""
    rec = _Recorder()
    _inject(monkeypatch, rec)
    gen = torch.Generator().manual_seed(7)
    xi, wi, fi = _inputs(1, 6, 3, torch.bfloat16, gen)
    xt, wt, ft = _inputs(1, 4, 3, torch.bfloat16, gen)
    joint = torch.empty(1, 10, 3, DH, dtype=torch.bfloat16)
    into = (joint[:, 4:], joint[:, :4])
    outs = qkr.launch([xi, xt], [wi, wt], [fi, ft], [1e-6, 1e-6], into)
    assert outs[0] is into[0] and outs[1] is into[1]
    (_, v), = rec.calls
    n = len(qkr.JOB_LAYOUT.replace("4P", "PPPP").replace("4q", "qqqq").replace("4i", "iiii"))
    assert v[3] == joint.data_ptr() + 4 * 3 * DH * 2 and v[n + 3] == joint.data_ptr()


def test_launch_refuses_subclasses_and_too_many_jobs(monkeypatch):
    _inject(monkeypatch, _Recorder())
    x, w, f = _args()

    class Sub(torch.Tensor):
        pass

    with pytest.raises(TypeError, match="plain tensors"):
        qkr.launch([x.as_subclass(Sub)], [w], [f], [1e-6])
    with pytest.raises(ValueError, match="at most 4"):
        qkr.launch([x] * 5, [w] * 5, [f] * 5, [1e-6] * 5)


# ---------------------------------------------------------------------------- variance orders


def _scalar_order_sum(row: list[float], order: int) -> float:
    """The kernel's ORDER, written out with numpy fp32 scalars (an independent statement of the
    header table in csrc/qk_norm_rope.cu)."""
    import numpy as np  # noqa: PLC0415

    f = np.float32
    sq = [f(v) * f(v) for v in row]
    descending, order = order >= 10, order % 10
    if order == 0:
        lanes = [((sq[4 * u] + sq[4 * u + 1]) + sq[4 * u + 2]) + sq[4 * u + 3] for u in range(32)]
    elif order == 1:
        lanes = [((sq[u] + sq[u + 32]) + sq[u + 64]) + sq[u + 96] for u in range(32)]
    elif order == 3:
        lanes = [(sq[2 * u] + sq[2 * u + 64]) + (sq[2 * u + 1] + sq[2 * u + 65]) for u in range(32)]
    else:
        v = 8 if order == 2 else 16
        lanes = []
        for u in range(128 // v):
            a = sq[v * u]
            for i in range(1, v):
                a = a + sq[v * u + i]
            lanes.append(a)
    while len(lanes) > 1:
        h = len(lanes) // 2
        lanes = ([lanes[i] + lanes[i + h] for i in range(h)] if descending
                 else [lanes[2 * i] + lanes[2 * i + 1] for i in range(h)])
    return float(lanes[0] * f(1.0 / 128))


@pytest.mark.parametrize("order", sorted(qkr.ORDERS))
def test_variance_in_order_is_the_stated_order(order):
    """The torch emulation used by the probe and the GPU tests equals the order table, bit for bit,
    and the orders really differ (else the probe could not tell them apart)."""
    gen = torch.Generator().manual_seed(order)
    x = torch.randn(64, DH, generator=gen) * torch.exp(torch.randn(64, DH, generator=gen) * 2)  # as the probe
    got = qkr.variance_in_order(x, order)
    want = torch.tensor([_scalar_order_sum(r, order) for r in x.float().tolist()], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    others = [qkr.variance_in_order(x, o) for o in qkr.ORDERS if o != order]
    assert all(not torch.equal(got, o) for o in others)
    exact = x.double().pow(2).mean(-1)
    assert torch.allclose(got.double(), exact, rtol=1e-6, atol=0)


def test_order_probe_needs_cuda_and_says_so():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    x, w, f = _inputs(1, 4, 24, torch.bfloat16, torch.Generator().manual_seed(0))
    reasons = ops.qk_norm_rope_not_supported_reasons(x, w, f)
    assert reasons and not any("order" in r for r in reasons)  # the machine reason comes first, no probe
