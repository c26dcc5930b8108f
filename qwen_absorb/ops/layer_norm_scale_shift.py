"""layer_norm_scale_shift: ``LayerNorm(x) * (1 + scale) + shift`` (norm1 + modulation), one kernel.

Replaces ``img_norm1``/``txt_norm1`` followed by ``_modulate`` in QwenImageTransformerBlock.
:func:`layer_norm_scale_shift_fp8` also (or only) writes the FP8 e4m3 codes of that output for
the real FP8 GEMMs of to_q/to_k/to_v (see :mod:`qwen_absorb.ops.fp8`).

Layers, from the user down: the public functions validate everything; :func:`launch` is the
checked-once entry the patched block calls (arguments already known good); the custom op
``torch.ops.qwen_absorb.layer_norm_scale_shift`` is what ``torch.compile`` traces.
"""

from __future__ import annotations

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._layer_norm import LN_MODES, NV_CHOICES, layout
from ._modulation import expand_param, layer_norm
from ._validate import check_activation, check_amax, check_eps, check_index, check_param
from ._validate import param_rows as _as_rows
from .fp8 import quantize_fp8_reference

CU = "layer_norm_scale_shift.cu"


# LayerNormScaleShiftParams in the .cu: x, out, out_fp8, shift, scale, index, out_amax, amax
# (pointers); shift_rs, scale_rs, B, L (int64); D (int32), eps (float), index_kind, quant_mode,
# vec_flags (int32)
LAYOUT = "8P4qifiii"


# ---------------------------------------------------------------------------- references


def layer_norm_scale_shift_reference(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None,
) -> torch.Tensor:
    """The diffusers eager expression, op for op."""
    return layer_norm(x, eps) * (1 + expand_param(scale, index)) + expand_param(shift, index)


def layer_norm_scale_shift_fp8_reference(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, out)``: the eager output and the reference quantizer applied to it."""
    out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
    return quantize_fp8_reference(out, fp8_amax), out


# ---------------------------------------------------------------------------- the launcher


_fns: dict[tuple, object] = rt.register_cache({})


def launch(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
    *, out: bool = True, fp8_amax: torch.Tensor | None = None, amax: torch.Tensor | None = None,
    quant_mode: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(out or None, e4m3 codes or None)``; arguments already validated.

    x: contiguous [B, L, D] on a usable CUDA device; shift/scale rows with unit last stride;
    index contiguous; fp8_amax fp32 with one element on x's device; amax/quant_mode: the norm-input
    fake quantizer (:class:`~qwen_absorb.ops.fp8.Fp8PerTensorQuant`'s amax and mode), or 0.
    """
    if type(x) is not torch.Tensor:  # a DTensor / AsyncCollectiveTensor: its data_ptr is not the data
        raise TypeError("qwen_absorb kernels take plain tensors; got " + ", ".join(type(t).__name__ for t in (x,)))
    B, L, D = x.shape
    o = torch.empty_like(x) if out else None
    f8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device) if fp8_amax is not None else None
    if x.numel() == 0:
        return o, f8
    esize = x.element_size()
    # eager's norm1 sees x itself (a misaligned x sends PyTorch down its rowwise path), or the
    # fresh, aligned output of the norm's input quantizer
    xp = x.data_ptr()
    vectorized = quant_mode != 0 or xp % (4 * esize) == 0
    dev = x.get_device()
    key = (x.dtype, D, vectorized, dev)
    hit = _fns.get(key)
    if hit is None:
        mode, threads, ch, nv = layout(D, vectorized)
        fn = rt.function(CU, f"layer_norm_scale_shift_kernel<{rt.TRAITS[x.dtype]}, {mode}, {nv}>", dev)
        hit = _fns[key] = (rt.Launcher(fn, threads, LAYOUT, dev), ch * esize)
    launcher, a = hit
    srs, crs = shift.stride(0), scale.stride(0)
    sp, cp = shift.data_ptr(), scale.data_ptr()
    flags = (xp % a == 0) | (((sp | srs * esize) % a == 0) << 1) | (((cp | crs * esize) % a == 0) << 2)
    launcher(
        B * L, xp, o.data_ptr() if o is not None else 0, f8.data_ptr() if f8 is not None else 0, sp, cp,
        index.data_ptr() if index is not None else 0, fp8_amax.data_ptr() if fp8_amax is not None else 0,
        amax.data_ptr() if amax is not None else 0, srs, crs, B, L, D, eps,
        index.element_size() if index is not None else 0, quant_mode, flags,
    )
    return o, f8


