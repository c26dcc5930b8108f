"""GPU tests of the streaming kernels' build variants: every variant gives the eager bits.

- ``qk_norm_rope``: the wide form (8 elements per lane, a row per half-warp) against the 4-element form and
  diffusers' chain, for both orders it implements (forced: the running PyTorch uses one of them), every dtype,
  rows per warp 2 / 4 / 8, odd row counts (a half-warp past the last row), several jobs in one launch, and rows
  that are not 16-byte aligned (its scalar loads).
- ``swiglu``: ``UNROLL`` 1 / 2 / 4 at element counts around a block's span, a tail that is not a whole vector,
  misaligned inputs, with and without the FP8 codes.

Outputs are poisoned first (NaN in every float dtype), so an element a variant fails to write shows up.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from qwen_absorb.ops import _runtime, quantize_fp8_reference

from .ops_helpers import assert_bit_identical, poison_allocator

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
    pytest.skip(
        f"needs CUDA and CuPy ({_runtime.cupy_unavailable_reason() if torch.cuda.is_available() else 'no CUDA'})",
        allow_module_level=True,
    )

qkr = importlib.import_module("qwen_absorb.ops.qk_norm_rope")
sw = importlib.import_module("qwen_absorb.ops.swiglu")
DEV = "cuda"
DH = 128
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _freqs(L, gen):
    return torch.polar(torch.ones(L, DH // 2, device=DEV), torch.randn(L, DH // 2, generator=gen, device=DEV) * 20)


def _rows(B, L, H, dtype, gen, offset=0):
    """[B, L, H, 128] with rows of very different magnitudes; offset > 0: a column slice whose rows start
    ``offset`` elements past an aligned address."""
    full = torch.randn(B, L, H * DH + 8, generator=gen, device=DEV) * 3
    full *= torch.exp(torch.randn(B, L, 1, generator=gen, device=DEV) * 2)
    return full.to(dtype)[..., offset: offset + H * DH].unflatten(-1, (H, DH))


@pytest.mark.parametrize("order", [0, 10])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_wide_form_is_the_narrow_forms_bits(order, dtype, monkeypatch):
    idx = torch.cuda.current_device()
    monkeypatch.setitem(qkr._orders, idx, qkr.VarianceOrder(order, 1, "forced by the test"))
    monkeypatch.setattr(qkr, "_fns", {})
    gen = torch.Generator(device=DEV).manual_seed(order * 10 + DTYPES.index(dtype))
    cases = [  # jobs of one launch: (B, L, H, offset)
        [(1, 300, 8, 0)],
        [(1, 333, 3, 0), (2, 5, 7, 0)],  # odd row counts: the last pair's second half has no row
        [(1, 1, 1, 0), (1, 17, 3, 4), (2, 77, 24, 0), (1, 9, 5, 1)],  # misaligned rows: scalar loads
    ]
    for jobs in cases:
        xs = [_rows(B, L, H, dtype, gen, off) for B, L, H, off in jobs]
        ws = [(torch.randn(DH, generator=gen, device=DEV) * 0.4 + 1).to(dtype) for _ in jobs]
        fs = [_freqs(L, gen) for _, L, _, _ in jobs]
        eps = [1e-6] * len(jobs)
        want = []
        for x, w, f in zip(xs, ws, fs):
            var = qkr.variance_in_order(x, order)[..., None]
            want.append(qkr.rope_reference(((x.float() * torch.rsqrt(var + 1e-6)).to(dtype) * w), f))
        for wide in (False, True):
            for rpw in (2, 4, 8):
                monkeypatch.setattr(qkr, "ROWS_PER_WARP", rpw)
                poison_allocator(sum(x.numel() for x in xs) * 4)
                got = qkr.launch(xs, ws, fs, eps, wide=wide)
                for i, (g, w_) in enumerate(zip(got, want)):
                    assert_bit_identical(g, w_, f"order {order} {dtype} {jobs} wide={wide} rpw={rpw} job {i}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_unroll_variants_are_exact(dtype, monkeypatch):
    gen = torch.Generator(device=DEV).manual_seed(5 + DTYPES.index(dtype))
    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    amax = torch.tensor([3.0], device=DEV)
    for unroll in (1, 2, 4):
        monkeypatch.setattr(sw, "UNROLL", unroll)
        span = sw.THREADS * vec * unroll
        for n, offset in ((span, 0), (span + vec, 0), (3 * span - 1, 0), (2 * span + 5, 1), (7, 0), (vec * 3, 3)):
            a = (torch.randn(n + 8, generator=gen, device=DEV) * 4).to(dtype)[offset: offset + n]
            b = torch.randn(n, generator=gen, device=DEV).to(dtype)
            want = sw.swiglu_reference(a, b)
            want_codes = quantize_fp8_reference(want, amax)
            poison_allocator(3 * n * 4)
            out, codes = sw.launch(a, b, fp8_amax=amax)
            assert_bit_identical(out, want, f"swiglu {dtype} unroll {unroll} n {n} offset {offset}")
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (dtype, unroll, n, offset)
            poison_allocator(3 * n * 4)
            none, codes = sw.launch(a, b, out=False, fp8_amax=amax)
            assert none is None
            assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)), (dtype, unroll, n, offset)
