"""GPU tests of CUDA graphs per block for Qwen-Image-2.1 (issue 21, item 5): a small random
``QwenImage21Transformer2DModel`` on CUDA patched with graphs (``cuda_graph=True``: captured at first sight;
``"auto"``: at the second) against an unpatched twin with the same weights, bit for bit, on inputs drawn fresh
per call, with the caching allocator poisoned before every call (an element a replay did not write is a NaN).
Also: every block output kept by a hook equals the twin's (outputs are clones, never a graph's buffer), the KV
cache refused and exact, a weight change recaptured and exact, real FP8 blocks, memory given back by unpatch.

Run: ``python -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_graph_blocks21_gpu.py``.
"""

from __future__ import annotations

import copy
import gc
import importlib
import weakref

import pytest
import torch

import qwen_absorb
from qwen_absorb import gating

from .ops_helpers import poison_allocator as poison
from .ops_helpers import skip_module_without_kernels
from .qwenimage21_helpers import model_inputs, run, run_kv, tiny_model

P = importlib.import_module("qwen_absorb.patch")  # the module (qwen_absorb.patch is also the function)
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]
skip_module_without_kernels()

DEV = "cuda"
PREFIX = "cuda_graph: "
# 2 heads x 128 (the q/k RMSNorm + RoPE kernel's width), 3 blocks; 64 image tokens per target
SHAPE = {"heads": 2, "head_dim": 128, "axes": (16, 56, 56), "layers": 3}
TARGET = (8, 8)


def _pair(seed: int, dtype=torch.bfloat16):
    """(model, unpatched twin with the same weights), on CUDA."""
    return tuple(tiny_model(dtype=dtype, device=DEV, seed=seed, gain=4.0, **SHAPE) for _ in range(2))


def _group(model):
    return model.__dict__["_qwen_absorb_state"].graph


def _keep_block_outputs(model) -> list:
    seen: list = []
    for blk in model.transformer_blocks:
        blk.register_forward_hook(lambda mod, args, out: seen.append(out))  # runs outside the block's graph
    return seen


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (a NaN equals a NaN of the same bits)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _graph_fallbacks(report) -> dict:
    return {k: v for k, v in {**report.runtime_fallbacks, **report.graph_fallbacks}.items() if k.startswith(PREFIX)}


@pytest.mark.parametrize("case", [{"batch_size": 1}, {"batch_size": 2, "cond": True, "pad": 1}])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_replays_bit_identical_to_unpatched(dtype, case, seed):
    model, twin = _pair(seed % 1000, dtype)
    report = qwen_absorb.patch(model, cuda_graph=True)
    assert report.cuda_graph["mode"] == "per block" and report.cuda_graph["blocks"] == 3
    ins = [model_inputs(model, seed=seed + i, target=TARGET, **case) for i in range(3)]
    got_blocks, want_blocks = _keep_block_outputs(model), _keep_block_outputs(twin)
    outs = []
    for inp in ins:
        poison(64 << 20)
        outs.append(run(model, inp))
    want = [run(twin, inp) for inp in ins]
    torch.cuda.synchronize()
    for i, (o, w) in enumerate(zip(outs, want)):
        assert same(o, w), f"call {i}: {(o.float() - w.float()).abs().max().item()}"
    assert not torch.equal(want[0], want[1])
    assert len(got_blocks) == len(want_blocks) == 9
    assert all(same(a, b) for a, b in zip(got_blocks, want_blocks))
    d = report.cuda_graph
    assert d["capture_failures"] == {} and d["captures"] == 3 and d["replays"] == 6, d
    assert d["shared"]["pools"] == 1 and _graph_fallbacks(report) == {}, (d, _graph_fallbacks(report))
    qwen_absorb.unpatch(model)
    assert same(run(model, ins[0]), want[0])


def test_auto_leaves_the_blocks_eager_and_says_why(seed):
    """"auto" on a CUDA model installs no block graphs (measured no faster, qwenimage21_h200_3341f42.md) and says so."""
    model, twin = _pair(seed % 1000)
    report = qwen_absorb.patch(model)
    assert report.cuda_graph is None and report.cuda_graph_refused == P.GRAPHS_21_AUTO
    for i in range(2):
        inp = model_inputs(model, seed=seed + i, target=TARGET, cond=True)
        poison(64 << 20)
        assert same(run(model, inp), run(twin, inp)), i
    qwen_absorb.unpatch(model)


