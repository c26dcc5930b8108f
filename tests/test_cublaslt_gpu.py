"""GPU tests of :mod:`qwen_absorb.cublaslt` (issue 18): cuBLASLt's FP8 matmul called directly, plain and
accumulating into its output, against ``torch._scaled_mm``, the add-after path and an fp32 reference; captured
in a CUDA graph; into a row slice at an unaligned offset; and a patched FP8 + LoRA model with the epilogue path
forced on, off and on its default rule."""

from __future__ import annotations

import pytest
import torch

from qwen_absorb import cublaslt, projection

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need sm_89+", allow_module_level=True)
if cublaslt.unavailable_reason() is not None:
    pytest.skip(f"cuBLASLt: {cublaslt.unavailable_reason()}", allow_module_level=True)

DEV = "cuda"
SHAPES = [(256, 512, 256), (96, 1024, 256), (7, 256, 512), (333, 384, 128)]


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
def test_plain_call_is_torch_scaled_mm_bit_for_bit(m, n, k, fast, bias, seed):
    o = _ops(m, n, k, torch.Generator(device=DEV).manual_seed(seed), bias=bias)
    assert not cublaslt.scaled_mm_reasons(o["a"], o["w"], o["bias"], torch.empty(m, n, dtype=torch.bfloat16, device=DEV))
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cublaslt.scaled_mm(o["a"], o["w"], o["sa"], o["sb"], o["bias"], out, fast_accum=fast, accumulate=False)
    assert torch.equal(out, _torch(o, fast))


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
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


@pytest.mark.parametrize("mode", [True, False, "auto"])
def test_patched_fp8_lora_model_with_and_without_the_epilogue(monkeypatch, mode, seed):
    """The epilogue path inside a patched model: as accurate against fp32 as fake quant + LoRA, and within
    rounding of the add-after path; the default rule takes it for the FFN up projections only."""
    pytest.importorskip("peft")
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from qwen_absorb.ops import _runtime  # noqa: PLC0415

    if _runtime.cupy_unavailable_reason() is not None:
        pytest.skip("needs CuPy")
    import copy  # noqa: PLC0415

    import qwen_absorb  # noqa: PLC0415
    from qwen_absorb import testing as T  # noqa: PLC0415
    from tests.test_fp8_follows_model_gpu import _fp8, _lora  # noqa: PLC0415

    s = seed % 1000
    model, inp = _fp8(s)
    _lora(model, s + 2)
    ref32 = copy.deepcopy(model)
    mtq.disable_quantizer(ref32, "*")
    ref32.float()
    want = T.run_transformer(ref32, {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                     for k, v in inp.items()})
    del ref32
    fake = T.run_transformer(model, inp)
    calls = []
    real = cublaslt.scaled_mm

    def spy(*a, **k):
        calls.append((a[0].shape[-1], a[5].shape[-1]))
        return real(*a, **k)

    monkeypatch.setattr(cublaslt, "scaled_mm", spy)
    monkeypatch.setattr(projection, "LORA_EPILOGUE", mode)
    qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    out = T.run_transformer(model, inp)
    monkeypatch.setattr(projection, "LORA_EPILOGUE", False)
    after = T.run_transformer(model, inp)
    if mode is False:
        assert not calls
    elif mode is True:
        assert len(calls) == 12 * 3, calls  # every LoRA linear of the 3 blocks
    else:
        assert len(calls) == 2 * 3 and all(n >= 2 * k for k, n in calls), calls  # img/txt net.0.proj
    assert _rel(out, want) <= 1.1 * _rel(fake, want) + 1e-3
    assert _rel(out, after) < 5e-3
