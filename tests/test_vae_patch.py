"""CPU: the VAE decode room (qwen_absorb.vae) on a tiny AutoencoderKLQwenImage: the 2-D path against diffusers'
decode (fp32 close, bf16 within the fidelity gate), fallbacks, a changed weight, unpatch exactness, the report."""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from . import builders
from qwen_absorb import vae as vae_room


def _z(seed: int, b: int = 1, t: int = 1, h: int = 12, w: int = 8, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(b, 4, t, h, w, generator=torch.Generator().manual_seed(seed)).to(dtype)


@torch.no_grad()
def test_fp32_matches_diffusers_and_unpatch_is_exact(seed):
    vae = builders.tiny_vae(seed=seed % 1000)
    z = _z(seed, b=2)
    ref = vae.decode(z).sample
    sd = {k: v.clone() for k, v in vae.state_dict().items()}
    rep = vae_room.patch(vae, cpu=True)
    out = vae.decode(z).sample
    assert rep.on and rep.fast_calls == 1 and not rep.fallbacks
    assert out.shape == ref.shape and out.is_contiguous() and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert not torch.equal(out, torch.zeros_like(out))
    tup = vae.decode(z, return_dict=False)
    assert isinstance(tup, tuple) and torch.equal(tup[0], out)
    vae_room.unpatch(vae)
    assert "_decode" not in vae.__dict__ and not rep.on
    assert all(torch.equal(v, sd[k]) for k, v in vae.state_dict().items())
    assert torch.equal(vae.decode(z).sample, ref)


@torch.no_grad()
def test_fp64_normalizes_in_fp64_as_diffusers_does(seed):
    """diffusers' RMS norm normalizes 16-bit inputs in fp32 and fp64 inputs in fp64: an fp64 decode normalized in
    fp32 would be off by ~1e-7 (relative), far beyond fp64's convolution reordering (~1e-15)."""
    vae = builders.tiny_vae(seed=seed % 1000).double()
    z = _z(seed, dtype=torch.float64)
    ref = vae.decode(z).sample
    vae_room.patch(vae, cpu=True)
    out = vae.decode(z).sample
    assert vae._decode.report.fast_calls == 1 and out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-11, atol=1e-12)
    vae_room.unpatch(vae)


@pytest.mark.slow
@torch.no_grad()
def test_bf16_within_the_fidelity_gate(seed):
    vae = builders.tiny_vae(seed=seed % 1000, dtype=torch.bfloat16)
    vae_room.patch(vae, cpu=True)
    gate = vae_room.fidelity(vae, _z(seed, h=16, w=16, dtype=torch.bfloat16))
    assert gate["err_unpatched"] > 0 and gate["ratio"] <= vae_room.GATE, gate
    assert vae._decode.report.fast_calls == 1  # fidelity() measured the 2-D path, not a fallback


@pytest.mark.slow
@torch.no_grad()
def test_fallbacks_run_diffusers_decode(seed):
    vae = builders.tiny_vae(seed=seed % 1000)
    rep = vae_room.patch(vae)  # default: the 2-D path on CUDA only
    z = _z(seed)
    assert torch.equal(vae.decode(z).sample, type(vae)._decode(vae, z).sample)
    assert rep.fast_calls == 0 and any("gated on CUDA" in r for r in rep.fallbacks)
    vae_room.patch(vae, cpu=True)
    rep = vae_room.report_of(vae)
    video = _z(seed, t=3)
    assert torch.equal(vae.decode(video).sample, type(vae)._decode(vae, video).sample)
    assert rep.fallbacks["several frames (video): the causal time path"] == 1
    with torch.enable_grad():
        vae.decode(z)
    assert rep.fallbacks["autograd"] == 1 and rep.fast_calls == 0
    vae.register_forward_hook(lambda *a: None)  # on the VAE itself: decode does not run forward, still fast
    vae.decoder.conv_in.register_forward_hook(lambda *a: None)  # on a decoder module: refused
    assert torch.equal(vae.decode(z).sample, type(vae)._decode(vae, z).sample)
    assert rep.rebuilds == 1 and not rep.on and any("hooks" in r for r in rep.reasons)
    vae_room.unpatch(vae)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["in_place", "load_state_dict", "data"])
