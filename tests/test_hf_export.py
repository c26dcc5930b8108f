"""ModelOpt Hugging Face exports made by ModelOpt's own exporter on tiny models (FP8 and NVFP4), loaded back
by qwen_absorb.hf_export: layouts, byte checks, outputs against the exported model, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from safetensors.torch import load_file, save_file  # noqa: E402

from qwen_absorb import hf_export, nvfp4  # noqa: E402
from qwen_absorb import modelopt_recipe as recipe  # noqa: E402
from . import builders as T  # noqa: E402

QKV = (("to_q", "to_k", "to_v"), ("add_q_proj", "add_k_proj", "add_v_proj"))


def _unify_qkv(model) -> None:
    """ModelOpt's export gives q/k/v one amax each for weights and inputs (the max); do it before
    computing the exported model's output so that the export changes nothing. The amaxes are also rounded
    up to powers of two: ModelOpt's second-level scale ``amax / 2688`` is a division on CPU (where this
    export runs) and a product with the reciprocal on CUDA (what its fake quantization, and the reference,
    compute), which agree on powers of two only."""
    for m in model.modules():
        for q in (getattr(m, "weight_quantizer", None), getattr(m, "input_quantizer", None)):
            if q is not None and q.is_enabled and q.block_sizes:
                q.amax = torch.exp2(torch.ceil(torch.log2(q.amax.float()))).to(q.amax.dtype)
    for block in model.transformer_blocks:
        for group in QKV:
            lins = [getattr(block.attn, n) for n in group]
            for q in ("weight_quantizer", "input_quantizer"):
                quantizers = [getattr(lin, q) for lin in lins]
                if not all(qq.is_enabled for qq in quantizers):
                    continue
                top = torch.stack([qq.amax.float() for qq in quantizers]).max()
                for qq in quantizers:
                    qq.amax = top.to(qq.amax.dtype)


@pytest.fixture(scope="module")
def nvfp4_export(tmp_path_factory):
    """A calibrated W4A4 NVFP4 tiny model (blocks 0 and 5 of 6 kept in bf16, like NVIDIA's 0, 1, 58, 59),
    its output under ModelOpt's own quantizers (reference kernel on CPU), and its export."""
    model = T.tiny_transformer(num_layers=6, dtype=torch.bfloat16)
    inputs = T.transformer_inputs(model)
    recipe.quantize(model, recipe.nvfp4_recipe_config(model, keep_first=1, keep_last=1),
                    lambda m: T.run_transformer(m, inputs))
    _unify_qkv(model)
    names = nvfp4.nvfp4_linear_names(model)
    with nvfp4.modelopt_fake_quant_on_cpu():
        y = T.run_transformer(model, inputs)
    folder = tmp_path_factory.mktemp("nvfp4") / "export"
    recipe.export_hf(model, folder)
    return folder, inputs, y, names


@pytest.fixture(scope="module")
def fp8_export(tmp_path_factory):
    model = T.tiny_transformer(num_layers=6, dtype=torch.bfloat16)
    inputs = T.transformer_inputs(model)
    recipe.quantize(model, recipe.fp8_recipe_config(model), lambda m: T.run_transformer(m, inputs))
    y = T.run_transformer(model, inputs)
    names = recipe.quantized_linear_names(model)
    folder = tmp_path_factory.mktemp("fp8") / "export"
    recipe.export_hf(model, folder)
    return folder, inputs, y, names


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "diffusion_pytorch_model.safetensors"))


def test_nvfp4_export_layout_is_nvidias(nvfp4_export):
    folder, _, _, names = nvfp4_export
    sd = _state(folder)
    n = names[0]
    w, s, s2 = sd[f"{n}.weight"], sd[f"{n}.weight_scale"], sd[f"{n}.weight_scale_2"]
    assert w.dtype == torch.uint8 and s.dtype == torch.float8_e4m3fn and s2.dtype == torch.float32
    assert w.shape[1] * 2 == s.shape[1] * 16 and s2.numel() == 1 and sd[f"{n}.input_scale"].numel() == 1
    assert sd["transformer_blocks.0.attn.to_q.weight"].dtype == torch.bfloat16  # kept blocks stay bf16
    assert hf_export.read_quant_algo(folder) == "NVFP4"


