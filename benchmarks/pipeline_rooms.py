"""The pipeline rooms on one GPU: the VAE decode (qwen_absorb.vae) and the prompt encoding (qwen_absorb.text_encoder).

VAE: the full ``AutoencoderKLQwenImage()`` (random weights, bf16), one 1024^2 latent: diffusers' decode, the 2-D
path eager and graphed (CUDA-event medians), the GPU work of one call of each (torch.profiler: kernels, busy ms,
the layout-conversion kernels), and the fidelity gate (``vae.fidelity``: error vs an fp32 decode, patched over
unpatched) on three latents.
Text encoder: Qwen2.5-VL-7B's geometry (random weights, bf16) with a word tokenizer (ids hashed into the real
vocabulary; the prompt below gives ~110 tokens with the template): ``encode_prompt`` wall time unpatched, with the
graphs (cache off) and from the cache, its GPU busy time, and bit-identity of the embeddings.

    python benchmarks/pipeline_rooms.py --out DIR [--te-layers 28] [--skip-te]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from qwen_absorb import text_encoder as te_room  # noqa: E402
from qwen_absorb import vae as vae_room  # noqa: E402

PROMPT = ("A red fox sitting on a mossy rock in a misty pine forest at dawn , soft golden light through the trees , "
          "dew on the grass , a small wooden sign with the text ' Trail 7 ' on the left , shallow depth of field , "
          "photorealistic , highly detailed fur , calm mood , muted green and orange colors")


class WordTokenizer:
    """Words and punctuation to ids below Qwen2's vocabulary (deterministic), right padding, like the real call."""

    def __call__(self, txt, max_length, padding, truncation, return_tensors):
        seqs = [[(hash_word(w) % 151000) + 1 for w in re.findall(r"\w+|[^\w\s]", t)][:max_length] for t in txt]
        n = max(map(len, seqs))
        ids = torch.full((len(seqs), n), 151643, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return Batch(input_ids=ids, attention_mask=mask)


class Batch(dict):
    __getattr__ = dict.__getitem__

    def to(self, device):
        return Batch({k: v.to(device) for k, v in self.items()})


def hash_word(w: str) -> int:
    h = 2166136261
    for c in w.encode():
        h = ((h ^ c) * 16777619) & 0xFFFFFFFF
    return h


def cuda_ms(fn, warmup=2, iters=7):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def wall_ms(fn, warmup=2, iters=7):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def gpu_work(fn):
    """Kernels of one call: count, busy ms, and the NCHW<->NHWC conversion kernels' share."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n, busy, conv = 0, 0.0, 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n += 1
            us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            busy += us
            if "nchwToNhwc" in e.name or "nhwcToNchw" in e.name:
                conv += us
    return {"kernels": n, "busy_ms": busy / 1e3, "layout_conversion_ms": conv / 1e3}


def bench_vae(res: dict) -> None:
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = AutoencoderKLQwenImage()
    vae = vae.to(torch.bfloat16).eval().requires_grad_(False)
    z = torch.randn(1, 16, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        unpatched = lambda: vae.decode(z, return_dict=False)  # noqa: E731
        res["vae_decode_unpatched_ms"] = cuda_ms(unpatched)
        res["vae_unpatched_gpu"] = gpu_work(unpatched)
        for fuse in (False, True):
            tag = "_fused" if fuse else ""
            vae_room.patch(vae, cuda_graph=False, fuse_norm=fuse)
            res[f"vae_decode_2d_eager{tag}_ms"] = cuda_ms(unpatched)
            res[f"vae_2d_eager{tag}_gpu"] = gpu_work(unpatched)
            vae_room.unpatch(vae)
        vae_room.patch(vae, fuse_norm=False)
        res["vae_decode_graph_unfused_ms"] = cuda_ms(unpatched, warmup=3)
        res["vae_fidelity_unfused"] = vae_room.fidelity(vae, z)
        vae_room.unpatch(vae)
        rep = vae_room.patch(vae)
        res["vae_decode_ms"] = cuda_ms(unpatched, warmup=3)
        res["vae_report"] = rep.to_dict()
        res["vae_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        gates = [vae_room.fidelity(vae, torch.randn(1, 16, 1, 128, 128, device="cuda", dtype=torch.bfloat16,
                                                    generator=torch.Generator("cuda").manual_seed(s)))
                 for s in range(3)]
    res["vae_fidelity"] = gates
    res["vae_rel_err_vs_fp32_ratio"] = max(g["ratio"] for g in gates)
    res["vae_gate_passed"] = res["vae_rel_err_vs_fp32_ratio"] <= vae_room.GATE
    # the conversion to PIL that follows the decode: diffusers' host path and the device path (same bytes)
    from diffusers.image_processor import VaeImageProcessor
    import numpy as np

    proc = VaeImageProcessor(vae_scale_factor=8)
    img = vae.decode(z, return_dict=False)[0][:, :, 0]
    fast = vae_room.FastPostprocess(proc, None)
    res["pil_diffusers_ms"] = wall_ms(lambda: proc.postprocess(img, output_type="pil"), 1, 5)
    res["pil_device_ms"] = wall_ms(lambda: fast(img, output_type="pil"), 1, 5)
    res["pil_same_bytes"] = bool(np.array_equal(np.asarray(fast(img)[0]), np.asarray(proc.postprocess(img)[0])))
    vae_room.unpatch(vae)
    del vae
    torch.cuda.empty_cache()


def bench_te(res: dict, layers: int) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = dict(hidden_size=3584, num_hidden_layers=layers, num_attention_heads=28, num_key_value_heads=4,
                intermediate_size=18944, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
                rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                hidden_act="silu", tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=3584,
                  fullatt_block_indexes=[0])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=151655, video_token_id=151656,
                           vision_start_token_id=151652, vision_end_token_id=151653, tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        te = Qwen2_5_VLForConditionalGeneration(cfg)
    torch.set_default_dtype(torch.float32)
    te = te.to(torch.bfloat16).eval().requires_grad_(False)
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=te,
                             tokenizer=WordTokenizer(), transformer=None)
    res["te_layers"] = layers
    with torch.no_grad():
        enc = lambda p=PROMPT: pipe.encode_prompt(p, device=torch.device("cuda"))  # noqa: E731
        ref = enc()
        ref_empty = enc(" ")
        res["te_tokens"] = int(WordTokenizer()([pipe.prompt_template_encode.format(PROMPT)], 2000, 1, 1, 1)
                               .input_ids.shape[1])
        res["te_encode_unpatched_ms"] = wall_ms(enc)
        res["te_unpatched_gpu"] = gpu_work(enc)
        te_room.patch(pipe, cuda_graph=True, cache_size=0)
        res["te_encode_ms"] = wall_ms(enc, warmup=3)
        res["te_graph_gpu"] = gpu_work(enc)
        got = enc()
        res["te_bit_identical"] = bool(torch.equal(got[0], ref[0])) and (got[1] is None) == (ref[1] is None)
        res["te_report_graphs"] = te_room.report_of(pipe).to_dict()
        te_room.unpatch(pipe)
        te_room.patch(pipe)
        enc(" ")
        res["te_cache_hit_ms"] = wall_ms(lambda: enc(" "))
        res["te_cache_bit_identical"] = bool(torch.equal(enc(" ")[0], ref_empty[0]))
        res["te_report_cache"] = te_room.report_of(pipe).to_dict()
    res["te_gpu_busy_ms"] = res["te_unpatched_gpu"]["busy_ms"]
    res["te_encode_over_gpu_work"] = res["te_encode_ms"] / res["te_gpu_busy_ms"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/pipeline")
    ap.add_argument("--te-layers", type=int, default=28)
    ap.add_argument("--skip-te", action="store_true")
    ap.add_argument("--skip-vae", action="store_true")
    a = ap.parse_args()
    import diffusers
    import transformers

    res = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
           "transformers": transformers.__version__, "side": 1024}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fn in (("vae", None if a.skip_vae else bench_vae), ("te", None if a.skip_te else bench_te)):
        if fn is None:
            continue
        try:
            fn(res) if name == "vae" else fn(res, a.te_layers)
        except Exception as e:  # noqa: BLE001 - keep the other room's numbers
            res[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
        (out / "rooms_h200.json").write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps({k: v for k, v in res.items() if not isinstance(v, (dict, list))}, indent=1), flush=True)


if __name__ == "__main__":
    main()
