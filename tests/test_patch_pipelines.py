"""Whole pipelines (tiny transformer + tiny VAE, precomputed prompt embeddings, no text encoder)."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import qwen_absorb
from qwen_absorb import pipeline_walks
from qwen_absorb.patch import NOT_PATCHED_HERE
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


def _lines(report):
    return {name: part.line() for name, part in report.parts.items()}


def test_pipeline_sections_read_true_for_copies_and_shared_transformers(seed):
    """``patch_report(pipe)`` reads the pipeline's own sections: a deep copy of a patched pipeline is of diffusers'
    class (its walks are not patched: it said on), and a ``from_pipe`` sibling sharing the transformer, patched with
    ``text_encoder=False``, reads as a pipeline patched alone with that argument (it said "patch() it" for the
    prompt encoding the user turned off) while the first pipeline keeps its own."""
    import copy

    from diffusers import QwenImagePipeline

    from .test_text_encoder_patch import tiny_text_pipeline

    pipe = tiny_text_pipeline(seed=seed % 1000)
    qwen_absorb.patch(pipe)
    mine = _lines(qwen_absorb.patch_report(pipe))
    assert qwen_absorb.patch_report(pipe).parts["pipeline"].on
    twin = copy.deepcopy(pipe)
    sec = qwen_absorb.patch_report(twin).parts["pipeline"]
    assert not sec.on and sec.reason == NOT_PATCHED_HERE
    other = QwenImagePipeline.from_pipe(pipe)
    assert other.transformer is pipe.transformer
    alone = tiny_text_pipeline(seed=seed % 1000)
    qwen_absorb.patch(other, text_encoder=False)
    assert _lines(qwen_absorb.patch_report(other)) == _lines(qwen_absorb.patch(alone, text_encoder=False))
    assert "text_encoder" not in qwen_absorb.patch_report(other).parts  # the user's choice, as patch() said it
    assert _lines(qwen_absorb.patch_report(pipe)) == mine
    assert qwen_absorb.patch_report(pipe).parts["vae"] is qwen_absorb.patch_report(other).parts["vae"]  # one VAE
    for p in (other, pipe, alone):
        qwen_absorb.unpatch(p)


def test_refused_sections_keep_their_reasons(seed, monkeypatch):
    """A section ``patch()`` refused (the walks of other diffusers code, a VAE with a hook inside, no text encoder)
    reads as ``patch()`` said it (it read "not patched on this pipeline"), and a section turned off by patching
    again stays out, as for a pipeline patched so at once (it read "not patched on this pipeline")."""
    from .test_text_encoder_patch import tiny_text_pipeline

    monkeypatch.setattr(pipeline_walks, "MIRRORED_SHA256", "0" * 16)
    pipe = T.tiny_pipeline(seed=seed)
    pipe.vae.decoder.conv_in.register_forward_hook(lambda *a: None)
    said = _lines(qwen_absorb.patch(pipe))
    assert set(said) == {"pipeline", "vae", "text_encoder"}
    assert not any(part.on for part in qwen_absorb.patch_report(pipe).parts.values())
    assert _lines(qwen_absorb.patch_report(pipe)) == said and NOT_PATCHED_HERE not in str(said)
    qwen_absorb.unpatch(pipe)
    pipe, alone = tiny_text_pipeline(seed=seed % 1000), tiny_text_pipeline(seed=seed % 1000)
    qwen_absorb.patch(pipe)
    qwen_absorb.patch(pipe, vae=False, text_encoder=False)  # the same transformer arguments: its patch is kept
    assert _lines(qwen_absorb.patch_report(pipe)) == _lines(qwen_absorb.patch(alone, vae=False, text_encoder=False))
    qwen_absorb.unpatch(pipe)
    qwen_absorb.unpatch(alone)


def test_a_deep_copy_of_a_pipeline_with_parts_swapped_after_patch(seed):
    """``pipe.image_processor = other`` and ``pipe.vae = other`` after ``patch(pipe)``, then ``copy.deepcopy(pipe)``:
    the copy computes as an unpatched twin given the same swaps, holds nothing of the original's, and its report
    and the original's say what runs there (the VAE section said the PIL conversion ran on the device after the
    processor was swapped for an unpatched one, in the copy too)."""
    import copy

    pipe, twin = T.tiny_pipeline(seed=seed), T.tiny_pipeline(seed=seed)
    qwen_absorb.patch(pipe)
    proc = copy.deepcopy(twin.image_processor)  # a fresh processor, as a user would build one
    pipe.image_processor, twin.image_processor = proc, copy.deepcopy(proc)
    for p in (pipe, copy.deepcopy(pipe)):
        vae = qwen_absorb.patch_report(p).parts["vae"]
        assert vae.on and vae.postprocess is ("postprocess" in p.image_processor.__dict__) is False
    vae = T.tiny_vae(seed=seed + 7)
    pipe.vae, twin.vae = vae, copy.deepcopy(vae)
    copied = copy.deepcopy(pipe)
    assert copied.__dict__["_qwen_absorb_vae"] is copied.__dict__["_qwen_absorb_image_processor"] is None
    for p in (pipe, copied):
        assert qwen_absorb.patch_report(p).parts["vae"].reasons == [NOT_PATCHED_HERE]
    kw = _embeds(seed)
    assert torch.equal(_run(copied, seed + 2, **kw), _run(twin, seed + 2, **kw))
    qwen_absorb.unpatch(copied)
    assert "_decode" not in copied.vae.__dict__ and "postprocess" not in copied.image_processor.__dict__
    assert torch.equal(_run(copied, seed + 2, **kw), _run(twin, seed + 2, **kw))
    qwen_absorb.unpatch(pipe)