@torch.no_grad()
def test_changed_weight_is_seen(seed, how):
    vae = builders.tiny_vae(seed=seed % 1000)
    z = _z(seed)
    rep = vae_room.patch(vae, cpu=True)
    vae.decode(z)
    w = vae.decoder.up_blocks[0].resnets[0].conv1.weight
    new = torch.randn_like(w)
    if how == "in_place":
        w.copy_(new)
    elif how == "load_state_dict":
        vae.load_state_dict({"decoder.up_blocks.0.resnets.0.conv1.weight": new}, strict=False)
    else:
        w.data = new
    out = vae.decode(z).sample
    assert rep.rebuilds == 1 and rep.on
    torch.testing.assert_close(out, type(vae)._decode(vae, z).sample, rtol=1e-4, atol=1e-5)


def test_refusals_copy_and_pipeline_patch(seed):
    wrong = builders.tiny_qwenimage21_vae()
    rep = vae_room.patch(wrong)
    assert not rep.on and "_decode" not in wrong.__dict__
    with pytest.raises(ValueError):
        vae_room.patch(builders.tiny_vae(), cuda_graph="sometimes")
    vae = builders.tiny_vae(seed=seed % 1000)
    vae_room.patch(vae, cpu=True)
    twin = copy.deepcopy(vae)
    z = _z(seed)
    with torch.no_grad():
        torch.testing.assert_close(twin.decode(z).sample, vae.decode(z).sample, rtol=0, atol=0)
    assert vae_room.report_of(twin) is not vae_room.report_of(vae)
    pipe = builders.tiny_pipeline()
    report = qwen_absorb.patch(pipe)
    assert report.parts["vae"].on and "VAE decode" in str(report) and "vae" in report.to_dict()
    qwen_absorb.unpatch(pipe)
    assert "_decode" not in pipe.vae.__dict__
    qwen_absorb.patch(pipe, vae=False)
    assert "_decode" not in pipe.vae.__dict__
    qwen_absorb.unpatch(pipe)


def test_pil_conversion_on_the_device_gives_diffusers_bytes(seed):
    import numpy as np

    pipe = builders.tiny_pipeline()
    assert vae_room.patch_postprocess(pipe.image_processor)
    fast = pipe.image_processor.postprocess
    g = torch.Generator().manual_seed(seed)
    img = (torch.rand(2, 3, 40, 24, generator=g) * 2.4 - 1.2).to(torch.bfloat16)  # past both clamps too
    img[0, 0, 0, :6] = torch.tensor([-1.0, 1.0, 0.0, 1 / 255, -0.5, 0.5])
    ref = type(pipe.image_processor).postprocess(pipe.image_processor, img, output_type="pil")
    got = fast.pil_images(img, None)  # the device path's conversion, run here on the host tensor
    assert len(got) == 2 and all(a.mode == b.mode and a.size == b.size for a, b in zip(got, ref))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, ref))
    img[1, 2, 3, 4] = float("nan")
    assert fast.pil_images(img, None) is None
    out = pipe.image_processor.postprocess(img[:1], output_type="pil")  # a host image: diffusers' method
    assert fast.calls["diffusers"] == 1 and np.array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    vae_room.unpatch_postprocess(pipe.image_processor)
    assert "postprocess" not in pipe.image_processor.__dict__


