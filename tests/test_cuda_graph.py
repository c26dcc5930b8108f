"""CUDA-graph mode (qwen_absorb.cuda_graph) on the CPU: what can be checked without a GPU.

On a CPU every call is refused ("input on cpu") and must be exactly the eager call. The decision logic
(signature keys, the snapshot that invalidates graphs, refusal reasons, host-constant interception, LRU,
install/remove, deepcopy/pickle) is exercised directly; replay itself is in tests/test_cuda_graph_gpu.py.
"""

from __future__ import annotations

import collections
import copy
import inspect
import io
import json
import math
import pickle

import pytest
import torch
from torch import nn

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from qwen_absorb.cuda_graph import capture as C
from qwen_absorb.cuda_graph import fingerprint as F
from qwen_absorb.cuda_graph import settings
from qwen_absorb.cuda_graph import signature as S
from . import builders as T

from .cuda_graph_fakes import FakeGraph as _FakeGraph
from .cuda_graph_fakes import arm as _arm

CPU_REASON = "cuda_graph: input on cpu"


def _install(model, **kw):
    fb = collections.Counter()
    return CG.install(model, fallbacks=fb, **kw), fb


def _run(model, kw):
    with torch.no_grad():
        return model(**kw)


def _first(out):
    return out[0] if isinstance(out, tuple) else out.sample


def _key(kwargs, positional=()):
    return S.signature((), kwargs, positional)[2]


# ------------------------------------------------------------------------------------------ eager on CPU


@pytest.mark.slow
@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("return_dict", [False, True])
def test_cpu_calls_are_the_eager_call(zero_cond_t, patched, return_dict, seed):
    model = T.tiny_transformer(seed=seed, zero_cond_t=zero_cond_t, num_layers=2)
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)
    inputs = [T.transformer_inputs(model, seed=seed + i, masked_tail=2 * (i % 2)) for i in range(3)]
    for kw in inputs:
        kw["return_dict"] = return_dict
    refs = [_first(_run(model, kw)) for kw in inputs]
    runner, fb = _install(model)
    outs = [_run(model, kw) for kw in inputs]
    assert all(isinstance(o, tuple) != return_dict for o in outs)
    for o, r in zip(outs, refs):
        assert torch.equal(_first(o), r)
    assert fb == collections.Counter({CPU_REASON: 3})
    d = runner.describe()
    assert d["eager_calls"] == 3 and d["captures"] == 0 and d["replays"] == 0 and d["graphs"] == 0
    runner.remove()
    assert "forward" not in model.__dict__
    for kw, r in zip(inputs, refs):
        assert torch.equal(_first(_run(model, kw)), r)
    assert fb[CPU_REASON] == 3  # removed: nothing counted any more


def test_install_remove_restores_forward_exactly(seed):
    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    runner, fb = _install(model)
    assert model.__dict__["forward"] is runner
    assert CG.install(model, fallbacks=collections.Counter()) is runner  # installing twice: the same runner
    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    runner.remove()
    assert "forward" not in model.__dict__
    assert model.forward.__func__ is type(model).forward
    runner.remove()  # idempotent
    assert torch.equal(_first(_run(model, kw)), ref)
    assert _first(runner(**kw)).shape == ref.shape  # a removed runner is a plain pass-through

    # an instance forward that was there before (a wrapper of someone else's) comes back as the same object
    calls = []
    original = model.forward

    def wrapper(*a, **k):
        calls.append(1)
        return original(*a, **k)

    model.forward = wrapper
    runner, fb = _install(model)
    assert runner._inner is wrapper
    assert torch.equal(_first(_run(model, kw)), ref) and calls == [1]
    runner.remove()
    assert model.__dict__["forward"] is wrapper


