"""patch/unpatch on unquantized tiny transformers: exactness, report, idempotence, state_dict, fallbacks.

On CPU the fused ops run their torch references, which are diffusers' expressions op for op, and
unquantized models keep their biases in the GEMMs: patched outputs must equal unpatched bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

import qwen_absorb
from . import builders as T
from qwen_absorb.report import SITES, STREAMS


def _structure(model):
    return [(n, type(m).__name__, sorted(m.__dict__.get("_parameters", {}))) for n, m in model.named_modules()]


@pytest.mark.parametrize(
    "dtype,zero_cond_t",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False), (torch.bfloat16, True),
     (torch.float16, False)],
)
def test_patched_equals_unpatched_bitwise(dtype, zero_cond_t, seed):
    model = T.tiny_transformer(dtype=dtype, zero_cond_t=zero_cond_t, seed=seed)
    inputs = T.transformer_inputs(model, batch_size=2, seed=seed + 1)
    ref = T.run_transformer(model, inputs)
    structure = _structure(model)
    sd = model.state_dict(keep_vars=True)

    report = qwen_absorb.patch(model)
    assert report.summary["blocks_patched"] == 2
    assert report.summary["sites_fused"] == 12
    assert report.summary["biases_deferred"] == 0
    out = T.run_transformer(model, inputs)
    assert torch.equal(out, ref)
    # a second call with new inputs, other batch and no mask
    inputs2 = T.transformer_inputs(model, batch_size=1, masked_tail=0, seed=seed + 2, height=2, width=6)
    out2 = T.run_transformer(model, inputs2)

    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inputs), ref)
    assert torch.equal(T.run_transformer(model, inputs2), out2)
    assert _structure(model) == structure
    sd2 = model.state_dict(keep_vars=True)
    assert list(sd2) == list(sd) and all(sd2[k] is sd[k] for k in sd)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)
    assert not report.active


def test_patch_changes_the_forward_and_the_ops_are_called(seed, monkeypatch):
    """Guard against a patch that silently does nothing: the fused ops must actually run.

    On CPU the patched block runs each op's torch reference through its site runner
    (qwen_absorb.site_runners), so that is where the calls are counted."""
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed)
    calls = []
    import qwen_absorb.site_runners as blk

    for name in ("layer_norm_scale_shift_reference", "bias_residual_layer_norm_scale_shift_reference",
                 "bias_gate_residual_reference"):
        real = getattr(blk, name)
        monkeypatch.setattr(blk, name, (lambda real, name: lambda *a, **k: calls.append(name) or real(*a, **k))(real, name))
    qwen_absorb.patch(model)
    T.run_transformer(model, inputs)
    # 2 blocks x 2 streams; the cross-block hand-off turns block 0's FFN residual + block 1's norm1
    # into one bias_residual_layer_norm_scale_shift per stream (qwen_absorb.handoff)
    assert calls.count("layer_norm_scale_shift_reference") == 2
    assert calls.count("bias_residual_layer_norm_scale_shift_reference") == 4 + 2
    assert calls.count("bias_gate_residual_reference") == 2
    # and a wrong op would be caught: break one and the output changes
    monkeypatch.setattr(blk, "bias_gate_residual_reference", lambda r, x, *, bias, gate, index=None: r + x)
    qwen_absorb.unpatch(model)
    ref = T.run_transformer(model, inputs)
    qwen_absorb.patch(model)
    assert not torch.equal(T.run_transformer(model, inputs), ref)


def test_report_contents(seed):
    model = T.tiny_transformer(seed=seed)
    report = qwen_absorb.patch(model)
    assert isinstance(report, qwen_absorb.PatchReport)
    assert report.kernels_available is False
    assert report.kernel_unavailable_reasons == ["tensors are on cpu, the kernels need CUDA"]
    assert len(report.blocks) == 2
    for b in report.blocks:
        assert b.patched and b.install == "forward"
        assert {(s.stream, s.site) for s in b.sites} == {(st, si) for st in STREAMS for si in SITES}
        for s in b.sites:
            assert s.fused and not s.reasons
            if s.site == "norm1":
                assert s.projection is None
            else:
                assert s.projection is not None and not s.bias_deferred
                assert any("not ModelOpt-quantized" in r for r in s.defer_reasons)
        assert set(b.projections) == {"attn.to_out.0", "attn.to_add_out", "img_mlp.net.2", "txt_mlp.net.2"}
        assert all(not p.modelopt and p.has_bias for p in b.projections.values())
    d = report.to_dict()
    json.dumps(d)
    assert d["summary"]["sites"] == 12 and d["kernels_available"] is False
    text = str(report)
    assert "blocks patched 2/2" in text and "kernels need CUDA" in text
    T.run_transformer(model, T.transformer_inputs(model, seed=seed))
    assert sum(report.runtime_fallbacks.values()) == 2  # one "ran the references" per block call
    assert all("torch references" in r for r in report.runtime_fallbacks)
    assert "runtime fallbacks" in str(report)
    assert qwen_absorb.patch_report(model) is report


def test_idempotent_and_repatch(seed):
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed)
    ref = T.run_transformer(model, inputs)
    r1 = qwen_absorb.patch(model)
    fwd = model.transformer_blocks[0].forward
    assert qwen_absorb.patch(model) is r1  # same arguments: the current patch stands
    assert model.transformer_blocks[0].forward is fwd
    # other arguments (issue 7): patched anew with them, never silently the first ones
    r2 = qwen_absorb.patch(model, defer_bias=False)
    assert r2 is not r1 and not r1.active and r2.active and r2.defer_bias is False
    assert qwen_absorb.patch_report(model) is r2
    assert torch.equal(T.run_transformer(model, inputs), ref)
    qwen_absorb.unpatch(model)
    qwen_absorb.unpatch(model)  # no-op
    assert qwen_absorb.patch_report(model) is None
    r3 = qwen_absorb.patch(model)
    assert r3 is not r1 and r3.active
    assert torch.equal(T.run_transformer(model, inputs), ref)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inputs), ref)


def test_pipeline_target_and_bad_targets(seed):
    pipe = T.tiny_pipeline(seed=seed)
    report = qwen_absorb.patch(pipe)
    assert qwen_absorb.patch(pipe.transformer) is report
    qwen_absorb.unpatch(pipe)
    with pytest.raises(TypeError, match="QwenImageTransformer2DModel"):
        qwen_absorb.patch(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="defer_bias"):
        qwen_absorb.patch(pipe, defer_bias="yes")
    with pytest.raises(ValueError, match="capabilities"):
        qwen_absorb.patch(pipe, capabilities=[1.5])
    assert qwen_absorb.patch_report(pipe) is None


def test_grad_enabled_runs_original_forward(seed):
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed)
    ref = model(**inputs)[0]
    report = qwen_absorb.patch(model)
    out = model(**inputs)[0]
    assert out.requires_grad and torch.equal(out, ref)
    assert report.runtime_fallbacks["grad enabled: original diffusers forward"] == 2
    out.sum().backward()
    assert model.transformer_blocks[0].img_mod[1].weight.grad is not None


def test_runtime_fallback_is_exact_and_counted(seed):
    """A broadcast batch (temb of batch 1 for activations of batch 2) is legal in diffusers but not
    for the fused ops: every site falls back to the diffusers expression, bit-identically."""
    model = T.tiny_transformer(seed=seed)
    block = model.transformer_blocks[0]
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(2, 16, 64, generator=g)
    ehs = torch.randn(2, 5, 64, generator=g)
    temb = torch.randn(1, 64, generator=g)
    rope = model.pos_embed([(1, 4, 4)], max_txt_seq_len=5, device=torch.device("cpu"))
    kw = dict(hidden_states=hs, encoder_hidden_states=ehs, encoder_hidden_states_mask=None, temb=temb,
              image_rotary_emb=rope)
    with torch.no_grad():
        ref = block(**kw)
        report = qwen_absorb.patch(model)
        out = block(**kw)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    fallbacks = {r: n for r, n in report.runtime_fallbacks.items() if "broadcast batch" in r}
    assert len(fallbacks) == 6 and all(n == 1 for n in fallbacks.values())


def test_custom_processor_gets_joint_attention_kwargs(seed):
    """joint_attention_kwargs reach the processor; a foreign processor blocks deferral but not fusion."""
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    seen = []

    class Recording(QwenDoubleStreamAttnProcessor2_0):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                     attention_mask=None, image_rotary_emb=None, tag=None):
            seen.append(tag)
            return super().__call__(attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                    attention_mask, image_rotary_emb)

    model = T.tiny_transformer(seed=seed)
    model.set_attn_processor(Recording())
    inputs = T.transformer_inputs(model, seed=seed)
    inputs["attention_kwargs"] = {"tag": "x"}
    ref = T.run_transformer(model, inputs)
    report = qwen_absorb.patch(model, defer_bias=True)
    out = T.run_transformer(model, inputs)
    # FFN biases deferred (forced): the bias add leaves the fp32 GEMM, float rounding only
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert seen == ["x"] * 4
    s = report.blocks[0].site("img", "attn_residual")
    assert s.fused and not s.bias_deferred
    assert any("Recording is not QwenDoubleStreamAttnProcessor2_0" in r for r in s.defer_reasons)
    assert report.blocks[0].site("img", "ffn_residual").bias_deferred


@pytest.mark.parametrize("kw", [{"force_reference": "no"}, {"force_reference": 1}, {"cross_block": "false"},
                                {"cross_block": None}])
def test_switches_take_booleans_only(kw):
    """``force_reference="no"`` turned the references on and ``cross_block="false"`` left the hand-off on (bool()
    of any string): a ValueError now, as for every other switch, before anything is patched."""
    model = T.tiny_transformer(seed=0)
    with pytest.raises(ValueError, match="True or False"):
        qwen_absorb.patch(model, **kw)
    assert qwen_absorb.patch_report(model) is None


def test_global_registration_hooks_live_only_while_patched(fake_cuda, seed):
    """The process-wide module / parameter / buffer registration hooks the watches and the graph runner use are
    there while a patched model lives and gone after ``unpatch`` (they stayed for the life of the process, called
    for every module any code built)."""
    import gc

    from torch.nn.modules import module as M

    dicts = ("_global_module_registration_hooks", "_global_parameter_registration_hooks",
             "_global_buffer_registration_hooks")
    gc.collect()  # models of earlier tests still waiting for collection hold the hooks until then
    before = {d: dict(getattr(M, d)) for d in dicts}
    model = T.tiny_transformer(seed=seed)
    qwen_absorb.patch(model, cuda_graph=True)
    T.run_transformer(model, T.transformer_inputs(model, seed=seed + 1))
    from qwen_absorb import watch as W
    from qwen_absorb.cuda_graph import fingerprint as F

    ours = {W._on_module_registered, F._on_registration}
    assert all(ours & set(getattr(M, d).values()) for d in dicts)  # (other live patched models may hold them too)
    qwen_absorb.unpatch(model)
    gc.collect()
    assert {d: dict(getattr(M, d)) for d in dicts} == before
    qwen_absorb.patch(model)  # a model patched again and collected without unpatch: gone with it
    T.run_transformer(model, T.transformer_inputs(model, seed=seed + 1))
    del model
    gc.collect()
    assert {d: dict(getattr(M, d)) for d in dicts} == before


def test_a_holder_collected_inside_a_module_registration_leaves_torch_walking():
    """A watch collected by a garbage collection that runs inside torch's walk of its registration hooks (a module
    assigned while garbage is pending) drops the global hook it held later, not inside that walk: removing it there
    raised "OrderedDict mutated during iteration" from the user's ``module.child = ...``."""
    import gc

    from torch.nn.modules import module as M

    from qwen_absorb import hooks

    held = hooks.HeldGlobalHooks(lambda: [M.register_module_module_registration_hook(lambda *a: None)])

    class Holder:
        pass

    box = [Holder()]
    held.hold(box[0])
    before = dict(M._global_module_registration_hooks)

    def collect_inside(module, name, sub):
        box.clear()
        gc.collect()  # the holder's finalizer runs here, inside torch's walk

    handle = M.register_module_module_registration_hook(collect_inside)
    try:
        parent = torch.nn.Module()
        parent.child = torch.nn.Linear(2, 2)
    finally:
        handle.remove()
    assert isinstance(parent.child, torch.nn.Linear) and held._handles  # still there until the next collection or hold
    other = Holder()
    held.hold(other)  # taken again, not registered twice
    assert dict(M._global_module_registration_hooks) == before
    held.release(other)
    assert not held._handles and len(M._global_module_registration_hooks) == len(before) - 1
