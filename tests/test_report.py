"""Issue 20 item 2: a report that reads true: counts of what runs, reasons that add up, readable
capabilities, no raw dicts, header current when printed; ``to_dict()`` complete (CPU; GPU decisions mocked)."""

from __future__ import annotations

import json
import re

import torch

import qwen_absorb
from qwen_absorb import plan as plan_mod
from . import builders as T


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


def _says_fused(text: str) -> list[str]:
    """Lines that claim something is fused ("not fused" is no claim)."""
    return [line for line in text.splitlines() if re.search(r"(?<!not )\bfused\b", line)]


def _site_counts(text: str) -> tuple[int, dict[str, int]]:
    """The sites line: ``N sites on X`` or ``N sites: a on X, b on Y``, as (N, {what: count})."""
    line = next(x.strip() for x in text.splitlines() if re.match(r"\s+\d+ sites[ :]", x))
    total = int(line.split()[0])
    runners = "on fused CUDA kernels|on torch references|as diffusers' ops"
    if line.startswith(f"{total} sites:"):
        parts = re.findall(rf"(\d+) ({runners})", line)
    else:  # one runner for all of them
        parts = [(total, re.match(rf"{total} sites ({runners})", line).group(1))]
    return total, {what: int(n) for n, what in parts}


def test_bf16_cpu_report_says_what_ran(seed):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    report = qwen_absorb.patch(model)
    T.run_transformer(model, T.transformer_inputs(model, seed=seed + 1))
    T.run_transformer(model, T.transformer_inputs(model, seed=seed + 2))
    text = str(report)
    s = report.summary
    total, parts = _site_counts(text)
    assert total == s["sites"] == 12 and parts == {"on torch references": 12}, text
    assert sum(parts.values()) == total
    assert "12 sites on torch references (no CUDA kernels on cpu" in text
    assert _says_fused(text) == [], text  # references ran: nothing reads "fused"
    assert "defer" not in text and "biases" not in text, text  # deferral cannot apply to a bf16 model
    assert "real FP8" not in text and "ModelOpt" not in text
    assert text.count("kernels need CUDA") == 1, text  # the reason once; the rest points to it
    # the block calls that ran the references: one grouped line with the count of calls
    lines = [line for line in text.splitlines() if "ran the torch references" in line]
    assert len(lines) == 1 and int(lines[0].split()[0]) == sum(report.runtime_fallbacks.values()) == 4, text


def test_fp8_report_with_the_h200_decisions_on_cpu(seed):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    T.fp8_quantize(model, [T.transformer_inputs(model, seed=seed + 1)])
    report = qwen_absorb.patch(model, fp8_gemm=True, capabilities={"cpu"})
    T.run_transformer(model, T.transformer_inputs(model, seed=seed + 2))
    text = str(report)
    s = report.summary
    total, parts = _site_counts(text)
    assert total == s["sites"] == sum(parts.values()) == 12 and parts == {"on torch references": 12}, text
    assert _says_fused(text) == [], text
    assert s["fp8_gemm_linears"] == s["modelopt_linears"] == 28
    assert "real FP8 GEMMs: 28 of 28 ModelOpt linears in the blocks" in text
    assert "a test of the logic, not a speed path" in text  # a CPU _scaled_mm is not the GPU's path
    # deferral applies to ModelOpt projections: its section is there, and deferred + kept add up
    assert "biases deferred into the op that follows their projection: " in text
    kept = s["biases_deferrable_sites"] - s["biases_deferred"]
    assert sum(_counts(text, "biases kept in the GEMM")) == kept if kept else "biases kept" not in text
    assert text.count("kernels need CUDA") == 1, text
    # the same model under fp8_gemm="auto" on the CPU: no real FP8, the 28 counted once, the override named
    auto = str(qwen_absorb.patch(model))
    assert "real FP8 GEMMs: 0 of 28 ModelOpt linears" in auto
    assert sum(_counts(auto, "ModelOpt linears not run as real FP8 GEMMs")) == 28, auto
    assert "real FP8 GEMMs need CUDA (fp8_gemm=True with capabilities={'cpu'} runs them here" in auto
    assert auto.count("kernels need CUDA") == 1 and _says_fused(auto) == [], auto


