"""Issue 21: ``qwen_absorb.patch`` on a Qwen-Image-2.1 transformer (CPU, tiny random models). The same
one line, report, unpatch and copies as Qwen-Image; outputs bit-identical to the unpatched model."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import qwen_absorb
from qwen_absorb.qwenimage21 import Patched21Forward

from .qwenimage21_helpers import model_inputs, run, run_kv, tiny_model

CASES = [
    {"batch_size": 1},
    {"batch_size": 2, "cond": True, "pad": 1},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_patch_is_bit_identical_and_unpatch_restores(dtype, case):
    model = tiny_model(dtype=dtype, seed=3, gain=4.0)
    inp = model_inputs(model, seed=4, **case)
    ref = run(model, inp)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    report = qwen_absorb.patch(model)
    assert report.transformer_class == "QwenImage21Transformer2DModel"
    assert report.summary["blocks_patched"] == 2 and report.summary["sites_fused"] == 10, str(report)
    assert all(isinstance(b.__dict__["forward"], Patched21Forward) for b in model.transformer_blocks)
    assert torch.equal(run(model, inp), ref)
    assert qwen_absorb.patch(model) is report  # same arguments: the current patch
    qwen_absorb.unpatch(model)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)
    assert torch.equal(run(model, inp), ref)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())
    assert not report.active and report.summary["blocks_patched"] == 2


def test_kv_cache_extract_then_cached():
    model = tiny_model(dtype=torch.bfloat16, seed=5)
    extract = model_inputs(model, seed=6, cond=True)
    cached = model_inputs(model, seed=7, cond=True)
    want = run_kv(model, extract, cached)
    report = qwen_absorb.patch(model)
    got = run_kv(model, extract, cached)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not [r for r in report.runtime_fallbacks if "original" in r or "eager" in r], report.runtime_fallbacks


def test_copies_and_the_report_plain_data():
    model = tiny_model(dtype=torch.bfloat16, seed=8)
    inp = model_inputs(model, seed=9, batch_size=2, pad=1)
    ref = run(model, inp)
    report = qwen_absorb.patch(model)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(run(twin, inp), ref)
        assert qwen_absorb.patch_report(twin) is not report
        fwd = twin.transformer_blocks[0].__dict__["forward"]
        assert isinstance(fwd, Patched21Forward) and fwd.block is twin.transformer_blocks[0]
    d = report.to_dict()
    assert d["summary"]["blocks_patched"] == 2 and d["blocks"][0]["sites"][0]["site"] == "norm1"


def test_a_hook_on_a_bypassed_norm_runs():
    model = tiny_model(dtype=torch.float32, seed=10)
    inp = model_inputs(model, seed=11)
    seen = []
    qwen_absorb.patch(model)
    h = model.transformer_blocks[1].img_norm2.register_forward_hook(lambda m, a, o: seen.append(1) or o * 2)
    out = run(model, inp)
    qwen_absorb.unpatch(model)
    want = run(model, inp)
    h.remove()
    assert torch.equal(out, want) and len(seen) == 2


def test_cuda_graph_true_installs_graphs_per_block_and_runs_exact():
    """diffusers' 2.1 forward syncs with the host before its blocks (tolist / nonzero), so a whole call cannot be
    captured: cuda_graph=True puts a graph runner on every block instead (tests/test_cuda_graph_blocks21.py).
    On the CPU every block call is refused ("input on cpu"), counted, and runs exactly as eager."""
    from qwen_absorb import cuda_graph as CG

    model = tiny_model(dtype=torch.bfloat16, seed=5, gain=4.0)
    inp = model_inputs(model, seed=6)
    ref = run(model, inp)
    report = qwen_absorb.patch(model, cuda_graph=True)
    assert report.cuda_graph_refused is None
    assert all(isinstance(b.__dict__["forward"], CG.GraphedCall) for b in model.transformer_blocks)
    assert [torch.equal(run(model, inp), ref) for _ in range(3)] == [True] * 3
    d = report.cuda_graph
    assert d["mode"] == "per block" and d["blocks"] == 2 and d["refusals"] == {"input on cpu": 6}
    assert report.to_dict()["cuda_graph"]["mode"] == "per block"
    assert "CUDA graphs per block (cuda_graph=True): 0 kept over 2 blocks" in str(report)
    assert report.runtime_fallbacks["cuda_graph: input on cpu"] == 6
    qwen_absorb.unpatch(model)
    assert all("forward" not in b.__dict__ for b in model.transformer_blocks)
    auto = qwen_absorb.patch(model)  # "auto" on a CPU model: no graph runners
    assert auto.cuda_graph_refused is None and auto.cuda_graph is None
    assert all(isinstance(b.__dict__["forward"], Patched21Forward) for b in model.transformer_blocks)
    qwen_absorb.unpatch(model)