def test_remove_from_inside_a_hook_chain(seed):
    """A diffusers hook registered after install wraps the runner; remove() takes the runner out of the
    chain and leaves the hook working on the original forward."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Count(ModelHook):
        def __init__(self):
            super().__init__()
            self.n = 0

        def pre_forward(self, module, *args, **kwargs):
            self.n += 1
            return args, kwargs

    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    runner, fb = _install(model)
    hook = Count()
    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.register_hook(hook, "count")
    assert model.forward is not runner and registry._fn_refs[0].forward is runner
    assert torch.equal(_first(_run(model, kw)), ref) and hook.n == 1
    # a diffusers hook on the transformer is a refusal reason (it runs per call); counted once per call
    assert fb == collections.Counter({"cuda_graph: diffusers hook active": 1})
    runner.remove()
    inner = registry._fn_refs[0].forward
    assert inner.__func__ is type(model).forward and inner.__self__ is model
    assert torch.equal(_first(_run(model, kw)), ref) and hook.n == 2
    registry.remove_hook("count")
    assert model.forward.__func__ is type(model).forward
    assert fb.total() == 1


def test_install_arguments_and_pipeline_target(seed):
    pipe = T.tiny_pipeline(seed=seed)
    runner, _ = _install(pipe)
    assert pipe.transformer.__dict__["forward"] is runner
    runner.remove()
    with pytest.raises(ValueError):
        CG.install(pipe.transformer, fallbacks=collections.Counter(), max_graphs=0)
    with pytest.raises(TypeError):
        CG.install(pipe.transformer, fallbacks={})
    with pytest.raises(TypeError):
        CG.install(object(), fallbacks=collections.Counter())


# ------------------------------------------------------------------------------------------ refusals


@pytest.mark.slow
def test_refusal_reasons_counted_per_call(seed):
    from diffusers import FirstBlockCacheConfig

    model = T.tiny_transformer(seed=seed, num_layers=2)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    runner, fb = _install(model)
    for _ in range(3):
        with torch.enable_grad():
            out = _first(model(**kw))
        assert out.requires_grad and torch.equal(out.detach(), ref)
    assert fb["cuda_graph: grad enabled"] == 3

    model.train()
    assert torch.equal(_first(_run(model, kw)), ref)
    assert fb["cuda_graph: module in training mode"] == 1
    model.eval()

    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    with torch.no_grad(), model.cache_context("cond"):
        model(**kw)
    assert sum(n for k, n in fb.items() if k.startswith("cuda_graph: FirstBlockCache: ")) == 1  # its own reason
    model.disable_cache()

    model.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)
    assert torch.equal(_first(_run(model, kw)), ref)
    assert fb["cuda_graph: offloading hook"] == 1

    assert all(k.startswith("cuda_graph: ") for k in fb)
    assert runner.describe()["refusals"]["grad enabled"] == 3


def test_argument_refusals(seed):
    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    names = S.positional_names(type(model))
    assert names[:4] == ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep")
    with pytest.raises(S.Refusal, match="python number"):
        S.signature((), {**kw, "timestep": 0.5}, names)
    with pytest.raises(S.Refusal, match="python number"):  # positional, by name
        S.signature((kw["hidden_states"], kw["encoder_hidden_states"], None, 3), {}, names)
    with pytest.raises(S.Refusal, match="unsupported argument type"):
        S.signature((), {**kw, "attention_kwargs": {"x": object()}}, names)
    with pytest.raises(S.Refusal, match="unsupported argument type"):
        S.signature((), {**kw, "hidden_states": kw["hidden_states"].as_subclass(_Sub)}, names)
    with pytest.raises(S.Refusal, match="input on cpu"):
        S.Call((), kw, names)
    # through a call: counted, then the eager forward runs (and here fails as diffusers does for a float)
    runner, fb = _install(model)
    with pytest.raises(AttributeError):
        _run(model, {**kw, "timestep": 0.5})
    assert fb == collections.Counter({"cuda_graph: python number argument (would be baked into the graph)": 1})


class _Sub(torch.Tensor):
    pass


def test_scan_refusals(seed):
    model = T.tiny_transformer(seed=seed)
    scan = F.Scan(model)
    assert scan.refusal == "model not on CUDA" and not scan.sticky and scan.device is None

    h = model.transformer_blocks[1].register_forward_hook(lambda *a: None)
    assert F.Scan(model).refusal == "forward hook on a submodule"
    h.remove()
    h = model.register_forward_pre_hook(lambda *a: None)  # the transformer's own hooks run outside the graph
    assert F.Scan(model).refusal == "model not on CUDA"
    h.remove()
    h = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert F.Scan(model).refusal == "global module forward hook"
    finally:
        h.remove()

    from accelerate.hooks import ModelHook as AccelerateHook
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module

    add_hook_to_module(model.transformer_blocks[0].attn.to_q, AccelerateHook())
    scan = F.Scan(model)
    assert scan.refusal == "offloading hook" and scan.sticky
    remove_hook_from_module(model.transformer_blocks[0].attn.to_q)

    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    assert F.Scan(model).refusal == "layerwise casting hook"

    with torch.device("meta"):
        meta = T._transformer_cls()(**{**T.TINY_CONFIG, "num_layers": 1})
    assert F.Scan(meta).refusal == "offloading hook"


def test_scan_refuses_modelopt_calibration(seed):
    pytest.importorskip("modelopt.torch.quantization")
    model = T.tiny_transformer(seed=seed)
    T.fp8_quantize(model, T.transformer_inputs(model, seed=seed + 1))
    scan = F.Scan(model)
    assert scan.refusal == "model not on CUDA"
    q = model.transformer_blocks[0].attn.to_q.input_quantizer
    q.enable_calib()
    assert scan.changed() is not None  # the switch itself is watched
    assert F.Scan(model).refusal == "ModelOpt calibration running"
    q.disable_calib()
    assert F.Scan(model).refusal == "model not on CUDA"
    scan = F.Scan(model)
    q.disable()  # mtq.disable_quantizer does this
    assert scan.changed() == "forward, hook, processor, quantizer or adapter switch replaced"


# ------------------------------------------------------------------------------------------ signature


def _aligned(g, *shape, dtype=torch.float32, offset=0):
    """A random tensor at a 256-byte aligned address plus ``offset`` elements (the CPU allocator only
    promises 64 bytes; the CUDA one 512)."""
    n = math.prod(shape)
    buf = torch.randn(n + 256 + offset, generator=g).to(dtype)
    start = (-buf.data_ptr() % 256) // buf.element_size() + offset
    return buf[start:start + n].view(*shape)


def test_signature_keys(seed):
    g = torch.Generator().manual_seed(seed)
    a = _aligned(g, 1, 16, 8)
    base = dict(hidden_states=a, timestep=_aligned(g, 1), img_shapes=[[(1, 4, 4)]],
                attention_kwargs={}, return_dict=False)
    k0 = _key(base)
    assert _key({**base, "hidden_states": _aligned(g, 1, 16, 8)}) == k0  # new values: the same graph
    assert _key({**base, "timestep": _aligned(g, 1)}) == k0
    assert S.align_class(a.data_ptr()) == 256 and S.align_class(a[0, 0, 1:].data_ptr()) == 4
    different = [
        {**base, "hidden_states": _aligned(g, 1, 20, 8)},  # shape
        {**base, "hidden_states": _aligned(g, 1, 16, 8, dtype=torch.float64)},  # dtype
        {**base, "hidden_states": _aligned(g, 1, 8, 16).transpose(1, 2)},  # strides
        {**base, "hidden_states": _aligned(g, 1, 16, 8, offset=4)},  # address alignment (16 bytes)
        {**base, "img_shapes": [[(1, 4, 2)]]},  # values of a non-tensor argument
        {**base, "img_shapes": [[[1, 4, 4]]]},  # list vs tuple: diffusers branches on it
        {**base, "img_shapes": ([(1, 4, 4)],)},
        {**base, "attention_kwargs": None},
        {**base, "attention_kwargs": {"scale": 0.5}},
        {**base, "return_dict": True},
        {**base, "return_dict": 1},  # True == 1 in Python, not here
        {**base, "txt_seq_lens": [7]},
        {k: v for k, v in base.items() if k != "attention_kwargs"},
        dict(reversed(list(base.items()))),  # keyword order is part of the structure
    ]
    keys = [_key(kw) for kw in different]
    assert all(k != k0 for k in keys)
    assert len(set(keys)) == len(keys)
    assert _key({**base, "txt_seq_lens": [7]}) != _key({**base, "txt_seq_lens": [8]})
    nan = {**base, "attention_kwargs": {"scale": math.nan}}
    assert _key(nan) == _key(dict(nan))
    assert _key({**base, "attention_kwargs": {"scale": 0.0}}) != _key({**base, "attention_kwargs": {"scale": -0.0}})
    # process-wide switches that change kernel choice are part of the key
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = not old
        assert _key(base) != k0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    with torch.inference_mode():
        assert _key(base) != k0
    assert _key(base) == k0


def test_freeze_thaw_roundtrip(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, generator=g)
    obj = ((x, [1, (2.5, None)], {"a": True, "b": [x, torch.float16]}, torch.Size([2, 3]), -0.0, 1 + 2j), {})
    tensors: list[torch.Tensor] = []
    spec = S.freeze(obj, tensors)
    assert len(tensors) == 2 and all(t is x for t in tensors)
    back = S.thaw(spec, iter(tensors))
    assert back[0][1] == [1, (2.5, None)] and back[0][2]["b"][1] is torch.float16
    assert back[0][3] == torch.Size([2, 3]) and math.copysign(1, back[0][4]) == -1 and back[0][5] == 1 + 2j
    assert back[0][0] is x and back[0][2]["b"][0] is x
    assert type(back[0][1]) is list and type(back[0][1][1]) is tuple
    pickle.loads(pickle.dumps(spec))  # the placeholder pickles (signatures are plain data)


def test_static_buffers_keep_strides_and_alignment(seed):
    g = torch.Generator().manual_seed(seed)
    cases = [
        torch.randn(33, generator=g)[1:],
        torch.randn(4, 6, generator=g).t(),
        torch.randn(3, 9, generator=g).to(torch.bfloat16)[:, 1:4],
        torch.randn(0, 3, generator=g),
        torch.randint(0, 2, (5, 7), generator=g).to(torch.bool)[1:],
    ]
    for x in cases:
        s = C.static_like(x)
        s.copy_(x)
        assert s.shape == x.shape and s.stride() == x.stride() and s.dtype == x.dtype
        assert s.data_ptr() % settings.ALIGN == x.data_ptr() % settings.ALIGN
        assert torch.equal(s, x)
    assert S.tensor_meta(_aligned(g, 32, offset=1)) != S.tensor_meta(_aligned(g, 32))


def test_outputs_are_mapped_with_their_types(seed):
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
    out = C.map_tensors(Transformer2DModelOutput(sample=x), torch.Tensor.clone)
    assert isinstance(out, Transformer2DModelOutput) and torch.equal(out.sample, x) and out.sample is not x
    out = C.map_tensors((x, [x, 3]), torch.Tensor.clone)
    assert type(out) is tuple and type(out[1]) is list and out[1][1] == 3 and out[0] is not x


# ------------------------------------------------------------------------------------------ invalidation


def _call_unchanged(model, kw, scan):
    _run(model, kw)
    return scan.changed()


@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("patched", [False, True])
def test_snapshot_is_stable_across_calls(zero_cond_t, patched, quantized, seed):
    """A forward must not change what the snapshot compares, or every call would re-capture."""
    model = T.tiny_transformer(seed=seed, zero_cond_t=zero_cond_t)
    kw = T.transformer_inputs(model, seed=seed + 1)
    if quantized:
        pytest.importorskip("modelopt.torch.quantization")
        T.fp8_quantize(model, kw)
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)
    _run(model, kw)  # lazy first-call state
    scan = F.Scan(model)
    assert scan.refusal == "model not on CUDA"  # and nothing else: no hook, no calibration
    for _ in range(3):
        assert _call_unchanged(model, kw, scan) is None


def test_snapshot_sees_weight_changes(seed):
    model = T.tiny_transformer(seed=seed)
    w = model.transformer_blocks[0].attn.to_q.weight
    scan = F.Scan(model)
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(seed)))
    assert scan.changed() == "weights modified in place"
    assert scan.which() == "transformer_blocks.0.attn.to_q.weight"

    scan = F.Scan(model)
    w.data = w.data.clone()
    assert scan.changed() == "weights moved or replaced"
    assert scan.which() == "transformer_blocks.0.attn.to_q.weight"

    scan = F.Scan(model)
    model.to(torch.float64)
    assert scan.changed() == "weights moved or replaced"



def test_snapshot_sees_structure_and_switches(seed):
    from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

    model = T.tiny_transformer(seed=seed)
    blk = model.transformer_blocks[0]

    scan = F.Scan(model)
    h = blk.attn.register_forward_hook(lambda *a: None)
    assert scan.changed() == "forward hooks added or removed"
    scan = F.Scan(model)
    h.remove()
    assert scan.changed() == "forward hooks added or removed"

    scan = F.Scan(model)
    qwen_absorb.patch(model, cuda_graph=False)
    assert scan.changed() is not None
    scan = F.Scan(model)
    qwen_absorb.unpatch(model)
    assert scan.changed() is not None

    scan = F.Scan(model)
    blk.compile(backend="eager")  # compile_repeated_blocks does this per block
    assert scan.changed() is not None
    scan = F.Scan(model)
    blk._compiled_call_impl = None
    assert scan.changed() == "forward, hook, processor, quantizer or adapter switch replaced"

    scan = F.Scan(model)
    blk.attn.set_processor(QwenDoubleStreamAttnProcessor2_0())
    assert scan.changed() == "forward, hook, processor, quantizer or adapter switch replaced"

    scan = F.Scan(model)
    blk.attn.processor._attention_backend = "native"  # set_attention_backend does this per processor
    assert scan.changed() is not None


def test_snapshot_sees_lora_state(seed):
    from peft import LoraConfig

    model = T.tiny_transformer(seed=seed)
    runner, _ = _install(model)
    runner._current_scan()
    assert runner._scan is not None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"], init_lora_weights=False),
                          adapter_name="a")
    assert runner._scan is None and "module structure changed" in runner._dirty  # registration hook
    steps = {
        "set_adapters": lambda: model.set_adapters(["a"], weights=[0.5]),
        "disable_lora": model.disable_lora,
        "enable_lora": model.enable_lora,
        "fuse_lora": model.fuse_lora,
        "unfuse_lora": model.unfuse_lora,
    }
    for name, step in steps.items():
        scan = runner._current_scan()
        step()
        assert scan.changed() is not None, name
    scan = runner._current_scan()
    model.unload_lora()
    assert runner._scan is None  # modules replaced by their base layers


def test_registration_drops_snapshot_and_graphs(seed):
    model = T.tiny_transformer(seed=seed)
    runner, _ = _install(model, max_graphs=4)
    runner._current_scan()
    nn.Linear(3, 3)  # unrelated modules: the snapshot stays
    other = T.tiny_transformer(seed=seed + 1)
    other.proj_out = nn.Linear(64, 16)
    assert runner._scan is not None
    _fake_graphs(runner, 2, replayed=True)
    model.proj_out = nn.Linear(model.proj_out.in_features, model.proj_out.out_features)
    assert runner._scan is None
    runner._current_scan()
    d = runner.describe()
    assert d["graphs"] == 0 and any("module structure changed" in k for k in d["invalidations"])

    runner._current_scan()
    _fake_graphs(runner, 1, replayed=True)
    to_k = model.transformer_blocks[0].attn.to_k
    to_k.weight = nn.Parameter(torch.zeros_like(to_k.weight))
    runner._current_scan()
    assert runner.describe()["graphs"] == 0

    runner._current_scan()
    _fake_graphs(runner, 1, replayed=True)
    with torch.no_grad():
        model.img_in.bias.add_(1.0)
    runner._current_scan()
    d = runner.describe()
    assert d["graphs"] == 0 and any(k.startswith("weights modified in place (img_in.bias)") for k in d["invalidations"])


def test_sticky_refusal_survives_weight_moves(seed):
    """Layerwise casting recasts the weights on every call: the verdict is kept without a full rescan."""
    model = T.tiny_transformer(seed=seed)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    runner, _ = _install(model)
    scan = runner._current_scan()
    assert scan.refusal == "layerwise casting hook"
    _run(model, T.transformer_inputs(model, seed=seed + 1))
    assert runner._current_scan() is scan and scan.changed() is None


# ------------------------------------------------------------------------------------------ bookkeeping


def _fake_graphs(runner, n, replayed):
    for i in range(n):
        g = C.Graph(None, [], None, [], f"fake {i} {len(runner._graphs)}", 0.0)
        g.replays = 1 if replayed else 0
        runner._insert(("fake", id(g)), g)


def test_lru_bound_and_invalidate(seed):
    model = T.tiny_transformer(seed=seed)
    runner, _ = _install(model, max_graphs=2)
    _fake_graphs(runner, 5, replayed=True)
    d = runner.describe()
    assert d["graphs"] == 2 and d["evictions"] == 3 and d["max_graphs"] == 2
    assert d["signatures"] == ["fake 3 2", "fake 4 2"]  # the most recent ones stay
    runner.invalidate("test reason")
    d = runner.describe()
    assert d["graphs"] == 0 and d["invalidations"] == {"test reason": 1}
    json.dumps(d)


def test_unstable_model_stops_capturing(seed):
    model = T.tiny_transformer(seed=seed)
    runner, _ = _install(model)
    for i in range(settings.MAX_UNREPLAYED_INVALIDATIONS):
        assert not runner.describe()["unstable"]
        _fake_graphs(runner, 1, replayed=False)
        runner._drop(f"state changed {i}")
    assert runner.describe()["unstable"]
    runner.invalidate()
    assert not runner.describe()["unstable"]
    # dropping graphs that were replayed is ordinary invalidation (e.g. switching LoRAs between generations)
    for i in range(2 * settings.MAX_UNREPLAYED_INVALIDATIONS):
        _fake_graphs(runner, 1, replayed=True)
        runner._drop(f"b {i}")
    assert not runner.describe()["unstable"]


def test_describe_is_json(seed):
    model = T.tiny_transformer(seed=seed)
    runner, _ = _install(model, max_graphs=3)
    _run(model, T.transformer_inputs(model, seed=seed + 1))
    d = json.loads(json.dumps(runner.describe()))
    for k in ("installed", "max_graphs", "graphs", "captures", "replays", "eager_calls", "refusals",
              "invalidations", "evictions", "capture_failures", "outputs"):
        assert k in d
    assert d["installed"] and d["max_graphs"] == 3 and d["refusals"] == {"input on cpu": 1} and d["outputs"] == "clone"
    runner.remove()
    assert runner.describe()["installed"] is False
    assert "GraphedCall" in repr(runner)


# ------------------------------------------------------------------------------------------ copy / pickle


@pytest.mark.parametrize("patched", [False, True])
def test_deepcopy_gets_its_own_runner(patched, seed):
    model = T.tiny_transformer(seed=seed, zero_cond_t=True)
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    runner, fb = _install(model)
    _fake_graphs(runner, 1, replayed=True)
    twin = copy.deepcopy(model)
    r2 = twin.__dict__["forward"]
    assert isinstance(r2, CG.GraphedCall) and r2 is not runner
    assert r2._transformer is twin and r2._inner.__self__ is twin and r2._inner.__func__ is type(model).forward
    assert r2.describe()["graphs"] == 0 and runner.describe()["graphs"] == 1  # no graphs shared
    assert r2.fallbacks is not fb
    assert torch.equal(_first(_run(twin, kw)), ref)
    assert r2.fallbacks[CPU_REASON] == 1 and fb[CPU_REASON] == 0
    runner.remove()
    assert twin.__dict__["forward"] is r2
    assert torch.equal(_first(_run(twin, kw)), ref)
    r2.remove()
    assert "forward" not in twin.__dict__
    if patched:
        qwen_absorb.unpatch(twin)
        assert torch.equal(_first(_run(twin, kw)), ref)


def test_pickle_and_torch_save(seed):
    model = T.tiny_transformer(seed=seed, zero_cond_t=True)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    runner, fb = _install(model, max_graphs=5)
    _run(model, kw)
    _fake_graphs(runner, 2, replayed=True)
    assert set(model.state_dict()) == set(T.tiny_transformer(seed=seed, zero_cond_t=True).state_dict())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    r2 = loaded.__dict__["forward"]
    assert isinstance(r2, CG.GraphedCall)
    assert r2._transformer is loaded and r2._inner.__self__ is loaded and r2.max_graphs == 5
    d = r2.describe()
    assert d["graphs"] == 0 and d["captures"] == 0 and d["installed"]  # graphs are never saved
    assert r2.fallbacks[CPU_REASON] == 1  # the counter is plain data and travels
    assert torch.equal(_first(_run(loaded, kw)), ref)
    r2.remove()
    assert "forward" not in loaded.__dict__
    assert torch.equal(_first(_run(loaded, kw)), ref)
    # pickle of the module alone, too
    again = pickle.loads(pickle.dumps(model))
    assert isinstance(again.__dict__["forward"], CG.GraphedCall)
    assert torch.equal(_first(_run(again, kw)), ref)


# ------------------------------------------------------------------------------------------ host constants


class _CpuConstants(C.HostConstants):
    device_types = ("cpu",)  # exercise the interception on the CPU (on a GPU it acts on cuda targets)


@pytest.mark.parametrize("masked_tail", [0, 2])
def test_host_constants_record_and_replay_edit_model(masked_tail, seed):
    """Qwen-Image-Edit's modulate_index (and the text length next to a mask) come from torch.tensor /
    torch.as_tensor of host data; during capture they are answered from the warm-up's values."""
    model = T.tiny_transformer(seed=seed, zero_cond_t=True)
    kw = T.transformer_inputs(model, seed=seed + 1, masked_tail=masked_tail)
    ref = _first(_run(model, kw))
    real_tensor, real_as_tensor = torch.tensor, torch.as_tensor
    consts = _CpuConstants()
    with consts.active("record"):
        assert torch.tensor is not real_tensor
        assert torch.equal(_first(_run(model, kw)), ref)
    assert torch.tensor is real_tensor and torch.as_tensor is real_as_tensor
    recorded = consts.tensors()
    assert len(recorded) == (2 if masked_tail else 1)
    with consts.active("replay"):
        assert torch.equal(_first(_run(model, kw)), ref)
        # a call without a recorded twin is the real one
        other = torch.tensor([[5, 6]], device="cpu", dtype=torch.int)
        assert torch.equal(other, real_tensor([[5, 6]], dtype=torch.int))
    assert consts.hits == len(recorded)
    assert torch.tensor is real_tensor and torch.as_tensor is real_as_tensor

    # a different img_shapes is a different key: no stale answer
    kw2 = T.transformer_inputs(model, seed=seed + 2, masked_tail=masked_tail, height=2, width=4)
    consts.hits = 0
    with consts.active("replay"):
        assert torch.equal(_first(_run(model, kw2)), _first(_run(model, kw2)))
    assert consts.hits == (1 if masked_tail else 0)  # only the text length (same 7 tokens) matches


