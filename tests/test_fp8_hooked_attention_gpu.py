"""GPU tests of issue 19: a hooked attention runs as its module (diffusers' processor) and its ModelOpt FP8
linears run real FP8 GEMMs through gated forwards, fed by the quantize kernel. The fused path (norm1
emitting the codes, the fused q/k RMSNorm + RoPE where probed exact, the split quantize of the attention
output) and the hooked path quantize the same bf16 values, so a pass-through hook changes no bit.
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import fp8_forward
from . import builders as T
from qwen_absorb.ops import _runtime

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 GEMMs need sm_89+", allow_module_level=True)
pytest.importorskip("modelopt.torch.quantization")

DEV = "cuda"
LAYERS = 3
PER_BLOCK = 14


def _fp8(seed: int, **geometry):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=LAYERS).to(DEV)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1, device=DEV, **geometry)])
    return model, T.transformer_inputs(model, seed=seed + 2, device=DEV, **geometry)


def _spy(monkeypatch):
    counts = collections.Counter()
    orig_mm, orig_gemm = torch._scaled_mm, fp8_forward.Fp8LinearForward.gemm

    def mm(*a, **k):
        counts["total"] += 1
        return orig_mm(*a, **k)

    def gemm(fwd, codes):
        counts[(fwd.index, fwd.path)] += 1
        return orig_gemm(fwd, codes)

    monkeypatch.setattr(torch, "_scaled_mm", mm)
    monkeypatch.setattr(fp8_forward.Fp8LinearForward, "gemm", gemm)
    return counts


@pytest.mark.parametrize("batch", [1, 2])
def test_hooked_attention_bit_identical_on_gpu(seed, monkeypatch, batch):
    model, inp = _fp8(seed, batch_size=batch, height=8, width=8, text_len=11)
    report = qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    s = report.summary
    assert s["fp8_gemm_linears"] == PER_BLOCK * LAYERS and s["fp8_forward_linears"] == 8 * LAYERS, str(report)
    counts = _spy(monkeypatch)
    want = T.run_transformer(model, inp)
    assert counts["total"] == PER_BLOCK * LAYERS and len(counts) == 1  # the fused path, no gated forward
    hooks = [b.attn.register_forward_hook(lambda m, a, o: None) for b in model.transformer_blocks]
    T.run_transformer(model, inp)  # decides anew for the hook, builds the gated FP8 weights
    counts.clear()
    out = T.run_transformer(model, inp)
    torch.cuda.synchronize()
    assert torch.equal(out, want), (out.float() - want.float()).abs().max().item()
    assert counts["total"] == PER_BLOCK * LAYERS
    assert {k: v for k, v in counts.items() if k != "total"} == {
        (i, p): 1 for i in range(LAYERS) for p in fp8_forward.ATTN_LINEARS}
    assert report.summary["hooked_attention_fp8_blocks"] == LAYERS
    assert not any("real-FP8 linear" in r for r in report.runtime_fallbacks), dict(report.runtime_fallbacks)
    for h in hooks:
        h.remove()
    T.run_transformer(model, inp)
    assert torch.equal(T.run_transformer(model, inp), want)


def test_taylorseer_warmup_steps_bit_identical_on_gpu(seed):
    from diffusers import TaylorSeerCacheConfig

    model, inp = _fp8(seed, height=8, width=8)
    plain = copy.deepcopy(model)
    qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    qwen_absorb.patch(plain, fp8_gemm=True, cuda_graph=False)
    want = T.run_transformer(plain, inp)
    model.enable_cache(TaylorSeerCacheConfig(cache_interval=5, disable_cache_before_step=10))
    with torch.no_grad():
        for _ in range(3):  # warm-up steps: every attention computes, through the hooked path
            with model.cache_context("cond"):
                out = model(**inp)[0]
            assert torch.equal(out, want)
    # the block runs the cache around its own attention (qwen_absorb.taylorseer), no gated forward
    assert qwen_absorb.patch_report(model).summary["hooked_attention_fp8_blocks"] == 0
    assert qwen_absorb.patch_report(model).summary["taylorseer_attention_blocks"] == LAYERS
