"""GPU tests of Qwen-Image-2.1's real FP8 GEMMs (qwen_absorb.fp8_forward) on a small random ModelOpt FP8
``QwenImage21Transformer2DModel`` on CUDA, with the fused kernels emitting the codes:

- every linear runs as a real FP8 ``torch._scaled_mm`` (default options on validated GPUs, ``fp8_gemm=True``
  elsewhere from sm_89), no per-call fallback;
- fidelity: the real-FP8 error against an fp32 reference is <= 1.05x ModelOpt fake quant's;
- the codes the kernels hand over are bit-identical to ``quantize_fp8_reference`` of the tensor each linear
  received (outputs poisoned first: an unwritten element is a NaN), and the direct GEMMs (no bf16 activation
  written) give the module-call path's output bit for bit;
- with ``fp8_gemm=False`` the fused QuantLayerNorm sites are bit-identical to the unpatched fake-quant model;
- the KV cache (extract, then cached) and a model patched on the CPU then moved to CUDA;
- unpatch restores the fake-quant output bit for bit.

Run: ``python -m pytest -q -p no:cacheprovider -m gpu tests/test_qwenimage21_fp8_gpu.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import fp8_forward as F8
from qwen_absorb import gating, ops, site_runners
from . import builders as T

from .ops_helpers import poison_allocator as poison
from .ops_helpers import skip_module_without_kernels
from .qwenimage21_helpers import f32 as _f32
from .qwenimage21_helpers import model_inputs, run, run_kv, spy_fp8_linears, tiny_model
from .qwenimage21_helpers import rel as _rel

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]
skip_module_without_kernels()
pytest.importorskip("modelopt")
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("real FP8 GEMMs need sm_89 or newer", allow_module_level=True)

DEV = "cuda"
LAYERS = 4
N_LINEARS = 7 * LAYERS
TARGET = (32, 32)  # 1024 image tokens


def _models(seed: int = 0, cond: bool = True, flex: bool = False, device: str = DEV):
    """``(ModelOpt FP8 bf16 model on device, its inputs, the unquantized fp32 model on CUDA)``: 4 blocks,
    hidden 256 (4 heads x 64), SwiGLU 768, calibrated on CUDA."""
    m32 = tiny_model(dtype=torch.float32, device=DEV, seed=seed, heads=4, head_dim=64, axes=(16, 24, 24),
                     layers=LAYERS, flex=flex)
    model = copy.deepcopy(m32).to(torch.bfloat16)
    inp = model_inputs(model, cond=cond, seed=seed + 1, target=TARGET)
    T.fp8_quantize(model, [inp, model_inputs(model, cond=not cond, seed=seed + 2, target=TARGET)])
    if device != DEV:
        model.to(device)
        inp = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    return model, inp, m32


def _options() -> dict:
    """Default options where the GPU is validated (they must pick real FP8), else fp8_gemm=True."""
    return {} if gating.capability_key(torch.device(DEV)) in gating.VALIDATED_FP8_CAPABILITIES else {"fp8_gemm": True}


def test_every_linear_real_fp8_on_kernels(gemms):
    model, inp, _ = _models(0)
    report = qwen_absorb.patch(model, cuda_graph=False, **_options())
    s = report.summary
    assert s["fp8_gemm_linears"] == s["modelopt_linears"] == N_LINEARS, str(report)
    assert s["fp8_emitting_sites"] == 3 * LAYERS and s["sites_on_kernels"] == 5 * LAYERS, str(report)
    poison(64 << 20)
    out = run(model, inp)
    assert len(gemms) == N_LINEARS and not torch.isnan(out).any()
    assert dict(report.runtime_fallbacks) == {}, str(report)


@pytest.mark.parametrize("fast_accum", ["auto", False])
def test_fidelity_gate_against_fp32(fast_accum):
    model, inp, m32 = _models(1)
    ref = run(m32, _f32(inp))
    fake = run(model, inp)
    qwen_absorb.patch(model, cuda_graph=False, use_fast_accum=fast_accum, **_options())
    real = run(model, inp)
    e_fake, e_real = _rel(fake, ref), _rel(real, ref)
    print(f"fidelity (use_fast_accum={fast_accum!r}): real FP8 {e_real:.5f}, fake quant {e_fake:.5f}, "
          f"ratio {e_real / e_fake:.4f}")
    assert e_real <= 1.05 * e_fake, (e_real, e_fake)


def test_codes_handed_over_bit_identical(monkeypatch):
    model, inp, _ = _models(2)
    qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    poison(64 << 20)
    direct = run(model, inp)  # unhooked: the runner's GEMMs read the codes the fused kernels emitted

    seen, used, quantized = spy_fp8_linears(model, monkeypatch)
    poison(64 << 20)
    hooked = run(model, inp)
    assert len(used) == N_LINEARS
    assert len(quantized) == N_LINEARS  # hooked: each linear quantizes what it receives (the kernel)
    for key, codes in used:
        lin = model.transformer_blocks[key[0]].get_submodule(key[1])
        want = ops.quantize_fp8_reference(seen[key], lin.input_quantizer._amax)
        diff = int((codes.view(torch.uint8) != want.view(torch.uint8)).sum())
        assert diff == 0, f"{key}: {diff} of {codes.numel()} codes differ"
    assert torch.equal(hooked, direct)


def test_fused_quant_layer_norms_bit_identical_without_fp8():
    model, inp, _ = _models(3)
    want = run(model, inp)
    report = qwen_absorb.patch(model, fp8_gemm=False, cuda_graph=False)
    assert report.summary["sites_on_kernels"] == 5 * LAYERS, str(report)
    poison(64 << 20)
    assert torch.equal(run(model, inp), want)


def test_norm_input_quantizers_run_inside_the_kernels(monkeypatch):
    """The QuantLayerNorm input fake quantization runs inside norm1's and norm2's kernels (no quantizer
    call), bit-identical to ModelOpt's; a hooked quantizer runs as its module (its hook sees the call)."""
    model, inp, _ = _models(4)
    want = run(model, inp)
    launched = []
    for name in ("ln_scale_launch", "tgrln_launch"):
        fn = getattr(site_runners, name)

        def spy(*a, _fn=fn, _name=name, **k):
            launched.append((_name, k.get("norm_input_quant") is not None))
            return _fn(*a, **k)

        monkeypatch.setattr(site_runners, name, spy)
    qwen_absorb.patch(model, fp8_gemm=False, cuda_graph=False)
    poison(64 << 20)
    assert torch.equal(run(model, inp), want)
    assert sorted(launched) == sorted([("ln_scale_launch", True), ("tgrln_launch", True)] * LAYERS), launched
    calls = []
    model.transformer_blocks[1].img_norm2.input_quantizer.register_forward_hook(lambda m, a, o: calls.append(1))
    launched.clear()
    poison(64 << 20)
    assert torch.equal(run(model, inp), want)
    assert calls == [1] and launched.count(("tgrln_launch", True)) == LAYERS - 1, launched


