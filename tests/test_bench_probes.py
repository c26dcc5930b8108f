"""The probes of this round in their CPU modes: ``probe_host_profile.py --tiny`` profiles the eager patched FP8
call of both families and names qwen_absorb's own functions; ``probe_lora_gemm.py``, ``probe_lora_add.py``
and ``probe_graph_idle.py`` refuse a machine without CUDA with their exit code 3 and a line that says so; the
harness's idle attribution on a made-up trace; ``probe_scan_cost.py`` (CPU) splits the fingerprint's checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_host_profile_tiny_names_the_patched_forwards(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    p = _run("probe_host_profile.py", "--tiny", "--device", "cpu", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads((tmp_path / "host_profile_h200.json").read_text())
    assert not d["errors"]
    for fam, forward in (("qwenimage", "block.py"), ("qwenimage21", "qwenimage21.py")):
        f = d[fam]
        assert f["calls_profiled"] == 3 and f["median_ms"] > 0 and f["profiled_ms_per_call"] > 0
        names = [r["function"] for r in f["by_cumtime"]]
        assert any(n.startswith(forward) and "patched_forward" in n for n in names), names
        assert all(r["cumtime_ms"] >= r["tottime_ms"] >= 0 for r in f["by_tottime"])
        assert f["summary"]["blocks_patched"] == f["summary"]["blocks"] > 0
    assert "## qwenimage21" in (tmp_path / "host_profile_h200.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_lora_gemm_probe_refuses_without_cuda(tmp_path):
    p = _run("probe_lora_gemm.py", "--device", "cpu", "--out", str(tmp_path))
    assert p.returncode == 3 and "needs CUDA" in p.stdout + p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_lora_add_probe_refuses_without_cuda(tmp_path):
    p = _run("probe_lora_add.py", "--out", str(tmp_path))
    assert p.returncode == 3 and "needs CUDA" in p.stdout + p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without CUDA sees")
def test_graph_idle_probe_refuses_without_cuda(tmp_path):
    p = _run("probe_graph_idle.py", "--device", "cpu", "--out", str(tmp_path))
    assert p.returncode == 3 and "needs CUDA" in p.stdout + p.stderr
    assert not list(tmp_path.iterdir())


def test_idle_summary_attributes_gaps_and_overlap():
    """harness.idle_summary on a made-up trace: gaps between device activities (overlapping ones merged, side
    streams included), the span, and the wall outside it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import harness as H
    from torch.autograd import DeviceType

    class _Range:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class _Event:
        def __init__(self, name, start, end, device=DeviceType.CUDA):
            self.name, self.time_range, self.device_type = name, _Range(start, end), device

    class _Prof:
        def events(self):
            return [_Event("gemm", 100, 140), _Event("host op", 0, 500, DeviceType.CPU), _Event("side", 150, 190),
                    _Event("norm", 145, 160), _Event("copy", 200, 205), _Event("late", 230, 240)]

    s = H.idle_summary(_Prof(), wall_ms=0.2)
    assert s["span_ms"] == pytest.approx(0.14)
    assert s["idle_in_span_ms"] == pytest.approx((5 + 10 + 25) / 1e3)  # 140-145, 190-200, 205-230
    assert s["idle_outside_span_ms"] == pytest.approx(0.06)
    assert s["gaps"] == 3 and s["gaps_over_5us"] == 2
    assert [(g["us"], g["after"], g["before"]) for g in s["largest_gaps"]] == [
        (25.0, "copy", "late"), (10.0, "side", "copy"), (5.0, "gemm", "norm")]


def test_scan_cost_probe_splits_the_checks(tmp_path):
    pytest.importorskip("modelopt.torch.quantization")
    p = _run("probe_scan_cost.py", "--layers", "2", "--calls", "2", "--reps", "1", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads((tmp_path / "scan_cost.json").read_text())
    after, before = d["sources_after_launch"], d["all_before_launch"]
    assert d["fp8_gemm_linears"] == 28 and before["tensors_after_launch"] == 0
    assert after["tensors_after_launch"] == 3 * 28  # each FP8 linear's weight, input amax, weight amax
    assert after["tensors_before_launch"] + after["tensors_after_launch"] == before["tensors_before_launch"]
    assert after["moved_us"] > 0 and before["stale_us"] > 0
