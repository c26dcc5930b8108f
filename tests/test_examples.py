"""The examples and the notebook, run as a user runs them (CPU: tiny random pipeline / transformer)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
HAS_CUDA = torch.cuda.is_available()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout,
    )


def _explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout\n{p.stdout[-6000:]}\n--- stderr\n{p.stderr[-6000:]}"


def _one(pattern: str, folder: Path) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {folder}, found {found}"
    return found[0]


# ------------------------------------------------------------------------------------- compare_outputs.py


@pytest.mark.slow
def test_compare_outputs_default_tiny(tmp_path):
    p = _run("compare_outputs.py", "--out", str(tmp_path))
    assert p.returncode == 0, _explain(p)
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    png = _one("side_by_side_*.png", tmp_path)

    assert res["status"] == "pass", res
    assert res["config"]["size"] == "tiny" and res["config"]["quant"] == "none"
    assert res["report"]["summary"]["blocks_patched"] == res["config"]["transformer_layers"] >= 1
    assert res["unpatch_restores_output"] is True
    m = res["metrics"]
    assert set(m) >= {"max_abs", "psnr_db", "ssim", "identical"}
    if not HAS_CUDA:
        # No kernels, no deferred bias: the contract says bit-identical, and the script says why plainly.
        assert res["kernels_available"] is False and res["kernel_unavailable_reasons"], res
        assert "could NOT run" in p.stdout and "CUDA" in p.stdout
        assert m["identical"] is True and m["max_abs"] == 0.0 and m["ssim"] == 1.0 and m["psnr_db"] == "inf"
        assert res["criterion"].startswith("bit-identical")
        # CPU wall-clock is labelled as such and never turned into a speed ratio
        assert res["timings_s"]["speedup"] is None and res["timings_s"]["speed_measurement"] is False
        assert "not a speed measurement" in p.stdout and not re.search(r"\d\.\d+x\b", p.stdout)
    assert "PatchReport" in p.stdout and "PSNR" in p.stdout and "SSIM" in p.stdout

    from PIL import Image

    with Image.open(png) as im:
        w, h = im.size
        assert im.mode == "RGB"
    assert w >= 3 * 64 and h > 64  # three panels plus a caption


@pytest.mark.slow
def test_compare_outputs_qwenimage21_tiny(tmp_path):
    """--family qwenimage21: the tiny random QwenImage21Pipeline, unpatched vs patched, its side-by-side PNG."""
    p = _run("compare_outputs.py", "--family", "qwenimage21", "--steps", "2", "--warmup", "0", "--repeats", "1",
             "--out", str(tmp_path))
    assert p.returncode == 0, _explain(p)
    res = json.loads(_one("results_*qwenimage21*.json", tmp_path).read_text())
    png = _one("side_by_side_*qwenimage21*.png", tmp_path)
    assert res["status"] == "pass", res
    assert res["config"]["family"] == "qwenimage21" and res["config"]["pipeline"] == "QwenImage21Pipeline"
    assert res["report"]["transformer_class"] == "QwenImage21Transformer2DModel"
    assert res["report"]["summary"]["blocks_patched"] == res["config"]["transformer_layers"] == 2
    assert res["unpatch_restores_output"] is True
    # 1 patched call x 2 steps x (cond + uncond: --cfg 4, negative embeddings) x 2 blocks, each the patched forward
    assert sum(res["runtime_fallbacks"].values()) == 8, res["runtime_fallbacks"]
    if not HAS_CUDA:
        assert res["metrics"]["identical"] is True and res["criterion"].startswith("bit-identical")
    assert "tiny Qwen-Image-2.1 pipeline" in p.stdout and "PASS" in p.stdout

    from PIL import Image

    with Image.open(png) as im:
        w, h = im.size
        assert im.mode == "RGB"
    assert w >= 3 * 64 and h > 64


@pytest.mark.slow
def test_compare_outputs_qwenimage21_modelopt_fp8(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    mod = _load_compare_module()
    code = mod.main(["--family", "qwenimage21", "--quant", "fp8", "--steps", "1", "--warmup", "0",
                     "--calib-prompts", "1", "--calib-steps", "1", "--out", str(tmp_path), "--tag", "t"])
    assert code == 0
    res = json.loads((tmp_path / "results_t.json").read_text())
    assert res["status"] == "pass" and res["quantization"]["quantized_linears"] > 0
    assert res["report"]["summary"]["blocks_patched"] == 2
    if not HAS_CUDA:  # ModelOpt's fake quantization on both sides, the fused ops on their references
        assert res["metrics"]["identical"] is True and res["fp8_gemms"] == 0


@pytest.mark.parametrize("argv, message", [
    (["--quant", "nvfp4"], "--quant nvfp4: NVFP4 is not validated for Qwen-Image-2.1"),
    (["--defer-bias", "true"], "--defer-bias true: Qwen-Image-2.1's linears have no biases"),
    (["--image", "photo.png"], "--image: QwenImage21Pipeline takes condition images only through its text encoder"),
    (["--height", "48"], "--height 48: QwenImage21Pipeline needs a multiple of 32"),
    (["--size", "full", "--width", "1040"], "--width 1040: QwenImage21Pipeline needs a multiple of 32"),
    (["--model", "Qwen/Qwen-Image-2.1"], "--family picks the random pipeline"),
])
def test_compare_outputs_qwenimage21_refuses_what_does_not_apply(tmp_path, monkeypatch, capsys, argv, message):
    mod = _load_compare_module()
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    assert _exit_code(mod.main, ["--family", "qwenimage21", *argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()  # refused before anything, the output folder included


@pytest.mark.slow
def test_compare_outputs_qwenimage21_refused_option_exits_2(tmp_path):
    """The real exit status of a refused option, as a user sees it."""
    p = _run("compare_outputs.py", "--family", "qwenimage21", "--quant", "nvfp4", "--out", str(tmp_path / "out"))
    assert p.returncode == 2, _explain(p)
    assert "NVFP4 is not validated for Qwen-Image-2.1" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_compare_outputs_modelopt_fp8(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    p = _run("compare_outputs.py", "--quant", "fp8", "--steps", "2", "--out", str(tmp_path))
    assert p.returncode == 0, _explain(p)
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "pass"
    assert res["quantization"]["format"] == "fp8" and res["quantization"]["quantized_linears"] > 0
    assert res["report"]["summary"]["quantized_projections"].get("FP8_E4M3", 0) > 0, res["report"]["summary"]
    if not HAS_CUDA:
        assert res["metrics"]["identical"] is True


@pytest.mark.slow
def test_compare_outputs_forced_deferral_is_judged_by_tolerance(tmp_path):
    """defer_bias=True moves a rounding point: not bit-identical, so PSNR/SSIM decide."""
    pytest.importorskip("modelopt.torch.quantization")
    p = _run("compare_outputs.py", "--quant", "fp8", "--defer-bias", "true", "--steps", "2",
             "--out", str(tmp_path))
    assert p.returncode == 0, _explain(p)
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["deferred_biases"] > 0
    assert res["criterion"].startswith("PSNR")
    assert res["metrics"]["psnr_db"] == "inf" or res["metrics"]["psnr_db"] >= 30.0


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU refusal of NVFP4 fake quantization")
def test_compare_outputs_nvfp4_refused_on_cpu(tmp_path):
    p = _run("compare_outputs.py", "--quant", "nvfp4", "--out", str(tmp_path))
    assert p.returncode == 3, _explain(p)
    assert "CANNOT RUN HERE" in p.stderr and "CUDA" in p.stderr
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "unsupported"


def _load(script: str):
    """The example as a module, to call main(argv) in-process: no interpreter start, no torch import."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(f"{Path(script).stem}_under_test", EXAMPLES / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_compare_module():
    return _load("compare_outputs.py")