def test_host_constants_keys_and_exception_safety(seed):
    consts = _CpuConstants()
    real = torch.tensor
    with pytest.raises(RuntimeError, match="boom"):
        with consts.active("record"):
            raise RuntimeError("boom")
    assert torch.tensor is real
    cpu = {"device": "cpu"}
    assert consts._key("tensor", [1, 2], (), cpu) != consts._key("tensor", [1, 2.0], (), cpu)
    assert consts._key("tensor", [1, 2], (), cpu) != consts._key("tensor", (1, 2), (), cpu)
    assert consts._key("tensor", [1], (), {"device": "cpu", "dtype": torch.int}) != consts._key(
        "tensor", [1], (), {"device": "cpu", "dtype": torch.long})
    assert consts._key("tensor", [1], (), {}) is None  # no device: a host tensor, nothing to intercept
    assert consts._key("as_tensor", 3, (None, "cpu"), {}) == consts._key("as_tensor", 3, (), {"device": "cpu"})
    assert consts._key("tensor", [object()], (), {"device": "cpu"}) is None
    x = torch.arange(4)
    assert consts._key("as_tensor", x, (), cpu) == consts._key("as_tensor", x.clone(), (), cpu)
    assert consts._key("as_tensor", x, (), cpu) != consts._key("as_tensor", x.to(torch.int32), (), cpu)
    k = consts._key("as_tensor", torch.tensor(3.5), (), cpu)  # a 0-dim host tensor
    assert k is not None and k != consts._key("as_tensor", torch.tensor(3.25), (), cpu)
    assert C.HostConstants()._key("tensor", [1], (), {"device": "cpu"}) is None  # default: CUDA targets only


