"""What the checked-once ``launch`` of every row-wise fused op shares (one block per [B, L] row).

An op's :class:`Kernels` names its ``csrc`` file, template and parameter struct, caches one compiled
:class:`~qwen_absorb.ops._runtime.Launcher` per (dtype, D, variant, device) and lists every template instance for
the compile test. The launches compute the structs' ``vec_flags`` inline, the same bits everywhere (1: activation
rows, 2: shift rows, 4: scale rows, 8: gate rows, 16: bias vector-aligned), and stay small (host cost).
"""

from __future__ import annotations

import math

import torch

from . import _runtime as rt
from ._layer_norm import LN_MODES, NV_CHOICES, layout, pick_nv

ptr = rt.ptr


def require_plain(*ts: torch.Tensor) -> None:
    """A DTensor / AsyncCollectiveTensor passes isinstance checks, but its data_ptr is not the data."""
    for t in ts:
        if type(t) is not torch.Tensor:
            raise TypeError("qwen_absorb kernels take plain tensors; got " + ", ".join(type(u).__name__ for u in ts))


def outputs(x: torch.Tensor, reads: tuple[torch.Tensor, ...], *, new_residual: bool = False, out: bool = True,
            codes: bool = False, nvfp4: bool = False) -> tuple[torch.Tensor | None, ...]:
    """A launch's outputs, once the tensors its kernel ``reads`` are known plain: ``(new_residual, out, second)``
    with ``new_residual``, else ``(out, second)``; None where not asked for. ``second``: the e4m3 codes of the output
    (``codes``) or its NVFP4 fake quantization in x's dtype (``nvfp4``: ``quantize_nvfp4.launch(out, nvfp4_amax)``)."""
    for t in reads:
        if type(t) is not torch.Tensor:
            require_plain(*reads)  # raises, naming them
    o = torch.empty_like(x) if out else None
    if nvfp4:
        f8 = torch.empty_like(x)
    else:
        f8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if codes else None
    return (torch.empty_like(x), o, f8) if new_residual else (o, f8)


def index_kind(index: torch.Tensor | None) -> int:
    """The kernels' index_kind: the element size of a 0/1 index, 0 without one."""
    return index.element_size() if index is not None else 0


def contiguous_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


def amax_fp32(a: torch.Tensor | None) -> torch.Tensor | None:
    """A per-tensor amax as the kernels read it: one fp32 element (or None)."""
    return a.float().reshape(1) if a is not None else None


def codes_or_empty(codes: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """A custom op's codes output: the codes, or an empty e4m3 tensor (custom ops need fixed output types)."""
    return codes if codes is not None else x.new_empty(0, dtype=torch.float8_e4m3fn)


def fake_codes(x: torch.Tensor, fp8_amax: torch.Tensor | None) -> torch.Tensor:
    """What a custom op's fake returns for its codes output."""
    return torch.empty(x.shape if fp8_amax is not None else (0,), dtype=torch.float8_e4m3fn, device=x.device)


class Kernels:
    """The template ``name<traits, A, NV>`` of ``csrc/cu`` whose parameter struct is ``layout``. LayerNorm kernels
    (:meth:`ln`): A is the mode of :func:`._layer_norm.layout`; with ``nvfp4=True`` the NVFP4-emitting instance
    ``name<traits, A, NV, 1>`` exists too. Elementwise kernels (:meth:`vec`): A is the vector width (16 bytes, or 1
    where D does not divide), ``threads`` per row."""

    __slots__ = ("cu", "name", "layout", "threads", "nv_choices", "nvfp4", "_cache")

    def __init__(self, cu: str, name: str, layout: str, threads: int = 0, nv_choices: tuple[int, ...] = NV_CHOICES,
                 nvfp4: bool = False):
        self.cu, self.name, self.layout = cu, name, layout
        self.threads, self.nv_choices, self.nvfp4 = threads, nv_choices, nvfp4
        self._cache: dict[tuple, tuple[rt.Launcher, int]] = rt.register_cache({})

    def _expression(self, traits: str, a: int, nv: int, nvfp4: bool) -> str:
        # the plain instance keeps the three-argument name (the template's default NVFP4 = 0)
        return f"{self.name}<{traits}, {a}, {nv}, 1>" if nvfp4 else f"{self.name}<{traits}, {a}, {nv}>"

    def _compile(self, key: tuple, x: torch.Tensor, a: int, nv: int, threads: int, nbytes: int, nvfp4: bool = False):
        dev = key[-1]
        fn = rt.function(self.cu, self._expression(rt.TRAITS[x.dtype], a, nv, nvfp4), dev)
        hit = self._cache[key] = (rt.Launcher(fn, threads, self.layout, dev), nbytes)
        return hit

    def ln(self, x: torch.Tensor, D: int, vectorized: bool, nvfp4: bool = False) -> tuple[rt.Launcher, int]:
        """(launcher, bytes of one slot) of the LayerNorm kernel for rows of D elements; ``vectorized``: whether
        eager PyTorch takes its vectorized path; ``nvfp4``: the instance whose second output is NVFP4 values."""
        key = (x.dtype, D, vectorized, nvfp4, x.get_device())
        hit = self._cache.get(key)
        if hit is None:
            if nvfp4 and not self.nvfp4:
                raise ValueError(f"{self.name} has no NVFP4 instance")
            mode, threads, ch, nv = layout(D, vectorized)
            hit = self._compile(key, x, mode, nv, threads, ch * x.element_size(), nvfp4)
        return hit

    def vec(self, x: torch.Tensor, D: int) -> tuple[rt.Launcher, int]:
        """(launcher, bytes of one vector) of the elementwise kernel for x's rows of D elements."""
        key = (x.dtype, D, x.get_device())
        hit = self._cache.get(key)
        if hit is None:
            esize = x.element_size()
            vec = 16 // esize if D % (16 // esize) == 0 else 1
            nv = pick_nv(math.ceil((D // vec) / self.threads), self.nv_choices)
            hit = self._compile(key, x, vec, nv, self.threads, vec * esize)
        return hit

    def expressions(self) -> list[tuple[str, str]]:
        """Every template instance :meth:`ln` or :meth:`vec` can ask for (the compile test builds them)."""
        out = []
        for dtype, t in rt.TRAITS.items():
            widths = LN_MODES if not self.threads else (1, 16 // torch.empty(0, dtype=dtype).element_size())
            out += [(self.cu, self._expression(t, a, nv, q)) for q in (False, True)[:1 + self.nvfp4]
                    for a in widths for nv in (*self.nv_choices, 0)]
        return out
