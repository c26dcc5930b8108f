"""Graphs under ``enable_model_cpu_offload()`` on a GPU (issue 39 C): a tiny ``QwenImagePipeline``, three runs of
four steps with true CFG, patched against the unpatched pipeline in the same mode.

accelerate's hook moves the transformer to the GPU at the first call of a run (under the pipeline's
``torch.inference_mode()``) and diffusers moves it back at the end: each run captures each signature once and
replays the other steps; the graphs of a run are dropped at the next run's first call, before anything replays.
bf16 is bit-identical to the unpatched pipeline; FP8 (real FP8 GEMMs) is bit-identical to the same pipeline patched
and resident without graphs, and close to ModelOpt's fake quantization.
"""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from . import builders as T
from qwen_absorb.ops import _runtime

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)
FP8_OK = torch.cuda.get_device_capability() >= (8, 9)

DEV = torch.device("cuda")
# head_dim 128: the fused kernels run
SMALL = dict(attention_head_dim=128, num_attention_heads=4, joint_attention_dim=256, axes_dims_rope=(16, 56, 56),
             in_channels=16, out_channels=4)
RUNS, STEPS = 3, 4


def _transformer(kind, seed):
    m = T.tiny_transformer(dtype=torch.bfloat16, seed=seed, num_layers=3, **SMALL).to(DEV)
    if kind == "fp8":
        pytest.importorskip("modelopt.torch.quantization")
        T.fp8_quantize(m, [T.transformer_inputs(m, seed=seed + 1 + i, height=8, width=8) for i in range(2)])
    return m.to("cpu")


def _run(pipe, seed):
    dim = pipe.transformer.config.joint_attention_dim
    emb, mask = T.tiny_prompt_embeds(seq_len=12, dim=dim, seed=seed, dtype=torch.bfloat16, masked_tail=0, device=DEV)
    neg, nmask = T.tiny_prompt_embeds(seq_len=5, dim=dim, seed=seed + 1, dtype=torch.bfloat16, masked_tail=0,
                                      device=DEV)
    with torch.inference_mode():
        return pipe(prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                    negative_prompt_embeds_mask=nmask, true_cfg_scale=4.0, height=128, width=128,
                    num_inference_steps=STEPS, output_type="pt", generator=torch.Generator().manual_seed(seed)).images


def _runs(pipe, seeds):
    return [_run(pipe, s) for s in seeds]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("cuda_graph", ["auto", True])
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_model_offload_replays_graphs_and_matches_the_unpatched_pipeline(kind, cuda_graph):
    if kind == "fp8" and not FP8_OK:
        pytest.skip("FP8 GEMMs need sm_89+")
    t = _transformer(kind, 11)
    seeds = [3, 4, 3]  # the third run repeats the first: a replay must not carry state over
    twin = T.tiny_pipeline(dtype=torch.bfloat16, seed=0, transformer=copy.deepcopy(t))
    twin.enable_model_cpu_offload()
    want = _runs(twin, seeds)
    pipe = T.tiny_pipeline(dtype=torch.bfloat16, seed=0, transformer=t)
    pipe.enable_model_cpu_offload()
    report = qwen_absorb.patch(pipe, cuda_graph=cuda_graph, vae=False)  # graphs in the model-offload hook: the default
    outs = _runs(pipe, seeds)
    g = report.cuda_graph
    print(f"{kind} {cuda_graph}: rel {[round(_rel(o, w), 6) for o, w in zip(outs, want)]}, graphs {g}, "
          f"fallbacks {dict(report.graph_fallbacks)} {dict(report.runtime_fallbacks)}")
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())  # offloaded after every run
    runner = pipe.transformer.__dict__.get("_old_forward")
    assert isinstance(runner, CG.GraphedCall)  # inside accelerate's hook
    # two signatures (text lengths 12 and 5), captured once per run (the weights moved in), replayed after
    eager = 2 if cuda_graph == "auto" else 0
    assert g["captures"] == 2 * RUNS and g["replays"] == RUNS * 2 * STEPS - 2 * RUNS - eager, g
    # dropped once per later run, as the weights moved in: seen as such, or (FP8) by the FP8 forwards' rebuild first
    moved = ("weights moved", "a block decided anew or an FP8 forward rebuilt")
    assert sum(g["invalidations"].values()) == RUNS - 1 and all(r.startswith(moved) for r in g["invalidations"]), g
    assert not g["capture_failures"] and g["discarded_replays"] == 0, g
    assert not any("cuda_graph" in r for r in report.runtime_fallbacks) and not report.graph_fallbacks
    assert torch.equal(outs[0], outs[2])
    if kind == "bf16":
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
    else:  # real FP8 GEMMs: the same bits as resident and eager; close to ModelOpt's fake quantization
        resident = T.tiny_pipeline(dtype=torch.bfloat16, seed=0, transformer=copy.deepcopy(t)).to(DEV)
        qwen_absorb.patch(resident, cuda_graph=False, vae=False)
        ref = _runs(resident, seeds)
        assert all(torch.equal(o, r) for o, r in zip(outs, ref))
        assert all(_rel(o, w) < 0.05 for o, w in zip(outs, want))
    qwen_absorb.unpatch(pipe)
    assert torch.equal(_run(pipe, seeds[0]), want[0])  # unpatched: the twin's bits, still offloaded


def test_graphs_of_an_offloaded_run_are_dropped_when_the_weights_move():
    """The graphs (and their pool) of a run are gone once the next run moved the weights in: no replay reads the
    memory the previous placement freed, and GPU memory does not grow run after run."""
    t = _transformer("bf16", 12)
    pipe = T.tiny_pipeline(dtype=torch.bfloat16, seed=0, transformer=t)
    pipe.enable_model_cpu_offload()
    report = qwen_absorb.patch(pipe, cuda_graph=True, vae=False)  # graphs in the model-offload hook: the default
    _run(pipe, 5)
    runner = pipe.transformer.__dict__["_old_forward"]
    first = [weakref.ref(e.graph) for e in runner._graphs.values()]
    torch.cuda.synchronize()
    after_one = torch.cuda.memory_allocated()  # the transformer is on the CPU again: what its graphs hold
    for _ in range(3):
        _run(pipe, 5)
    torch.cuda.synchronize()
    assert len(first) == 2 and all(r() is None for r in first)
    assert len(runner._graphs) == 2 and report.cuda_graph["captures"] == 8
    assert torch.cuda.memory_allocated() <= after_one + (1 << 20), (after_one, torch.cuda.memory_allocated())
    qwen_absorb.unpatch(pipe)