def test_keep_rope_holds_cached_freqs(seed):
    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    keep: list[torch.Tensor] = []
    with C.KeepRope(model, keep):
        assert "_compute_video_freqs" in model.pos_embed.__dict__
        out = _first(_run(model, kw))
    assert "_compute_video_freqs" not in model.pos_embed.__dict__
    assert keep and all(isinstance(x, torch.Tensor) for x in keep)
    assert torch.equal(out, _first(_run(model, kw)))


# ------------------------------------------------------------------------------------------ capture plumbing
# The capture / replay code path driven on the CPU with stand-ins for torch.cuda's stream and graph objects
# (tests/cuda_graph_fakes.py, the fake_cuda fixture of tests/conftest.py): the "graph" of a signature replays by
# running the wrapped forward on the static buffers and writing into the static output, which is what a CUDA graph
# does. Exactness of real replays is checked in tests/test_cuda_graph_gpu.py.


def _gcall(runner, model, kw):
    """A call through the runner; a graph it captured gets its (fake) replay right away."""
    out = _first(_run(model, kw))
    _arm(runner)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("zero_cond_t", [False, True])
@pytest.mark.parametrize("patched", [False, True])
def test_capture_plumbing_with_fake_graphs(fake_cuda, zero_cond_t, patched, seed, caplog):
    import logging

    model = T.tiny_transformer(seed=seed, zero_cond_t=zero_cond_t)
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)
    a = [T.transformer_inputs(model, seed=seed + 1 + i, masked_tail=2) for i in range(3)]  # one signature
    b = [T.transformer_inputs(model, seed=seed + 10 + i, text_len=5, masked_tail=0) for i in range(2)]  # another
    ra, rb = [_first(_run(model, kw)) for kw in a], [_first(_run(model, kw)) for kw in b]
    runner, fb = _install(model, max_graphs=4)
    with caplog.at_level(logging.INFO, logger="qwen_absorb"):
        first = _gcall(runner, model, a[0])  # warm-up + capture: the warm-up's output answers
    assert torch.equal(first, ra[0])
    d = runner.describe()
    assert (d["captures"], d["graphs"], d["replays"]) == (1, 1, 0) and not fb, (d, fb)
    entry = next(iter(runner._graphs.values()))
    assert entry.keep, "the RoPE tables the graph reads are held by it"
    consts = 2 if zero_cond_t else 1  # modulate_index (edit models), the text length next to a mask
    assert any(f"({consts} host constants)" in r.getMessage() for r in caplog.records), caplog.text
    outs = [_gcall(runner, model, kw) for kw in (a[1], b[0], a[2], b[1], a[0])]
    outs += [_gcall(runner, model, kw) for kw in (b[0], a[1])]
    for o, r in zip(outs, (ra[1], rb[0], ra[2], rb[1], ra[0], rb[0], ra[1])):
        assert torch.equal(o, r)  # checked after all calls: returned outputs never alias
    assert all(o.data_ptr() != x.data_ptr() for o in outs for e in runner._graphs.values()
               for x in C.tensors_in(e.out))
    d = runner.describe()
    assert (d["captures"], d["graphs"], d["eager_calls"]) == (2, 2, 0), d
    assert d["replays"] == 6 and d["host_us_per_replay"] > 0

    # a weight modified in place: graphs dropped, the next call captures again and is right
    with torch.no_grad():
        model.proj_out.weight.mul_(1.5)
    out = _gcall(runner, model, a[0])
    runner.remove()
    ref = _first(_run(model, a[0]))
    assert torch.equal(out, ref)
    d = runner.describe()
    assert d["captures"] == 3 and any(k.startswith("weights modified in place (proj_out.weight)")
                                      for k in d["invalidations"]), d
    assert "forward" not in model.__dict__ and d["graphs"] == 0


