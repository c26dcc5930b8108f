"""bias_residual_layer_norm_scale_shift: the attention residual, norm2 and its modulation, one kernel.

    new_residual = residual + gate * (x + bias)
    modulated    = LayerNorm(Q(new_residual)) * (1 + scale) + shift

``x`` is ``to_out[0]`` / ``to_add_out``'s output without its bias when the bias is deferred (``bias`` given), or with
it (``bias=None``). ``Q`` is the identity, or the FP8 fake quantization of ModelOpt's ``QuantLayerNorm`` before the
norm (``norm_input_quant``, an :class:`~.fp8.Fp8PerTensorQuant`); ``new_residual`` is never quantized. The ``_fp8``
variant also (or only) writes the e4m3 codes of ``modulated`` for a real FP8 ``net[0].proj``."""

import torch

from ._eligibility import common_reasons, custom_op_result, dispatch, dispatch_fp8, fake_outputs
from ._launch import Kernels, amax_fp32, contiguous_or_none, index_kind, ptr
from ._validate import check_bias, check_eps, check_fp8_amax, check_index, check_param, check_residual
from ._validate import param_rows as _rows
from .bias_gate_residual import bias_gate_residual_reference
from .fp8 import FORMULAS, Fp8PerTensorQuant, check_norm_input_quant, quant_args
from .layer_norm_scale_shift import layer_norm_scale_shift_reference

# BiasResidualLayerNormScaleShiftParams in the .cu: residual, x, bias, gate, shift, scale, new_residual, out, out2,
# index, amax, out2_amax (pointers); gate_rs, shift_rs, scale_rs, B, L (int64); D (int32), eps (float), index_kind,
# quant_mode, vec_flags (int32)
KERNELS = Kernels("bias_residual_layer_norm_scale_shift.cu", "bias_residual_layer_norm_scale_shift_kernel",
                  "12P5qifiii", nvfp4=True)
all_kernel_expressions = KERNELS.expressions