@pytest.mark.parametrize("flex", [False, True])
def test_kv_cache_extract_then_cached(gemms, flex):
    model, inp, m32 = _models(4, flex=flex)
    inp_c = model_inputs(model, cond=True, seed=60, target=TARGET)
    ref = run_kv(m32, _f32(inp), _f32(inp_c))
    fake = run_kv(model, inp, inp_c)
    report = qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    real = run_kv(model, inp, inp_c)
    assert len(gemms) == 2 * N_LINEARS
    assert dict(report.runtime_fallbacks) == {}, str(report)
    for r, f, e in zip(real, fake, ref):
        assert _rel(r, e) <= 1.1 * _rel(f, e), (_rel(r, e), _rel(f, e))


def test_patched_on_cpu_then_moved_to_cuda(gemms):
    model, inp, _ = _models(5, device="cpu")
    report = qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    assert report.summary["fp8_gemm_linears"] == 0  # on the CPU without capabilities={"cpu"}: refused
    model.to(DEV)
    inp = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    run(model, inp)
    assert len(gemms) == N_LINEARS
    assert report.summary["fp8_gemm_linears"] == N_LINEARS, str(report)


def test_unpatch_restores_fake_quant_bit_for_bit():
    model, inp, _ = _models(6)
    want = run(model, inp)
    qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    assert not torch.equal(run(model, inp), want)
    qwen_absorb.unpatch(model)
    assert not any(isinstance(m.__dict__.get("forward"), F8.Fp8LinearForward) for m in model.modules())
    assert torch.equal(run(model, inp), want)
