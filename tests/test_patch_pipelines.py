"""Whole pipelines (tiny transformer + tiny VAE, precomputed prompt embeddings, no text encoder)."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import qwen_absorb
from . import builders as T

PIPELINES = [
    "QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline", "QwenImageEditPipeline",
    "QwenImageEditInpaintPipeline", "QwenImageEditPlusPipeline", "QwenImageControlNetPipeline",
    "QwenImageControlNetInpaintPipeline", "QwenImageLayeredPipeline",
]


def _embeds(seed):
    pe, pm = T.tiny_prompt_embeds(seq_len=7, masked_tail=2, seed=seed)
    ne, nm = T.tiny_prompt_embeds(seq_len=3, masked_tail=0, seed=seed + 1)
    return dict(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm)


def _image(seed, size=32):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


@pytest.mark.parametrize("name", PIPELINES)
def test_every_pipeline_class_can_be_patched(name, seed):
    cls = getattr(diffusers, name)
    pipe = T.tiny_pipeline(cls, seed=seed, zero_cond_t="Edit" in name)
    report = qwen_absorb.patch(pipe)
    assert report.summary["blocks_patched"] == len(pipe.transformer.transformer_blocks)
    assert report.summary["sites_fused"] == report.summary["sites"]
    qwen_absorb.unpatch(pipe)
    assert qwen_absorb.patch_report(pipe) is None


def test_other_models_are_refused_clearly():
    """Qwen-Image and Qwen-Image-2.1 transformers are patched (tests/test_qwenimage21_patch.py); anything
    else gets a TypeError naming what it needs and what it got."""
    with pytest.raises(TypeError, match="QwenImageTransformer2DModel or QwenImage21Transformer2DModel.*Linear"):
        qwen_absorb.patch(torch.nn.Linear(2, 2))


def _run(pipe, seed, **kw):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return pipe(generator=gen, height=32, width=32, num_inference_steps=2, output_type="pt", **kw).images


def test_qwen_image_pipeline_same_images(seed):
    pipe = T.tiny_pipeline(seed=seed)
    kw = dict(_embeds(seed), true_cfg_scale=4.0)
    ref = _run(pipe, seed + 2, **kw)
    report = qwen_absorb.patch(pipe)
    out = _run(pipe, seed + 2, **kw)
    assert out.shape == ref.shape == (1, 3, 32, 32)
    assert torch.equal(out, ref)
    # 2 steps x (cond + uncond) x 2 blocks, all through the patched forward
    assert sum(report.runtime_fallbacks.values()) == 8
    qwen_absorb.unpatch(pipe)
    assert torch.equal(_run(pipe, seed + 2, **kw), ref)


@pytest.mark.slow
def test_edit_plus_zero_cond_t_same_images(seed, monkeypatch):
    # Edit-Plus encodes each condition image at ~1024^2 px: a minute on 2 CPU cores with the tiny
    # VAE. 64^2 px keeps the path (condition tokens, modulate_index) and takes a second.
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    monkeypatch.setattr(edit_plus, "CONDITION_IMAGE_SIZE", 64 * 64)
    pipe = T.tiny_pipeline(diffusers.QwenImageEditPlusPipeline, zero_cond_t=True, seed=seed)
    assert pipe.transformer.config.zero_cond_t
    kw = dict(_embeds(seed), image=[_image(seed)], true_cfg_scale=1.0)
    kw.pop("negative_prompt_embeds"), kw.pop("negative_prompt_embeds_mask")
    seen = []
    blk = pipe.transformer.transformer_blocks[0]
    handle = blk.register_forward_pre_hook(lambda m, a, k: seen.append(k.get("modulate_index")), with_kwargs=True)
    ref = _run(pipe, seed + 2, **kw)
    report = qwen_absorb.patch(pipe)
    out = _run(pipe, seed + 2, **kw)
    handle.remove()
    assert seen and seen[0] is not None and bool((seen[0] == 1).any())  # condition tokens present
    assert torch.equal(out, ref)
    assert report.summary["sites_fused"] == 12
    qwen_absorb.unpatch(pipe)


@pytest.mark.slow
def test_qwen_image_pipeline_quantized_deferred(seed):
    """FP8 transformer in a pipeline, deferral forced on CPU: images close to unpatched ones."""
    pipe = T.tiny_pipeline(seed=seed)
    calib = T.transformer_inputs(pipe.transformer, height=4, width=4, seed=seed)
    T.fp8_quantize(pipe.transformer, calib)
    kw = dict(_embeds(seed), true_cfg_scale=4.0)
    ref = _run(pipe, seed + 2, **kw)
    report = qwen_absorb.patch(pipe, capabilities={"cpu"})
    assert report.summary["biases_deferred"] == 8
    out = _run(pipe, seed + 2, **kw)
    assert (out - ref).abs().max().item() <= 2e-2  # images in [0, 1]; fp32, FP8 rounding flips only
    qwen_absorb.unpatch(pipe)
    assert torch.equal(_run(pipe, seed + 2, **kw), ref)


def test_pipeline_sections_read_true_for_copies_and_shared_transformers(seed):
    """``patch_report(pipe)`` reads the pipeline's own sections: a deep copy of a patched pipeline is of diffusers'
    class (its walks are not patched: it said on), and two pipelines sharing a transformer through ``from_pipe``
    each see their own prompt-encoding section (the second patch overwrote the first's)."""
    import copy

    from diffusers import QwenImagePipeline

    from .test_text_encoder_patch import tiny_text_pipeline

    pipe = tiny_text_pipeline(seed=seed % 1000)
    qwen_absorb.patch(pipe)
    assert qwen_absorb.patch_report(pipe).parts["pipeline"].on
    twin = copy.deepcopy(pipe)
    sec = qwen_absorb.patch_report(twin).parts["pipeline"]
    assert not sec.on and "patch() it" in sec.reason
    assert qwen_absorb.patch_report(pipe).parts["pipeline"].on  # the original's own again
    other = QwenImagePipeline.from_pipe(pipe)
    assert other.transformer is pipe.transformer
    qwen_absorb.patch(other, text_encoder=False)
    te = qwen_absorb.patch_report(other).parts["text_encoder"]
    assert not te.on and "patch() it" in te.reasons[0]
    assert qwen_absorb.patch_report(pipe).parts["text_encoder"].on
    assert qwen_absorb.patch_report(pipe).parts["vae"] is qwen_absorb.patch_report(other).parts["vae"]  # one VAE
    qwen_absorb.unpatch(other)
    qwen_absorb.unpatch(pipe)
