"""patch with diffusers/accelerate hooks, caches, offloading, PEFT LoRA and torch.compile."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch.nn.modules import module as M

import qwen_absorb
from qwen_absorb import hooks
from . import builders as T


def _cache_run(model, inputs_list):
    outs = []
    with torch.no_grad():
        for i, kw in enumerate(inputs_list):
            with model.cache_context("cond"):
                outs.append(model(**kw)[0])
    return outs


@pytest.mark.parametrize("order", ["patch-then-cache", "cache-then-patch"])
def test_first_block_cache(order, seed):
    from diffusers import FirstBlockCacheConfig

    model = T.tiny_transformer(seed=seed, num_layers=3)
    # steps whose inputs barely change, so the cache skips blocks on later calls
    base = T.transformer_inputs(model, seed=seed + 1)
    steps = []
    for k in range(3):
        kw = dict(base)
        kw["hidden_states"] = base["hidden_states"] + 1e-4 * k
        steps.append(kw)
    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    ref = _cache_run(model, steps)
    model.disable_cache()

    if order == "patch-then-cache":
        report = qwen_absorb.patch(model)
        model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    else:
        model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
        report = qwen_absorb.patch(model)
        assert report.blocks[0].install.startswith("diffusers hook")
    blk = model.transformer_blocks[0]
    assert blk._diffusers_hook.hooks, "the cache hooks must survive patching"
    assert getattr(blk.forward, "__func__", None) is None  # still the hook wrapper on top
    outs = _cache_run(model, steps)
    assert report.runtime_fallbacks  # the patched forward did run under the hooks
    for a, b in zip(outs, ref):
        assert torch.equal(a, b)
    qwen_absorb.unpatch(model)
    model._reset_stateful_cache()
    for a, b in zip(_cache_run(model, steps), ref):
        assert torch.equal(a, b)
    model.disable_cache()  # diffusers leaves the original bound forward as an instance attribute
    assert all(getattr(b.forward, "__func__", None) is type(b).forward for b in model.transformer_blocks)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_group_offloading(offload_type, order, seed):
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    ref = T.run_transformer(model, inputs)
    kw = dict(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"), offload_type=offload_type)
    if offload_type == "block_level":
        kw["num_blocks_per_group"] = 1
    if order == "before":
        qwen_absorb.patch(model)
        model.enable_group_offload(**kw)
    else:
        model.enable_group_offload(**kw)
        qwen_absorb.patch(model)
    assert torch.equal(T.run_transformer(model, inputs), ref)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inputs), ref)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("order", ["before", "after"])
def test_accelerate_cpu_offload_meta_weights(quantized, order, seed):
    """accelerate's cpu_offload keeps every weight on the meta device outside its own module's
    forward; the fused path reads some of them without calling their module (q/k norm weights, deferred
    biases, amax), so every block runs diffusers' forward, saying why (block.WEIGHT_HOOK_FALLBACK).
    Outputs stay correct."""
    from accelerate import cpu_offload

    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    if quantized:
        T.fp8_quantize(model, inputs)
    ref = T.run_transformer(model, inputs)
    if order == "before":
        report = qwen_absorb.patch(model, capabilities={"cpu"})
        cpu_offload(model, execution_device=torch.device("cpu"))
    else:
        cpu_offload(model, execution_device=torch.device("cpu"))
        report = qwen_absorb.patch(model, capabilities={"cpu"})
    assert model.transformer_blocks[0].attn.to_out[0]._parameters["bias"].device.type == "meta"
    out = T.run_transformer(model, inputs)
    refused = [r for r in report.runtime_fallbacks if "accelerate hook inside the block" in r]
    assert refused and sum(report.runtime_fallbacks[r] for r in refused) == len(model.transformer_blocks)
    assert torch.equal(out, ref)


def test_accelerate_hook_on_block_before_and_after(seed):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Counting(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Counting.calls += 1
            return args, kwargs

    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    ref = T.run_transformer(model, inputs)
    add_hook_to_module(model.transformer_blocks[0], Counting())
    report = qwen_absorb.patch(model)
    assert report.blocks[0].install == "accelerate _old_forward"
    add_hook_to_module(model.transformer_blocks[1], Counting())  # after patching
    assert torch.equal(T.run_transformer(model, inputs), ref)
    assert Counting.calls == 2
    assert report.runtime_fallbacks  # patched forwards ran inside the hooks
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inputs), ref)
    assert Counting.calls == 4
    for b in model.transformer_blocks:
        remove_hook_from_module(b)
        assert getattr(b.forward, "__func__", None) is type(b).forward


@pytest.mark.parametrize("quantized", [False, True])
def test_peft_lora_on_projections(quantized, seed):
    from peft import LoraConfig

    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    if quantized:
        T.fp8_quantize(model, inputs)
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_out.0", "to_add_out", "net.2"],
                                 init_lora_weights=False))
    lin = model.transformer_blocks[0].attn.to_out[0]
    assert hasattr(lin, "base_layer")
    ref = T.run_transformer(model, inputs)
    report = qwen_absorb.patch(model, capabilities={"cpu"})
    info = report.blocks[0].projections["attn.to_out.0"]
    assert info.peft_wrapped and info.modelopt == quantized
    out = T.run_transformer(model, inputs)
    if quantized:
        assert report.summary["biases_deferred"] == 8
        assert lin.base_layer.bias is lin.base_layer._parameters["bias"] is not None
        rel = (out - ref).float().pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()
        assert rel <= 2e-3
    else:
        assert report.summary["biases_deferred"] == 0
        assert torch.equal(out, ref)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inputs), ref)


def test_peft_lora_bias_refuses_deferral(seed):
    from peft import LoraConfig

    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    T.fp8_quantize(model, inputs)
    model.add_adapter(LoraConfig(r=2, target_modules=["to_out.0"], lora_bias=True))
    report = qwen_absorb.patch(model, defer_bias=True)
    s = report.blocks[0].site("img", "attn_residual")
    assert not s.bias_deferred and any("lora_bias" in r for r in s.defer_reasons)
    assert report.blocks[0].site("txt", "attn_residual").bias_deferred


@pytest.mark.parametrize("quantized", [False, True])
def test_compile_repeated_blocks(quantized, seed):
    torch._dynamo.reset()
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    if quantized:
        T.fp8_quantize(model, inputs)
    ref = T.run_transformer(model, inputs)
    qwen_absorb.patch(model, capabilities={"cpu"})
    deferred_eager = T.run_transformer(model, inputs)
    # aot_eager keeps eager numerics: the compiled patched model must equal the eager patched one
    model.compile_repeated_blocks(backend="aot_eager", fullgraph=False)
    out = T.run_transformer(model, inputs)
    assert torch.equal(out, deferred_eager)
    if not quantized:
        assert torch.equal(out, ref)
    torch._dynamo.reset()


def test_compile_repeated_blocks_inductor(seed):
    torch._dynamo.reset()
    model = T.tiny_transformer(seed=seed)
    inputs = T.transformer_inputs(model, seed=seed + 1)
    ref = T.run_transformer(model, inputs)
    qwen_absorb.patch(model)
    model.compile_repeated_blocks()
    out = T.run_transformer(model, inputs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # inductor fuses and reorders fp32 math
    torch._dynamo.reset()


class _Holder:
    pass


def _held():
    return hooks.HeldGlobalHooks(lambda: [M.register_module_module_registration_hook(lambda *a: None)])


def test_a_hook_whose_last_holder_died_in_a_registration_goes_at_the_next_collection():
    """The last holder collected inside torch's walk of its registration hooks: the hook waits out the walk, then
    goes at the next garbage collection (it stayed registered until some later hold or release, which may never
    come: every module built afterwards called into it)."""
    box = [_Holder()]

    def collect_inside(module, name, sub):
        box.clear()
        gc.collect()  # the holder's finalizer runs here, inside torch's walk

    gc.collect()  # models of earlier tests waiting for collection hold hooks until then
    before = dict(M._global_module_registration_hooks)
    handle = M.register_module_module_registration_hook(collect_inside)  # walked before the held hook
    held = _held()
    held.hold(box[0])
    try:
        torch.nn.Module().child = torch.nn.Linear(2, 2)  # (a removal inside the walk raised here)
    finally:
        handle.remove()
    assert len(M._global_module_registration_hooks) == len(before) + 1  # waited out the walk
    gc.collect()
    assert dict(M._global_module_registration_hooks) == before and not held._handles


def test_a_release_while_another_thread_walks_the_registration_hooks_waits():
    """The last holder released while another thread is inside torch's walk of the registration hooks: removing
    the hook then made that thread's ``module.child = ...`` raise "OrderedDict mutated during iteration"."""
    inside, go, errors = threading.Event(), threading.Event(), []

    def wait_inside(module, name, sub):
        if name == "walking":
            inside.set()
            go.wait(10)

    def assign():
        try:
            torch.nn.Module().walking = torch.nn.Linear(2, 2)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    gc.collect()  # models of earlier tests waiting for collection hold hooks until then
    before = dict(M._global_module_registration_hooks)
    handle = M.register_module_module_registration_hook(wait_inside)  # walked before the held hook
    held, holder = _held(), _Holder()
    held.hold(holder)
    thread = threading.Thread(target=assign)
    try:
        thread.start()
        assert inside.wait(10)
        held.release(holder)
    finally:
        go.set()
        thread.join(10)
        handle.remove()
    assert not errors
    gc.collect()
    assert dict(M._global_module_registration_hooks) == before and not held._handles
