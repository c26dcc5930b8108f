"""FP8 (e4m3fn) per-tensor quantization the ops take, under a static ``amax`` tensor on the device (no host sync).

- :class:`Fp8PerTensorQuant`: the *fake* quantization ModelOpt's ``QuantLayerNorm.input_quantizer`` applies before a
  block LayerNorm. ``formula``: ``"cuda_ext"`` (its CUDA extension: ``448 / amax`` and ``1 / scale`` as true
  divisions) or ``"eager"`` (its torch fallback: ``t.reciprocal() * 448``, which can differ in the last bit).
- FP8 *emission* (``*_fp8`` ops, :func:`quantize_fp8`): the e4m3 codes a real FP8 GEMM consumes, by the
  ``"cuda_ext"`` formula; the GEMM dequantizes by :func:`dequant_scale`.

Everywhere ``amax <= 2**-24`` counts as 1; codes are ``e4m3(x * scale)`` in fp32, round to nearest even, clamped to
+-448 first (PyTorch's conversion turns out-of-range values into NaN), NaN stays NaN."""

from dataclasses import dataclass, field

import torch

FORMULAS = ("auto", "cuda_ext", "eager")
QUANT_MODE = {"cuda_ext": 1, "eager": 2}
E4M3_MAX = 448.0
_TINY = 1.0 / (1 << 24)


def _amax32(amax: torch.Tensor, device: torch.device) -> torch.Tensor:
    a = amax.detach().to(device=device, dtype=torch.float32).reshape(())  # no copy where it already is
    return torch.where(a <= _TINY, torch.ones_like(a), a)


def quant_scale(amax: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``448 / amax`` (fp32 division; the "cuda_ext" formula), a 0-d fp32 tensor."""
    a = _amax32(amax, device if device is not None else amax.device)
    return torch.full_like(a, E4M3_MAX).div_(a)


def dequant_scale(amax: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """``amax / 448``: what ``torch._scaled_mm`` multiplies the FP8 products by (1-element fp32)."""
    return (_amax32(amax, device if device is not None else amax.device) / E4M3_MAX).reshape(1)


def quantize_fp8_reference(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 codes of ``x`` under a per-tensor ``amax`` (see the module docstring)."""
    q = (x.to(torch.float32) * quant_scale(amax, x.device)).clamp(min=-E4M3_MAX, max=E4M3_MAX)
    return q.to(torch.float8_e4m3fn)


@dataclass(frozen=True)
class Fp8PerTensorQuant:
    """FP8 e4m3 per-tensor fake quantization with a static ``amax`` (see the module docstring)."""

    amax: torch.Tensor
    formula: str = "auto"
    _fp32: list = field(default_factory=list, compare=False, repr=False)  # [key, fp32 copy] (amax_fp32)

    def __post_init__(self) -> None:
        if not isinstance(self.amax, torch.Tensor) or self.amax.numel() != 1:
            raise ValueError("norm_input_quant.amax must be a tensor holding one value")
        if not self.amax.is_floating_point():
            raise TypeError(f"norm_input_quant.amax must be floating point, got {self.amax.dtype}")
        if self.formula not in FORMULAS:
            raise ValueError(f"norm_input_quant.formula must be one of {FORMULAS}, got {self.formula!r}")

    def formula_for(self, device: torch.device) -> str:
        """The formula in force on ``device``: ``"auto"`` is ModelOpt's default by device type
        (:func:`qwen_absorb.quant.norm_input_fp8` passes the one ModelOpt really uses)."""
        return self.formula if self.formula != "auto" else "cuda_ext" if device.type == "cuda" else "eager"

    def amax_fp32(self, device: torch.device) -> torch.Tensor:
        """The amax as the kernels read it: a 0-d fp32 tensor on ``device``. Another dtype or device is converted
        once per value: the copy is kept while the amax keeps its version and address (an in-place recalibration
        bumps the version; an inference tensor, which has none, is converted each call)."""
        a = self.amax.detach()
        if a.device == device and a.dtype == torch.float32:
            return a.reshape(())
        try:
            key = (a._version, a.data_ptr(), device)
        except RuntimeError:  # inference tensors have no version counter
            return a.to(device=device, dtype=torch.float32).reshape(())
        c = self._fp32
        if not c or c[0] != key:
            c[:] = [key, a.to(device=device, dtype=torch.float32).reshape(())]
        return c[1]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Exactly what ModelOpt's quantizer returns for ``x`` (torch ops)."""
        if self.formula_for(x.device) == "cuda_ext":
            scale = quant_scale(self.amax, x.device)
            inv = torch.full_like(scale, 1.0).div_(scale)
        else:
            scale = _amax32(self.amax, x.device).reciprocal() * E4M3_MAX
            inv = scale.reciprocal() * 1.0
        q = (x.to(torch.float32) * scale).clamp(min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn)
        return (q.to(torch.float32) * inv).to(x.dtype)


def quant_args(quant: Fp8PerTensorQuant | None, device: torch.device) -> tuple[torch.Tensor | None, int]:
    """A norm-input quantizer as the kernels take it: ``(amax_fp32, quant_mode)``, ``(None, 0)`` without one."""
    return (quant.amax_fp32(device), QUANT_MODE[quant.formula_for(device)]) if quant is not None else (None, 0)


def check_norm_input_quant(norm_input_quant: object) -> Fp8PerTensorQuant | None:
    if norm_input_quant is None or isinstance(norm_input_quant, Fp8PerTensorQuant):
        return norm_input_quant
    raise TypeError("norm_input_quant must be None or an Fp8PerTensorQuant (qwen_absorb.quant.norm_input_fp8 builds "
                    f"one from a ModelOpt quantizer), got {type(norm_input_quant).__name__}")
