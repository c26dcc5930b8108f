"""What the checked-once ``launch`` of every row-wise fused op shares (one block per [B, L] row): :class:`Kernels`.

The launches compute the structs' ``vec_flags`` inline and stay small (host cost), the same bits everywhere (1:
activation rows, 2: shift rows, 4: scale rows, 8: gate rows, 16: bias vector-aligned)."""

import math

import torch

from . import _runtime as rt
from ._validate import SUPPORTED_DTYPES, check_device

ptr = rt.ptr
# LayerNorm mode -> (threads per row, elements per slot): 0 is PyTorch's vectorized path, 1 its rowwise path; the
# kernel takes the one eager PyTorch would take for the same input
LN_MODES = {0: (128, 4), 1: (512, 1)}
NV_CHOICES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
NVFP4_BLOCK = 16  # elements under one NVFP4 scale


def pick_nv(per_thread: int, choices: tuple[int, ...] = NV_CHOICES) -> int:
    """The smallest register-slot count that holds ``per_thread`` slots (0: streaming variant)."""
    return next((nv for nv in choices if nv >= per_thread), 0)


def layout(D: int, vectorized: bool) -> tuple[int, int, int, int]:
    """(mode, threads, elements per slot, slots per thread) of a LayerNorm row of ``D`` elements; ``vectorized``:
    eager PyTorch would take its vectorized path (4-element aligned input), which also needs D % 4 == 0."""
    mode = 0 if (vectorized and D % 4 == 0) else 1
    threads, ch = LN_MODES[mode]
    return mode, threads, ch, pick_nv(math.ceil((D // ch) / threads))


def require_plain(*ts: torch.Tensor) -> None:
    """A DTensor / AsyncCollectiveTensor passes isinstance checks, but its data_ptr is not the data."""
    for t in ts:
        if type(t) is not torch.Tensor:
            raise TypeError("qwen_absorb kernels take plain tensors; got " + ", ".join(type(u).__name__ for u in ts))


def outputs(x: torch.Tensor, reads: tuple[torch.Tensor, ...], *, new_residual: bool = False, out: bool = True,
            codes: bool = False, nvfp4: bool = False) -> tuple[torch.Tensor | None, ...]:
    """A launch's ``([new_residual,] out, second)`` (None where not asked for), once the tensors its kernel ``reads``
    are known plain. ``second``: the e4m3 codes of the output or its NVFP4 fake quantization in x's dtype."""
    require_plain(*reads)
    o = torch.empty_like(x) if out else None
    f8 = (torch.empty_like(x) if nvfp4
          else torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if codes else None)
    return (torch.empty_like(x), o, f8) if new_residual else (o, f8)


def emit_reasons(D: int) -> list[str]:
    """Why a fused kernel cannot emit NVFP4 values (``nvfp4_amax``) for rows of ``D`` elements (empty: it can): a
    16-element block sits in adjacent lanes and must not straddle two rows."""
    return [] if D % NVFP4_BLOCK == 0 else [f"D = {D} is not a multiple of 16 (NVFP4 blocks of a fused output)"]


def check_emit(x: torch.Tensor, fp8_amax: torch.Tensor | None, nvfp4_amax: torch.Tensor) -> None:
    """The checks of a launcher asked for an NVFP4 second output (only that path pays for them)."""
    if fp8_amax is not None:
        raise ValueError("fp8_amax and nvfp4_amax are exclusive: a kernel emits e4m3 codes or NVFP4 values, not both")
    why = emit_reasons(x.shape[-1])
    if why:
        raise ValueError(f"nvfp4_amax: {why[0]}; quantize the output with quantize_nvfp4 instead")
    if not isinstance(nvfp4_amax, torch.Tensor) or nvfp4_amax.dtype != torch.float32 or nvfp4_amax.numel() != 1:
        raise TypeError("nvfp4_amax must be a one-element float32 tensor (the kernels read one fp32 value)")
    check_device("nvfp4_amax", nvfp4_amax, x)
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; NVFP4 emission supports bfloat16, float16, float32")


def index_kind(index: torch.Tensor | None) -> int:
    """The kernels' index_kind: the element size of a 0/1 index, 0 without one."""
    return index.element_size() if index is not None else 0


def contiguous_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


def amax_fp32(a: torch.Tensor | None) -> torch.Tensor | None:
    """A per-tensor amax as the kernels read it: one fp32 element (or None)."""
    return a.detach().float().reshape(1) if a is not None else None


class Kernels:
    """The template ``name<traits, A, NV>`` of ``csrc/cu`` whose parameter struct is ``layout``, one compiled
    launcher per (dtype, D, variant, device). LayerNorm kernels (:meth:`ln`): A is the mode of :func:`layout`; with
    ``nvfp4=True`` the NVFP4-emitting ``name<traits, A, NV, 1>`` too. Elementwise kernels (:meth:`vec`): A is the
    vector width (16 bytes, or 1 where D does not divide), ``threads`` per row."""

    __slots__ = ("cu", "name", "layout", "threads", "nv_choices", "nvfp4", "_cache")

    def __init__(self, cu: str, name: str, layout: str, threads: int = 0, nv_choices: tuple[int, ...] = NV_CHOICES,
                 nvfp4: bool = False):
        self.cu, self.name, self.layout = cu, name, layout
        self.threads, self.nv_choices, self.nvfp4 = threads, nv_choices, nvfp4
        self._cache: dict[tuple, tuple[rt.Launcher, int]] = rt.register_cache({})

    def _compile(self, key: tuple, x: torch.Tensor, a: int, nv: int, threads: int, nbytes: int, nvfp4: bool = False):
        fn = rt.function(self.cu, rt.template(self.name, rt.TRAITS[x.dtype], a, nv, optional=int(nvfp4)), key[-1])
        return self._cache.setdefault(key, (rt.Launcher(fn, threads, self.layout, key[-1]), nbytes))

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

    def start(self, x: torch.Tensor, reads: tuple[torch.Tensor, ...], out: bool, fp8_amax: torch.Tensor | None,
              nvfp4_amax: torch.Tensor | None, fresh: bool, new_residual: bool = False) -> tuple[tuple, tuple | None]:
        """A LayerNorm launch's :func:`outputs` and, unless x is empty, ``(launcher, slot bytes, second output's
        amax)`` (``fp8_amax`` and ``nvfp4_amax`` are exclusive: one struct field). Eager's norm takes PyTorch's
        vectorized path on a ``fresh`` (allocated, aligned) input, else as x's alignment says (rowwise if not)."""
        q4 = nvfp4_amax is not None
        if q4:
            check_emit(x, fp8_amax, nvfp4_amax)
        outs = outputs(x, reads, new_residual=new_residual, out=out, codes=fp8_amax is not None, nvfp4=q4)
        if x.numel() == 0:
            return outs, None
        launcher, a = self.ln(x, x.shape[2], fresh or x.data_ptr() % (4 * x.element_size()) == 0, q4)
        return outs, (launcher, a, nvfp4_amax if q4 else fp8_amax)

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
        return [(self.cu, rt.template(self.name, t, a, nv, optional=q)) for d, t in rt.TRAITS.items()
                for q in (0, 1)[:1 + self.nvfp4]
                for a in (LN_MODES if not self.threads else (1, 16 // d.itemsize)) for nv in (*self.nv_choices, 0)]
