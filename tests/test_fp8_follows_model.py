"""Issue 18: real FP8 that follows the model. CPU, tiny bf16 ModelOpt FP8 models, through the real-FP8
decision path (``fp8_gemm=True, capabilities={"cpu"}``: ``torch._scaled_mm`` has a CPU implementation).

Every user action is checked against a twin that did the same action *before* being patched: both run
the same real-FP8 computation from the same state, so their outputs are bit-identical unless the
patched model serves stale derived state (an old FP8 weight, amax, dtype or bias mode).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import weakref

import pytest
import torch

import qwen_absorb
from qwen_absorb import lora as L
from . import builders as T
from qwen_absorb.block import HOOK_FALLBACK, PatchedForward
from qwen_absorb.plan import PLAN_ATTR

pytest.importorskip("modelopt")
peft = pytest.importorskip("peft")

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}
TARGETS = ["to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
LAYERS = 2


def _fp8(seed: int, dtype=torch.bfloat16):
    model = T.tiny_transformer(dtype=dtype, seed=seed, num_layers=LAYERS)
    inp = T.transformer_inputs(model, seed=seed + 1)
    T.fp8_quantize(model, [inp])
    return model, inp


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _add_lora(model, seed: int, name: str = "default", r: int = 4) -> None:
    model.add_adapter(peft.LoraConfig(r=r, lora_alpha=r, init_lora_weights="gaussian", target_modules=TARGETS),
                      adapter_name=name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # gaussian init leaves lora_B at zero: give the branch a value
        for n, p in model.named_parameters():
            if "lora_B" in n and f".{name}." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _real(model):
    report = qwen_absorb.patch(model, **REAL)
    assert report.summary["fp8_gemm_linears"] == 14 * LAYERS, str(report)
    return report


def _same_after(action, seed, patch_kwargs=REAL, check_real=True):
    """The model patched, then ``action``; its twin ``action`` first, then patched: same outputs."""
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, **patch_kwargs)
    if check_real:
        assert report.summary["fp8_gemm_linears"] == 14 * LAYERS
    before = T.run_transformer(model, inp)
    action(model)
    out = T.run_transformer(model, inp)
    action(twin)
    qwen_absorb.patch(twin, **patch_kwargs)
    want = T.run_transformer(twin, inp)
    assert torch.equal(out, want), _rel(out, want)
    return before, out, report


# ---------------------------------------------------------------------------- stale state


@pytest.mark.slow
def test_load_state_dict_of_another_checkpoint(seed):
    other, _ = _fp8(seed + 7)
    sd = other.state_dict()
    before, out, report = _same_after(lambda m: m.load_state_dict(sd), seed)
    assert _rel(before, out) > 1e-2  # the other checkpoint really runs
    assert report.rebuilds and not report.runtime_fallbacks.get(HOOK_FALLBACK)


@pytest.mark.slow
def test_load_state_dict_assign(seed):
    other, _ = _fp8(seed + 7)
    sd = {k: v.clone() for k, v in other.state_dict().items()}
    _same_after(lambda m: m.load_state_dict(sd, assign=True), seed)


def test_disable_quantizer_after_patching(seed):
    import modelopt.torch.quantization as mtq

    _, out, report = _same_after(lambda m: mtq.disable_quantizer(m, "*to_q.input_quantizer"), seed)
    # q/k/v share one emission: with to_q's input quantizer off, all three run as their modules
    assert report.summary["fp8_gemm_linears"] == 11 * LAYERS, str(report)
    assert "input quantizer: quantizer is disabled" in report.blocks[0].linears["attn.to_q"].fp8_reasons


def _cast(inp, dtype):
    return {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inp.items()}


@pytest.mark.slow
@pytest.mark.parametrize("move", ["half", "float"])
def test_dtype_move_after_patching(seed, move):
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)
    report = _real(model)
    T.run_transformer(model, inp)
    getattr(model, move)()
    getattr(twin, move)()
    inp = _cast(inp, torch.float16 if move == "half" else torch.float32)
    out = T.run_transformer(model, inp)  # no crash, no stale output dtype
    qwen_absorb.patch(twin, **REAL)
    assert torch.equal(out, T.run_transformer(twin, inp))
    # fp16 activations run FP8 GEMMs too (output dtype rebuilt); fp32 ones run ModelOpt's modules
    assert report.summary["fp8_gemm_linears"] == (14 * LAYERS if move == "half" else 0)
    assert out.dtype == inp["hidden_states"].dtype


def test_output_quantizer_enabled_after_patching_undefers(seed):
    def enable_out(m):
        for blk in m.transformer_blocks:
            blk.attn.to_out[0].output_quantizer.enable()

    forced = {"defer_bias": True, "fp8_gemm": False, "capabilities": {"cpu"}}
    _, _, report = _same_after(enable_out, seed, forced, check_real=False)
    assert report.summary["biases_deferred"] == 3 * LAYERS
    assert any("output quantizer" in r for r in report.blocks[0].site("img", "attn_residual").defer_reasons)


@pytest.mark.parametrize("action", ["to_bf16", "assign"])
def test_default_path_fp32_model_follows_norm_quantizer_amax(seed, action):
    """No real FP8 here (fp32 on CPU): the fused norms reproduce the norm quantizers, whose amax tensor
    objects a dtype move or an assigning load replaces."""
    model, inp = _fp8(seed, dtype=torch.float32)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model)
    if action == "to_bf16":
        model.to(torch.bfloat16)
        twin.to(torch.bfloat16)
        inp = _cast(inp, torch.bfloat16)
    else:
        sd = {k: v.clone() * (1.5 if k.endswith("input_quantizer._amax") else 1) for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)
        twin.load_state_dict(sd, assign=True)
    assert torch.equal(T.run_transformer(model, inp), T.run_transformer(twin, inp))


def test_patch_again_after_a_change_is_current(seed):
    model, inp = _fp8(seed)
    report = _real(model)
    other, _ = _fp8(seed + 3)
    model.load_state_dict(other.state_dict())
    again = qwen_absorb.patch(model, **REAL)
    out = T.run_transformer(model, inp)
    qwen_absorb.patch(other, **REAL)
    assert torch.equal(out, T.run_transformer(other, inp))
    assert again.summary["fp8_gemm_linears"] == report.summary["fp8_gemm_linears"]


# ---------------------------------------------------------------------------- LoRA


@pytest.mark.slow
def test_lora_runs_on_the_fp8_path(seed):
    import modelopt.torch.quantization as mtq

    model, inp = _fp8(seed)
    _add_lora(model, seed)
    ref32 = copy.deepcopy(model)  # the same weights and adapter, unquantized, in fp32
    mtq.disable_quantizer(ref32, "*")
    ref32.float()
    fake = T.run_transformer(model, inp)  # unpatched: ModelOpt fake quant + PEFT
    report = _real(model)
    assert report.summary["fp8_gemm_lora_linears"] == 12 * LAYERS
    out = T.run_transformer(model, inp)
    want = T.run_transformer(ref32, {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
                                     for k, v in inp.items()})
    assert _rel(out, want) <= 1.25 * _rel(fake, want) + 1e-3, (_rel(out, want), _rel(fake, want))
    # the branch is there: disabling the adapters gives the FP8 model without it, bit for bit
    model.disable_adapters()
    off = T.run_transformer(model, inp)
    model.enable_adapters()
    assert _rel(off, out) > 1e-2
    assert torch.equal(T.run_transformer(model, inp), out)
    assert not any("original diffusers forward" in r for r in report.runtime_fallbacks), report.runtime_fallbacks


@pytest.mark.slow
def test_lora_scale_and_adapter_weights_are_read_per_call(seed):
    model, inp = _fp8(seed)
    _add_lora(model, seed, "a")
    _add_lora(model, seed + 1, "b")
    model.set_adapters(["a", "b"], [1.0, 0.5])
    twin = copy.deepcopy(model)
    _real(model)
    outs = {}
    for scale in (1.0, 0.3):
        outs[scale] = T.run_transformer(model, {**inp, "attention_kwargs": {"scale": scale}})
    model.set_adapters(["a"], [0.7])
    outs["a"] = T.run_transformer(model, inp)
    # the twin does the same before being patched
    qwen_absorb.patch(twin, **REAL)
    assert torch.equal(T.run_transformer(twin, {**inp, "attention_kwargs": {"scale": 0.3}}), outs[0.3])
    twin.set_adapters(["a"], [0.7])
    assert torch.equal(T.run_transformer(twin, inp), outs["a"])
    assert _rel(outs[1.0], outs[0.3]) > 1e-3


@pytest.mark.slow
def test_fused_lora_is_rebuilt_from_the_merged_weight(seed):
    model, inp = _fp8(seed)
    _add_lora(model, seed)
    twin = copy.deepcopy(model)
    report = _real(model)
    unfused = T.run_transformer(model, inp)
    model.fuse_lora()
    fused = T.run_transformer(model, inp)
    twin.fuse_lora()
    qwen_absorb.patch(twin, **REAL)
    assert torch.equal(fused, T.run_transformer(twin, inp))
    assert report.summary["fp8_gemm_linears"] == 14 * LAYERS
    assert 0 < _rel(fused, unfused) < 0.1  # the merged weight, quantized: close to the branch, not equal
    model.unfuse_lora()
    twin.unfuse_lora()
    assert torch.equal(T.run_transformer(model, inp), T.run_transformer(twin, inp))


@pytest.mark.slow
def test_lora_lifecycle_through_the_pipeline(seed):
    pipe = T.tiny_pipeline(seed=seed, dtype=torch.bfloat16)
    inp = T.transformer_inputs(pipe.transformer, seed=seed + 1)
    T.fp8_quantize(pipe.transformer, [inp])
    src = copy.deepcopy(pipe.transformer)
    _add_lora(src, seed, "x")
    from peft.utils import get_peft_model_state_dict

    sd = {f"transformer.{k}": v for k, v in get_peft_model_state_dict(src, adapter_name="x").items()}
    twin = copy.deepcopy(pipe)
    report = qwen_absorb.patch(pipe, **REAL)
    steps = [
        lambda p: p.load_lora_weights(copy.deepcopy(sd), adapter_name="x"),
        lambda p: p.set_adapters(["x"], [0.6]),
        lambda p: p.fuse_lora(lora_scale=1.0),
        lambda p: p.unfuse_lora(),
        lambda p: p.delete_adapters("x"),
        lambda p: p.load_lora_weights(copy.deepcopy(sd), adapter_name="y"),
        lambda p: p.unload_lora_weights(),
    ]
    outs = []
    for step in steps:
        step(pipe)
        outs.append(T.run_transformer(pipe.transformer, inp))
    assert report.summary["fp8_gemm_linears"] == 14 * len(pipe.transformer.transformer_blocks)
    for i, step in enumerate(steps):  # the twin: each state reached unpatched, then patched
        step(twin)
        qwen_absorb.patch(twin, **REAL)
        assert torch.equal(T.run_transformer(twin.transformer, inp), outs[i]), i
        qwen_absorb.unpatch(twin)


def test_add_branches_is_pefts_math():
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.lin = torch.nn.Linear(32, 48)
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                                 target_modules=["lin"]), holder, adapter_name="a")
    layer, base = holder.lin, holder.lin.base_layer
    assert L.is_lora_layer(layer) and not L.unsupported_reasons(layer)
    with torch.no_grad():
        layer.lora_B["a"].weight.normal_(0, 0.1)
    layer.eval()
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        want = layer(x)
        got = L.add_branches(layer, base(x), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: one rounding vs three
    layer.bfloat16()
    xb = x.bfloat16()
    with torch.no_grad():
        got, want = L.add_branches(layer, base.bfloat16()(xb), xb), layer(xb)
    assert _rel(got, want) < 4e-3
    layer.lora_A["a"].float()  # mixed dtypes: PEFT's expression op for op, bit for bit
    layer.lora_B["a"].float()
    with torch.no_grad():
        assert torch.equal(L.add_branches(layer, base(xb), xb), layer(xb))


def test_unsupported_lora_kinds_say_why(seed):
    model, inp = _fp8(seed)
    model.add_adapter(peft.LoraConfig(r=4, use_dora=True, target_modules=["to_q"]))
    report = qwen_absorb.patch(model, **REAL)
    reasons = report.blocks[0].linears["attn.to_q"].fp8_reasons
    assert any("DoRA" in r for r in reasons), reasons
    out = T.run_transformer(model, inp)
    qwen_absorb.unpatch(model)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------- hooks, blocks, memory


DEFERRED = {"defer_bias": True, "fp8_gemm": False, "capabilities": {"cpu"}}


@pytest.mark.slow
@pytest.mark.parametrize("where,kwargs", [("img_norm1", REAL), ("attn.to_q", REAL), ("img_mlp.net.2", REAL),
                                          ("attn.to_out.0", DEFERRED), ("img_mlp.net.2", DEFERRED)])
def test_user_hooks_run_and_see_unpatched_values(seed, where, kwargs):
    """A hook added after patching on a module the fused path skips (a fused norm, an FP8 linear) or
    changes (a projection whose bias is deferred): that module runs as its module (the block decides
    again), the hook runs once and sees what it sees on the twin that had the hook before being patched."""
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)
    seen: dict[str, list] = {"patched": [], "twin": []}

    def hook(tag):
        def fn(mod, args, out):
            seen[tag].append(out.float().sum().item())
            return out * 1.5  # an editing hook
        return fn

    report = qwen_absorb.patch(model, **kwargs)
    model.transformer_blocks[1].get_submodule(where).register_forward_hook(hook("patched"))
    out = T.run_transformer(model, inp)
    twin.transformer_blocks[1].get_submodule(where).register_forward_hook(hook("twin"))
    qwen_absorb.patch(twin, **kwargs)
    want = T.run_transformer(twin, inp)
    assert torch.equal(out, want) and seen["patched"] == seen["twin"] and len(seen["twin"]) == 1
    # the block decided again: the hooked module runs as its module, the rest of the block stays fused
    assert not report.runtime_fallbacks.get(HOOK_FALLBACK) and report.rebuilds, report.runtime_fallbacks
    assert f"a forward hook on {where}" in str(report), str(report)
    assert report.blocks[0].sites[0].fused and report.summary["sites_fused"] >= 11


def test_blocks_replaced_appended_and_copied(seed):
    model, inp = _fp8(seed)
    ref = T.run_transformer(model, inp)
    _real(model)
    fresh = copy.deepcopy(model.transformer_blocks[1])  # a patched copy of a patched block
    qwen_absorb.unpatch(model)
    assert PLAN_ATTR in fresh.__dict__
    model.transformer_blocks[1] = fresh  # replaced by a copy that still carries a patch
    again = qwen_absorb.patch(model, **REAL)
    assert again.summary["blocks_patched"] == LAYERS and fresh.__dict__[PLAN_ATTR] is not None
    model.transformer_blocks.append(copy.deepcopy(fresh))  # appended (patched copy)
    third = qwen_absorb.patch(model, **REAL)  # sees the new block
    assert third.summary["blocks_patched"] == LAYERS + 1 and third is not again
    qwen_absorb.unpatch(model)
    for blk in model.transformer_blocks:
        assert PLAN_ATTR not in blk.__dict__ and not isinstance(blk.__dict__.get("forward"), PatchedForward)
    del model.transformer_blocks[-1]
    assert torch.equal(T.run_transformer(model, inp), ref)


@pytest.mark.slow
def test_a_kept_report_pins_nothing(seed):
    model, inp = _fp8(seed)
    _add_lora(model, seed)
    report = _real(model)
    T.run_transformer(model, inp)
    codes = weakref.ref(model.transformer_blocks[0].__dict__[PLAN_ATTR].linears["attn.to_q"].weight.codes)
    blocks = [weakref.ref(b) for b in model.transformer_blocks]
    m = weakref.ref(model)
    again = qwen_absorb.patch(model, **{**REAL, "use_fast_accum": True})  # a re-patch frees the first one's
    gc.collect()
    assert codes() is None
    codes = weakref.ref(model.transformer_blocks[0].__dict__[PLAN_ATTR].linears["attn.to_q"].weight.codes)
    qwen_absorb.unpatch(model)
    gc.collect()
    assert codes() is None
    del model
    gc.collect()
    assert m() is None and all(b() is None for b in blocks)
    assert not report.active and report.summary["fp8_gemm_linears"] == 14 * LAYERS  # the last decisions
    assert "unpatched" in str(again) and again.to_dict()["blocks"]


@pytest.mark.parametrize("compress", [False, True])
def test_graph_scan_checks_fp8_sources_after_the_launch(seed, compress):
    """CUDA-graph mode's snapshot (cuda_graph.fingerprint.Scan): the original weights and quantizer amaxes of
    the FP8-GEMM linears (the graph reads the plan's codes and scales made from them) are compared after a
    replay is launched (``stale``), every tensor the graph reads before it (``moved``). ModelOpt's compressed
    weight *is* the codes the GEMM reads: it stays a pre-launch check."""
    from qwen_absorb.cuda_graph import fingerprint as F

    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=LAYERS)
    inp = T.transformer_inputs(model, seed=seed + 1)
    T.fp8_quantize(model, [inp], compress=compress)
    _real(model)
    scan = F.Scan(model)
    read, src = set(map(id, scan.tensors)), set(map(id, scan.stensors))
    assert not read & src
    q = model.transformer_blocks[0].attn.to_q
    plan = model.transformer_blocks[0].__dict__[PLAN_ATTR]
    assert plan.linears["attn.to_q"].weight.reused_storage is compress
    assert id(q.input_quantizer._amax) in src and id(q.bias) in read
    assert (id(q.weight) in read) if compress else (id(q.weight) in src)
    # input amax, weight amax, and the original weight (compressed: the weight quantizer's scale instead)
    assert len(src) == 3 * 14 * LAYERS, sorted(scan.snames)

    # a source replaced: the replay's result would be stale (seen after the launch), its memory is not read
    amax = q.input_quantizer._amax
    amax.data = amax.data.clone()  # new memory, same tensor (replacing the buffer is seen by fingerprint.watch)
    assert scan.moved() is None and scan.stale() == "weights moved or replaced"
    assert scan.which().endswith("to_q.input_quantizer._amax")
    scan = F.Scan(model)
    assert scan.changed() is None
    q.bias.data = q.bias.data.clone()  # read by the graph (the GEMM epilogue): seen before the launch
    assert scan.moved() == "weights moved or replaced"


def test_graph_scan_sees_derived_tensors_dropped_before_the_launch(seed):
    """What holds derived tensors a graph reads (a block's ``BlockRuntime``, an ``Fp8LinearForward``) moves its
    ``generation`` when it drops or rebuilds them, and ``Scan.moved`` (asked before a replay is launched) sees
    it; replacing a forward object is left to ``Scan.stale`` (the scan holds the replaced object alive)."""
    from qwen_absorb import fp8_forward
    from qwen_absorb.cuda_graph import fingerprint as F

    model, inp = _fp8(seed)
    _real(model)
    blk = model.transformer_blocks[0]
    f = blk.__dict__[PLAN_ATTR].rt.attn_fwds["attn.to_q"]  # a gated forward: in its slot only during a call
    f.linear.forward = f  # as while the block calls a hooked attention (qwen_absorb.block._gated_forwards)
    fwds = [o for o in F.Scan(model).owners if isinstance(o, fp8_forward.Fp8LinearForward)]
    assert fwds == [f]
    scan = F.Scan(model)
    assert scan.moved() is None and scan.changed() is None
    g = f.generation
    f._clear()  # what unpatch and fp8_forward.release do with the FP8 weights
    assert f.generation == g + 1
    assert scan.moved() == "a block decided anew or an FP8 forward rebuilt its derived tensors"

    scan = F.Scan(model)
    g = f.generation
    f._decide(first=False)  # a rebuild (its sources changed), e.g. when a block is called on its own
    assert f.generation > g and scan.moved() is not None

    scan = F.Scan(model)
    lin = f.linear
    lin.forward = copy.copy(f)  # a new forward object: the old one is held by the scan, its memory stays
    assert scan.moved() is None and scan.stale() == F.SWITCHED
    lin.forward = f
    assert scan.changed() is None
    with torch.no_grad():
        blk.attn.to_q.weight.mul_(1.0)  # in place: a version change only, after the launch
    assert scan.moved() is None and scan.stale() == "weights modified in place"


def test_patch_again_reports_a_change_before_any_call(seed):
    """``patch()`` again after a LoRA is added (no call in between): the report it returns is current."""
    model, inp = _fp8(seed)
    report = _real(model)
    _add_lora(model, seed)
    again = qwen_absorb.patch(model, **REAL)
    assert again is report and again.summary["fp8_gemm_lora_linears"] == 12 * LAYERS
    model.fuse_lora()
    assert qwen_absorb.patch(model, **REAL).summary["fp8_gemm_linears"] == 14 * LAYERS


def test_a_hook_on_the_attention_keeps_the_rest_real_fp8(seed):
    """A hook on ``attn`` (what diffusers' caches do): the attention runs as its module (its linears
    through their gated real-FP8 forwards, tests/test_fp8_hooked_attention.py), the FFN and modulation
    linears stay real FP8; the same as a twin hooked first."""
    model, inp = _fp8(seed)
    twin = copy.deepcopy(model)
    calls = []

    def hook(m, args, kwargs, out):
        calls.append(1)
        return out

    report = _real(model)
    model.transformer_blocks[0].attn.register_forward_hook(hook, with_kwargs=True)
    out = T.run_transformer(model, inp)
    twin.transformer_blocks[0].attn.register_forward_hook(hook, with_kwargs=True)
    qwen_absorb.patch(twin, **REAL)
    assert torch.equal(out, T.run_transformer(twin, inp)) and len(calls) == 2
    assert report.summary["fp8_gemm_linears"] == 14 * LAYERS - 8  # block 0's eight attention linears
    assert not report.blocks[0].linears["attn.to_q"].fp8_gemm and report.blocks[0].linears["img_mlp.net.2"].fp8_gemm


def _mm_counts(model, inp) -> collections.Counter:
    """aten matmul ops of one call, by name (TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter = collections.Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if "mm" in name or name in ("linear", "_scaled_mm"):
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        T.run_transformer(model, inp)
    return counts


@pytest.mark.slow
def test_shared_lora_a_products_are_the_separate_ones(seed, monkeypatch):
    """q/k/v of a stream take their lora_A products from one GEMM over the concatenated A weights: the per-linear
    GEMMs' values, 10 fewer matmuls per block with two adapters, and the live weights after every LoRA action,
    PEFT's hotswap included (an in-place write through .data, which no version sees).

    One GEMM over N = sum of ranks may pick another CPU microkernel than N = rank (AMX or AVX-512 tiles), so a
    product's last bf16 bit may differ by machine, and the FP8 quantization after it can move a code: the merged
    output is held to the separate one within 1/4 of the smallest change any step below makes (about 1e-2)."""
    from qwen_absorb import attention

    model, inp = _fp8(seed)
    _add_lora(model, seed, "a", r=4)
    _add_lora(model, seed + 1, "b", r=2)
    model.set_adapters(["a", "b"], [1.0, 0.5])
    _real(model)
    separate = attention._shared_lora

    def both():
        merged = T.run_transformer(model, inp)
        with monkeypatch.context() as mp:
            mp.setattr(attention, "_shared_lora", lambda *a: None)
            sep = T.run_transformer(model, inp)
        assert separate is attention._shared_lora
        return merged, sep

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    merged, sep = both()
    assert rel(merged, sep) <= 2.5e-3, rel(merged, sep)
    n_merged = _mm_counts(model, inp)
    monkeypatch.setattr(attention, "_shared_lora", lambda *a: None)
    n_sep = _mm_counts(model, inp)
    monkeypatch.setattr(attention, "_shared_lora", separate)
    # per block and stream, q/k/v x 2 adapters: 6 lora_A GEMMs become 1; the 6 lora_B addmm_ stay
    assert n_sep["mm"] - n_merged["mm"] == 2 * 5 * LAYERS, (n_merged, n_sep)
    assert n_sep["addmm_"] == n_merged["addmm_"], (n_merged, n_sep)
    blk = model.transformer_blocks[0]
    q_a = blk.attn.to_q.lora_A["a"].weight
    steps = [
        ("A weight written in place", lambda: q_a.data.mul_(1.5)),  # what PEFT's hotswap does
        ("A weight replaced", lambda: setattr(q_a, "data", q_a.data * 0.5)),
        ("adapter weights", lambda: model.set_adapters(["a", "b"], [0.25, 2.0])),
        ("active set", lambda: model.set_adapters(["b"], [1.0])),
        ("disable", model.disable_adapters),
        ("enable", model.enable_adapters),
        ("add", lambda: _add_lora(model, seed + 2, "c", r=3)),
        ("all three", lambda: model.set_adapters(["a", "b", "c"], [1.0, 0.5, 0.7])),
        ("delete", lambda: model.delete_adapters("b")),
    ]
    prev = merged
    for label, step in steps:
        with torch.no_grad():
            step()
        merged, sep = both()
        step_change = rel(merged, prev)  # the step changed what runs, in both paths, by more than they differ
        assert rel(merged, sep) <= min(2.5e-3, step_change / 4), (label, rel(merged, sep), step_change)
        assert rel(sep, prev) > 2.5e-3, label
        prev = merged


def test_shared_lora_a_refuses_dropout(seed):
    """A LoRA dropout that is not the identity (training): no merged GEMM, each linear runs PEFT's expression."""
    model, inp = _fp8(seed)
    _add_lora(model, seed, "a")
    _add_lora(model, seed + 1, "b")
    model.set_adapters(["a", "b"])
    _real(model)
    x = torch.randn(5, model.transformer_blocks[0].attn.to_q.in_features, dtype=torch.bfloat16)
    attn = model.transformer_blocks[0].attn
    layers = [attn.to_q, attn.to_k, attn.to_v]
    assert L.shared_input_branches(layers, x, torch.bfloat16) is not None
    layers[1].lora_dropout["b"] = torch.nn.Dropout(0.1)
    assert L.shared_input_branches(layers, x, torch.bfloat16) is None
    layers[1].lora_dropout["b"].eval()  # eval dropout is the identity
    assert L.shared_input_branches(layers, x, torch.bfloat16) is not None
    assert L.shared_input_branches(layers, x, torch.float32) is None  # another output dtype
    assert L.shared_input_branches(layers[:1], x, torch.bfloat16) is not None  # two adapters on one layer
    model.set_adapters(["a"])
    assert L.shared_input_branches(layers[:1], x, torch.bfloat16) is None  # one branch: nothing to share


@pytest.mark.parametrize("shared", [False, True])
def test_fp8_linear_into_a_view_is_fp8_linear(seed, shared):
    """The v projections of the joint attention write into rows of the joint tensor (GPU, batch 1): with a
    LoRA, the GEMM into the view and the branches added there in place give fp8_linear's bits."""
    from qwen_absorb import projection
    from qwen_absorb.ops.fp8 import quantize_fp8_reference

    model, inp = _fp8(seed)
    _add_lora(model, seed + 3)
    _real(model)
    block = model.transformer_blocks[0]
    plan = block.__dict__[PLAN_ATTR]
    attn = block.attn
    x = torch.randn(1, 9, attn.to_v.in_features, generator=torch.Generator().manual_seed(seed), dtype=torch.bfloat16)
    paths = ("attn.to_q", "attn.to_k", "attn.to_v")
    for p in paths:
        assert plan.linears[p].lora and projection.writes_into(plan.linears[p])
    lp = plan.linears["attn.to_v"]
    codes = quantize_fp8_reference(x, lp.weight.input_amax)
    branches = None
    if shared:
        rows = L.shared_input_branches([attn.to_q, attn.to_k, attn.to_v], x, torch.bfloat16)
        assert rows is not None
        branches = rows[2]
    want = projection.fp8_linear(codes, lp, plan, None, x, attn.to_v, branches)
    joint = torch.full((13, want.shape[-1]), float("nan"), dtype=torch.bfloat16)  # poisoned: [4 text, 9 image]
    got = projection.fp8_linear_into(codes, lp, plan, joint[4:], x, attn.to_v, branches)
    assert got.data_ptr() == joint[4:].data_ptr()
    assert torch.equal(joint[4:], want.reshape(9, -1)) and torch.isnan(joint[:4]).all()
    base = projection.fp8_linear(codes, dataclasses.replace(lp, lora=False), plan, None)
    assert _rel(want, base) > 1e-3  # the branch is there


@pytest.mark.slow
def test_layers_without_active_branches_hand_over_nothing(seed):
    """A LoRA layer whose adapters are disabled or merged has no branch to feed: no producer hands its activation
    over (the GELU output for net[2] included) and nothing is computed for it; enabling or unmerging decides again
    (PEFT's adapter state is watched). Each state against a twin patched in that state: the same bits."""
    model, inp = _fp8(seed)
    _add_lora(model, seed)
    twin = copy.deepcopy(model)
    _real(model)
    qwen_absorb.patch(twin, **REAL)

    def state():
        plan = model.transformer_blocks[0].__dict__[PLAN_ATTR]
        return ({sp.key for sp in plan.sites if sp.act_out},
                {p for p, lp in plan.linears.items() if lp.lora_active})

    def same():
        out = T.run_transformer(model, inp)
        assert torch.equal(out, T.run_transformer(twin, inp)), _rel(out, T.run_transformer(twin, inp))
        return out

    on = same()
    handed, active = state()
    assert handed == {"img.norm1", "txt.norm1", "img.attn_residual", "txt.attn_residual"}, handed
    assert len(active) == 12, active
    for m in (model, twin):
        m.disable_lora()
    off = same()
    assert state() == (set(), set()) and not torch.equal(off, on)
    for m in (model, twin):
        m.enable_lora()
    assert torch.equal(same(), on) and state() == (handed, active)
    for m in (model, twin):
        m.fuse_lora()
    same()
    assert state() == (set(), set())
    for m in (model, twin):
        m.unfuse_lora()
    same()
    assert state() == (handed, active)
