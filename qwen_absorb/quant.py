"""Per-layer detection of ModelOpt quantization in a Qwen-Image block.

Detection is per module, never per model: configs exclude layers, AutoQuantize mixes formats, and
diffusers' ``NVIDIAModelOptConfig`` / ``hf_quantizer`` cannot be relied on (it raises with
modelopt >= 0.44), so nothing here reads model-level flags. A module counts as ModelOpt-quantized
when it carries a ModelOpt quantizer object, which is true however it was made: ``mtq.quantize``
(fake quant), ``mtq.compress`` (real-quant ``QTensorWrapper`` weights) or a restored checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from .ops.fp8 import Fp8PerTensorQuant, dequant_scale, quantize_fp8_reference
from .parallel import is_dtensor

FP8_E4M3 = "FP8_E4M3"
NVFP4 = "NVFP4"
MXFP4 = "MXFP4"
INT8 = "INT8"
INT4 = "INT4"
OTHER = "other"


def unwrap_peft(module: nn.Module) -> tuple[nn.Module, list[nn.Module]]:
    """``(innermost base layer, [wrappers outermost first])``; PEFT LoRA layers keep the original
    linear as ``.base_layer`` (possibly nested, e.g. a ModelOpt ``_QuantLoraLinear``)."""
    wrappers = []
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        wrappers.append(module)
        module = module.base_layer
    return module, wrappers


def is_modelopt_quantizer(q: Any) -> bool:
    return q is not None and type(q).__module__.startswith("modelopt.")


def _first_quantizer(q: Any) -> Any:
    # A SequentialQuantizer (e.g. W4A8) is an nn.Sequential of TensorQuantizers; the first one
    # sees the tensor first and names the storage format.
    if isinstance(q, nn.Sequential) and len(q) > 0:
        return q[0]
    return q


def quantizer_enabled(q: Any) -> bool:
    if not is_modelopt_quantizer(q):
        return False
    if isinstance(q, nn.Sequential):
        return any(bool(getattr(s, "is_enabled", False)) for s in q)
    return bool(getattr(q, "is_enabled", False))


def quantizer_format(q: Any) -> str | None:
    """FP8_E4M3 / NVFP4 / MXFP4 / INT8 / INT4 / other for an enabled ModelOpt quantizer, else None."""
    if not quantizer_enabled(q):
        return None
    q = _first_quantizer(q)
    bits = getattr(q, "num_bits", None)
    blocks = getattr(q, "block_sizes", None) or {}
    if bits == (4, 3):
        return FP8_E4M3
    if bits == (2, 1):
        scale_bits = blocks.get("scale_bits")
        if blocks.get(-1) == 16 and scale_bits == (4, 3):
            return NVFP4
        if scale_bits == (8, 0):
            return MXFP4
        return OTHER
    if bits == 8:
        return INT8
    if bits == 4:
        return INT4
    return OTHER


def fp8_quantizer_reasons(quantizer: Any) -> list[str]:
    """Why a ModelOpt quantizer is not an FP8 e4m3 per-tensor static fake quantizer (empty: it is)."""
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
        r.append("no static amax (dynamic quantization or not calibrated)")
    elif amax.numel() != 1:
        r.append("amax is not a single value")
    elif amax.device.type == "meta":
        r.append("amax is on the meta device (offloaded)")
    return r


def norm_input_fp8(quantizer: Any) -> tuple[Fp8PerTensorQuant | None, list[str]]:
    """The norm-input fake quantizer as the ops' :class:`Fp8PerTensorQuant` (holding the quantizer's
    own ``_amax`` tensor, so an in-place recalibration is seen), else ``(None, reasons)``."""
    r = fp8_quantizer_reasons(quantizer)
    if not getattr(quantizer, "fake_quant", False):
        r.append("not fake quantization")
    if r:
        return None, r
    return Fp8PerTensorQuant(amax=quantizer._amax, formula="auto"), []


@dataclass
class ProjectionInfo:
    """What one output projection (``to_out.0``, ``to_add_out``, ``net.2``) is."""

    name: str
    cls: str
    modelopt: bool = False
    weight_format: str | None = None
    input_format: str | None = None
    compressed: bool = False
    input_quantizer_enabled: bool = False
    output_quantizer_enabled: bool = False
    pre_quant_scale: bool = False
    peft_wrapped: bool = False
    lora_bias: bool = False
    has_bias: bool = False
    bias_holder_ok: bool = True  # the innermost module keeps its bias in _parameters["bias"]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lora_bias(wrapper: nn.Module) -> bool:
    # peft >= 0.14 keeps lora_bias as {adapter_name: bool}; a biased adapter adds its own bias,
    # which the projection's output then contains: deferring only the base bias stays correct,
    # but we refuse (conservative) since such adapters are rare and untested with deferral.
    lb = getattr(wrapper, "lora_bias", None)
    if isinstance(lb, dict):
        return any(bool(v) for v in lb.values())
    return bool(lb)


def inspect_projection(name: str, module: nn.Module) -> ProjectionInfo:
    base, wrappers = unwrap_peft(module)
    info = ProjectionInfo(name=name, cls=type(module).__name__, peft_wrapped=bool(wrappers))
    info.lora_bias = any(_lora_bias(w) for w in wrappers)
    # The quantizers may sit on the base layer (LoRA added after quantization) or on a ModelOpt-
    # converted PEFT wrapper (LoRA present at quantize time): take the outermost that has them.
    qmod = next((m for m in [*wrappers, base] if is_modelopt_quantizer(getattr(m, "weight_quantizer", None))), None)
    params = getattr(base, "_parameters", {})
    info.bias_holder_ok = "bias" in params
    info.has_bias = params.get("bias") is not None
    if qmod is None:
        return info
    wq = getattr(qmod, "weight_quantizer", None)
    iq = getattr(qmod, "input_quantizer", None)
    oq = getattr(qmod, "output_quantizer", None)
    info.modelopt = True
    info.cls = type(qmod).__name__ if qmod is module else f"{type(module).__name__}({type(qmod).__name__})"
    info.weight_format = quantizer_format(wq)
    info.input_format = quantizer_format(iq)
    info.input_quantizer_enabled = quantizer_enabled(iq)
    info.output_quantizer_enabled = quantizer_enabled(oq)
    info.pre_quant_scale = getattr(_first_quantizer(iq), "pre_quant_scale", None) is not None if iq is not None else False
    w = getattr(qmod, "_parameters", {}).get("weight")
    info.compressed = type(w).__name__ == "QTensorWrapper"
    if not quantizer_enabled(wq):
        info.notes.append("weight quantizer disabled")
    return info


@dataclass
class NormInfo:
    """A block LayerNorm (``img_norm1`` ...): plain, or a ModelOpt ``QuantLayerNorm``."""

    name: str
    cls: str
    eps: float = 1e-6
    affine: bool = False
    modelopt: bool = False
    input_quantizer_enabled: bool = False
    input_format: str | None = None
    output_quantizer_enabled: bool = False
    # Why the FP8 path of bias_residual_layer_norm_scale_shift cannot reproduce the input quantizer
    # (empty: it can). Irrelevant when the input quantizer is disabled.
    fp8_kernel_reasons: list[str] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)  # why the site cannot be fused at all

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def inspect_norm(name: str, norm: nn.Module) -> NormInfo:
    info = NormInfo(name=name, cls=type(norm).__name__)
    if not isinstance(norm, nn.LayerNorm):
        info.unsupported.append(f"{name} is a {type(norm).__name__}, not an nn.LayerNorm")
        return info
    info.eps = float(norm.eps)
    info.affine = norm.weight is not None or norm.bias is not None
    if info.affine:
        info.unsupported.append(f"{name} has an elementwise affine (the fused ops have none)")
    if len(norm.normalized_shape) != 1:
        info.unsupported.append(f"{name} normalises over {tuple(norm.normalized_shape)}, not the last dim")
    iq = getattr(norm, "input_quantizer", None)
    oq = getattr(norm, "output_quantizer", None)
    info.modelopt = is_modelopt_quantizer(iq) or is_modelopt_quantizer(oq)
    info.input_quantizer_enabled = quantizer_enabled(iq)
    info.input_format = quantizer_format(iq)
    info.output_quantizer_enabled = quantizer_enabled(oq)
    if info.output_quantizer_enabled:
        info.unsupported.append(f"{name} has an enabled output quantizer")
    if info.input_quantizer_enabled:
        info.fp8_kernel_reasons = norm_input_fp8(iq)[1]
    if info.modelopt and type(norm).forward is not _quant_input_forward():
        # Something other than QuantInputBase.forward (LN(Q(x)) then Q_out) would run.
        info.unsupported.append(f"{name}: unknown ModelOpt forward {type(norm).forward.__qualname__}")
    if info.modelopt and "_forward_pre_dm" in norm.__dict__:
        info.unsupported.append(f"{name}: its forward was replaced before ModelOpt converted it")
    return info


def _quant_input_forward():
    try:
        from modelopt.torch.quantization.nn.modules.quant_module import QuantInputBase  # noqa: PLC0415
    except Exception:  # modelopt missing: no norm can be a ModelOpt norm
        return None
    return QuantInputBase.forward


# ---------------------------------------------------------------------------- real FP8 GEMMs

FP8_GEMM_MIN_CAPABILITY = (8, 9)  # torch._scaled_mm with e4m3 needs Ada or newer


def fp8_gemm_reasons(module: nn.Module) -> list[str]:
    """Why a linear cannot run as a real FP8 ``torch._scaled_mm`` exactly where ModelOpt fake-quantizes
    it (empty: it can). Device-independent part; the caller adds the device's."""
    base, wrappers = unwrap_peft(module)
    if wrappers:
        return ["PEFT adapter: runs as ModelOpt runs it"]
    iq, wq = getattr(base, "input_quantizer", None), getattr(base, "weight_quantizer", None)
    if not is_modelopt_quantizer(wq):
        return ["not ModelOpt-quantized"]
    r = []
    if type(base).__name__ not in ("QuantLinear", "RealQuantQuantLinear"):
        r.append(f"{type(base).__name__} is not a ModelOpt QuantLinear")
    r += [f"input quantizer: {x}" for x in fp8_quantizer_reasons(iq)]
    r += [f"weight quantizer: {x}" for x in fp8_quantizer_reasons(wq)]
    if quantizer_enabled(getattr(base, "output_quantizer", None)):
        r.append("output quantizer enabled")
    w = base._parameters.get("weight")
    if w is None or w.dim() != 2:
        r.append("no 2-D weight")
    else:
        n, k = _weight_shape(base)
        if k % 16 or n % 16:
            r.append(f"weight {n}x{k}: _scaled_mm needs both dims multiples of 16")
    if is_dtensor(w):
        local = tuple(w.to_local().shape)
        if local[0] % 16 or local[1] % 16:
            r.append(f"tensor-parallel shard {local[0]}x{local[1]}: _scaled_mm needs both dims multiples of 16")
        for q, name in ((iq, "input"), (wq, "weight")):
            if is_dtensor(getattr(q, "_amax", None)):
                r.append(f"{name} quantizer amax is a DTensor")
    if type(w).__name__ == "QTensorWrapper" and w.dtype != torch.float8_e4m3fn:
        r.append(f"compressed weight stored as {w.dtype}, not float8_e4m3fn")
    if getattr(wq, "fake_quant", True) and type(w).__name__ == "QTensorWrapper":
        r.append("compressed weight with a fake-quant weight quantizer")
    return r