def _exit_code(fn, *args) -> int:
    """fn's return value, or the code of the SystemExit it raised (argparse errors exit 2)."""
    try:
        return fn(*args)
    except SystemExit as e:
        return e.code


def _must_not_run(what: str):
    def fail(*a, **k):
        raise AssertionError(f"{what} ran: the run should have been refused before any work")
    return fail


@pytest.mark.slow
def test_compare_outputs_exits_nonzero_on_mismatch(tmp_path, monkeypatch):
    """A patch that changes the numbers must make the script fail (exit 1), not print PASS."""
    import qwen_absorb

    mod = _load_compare_module()
    real_patch, real_unpatch = qwen_absorb.patch, qwen_absorb.unpatch
    saved = {}

    def bad_patch(pipe, **kw):
        report = real_patch(pipe, **kw)
        bias = pipe.transformer.proj_out.bias
        saved["bias"] = bias.detach().clone()
        with torch.no_grad():
            bias.add_(0.5)
        return report

    def bad_unpatch(pipe):  # leaves the perturbation: the unpatch check must catch it too
        real_unpatch(pipe)

    monkeypatch.setattr(mod.qwen_absorb, "patch", bad_patch)
    monkeypatch.setattr(mod.qwen_absorb, "unpatch", bad_unpatch)
    code = mod.main(["--out", str(tmp_path), "--steps", "2", "--min-psnr", "1000"])
    assert code == 1
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "fail" and len(res["failures"]) == 2, res["failures"]
    assert res["metrics"]["identical"] is False


