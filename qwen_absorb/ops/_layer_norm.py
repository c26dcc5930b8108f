"""Launch layout shared by the two LayerNorm kernels (csrc/layer_norm.cuh explains the modes)."""

from __future__ import annotations

import math

# mode -> (threads per row, elements per slot). Mode 0 is PyTorch's vectorized LayerNorm path,
# mode 1 its rowwise path; the kernel takes the one eager PyTorch would take for the same input.
LN_MODES = {0: (128, 4), 1: (512, 1)}
NV_CHOICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def pick_nv(per_thread: int, choices: tuple[int, ...] = NV_CHOICES) -> int:
    """The smallest register-slot count that holds ``per_thread`` slots (0: streaming variant)."""
    return next((nv for nv in choices if nv >= per_thread), 0)


def layout(D: int, vectorized: bool) -> tuple[int, int, int, int]:
    """(mode, threads, elements per slot, slots per thread) for rows of ``D`` elements. ``vectorized``: whether
    eager PyTorch would take its vectorized path for this input (4-element aligned); it also needs D % 4 == 0."""
    mode = 0 if (vectorized and D % 4 == 0) else 1
    threads, ch = LN_MODES[mode]
    return mode, threads, ch, pick_nv(math.ceil((D // ch) / threads))