def test_other_diffusers_code_is_left_alone(monkeypatch):
    vae = builders.tiny_vae()
    monkeypatch.setattr(vae_room, "REPLICATED", frozenset({"0" * 16}))  # as if diffusers' VAE code had changed
    rep = vae_room.patch(vae)
    assert not rep.on and "replicates" in rep.reasons[0] and "_decode" not in vae.__dict__


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_decoder_edits_after_patch_are_diffusers_decode(seed):
    """Edits a user makes to the decoder after a call, each against the unpatched twin (fp32 tolerance): a module
    replaced and then loaded into (the watch is made anew with it), a bias set to None (crashed every decode), a
    norm's number bias (dropped), an ablation with nn.Identity (crashed: the 2-D path reads each slot's module), an
    empty latent (returned an empty image where diffusers raises), a convolution's padding set anew (its old
    geometry was kept)."""
    vae = builders.tiny_vae(seed=seed % 1000)
    twin = copy.deepcopy(vae)
    vae_room.patch(vae, cpu=True)
    z = _z(seed)
    vae.decode(z)

    def both(edit):
        for v in (vae, twin):
            edit(v)
        _close(vae.decode(z).sample, twin.decode(z).sample)

    g = torch.Generator().manual_seed(seed)
    both(lambda v: setattr(v.decoder, "conv_in", copy.deepcopy(twin.decoder.conv_in)))
    new = torch.randn(vae.decoder.conv_in.weight.shape, generator=g)
    both(lambda v: v.decoder.conv_in.load_state_dict({"weight": new, "bias": v.decoder.conv_in.bias}))
    assert vae_room.report_of(vae).on
    both(lambda v: setattr(v.decoder.conv_out, "bias", None))
    both(lambda v: setattr(v.decoder.norm_out, "bias", 0.25))
    pad, side = vae.decoder.conv_out._padding, vae.decode(z).sample.shape[-1]
    wider = (pad[0] + 1, pad[1] + 1, pad[2] + 1, pad[3] + 1, *pad[4:])
    both(lambda v: setattr(v.decoder.conv_out, "_padding", wider))  # a larger image (the 2-D path kept the old one)
    assert vae.decode(z).sample.shape[-1] == twin.decode(z).sample.shape[-1] == side + 2
    assert vae_room.report_of(vae).on and vae_room.report_of(vae).fast_calls >= 4
    both(lambda v: setattr(v.decoder.mid_block.resnets[0], "norm1", torch.nn.Identity()))
    assert not vae_room.report_of(vae).on and "norm1" in vae_room.report_of(vae).reasons[0]
    with pytest.raises(RuntimeError):
        twin.decode(_z(seed, b=0))
    with pytest.raises(RuntimeError):
        vae.decode(_z(seed, b=0))


@torch.no_grad()
def test_global_hooks_dropout_p_and_patch_again(seed):
    """torch's global forward hooks run diffusers' decode (they were skipped); dropout's p set in train mode after a
    call is seen (it was skipped); patch() again remakes the 2-D weights after a .data write (it kept them)."""
    vae = builders.tiny_vae(seed=seed % 1000)
    twin = copy.deepcopy(vae)
    rep = vae_room.patch(vae, cpu=True)
    z = _z(seed)
    vae.decode(z)
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        out = vae.decode(z).sample
    finally:
        handle.remove()
    assert "QwenImageRMS_norm" in seen  # diffusers' decode ran, its modules' calls hooked
    assert any("global module forward hooks" in r for r in rep.fallbacks)
    _close(out, twin.decode(z).sample)
    for v in (vae, twin):
        v.train()
    vae.decode(z)
    for v in (vae, twin):
        for m in v.decoder.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.5
    assert not torch.equal(vae.decode(z).sample, vae.decode(z).sample)  # dropout runs (diffusers' decode)
    for v in (vae, twin):
        v.eval()
        v.decoder.conv_in.weight.data.mul_(0.5)  # a .data write: no watch sees it
    want = twin.decode(z).sample
    vae_room.patch(vae, cpu=True)  # patch() again: made anew
    _close(vae.decode(z).sample, want)
    assert rep.on


def test_bad_arguments_are_clear_errors():
    vae = builders.tiny_vae()
    for bad in (None, "vae", builders.tiny_pipeline()):
        with pytest.raises(TypeError):
            vae_room.patch(bad)
    for kw in ({"cpu": "no"}, {"fuse_norm": "off"}, {"cpu": None}):
        with pytest.raises(ValueError):
            vae_room.patch(vae, **kw)
    assert vae_room.report_of(None) is None
    vae_room.unpatch(None)  # a no-op, as for anything not patched


