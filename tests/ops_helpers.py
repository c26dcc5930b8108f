"""Shared helpers for the op tests: literal diffusers expressions, input factories, comparisons."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock

import qwen_absorb.ops as ops
from qwen_absorb.ops import _runtime, lora_add

EPS = 1e-6


def skip_module_without_kernels() -> None:
    """Skip the calling test module unless CUDA and CuPy can run the kernels (the GPU test files)."""
    if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
        pytest.skip(
            f"needs CUDA and CuPy ({_runtime.cupy_unavailable_reason() if torch.cuda.is_available() else 'no CUDA'})",
            allow_module_level=True,
        )


def poison_allocator(nbytes: int, device: str = "cuda") -> None:
    """Fill the next cached blocks with 0xFF (NaN in every float dtype) and give them back."""
    blocks = [torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device=device).fill_(0xFF) for _ in range(3)]
    del blocks


def lora_add_(problems, tiles: bool = True) -> None:
    """``y += alpha * t @ B.T`` in place for each ``(y, t, B, alpha)`` (distinct ``y``) by ``ops.lora_add``'s kernels,
    up to ``MAX_PROBLEMS`` a launch: their in-place form (ACT 0), which no library path runs; the sums it writes are
    what the fused form (ACT 1) quantizes, so the GPU tests check the kernels' arithmetic by it."""
    for i in range(0, len(problems), lora_add.MAX_PROBLEMS):
        chunk = [p for p in problems[i:i + lora_add.MAX_PROBLEMS] if p[0].numel()]
        if chunk:  # a smaller rank is zero-padded to the launch's k steps
            lora_add._launch(0, chunk, max(lora_add.ksteps(t.shape[1]) for _, t, _, _ in chunk), tiles)


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


def seeded_activations(seed, B, L, D, dtype, device):
    """(generator, x, attn): a generator seeded with ``seed`` and two random [B, L, D] activations drawn from it."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, L, D, generator=gen, device=device).to(dtype)
    attn = torch.randn(B, L, D, generator=gen, device=device).to(dtype)
    return gen, x, attn


def misaligned_activations(B, L, D, dtype, device, gen, offset):
    """(x, attn): two [B, L, D] views at element offsets ``offset`` and ``offset + 1`` of fresh buffers
    (a misaligned x sends PyTorch's LayerNorm down its rowwise path; the kernels drop vector loads)."""
    out = []
    for k in (0, 1):
        base = torch.randn(B * L * D + 16, generator=gen, device=device).to(dtype)
        out.append(base[offset + k: offset + k + B * L * D].view(B, L, D))
    return tuple(out)


def extreme_activations(B, L, D, dtype, device, gen):
    """(x, attn) near the dtype's overflow, with NaN, +-Inf and +-0 at x[0, 0, :5] and a NaN at attn[1, 3, 7]."""
    big = {torch.bfloat16: 1e30, torch.float16: 3e4, torch.float32: 1e30}[dtype]
    x = (torch.randn(B, L, D, generator=gen, device=device) * big).to(dtype)
    attn = (torch.randn(B, L, D, generator=gen, device=device) * big).to(dtype)
    x[0, 0, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0], device=device).to(dtype)
    attn[1, 3, 7] = float("nan")
    return x, attn


def qwen_image_chain(h, attn, bias, mod, index):
    """The three Qwen-Image fused ops as a block chains them: (norm1 output, new residual, norm2
    output, FFN residual); ``mod`` holds both [R, 3D] modulations side by side."""
    m1, m2 = mod.chunk(2, dim=-1)
    sh1, sc1, g1 = chunk_views(m1)
    sh2, sc2, g2 = chunk_views(m2)
    x = ops.layer_norm_scale_shift(h, shift=sh1, scale=sc1, index=index)
    h2, y = ops.bias_residual_layer_norm_scale_shift(h, attn, bias=bias, gate=g1, shift=sh2, scale=sc2, index=index)
    return x, h2, y, ops.bias_gate_residual(h2, y, bias=bias, gate=g2, index=index)


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