@pytest.mark.slow
def test_capture_plumbing_lru_and_failure(fake_cuda, seed, caplog):
    import logging

    model = T.tiny_transformer(seed=seed)
    shapes = [(2, 2), (2, 4), (4, 4)]
    ins = {s: T.transformer_inputs(model, seed=seed + 1, height=s[0], width=s[1]) for s in shapes}
    refs = {s: _first(_run(model, kw)) for s, kw in ins.items()}
    runner, fb = _install(model, max_graphs=2)
    for _ in range(2):
        for s in shapes:
            assert torch.equal(_gcall(runner, model, ins[s]), refs[s])
            assert runner.describe()["graphs"] <= 2
    d = runner.describe()
    assert (d["graphs"], d["captures"], d["evictions"], d["replays"]) == (2, 6, 4, 0), d
    assert torch.equal(_gcall(runner, model, ins[(4, 4)]), refs[(4, 4)])
    assert runner.describe()["replays"] == 1
    runner.remove()

    _FakeGraph.fail = True
    runner, fb = _install(model)
    with caplog.at_level(logging.WARNING, logger="qwen_absorb"):
        for _ in range(3):
            assert torch.equal(_gcall(runner, model, ins[(2, 4)]), refs[(2, 4)])
    d = runner.describe()
    assert d["failed_signatures"] == 1 and d["captures"] == 0 and d["capture_failures"] == {"RuntimeError": 1}
    assert fb == collections.Counter({"cuda_graph: capture failed (this signature runs eager)": 3})
    assert len([r for r in caplog.records if "capture failed" in r.getMessage()]) == 1
    assert torch.tensor.__module__ != __name__ and "wrapper" not in getattr(torch.tensor, "__qualname__", "")


@pytest.mark.slow
def test_capture_plumbing_unstable_model(fake_cuda, seed):
    """Something that changes the model between every two calls: each graph is dropped before it ever replays;
    after a few the runner stops capturing (eager, counted) until invalidate()."""
    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    blk = model.transformer_blocks[0]
    runner, fb = _install(model)
    for _ in range(settings.MAX_UNREPLAYED_INVALIDATIONS + 2):
        assert torch.equal(_gcall(runner, model, kw), ref)
        blk.__dict__["_qwen_absorb_probe"] = object()  # e.g. a per-call switch set from outside
    d = runner.describe()
    assert d["unstable"] and d["captures"] == settings.MAX_UNREPLAYED_INVALIDATIONS, d
    assert fb["cuda_graph: model state changes on every call"] == 2, fb
    runner.invalidate("user")
    assert torch.equal(_gcall(runner, model, kw), ref)
    assert torch.equal(_gcall(runner, model, kw), ref)
    d = runner.describe()
    assert not d["unstable"] and d["replays"] == 1 and d["invalidations"]["user"] == 1, d


def test_capture_plumbing_lazy_state_is_snapshotted_after_capture(fake_cuda, seed):
    """A forward that sets state on its first run (as lazy plans do) must not make the next call re-capture."""
    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))
    blk = model.transformer_blocks[0]
    orig = blk.forward

    def lazy(*a, **k):
        blk.__dict__.setdefault("_qwen_absorb_lazy", object())  # first run only
        return orig(*a, **k)

    object.__setattr__(blk, "forward", lazy)
    runner, fb = _install(model)
    assert torch.equal(_gcall(runner, model, kw), ref)
    for _ in range(3):
        assert torch.equal(_gcall(runner, model, kw), ref)
    d = runner.describe()
    assert (d["captures"], d["replays"], d["invalidations"]) == (1, 3, {}), d


# ------------------------------------------------------------------------------------------ install options


def test_install_option_validation(seed):
    model = T.tiny_transformer(seed=seed)
    with pytest.raises(TypeError, match="host_tensors"):
        CG.install(model, fallbacks=collections.Counter(), host_tensors=[model.proj_out.weight])
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="capture_after"):
            CG.install(model, fallbacks=collections.Counter(), capture_after=bad)
    assert "forward" not in model.__dict__
    runner, _ = _install(model, capture_after=2)
    assert runner.describe()["capture_after"] == 2 and runner.describe()["new_signature_calls"] == 0


def _with_host_param(model):
    """A parameter the forward never reads, on the meta device: stands for an original weight offloaded to
    host memory while its FP8 copy runs on the GPU (on a CPU host, 'cpu' is the graph device here)."""
    lin = model.transformer_blocks[0].attn.to_q
    lin.register_parameter("offloaded_original", nn.Parameter(torch.zeros(lin.weight.shape, device="meta"),
                                                             requires_grad=False))
    return lin.offloaded_original


