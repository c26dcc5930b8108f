"""The ModelOpt journey on CPU: the recipe config, the save/load round trips, patching the reloaded model,
the example script, and the model being freed after ModelOpt's first import (tests/builders.py)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from qwen_absorb import modelopt_recipe as recipe  # noqa: E402
from . import builders as T  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# per block, what the recipe quantizes: every linear but img_mod.1, txt_mod.1 and img_mlp.net.2
BLOCK_FP8 = {"attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
             "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "txt_mlp.net.0.proj", "txt_mlp.net.2"}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _quantized(num_layers: int, dtype=torch.float32, calibrate: bool = True, **kw):
    model = T.tiny_transformer(num_layers=num_layers, dtype=dtype)
    inputs = T.transformer_inputs(model)
    loop = (lambda m: T.run_transformer(m, inputs)) if calibrate else None
    recipe.quantize(model, recipe.fp8_recipe_config(model, **kw), loop)
    return model, inputs


def _by_block(names) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for n in names:
        assert n.startswith("transformer_blocks."), f"{n} is outside the blocks"
        _, i, rest = n.split(".", 2)
        out.setdefault(int(i), set()).add(rest)
    return out


def _enabled_norm_quantizers(model) -> list[str]:
    return [n for n, m in model.named_modules() if n.endswith("norm1.input_quantizer") or
            n.endswith("norm2.input_quantizer") if m.is_enabled]


# ---------------------------------------------------------------------------------------------- config


def test_recipe_quantizes_only_the_middle_blocks_minus_the_sensitive_layers():
    model, _ = _quantized(6, calibrate=False)
    assert _by_block(recipe.quantized_linear_names(model)) == {2: BLOCK_FP8, 3: BLOCK_FP8}
    # nothing outside the blocks, no attention quantizers, no LayerNorm input quantizer (the export has none)
    enabled = [n for n, m in model.named_modules() if n.endswith("_quantizer") and m.is_enabled]
    assert all(n.startswith(("transformer_blocks.2.", "transformer_blocks.3.")) for n in enabled), enabled
    assert all(n.endswith(("weight_quantizer", "input_quantizer")) for n in enabled), enabled
    assert _enabled_norm_quantizers(model) == []
    # a config built from the layer count alone selects the same quantizers
    other = T.tiny_transformer(num_layers=6)
    recipe.quantize(other, recipe.fp8_recipe_config(6), None)
    assert [n for n, m in other.named_modules() if n.endswith("_quantizer") and m.is_enabled] == enabled


def test_recipe_block_indices_match_exactly_and_options_apply():
    # keep block 1 but not 10/11: the patterns must not match by prefix
    model, _ = _quantized(12, calibrate=False, keep_first=2, keep_last=0, sensitive_layers=("txt_mod",),
                          quantize_norm_inputs=True)
    blocks = _by_block(recipe.quantized_linear_names(model))
    assert sorted(blocks) == list(range(2, 12))
    assert all(b == BLOCK_FP8 | {"img_mod.1", "img_mlp.net.2"} for b in blocks.values())
    assert {n.split(".")[1] for n in _enabled_norm_quantizers(model)} == {str(i) for i in range(2, 12)}
    with pytest.raises(ValueError):
        recipe.fp8_recipe_config(4, sensitive_layers=("",))


# --------------------------------------------------------------------------------------- round trips


@pytest.fixture(scope="module")
def saved():
    """A calibrated bf16 recipe model (bf16: real FP8 GEMMs take bf16/fp16 activations), its inputs and
    its output."""
    model, inputs = _quantized(6, dtype=torch.bfloat16)
    return model, inputs, T.run_transformer(model, inputs)


def test_mto_save_restore_is_bit_identical(saved, tmp_path):
    model, inputs, y = saved
    recipe.save(model, tmp_path / "m.pth")
    restored = recipe.restore(recipe.empty_transformer(model.config, torch.bfloat16, "cpu"), tmp_path / "m.pth")
    assert recipe.quantized_linear_names(restored) == recipe.quantized_linear_names(model)
    assert torch.equal(T.run_transformer(restored, inputs), y)
    assert torch.equal(T.run_transformer(model, inputs), y)  # saving changed nothing


@pytest.mark.slow
def test_hf_export_loads_back_bit_identical_and_patches(saved, tmp_path):
    import qwen_absorb
    from safetensors.torch import load_file

    model, inputs, y = saved
    names = recipe.quantized_linear_names(model)
    spent = copy.deepcopy(model)  # the export converts the weights of the model it is given
    recipe.export_hf(spent, tmp_path / "hf")
    del spent
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    state = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        state.update(load_file(str(f)))

    loaded = recipe.load_hf_export(tmp_path / "hf")
    assert recipe.quantized_linear_names(loaded) == names
    modules = dict(loaded.named_modules())
    for n in names:  # the weights quantize to the checkpoint's bytes; the amaxes give its scales
        lin, scale = modules[n], state[f"{n}.weight_scale"]
        assert lin.weight.dtype == torch.bfloat16
        codes = (lin.weight.float() / scale).to(torch.float8_e4m3fn)
        assert torch.equal(codes.view(torch.uint8), state[f"{n}.weight"].view(torch.uint8))
        assert torch.equal(lin.weight_quantizer.amax.float() / 448, scale)
        assert torch.equal(lin.input_quantizer.amax.float() / 448, state[f"{n}.input_scale"])
    y_loaded = T.run_transformer(loaded, inputs)
    assert torch.equal(y_loaded, y)  # bf16: the export and its reload are the saved model, bit for bit

    report = qwen_absorb.patch(loaded, fp8_gemm=True, capabilities={"cpu"})
    assert report.summary["fp8_gemm_linears"] == len(names), str(report)
    y_patched = T.run_transformer(loaded, inputs)
    assert float((y_patched.double() - y.double()).norm() / y.double().norm()) < 0.02
    qwen_absorb.unpatch(loaded)
    assert torch.equal(T.run_transformer(loaded, inputs), y_loaded)

    compressed = recipe.load_hf_export(tmp_path / "hf", compress=True)  # float8 storage, checked bytes
    cmods = dict(compressed.named_modules())
    assert all(cmods[n]._parameters["weight"].data.dtype == torch.float8_e4m3fn for n in names)
    assert qwen_absorb.patch(compressed, fp8_gemm=True, capabilities={"cpu"}).summary["fp8_gemm_linears"] == len(names)


# ----------------------------------------------- ModelOpt's first import, then the script, in one interpreter

FRESH_INTERPRETER = """
import gc, runpy, sys, weakref
from tests import builders as T
if "modelopt" in sys.modules:
    print("memory: modelopt-preimported")
