"""NVFP4 as rows at the sites on the GPU: a 2-block full-width (3072) Qwen-Image transformer quantized with ModelOpt
NVFP4, patched (eager and in CUDA graphs), is bit-identical to ModelOpt's own CUDA fake quantization; the fused
kernels emit every NVFP4 linear's input (no linear quantizes its own)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")
pytest.importorskip("modelopt.torch.quantization")

import qwen_absorb  # noqa: E402
from qwen_absorb import modelopt_recipe as recipe  # noqa: E402
from qwen_absorb import nvfp4  # noqa: E402
from . import builders as T  # noqa: E402
from qwen_absorb.plan import PLAN_ATTR  # noqa: E402
from qwen_absorb.sites import LINEAR_TABLE  # noqa: E402

if torch.cuda.get_device_capability() < nvfp4.MIN_CAPABILITY:
    pytest.skip("ModelOpt's NVFP4 fake quantization is its Triton kernel from sm_89 on", allow_module_level=True)


@pytest.fixture(scope="module")
def model_and_inputs():
    model = T.full_size_transformer(num_layers=2, dtype=torch.bfloat16, device="cuda", seed=3)
    calib = T.transformer_inputs(model, batch_size=1, height=8, width=8, text_len=12, seed=4)
    recipe.quantize(model, recipe.nvfp4_recipe_config(model, keep_first=0, keep_last=0),
                    lambda m: T.run_transformer(m, calib))
    inputs = [T.transformer_inputs(model, batch_size=1, height=8, width=8, text_len=12, seed=5),
              T.transformer_inputs(model, batch_size=2, height=6, width=8, text_len=9, seed=6)]
    return model, inputs


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_patched_nvfp4_rows_are_modelopt_bit_for_bit(model_and_inputs, cuda_graph, monkeypatch):
    model, inputs = model_and_inputs
    wants = [T.run_transformer(model, x) for x in inputs]
    own = []
    real_call = nvfp4.Nvfp4Linear.__call__
    monkeypatch.setattr(nvfp4.Nvfp4Linear, "__call__", lambda self, x: own.append(self) or real_call(self, x))
    report = qwen_absorb.patch(model, cuda_graph=cuda_graph)
    try:
        for blk in model.transformer_blocks:
            plan = blk.__dict__[PLAN_ATTR]
            assert plan.kernels, report
            assert {sp.key for sp in plan.sites if sp.emit == "nvfp4"} == {
                "img.norm1", "txt.norm1", "img.attn_residual", "txt.attn_residual"}, report
            assert {p for p, lp in plan.linears.items() if lp.quant == "nvfp4"} == set(LINEAR_TABLE), report
        for _ in range(3):  # eager; with graphs: warm-up, capture, replay
            for x, want in zip(inputs, wants):
                torch.cuda.synchronize()
                junk = torch.full((64 << 20,), float("nan"), dtype=torch.bfloat16, device="cuda")
                del junk  # poisoned memory: an unwritten output shows
                assert torch.equal(T.run_transformer(model, x), want)
    finally:
        qwen_absorb.unpatch(model)
    assert own == []
    assert torch.equal(T.run_transformer(model, inputs[0]), wants[0])
