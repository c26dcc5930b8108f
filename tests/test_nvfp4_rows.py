"""NVFP4 as rows at the sites (issue 39 B), on CPU: the site that produces an NVFP4 linear's input emits its
NVFP4 fake quantization (norm1 -> q/k/v, attn_residual -> net[0].proj, the cross-block residual -> the next norm1),
the launches between sites quantize with their activation (SiLU -> img_mod.1 / txt_mod.1, GELU -> net[2], the
attention output -> the output projections), and every such linear is one ``F.linear(fq(x), fq(W), bias)``.
References on CPU: patched equals ModelOpt's fake quantization (its reference kernel) bit for bit."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

import qwen_absorb  # noqa: E402
from qwen_absorb import nvfp4  # noqa: E402
from qwen_absorb import site_runners as R  # noqa: E402
from . import builders as T  # noqa: E402
from qwen_absorb.ops import quantize_nvfp4_reference  # noqa: E402
from qwen_absorb.plan import PLAN_ATTR  # noqa: E402
from qwen_absorb.sites import LINEAR_TABLE  # noqa: E402

EMITTING = {"img.norm1", "txt.norm1", "img.attn_residual", "txt.attn_residual"}


def _nvfp4_model(num_layers=4, seed=0, keep=1):
    from qwen_absorb import modelopt_recipe as recipe  # noqa: PLC0415

    model = T.tiny_transformer(num_layers=num_layers, dtype=torch.bfloat16, seed=seed)
    calib = T.transformer_inputs(model, seed=seed + 100)
    recipe.quantize(model, recipe.nvfp4_recipe_config(model, keep_first=keep, keep_last=keep),
                    lambda m: T.run_transformer(m, calib))
    return model


def _modelopt(model, inputs):
    with nvfp4.modelopt_fake_quant_on_cpu():
        return T.run_transformer(model, inputs)


def _quantized_blocks(model):
    return [b for b in model.transformer_blocks if b.__dict__[PLAN_ATTR].nvfp4]


@pytest.mark.parametrize("cross_block", [True, False])
def test_sites_emit_nvfp4_and_the_patch_is_modelopt_bit_for_bit(monkeypatch, cross_block, seed):
    model = _nvfp4_model(seed=seed % 1000)
    cases = [T.transformer_inputs(model, batch_size=2, seed=seed + 1),
             T.transformer_inputs(model, batch_size=1, masked_tail=0, seed=seed + 2, height=2, width=6)]
    wants = [_modelopt(model, c) for c in cases]
    per_linear, emitted = [], []
    real_call = nvfp4.Nvfp4Linear.__call__
    monkeypatch.setattr(nvfp4.Nvfp4Linear, "__call__", lambda self, x: per_linear.append(self) or real_call(self, x))
    for name in ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift", "quantize_nvfp4"):
        real = getattr(R, name)

        def spy(*a, _real=real, _name=name, **k):
            args = inspect.signature(_real).bind(*a, **k).arguments
            q4 = args.get("nvfp4_amax", args.get("amax"))
            emitted.append((_name, q4 is not None, args.get("act")))
            return _real(*a, **k)

        monkeypatch.setattr(R, name, spy)  # before the patch: the plan looks the site runners up
    report = qwen_absorb.patch(model, capabilities={"cpu"}, cross_block=cross_block)
    blocks = _quantized_blocks(model)
    assert len(blocks) == 2, report
    for blk in blocks:
        plan = blk.__dict__[PLAN_ATTR]
        assert {sp.key for sp in plan.sites if sp.emit == "nvfp4"} == EMITTING
        assert {p for p, lp in plan.linears.items() if lp.quant == "nvfp4"} == set(LINEAR_TABLE)
        # the bias stays in the GEMM (as ModelOpt adds it): nothing deferred
        assert not any(sp.bias_deferred for sp in plan.sites)
    for c, want in zip(cases, wants):
        got = T.run_transformer(model, c)  # no ModelOpt NVFP4 call: it would fail on CPU
        assert torch.equal(got, want)
    assert per_linear == []  # no linear quantized its own input: every one read an emission
    assert ("bias_residual_layer_norm_scale_shift", True, None) in emitted
    assert {e[2] for e in emitted if e[0] == "quantize_nvfp4"} == {"silu", "gelu_tanh", None}
    # with the hand-off the quantized blocks' norm1 runs in the previous block's residual op (its emission too)
    assert (("layer_norm_scale_shift", True, None) in emitted) is not cross_block
    plan1 = blocks[0].__dict__[PLAN_ATTR]
    assert not blocks[1].__dict__[PLAN_ATTR].handoff_in_reasons
    assert (sum(plan1.rt.handoffs.values()) > 0) is cross_block
    qwen_absorb.unpatch(model)
    assert torch.equal(_modelopt(model, cases[0]), wants[0])


@pytest.mark.parametrize("hooked,site,linears", [
    ("attn.to_k", "img.norm1", ("attn.to_q", "attn.to_k", "attn.to_v")),
    ("img_mlp.net.1", "img.attn_residual", ("img_mlp.net.0.proj", "img_mlp.net.2")),
    ("txt_mod", None, ("txt_mod.1",)),
])
def test_a_hook_keeps_the_linears_it_sees_out_of_the_rows(hooked, site, linears, seed):
    """A hook on a linear or on a container the rows would skip: those linears run where the block calls their
    modules (the hook sees the call), their site does not emit for them, the numbers stay ModelOpt's."""
    model = _nvfp4_model(seed=seed % 1000)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    seen = []
    model.transformer_blocks[1].get_submodule(hooked).register_forward_hook(lambda m, a, o: seen.append(1))
    want = _modelopt(model, inputs)
    seen.clear()
    qwen_absorb.patch(model, capabilities={"cpu"})
    plan = model.transformer_blocks[1].__dict__[PLAN_ATTR]
    with nvfp4.modelopt_fake_quant_on_cpu():  # what runs as its module is ModelOpt's
        got = T.run_transformer(model, inputs)
    assert torch.equal(got, want) and seen == [1]
    if site is not None:
        assert plan.site_plan(site).emit is None
    assert all(plan.linears[p].quant is None for p in linears)
    assert plan.linears["attn.add_q_proj"].quant == "nvfp4"  # the rest keeps its rows


