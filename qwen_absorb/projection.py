"""The projection owner: one linear of a patched block run as a real FP8 ``torch._scaled_mm``.

``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype)`` computes ``scale_a * scale_b * (a @ b)
+ bias`` with fp32 accumulation; ``a`` is the row-major [M, K] e4m3 activation (codes emitted by
the producing fused op), ``b`` the column-major [K, N] weight (our row-major [N, K] codes,
transposed as a view), the scales are the per-tensor *dequantization* scales ``amax / 448`` as
one-element fp32 device tensors (no host synchronisation). The bias rides in the GEMM epilogue
when it has the output's dtype (bf16/fp16), else it is added after, as ModelOpt's own backend does.
"""

from __future__ import annotations

import torch

from .plan import BlockPlan, LinearPlan


def fp8_linear(codes: torch.Tensor, lp: LinearPlan, plan: BlockPlan) -> torch.Tensor:
    """``linear(x)`` from the e4m3 codes of ``x`` ([..., K]) -> [..., N] in the linear's dtype."""
    w = lp.weight
    lead = codes.shape[:-1]
    a = codes.reshape(-1, codes.shape[-1])
    bias = lp.bias
    fuse_bias = bias is not None and bias.dtype == w.out_dtype and w.out_dtype != torch.float32
    out = torch._scaled_mm(
        a, w.codes.t(), scale_a=lp.input_scale, scale_b=w.scale, bias=bias if fuse_bias else None,
        out_dtype=w.out_dtype, use_fast_accum=plan.options.use_fast_accum,
    )
    if bias is not None and not fuse_bias:
        out = out + bias.to(out.dtype)
    return out.reshape(*lead, out.shape[-1])


def fp8_linear_reference(codes: torch.Tensor, lp: LinearPlan) -> torch.Tensor:
    """What :func:`fp8_linear` computes, in fp32 (dequantize both, matmul, scale, bias)."""
    w = lp.weight
    x = codes.float() * lp.input_scale
    y = x @ (w.codes.float() * w.scale).t()
    if lp.bias is not None:
        y = y + lp.bias.float()
    return y.to(w.out_dtype)