@pytest.mark.slow
def test_nvfp4_export_loads_with_modelopt_nvfp4_quantizers_and_computes_the_exported_model(nvfp4_export):
    folder, inputs, y, names = nvfp4_export
    loaded = recipe.load_hf_export(folder)  # byte checks inside: codes and block scales
    assert next(loaded.parameters()).dtype == torch.bfloat16
    assert nvfp4.nvfp4_linear_names(loaded) == names
    with nvfp4.modelopt_fake_quant_on_cpu():
        got = T.run_transformer(loaded, inputs)
    assert torch.equal(got, y)
    # the loaded weights are on the NVFP4 grid: the runner shares them (no copy)
    modules = dict(loaded.named_modules())
    for n in names:
        runner = nvfp4.Nvfp4Linear(modules[n], use_kernel=False)
        runner.weight()
        assert runner.shares_weight and runner.extra_bytes() == 0, n


def test_fp8_export_round_trip_and_pipeline_folder(fp8_export, tmp_path):
    folder, inputs, y, names = fp8_export
    assert hf_export.read_quant_algo(folder) == "FP8"
    pipe_dir = tmp_path / "pipe"
    shutil.copytree(folder, pipe_dir / "transformer")  # a pipeline folder: its transformer is found
    loaded = hf_export.load_hf_export(pipe_dir)
    assert recipe.quantized_linear_names(loaded) == names
    assert torch.equal(T.run_transformer(loaded, inputs), y)


def test_hf_quant_config_json_side_file_is_read(fp8_export, tmp_path):
    folder = tmp_path / "side"
    shutil.copytree(fp8_export[0], folder)
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "hf_quant_config.json").write_text(json.dumps({"producer": qc["producer"],
                                                             "quantization": {"quant_algo": "FP8"}}))
    assert hf_export.read_quant_algo(folder) == "FP8"
    assert recipe.quantized_linear_names(hf_export.load_hf_export(folder)) == fp8_export[3]