def _weight_shape(base: nn.Module) -> tuple[int, int]:
    w = base._parameters["weight"]
    shape = getattr(w, "metadata", {}).get("shape") if type(w).__name__ == "QTensorWrapper" else None
    return tuple(shape) if shape is not None else tuple(w.shape)  # type: ignore[return-value]


@dataclass
class Fp8Weight:
    """A linear's weight as ``torch._scaled_mm`` takes it: e4m3 codes [out, in] and the per-tensor
    dequantization scale (``amax / 448``, one fp32 element), plus the input quantizer's ``_amax``."""

    codes: torch.Tensor
    scale: torch.Tensor
    input_amax: torch.Tensor
    reused_storage: bool  # the codes are ModelOpt's own compressed weight (mtq.compress)
    out_dtype: torch.dtype  # the dtype the linear computes in (its original weight's)


def make_fp8_weight(module: nn.Module, device: torch.device) -> Fp8Weight:
    """Build (once, at decision time) the FP8 weight of a linear that passed :func:`fp8_gemm_reasons`.

    Fake quant: codes = e4m3(W * 448 / amax_w), the codes inside ModelOpt's own fake quantization
    of W (CUDA-extension formula). ``mtq.compress``ed: ModelOpt's stored codes and its ``_scale``.
    """
    base, _ = unwrap_peft(module)
    wq, iq = base.weight_quantizer, base.input_quantizer
    w = base._parameters["weight"]
    # A snapshot: the emitting kernels and the GEMM's dequantization scale must agree. ModelOpt
    # recalibrates through calibration mode, which the plan detects and then decides anew.
    input_amax = iq._amax.detach().float().reshape(1).to(device).clone()
    if type(w).__name__ == "QTensorWrapper":
        codes = w.as_subclass(torch.Tensor).detach()
        scale = wq._scale.detach().float().reshape(1)
        return Fp8Weight(codes.to(device), scale.to(device), input_amax, True, w.metadata["dtype"])
    if is_dtensor(w):
        # tensor parallelism: this rank's shard. ModelOpt calibrates a DTensor weight's amax over the
        # whole tensor (a plain tensor, equal on every rank), so the codes are the shard of the codes.
        w = w.to_local().contiguous()
    with torch.no_grad():
        codes = quantize_fp8_reference(w.detach().to(device), wq._amax)
    return Fp8Weight(codes, dequant_scale(wq._amax, device), input_amax, False, w.dtype)


def calibrating(module: nn.Module) -> bool:
    """Whether a ModelOpt quantizer of this module is collecting calibration statistics now."""
    for name in ("input_quantizer", "weight_quantizer"):
        q = getattr(module, name, None)
        if q is not None and getattr(q, "_if_calib", False):
            return True
    return False
