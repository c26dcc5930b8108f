"""The device benchmarks of issues 38-40 in their CPU smoke modes (``--tiny``): each runs end to end and writes its
JSON with every key the issue names (``None`` only where a value needs CUDA, with the reason under ``skipped``);
the local tokenizer of ``pipeline_parts`` has the real vocabulary and special-token ids, and a pipeline built
with it encodes a prompt as diffusers' own encoding does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
CUDA_ONLY = ("gpu_busy_ms", "mem_gib", "peak_gib", "model_gib")  # keys that need CUDA (memory, profiler)


def _run(script: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _load(path: Path) -> dict:
    d = json.loads(path.read_text())
    for k in ("gpu", "date", "versions"):
        assert k in d, k
    v = d["versions"]
    assert {"torch", "cuda", "cupy", "diffusers", "modelopt", "driver"} <= set(v)
    assert v["qwen_absorb_commit"] or v["qwen_absorb_version"]  # never "qwen_absorb None"
    return d


def _measured_or_cuda(d: dict, keys: tuple[str, ...]) -> None:
    """Every key is present; a null one needs CUDA and says so."""
    for k in keys:
        assert k in d, k
        if d[k] is None:
            assert k.endswith(CUDA_ONLY) and "CUDA" in d["skipped"].get(k, ""), (k, d["skipped"].get(k))


@pytest.mark.slow
def test_one_owner_tiny_times_both_trees(tmp_path):
    """The before tree (here the same checkout, in its own worker process) and this tree: every key, both ways."""
    p = _run("one_owner.py", "--tiny", "--before-root", str(REPO), "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = _load(tmp_path / "one_owner_tiny.json")
    keys = [f"{c}_{s}" for c in ("bf16_default", "fp8_default", "fp8_lora", "qwenimage21_fp8")
            for s in ("ms", "wall_ms", "gpu_busy_ms", "mem_gib", "peak_gib")]
    _measured_or_cuda(d, tuple(keys) + tuple(f"before_{k}" for k in keys))
    assert all(d[k] > 0 for k in keys if k.endswith("_ms") and "busy" not in k)
    for tree in ("before", "current"):
        t = d["trees"][tree]
        assert not t["errors"] and t["exit_code"] == 0
        assert Path(t["qwen_absorb_file"]).resolve().is_relative_to(REPO)
    assert set(d["ratios"]) == {"bf16_default", "fp8_default", "fp8_lora", "qwenimage21_fp8"}
    assert "| fp8_lora |" in (tmp_path / "one_owner_tiny.md").read_text()


@pytest.mark.slow
def test_one_owner_records_a_root_without_the_package_and_a_killed_worker(tmp_path):
    """A before root without its own qwen_absorb/ is not timed as if it were that tree (the editable install would
    answer the import); a worker past --worker-timeout-s is killed and says so. Both keep the run going."""
    p = _run("one_owner.py", "--tiny", "--before-root", str(tmp_path), "--out", str(tmp_path / "out"),
             "--worker-timeout-s", "1")
    d = json.loads((tmp_path / "out" / "one_owner_tiny.json").read_text())
    assert p.returncode == 1 and d["trees"]["before"]["errors"]
    assert d["before_bf16_default_ms"] is None and "no qwen_absorb package" in d["skipped"]["before_bf16_default_ms"]
    assert d["trees"]["current"]["exit_code"].startswith("killed after 1 s") and d["bf16_default_ms"] is None


@pytest.mark.slow
def test_journey_tiny_has_every_key(tmp_path):
    off = tmp_path / "journey_offload_h200.json"
    off.write_text(json.dumps({"offload_model_8step_s": 1.5, "offload_model_graph_replays": 7, "date": "x"}))
    p = _run("journey.py", "--tiny", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = _load(tmp_path / "journey_tiny.json")
    assert not d["errors"]
    _measured_or_cuda(d, ("bf16_model_gib", "bf16_patched_ms", "fp8_default_model_gib", "fp8_default_ms",
                          "fp8_prev_default_ms", "nvfp4_fake_ms", "nvfp4_patched_ms", "nvfp4_model_gib",
                          "pipeline_resident_peak_gib"))
    assert d["nvfp4_export_loaded"] is True and d["nvfp4_bit_identical_to_fake"] is True
    assert d["offload_model_8step_s"] == 1.5 and d["offload_model_graph_replays"] == 7  # merged
    assert d["offload_group_8step_s"] is None and "not in" in d["skipped"]["offload_group_8step_s"]


@pytest.mark.slow
def test_pipeline_e2e_tiny_runs_every_case(tmp_path):
    p = _run("pipeline_e2e.py", "--tiny", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = _load(tmp_path / "pipeline_tiny.json")
    assert not d["errors"]
    cases = ("4step_bf16_unpatched", "4step_bf16", "50step_cfg_bf16_unpatched", "4step_fp8_unpatched", "4step_fp8",
             "50step_cfg_fp8", "50step_cfg_fp8_cache", "8step_lora_fused_fp8")
    for c in cases:
        assert d[f"e2e_{c}_s"] > 0, c
        st = d["stage_split"][c]
        assert {"encode_s", "denoise_s", "decode_s", "postprocess_s"} <= set(st) and st["encode_s"] > 0
        assert c in d["peak_gib"] or "CUDA" in d["skipped"][f"peak_gib.{c}"]
    for k in ("vae_decode_ms", "vae_decode_unpatched_ms", "vae_rel_err_vs_fp32_ratio", "te_encode_ms"):
        assert d[k] > 0, k
    assert d["cache_name"].startswith("magcache") and d["cache_latent_rel_err"] > 0  # the cache skipped steps
    # a second part merges into the first: its keys stay, the new part is listed
    p = _run("pipeline_e2e.py", "--tiny", "--out", str(tmp_path / "b"), "--cases", "4step_bf16",
             "--sections", "none", "--merge-json", str(tmp_path / "pipeline_tiny.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    d2 = json.loads((tmp_path / "b" / "pipeline_tiny.json").read_text())
    assert d2["e2e_8step_lora_fused_fp8_s"] == d["e2e_8step_lora_fused_fp8_s"] and len(d2["parts"]) == 2


@pytest.mark.slow
def test_local_tokenizer_and_pipeline_encode_a_prompt():
    sys.path.insert(0, str(BENCH))
    import pipeline_parts as P

    from . import builders as T

    tok = P.build_tokenizer(P.TEMPLATE)
    assert len(tok) == 151665 and tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645 and tok.pad_token_id == 151643
    ids = tok(P.TEMPLATE.format(P.PROMPT)).input_ids
    assert 60 < len(ids) - 34 < 120  # about as many tokens as Qwen2's tokenizer gives this prompt
    assert tok.decode(ids) == P.TEMPLATE.format(P.PROMPT)  # byte-level: lossless
    pipe = P.build_pipeline(T.tiny_transformer(dtype=torch.bfloat16), True, torch.device("cpu"))
    assert pipe.text_encoder.config.text_config.vocab_size == 152064
    with torch.inference_mode():
        emb, mask = pipe.encode_prompt(P.PROMPT, device="cpu")
        emb2, _ = pipe.encode_prompt("another prompt", device="cpu")
    assert emb.shape == (1, len(ids) - 34, 32) and (mask is None or mask.sum().item() == len(ids) - 34)
    assert torch.isfinite(emb).all() and emb.shape[1] != emb2.shape[1]


@pytest.mark.slow
def test_caches_tiny_runs_every_case(tmp_path):
    """benchmarks/caches.py: the uncached run, each cache patched (graph counters, error against uncached) and
    unpatched, MagCache's ratios from its own calibration run."""
    p = _run("caches.py", "--tiny", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = _load(tmp_path / "caches_tiny.json")
    assert not d["errors"] and d["uncached_s"] > 0 and d["uncached_unpatched_s"] > 0
    assert len(d["mag_ratios"]) == d["config"]["steps"]
    for name in ("pab_default", "pab_fast", "mag_default", "mag_fast", "fbc_default", "fbc_fast"):
        c = d["cases"][name]
        assert c["wall_s"] > 0 and c["unpatched_wall_s"] > 0 and c["latent_rel_err"] is not None, name
    assert d["cases"]["mag_fast"]["latent_rel_err"] > 0  # the cache skipped work