def bias_residual_layer_norm_scale_shift_reference(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, index: torch.Tensor | None = None,
    norm_input_quant: Fp8PerTensorQuant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The diffusers eager expressions, op for op (the bias added the way a separate add would)."""
    new_residual = bias_gate_residual_reference(residual, x, bias=bias, gate=gate, index=index)
    normed_in = norm_input_quant.reference(new_residual) if norm_input_quant is not None else new_residual
    return new_residual, layer_norm_scale_shift_reference(normed_in, shift=shift, scale=scale, eps=eps, index=index)


def launch(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, shift: torch.Tensor,
    scale: torch.Tensor, eps: float, index: torch.Tensor | None, amax: torch.Tensor | None, quant_mode: int,
    *, out: bool = True, fp8_amax: torch.Tensor | None = None, nvfp4_amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checked-once entry: ``(new_residual, modulated or None, second or None)`` (as in
    :func:`.layer_norm_scale_shift.launch`); residual, x: contiguous [B, L, D]; gate rows like shift's."""
    # eager's norm2 sees a freshly allocated tensor
    (h, o, f8), run = KERNELS.start(x, (x, residual), out, fp8_amax, nvfp4_amax, True, new_residual=True)
    if run is None:
        return h, o, f8
    launcher, a, amax2 = run
    B, L, D = x.shape
    esize, grs, srs, crs, bp = x.element_size(), gate.stride(0), shift.stride(0), scale.stride(0), ptr(bias)
    xp, rp, gp, sp, cp = x.data_ptr(), residual.data_ptr(), gate.data_ptr(), shift.data_ptr(), scale.data_ptr()
    flags = (((xp | rp) % a == 0) | (((sp | srs * esize) % a == 0) << 1) | (((cp | crs * esize) % a == 0) << 2)
             | (((gp | grs * esize) % a == 0) << 3) | ((bp % a == 0) << 4))
    launcher(B * L, rp, xp, bp, gp, sp, cp, h.data_ptr(), ptr(o), ptr(f8), ptr(index), ptr(amax), ptr(amax2),
             grs, srs, crs, B, L, D, eps, index_kind(index), quant_mode, flags)
    return h, o, f8


def _checked(residual, x, bias, gate, shift, scale, eps, index, norm_input_quant, force_reference, fp8_amax=None):
    check_residual(residual, x)
    eps = check_eps(eps)
    check_index(index, x)
    check_bias(bias, x)
    check_param("gate", gate, x, index)
    check_param("shift", shift, x, index)
    check_param("scale", scale, x, index)
    quant = check_norm_input_quant(norm_input_quant)
    if quant is not None and quant.amax.device != x.device:
        raise ValueError(f"norm_input_quant.amax is on {quant.amax.device} but x is on {x.device}")
    check_fp8_amax(fp8_amax, x)
    return eps, quant, common_reasons([x, residual, bias, gate, shift, scale], force_reference)


def _kernel(residual, x, bias, gate, shift, scale, eps, index, amax, mode, out=True, fp8_amax=None):
    return launch(residual.contiguous(), x.contiguous(), bias, _rows(gate), _rows(shift), _rows(scale), eps,
                  contiguous_or_none(index), amax, mode, out=out, fp8_amax=amax_fp32(fp8_amax))


def bias_residual_layer_norm_scale_shift_not_supported_reasons(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, index: torch.Tensor | None = None,
    norm_input_quant: Fp8PerTensorQuant | None = None, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    return _checked(residual, x, bias, gate, shift, scale, eps, index, norm_input_quant, force_reference)[2]


def bias_residual_layer_norm_scale_shift(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, index: torch.Tensor | None = None,
    norm_input_quant: Fp8PerTensorQuant | None = None, force_reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new_residual, modulated)`` (module docstring). residual, x: [B, L, D]; bias: [D] or None; gate, shift,
    scale: [B, D] or [B, 1, D] (2B rows with ``index`` [B, L] of 0/1); norm_input_quant: an Fp8PerTensorQuant."""
    return _dispatch(False, residual, x, bias, gate, shift, scale, eps, index, norm_input_quant, force_reference)


def bias_residual_layer_norm_scale_shift_fp8(
    residual: torch.Tensor, x: torch.Tensor, *, bias: torch.Tensor | None, gate: torch.Tensor,
    shift: torch.Tensor, scale: torch.Tensor, fp8_amax: torch.Tensor, eps: float = 1e-6,
    index: torch.Tensor | None = None, norm_input_quant: Fp8PerTensorQuant | None = None,
    also_output: bool = False, force_reference: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(new_residual, codes, modulated or None)``: :func:`bias_residual_layer_norm_scale_shift` plus the e4m3
    codes of ``modulated`` under ``fp8_amax`` (as the reference quantizer's); ``modulated`` with ``also_output``."""
    return _dispatch(True, residual, x, bias, gate, shift, scale, eps, index, norm_input_quant, force_reference,
                     fp8_amax, also_output)


def _dispatch(fp8, residual, x, bias, gate, shift, scale, eps, index, norm_input_quant, force_reference,
              fp8_amax=None, also_output=False):
    eps, quant, reasons = _checked(residual, x, bias, gate, shift, scale, eps, index, norm_input_quant,
                                   force_reference, fp8_amax)
    op = torch.ops.qwen_absorb.bias_residual_layer_norm_scale_shift

    def args(*more):  # the custom op's and _kernel's leading arguments (no amax conversion on the reference path)
        return (residual, x, bias, gate, shift, scale, eps, index, *quant_args(quant, x.device), *more)

    def reference():
        return bias_residual_layer_norm_scale_shift_reference(
            residual, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=eps, index=index, norm_input_quant=quant)

    if not fp8:
        return dispatch(reasons, reference, lambda: op(*args(None))[:2], lambda: _kernel(*args())[:2])
    return dispatch_fp8(reasons, fp8_amax, also_output, reference, lambda: op(*args(fp8_amax)),
                        lambda out: _kernel(*args(out, fp8_amax)))


@torch.library.custom_op("qwen_absorb::bias_residual_layer_norm_scale_shift", mutates_args=())
def _custom_op(
    residual: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gate: torch.Tensor, shift: torch.Tensor,
    scale: torch.Tensor, eps: float, index: torch.Tensor | None, amax: torch.Tensor | None, quant_mode: int,
    fp8_amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return custom_op_result(
        x, fp8_amax,
        lambda: _kernel(residual, x, bias, gate, shift, scale, eps, index, amax, quant_mode, fp8_amax=fp8_amax),
        lambda: bias_residual_layer_norm_scale_shift_reference(
            residual, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=eps, index=index,
            norm_input_quant=Fp8PerTensorQuant(amax, formula=FORMULAS[quant_mode]) if quant_mode else None))


_custom_op.register_fake(lambda residual, x, bias, gate, shift, scale, eps, index, amax, quant_mode, fp8_amax:
                         fake_outputs(x, 2, fp8_amax))