def all_kernel_expressions() -> list[tuple[str, str]]:
    """Every template instance :func:`launch` can ask for (the compile test builds them all)."""
    return [
        (CU, f"layer_norm_scale_shift_kernel<{t}, {mode}, {nv}>")
        for t in rt.TRAITS.values() for mode in LN_MODES for nv in (*NV_CHOICES, 0)
    ]


# ---------------------------------------------------------------------------- public ops


def _validate(x, shift, scale, eps, index, fp8_amax=None) -> float:
    check_activation("x", x)
    eps = check_eps(eps)
    check_index(index, x)
    check_param("shift", shift, x, index)
    check_param("scale", scale, x, index)
    if fp8_amax is not None:
        check_amax("fp8_amax", fp8_amax, x)
    return eps


def layer_norm_scale_shift_not_supported_reasons(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(x, shift, scale, eps, index)
    return common_reasons([x, shift, scale], force_reference)


def layer_norm_scale_shift(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, force_reference: bool = False,
) -> torch.Tensor:
    """``LayerNorm(x, eps, no affine) * (1 + scale) + shift``, fused on CUDA.

    x: [B, L, D]; shift, scale: [B, D] or [B, 1, D] (2B rows with ``index`` [B, L] of 0/1).
    """
    eps = _validate(x, shift, scale, eps, index)
    return dispatch(
        common_reasons([x, shift, scale], force_reference),
        lambda: layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index),
        lambda: torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index, None)[0],
        lambda: launch(x.contiguous(), _as_rows(shift), _as_rows(scale), eps, _contig(index))[0],
    )


def layer_norm_scale_shift_fp8(
    x: torch.Tensor, *, shift: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, also_output: bool = False, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(codes, out)``: the e4m3 codes of :func:`layer_norm_scale_shift`'s output under a per-tensor
    ``fp8_amax`` (bit-identical to that output followed by the reference quantizer), and the output
    itself when ``also_output`` (else None: the kernel skips writing it)."""
    eps = _validate(x, shift, scale, eps, index, fp8_amax)

    def reference():
        codes, out = layer_norm_scale_shift_fp8_reference(
            x, shift=shift, scale=scale, fp8_amax=fp8_amax, eps=eps, index=index)
        return codes, (out if also_output else None)

    def compiled():
        out, codes = torch.ops.qwen_absorb.layer_norm_scale_shift(x, shift, scale, eps, index, fp8_amax)
        return codes, (out if also_output else None)

    def kernel():
        out, codes = launch(x.contiguous(), _as_rows(shift), _as_rows(scale), eps, _contig(index),
                            out=also_output, fp8_amax=fp8_amax.float().reshape(1))
        return codes, out

    return dispatch(common_reasons([x, shift, scale], force_reference), reference, compiled, kernel)


def _contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.contiguous() if t is not None else None


# ---------------------------------------------------------------------------- custom op


@torch.library.custom_op("qwen_absorb::layer_norm_scale_shift", mutates_args=())
def _custom_op(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, index: torch.Tensor | None,
    fp8_amax: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque to the compiler; picks the kernel or the reference when it runs. Always returns
    ``(out, codes)`` (codes empty when ``fp8_amax`` is None: custom ops need fixed output types)."""
    if kernel_usable_now(x):
        out, codes = launch(x.contiguous(), _as_rows(shift), _as_rows(scale), eps, _contig(index),
                            fp8_amax=None if fp8_amax is None else fp8_amax.float().reshape(1))
    else:
        out = layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=eps, index=index)
        codes = quantize_fp8_reference(out, fp8_amax) if fp8_amax is not None else None
    return out, codes if codes is not None else x.new_empty(0, dtype=torch.float8_e4m3fn)


@_custom_op.register_fake
def _(x, shift, scale, eps, index, fp8_amax):
    codes = torch.empty(x.shape if fp8_amax is not None else (0,), dtype=torch.float8_e4m3fn, device=x.device)
    return torch.empty_like(x, memory_format=torch.contiguous_format), codes