def test_weight_changes_after_patch_remake_the_fake_quantized_weight(seed):
    model = _nvfp4_model(seed=seed % 1000)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    want = _modelopt(model, inputs)
    qwen_absorb.patch(model, capabilities={"cpu"})
    blk = _quantized_blocks(model)[0]
    assert torch.equal(T.run_transformer(model, inputs), want)
    lin = blk.attn.to_q
    with torch.no_grad():
        lin.weight.mul_(-1.5)  # in place
    edited = _modelopt(model, inputs)
    assert not torch.equal(edited, want)
    assert torch.equal(T.run_transformer(model, inputs), edited)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        sd_new = dict(sd)
        k = next(k for k in sd if k.endswith("img_mlp.net.2.weight") and sd[k].shape == blk.img_mlp.net[2].weight.shape
                 and model.get_submodule(k.rsplit(".", 1)[0]) is blk.img_mlp.net[2])
        sd_new[k] = torch.randn(sd[k].shape, generator=g).to(sd[k].dtype) * 0.05
    model.load_state_dict(sd_new)  # copies into the parameters: a version change the watch sees
    loaded = _modelopt(model, inputs)
    assert not torch.equal(loaded, edited)
    assert torch.equal(T.run_transformer(model, inputs), loaded)


def test_patch_again_catches_up_with_a_data_write(seed):
    """A write through ``.data`` in place moves no version: the cached ``fq(W)`` goes on serving the old weight (no
    per-call check sees it, as for the FP8 codes), and ``patch()`` again compares the weight's content with the one
    ``fq(W)`` was made from and remakes it: ModelOpt's bits."""
    model = _nvfp4_model(seed=seed % 1000)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    qwen_absorb.patch(model, capabilities={"cpu"})
    before = T.run_transformer(model, inputs)
    lin = _quantized_blocks(model)[0].img_mlp.net[2]
    with torch.no_grad():
        lin.weight.data.mul_(0.5)
    twin = copy.deepcopy(model)
    qwen_absorb.unpatch(twin)
    want = _modelopt(twin, inputs)  # ModelOpt's fake quantization of the weight as it is now
    assert not torch.equal(want, before)
    assert torch.equal(T.run_transformer(model, inputs), before)  # the limit: unseen per call
    qwen_absorb.patch(model, capabilities={"cpu"})
    assert torch.equal(T.run_transformer(model, inputs), want)
    qwen_absorb.patch(model, capabilities={"cpu"})  # nothing changed since: the runners' fq(W) are kept
    rows = [r for b in _quantized_blocks(model) for r in b.__dict__[PLAN_ATTR].nvfp4.values()]
    assert rows and not any(r.content_changed() for r in rows)
    prev = T.run_transformer(model, inputs)
    for m in (model, twin):  # ModelOpt's own setter writes the amax through .data too
        q = m.get_submodule(_path_of(model, lin) + ".weight_quantizer")
        q.amax = q.amax * 0.7
    want = _modelopt(twin, inputs)
    assert not torch.equal(want, prev)
    qwen_absorb.patch(model, capabilities={"cpu"})
    assert torch.equal(T.run_transformer(model, inputs), want)


