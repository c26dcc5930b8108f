"""Issue 20 item 2: a report that reads true: counts of what runs, reasons that add up, readable
capabilities, no raw dicts, header current when printed; ``to_dict()`` complete (CPU; GPU decisions mocked)."""

from __future__ import annotations

import json
import re

import torch

import qwen_absorb
from qwen_absorb import plan as plan_mod
from qwen_absorb import testing as T


def _counts(text: str, title: str) -> list[int]:
    """The ``[N site(s)...]`` counts of the group lines under ``title``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(title))
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("    "):
            break
        m = re.search(r"\[(\d+) (site|linear|block)s?,", line)
        if m:
            out.append(int(m.group(1)))
    return out


def test_cpu_report_says_what_runs_and_counts_add_up(seed):
    model = T.tiny_transformer(seed=seed)
    report = qwen_absorb.patch(model, defer_bias=True, capabilities={"cpu"})
    text = str(report)
    s = report.summary
    assert s["sites_on_references"] == s["sites_fused"] == 12 and s["sites_on_kernels"] == 0
    assert "fused sites 12/12 (12 on torch references)" in text
    assert "CUDA kernels not used here: tensors are on cpu" in text
    assert "{" not in text and "site(s)" not in text  # no raw dicts, no hedged plurals
    # auto on the CPU: every deferrable site is counted exactly once among the reasons
    auto = qwen_absorb.patch(model)
    t2 = str(auto)
    kept = auto.summary["biases_deferrable_sites"] - auto.summary["biases_deferred"]
    assert sum(_counts(t2, "biases kept in the GEMM")) == kept == 8, t2
    assert "validated on GPUs only (sm_90)" in t2 and "'(9, 0)'" not in t2


def test_header_is_current_when_printed(seed):
    model = T.tiny_transformer(seed=seed)
    report = qwen_absorb.patch(model)
    assert ", float32" in str(report).splitlines()[0]
    model.to(torch.bfloat16)
    assert ", bfloat16" in str(report).splitlines()[0]
    qwen_absorb.unpatch(model)
    assert "(unpatched)" in str(report).splitlines()[0]


def test_mocked_gpu_decisions_read_as_kernels(seed, monkeypatch):
    monkeypatch.setattr(plan_mod, "_kernel_reasons", lambda device, options: [])
    model = T.tiny_transformer(seed=seed)
    report = qwen_absorb.patch(model)
    text = str(report)
    assert report.summary["sites_on_kernels"] == 12 and "(12 on CUDA kernels)" in text
    assert "not used here" not in text
    qwen_absorb.unpatch(model)


def test_fp8_linear_reasons_are_grouped_and_bounded(seed):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1)])
    report = qwen_absorb.patch(model)  # CPU, fp8_gemm="auto": no real FP8 here, said once per reason
    text = str(report)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "not run as real FP8 GEMMs" in line)
    group = [line for line in lines[start + 1:] if line.startswith("    ")]
    assert 1 <= len(group) <= 9  # at most 8 reasons and a "more" line
    assert "real FP8 GEMMs: 0 of 28 ModelOpt linears" in text
    d = report.to_dict()
    json.dumps(d)
    assert len(d["blocks"]) == 2 and set(d["blocks"][0]["linears"]) >= {"attn.to_q", "img_mlp.net.2"}
    assert d["blocks"][0]["linears"]["attn.to_q"]["fp8_reasons"]