def test_host_tensors_are_allowed_off_the_device_and_fingerprinted(fake_cuda, monkeypatch, seed):
    monkeypatch.setattr(settings, "GRAPH_DEVICE_TYPES", ("cpu",))
    model = T.tiny_transformer(seed=seed)
    host = _with_host_param(model)
    ins = [T.transformer_inputs(model, seed=seed + 1 + i) for i in range(3)]
    refs = [_first(_run(model, kw)) for kw in ins]

    runner, fb = _install(model)  # without host_tensors: a parameter off the graph device refuses
    assert torch.equal(_gcall(runner, model, ins[0]), refs[0])
    assert fb == collections.Counter({"cuda_graph: offloading hook": 1}) and runner.describe()["captures"] == 0
    runner.remove()

    extra = torch.zeros(4)  # a tensor handed in that no module registers: fingerprinted too
    calls = []

    def host_tensors():
        calls.append(1)
        return [host, extra]

    runner, fb = _install(model, host_tensors=host_tensors)
    for kw, r in zip(ins + ins, refs + refs):
        assert torch.equal(_gcall(runner, model, kw), r)
    d = runner.describe()
    assert (d["captures"], d["replays"], d["graphs"]) == (1, 5, 1) and not fb, (d, fb)
    assert runner._scan.host_count == 1 and runner._scan.device == torch.device("cpu")
    scans = len(calls)
    assert scans >= 1

    with torch.no_grad():
        host.add_(1.0)  # a change to a host tensor still invalidates
    assert torch.equal(_gcall(runner, model, ins[0]), refs[0])
    d = runner.describe()
    assert d["captures"] == 2 and any(
        k.startswith("weights modified in place (transformer_blocks.0.attn.to_q.offloaded_original)")
        for k in d["invalidations"]), d
    assert len(calls) > scans  # read anew for the new scan

    extra.add_(1.0)
    assert torch.equal(_gcall(runner, model, ins[1]), refs[1])
    d = runner.describe()
    assert d["captures"] == 3 and any(k.startswith("weights modified in place (host tensor 1)")
                                      for k in d["invalidations"]), d

    # the same tensor back on the graph device (un-offloaded): a move, seen; host_tensors may keep naming it
    model.transformer_blocks[0].attn.to_q.offloaded_original = nn.Parameter(torch.zeros(host.shape),
                                                                            requires_grad=False)
    assert torch.equal(_gcall(runner, model, ins[2]), refs[2])
    d = runner.describe()
    assert d["captures"] == 4 and any("module structure changed" in k for k in d["invalidations"]), d
    assert not fb


def test_host_tensors_that_raise_allow_nothing(fake_cuda, monkeypatch, seed, caplog):
    import logging

    monkeypatch.setattr(settings, "GRAPH_DEVICE_TYPES", ("cpu",))
    model = T.tiny_transformer(seed=seed)
    _with_host_param(model)
    kw = T.transformer_inputs(model, seed=seed + 1)
    ref = _first(_run(model, kw))

    def broken():
        raise KeyError("gone")

    runner, fb = _install(model, host_tensors=broken)
    with caplog.at_level(logging.WARNING, logger="qwen_absorb"):
        for _ in range(2):
            assert torch.equal(_gcall(runner, model, kw), ref)
    assert fb == collections.Counter({"cuda_graph: offloading hook": 2})
    assert len([r for r in caplog.records if "host_tensors() raised" in r.getMessage()]) == 1


@pytest.mark.parametrize("capture_after", [1, 2])
def test_capture_after_eager_calls(fake_cuda, capture_after, seed):
    model = T.tiny_transformer(seed=seed)
    a = [T.transformer_inputs(model, seed=seed + 1 + i) for i in range(capture_after + 3)]
    b = T.transformer_inputs(model, seed=seed + 20, height=2, width=4)  # a one-off signature
    ra, rb = [_first(_run(model, kw)) for kw in a], _first(_run(model, b))
    runner, fb = _install(model, capture_after=capture_after)
    for i in range(capture_after):
        assert torch.equal(_gcall(runner, model, a[i]), ra[i])
        d = runner.describe()
        assert (d["captures"], d["new_signature_calls"], d["eager_calls"]) == (0, i + 1, 0), d
    assert torch.equal(_gcall(runner, model, b), rb)  # never pays a capture
    assert torch.equal(_gcall(runner, model, a[capture_after]), ra[capture_after])  # seen enough: captured
    d = runner.describe()
    assert (d["captures"], d["replays"], d["new_signature_calls"]) == (1, 0, capture_after + 1), d
    for kw, r in zip(a[capture_after + 1:], ra[capture_after + 1:]):
        assert torch.equal(_gcall(runner, model, kw), r)
    d = runner.describe()
    assert (d["captures"], d["replays"], d["graphs"], d["eager_calls"]) == (1, 2, 1, 0), d
    assert not fb  # a new signature is a policy, not a fallback
    # after an invalidation a signature already seen captures at once
    runner.invalidate("user")
    assert torch.equal(_gcall(runner, model, a[0]), ra[0])
    assert runner.describe()["captures"] == 2 and runner.describe()["new_signature_calls"] == capture_after + 1


def test_capture_after_forgets_old_signatures(fake_cuda, monkeypatch, seed):
    monkeypatch.setattr(settings, "MAX_COUNTED_SIGNATURES", 2)
    model = T.tiny_transformer(seed=seed)
    ins = [T.transformer_inputs(model, seed=seed + 1, height=h, width=w) for h, w in ((2, 2), (2, 4), (4, 4))]
    runner, _ = _install(model, capture_after=1)
    for kw in ins + ins:  # three signatures round robin, two remembered: each is new every time
        _gcall(runner, model, kw)
    d = runner.describe()
    assert d["captures"] == 0 and d["new_signature_calls"] == 6 and len(runner._seen) == 2, d