@pytest.mark.slow
def test_compare_outputs_exits_nonzero_on_exception(tmp_path, monkeypatch):
    mod = _load_compare_module()

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(mod.qwen_absorb, "patch", broken)
    assert mod.main(["--out", str(tmp_path), "--steps", "1"]) == 4
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "error" and "boom" in res["error"]


# Bad arguments: exit 2 with one argparse line, before anything is built. One subprocess shows the real
# exit status; the rest call main() in-process (an interpreter start costs seconds on a 2-core runner).


@pytest.mark.slow
def test_compare_outputs_bad_argument_exits_2(tmp_path):
    out = tmp_path / "out"
    p = _run("compare_outputs.py", "--steps", "0", "--out", str(out))
    assert p.returncode == 2, _explain(p)
    assert "--steps: must be a positive integer" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()  # refused before the output folder was even made


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: must be a positive integer"),  # ran 4 steps
    (["--steps", "-3"], "--steps: must be a positive integer"),  # traceback
    (["--num-layers", "0", "--size", "full"], "--num-layers: must be a positive integer"),  # 0-block PASS
    (["--repeats", "0"], "--repeats: must be a positive integer"),  # traceback
    (["--warmup", "-1"], "--warmup: must be >= 0"),
    (["--calib-prompts", "0"], "--calib-prompts: must be a positive integer"),
    (["--device", "bogus"], "--device: 'bogus' is not a device"),  # traceback
    (["--device", "cuda:99"], "--device: cuda:99"),  # a CUDA index past device_count (or no CUDA at all)
    (["--dtype", "fp13"], "--dtype: unknown dtype"),  # exited 1 ("outputs disagree")
    (["--height", "70"], "--height: must be a positive multiple of 16"),
    (["--tag", "../x"], "--tag"),
    (["--three-way"], "it needs --quant fp8"),
    (["--quant", "fp8", "--three-way", "--fp8-gemm", "false"], "contradicts --fp8-gemm false"),
    (["--fp8-gemm", "on"], "--fp8-gemm: 'on': choose auto, true or false"),  # the API's spelling, not on/off
    (["--cuda-graph", "yes"], "--cuda-graph: 'yes': choose auto, true or false"),
])
def test_compare_outputs_refuses_bad_arguments(tmp_path, monkeypatch, capsys, argv, message):
    mod = _load_compare_module()
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    assert _exit_code(mod.main, [*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_compare_outputs_missing_model_exits_2_in_one_line(tmp_path):
    out = tmp_path / "out"
    p = _run("compare_outputs.py", "--model", "/nonexistent/path", "--out", str(out), timeout=120)
    assert p.returncode == 2, _explain(p)
    assert p.stderr.strip().splitlines() == [
        "compare_outputs.py: error: --model /nonexistent/path: no such folder (--help: usage)"], p.stderr
    assert not out.exists()


@pytest.fixture
def hub_offline(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_compare_outputs_model_errors_exit_2(tmp_path, monkeypatch, capsys, hub_offline):
    mod = _load_compare_module()
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    empty = tmp_path / "not_a_pipeline"
    empty.mkdir()
    for argv, message in [
        (["--model", "someone/some-model"], "offline (HF_HUB_OFFLINE=1) and this id is not in the local"),
        (["--model", str(empty)], "without model_index.json"),
        (["--model", "a b"], "neither a folder nor a valid Hugging Face hub id"),
        (["--prompt", "a fox"], "--prompt needs --model"),  # the random pipelines ignored it
    ]:
        assert _exit_code(mod.main, [*argv, "--out", str(tmp_path / "out")]) == 2, argv
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_compare_outputs_model_too_large_is_refused(tmp_path, monkeypatch, capsys):
    """--model gets the memory check of --size full: counted from the safetensors headers (no weights read)."""
    import struct

    mod = _load_compare_module()
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    folder = tmp_path / "huge"
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text("{}")
    header = json.dumps({"w": {"dtype": "BF16", "shape": [10**7, 10**6], "data_offsets": [0, 0]}}).encode()
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    code = mod.main(["--model", str(folder), "--device", "cpu", "--out", str(tmp_path / "out")])
    assert code == 3
    err = capsys.readouterr().err
    assert "CANNOT RUN HERE" in err and "10000.00 B parameters" in err


def test_compare_outputs_result_names_differ_by_configuration(tmp_path):
    mod = _load_compare_module()
    configs = [[], ["--family", "qwenimage21"], ["--family", "qwenimage21", "--size", "full"],
               ["--defer-bias", "true"], ["--defer-bias", "false"], ["--force-reference"], ["--steps", "2"],
               ["--seed", "1"], ["--cfg", "1"], ["--cuda-graph"], ["--fp8-gemm", "false"], ["--quant", "fp8"],
               ["--quant", "fp8", "--no-three-way"], ["--quant", "fp8", "--calib-prompts", "1"]]
    tags = set()
    for argv in configs:
        args = mod.parse_args([*argv, "--out", str(tmp_path)])
        size = "model" if args.model else args.size
        h, w, _ = mod.DEFAULTS[size]
        tags.add(mod.default_tag(args, size, args.dtype, args.device, args.height or h, args.width or w))
    assert len(tags) == len(configs), sorted(tags)


def test_example_help_prints_each_line_once(capsys):
    for script in ("compare_outputs.py", "benchmark.py", "quantize_fp8.py"):
        mod = _load(script)
        assert _exit_code(mod.main, ["--help"]) == 0
        out = capsys.readouterr().out
        first = mod.__doc__.strip().splitlines()[0]
        assert out.count(first) == 1, (script, out[:500])


def test_example_clis_share_one_device_default_and_one_tristate_spelling():
    """--device auto everywhere; the patch options the API takes as "auto"/True/False are auto/true/false."""
    for script in ("compare_outputs.py", "benchmark.py", "quantize_fp8.py"):
        parser = _load(script).build_parser()
        actions = {a.dest: a for a in parser._actions}
        assert actions["device"].default == "auto", script
        for dest in ("fp8_gemm", "cuda_graph", "defer_bias"):
            if dest in actions:
                assert actions[dest].default == "auto" and actions[dest].metavar == "{auto,true,false}", (script, dest)
    text = (EXAMPLES / "parallel.py").read_text()
    assert 'choices=("auto", "cuda", "cpu"), default="auto"' in text and '("auto", "true", "false")' in text


def test_packaging_license_script_and_version():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    module, func = project["scripts"]["qwen-absorb-compare"].split(":")
    assert module == "qwen_absorb_examples.compare_outputs" and func == "main"
    assert "qwen_absorb_examples" in (REPO / "setup.py").read_text()  # the package the script imports
    assert callable(_load("compare_outputs.py").main)


def test_version_matches_pyproject():
    import tomllib

    import qwen_absorb

    _common = _load("_common.py")

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert qwen_absorb.__version__ == project["version"]
    assert _common.plural(1, "layer") == "1 layer" and _common.plural(8, "layer") == "8 layers"


def _file_in_a_file(tmp_path) -> Path:
    """An --out nobody can create, root included (os.access would say yes to root)."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    return blocker / "out"


def test_compare_outputs_unwritable_out_refused_before_work(tmp_path, monkeypatch, capsys):
    mod = _load_compare_module()
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    assert _exit_code(mod.main, ["--out", str(_file_in_a_file(tmp_path))]) == 2
    assert "--out: cannot create the folder" in capsys.readouterr().err


@pytest.mark.parametrize("family, name", [("qwenimage", "Qwen-Image"), ("qwenimage21", "Qwen-Image-2.1")])
def test_compare_outputs_refuses_full_size_that_cannot_fit(tmp_path, monkeypatch, capsys, family, name):
    """A model larger than the device is refused with the size it needs (exit 3), not started."""
    mod = _load_compare_module()
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    code = mod.main(["--family", family, "--size", "full", "--num-layers", "100000", "--device", "cpu",
                     "--dtype", "fp32", "--out", str(tmp_path)])
    assert code == 3
    err = capsys.readouterr().err
    assert "CANNOT RUN HERE" in err and re.search(r"needs about [\d.]+ GB", err) and "--num-layers" in err
    assert f"full-size {name} transformer" in err
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "unsupported"


def _recording_patch(seen: dict, real_patch):
    """qwen_absorb.patch that records its keyword arguments, then patches (dropping the options this
    qwen_absorb does not have yet, so the test does not depend on them landing)."""
    import _common

    def patch(target, **kw):
        seen.update(kw)
        return real_patch(target, **{k: v for k, v in kw.items() if _common.patch_supports(k, real_patch)})
    return patch


@pytest.mark.slow
def test_compare_outputs_patch_switches_passed_only_when_set(tmp_path, monkeypatch):
    mod = _load_compare_module()
    default, switched = {}, {}
    monkeypatch.setattr(mod.qwen_absorb, "patch", _recording_patch(default, mod.qwen_absorb.patch))
    assert mod.main(["--steps", "1", "--warmup", "0", "--skip-unpatch-check", "--out", str(tmp_path)]) == 0
    assert "fp8_gemm" not in default and "cuda_graph" not in default  # the default path predates them
    monkeypatch.setattr(mod.qwen_absorb, "patch", _recording_patch(switched, mod.qwen_absorb.patch))
    assert mod.main(["--steps", "1", "--warmup", "0", "--skip-unpatch-check", "--fp8-gemm", "false", "--cuda-graph",
                     "--out", str(tmp_path)]) == 0
    assert switched["fp8_gemm"] is False and switched["cuda_graph"] is True


def test_compare_outputs_patch_option_missing_is_unavailable(tmp_path, monkeypatch, capsys):
    """A switch this qwen_absorb's patch() lacks: exit 3 before any work, not a TypeError after it."""
    mod = _load_compare_module()

    def old_patch(target, *, defer_bias="auto", force_reference=False):
        raise AssertionError("must not be called")

    monkeypatch.setattr(mod.qwen_absorb, "patch", old_patch)
    monkeypatch.setattr(mod, "build", _must_not_run("build"))
    assert mod.main(["--fp8-gemm", "true", "--out", str(tmp_path)]) == 3
    assert "fp8_gemm=" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_outputs_three_way(tmp_path, monkeypatch):
    """unquantized, ModelOpt FP8 fake quant (unpatched), qwen_absorb with fp8_gemm=True: three pairs compared."""
    pytest.importorskip("modelopt.torch.quantization")
    mod = _load_compare_module()
    seen = {}
    monkeypatch.setattr(mod.qwen_absorb, "patch", _recording_patch(seen, mod.qwen_absorb.patch))
    code = mod.main(["--quant", "fp8", "--three-way", "--steps", "1", "--warmup", "0", "--calib-prompts", "1",
                     "--calib-steps", "1", "--out", str(tmp_path), "--tag", "t"])
    assert code == 0
    assert seen["fp8_gemm"] is True
    res = json.loads((tmp_path / "results_t.json").read_text())
    tw = res["three_way"]
    assert set(tw["metrics"]) == {"unquantized_vs_fake_fp8", "unquantized_vs_real_fp8", "fake_fp8_vs_real_fp8"}
    assert set(tw["median_s"]) == {"unquantized", "fake_fp8", "real_fp8"}
    assert (tmp_path / "side_by_side_t_vs_unquantized.png").is_file()
    if not HAS_CUDA:  # no real FP8 GEMM on CPU: qwen_absorb's leg is ModelOpt's, bit for bit
        assert res["fp8_gemms"] == 0 and tw["metrics"]["fake_fp8_vs_real_fp8"]["identical"] is True
        assert tw["metrics"]["unquantized_vs_fake_fp8"]["identical"] is False  # FP8 did quantize


# ------------------------------------------------------------------------------------------ benchmark.py


@pytest.mark.slow
def test_benchmark_tiny_smoke(tmp_path):
    p = _run("benchmark.py", "--tiny", "--out-dir", str(tmp_path), "--tag", "tiny", "--extrapolate-to", "4")
    assert p.returncode == 0, _explain(p)
    res = json.loads((tmp_path / "tiny.json").read_text())
    md = (tmp_path / "tiny.md").read_text()
    rows = res["rows"]
    assert not any("error" in r for r in rows), rows
    expected = {(q, v, r) for q in ("none", "fp8") for v in ("eager", "patched") for r in (64, 128)}
    assert {(r["quant"], r["variant"], r["resolution"]) for r in rows} == expected
    for r in rows:
        assert r["ms_measured"] > 0 and r["measured_layers"] == 2 and r["extrapolated_layers"] == 4
        assert r["ms_extrapolated"] == pytest.approx(r["ms_outside_blocks"] + 4 * r["ms_per_block"])
        assert r["image_tokens"] == (r["resolution"] // 16) ** 2
        if r["variant"] == "patched":
            assert r["report"]["summary"]["blocks_patched"] == 2
            if not HAS_CUDA:
                assert r["report"]["kernels_available"] is False
        if not HAS_CUDA:
            assert r["kernels_measured"] is None  # launches are counted on CUDA only
    assert res["environment"]["torch"] == torch.__version__
    assert "| resolution |" in md and "extrapolated to 4 layers" in md


TINY_ONE = ["--tiny", "--quant", "none", "--resolutions", "64", "--warmup", "0", "--iters", "1"]


@pytest.mark.slow
def test_benchmark_bad_argument_exits_2(tmp_path):
    p = _run("benchmark.py", "--tiny", "--iters", "0", "--out-dir", str(tmp_path / "out"))  # the old name works
    assert p.returncode == 2, _explain(p)
    assert "--iters: must be a positive integer" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, message", [
    (["--iters", "0"], "--iters: must be a positive integer"),  # every row an error
    (["--num-layers", "0"], "--num-layers: must be a positive integer"),
    (["--text-tokens", "0"], "--text-tokens: must be a positive integer"),  # silently became 128
    (["--resolutions", "100"], "multiple of 16"),
    (["--quant", "int4"], "--quant: 'int4'"),  # exited 1
    (["--device", "bogus"], "--device: 'bogus' is not a device"),  # traceback
    (["--time-budget-s", "-5"], "--time-budget-s: must be >= 0"),
])
def test_benchmark_refuses_bad_arguments(tmp_path, monkeypatch, capsys, argv, message):
    mod = _load("benchmark.py")
    monkeypatch.setattr(mod, "build_model", _must_not_run("build_model"))
    assert _exit_code(mod.main, ["--tiny", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_benchmark_unwritable_out_refused_before_work(tmp_path, monkeypatch, capsys):
    mod = _load("benchmark.py")
    monkeypatch.setattr(mod, "build_model", _must_not_run("build_model"))
    assert _exit_code(mod.main, [*TINY_ONE, "--out", str(_file_in_a_file(tmp_path))]) == 2
    assert "--out: cannot create the folder" in capsys.readouterr().err


def test_benchmark_tiny_does_not_write_into_benchmarks_results(tmp_path, monkeypatch):
    """Smoke runs go to ./benchmark_results by default; benchmarks/results/ holds recorded GPU runs only."""
    mod = _load("benchmark.py")
    committed = REPO / "benchmarks" / "results"
    before = set(committed.glob("transformer_tiny*"))
    monkeypatch.chdir(tmp_path)
    assert mod.main([*TINY_ONE, "--variants", "eager"]) == 0
    assert set(committed.glob("transformer_tiny*")) == before
    res = json.loads(_one("transformer_tiny_*.json", tmp_path / "benchmark_results").read_text())
    assert res["status"] == "complete" and len(res["rows"]) == 1
    assert res["rows"][0]["speedup_vs_eager"] is None and res["speed_measurement"] is False  # CPU: no ratios


def test_benchmark_writes_results_after_each_configuration(tmp_path, monkeypatch):
    """The results file is on disk, complete, while later configurations are still running."""
    mod = _load("benchmark.py")
    path = tmp_path / "t.json"
    rows_on_disk = []
    real_latency = mod.Bench.latency

    def latency(self, inputs):
        rows_on_disk.append(len(json.loads(path.read_text())["rows"]) if path.exists() else None)
        return real_latency(self, inputs)

    monkeypatch.setattr(mod.Bench, "latency", latency)
    assert mod.main([*TINY_ONE, "--variants", "eager,patched", "--out", str(tmp_path), "--tag", "t"]) == 0
    # calls: T(0), eager, patched; when patched started, eager's row was already written
    assert rows_on_disk[-1] == 1, rows_on_disk
    assert json.loads(path.read_text())["status"] == "complete"
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_benchmark_keeps_going_when_a_configuration_fails(tmp_path, monkeypatch):
    mod = _load("benchmark.py")

    def broken_patch(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(mod.qwen_absorb, "patch", broken_patch)
    code = mod.main([*TINY_ONE, "--variants", "eager,patched", "--out", str(tmp_path), "--tag", "t"])
    assert code == 1  # a failed configuration is reported in the exit status
    res = json.loads((tmp_path / "t.json").read_text())
    assert res["status"] == "complete"
    assert [r["variant"] for r in res["rows"]] == ["eager"] and "error" not in res["rows"][0]
    assert res["errors"][0]["variant"] == "patched" and "boom" in res["errors"][0]["error"]
    assert "boom" in (tmp_path / "t.md").read_text()


def test_benchmark_interrupt_keeps_results(tmp_path, monkeypatch):
    mod = _load("benchmark.py")

    def ctrl_c(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(mod.qwen_absorb, "patch", ctrl_c)
    try:
        code = mod.main([*TINY_ONE, "--variants", "eager,patched", "--out", str(tmp_path), "--tag", "t"])
    except KeyboardInterrupt:  # escaping main() would also stop this pytest session
        pytest.fail("Ctrl-C escaped main() without writing the results")
    assert code == 130
    res = json.loads((tmp_path / "t.json").read_text())
    assert res["status"] == "interrupted" and [r["variant"] for r in res["rows"]] == ["eager"]


def test_benchmark_patch_switches(tmp_path, monkeypatch):
    mod = _load("benchmark.py")
    seen = {}
    monkeypatch.setattr(mod.qwen_absorb, "patch", _recording_patch(seen, mod.qwen_absorb.patch))
    assert mod.main([*TINY_ONE, "--variants", "patched", "--fp8-gemm", "true", "--cuda-graph",
                     "--out", str(tmp_path)]) == 0
    assert seen["fp8_gemm"] is True and seen["cuda_graph"] is True


# ------------------------------------------------------------------------------------------- notebook


@pytest.mark.slow
def test_quickstart_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    nb = nbformat.read(EXAMPLES / "quickstart.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute(env=_env())  # raises CellExecutionError if any cell fails (its asserts included)

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "PatchReport" in text
    assert "output identical to the first run: True" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the side-by-side image was not displayed"
    if not HAS_CUDA:
        assert "could NOT run here" in text
