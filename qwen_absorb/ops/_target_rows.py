"""Modulation rows as diffusers selects them, and the block norm, shared by the fused ops and their references.

Qwen-Image (:func:`expand_param`): each sample's row, or with ``index`` (2B rows) a per-token choice of two.
Qwen-Image-2.1 (:func:`select_rows`), diffusers' ``_select_modulation_rows(params, target_token_mask)``: without a
mask every token uses its sample's row (``[B, D]``); with the mask (``[L]`` bool, True at target-image tokens)
``params`` has ``B + 1`` rows: target tokens use their sample's row, all others the trailing ``t = 0`` row ``B``. The
kernels choose per token, without building the ``[B, L, D]`` tensor."""

import torch

from ._validate import check_device, check_same, check_tensor, param_rows


def expand_param(p: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """What QwenImageTransformerBlock._modulate makes of one chunk of the modulation parameters: ``p.unsqueeze(1)``
    ([B, 1, D]), or with index (2B rows) ``torch.where(index[..., None] == 0, p[:B, None], p[B:, None])``."""
    rows = param_rows(p)
    if index is None:
        return rows.unsqueeze(1)
    b = rows.shape[0] // 2
    return torch.where(index.unsqueeze(-1) == 0, rows[:b].unsqueeze(1), rows[b:].unsqueeze(1))


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """nn.LayerNorm(D, elementwise_affine=False, eps) as diffusers' block norms compute it."""
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), None, None, eps)


def select_rows(params: torch.Tensor, target_token_mask: torch.Tensor | None) -> torch.Tensor:
    """diffusers' ``_select_modulation_rows``, op for op (``torch.where`` selects, never rounds)."""
    if target_token_mask is None:
        return params.unsqueeze(1)
    real, zero = params[:-1].unsqueeze(1), params[-1:].unsqueeze(0)
    return torch.where(target_token_mask.view(1, -1, 1), real, zero)


def check_target_token_mask(mask: torch.Tensor | None, x: torch.Tensor) -> None:
    """None, or a bool ``[L]`` tensor on x's device (diffusers' ``torch.where`` needs bool)."""
    if mask is not None:
        check_tensor("target_token_mask", mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"target_token_mask must be a bool tensor, got dtype {mask.dtype}")
        if tuple(mask.shape) != (x.shape[1],):
            raise ValueError(f"target_token_mask must have shape [L] = [{x.shape[1]}], got {tuple(mask.shape)}")
        check_device("target_token_mask", mask, x)


def check_rows(name: str, p: torch.Tensor, x: torch.Tensor, mask: torch.Tensor | None) -> None:
    """A modulation chunk: ``[B, D]`` (``[B + 1, D]`` with a mask), unit stride in its last dimension."""
    check_same(name, p, x, "x")
    B, D = x.shape[0], x.shape[2]
    rows = B + 1 if mask is not None else B
    if p.dim() != 2 or tuple(p.shape) != (rows, D):
        why = " (B + 1 rows because target_token_mask is given)" if mask is not None else ""
        raise ValueError(f"{name} must have shape [{rows}, {D}]{why}, got {tuple(p.shape)}")
    if D > 1 and p.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dimension, got strides {p.stride()}")


def check_clip(clip_fp16: object) -> bool:
    if not isinstance(clip_fp16, bool):
        raise TypeError(f"clip_fp16 must be a bool, got {type(clip_fp16).__name__}")
    return clip_fp16


def clip_reference(h: torch.Tensor, clip_fp16: bool) -> torch.Tensor:
    """The block's ``if hidden_states.dtype == torch.float16: hidden_states.clip(-65504, 65504)``."""
    return h.clip(-65504, 65504) if clip_fp16 and h.dtype == torch.float16 else h


def row_stride(p: torch.Tensor) -> int:
    """Row stride of a [R, D] chunk (any value for a single row; 0 keeps the kernel's math simple)."""
    return p.stride(0) if p.shape[0] > 1 else 0