def test_kv_cache_refused_and_a_weight_change_recaptured(seed):
    model, twin = _pair(seed % 1000)
    report = qwen_absorb.patch(model, cuda_graph=True)
    extract = model_inputs(model, seed=seed, cond=True, target=TARGET)
    cached = model_inputs(model, seed=seed + 1, cond=True, target=TARGET)
    assert all(same(a, b) for a, b in zip(run_kv(model, extract, cached), run_kv(twin, extract, cached)))
    assert report.runtime_fallbacks[PREFIX + "unsupported argument type"] == 6
    ins = [model_inputs(model, seed=seed + 2 + i, target=TARGET) for i in range(4)]
    for inp in ins[:2]:
        assert same(run(model, inp), run(twin, inp))
    other = tiny_model(dtype=torch.bfloat16, device=DEV, seed=seed % 1000 + 1, gain=4.0, **SHAPE).state_dict()
    model.load_state_dict(other)
    twin.load_state_dict(other)
    for inp in ins[2:]:
        poison(64 << 20)
        assert same(run(model, inp), run(twin, inp))
    d = report.cuda_graph
    assert d["invalidations"] and d["captures"] == 6 and d["replays"] == 6 and d["capture_failures"] == {}, d


def test_real_fp8_blocks(seed):
    pytest.importorskip("modelopt")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("real FP8 GEMMs need sm_89 or newer")
    from . import builders as T

    base = tiny_model(dtype=torch.bfloat16, device=DEV, seed=seed % 1000, **SHAPE)
    T.fp8_quantize(base, [model_inputs(base, seed=seed, target=TARGET), model_inputs(base, cond=True, seed=seed + 1,
                                                                                     target=TARGET)])
    model, twin = base, copy.deepcopy(base)
    opts = {} if gating.capability_key(torch.device(DEV)) in gating.VALIDATED_FP8_CAPABILITIES else {"fp8_gemm": True}
    report = qwen_absorb.patch(model, cuda_graph=True, **opts)
    qwen_absorb.patch(twin, cuda_graph=False, **opts)
    assert report.summary["fp8_gemm_linears"] == 7 * SHAPE["layers"], str(report)
    for i in range(3):
        inp = model_inputs(model, seed=seed + 2 + i, cond=True, target=TARGET)
        poison(64 << 20)
        assert same(run(model, inp), run(twin, inp)), i
    d = report.cuda_graph
    assert d["replays"] == 6 and d["capture_failures"] == {}, d


def test_memory_steady_and_given_back_by_unpatch(seed):
    """Replays allocate nothing that stays; unpatch releases at least the static inputs and every graph's output."""
    model, twin = _pair(seed % 1000)
    inp = model_inputs(model, seed=seed, target=(16, 16), cond=True)
    want = run(twin, inp)
    report = qwen_absorb.patch(model, cuda_graph=True)
    for _ in range(2):
        assert same(run(model, inp), want)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        out = run(model, inp)
        del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    group = _group(model)
    graphs = [g for r in group.runners for g in r._graphs.values()]
    outputs = sum(g.out.untyped_storage().nbytes() for g in graphs)
    statics = group.describe()["shared"]["static_input_bytes"]
    assert len(graphs) == 3 and group.describe()["shared"]["static_inputs"] == 5 and outputs > 0 and statics > 0
    dead = weakref.ref(graphs[0].graph)
    del group, graphs
    held = torch.cuda.memory_allocated()
    qwen_absorb.unpatch(model)
    gc.collect()
    torch.cuda.synchronize()
    assert dead() is None
    assert torch.cuda.memory_allocated() <= held - outputs - statics, (held, outputs, statics)
    assert report.cuda_graph["replays"] == 21 * 3  # 22 calls of 3 blocks, the first one captured
    assert same(run(model, inp), want)