def _path_of(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def test_unpatch_restores_the_exact_state_dict(seed):
    model = _nvfp4_model(seed=seed % 1000)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    sd = model.state_dict(keep_vars=True)
    values = {k: v.detach().clone() for k, v in sd.items()}
    qwen_absorb.patch(model, capabilities={"cpu"})
    T.run_transformer(model, inputs)
    qwen_absorb.unpatch(model)
    sd2 = model.state_dict(keep_vars=True)
    assert list(sd2) == list(sd) and all(sd2[k] is sd[k] for k in sd)
    assert all(torch.equal(sd2[k].detach(), values[k]) for k in sd)


def test_on_grid_weights_are_shared_not_copied(seed):
    """An export's weights are already on the NVFP4 grid: the fake-quantized weight is the weight itself."""
    model = _nvfp4_model(seed=seed % 1000)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    with torch.no_grad():
        for name in nvfp4.nvfp4_linear_names(model):
            lin = model.get_submodule(name)
            lin.weight.copy_(quantize_nvfp4_reference(lin.weight, lin.weight_quantizer._amax))
    want = _modelopt(model, inputs)
    qwen_absorb.patch(model, capabilities={"cpu"})
    assert torch.equal(T.run_transformer(model, inputs), want)
    rows = [lp.nvfp4 for b in _quantized_blocks(model) for lp in b.__dict__[PLAN_ATTR].linears.values()]
    assert rows and all(r is not None and r.shares_weight and r.extra_bytes() == 0 for r in rows)
    assert all(r.weight().data_ptr() == r.lin.weight.data_ptr() for r in rows)


def test_lora_on_an_nvfp4_linear_is_unpatched_bit_for_bit(seed):
    """A PEFT LoRA on NVFP4 linears: the adapted linears run as their (ModelOpt + PEFT) modules, their sites do not
    emit for them (the reason is in their plans), the rest keeps its rows; the output is the unpatched model's (biases in
    their GEMMs: a deferred bias would be added after the LoRA branches, another rounding)."""
    from peft import LoraConfig  # noqa: PLC0415

    model = _nvfp4_model(seed=seed % 1000)
    model.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "net.2"],
                                 init_lora_weights=False), adapter_name="a")
    inputs = T.transformer_inputs(model, seed=seed + 1)
    want = _modelopt(model, inputs)
    qwen_absorb.patch(model, capabilities={"cpu"}, defer_bias=False)
    with nvfp4.modelopt_fake_quant_on_cpu():
        got = T.run_transformer(model, inputs)
    assert torch.equal(got, want)
    plan = _quantized_blocks(model)[0].__dict__[PLAN_ATTR]
    assert plan.site("img", "norm1").emit is None and plan.linears["attn.to_q"].quant is None
    assert plan.site("txt", "norm1").emit == "nvfp4"  # add_q/k/v carry no adapter


def test_inference_mode_weights_are_fake_quantized_once_and_followed_by_the_watch(monkeypatch, seed):
    """Weights made under ``torch.inference_mode()`` (an export loaded there) have no version counter: a patched
    block's NVFP4 runners trust the plan's watch (their content compared before every call) instead of remaking
    ``fq(W)`` at every call; an in-place edit is still followed, bit for bit ModelOpt."""
    model = _nvfp4_model(seed=seed % 1000)
    with torch.inference_mode():  # Parameters made there (an export loaded there): inference tensors, no version
        for m in model.modules():
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
    with pytest.raises(RuntimeError):
        model.transformer_blocks[1].attn.to_q.weight._version  # noqa: B018 - what makes them version-less
    inputs = T.transformer_inputs(model, seed=seed + 1)
    want = _modelopt(model, inputs)
    qwen_absorb.patch(model, capabilities={"cpu"})
    weights = {m.weight.data_ptr() for b in _quantized_blocks(model) for m in b.__dict__[PLAN_ATTR].nvfp4}
    made = []
    real = nvfp4._fake_quant
    monkeypatch.setattr(nvfp4, "_fake_quant", lambda t, *a: made.append(t.data_ptr() in weights) or real(t, *a))
    assert torch.equal(T.run_transformer(model, inputs), want)
    first = sum(made)
    assert first == len(weights)  # each weight once
    made.clear()
    assert torch.equal(T.run_transformer(model, inputs), want)
    assert sum(made) == 0  # not remade: the watch vouched for them
    lin = _quantized_blocks(model)[0].attn.to_q
    with torch.inference_mode():
        lin.weight.mul_(-1.5)
    edited = _modelopt(model, inputs)
    assert not torch.equal(edited, want)
    assert torch.equal(T.run_transformer(model, inputs), edited)
