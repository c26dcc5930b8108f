"""Issue 21: a whole ``QwenImage21Pipeline`` (tiny random transformer and VAE, precomputed prompt embeddings, no
text encoder or processor) patched by ``qwen_absorb.patch(pipe)``: on the CPU the fused ops run their torch
references, so every latent must be bit-identical to the unpatched pipeline's, with and without the prefix KV
cache, with true CFG, for a batch of two prompts of different lengths; ``unpatch`` restores the output."""

from __future__ import annotations

import diffusers
import pytest
import torch

import qwen_absorb
from . import builders as T

STEPS = 3
SIDE = 64  # pixels: 4 x 4 latent tokens (16x VAE), 4 target slots of 2 x 2 tokens


def _embeds(pipe, seed, batch_size=2, cfg=False):
    dim = pipe.transformer.config.context_in_dim
    dtype = pipe.transformer.dtype
    pe, pm = T.qwenimage21_prompt_embeds(batch_size, seq_len=7, dim=dim, padded=2, seed=seed, dtype=dtype)
    kw = dict(prompt_embeds=pe, prompt_embeds_mask=pm)
    if cfg:
        ne, nm = T.qwenimage21_prompt_embeds(batch_size, seq_len=3, dim=dim, seed=seed + 1, dtype=dtype)
        kw.update(negative_prompt_embeds=ne, negative_prompt_embeds_mask=nm, true_cfg_scale=3.0)
    return kw


def _run(pipe, seed, output_type="latent", **kw):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return pipe(generator=gen, height=SIDE, width=SIDE, num_inference_steps=STEPS, output_type=output_type,
                    **kw).images


def _kv_modes(pipe):
    """The ``kv_cache_mode`` of every transformer call, recorded by a pre-hook on the transformer."""
    modes = []
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: modes.append(k.get("kv_cache_mode")), with_kwargs=True)
    return modes, handle


def test_tiny_pipeline_has_no_text_encoder_or_processor(seed):
    pipe = T.tiny_qwenimage21_pipeline(seed=seed)
    assert isinstance(pipe, diffusers.QwenImage21Pipeline)
    assert pipe.text_encoder is None and pipe.processor is None
    assert pipe.config.processor == (None, None) and pipe.config.text_encoder == (None, None)
    assert isinstance(pipe.transformer, diffusers.QwenImage21Transformer2DModel)
    assert isinstance(pipe.vae, diffusers.AutoencoderKLQwenImage21)
    assert pipe.vae.config.z_dim == pipe.transformer.config.in_channels
    pe, pm = T.qwenimage21_prompt_embeds(2, seq_len=5, dim=pipe.transformer.config.context_in_dim, padded=2, seed=seed)
    assert pe.shape == (2, 5, 32) and pm.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert torch.equal(pe[1, 3:], torch.zeros(2, 32)) and bool(pe[0].ne(0).all())
    with pytest.raises(TypeError):  # a prompt string needs the processor this pipeline does not have
        pipe(prompt="a fox", num_inference_steps=1, height=SIDE, width=SIDE, output_type="latent")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_kv_cache", [True, False])
@pytest.mark.parametrize("cfg", [False, True], ids=["no-cfg", "true-cfg"])
def test_patched_pipeline_latents_bit_identical(seed, dtype, use_kv_cache, cfg):
    pipe = T.tiny_qwenimage21_pipeline(dtype=dtype, seed=seed)
    pipe.set_progress_bar_config(disable=True)
    kw = dict(_embeds(pipe, seed + 1, cfg=cfg), use_kv_cache=use_kv_cache)
    modes, handle = _kv_modes(pipe)
    ref = _run(pipe, seed + 2, **kw)
    calls = len(modes)
    assert calls == STEPS * (2 if cfg else 1)
    want_modes = ["extract"] + ["cached"] * (STEPS - 1) if use_kv_cache else [None] * STEPS
    assert modes[:: 2 if cfg else 1] == want_modes, modes  # the cache was (not) used as asked
    assert ref.shape == (2, (SIDE // 16) ** 2, 4) and ref.dtype == dtype and bool(ref.isfinite().all())
    assert not torch.equal(ref, _run(pipe, seed + 3, **kw))  # the output depends on the noise: a real run

    report = qwen_absorb.patch(pipe)
    n_blocks = len(pipe.transformer.transformer_blocks)
    assert report.transformer_class == "QwenImage21Transformer2DModel"
    assert report.summary["blocks_patched"] == n_blocks == 2, str(report)
    assert report.summary["sites_fused"] == report.summary["sites"] == 5 * n_blocks, str(report)
    modes.clear()
    out = _run(pipe, seed + 2, **kw)
    handle.remove()
    assert modes[:: 2 if cfg else 1] == want_modes
    assert torch.equal(out, ref), (out - ref).abs().max()
    # every block call of every transformer call went through the patched forward (its torch references)
    assert dict(report.runtime_fallbacks) == {"fused ops ran their torch references": calls * n_blocks}, \
        report.runtime_fallbacks

    qwen_absorb.unpatch(pipe)
    assert qwen_absorb.patch_report(pipe) is None
    assert all("forward" not in b.__dict__ for b in pipe.transformer.transformer_blocks)
    assert torch.equal(_run(pipe, seed + 2, **kw), ref)


def test_patched_pipeline_images_bit_identical(seed):
    """Through the VAE too: ``output_type="pt"``, RGBA images of the requested size."""
    pipe = T.tiny_qwenimage21_pipeline(seed=seed)
    pipe.set_progress_bar_config(disable=True)
    kw = _embeds(pipe, seed + 1, batch_size=1, cfg=True)
    ref = _run(pipe, seed + 2, output_type="pt", **kw)
    assert ref.shape == (1, 4, SIDE, SIDE) and 0.0 <= ref.min() and ref.max() <= 1.0
    report = qwen_absorb.patch(pipe)
    assert report.summary["blocks_patched"] == 2
    assert torch.equal(_run(pipe, seed + 2, output_type="pt", **kw), ref)
    qwen_absorb.unpatch(pipe)
    assert torch.equal(_run(pipe, seed + 2, output_type="pt", **kw), ref)
