"""Shared helpers for the op tests: literal diffusers expressions, input factories, comparisons."""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

EPS = 1e-6


def diffusers_modulate(x_normed, mod_params, index=None):
    """diffusers' own QwenImageTransformerBlock._modulate (it does not use self)."""
    return QwenImageTransformerBlock._modulate(None, x_normed, mod_params, index)


def diffusers_layer_norm(x):
    return torch.nn.LayerNorm(x.shape[-1], elementwise_affine=False, eps=EPS).to(x.device)(x)


def make_mod_params(rows, D, dtype, device, gen, magnitude=1.0):
    """[rows, 3D] modulation parameters (shift, scale, gate), as img_mod/txt_mod chunks give them."""
    return (torch.randn(rows, 3 * D, generator=gen, device=device, dtype=torch.float32) * magnitude).to(dtype)


def chunk_views(mod_params, as_3d=True):
    """(shift, scale, gate) views exactly as diffusers makes them: chunk(3), then [R, 1, D]."""
    shift, scale, gate = mod_params.chunk(3, dim=-1)
    if as_3d:
        return shift.unsqueeze(1), scale.unsqueeze(1), gate.unsqueeze(1)
    return shift, scale, gate


def make_index(B, L, device, gen):
    idx = (torch.rand(B, L, generator=gen, device=device) > 0.5).long()
    return idx


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_identical(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same bits wherever expected is not NaN, NaN exactly where expected is NaN."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    an, en = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(an, en), f"{what}: NaN positions differ ({int((an != en).sum())} elements)"
    keep = ~en
    diff = (bits(actual) != bits(expected)) & keep
    n = int(diff.sum())
    assert n == 0, f"{what}: {n} of {actual.numel()} elements differ in bits"


def ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Integers whose difference counts representable values between floats (ulps)."""
    i = bits(t).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    i = torch.where(i < 0, i + 2 * sign_bit, i)  # as unsigned
    return torch.where(i >= sign_bit, sign_bit - i, i)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (ordered_bits(a) - ordered_bits(b)).abs()


def ln_output_stats(actual: torch.Tensor, expected: torch.Tensor) -> dict:
    """Share of bit-identical elements and max ulp distance (NaN-free elements)."""
    keep = ~(torch.isnan(actual) | torch.isnan(expected))
    a, e = actual[keep], expected[keep]
    same = (bits(a) == bits(e)).float().mean().item() if a.numel() else 1.0
    max_ulp = int(ulp_distance(a, e).max()) if a.numel() else 0
    return {"identical": same, "max_ulp": max_ulp}


def check_graph_replay(chain, static, fresh) -> None:
    """``chain(*static)`` captured in a CUDA graph, replayed on ``fresh`` copied into the static
    inputs: bit-identical to ``chain(*fresh)`` run eagerly (the ops launch on the capturing stream)."""
    chain(*static)  # compile + load modules before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(*static)
        with torch.cuda.graph(g):
            outs = chain(*static)
    torch.cuda.current_stream().wait_stream(s)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    g.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, chain(*fresh)):
        assert_bit_identical(got, want, "graph replay")


def check_side_stream(chain, args) -> None:
    """``chain(*args)`` on a side stream equals it on the current stream (launches follow torch's stream)."""
    want = chain(*args)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = chain(*args)
    torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(got, want):
        assert_bit_identical(a, b, "side stream")
