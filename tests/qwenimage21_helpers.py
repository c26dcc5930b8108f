"""Shared helpers of the Qwen-Image-2.1 tests: a tiny random transformer, its inputs, and the runner
installed on every block (the wiring the patch floor does: decide, then the forward slot)."""

from __future__ import annotations

import contextlib

import torch
from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    QwenImage21FlexAttnProcessor,
    QwenImage21KVCache,
)

from qwen_absorb import fp8_forward, qwenimage21
from qwen_absorb.plan import BlockPlan, decide


def tiny_model(dtype=torch.float32, device="cpu", seed=0, heads=2, head_dim=16, axes=(4, 6, 6), layers=2,
               mlp_ratio=3, flex=False, gain=1.0, causal_condition=True):
    """A random QwenImage21Transformer2DModel with tiny sizes (head_dim >= 16 for flex attention;
    ``axes`` sums to ``head_dim``). ``gain`` scales the modulation weights (larger gates and scales
    exercise more rounding cases). ``causal_condition=False``: no t = 0 row, no target_token_mask."""
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=layers, attention_head_dim=head_dim,
        num_attention_heads=heads, context_in_dim=8, mlp_ratio=mlp_ratio, axes_dims_rope=tuple(axes),
        causal_condition=causal_condition,
    )
    if gain != 1.0:
        with torch.no_grad():
            model.modulation[1].weight.mul_(gain)
    model = model.to(device=device, dtype=dtype).eval()
    if flex:
        model.set_attn_processor(QwenImage21FlexAttnProcessor())
    else:
        model.set_attn_processor(QwenImage21AttnProcessor())
    return model


def model_inputs(model, batch_size=1, cond=False, pad=0, seed=0, target=(2, 2), timestep=None):
    """Inputs as QwenImage21Pipeline builds them: the VLM sequence ``text, [condition slot, text],``
    then the target image's slots appended; ``pad`` right-pads the prompt of every sample after the
    first (batch 2 with padded prompts)."""
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    g = torch.Generator().manual_seed(seed)
    B = batch_size
    th, tw = target
    assert (th * tw) % 4 == 0
    target_slots = th * tw // 4
    if cond:
        vlm = [False, False, False, True, False, False]  # text, one condition image (2x2 = 1 slot), text
        img_shapes = [(1, 2, 2), (1, th, tw)]
    else:
        vlm = [False] * 5
        img_shapes = [(1, th, tw)]
    img_tokens = sum(h * w for _, h, w in img_shapes)
    img_mask = torch.tensor(vlm + [True] * target_slots).expand(B, -1).clone()
    ehs_mask = torch.ones(B, len(vlm), dtype=torch.long)
    if pad:
        ehs_mask[1:, -pad:] = 0
    ts = torch.rand(B, generator=g) if timestep is None else torch.full((B,), float(timestep))
    return {
        "hidden_states": torch.randn(B, img_tokens, model.config.in_channels, generator=g).to(device, dtype),
        "encoder_hidden_states": torch.randn(B, len(vlm), model.config.context_in_dim, generator=g).to(device, dtype),
        "encoder_hidden_states_mask": ehs_mask.to(device),
        "timestep": ts.to(device, dtype),
        "img_shapes": [img_shapes] * B,
        "img_mask": img_mask.to(device),
    }


def run(model, inputs, **kw):
    with torch.no_grad():
        return model(**inputs, return_dict=False, **kw)[0]


def run_kv(model, inputs_extract, inputs_cached):
    """A prefill that extracts the prefix KV cache, then a cached decode step: both outputs."""
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    a = run(model, inputs_extract, kv_cache=cache, kv_cache_mode="extract")
    b = run(model, inputs_cached, kv_cache=cache, kv_cache_mode="cached")
    return a, b


@contextlib.contextmanager
def installed(model, device):
    """The runner in every block's forward slot (as the patch floor wires it); yields the blocks' plans."""
    plans = []
    for i, block in enumerate(model.transformer_blocks):
        plan = BlockPlan(index=i)
        decide(plan, block, torch.device(device))
        plans.append(plan)
        block.forward = (lambda b, p: (lambda *a, **k: qwenimage21.patched_forward(b, p, *a, **k)))(block, plan)
    try:
        yield plans
    finally:
        for block in model.transformer_blocks:
            block.__dict__.pop("forward", None)


def fallback_counts(plans, allowed=("fused ops ran their torch references",)) -> dict:
    """Counted reasons other than the expected ones (empty: every call took the fused path)."""
    out = {}
    for p in plans:
        for k, v in p.rt.counter.items():
            if k not in allowed:
                out[k] = out.get(k, 0) + v
    return out


def f32(inp: dict) -> dict:
    """``inp`` with its floating-point tensors upcast to fp32 (the fp32 reference's inputs)."""
    return {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inp.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def spy_fp8_linears(model, monkeypatch) -> tuple[dict, list, list]:
    """``(seen, used, quantized)``, filled while ``model`` runs: every block linear's input by ``(block, path)``
    (a no-op pre-hook on each, so each is called as a module), the codes each real-FP8 GEMM multiplied, and the
    paths of the linears that quantized their input themselves (clones: the buffers may be reused)."""
    seen, used, quantized = {}, [], []
    for name in fp8_forward.LINEARS:
        for i, b in enumerate(model.transformer_blocks):
            b.get_submodule(name).register_forward_pre_hook(
                lambda m, args, key=(i, name): seen.__setitem__(key, args[0].clone()))
    real_gemm, real_quantize = fp8_forward.Fp8LinearForward.gemm, fp8_forward.Fp8LinearForward.quantize

    def gemm(self, codes):
        used.append(((self.index, self.path), codes.clone()))
        return real_gemm(self, codes)

    def quantize(self, x):
        quantized.append(self.path)
        return real_quantize(self, x)

    monkeypatch.setattr(fp8_forward.Fp8LinearForward, "gemm", gemm)
    monkeypatch.setattr(fp8_forward.Fp8LinearForward, "quantize", quantize)
    return seen, used, quantized