else:
    model = T.tiny_transformer()
    ref = weakref.ref(model)
    T.fp8_quantize(model, T.transformer_inputs(model))
    assert "modelopt.torch.quantization" in sys.modules
    del model
    gc.collect()
    print("memory:", "freed" if ref() is None else "alive")
sys.argv = [sys.argv[1], "--out", sys.argv[2]]
runpy.run_path(sys.argv[0], run_name="__main__")  # as `python examples/quantize_fp8.py --out DIR` runs it
"""


@pytest.mark.slow
def test_model_freed_after_first_modelopt_import_and_example_exits_0(tmp_path):
    """One fresh interpreter (an interpreter start costs seconds on a 2-core runner) does two things:

    1. ModelOpt not imported yet, a model quantized through tests/builders.py is freed by ``del``
       (ModelOpt's first import would otherwise pin the frame that holds it: tests/builders.py);
    2. ``python examples/quantize_fp8.py`` (CPU default: quantize -> save -> load -> patch) exits 0.
    """
    script = str(REPO / "examples" / "quantize_fp8.py")
    p = subprocess.run([sys.executable, "-c", FRESH_INTERPRETER, script, str(tmp_path)], cwd=REPO, env=_env(),
                       capture_output=True, text=True, timeout=600)
    out = f"exit {p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    memory = next(line.split()[-1] for line in p.stdout.splitlines() if line.startswith("memory:"))
    assert memory in ("freed", "modelopt-preimported"), out  # preimported: at module level, no model pinned
    assert p.returncode == 0, out
    assert "PASS" in p.stdout and "Traceback" not in p.stderr, out
    res = json.loads((tmp_path / "modelopt_journey_tiny_cpu.json").read_text())
    assert res["status"] == "pass" and res["reload_bit_identical"] is True
    assert res["quantized_linears"] == res["real_fp8_linears"] == 2 * len(BLOCK_FP8)
    assert res["hf_roundtrip"]["fp8_codes_identical_to_checkpoint"] is True
    assert {"rel_err_vs_bf16", "bf16_eager_ms", "gpu", "date", "versions", "reload_bit_identical"} <= set(res)


def test_export_code_mismatches_counts_the_codes_export_and_fake_quant_disagree_on():
    """ModelOpt's fake quantization multiplies by 448/amax, its export divides by amax/448: the count is
    of exactly the elements whose two float32 products round to different e4m3 codes."""
    R = recipe
    g = torch.Generator().manual_seed(7)
    amax = torch.tensor(3.703125, dtype=torch.bfloat16)
    w = ((torch.rand(4_000_000, generator=g) * 2 - 1) * 1e-3).bfloat16()  # small values: near subnormal steps
    x, a = w.float(), amax.float()
    fake = (x * (448.0 / a)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    exported = (x / (a / 448.0)).to(torch.float8_e4m3fn).view(torch.uint8)
    expected = int((fake != exported).sum())
    assert expected > 0  # tiny values sit on e4m3's subnormal boundaries often enough
    assert R._code_mismatches(w, amax) == expected
    # an element that disagrees is counted alone; a value on no boundary is not
    moved = w[fake != exported]
    assert R._code_mismatches(moved[:1], amax) == 1
    assert R._code_mismatches(torch.tensor([amax.float() / 2]).bfloat16(), amax) == 0


def test_export_code_mismatches_walks_the_quantized_linears():
    R = recipe
    model, _ = _quantized(6, dtype=torch.bfloat16)
    moved, total = R.export_code_mismatches(model)
    names = R.quantized_linear_names(model)
    modules = dict(model.named_modules())
    assert total == sum(modules[n].weight.numel() for n in names) > 0
    assert 0 <= moved < total
