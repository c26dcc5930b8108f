"""GPU tests of the joint q/k/v outputs of the patched Qwen-Image attention (batch 1): the qk kernel writes
q and k, and the FP8 GEMMs of to_v / add_v_proj write v, straight into the [text, image] tensors the
attention reads. The promise: the same bits as concatenating afterwards (``Tuning(joint_outputs=
False)``), and, in bf16, as diffusers itself."""

from __future__ import annotations

import pytest
import torch

import qwen_absorb
from qwen_absorb import attention
from . import builders as T

from .ops_helpers import poison_allocator, skip_module_without_kernels

pytestmark = pytest.mark.gpu
skip_module_without_kernels()

DEV = "cuda"
GEOMETRY = dict(attention_head_dim=128, num_attention_heads=2, axes_dims_rope=(16, 56, 56))


@pytest.fixture
def spy(monkeypatch):
    """Calls of the qk kernel with joint outputs, and of the FP8 GEMMs written in place."""
    n = {"qk_joint": 0, "qk": 0, "v_into": 0}
    qkr, into = attention.qkr_launch, attention.fp8_linear_into

    def qk(xs, w, f, eps, outs=None, **kw):
        n["qk_joint" if outs is not None else "qk"] += 1
        return qkr(xs, w, f, eps, outs, **kw)

    def v(*a, **k):
        n["v_into"] += 1
        return into(*a, **k)

    monkeypatch.setattr(attention, "qkr_launch", qk)
    monkeypatch.setattr(attention, "fp8_linear_into", v)
    return n


def _inputs(model, seed, **kw):
    inp = T.transformer_inputs(model, batch_size=1, seed=seed, height=8, width=8, text_len=20, **kw)
    return {k: (v.to(DEV) if torch.is_tensor(v) else v) for k, v in inp.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bf16_joint_qk_is_diffusers(dtype, spy):
    model = T.tiny_transformer(dtype=dtype, seed=91, **GEOMETRY).to(DEV)
    inp = _inputs(model, 92)
    ref = T.run_transformer(model, inp)
    report = qwen_absorb.patch(model)
    try:
        assert report.summary["qk_norm_rope_fused_blocks"] == 2, str(report)
        poison_allocator(1 << 24)
        out = T.run_transformer(model, inp)
        assert spy["qk_joint"] == 2 and spy["qk"] == 0, spy
        assert torch.equal(out, ref)
    finally:
        qwen_absorb.unpatch(model)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs need sm_89+")
@pytest.mark.parametrize("with_lora", [False, True])
def test_fp8_joint_qkv_equals_concatenation(spy, monkeypatch, with_lora):
    """With a LoRA the v projections' branches are added in place to the joint rows (shared lora_A products
    of the stream included): the same bits as adding them to a separate output and concatenating."""
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=93, **GEOMETRY).to(DEV)
    calib = [_inputs(model, 94)]
    T.fp8_quantize(model, calib)
    if with_lora:
        peft = pytest.importorskip("peft")
        model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=[
            "to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"]))
        g = torch.Generator(device=DEV).manual_seed(96)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g, device=DEV, dtype=p.dtype) * 0.05)
    inp = _inputs(model, 95)
    report = qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False)
    try:
        assert report.summary["fp8_gemm_linears"] == 28, str(report)
        assert report.summary["fp8_gemm_lora_linears"] == (16 if with_lora else 0), str(report)
        poison_allocator(1 << 24)
        joint = T.run_transformer(model, inp)
        assert spy["qk_joint"] == 2 and spy["v_into"] == 4, spy  # 2 blocks x (to_v, add_v_proj)
        qwen_absorb.patch(model, fp8_gemm=True, cuda_graph=False, tuning=qwen_absorb.Tuning(joint_outputs=False))
        poison_allocator(1 << 24)
        cat = T.run_transformer(model, inp)
        assert spy["qk"] == 2 and spy["v_into"] == 4, spy
        assert torch.equal(joint, cat)
        assert torch.isfinite(joint).all()
    finally:
        qwen_absorb.unpatch(model)