def test_capture_after_zero_is_the_default(fake_cuda, seed):
    model = T.tiny_transformer(seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    runner, _ = _install(model)
    _gcall(runner, model, kw)
    d = runner.describe()
    assert d["capture_after"] == 0 and d["captures"] == 1 and d["new_signature_calls"] == 0


# ------------------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("wrapped", ["class forward", "instance wrapper", "inside a hook chain"])
def test_remove_frees_the_model_while_the_runner_lives(fake_cuda, wrapped, seed):
    """After remove() nothing of the runner keeps the transformer, its parameters, the static buffers or
    the graphs alive; the runner itself (held by a report, say) stays usable as plain data."""
    import gc
    import weakref

    from diffusers.hooks import HookRegistry, ModelHook

    model = T.tiny_transformer(seed=seed, zero_cond_t=True)
    if wrapped == "instance wrapper":
        inner = model.forward

        def wrapper(*a, **k):
            return inner(*a, **k)

        model.forward = wrapper
    ins = [T.transformer_inputs(model, seed=seed + 1 + i, masked_tail=2) for i in range(2)]
    refs = [_first(_run(model, kw)) for kw in ins]
    runner, fb = _install(model)
    for kw, r in zip(ins + ins, refs + refs):
        assert torch.equal(_gcall(runner, model, kw), r)
    d = runner.describe()
    assert d["captures"] == 1 and d["replays"] == 3, (d, fb)
    registry = None
    if wrapped == "inside a hook chain":  # a hook registered after install: the runner sits inside its chain
        registry = HookRegistry.check_if_exists_or_initialize(model)
        registry.register_hook(ModelHook(), "noop")
        assert model.__dict__["forward"] is not runner and registry._fn_refs[0].forward is runner
    entry = next(iter(runner._graphs.values()))
    dead = {name: weakref.ref(x) for name, x in (
        ("model", model), ("block", model.transformer_blocks[0]), ("weight", model.proj_out.weight),
        ("static input", entry.statics[0]), ("static output", C.tensors_in(entry.out)[0]),
        ("graph", entry.graph))}
    del entry
    runner.remove()
    assert runner._graphs == {} and runner._pools == {} and runner._streams == {} and runner._scan is None
    assert not torch.equal(refs[0], torch.zeros_like(refs[0]))
    if registry is not None:
        assert registry._fn_refs[0].forward.__func__ is type(model).forward
    with torch.no_grad():
        out = _first(runner(**ins[0]))  # a removed runner passes through while its model lives
    assert torch.equal(out, refs[0])
    assert torch.equal(_first(_run(model, ins[1])), refs[1])
    del model, registry, out
    if wrapped == "instance wrapper":
        del inner, wrapper
    gc.collect()
    alive = [name for name, r in dead.items() if r() is not None]
    assert not alive, alive
    d = runner.describe()
    json.dumps(d)
    assert d["installed"] is False and d["captures"] == 1 and d["replays"] == 3 and d["graphs"] == 0
    assert "removed" in repr(runner) and "QwenImageTransformer2DModel" in repr(runner)
    with pytest.raises(RuntimeError, match="removed"):
        runner(**ins[0])
    copy.deepcopy(runner).describe()
    pickle.loads(pickle.dumps(runner)).describe()


def test_unpatch_frees_a_graphed_patched_model(seed):
    """patch(cuda_graph=True) + unpatch() + del: the runner the report holds keeps nothing alive."""
    import gc
    import weakref

    model = T.tiny_transformer(seed=seed)
    report = qwen_absorb.patch(model, cuda_graph=True)
    runner = model.__dict__["forward"]
    assert isinstance(runner, CG.GraphedCall)
    _run(model, T.transformer_inputs(model, seed=seed + 1))
    refs = [weakref.ref(model), weakref.ref(model.transformer_blocks[0]), weakref.ref(model.proj_out.weight)]
    qwen_absorb.unpatch(model)
    assert runner.describe()["installed"] is False
    del model
    gc.collect()
    assert [r() is None for r in refs] == [True] * 3
    assert runner.describe()["refusals"] == {"input on cpu": 1}
    assert report is not None  # the user still holds the report (and the runner)


# ------------------------------------------------------------------------------------------ LoRA


def _lora_model(seed, names=("a", "b")):
    from peft import LoraConfig

    model = T.tiny_transformer(seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 7)
        for i, name in enumerate(names):
            model.add_adapter(LoraConfig(r=2, lora_alpha=2 + 2 * i, target_modules=["to_q", "to_k", "to_out.0"],
                                         init_lora_weights=False), adapter_name=name)
    return model


def test_lora_state_is_fingerprinted_on_its_own(seed):
    """Each PEFT switch changes the LoRA part of the fingerprint by itself, whatever else also moves (fuse_lora
    writes base_layer.weight.data in place, which no _version sees: the merged-adapter list is the signal)."""
    model = _lora_model(seed)
    model.set_adapters(["a", "b"], weights=[1.0, 1.0])
    base = model.transformer_blocks[0].attn.to_q.base_layer.weight

    def lora_changed(step):
        scan = F.Scan(model)
        assert scan.peft, "the LoRA layers are watched"
        version = base._version
        step()
        assert F.lora_state(scan.peft_dicts) != scan.peft_state
        assert scan.changed() is not None and scan.which()
        return version

    lora_changed(lambda: model.set_adapters(["a", "b"], weights=[0.5, 1.0]))  # scaling values
    lora_changed(lambda: model.set_adapters(["a"], weights=[0.5]))  # active adapters
    lora_changed(lambda: model.disable_adapters())
    lora_changed(lambda: model.enable_adapters())
    version = lora_changed(lambda: model.fuse_lora(adapter_names=["a"]))
    assert base._version == version  # the trap: an in-place write through .data
    lora_changed(lambda: model.unfuse_lora())
    lora_changed(lambda: model.delete_adapters("b"))

    # in place, nothing else changing: only the LoRA state can see these
    lin = model.transformer_blocks[0].attn.to_q
    scan = F.Scan(model)
    lin.merged_adapters.append("a")
    assert scan.changed() == "LoRA adapter state changed" and scan.which() == "transformer_blocks.0.attn.to_q"
    lin.merged_adapters.clear()
    assert scan.changed() is None
    lin.scaling["a"] = lin.scaling["a"] * 2
    assert scan.changed() == "LoRA adapter state changed"


@pytest.mark.slow
def test_lora_lifecycle_recaptures_with_fake_graphs(fake_cuda, seed):
    """The PEFT lifecycle on a graphed model: every step that changes what runs drops the graphs and the next
    call captures anew; outputs are an ungraphed twin's that took the same steps."""
    from peft import LoraConfig

    model, twin = _lora_model(seed), _lora_model(seed)
    ins = [T.transformer_inputs(model, seed=seed + 1 + i) for i in range(2)]
    runner, fb = _install(model)

    def check(label):
        n = runner.describe()["captures"]
        for kw in ins + ins:
            assert torch.equal(_gcall(runner, model, kw), _first(_run(twin, kw))), label
        d = runner.describe()
        assert d["captures"] == n + 1 and d["replays"] >= 3, (label, d)

    check("first")

    def add_c(m):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 11)
            m.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_v"], init_lora_weights=False),
                          adapter_name="c")

    steps = [
        ("set_adapters weights", lambda m: m.set_adapters(["a", "b"], weights=[0.5, 0.25])),
        ("disable", lambda m: m.disable_adapters()),
        ("enable", lambda m: m.enable_adapters()),
        ("fuse", lambda m: m.fuse_lora(adapter_names=["a"])),
        ("unfuse", lambda m: m.unfuse_lora()),
        ("delete", lambda m: m.delete_adapters("b")),
        ("add", add_c),
    ]
    for label, step in steps:
        step(model)
        step(twin)
        check(label)
    d = runner.describe()
    assert d["captures"] == 1 + len(steps) and not d["unstable"] and not fb, (d, fb)


def _count_launches(monkeypatch) -> collections.Counter:
    """Fake replays counted per graph (by id) from now on."""
    launches = collections.Counter()
    real_replay = _FakeGraph.replay

    def counting(self):
        launches[id(self)] += 1
        real_replay(self)

    monkeypatch.setattr(_FakeGraph, "replay", counting)
    return launches


def _graphed_once(runner, model, twin, kw) -> tuple[int, object]:
    """Two calls (capture if needed, then a replay), each equal to the ungraphed twin's; the id of the one graph,
    and the graph: the caller holds it, so that no later graph can be given the same id."""
    for _ in range(2):
        assert torch.equal(_gcall(runner, model, kw), _first(_run(twin, kw)))
    (entry,) = runner._graphs.values()
    return id(entry.graph), entry.graph


@pytest.mark.slow
def test_checks_around_the_launch_with_fake_graphs(fake_cuda, monkeypatch, seed):
    """Scan.moved runs before a replay is launched (memory the graph reads may be gone: never launched), Scan.stale
    after it (the launched replay is discarded, the call runs eager): each kind of change, outputs always the
    ungraphed twin's."""
    model, twin = _lora_model(seed), _lora_model(seed)
    qwen_absorb.patch(model, cuda_graph=False)
    qwen_absorb.patch(twin, cuda_graph=False)
    kw = T.transformer_inputs(model, seed=seed + 1)
    runner, fb = _install(model)
    launches = _count_launches(monkeypatch)

    blk, tblk = model.transformer_blocks[0], twin.transformer_blocks[0]
    stale_steps = [  # seen after the launch: one discarded replay each
        ("in-place weight write", lambda b: b.img_mod[1].weight.mul_(1.5)),
        ("switch value", lambda b: setattr(b.attn.to_q, "_disable_adapters", True)),
        ("LoRA scaling", lambda b: b.attn.to_k.scaling.__setitem__("a", 0.25)),
        ("hook added", lambda b: b.img_norm1.register_forward_hook(lambda *a: None)),
        # the scan holds the replaced processor: the replay reads live memory, and is discarded
        ("processor replaced", lambda b: setattr(b.attn, "processor", type(b.attn.processor)())),
    ]
    for label, step in stale_steps:
        g, held = _graphed_once(runner, model, twin, kw)
        n, d = launches[g], runner.discarded_replays
        with torch.no_grad():
            handles = [step(blk), step(tblk)]
        assert torch.equal(_gcall(runner, model, kw), _first(_run(twin, kw))), label
        assert launches[g] == n + 1 and runner.discarded_replays == d + 1, label  # launched, then discarded
        assert not any(e.graph is held for e in runner._graphs.values()), label
        for h in handles:
            if isinstance(h, torch.utils.hooks.RemovableHandle):
                h.remove()  # a hooked submodule refuses graphs: take it off for the next step
    moved_steps = [  # seen before the launch: the old graph never runs again
        ("weight moved", lambda b: setattr(b.img_mod[1].weight, "data", b.img_mod[1].weight.data.clone())),
        ("block decided anew", lambda b: qwen_absorb.block.redecide(b._qwen_absorb_plan, b, torch.device("cpu"), "t")),
    ]
    for label, step in moved_steps:
        g, held = _graphed_once(runner, model, twin, kw)
        n, d = launches[g], runner.discarded_replays
        with torch.no_grad():
            step(blk)
            step(tblk)
        assert torch.equal(_gcall(runner, model, kw), _first(_run(twin, kw))), label
        assert launches[g] == n and runner.discarded_replays == d, label
    assert runner.describe()["discarded_replays"] == len(stale_steps)


