"""The tensor-core LoRA branch kernel (``ops.lora_add``) on a GPU.

    python -m pytest -q -m gpu tests/test_lora_add_gpu.py

- ``lora_add_`` (the kernels' in-place form): ``y += alpha * t @ B.T`` against the exact sum (fp64) and cuBLAS's
  ``addmm_`` of the same operands: never further from the exact value than one rounding of the accumulated sum
  allows, rarely a different bit from cuBLAS; awkward shapes (ranks that are not multiples of 16 or 8, odd widths,
  partial tiles, strided views of wider tensors whose other columns must stay untouched, several rank chunks), bf16
  and fp16.
- Several outputs in one launch give each output's single-launch result bit for bit.
- ``add_gelu_fp8``: bit for bit what ``lora_add_`` followed by the GELU + e4m3 quantization kernel gives.
- The tiled kernel (``lora_add_tiles.cu``, the default where rows are 16-byte aligned and widths / ranks multiples
  of 8) gives ``lora_add_kernel``'s outputs bit for bit, both forms, on partial tiles, grouped launches and blocks
  that walk across column ranges and problems (few resident blocks forced); poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

from qwen_absorb.ops import lora_add
from qwen_absorb.ops.quantize_fp8 import quantize_fp8

from .ops_helpers import lora_add_, poison_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"


def _skip_without_kernel():
    y = torch.empty(2, 2, device=DEV, dtype=torch.bfloat16)
    why = lora_add.reasons(y, y, y)
    if why:
        pytest.skip("; ".join(why))


def _operands(m, n, r, dtype, seed, wide=0, offset=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    big = torch.full((m, n + wide), float("nan"), device=DEV, dtype=dtype)
    y = big[:, offset:offset + n]
    y.copy_(torch.randn(m, n, device=DEV, generator=g, dtype=torch.float32).to(dtype))
    t_all = torch.randn(m, r + 24, device=DEV, generator=g, dtype=torch.float32).to(dtype)
    t = t_all[:, 8:8 + r]  # a column slice, as q/k/v's shared lora_A product hands it over
    b = (torch.randn(n, r, device=DEV, generator=g, dtype=torch.float32) / r ** 0.5).to(dtype)
    return big, y, t, b


SHAPES = [  # M, N, R, extra columns of the wider tensor, column offset of y in it
    (4096, 3072, 64, 0, 0),
    (128, 3072, 64, 0, 0),
    (300, 130, 16, 6, 2),
    (77, 203, 12, 5, 1),  # R % 8 != 0: scalar staging; odd width and offset: unpaired y access
    (129, 65, 4, 0, 0),
    (64, 256, 128, 0, 0),  # the largest rank
    (200, 96, 100, 0, 0),  # rank zero-padded to 128, a partial last column chunk
    (1, 8, 8, 0, 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_add_is_the_addmm_sum(dtype, shape):
    _skip_without_kernel()
    m, n, r, wide, off = shape
    big, y, t, b = _operands(m, n, r, dtype, seed=m * 7 + n + r, wide=wide, offset=off)
    alpha = 0.6875 if r != 16 else 2.0
    assert not lora_add.reasons(y, t, b)
    exact = y.double() + alpha * (t.double() @ b.double().t())
    cublas = y.clone().addmm_(t, b.t(), alpha=alpha)
    before = big.clone()
    lora_add_([(y, t, b, alpha)])
    torch.cuda.synchronize()
    # untouched outside the view (NaN poison stays NaN where it was)
    mask = torch.ones_like(big, dtype=torch.bool)
    mask[:, off:off + n] = False
    assert torch.equal(big[mask].isnan(), before[mask].isnan())
    assert not y.isnan().any(), "NaN inside the output"
    # one rounding of the fp32 sum: within half an ulp of the exact value, plus the fp32 accumulation's error
    half_ulp = exact.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    absum = abs(alpha) * (t.double().abs() @ b.double().abs().t())
    bound = half_ulp + r * 2.0 ** -23 * absum + 1e-7
    err_k = (y.double() - exact).abs()
    err_c = (cublas.double() - exact).abs()
    worst = int((err_k - bound).argmax())
    assert (err_k <= bound).all(), (
        f"kernel {float(y.flatten()[worst])} exact {float(exact.flatten()[worst])} cuBLAS {float(cublas.flatten()[worst])}"
        f" at {divmod(worst, n)}; {int((err_k > bound).sum())} of {y.numel()} beyond the bound")
    # cuBLAS does not round once (at rank >= 32 its result differs from the correctly rounded sum in ~25% of the
    # elements, H200): the kernel is never further from the exact sum on average
    assert err_k.mean() <= err_c.mean() * 1.01 + 1e-12, (float(err_k.mean()), float(err_c.mean()))


def test_several_outputs_in_one_launch_equal_single_launches():
    _skip_without_kernel()
    probs, singles = [], []
    for i, (m, n, r, wide, off) in enumerate(SHAPES[:6]):
        _, y, t, b = _operands(m, n, r, torch.bfloat16, seed=100 + i, wide=wide, offset=off)
        y1 = y.clone()
        lora_add_([(y1, t, b, 0.5 + i)])
        singles.append(y1)
        probs.append((y, t, b, 0.5 + i))
    lora_add_(probs)
    for (y, _, _, _), y1 in zip(probs, singles):
        assert torch.equal(y, y1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4096, 12288, 64), (128, 12288, 64), (77, 130, 12), (33, 95, 32)])
def test_add_gelu_fp8_is_add_then_the_gelu_quantization(dtype, shape):
    _skip_without_kernel()
    m, n, r = shape
    _, y, t, b = _operands(m, n, r, dtype, seed=m + n + r)
    y = y.contiguous()
    amax = torch.tensor([3.7], device=DEV)
    alpha = 1.25
    y_before = y.clone()
    codes, g = lora_add.add_gelu_fp8(y, t, b, alpha, amax, act_out=True)
    codes_only, none = lora_add.add_gelu_fp8(y, t, b, alpha, amax, act_out=False)
    assert none is None and torch.equal(y, y_before)  # y is only read
    h = y.clone()
    lora_add_([(h, t, b, alpha)])
    want_g = torch.nn.functional.gelu(h, approximate="tanh")
    want_codes = quantize_fp8(h.unsqueeze(0), amax, activation="gelu_tanh")[0]
    assert torch.equal(g, want_g)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(codes_only.view(torch.uint8), codes.view(torch.uint8))


TILE_SHAPES = [  # M, N, R: rank 8 pieces, partial row tiles, partial column tiles, several column ranges
    (4096, 12288, 64),
    (4096, 3072, 64),
    (128, 3072, 64),
    (100, 264, 16),
    (65, 136, 8),
    (130, 1000, 24),
    (64, 256, 128),
    (3, 8, 32),
    (1000, 392, 48),
]


def _both_kernels(monkeypatch, fn, nbytes=1 << 26):
    """fn(tiles=True) (the tiled kernel), then fn(tiles=False) (lora_add_kernel), each output over a poisoned pool."""
    outs = []
    for tiles in (True, False):
        poison_allocator(nbytes)  # the size of the largest output: its block is reused
        outs.append(fn(tiles))
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", TILE_SHAPES)
def test_tiled_kernel_equals_the_row_kernel(monkeypatch, dtype, shape):
    _skip_without_kernel()
    m, n, r = shape
    _, y, t, b = _operands(m, n, r, dtype, seed=m * 3 + n * 5 + r)
    assert not lora_add.tile_reasons(y, t, b), lora_add.tile_reasons(y, t, b)
    amax = torch.tensor([3.3], device=DEV)

    def add(tiles):
        out = y.clone()
        lora_add_([(out, t, b, 0.8125)], tiles)
        return out

    tiled, rows = _both_kernels(monkeypatch, add, y.numel() * y.element_size())
    assert not tiled.isnan().any() and torch.equal(tiled, rows)
    (c1, g1), (c2, g2) = _both_kernels(monkeypatch, lambda tiles: lora_add.add_gelu_fp8(y, t, b, 1.5, amax, act_out=True, tiles=tiles),
                                       y.numel() * y.element_size())
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8)) and torch.equal(g1, g2)
    assert not g1.isnan().any()


@pytest.mark.parametrize("slots", [1, 3, 7])
def test_tiled_blocks_walk_across_column_ranges_and_problems(monkeypatch, slots):
    """Few resident blocks: each walks many tiles, restaging lora_B where its column range or problem changes
    (ranks mixed: the launch pads to the largest)."""
    _skip_without_kernel()
    shapes = [(300, 520, 64), (128, 3072, 64), (77, 1024, 32), (512, 264, 16), (64, 136, 64), (9, 2048, 48)]
    probs = []
    for i, (m, n, r) in enumerate(shapes):
        _, y, t, b = _operands(m, n, r, torch.bfloat16, seed=500 + i)
        probs.append((y, t, b, 0.25 + i))
    monkeypatch.setattr(lora_add, "tile_slots", lambda device, ks: slots)

    def grouped(tiles):
        outs = [y.clone() for y, _, _, _ in probs]
        lora_add_([(o, t, b, a) for o, (_, t, b, a) in zip(outs, probs)], tiles)
        return outs

    tiled, rows = _both_kernels(monkeypatch, grouped)
    for a, b in zip(tiled, rows):
        assert torch.equal(a, b)
