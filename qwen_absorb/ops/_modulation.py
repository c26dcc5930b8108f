"""Torch helpers shared by the references: diffusers' per-sample / per-token parameter selection."""

from __future__ import annotations

import torch

from ._validate import param_rows


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