def test_cpu_report_says_what_runs_and_counts_add_up(seed):
    model = T.tiny_transformer(seed=seed)
    report = qwen_absorb.patch(model, defer_bias=True, capabilities={"cpu"})
    text = str(report)
    s = report.summary
    assert s["sites_on_references"] == s["sites_fused"] == 12 and s["sites_on_kernels"] == 0
    assert "12 sites on torch references (no CUDA kernels on cpu: tensors are on cpu" in text
    assert "biases deferred into the op that follows" in text  # defer_bias=True: deferral can apply
    assert "{" not in text and "site(s)" not in text  # no raw dicts, no hedged plurals
    # auto on an unquantized model: deferral cannot apply, so no section; the decisions stay in to_dict()
    auto = qwen_absorb.patch(model)
    t2 = str(auto)
    assert auto.summary["biases_deferred"] == 0 and "biases" not in t2, t2
    reasons = [r for b in auto.to_dict()["blocks"] for x in b["sites"] for r in x["defer_reasons"]]
    assert any("validated on GPUs only (sm_90)" in r for r in reasons) and "'(9, 0)'" not in str(reasons)


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
    assert report.summary["sites_on_kernels"] == 12 and "12 sites on fused CUDA kernels" in text
    assert "no CUDA kernels" not in text and "biases" not in text
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


def test_a_block_replaced_after_patch_reads_as_what_runs(seed):
    """``transformer_blocks[i] = other`` after ``patch()``: the new block runs diffusers' forward (the outputs were
    right), and the report says so now (it said every block was patched until ``patch()`` again)."""
    import copy

    model = T.tiny_transformer(seed=seed, num_layers=3)
    twin = copy.deepcopy(model)
    kw = T.transformer_inputs(model, seed=seed + 1)
    report = qwen_absorb.patch(model)
    n = len(model.transformer_blocks)
    assert report.summary["blocks_patched"] == n
    fused = report.summary["sites_fused"]
    model.transformer_blocks[1] = copy.deepcopy(twin.transformer_blocks[1])
    assert torch.equal(T.run_transformer(model, kw), T.run_transformer(twin, kw))
    b1 = report.blocks[1]
    assert report.summary["blocks_patched"] == n - 1 and not b1.patched and "replaced" in b1.reasons[0]
    assert not any(s.fused for s in b1.sites) and report.summary["sites_fused"] == fused - len(b1.sites)
    assert "blocks patched 2/3" in str(report)
    report = qwen_absorb.patch(model)  # patched again: the new block too
    assert report.summary["blocks_patched"] == n and report.blocks[1].patched


@torch.no_grad()
def test_a_pipeline_view_leaves_what_others_see_and_stays_live(seed):
    """``patch_report(sibling)`` of a ``from_pipe`` sibling (one transformer, one report) is a view for that
    pipeline: the first pipeline's report, and ``patch_report(transformer)``, keep their sections (asking about the
    sibling rewrote them); the view counts what runs and says when the patch ends, as the report does."""
    from diffusers import QwenImagePipeline

    pipe = T.tiny_pipeline(seed=seed)
    report = qwen_absorb.patch(pipe)
    said = {name: part.line() for name, part in report.parts.items()}
    view = qwen_absorb.patch_report(QwenImagePipeline.from_pipe(pipe))
    assert not view.parts["pipeline"].on and "module walks (not patched on this pipeline" in str(view)
    assert {name: part.line() for name, part in report.parts.items()} == said
    assert qwen_absorb.patch_report(pipe.transformer) is report
    assert {name: part.line() for name, part in qwen_absorb.patch_report(pipe).parts.items()} == said
    embeds, mask = T.tiny_prompt_embeds(seed=seed % 1000)
    pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, num_inference_steps=2, height=32, width=32,
         output_type="latent")
    assert view.active and view.runtime_fallbacks == report.runtime_fallbacks and sum(view.runtime_fallbacks.values())
    assert view.summary == report.summary and view.dtype == report.dtype == "float32"
    qwen_absorb.unpatch(pipe)
    assert not view.active and not report.active and view.dtype == "float32"
    assert str(view).startswith("qwen_absorb PatchReport (unpatched)")
