"""GPU tests of the patched Qwen-Image-2.1 attention: with head_dim 128 the q/k RMSNorm + RoPE run as one
``qk_norm_rope`` launch, and the patched model stays bit-identical to diffusers' in every KV-cache mode
and dtype (outputs poisoned: the caching allocator hands out NaN-filled blocks)."""

from __future__ import annotations

import pytest
import torch

from qwen_absorb import attention21

from .ops_helpers import poison_allocator, skip_module_without_kernels
from .qwenimage21_helpers import fallback_counts, installed, model_inputs, run, run_kv, tiny_model
from .test_qwenimage21_gpu import same

pytestmark = [pytest.mark.gpu]
skip_module_without_kernels()

DEV = "cuda"
SHAPE = dict(heads=2, head_dim=128, axes=(16, 56, 56))


@pytest.fixture
def qk_launches(monkeypatch):
    n = []
    fn = attention21.qkr_launch

    def counting(xs, *a, **k):
        n.append(xs[0].shape[0] * xs[0].shape[1] * xs[0].shape[2])
        return fn(xs, *a, **k)

    monkeypatch.setattr(attention21, "qkr_launch", counting)
    return n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qk_kernel_in_the_patched_attention_is_exact(dtype, qk_launches):
    model = tiny_model(dtype=dtype, device=DEV, seed=5, gain=4.0, layers=2, **SHAPE)
    cases = {
        "text_target": model_inputs(model, batch_size=1, seed=1, target=(8, 8)),
        "condition_batch2_padded": model_inputs(model, batch_size=2, cond=True, pad=2, seed=2, target=(8, 6)),
    }
    prefill = model_inputs(model, batch_size=2, cond=True, pad=1, seed=3, target=(8, 8), timestep=0.9)
    decode = model_inputs(model, batch_size=2, cond=True, pad=1, seed=3, target=(8, 8), timestep=0.4)
    refs = {k: run(model, v) for k, v in cases.items()}
    ref_kv = run_kv(model, prefill, decode)
    poison_allocator(1 << 26)
    with installed(model, DEV) as decisions:
        assert all(d.own_attention and d.qk_fused for d in decisions), [d.qk_reasons for d in decisions]
        outs = {k: run(model, v) for k, v in cases.items()}
        out_kv = run_kv(model, prefill, decode)
    for k in cases:
        same(outs[k], refs[k], f"{dtype} {k}")
    same(out_kv[0], ref_kv[0], f"{dtype} kv extract")
    same(out_kv[1], ref_kv[1], f"{dtype} kv cached")
    assert fallback_counts(decisions, allowed=()) == {}
    min_rows = decisions[0].qk_min_rows
    assert qk_launches and all(r >= min_rows for r in qk_launches)
    assert len(qk_launches) == 4 * len(model.transformer_blocks)  # every call had enough rows


def test_full_width_block_attention_exact():
    """One full-size-width block (hidden 4096, 32 heads, 1024 target tokens): the shapes the benchmark runs."""
    model = tiny_model(dtype=torch.bfloat16, device=DEV, seed=9, layers=1, heads=32, head_dim=128,
                       axes=(16, 56, 56))
    inputs = model_inputs(model, batch_size=1, seed=4, target=(32, 32))
    ref = run(model, inputs)
    poison_allocator(1 << 26)
    with installed(model, DEV) as decisions:
        out = run(model, inputs)
    same(out, ref, "hidden 4096")
    assert decisions[0].qk_fused and fallback_counts(decisions, allowed=()) == {}
