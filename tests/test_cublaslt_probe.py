"""Tests of ``benchmarks/cublaslt_fp8.py``, the ctypes call of cuBLASLt's FP8 matmul that ``probe_lora_gemm.py``
measures (issue 18): its operand checks on the CPU; on a GPU, the plain call bit for bit against
``torch._scaled_mm``, the accumulating call against the add-after path and an fp32 reference, captured in a CUDA
graph, and into a row slice at an unaligned offset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cublaslt_fp8 as cublaslt  # noqa: E402

DEV = "cuda"
SHAPES = [(256, 512, 256), (96, 1024, 256), (7, 256, 512), (333, 384, 128)]


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability() < (8, 9):
        return "FP8 GEMMs need sm_89+"
    return None if cublaslt.unavailable_reason() is None else f"cuBLASLt: {cublaslt.unavailable_reason()}"


needs_gpu = pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))


def test_operand_checks_name_each_bad_operand():
    e4 = torch.float8_e4m3fn
    a, b = torch.zeros(8, 32, dtype=e4), torch.zeros(16, 32, dtype=e4)
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    assert cublaslt.scaled_mm_reasons(a, b, None, out) == ["operands are not on one CUDA device"]
    assert "not float8_e4m3fn" in " ".join(cublaslt.scaled_mm_reasons(a.bfloat16(), b, None, out))
    assert "bf16 or fp16 only" in " ".join(cublaslt.scaled_mm_reasons(a, b, None, out.float()))
    assert "do not agree" in " ".join(cublaslt.scaled_mm_reasons(a, b[:, :16], None, out))
    t = torch.empty(16, 8, dtype=torch.bfloat16).t()
    assert "not row-major" in " ".join(cublaslt.scaled_mm_reasons(a, b, None, t))
    assert "16 bytes" in " ".join(cublaslt.scaled_mm_reasons(a[:, :24], b[:, :24], None, out))
    assert "bias" in " ".join(cublaslt.scaled_mm_reasons(a, b, torch.zeros(16), out))
    assert "2-D" in " ".join(cublaslt.scaled_mm_reasons(a[None], b, None, out))


def test_alignment_is_the_largest_power_of_two_up_to_256():
    assert [cublaslt._alignment(p) for p in (0, 512, 96, 6, 7)] == [256, 256, 32, 2, 1]


def _ops(m, n, k, gen, dtype=torch.bfloat16, bias=True):
    ax, aw = 4.0, 0.05
    a = (torch.randn(m, k, generator=gen, device=DEV).clamp(-ax, ax) * (448 / ax)).to(torch.float8_e4m3fn)
    w = (torch.randn(n, k, generator=gen, device=DEV).mul(0.02).clamp(-aw, aw) * (448 / aw)).to(torch.float8_e4m3fn)
    return dict(a=a, w=w, sa=torch.tensor([ax / 448], device=DEV), sb=torch.tensor([aw / 448], device=DEV),
                bias=(torch.randn(n, generator=gen, device=DEV) * 0.02).to(dtype) if bias else None,
                t=torch.randn(m, 16, generator=gen, device=DEV).to(dtype),
                B=(torch.randn(n, 16, generator=gen, device=DEV) * 0.05).to(dtype), s=0.75, dtype=dtype)


def _torch(o, fast, out=None):
    return torch._scaled_mm(o["a"], o["w"].t(), scale_a=o["sa"], scale_b=o["sb"], bias=o["bias"],
                            out_dtype=o["dtype"], use_fast_accum=fast, out=out)


def _ref(o):
    y = (o["a"].float() * o["sa"]) @ (o["w"].float() * o["sb"]).t() + o["s"] * (o["t"].float() @ o["B"].float().t())
    return y if o["bias"] is None else y + o["bias"].float()


def _accumulate(o, out, fast):
    out.view(-1, out.shape[-1]).addmm_(o["t"], o["B"].t(), beta=0, alpha=o["s"])
    assert cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out, fast_accum=fast, accumulate=True)
    return out


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.gpu
@needs_gpu
def test_plain_call_is_torch_scaled_mm_bit_for_bit(m, n, k, fast, bias, seed):
    o = _ops(m, n, k, torch.Generator(device=DEV).manual_seed(seed), bias=bias)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert not cublaslt.scaled_mm_reasons(o["a"], o["w"], o["bias"], out)
    assert cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out, fast_accum=fast, accumulate=False)
    assert torch.equal(out, _torch(o, fast))


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.gpu
@needs_gpu
def test_accumulate_matches_fp32_as_well_as_adding_after(m, n, k, dtype, seed):
    o = _ops(m, n, k, torch.Generator(device=DEV).manual_seed(seed), dtype=dtype)
    ref = _ref(o)
    got = _accumulate(o, torch.full((m, n), float("nan"), dtype=dtype, device=DEV), fast=False)
    after = _torch(o, False).addmm_(o["t"], o["B"].t(), alpha=o["s"])
    assert not got.isnan().any()
    e_got, e_after = _rel(got, ref), _rel(after, ref)
    assert e_got <= 1.05 * e_after + 1e-5, (e_got, e_after)
    eps = torch.finfo(dtype).eps
    assert ((got.float() - after.float()).abs() <= 2 * eps * after.float().abs() + 1e-3).all()


@pytest.mark.gpu
@needs_gpu
def test_accumulate_into_an_unaligned_row_slice(seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    o = _ops(40, 48, 32, gen)
    joint = torch.randn(43, 48, generator=gen, device=DEV).bfloat16()
    before = joint.clone()
    view = joint[3:]
    assert view.data_ptr() % 256  # the heuristic is asked for this alignment
    _accumulate(o, view, fast=True)
    assert torch.equal(joint[:3], before[:3])
    assert _rel(view, _ref(o)) < 1e-2


@pytest.mark.gpu
@needs_gpu
def test_accumulate_in_a_cuda_graph_replays_new_values(seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    o = _ops(512, 1024, 256, gen)
    out = torch.empty(512, 1024, dtype=torch.bfloat16, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _accumulate(o, out, fast=True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _accumulate(o, out, fast=True)
    o2 = _ops(512, 1024, 256, gen)
    for key in ("a", "w", "bias", "t", "B", "sa", "sb"):
        o[key].copy_(o2[key])
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _accumulate(o, torch.empty_like(out), fast=True))
