"""The folded GELU + net[2] lora_A kernel (``ops.lora_fold``) on a GPU.

    python -m pytest -q -m gpu tests/test_lora_fold_gpu.py

- The codes are ``lora_add.add_gelu_fp8``'s bit for bit (awkward shapes: partial row bands, ranks below a k step
  or an n8 tile, widths of one column tile; bf16 and fp16; poisoned outputs).
- ``t2`` is the product of the GELU output that ``add_gelu_fp8`` hands over with net[2]'s lora_A weight: within
  one rounding of the exact sum plus the fp32 accumulation's error, never further from it on average than
  PyTorch's own ``F.linear`` of the same operands; and it is the same whatever the number of column segments
  a row band is split into (up to the last bit: the order of the fp32 partial sums changes).
- Two launches give the same bits.
"""

from __future__ import annotations

import pytest
import torch

from qwen_absorb.ops import lora_add, lora_fold

from .ops_helpers import poison_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
DEV = "cuda"


def _operands(m, n, r, r2, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEV, generator=g, dtype=torch.float32) * scale).to(dtype)

    y = rnd(m, n)
    t = rnd(m, r + 16)[:, 8:8 + r]  # a column slice, as q/k/v's shared lora_A product hands it over
    b = rnd(n, r, scale=r ** -0.5)
    a2 = rnd(r2, n, scale=n ** -0.5)
    return y, t, b, a2


@pytest.fixture(autouse=True)
def _every_size(monkeypatch):
    """The kernel at every size: the rule that keeps small ones on the two steps (size_reasons) is for speed."""
    monkeypatch.setattr(lora_fold, "size_reasons", lambda m, sms: [])


def _skip_without_kernel(y, t, b, a2):
    why = lora_fold.reasons(y, t, b, a2)
    if why:
        pytest.skip("; ".join(why))


SHAPES = [  # M, N, R (net[0]'s rank), R2 (net[2]'s)
    (4096, 12288, 64, 64),
    (128, 12288, 64, 64),
    (1000, 3072, 16, 24),
    (77, 256, 8, 8),
    (129, 1024, 48, 40),
    (300, 128, 64, 16),
    (1, 384, 32, 64),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fold_gives_add_gelu_fp8s_codes_and_the_product_of_its_output(dtype, shape):
    m, n, r, r2 = shape
    y, t, b, a2 = _operands(m, n, r, r2, dtype, seed=m + 3 * n + 7 * r + r2)
    _skip_without_kernel(y, t, b, a2)
    amax = torch.tensor([3.7], device=DEV)
    alpha = 1.25
    y_before = y.clone()
    codes_ref, g = lora_add.add_gelu_fp8(y, t, b, alpha, amax, act_out=True)
    poison_allocator(y.numel() * y.element_size())
    codes, t2 = lora_fold.add_gelu_fp8_fold(y, t, b, alpha, amax, a2)
    torch.cuda.synchronize()
    assert torch.equal(y, y_before)  # only read
    assert torch.equal(codes.view(torch.uint8), codes_ref.view(torch.uint8))
    assert t2.shape == (m, r2) and t2.dtype == dtype and not t2.isnan().any()
    exact = g.double() @ a2.double().t()
    half_ulp = exact.abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    absum = g.double().abs() @ a2.double().abs().t()
    bound = half_ulp + n * 2.0 ** -23 * absum + 1e-7
    err = (t2.double() - exact).abs()
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (f"{float(t2.flatten()[worst])} exact {float(exact.flatten()[worst])}; "
                                  f"{int((err > bound).sum())} of {t2.numel()} beyond the bound")
    torch_t2 = torch.nn.functional.linear(g, a2)
    err_torch = (torch_t2.double() - exact).abs()
    assert err.mean() <= err_torch.mean() * 1.05 + 1e-12, (float(err.mean()), float(err_torch.mean()))
    codes2, t2b = lora_fold.add_gelu_fp8_fold(y, t, b, alpha, amax, a2)
    assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(t2b, t2)


@pytest.mark.parametrize("sms", [1, 7, 1000])
def test_any_split_of_a_row_band_gives_the_same_codes_and_product(monkeypatch, sms):
    """The column segments per row band follow the SM count (1: one block per band walks every column tile; many:
    up to MAX_SEGMENTS partial sums added by the second kernel)."""
    y, t, b, a2 = _operands(300, 3072, 64, 64, torch.bfloat16, seed=11)
    _skip_without_kernel(y, t, b, a2)
    amax = torch.tensor([2.5], device=DEV)
    codes_ref, t2_ref = lora_fold.add_gelu_fp8_fold(y, t, b, 0.75, amax, a2)
    limits = lora_fold._device_limits(y.device)
    monkeypatch.setattr(lora_fold, "_device_limits", lambda device: (sms, limits[1]))
    poison_allocator(1 << 24)
    codes, t2 = lora_fold.add_gelu_fp8_fold(y, t, b, 0.75, amax, a2)
    torch.cuda.synchronize()
    assert torch.equal(codes.view(torch.uint8), codes_ref.view(torch.uint8))
    torch.testing.assert_close(t2, t2_ref, rtol=2 ** -7, atol=1e-6)
