"""CPU tests of the patched Qwen-Image-2.1 attention (qwen_absorb.attention21): the replicated segment
processor is bit-identical to diffusers' in every KV-cache mode, it is the path that runs, and whatever
it cannot vouch for (flex processor, hooks on the attention or its q/k norms, a processor or norm
swapped after deciding) runs diffusers' attention module, counted."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21FlexAttnProcessor

import qwen_absorb
from qwen_absorb import attention21

from .ops_helpers import assert_bit_identical
from .qwenimage21_helpers import fallback_counts, installed, model_inputs, run, run_kv, tiny_model


@pytest.fixture
def calls(monkeypatch):
    """How often the replicated attention ran, and how often diffusers' processor did."""
    n = {"ours": 0, "diffusers": 0}
    ours = attention21.run

    def counting(*a, **k):
        n["ours"] += 1
        return ours(*a, **k)

    monkeypatch.setattr(attention21, "run", counting)
    proc_cls = attention21.attention21_functions()[3]
    theirs = proc_cls.__call__

    def counting_proc(self, *a, **k):
        n["diffusers"] += 1
        return theirs(self, *a, **k)

    monkeypatch.setattr(proc_cls, "__call__", counting_proc)
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_replicated_attention_runs_and_is_exact_in_every_cache_mode(dtype, calls, seed):
    model = tiny_model(dtype=dtype, seed=seed % 1000, gain=4.0, layers=3)
    prefill = model_inputs(model, batch_size=2, cond=True, pad=1, seed=seed, target=(2, 2), timestep=0.9)
    decode = model_inputs(model, batch_size=2, cond=True, pad=1, seed=seed + 1, target=(2, 2), timestep=0.4)
    plain = model_inputs(model, batch_size=1, seed=seed + 2, target=(2, 6))
    ref_kv = run_kv(model, prefill, decode)
    ref = run(model, plain)
    calls["diffusers"] = 0
    with installed(model, "cpu") as decisions:
        assert all(d.own_attention for d in decisions), [d.qk_reasons for d in decisions]
        assert all(not d.qk_fused and "the fused kernels cannot run here" in d.qk_reasons for d in decisions)
        out_kv = run_kv(model, prefill, decode)
        out = run(model, plain)
    assert_bit_identical(out_kv[0], ref_kv[0], "kv extract")
    assert_bit_identical(out_kv[1], ref_kv[1], "kv cached")
    assert_bit_identical(out, ref, "text + target")
    assert calls == {"ours": 3 * 3, "diffusers": 0}
    assert fallback_counts(decisions) == {}


def test_flex_processor_runs_as_its_module(calls, seed):
    model = tiny_model(dtype=torch.float32, seed=seed % 1000, flex=True)
    inputs = model_inputs(model, batch_size=1, seed=seed)
    ref = run(model, inputs)
    with installed(model, "cpu") as decisions:
        out = run(model, inputs)
    assert_bit_identical(out, ref, "flex")
    assert calls["ours"] == 0
    assert all(not d.own_attention and any("QwenImage21FlexAttnProcessor" in r for r in d.qk_reasons) for d in decisions)


def test_changes_after_deciding_run_diffusers_attention(calls, seed):
    model = tiny_model(dtype=torch.bfloat16, seed=seed % 1000, gain=4.0)
    inputs = model_inputs(model, batch_size=2, cond=True, pad=2, seed=seed)
    ref = run(model, inputs)
    blk = model.transformer_blocks[0]
    seen = []
    with installed(model, "cpu") as decisions:
        # a hook on a q/k/v linear is fine: the replicated attention calls the linears as modules
        h = blk.attn.to_k.register_forward_hook(lambda m, a, o: seen.append(o.shape))
        try:
            assert_bit_identical(run(model, inputs), ref, "hook on to_k")
        finally:
            h.remove()
        assert len(seen) == 1 and calls["ours"] == 2 and fallback_counts(decisions) == {}
        # an editing hook on norm_q: diffusers' attention runs (the hook's edit applies)
        h = blk.attn.norm_q.register_forward_hook(lambda m, a, o: o * 2)
        try:
            with torch.no_grad():
                edited = run(model, inputs)
        finally:
            h.remove()
        assert any("q/k norms changed or hooked" in k for k in fallback_counts(decisions))
        assert not torch.equal(edited, ref)
        # the processor swapped after deciding
        old = blk.attn.processor
        blk.attn.set_processor(QwenImage21FlexAttnProcessor())
        try:
            n = calls["ours"]
            assert_bit_identical(run(model, inputs), run_unpatched_like(model, inputs), "flex later")
            assert calls["ours"] == n + 1  # block 1 still replicated, block 0 ran the flex processor
        finally:
            blk.attn.set_processor(old)
    with torch.no_grad():
        h = blk.attn.norm_q.register_forward_hook(lambda m, a, o: o * 2)
        try:
            assert_bit_identical(edited, run(model, inputs), "editing hook, unpatched")
        finally:
            h.remove()


def run_unpatched_like(model, inputs):
    """The model's output with the current processors, every block unpatched."""
    saved = {b: b.__dict__.pop("forward") for b in model.transformer_blocks if "forward" in b.__dict__}
    try:
        return run(model, inputs)
    finally:
        for b, f in saved.items():
            b.forward = f


def test_report_says_why_qk_is_not_fused_here(seed):
    model = tiny_model(dtype=torch.bfloat16, seed=seed % 1000)
    inputs = model_inputs(model, batch_size=1, seed=seed)
    ref = run(model, inputs)
    report = qwen_absorb.patch(model)
    try:
        assert_bit_identical(run(model, inputs), ref, "patched")
        d = report.to_dict()
        assert d["summary"]["qk_norm_rope_fused_blocks"] == 0
        for b in d["blocks"]:
            assert not b["qk_norm_rope_fused"]
            assert "the fused kernels cannot run here" in b["qk_norm_rope_reasons"]
    finally:
        qwen_absorb.unpatch(model)


def test_an_attention_module_replaced_after_deciding_runs_as_itself(calls, seed):
    """block.attn swapped for another class after deciding (here a subclass with an editing forward): the
    block calls it as a module, counted, and the result is what the swapped model computes unpatched."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21Attention

    class Edited(QwenImage21Attention):
        def forward(self, hidden_states, **kwargs):
            return super().forward(hidden_states, **kwargs) * 0.5

    model = tiny_model(dtype=torch.float32, seed=seed % 1000, gain=4.0)
    inputs = model_inputs(model, batch_size=1, seed=seed)
    blk = model.transformer_blocks[0]
    with installed(model, "cpu") as decisions:
        old = blk.attn
        new = Edited(dim=old.to_q.in_features, heads=old.heads, dim_head=old.inner_dim // old.heads)
        new.load_state_dict(old.state_dict())
        new.set_processor(old.processor)
        blk.attn = new
        try:
            out = run(model, inputs)
            want = run_unpatched_like(model, inputs)
        finally:
            blk.attn = old
        assert any("changed or hooked since patching" in k for k in fallback_counts(decisions))
    assert_bit_identical(out, want, "replaced attention")
    assert not torch.equal(out, run(model, inputs))
