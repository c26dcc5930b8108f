"""FP8 (e4m3) per-tensor static fake quantization of a LayerNorm input, as ModelOpt does it.

ModelOpt >= 0.44 turns each block ``nn.LayerNorm`` into a ``QuantLayerNorm`` whose enabled
``input_quantizer`` (``num_bits=(4, 3)``, ``axis=None``, calibrated ``amax``) fake-quantizes the
residual stream before the norm. ``bias_residual_layer_norm_scale_shift`` reproduces
``norm.input_quantizer(new_residual)`` inside the kernel from this small description.

Representation: :class:`Fp8PerTensorQuant` holds the quantizer's ``amax`` *tensor* (read on the
device by the kernel, so no host synchronisation and later recalibration is seen) and the formula
ModelOpt uses for the scales, which differs by path:

- ``"cuda_ext"``: ModelOpt's CUDA extension (used for CUDA inputs when it builds):
  ``scale = 448 / amax`` and ``inv = 1 / scale`` as true divisions;
- ``"eager"``: ModelOpt's torch fallback (CPU inputs, or no extension): Python's ``448 / t`` is
  ``t.reciprocal() * 448``, which can differ from the division in the last bit.

Both: ``amax <= 2**-24`` counts as 1, ``q = e4m3(x * scale) * inv`` computed in fp32 (e4m3 rounding to
nearest even, saturating at +-448, NaN kept) and rounded back to the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMULAS = ("auto", "cuda_ext", "eager")
QUANT_MODE = {"cuda_ext": 1, "eager": 2}
_ext_available: bool | None = None


def _modelopt_cuda_ext_available() -> bool:
    """Whether ModelOpt would use its CUDA extension for CUDA inputs (builds it once if needed)."""
    global _ext_available
    if _ext_available is None:
        try:
            from modelopt.torch.quantization.extensions import get_cuda_ext_fp8  # noqa: PLC0415

            _ext_available = get_cuda_ext_fp8(raise_if_failed=False) is not None
        except Exception:
            _ext_available = False
    return _ext_available


def modelopt_not_supported_reasons(quantizer) -> list[str]:
    """Why a ModelOpt quantizer is not an FP8 per-tensor static fake quantizer (empty: it is)."""
    r = []
    cls = type(quantizer)
    if not cls.__module__.startswith("modelopt."):
        return [f"{cls.__name__} is not a ModelOpt quantizer"]
    if cls.__name__ != "TensorQuantizer":
        r.append(f"{cls.__name__} is not a plain TensorQuantizer")
    if not getattr(quantizer, "is_enabled", False):
        r.append("quantizer is disabled")
    if getattr(quantizer, "num_bits", None) != (4, 3):
        r.append(f"num_bits {getattr(quantizer, 'num_bits', None)} is not FP8 e4m3 (4, 3)")
    if getattr(quantizer, "axis", None) is not None:
        r.append("not per-tensor (axis is set)")
    if getattr(quantizer, "block_sizes", None):
        r.append("block quantization")
    if not getattr(quantizer, "fake_quant", False):
        r.append("not fake quantization")
    if getattr(quantizer, "pre_quant_scale", None) is not None:
        r.append("pre_quant_scale is set")
    if getattr(quantizer, "_if_calib", False):
        r.append("calibration is running")
    if not getattr(quantizer, "_if_quant", True):
        r.append("quantization is switched off")
    if getattr(quantizer, "backend", None) is not None:
        r.append("custom backend")
    if getattr(quantizer, "_use_constant_amax", False):
        r.append("constant amax")
    if getattr(quantizer, "rotate_is_enabled", False):
        r.append("rotation enabled")
    if getattr(quantizer, "_bias_calibrator", None) is not None or getattr(quantizer, "bias", None) is not None:
        r.append("quantizer has a bias")
    amax = getattr(quantizer, "_amax", None)
    if not isinstance(amax, torch.Tensor):
        r.append("no static amax (dynamic quantization)")
    elif amax.numel() != 1:
        r.append("amax is not a single value")
    return r


@dataclass(frozen=True)
class Fp8PerTensorQuant:
    """FP8 e4m3 per-tensor fake quantization with a static ``amax`` (see module docstring)."""

    amax: torch.Tensor
    formula: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.amax, torch.Tensor) or self.amax.numel() != 1:
            raise ValueError("norm_input_quant.amax must be a tensor holding one value")
        if not self.amax.is_floating_point():
            raise TypeError(f"norm_input_quant.amax must be floating point, got {self.amax.dtype}")
        if self.formula not in FORMULAS:
            raise ValueError(f"norm_input_quant.formula must be one of {FORMULAS}, got {self.formula!r}")

    @classmethod
    def from_modelopt(cls, quantizer) -> Fp8PerTensorQuant:
        reasons = modelopt_not_supported_reasons(quantizer)
        if reasons:
            raise ValueError("norm_input_quant: unsupported ModelOpt quantizer: " + "; ".join(reasons))
        return cls(amax=quantizer._amax, formula="auto")

    def formula_for(self, device: torch.device) -> str:
        if self.formula != "auto":
            return self.formula
        if device.type == "cuda" and _modelopt_cuda_ext_available():
            return "cuda_ext"
        return "eager"

    def amax_fp32(self, device: torch.device) -> torch.Tensor:
        a = self.amax.detach()
        if a.device != device:
            a = a.to(device)
        if a.dtype != torch.float32:
            a = a.float()
        return a.reshape(())

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Exactly what ModelOpt's quantizer returns for ``x`` (torch ops)."""
        amax = self.amax_fp32(x.device)
        safe = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
        if self.formula_for(x.device) == "cuda_ext":
            scale = torch.full_like(safe, 448.0).div_(safe)
            inv = torch.full_like(scale, 1.0).div_(scale)
        else:
            scale = safe.reciprocal() * 448.0
            inv = scale.reciprocal() * 1.0
        q = (x.to(torch.float32) * scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn)
        return (q.to(torch.float32) * inv).to(x.dtype)


def as_fp8_quant(norm_input_quant) -> Fp8PerTensorQuant | None:
    """Normalise the ``norm_input_quant`` argument (None, Fp8PerTensorQuant or a ModelOpt quantizer)."""
    if norm_input_quant is None or isinstance(norm_input_quant, Fp8PerTensorQuant):
        return norm_input_quant
    if type(norm_input_quant).__module__.startswith("modelopt."):
        return Fp8PerTensorQuant.from_modelopt(norm_input_quant)
    raise TypeError(
        "norm_input_quant must be None, an Fp8PerTensorQuant or a ModelOpt TensorQuantizer, got "
        f"{type(norm_input_quant).__name__}"
    )