@pytest.mark.slow
def test_fp8_sources_are_checked_after_the_launch_with_fake_graphs(fake_cuda, monkeypatch, seed):
    """A real-FP8 model (the CPU's ``torch._scaled_mm``): its graph reads the plans' FP8 codes and scales, not the
    original weights or amaxes they are made from (``plan.derived_only_sources``). Such a source moved: the replay
    is launched and discarded (Scan.stale); a tensor the graph reads (a bias) moved: never launched. Outputs are
    always those of the ungraphed twin that made the same change."""
    pytest.importorskip("modelopt")
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    T.fp8_quantize(model, [kw])
    twin = copy.deepcopy(model)
    real = {"fp8_gemm": True, "capabilities": {"cpu"}}
    assert qwen_absorb.patch(model, **real, cuda_graph=False).summary["fp8_gemm_linears"] == 28
    qwen_absorb.patch(twin, **real, cuda_graph=False)
    runner, fb = _install(model)
    launches = _count_launches(monkeypatch)

    def scaled(t):  # new memory, new values: the twin rebuilds its FP8 weight from them too
        t.data = t.data * 1.5

    steps = [  # (what, change, launched and discarded)
        ("original weight moved", lambda b: scaled(b.attn.to_q.weight), True),
        ("input amax moved", lambda b: scaled(b.img_mlp.net[2].input_quantizer._amax), True),
        ("bias moved", lambda b: scaled(b.attn.to_k.bias), False),
    ]
    for label, step, discarded in steps:
        g, held = _graphed_once(runner, model, twin, kw)
        n, d = launches[g], runner.discarded_replays
        with torch.no_grad():
            step(model.transformer_blocks[1])
            step(twin.transformer_blocks[1])
        assert torch.equal(_gcall(runner, model, kw), _first(_run(twin, kw))), label
        assert launches[g] == n + discarded and runner.discarded_replays == d + discarded, label
        assert not any(e.graph is held for e in runner._graphs.values()), label
    assert not fb, fb


@pytest.mark.parametrize("patched", [False, True])
def test_a_norm_eps_set_anew_is_a_change(seed, patched):
    """A graph holds the eps its LayerNorm / RMSNorm kernels were launched with: ``norm.eps = ...`` (no tensor moves)
    is a change the scan sees, an equal value is none; so are GELU's ``approximate`` and the RoPE's ``scale_rope``."""
    model = T.tiny_transformer(seed=seed)
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)
    blk = model.transformer_blocks[1]
    for norm in (blk.img_norm1, blk.attn.norm_added_k):
        scan = F.Scan(model)
        norm.eps = float(norm.eps)  # the same value, another object
        assert scan.changed() is None
        norm.eps = 0.05
        assert scan.changed() == F.SWITCHED and "eps" in scan.which()
    # the other plain attributes a graph bakes in: GELU's approximation, the RoPE's scale_rope
    for m, k, v in ((blk.img_mlp.net[0], "approximate", "none"), (model.pos_embed, "scale_rope", None)):
        scan = F.Scan(model)
        setattr(m, k, (not getattr(m, k)) if v is None else v)
        assert scan.changed() == F.SWITCHED and k in scan.which(), k


@pytest.mark.parametrize("edit", ["bias_none", "parameters_slot", "class_swap", "modulelist_del", "modulelist_insert"])
def test_edits_no_registration_hook_reports_are_changes(seed, edit):
    """What a graph baked in, changed by an edit torch calls no registration hook for: a bias set to None, a
    direct ``_parameters[k] = p`` (accelerate's set_module_tensor_to_device), a module's class swapped, a
    ModuleList's ``del`` (a new ``_modules`` dict) or ``insert``. Each was replayed past before."""
    model = T.tiny_transformer(seed=seed, num_layers=3)
    qwen_absorb.patch(model, cuda_graph=False)
    scan = F.Scan(model)
    blk = model.transformer_blocks[1]
    if edit == "bias_none":
        blk.img_mlp.net[2].bias = None
    elif edit == "parameters_slot":
        w = model.proj_out.weight
        model.proj_out._parameters["weight"] = torch.nn.Parameter(w.detach() * 1.5, requires_grad=False)
    elif edit == "class_swap":
        class Gelu(type(blk.img_mlp.net[0])):
            pass

        blk.img_mlp.net[0].__class__ = Gelu
    elif edit == "modulelist_del":
        del model.transformer_blocks[2]
    else:
        model.transformer_blocks.insert(0, copy.deepcopy(blk))
    assert scan.changed() is not None


def test_kernel_choosing_switches_are_in_the_call_key():
    """cuBLAS fp16 accumulation and the SDPA reduced-precision switch pick other kernels: part of every key."""
    from qwen_absorb.cuda_graph.signature import global_flags

    m = torch.backends.cuda.matmul
    if not hasattr(m, "allow_fp16_accumulation"):
        pytest.skip("this torch has no allow_fp16_accumulation")
    before = global_flags()
    m.allow_fp16_accumulation = not m.allow_fp16_accumulation
    try:
        assert global_flags() != before
    finally:
        m.allow_fp16_accumulation = not m.allow_fp16_accumulation
    assert global_flags() == before


def test_switch_values_compared_by_value_identity_elsewhere(seed):
    """Plain switch values (ModelOpt's bools, num_bits tuples) are compared by value, one itemgetter per dict;
    a deleted switch or an incomparable value is a change; anything else by identity."""
    model = T.tiny_transformer(seed=seed)
    q = model.transformer_blocks[0].attn.to_q
    q._if_quant, q._num_bits = True, (4, 3)  # switch names the scan watches
    scan = F.Scan(model)
    assert any(d is q.__dict__ for d in scan.plain_dicts)
    q._num_bits = (4, 3)  # an equal tuple: no change
    assert scan.changed() is None
    q._num_bits = (8, 0)
    assert scan.changed() == F.SWITCHED and "_num_bits" in scan.which()
    q._num_bits = (4, 3)
    assert scan.changed() is None
    q._if_quant = torch.ones(3)  # a value that cannot be compared with a bool
    assert scan.changed() == F.SWITCHED
    q._if_quant = True
    del q.__dict__["_if_quant"]
    q.__dict__["_other"] = 1  # the dict length stays: the missing switch itself is the change
    assert scan.changed() == F.SWITCHED and "removed" in scan.which()
    blk = model.transformer_blocks[1]
    blk.forward = type(blk).forward.__get__(blk)  # an instance forward (a bound method): watched by identity
    scan = F.Scan(model)
    assert scan.moved() is None and scan.changed() is None
    blk.forward = type(blk).forward.__get__(blk)  # an equal bound method, a new object (the scan holds the old)
    assert scan.moved() is None and scan.stale() == F.SWITCHED
