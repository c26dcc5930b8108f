"""The examples and the notebook, run as a user runs them (CPU: tiny random pipeline / transformer)."""

from __future__ import annotations

import importlib.util
import json
import os
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
    assert "PatchReport" in p.stdout and "PSNR" in p.stdout and "SSIM" in p.stdout

    from PIL import Image

    with Image.open(png) as im:
        w, h = im.size
        assert im.mode == "RGB"
    assert w >= 3 * 64 and h > 64  # three panels plus a caption


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


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU refusal of NVFP4 fake quantization")
def test_compare_outputs_nvfp4_refused_on_cpu(tmp_path):
    p = _run("compare_outputs.py", "--quant", "nvfp4", "--out", str(tmp_path))
    assert p.returncode == 3, _explain(p)
    assert "CANNOT RUN HERE" in p.stderr and "CUDA" in p.stderr
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "unsupported"


def _load_compare_module():
    sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location("compare_outputs_under_test", EXAMPLES / "compare_outputs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_compare_outputs_exits_nonzero_on_exception(tmp_path, monkeypatch):
    import qwen_absorb

    mod = _load_compare_module()

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(mod.qwen_absorb, "patch", broken)
    assert mod.main(["--out", str(tmp_path), "--steps", "1"]) == 4
    res = json.loads(_one("results_*.json", tmp_path).read_text())
    assert res["status"] == "error" and "boom" in res["error"]


# ------------------------------------------------------------------------------------------ benchmark.py


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


# ------------------------------------------------------------------------------------------- notebook


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