def _edited(src: Path, dst: Path, config=None, state=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if state:
        sd = _state(dst)
        state(sd)
        save_file(sd, str(dst / "diffusion_pytorch_model.safetensors"))
    return dst


@pytest.mark.parametrize("which", ["fp8", "nvfp4"])
@pytest.mark.parametrize("config", [{"num_layers": 5}, {"num_layers": 7}, {"attention_head_dim": 8},
                                    {"joint_attention_dim": 24}])
def test_config_that_does_not_match_the_weights_is_the_loaders_error(which, config, fp8_export, nvfp4_export,
                                                                       tmp_path):
    src = (fp8_export if which == "fp8" else nvfp4_export)[0]
    bad = _edited(src, tmp_path / "bad", config=config)
    with pytest.raises(ValueError, match="does not match"):
        hf_export.load_hf_export(bad)


def test_swizzled_or_padded_nvfp4_scales_are_refused(nvfp4_export, tmp_path):
    n = nvfp4_export[3][0]

    def pad(sd):
        sd[f"{n}.weight_scale"] = torch.nn.functional.pad(sd[f"{n}.weight_scale"].view(torch.uint8), (0, 4)).view(
            torch.float8_e4m3fn)

    with pytest.raises(ValueError, match="does not match.*swizzled"):
        hf_export.load_hf_export(_edited(nvfp4_export[0], tmp_path / "bad", state=pad))


def test_nvfp4_codes_that_do_not_round_trip_are_refused(nvfp4_export, tmp_path):
    n = nvfp4_export[3][0]

    def shrink(sd):  # block (0, 0) holds codes of magnitude <= 1 only: its stored scale cannot be its own
        w = sd[f"{n}.weight"].clone()
        w[0, :8] = 0x22  # two codes of 1.0 a byte
        sd[f"{n}.weight"] = w

    with pytest.raises(ValueError, match="do not reproduce the checkpoint's codes"):
        hf_export.load_hf_export(_edited(nvfp4_export[0], tmp_path / "bad", state=shrink))


@pytest.mark.parametrize("which", ["fp8", "nvfp4"])
@pytest.mark.parametrize("key, value, says", [
    ("input_scale", float("nan"), "input_scale .* not a finite positive"),
    ("input_scale", float("inf"), "input_scale .* not a finite positive"),
    ("input_scale", -1.0, "input_scale .* not a finite positive"),
    ("weight_scale", float("nan"), "weight_scale"),  # ModelOpt asserted on the NaN amax
    ("weight_scale", -0.5, "weight_scale"),
])
def test_scales_that_are_not_modelopts_are_the_loaders_error(request, which, key, value, says, tmp_path):
    """A stored scale no ModelOpt export writes (NaN, infinite, negative) is a ValueError naming the linear; before,
    a NaN weight scale was ModelOpt's AssertionError and a negative or infinite input scale loaded."""
    folder, _, _, names = request.getfixturevalue(f"{which}_export")
    n = names[0]

    def spoil(sd):
        t = sd[f"{n}.{key}"]
        sd[f"{n}.{key}"] = torch.full_like(t.float(), value).to(t.dtype)

    with pytest.raises(ValueError, match=f"{n}: {says}"):
        hf_export.load_hf_export(_edited(folder, tmp_path / "bad", state=spoil))


def test_unsupported_layouts_have_reasons(fp8_export, tmp_path):
    n = fp8_export[3][0]

    def per_channel(sd):
        sd[f"{n}.weight_scale"] = sd[f"{n}.weight_scale"].reshape(1).repeat(sd[f"{n}.weight"].shape[0])

    with pytest.raises(ValueError, match="per-channel"):
        hf_export.load_hf_export(_edited(fp8_export[0], tmp_path / "pc", state=per_channel))
    with pytest.raises(ValueError, match="quant_algo"):
        hf_export.load_hf_export(_edited(fp8_export[0], tmp_path / "algo",
                                         config={"quantization_config": {"quant_algo": "W4A8_AWQ"}}))
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_export.load_hf_export(tmp_path)


def test_compress_is_refused_for_nvfp4(nvfp4_export):
    with pytest.raises(ValueError, match="FP8 exports only"):
        hf_export.load_hf_export(nvfp4_export[0], compress=True)


@pytest.mark.slow
def test_export_code_mismatches_predicts_the_nan_codes_of_an_all_zero_weight(tmp_path):
    model = T.tiny_transformer(num_layers=6, dtype=torch.bfloat16)
    inputs = T.transformer_inputs(model)
    lin = model.transformer_blocks[2].attn.to_q
    with torch.no_grad():
        lin.weight.zero_()
    recipe.quantize(model, recipe.fp8_recipe_config(model), lambda m: T.run_transformer(m, inputs))
    fake = {n: (m.weight.detach().clone(), m.weight_quantizer.amax.clone()) for n, m in model.named_modules()
            if n in recipe.quantized_linear_names(model)}
    predicted, total = recipe.export_code_mismatches(model)
    recipe.export_hf(model, tmp_path / "e")
    sd = _state(tmp_path / "e")
    actual = 0
    for n, (w, amax) in fake.items():
        a = amax.float()
        safe = a if float(a) > 2.0 ** -24 else torch.ones_like(a)
        codes = (w.float() * (448.0 / safe)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        actual += int((codes != sd[f"{n}.weight"].view(torch.uint8)).sum())
    assert predicted == actual >= lin.weight.numel()  # every element of the zero linear: NaN codes
    assert (sd["transformer_blocks.2.attn.to_q.weight"].view(torch.uint8) & 0x7F == 0x7F).all()


def test_export_of_a_patched_model_is_the_unpatched_twins(tmp_path):
    """ModelOpt's HF export of a patched model (its dummy forward passes what ``model.forward``'s signature names):
    the same tensors as the unpatched twin's export."""
    import copy

    import qwen_absorb

    model = T.tiny_transformer(num_layers=6, dtype=torch.bfloat16)
    inputs = T.transformer_inputs(model)
    recipe.quantize(model, recipe.fp8_recipe_config(model), lambda m: T.run_transformer(m, inputs))
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model)
    T.run_transformer(model, inputs)
    recipe.export_hf(model, tmp_path / "patched")
    recipe.export_hf(twin, tmp_path / "twin")
    got, want = _state(tmp_path / "patched"), _state(tmp_path / "twin")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