def test_a_vae_swapped_out_after_patch_is_put_back(seed):
    """``pipe.vae = other`` after ``patch(pipe)``: the next ``unpatch(pipe)`` (or ``patch(pipe)``) puts the old
    VAE's decode back too, so that code still holding it gets diffusers' decode; a pickled pipeline carries no
    reference to it, a deep copy one to its own copy of the VAE."""
    import pickle

    pipe = builders.tiny_pipeline()
    qwen_absorb.patch(pipe)
    old = pipe.vae
    assert "_decode" in old.__dict__
    pipe.vae = builders.tiny_vae(seed=seed % 1000)
    qwen_absorb.unpatch(pipe)
    assert "_decode" not in old.__dict__ and "_decode" not in pipe.vae.__dict__
    qwen_absorb.patch(pipe)
    swapped, pipe.vae = pipe.vae, old
    qwen_absorb.patch(pipe)  # again, with the first VAE back: the second one put back, the first patched
    assert "_decode" not in swapped.__dict__ and "_decode" in old.__dict__
    copied = pickle.loads(pickle.dumps(pipe))
    assert copied.__dict__["_qwen_absorb_vae"] is None
    twin = copy.deepcopy(pipe)
    assert twin.__dict__["_qwen_absorb_vae"]() is twin.vae is not old
    qwen_absorb.unpatch(pipe)
    assert "_decode" not in old.__dict__ and "_qwen_absorb_vae" not in pipe.__dict__


@torch.no_grad()
def test_a_deep_copy_unpatched_after_a_swap_gives_its_parts_back(seed):
    """``patch(pipe)``, ``c = copy.deepcopy(pipe)``, ``c.vae = other`` (or ``c.image_processor = other``),
    ``unpatch(c)``: the copy's first VAE (image processor) is diffusers' again, as an unpatched twin's given the same
    actions (the copy's record of it was None, so it stayed patched), and the original keeps its patch."""
    z = _z(seed)
    image = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    for name, attr in (("vae", "_decode"), ("image_processor", "postprocess")):
        pipe, twin = builders.tiny_pipeline(seed=seed % 1000), builders.tiny_pipeline(seed=seed % 1000)
        qwen_absorb.patch(pipe)
        copied, twin = copy.deepcopy(pipe), copy.deepcopy(twin)
        first, twin_first = getattr(copied, name), getattr(twin, name)
        assert attr in first.__dict__ and first is not getattr(pipe, name) and attr not in twin_first.__dict__
        other = copy.deepcopy(twin_first)  # a fresh part, never patched
        for p in (copied, twin):
            setattr(p, name, copy.deepcopy(other))
            qwen_absorb.unpatch(p)
        assert attr not in first.__dict__, name
        if name == "vae":
            assert torch.equal(first.decode(z).sample, twin_first.decode(z).sample)
        else:
            got, want = (proc.postprocess(image, output_type="pt") for proc in (first, twin_first))
            assert torch.equal(got, want)
        kept = getattr(pipe, name)
        assert attr in kept.__dict__ and pipe.__dict__[f"_qwen_absorb_{name}"]() is kept
        qwen_absorb.unpatch(pipe)
        assert attr not in kept.__dict__


def test_an_image_processor_swapped_out_after_patch_is_put_back():
    """``pipe.image_processor = other`` after ``patch(pipe)``: the next ``patch`` or ``unpatch`` gives the old one
    diffusers' ``postprocess`` back (code still holding it is left as unpatched), and patches the new one."""
    import pickle

    pipe = builders.tiny_pipeline()
    qwen_absorb.patch(pipe)
    old = pipe.image_processor
    assert "postprocess" in old.__dict__
    pipe.image_processor = copy.deepcopy(old)
    del pipe.image_processor.__dict__["postprocess"]  # a fresh processor, as a user would build one
    qwen_absorb.unpatch(pipe)
    assert "postprocess" not in old.__dict__ and "postprocess" not in pipe.image_processor.__dict__
    qwen_absorb.patch(pipe)
    swapped, pipe.image_processor = pipe.image_processor, old
    assert "postprocess" in swapped.__dict__ and "postprocess" not in old.__dict__
    qwen_absorb.patch(pipe)  # the first one back: the second put back, the first patched
    assert "postprocess" not in swapped.__dict__ and "postprocess" in old.__dict__
    assert pickle.loads(pickle.dumps(pipe)).__dict__["_qwen_absorb_image_processor"] is None
    qwen_absorb.unpatch(pipe)
    assert "postprocess" not in old.__dict__ and "_qwen_absorb_image_processor" not in pipe.__dict__
