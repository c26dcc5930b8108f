"""ModelOpt, per layer: quantizer formats, the one FP8 eligibility check, FP8 weights, what a plan watches. Detection
is per module, never per model (configs exclude layers, AutoQuantize mixes formats): a module is ModelOpt-quantized
when it carries a ModelOpt quantizer, however it was made (quantize, compress, restore)."""

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from .ops.fp8 import Fp8PerTensorQuant, dequant_scale, quantize_fp8_reference
from .parallel import is_dtensor
from . import staging
from .lora import has_lora_bias
from .sites import unwrap_peft


def _quant_input_forward() -> Any:
    """ModelOpt's ``QuantInputBase.forward`` if imported (else no module is ModelOpt's); never imported here (why:
    ``hf_export.import_modelopt``)."""
    mod = sys.modules.get("modelopt.torch.quantization.nn.modules.quant_module")
    return getattr(getattr(mod, "QuantInputBase", None), "forward", None)


FP8_E4M3 = "FP8_E4M3"
NVFP4 = "NVFP4"
MXFP4 = "MXFP4"
INT8 = "INT8"
INT4 = "INT4"
OTHER = "other"


def is_modelopt_object(obj: Any) -> bool:
    """``obj`` is an instance of a ModelOpt class: a quantizer, or a module ModelOpt put in place of a diffusers one."""
    return obj is not None and type(obj).__module__.startswith("modelopt.")


is_modelopt_quantizer = is_modelopt_object


def hook_attrs_in_dict(cls: type) -> bool:
    """A module of class ``cls`` keeps attributes set on it (hook attributes among them) in its ``__dict__`` alone:
    its ``__getattr__`` is ``nn.Module``'s, or ModelOpt's ``DynamicModule`` one (adding only hparams and tensors)."""
    dynamic = getattr(sys.modules.get("modelopt.torch.opt.dynamic"), "DynamicModule", None)
    return cls.__getattr__ in (nn.Module.__getattr__, getattr(dynamic, "__getattr__", None))


def _first_quantizer(q: Any) -> Any:
    # a SequentialQuantizer (e.g. W4A8): the first one sees the tensor first and names the storage format
    return q[0] if isinstance(q, nn.Sequential) and len(q) > 0 else q


def quantizer_enabled(q: Any) -> bool:
    subs = q if isinstance(q, nn.Sequential) else [q]
    return is_modelopt_quantizer(q) and any(bool(getattr(s, "is_enabled", False)) for s in subs)


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
        if blocks.get(-1) == 16 and blocks.get("scale_bits") == (4, 3):
            return NVFP4
        return MXFP4 if blocks.get("scale_bits") == (8, 0) else OTHER
    return INT8 if bits == 8 else INT4 if bits == 4 else OTHER


# (attribute, its value refuses, why) of fp8_quantizer_reasons, in the order it says them
_FP8_REFUSED = (("axis", lambda v: v is not None, "not per-tensor (axis is set)"),
                ("block_sizes", bool, "block quantization"),
                ("pre_quant_scale", lambda v: v is not None, "pre_quant_scale is set"),
                ("_if_calib", bool, "calibration is running"),
                ("_if_quant", lambda v: v is not None and not v, "quantization is switched off"),
                ("backend", lambda v: v is not None, "custom backend"),
                ("_use_constant_amax", bool, "constant amax"),
                ("rotate_is_enabled", bool, "rotation enabled"))


def fp8_quantizer_reasons(quantizer: Any) -> list[str]:
    """Why a ModelOpt quantizer is not an FP8 e4m3 per-tensor static fake quantizer (empty: it is)."""
    cls = type(quantizer)
    if not cls.__module__.startswith("modelopt."):
        return [f"{cls.__name__} is not a ModelOpt quantizer"]
    r = [f"{cls.__name__} is not a plain TensorQuantizer"] if cls.__name__ != "TensorQuantizer" else []
    if not getattr(quantizer, "is_enabled", False):
        r.append("quantizer is disabled")
    if getattr(quantizer, "num_bits", None) != (4, 3):
        r.append(f"num_bits {getattr(quantizer, 'num_bits', None)} is not FP8 e4m3 (4, 3)")
    r += [why for attr, bad, why in _FP8_REFUSED if bad(getattr(quantizer, attr, None))]
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


@functools.lru_cache(maxsize=1)
def _cuda_ext_available() -> bool:
    """Whether ModelOpt uses its CUDA extension for CUDA inputs (it builds it once, on first use)."""
    ext = sys.modules.get("modelopt.torch.quantization.extensions")  # imported with mtq
    try:
        return ext is not None and ext.get_cuda_ext_fp8(raise_if_failed=False) is not None
    except Exception:
        return False


def norm_input_fp8(quantizer: Any, device: torch.device | None = None) -> tuple[Fp8PerTensorQuant | None, list[str]]:
    """The norm-input fake quantizer as an :class:`Fp8PerTensorQuant` for ``device``, holding its live ``_amax``."""
    r = fp8_quantizer_reasons(quantizer)
    if not getattr(quantizer, "fake_quant", False):
        r.append("not fake quantization")
    if r:
        return None, r
    device = device if device is not None else quantizer._amax.device
    formula = "cuda_ext" if device.type == "cuda" and _cuda_ext_available() else "eager"
    return Fp8PerTensorQuant(amax=quantizer._amax, formula=formula), []


def quant_input_norm_ok(norm: nn.Module) -> bool:
    """Per call: a ModelOpt LayerNorm still computes ``LayerNorm(input_quantizer(x))``, so a runner may fuse it."""
    d = norm.__dict__
    mods = d.get("_modules") or {}
    return (type(norm).forward is _quant_input_forward() and "_forward_pre_dm" not in d
            and is_modelopt_quantizer(mods.get("input_quantizer"))
            and not quantizer_enabled(mods.get("output_quantizer")))


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


def inspect_projection(name: str, module: nn.Module) -> ProjectionInfo:
    base, wrappers = unwrap_peft(module)
    params = getattr(base, "_parameters", {})
    # lora_bias: deferring only the base bias would stay correct, but deferral refuses such (rare) adapters
    info = ProjectionInfo(name=name, cls=type(module).__name__, peft_wrapped=bool(wrappers),
                          lora_bias=any(has_lora_bias(w) for w in wrappers), bias_holder_ok="bias" in params,
                          has_bias=params.get("bias") is not None)
    # the quantizers sit on the base layer (LoRA added after quantization) or on a ModelOpt-converted PEFT
    # wrapper (LoRA present at quantize time): the outermost that has them
    qmod = next((m for m in [*wrappers, base] if is_modelopt_quantizer(getattr(m, "weight_quantizer", None))), None)
    if qmod is None:
        return info
    wq, iq, oq = (getattr(qmod, f"{n}_quantizer", None) for n in ("weight", "input", "output"))
    cls = type(qmod).__name__ if qmod is module else f"{type(module).__name__}({type(qmod).__name__})"
    return replace(info, cls=cls, modelopt=True, weight_format=quantizer_format(wq), input_format=quantizer_format(iq),
                   input_quantizer_enabled=quantizer_enabled(iq), output_quantizer_enabled=quantizer_enabled(oq),
                   pre_quant_scale=getattr(_first_quantizer(iq), "pre_quant_scale", None) is not None,
                   compressed=type(getattr(qmod, "_parameters", {}).get("weight")).__name__ == "QTensorWrapper",
                   notes=[] if quantizer_enabled(wq) else ["weight quantizer disabled"])


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
    fp8_kernel_reasons: list[str] = field(default_factory=list)  # why the FP8 kernels can't reproduce input_q
    unsupported: list[str] = field(default_factory=list)  # why the site cannot be fused at all


def inspect_norm(name: str, norm: nn.Module) -> NormInfo:
    cls = type(norm).__name__
    if not isinstance(norm, nn.LayerNorm):
        return NormInfo(name=name, cls=cls, unsupported=[f"{name} is a {cls}, not an nn.LayerNorm"])
    iq, oq = getattr(norm, "input_quantizer", None), getattr(norm, "output_quantizer", None)
    info = NormInfo(name=name, cls=cls, eps=float(norm.eps), affine=norm.weight is not None or norm.bias is not None,
                    modelopt=is_modelopt_quantizer(iq) or is_modelopt_quantizer(oq),
                    input_quantizer_enabled=quantizer_enabled(iq), input_format=quantizer_format(iq),
                    output_quantizer_enabled=quantizer_enabled(oq))
    if info.affine:
        info.unsupported.append(f"{name} has an elementwise affine (the fused ops have none)")
    if len(norm.normalized_shape) != 1:
        info.unsupported.append(f"{name} normalises over {tuple(norm.normalized_shape)}, not the last dim")
    if info.output_quantizer_enabled:
        info.unsupported.append(f"{name} has an enabled output quantizer")
    if info.input_quantizer_enabled:
        info.fp8_kernel_reasons = fp8_quantizer_reasons(iq)
    if info.modelopt and type(norm).forward is not _quant_input_forward():
        info.unsupported.append(f"{name}: unknown ModelOpt forward {type(norm).forward.__qualname__}")
    if info.modelopt and "_forward_pre_dm" in norm.__dict__:
        info.unsupported.append(f"{name}: its forward was replaced before ModelOpt converted it")
    return info


FP8_GEMM_MIN_CAPABILITY = (8, 9)  # torch._scaled_mm with e4m3 needs Ada or newer


def fp8_gemm_reasons(module: nn.Module) -> list[str]:
    """Why a linear cannot run as a real FP8 GEMM where ModelOpt fake-quantizes it (device-independent part)."""
    base, wrappers = unwrap_peft(module)
    if any(is_modelopt_quantizer(getattr(w, "weight_quantizer", None)) for w in wrappers):
        return ["a PEFT layer quantized by ModelOpt as a whole: runs as ModelOpt runs it"]
    iq, wq = getattr(base, "input_quantizer", None), getattr(base, "weight_quantizer", None)
    if not is_modelopt_quantizer(wq):
        return ["not ModelOpt-quantized"]
    cls = type(base).__name__
    r = [f"{cls} is not a ModelOpt QuantLinear"] if cls not in ("QuantLinear", "RealQuantQuantLinear") else []
    r += [f"input quantizer: {x}" for x in fp8_quantizer_reasons(iq)]
    r += [f"weight quantizer: {x}" for x in fp8_quantizer_reasons(wq)]
    if quantizer_enabled(getattr(base, "output_quantizer", None)):
        r.append("output quantizer enabled")
    w = base._parameters.get("weight")
    if w is None or w.dim() != 2:
        r.append("no 2-D weight")
    else:
        shape = getattr(w, "metadata", {}).get("shape") if type(w).__name__ == "QTensorWrapper" else None
        n, k = tuple(shape) if shape is not None else tuple(w.shape)
        if k % 16 or n % 16:
            r.append(f"weight {n}x{k}: _scaled_mm needs both dims multiples of 16")
    if is_dtensor(w):
        local = tuple(w.to_local().shape)
        if local[0] % 16 or local[1] % 16:
            r.append(f"tensor-parallel shard {local[0]}x{local[1]}: _scaled_mm needs both dims multiples of 16")
        r += [f"{name} quantizer amax is a DTensor" for q, name in ((iq, "input"), (wq, "weight"))
              if is_dtensor(getattr(q, "_amax", None))]
    if type(w).__name__ == "QTensorWrapper" and w.dtype != torch.float8_e4m3fn:
        r.append(f"compressed weight stored as {w.dtype}, not float8_e4m3fn")
    if getattr(wq, "fake_quant", True) and type(w).__name__ == "QTensorWrapper":
        r.append("compressed weight with a fake-quant weight quantizer")
    return r


def fp8_linear_refusals(module: nn.Module, device_reasons: list[str]) -> list[str]:
    """The one FP8 eligibility check of a ModelOpt linear, both families (TP and offload hooks are the caller's)."""
    r = fp8_gemm_reasons(module)
    if r == ["not ModelOpt-quantized"]:
        return r
    r += device_reasons
    w = unwrap_peft(module)[0]._parameters.get("weight")
    if isinstance(w, torch.Tensor):
        if not is_dtensor(w) and type(w.data) is not torch.Tensor and type(w).__name__ != "QTensorWrapper":
            r.append(f"weight is a {type(w.data).__name__}: the GEMM must stay the module's")
        if w.device.type == "meta":
            r.append("weight on the meta device (offload hook)")
        if getattr(w, "metadata", {}).get("dtype", w.dtype) not in (torch.bfloat16, torch.float16):
            r.append("activations are not bf16/fp16")
    return r


def modelopt_inner_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """What ModelOpt's ``QuantInputBase.forward`` runs between its quantizers: our forward kept as ``_forward_pre_dm``
    by a conversion (``mtq.compress`` after patching) calls this, never the module (no recursion)."""
    qf = _quant_input_forward()
    for cls in type(module).__mro__:
        if cls.__dict__.get("forward") is qf:
            return super(cls, module).forward(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


@dataclass
class Fp8Weight:
    """A linear's weight for ``torch._scaled_mm``: e4m3 codes [out, in], its fp32 scale, the input ``_amax``."""

    codes: torch.Tensor
    scale: torch.Tensor
    input_amax: torch.Tensor
    reused_storage: bool  # the codes are ModelOpt's own compressed weight (mtq.compress)
    out_dtype: torch.dtype  # the dtype the linear computes in (its original weight's)
    amax: torch.Tensor | None = None  # the weight amax the codes were made with (fp32 [1]; None: reused storage)


def staged_weight(module: nn.Module, device: torch.device, pinned: bool = False) -> torch.Tensor | None:
    """A plain linear weight kept elsewhere (the host-kept originals) copied to ``device`` once, for all the decision
    reads of it there (its fingerprint, its FP8 codes), so the CPU never reads the originals. ``pinned``: through
    pinned buffers (:mod:`qwen_absorb.staging`). None where the weight is on ``device`` already or not plain."""
    w = unwrap_peft(module)[0]._parameters.get("weight")
    if type(w) is not nn.Parameter or type(w.data) is not torch.Tensor or w.device == device \
            or w.device.type == "meta":
        return None
    return staging.to_device(w.detach(), device, pinned=pinned)


def make_fp8_weight(module: nn.Module, device: torch.device, staged: torch.Tensor | None = None,
                    codes: torch.Tensor | None = None) -> Fp8Weight:
    """The FP8 weight of a linear that passed :func:`fp8_gemm_reasons` (``staged``: :func:`staged_weight`;
    ``codes``: its codes already made, on ``device``, from the same sources: :mod:`qwen_absorb.host_codes`)."""
    base, _ = unwrap_peft(module)
    wq, iq = base.weight_quantizer, base.input_quantizer
    w = base._parameters["weight"]
    # a copy: the emitting kernels and the GEMM's scale must agree (the watch sees the amax change: decided anew)
    input_amax = iq._amax.detach().float().reshape(1).to(device).clone()
    if type(w).__name__ == "QTensorWrapper":
        scale = wq._scale.detach().float().reshape(1).to(device)
        return Fp8Weight(w.as_subclass(torch.Tensor).detach().to(device), scale, input_amax, True, w.metadata["dtype"])
    if is_dtensor(w):
        # this rank's shard; the amax was calibrated over the whole tensor, so these are the shard of the codes
        w = w.to_local().contiguous()
    if codes is None:
        with torch.no_grad():
            codes = quantize_fp8_reference(w.detach().to(device) if staged is None else staged, wq._amax)
    amax = wq._amax.detach().float().reshape(1).to(device).clone()
    return Fp8Weight(codes, dequant_scale(wq._amax, device), input_amax, False, w.dtype, amax)


def fp8_sources_moved(module: nn.Module, weight: Fp8Weight, device: torch.device) -> bool:
    """Whether ``module``'s amaxes moved from ``weight``'s through ``.data`` (``quantizer.amax = v``); it syncs."""
    base = unwrap_peft(module)[0]
    wq, iq = base.weight_quantizer, base.input_quantizer
    now = iq._amax.detach().float().reshape(1).to(device)
    scale = (wq._scale.detach().float().reshape(1).to(device) if weight.reused_storage
             else dequant_scale(wq._amax, device))
    return not (torch.equal(now, weight.input_amax) and torch.equal(scale, weight.scale))


def input_amax(module: nn.Module | None) -> torch.Tensor | None:
    """The static amax of a (possibly PEFT-wrapped) ModelOpt linear's input quantizer."""
    base = unwrap_peft(module)[0]
    return getattr(getattr(base, "input_quantizer", None), "_amax", None)


def calibrating(module: nn.Module) -> bool:
    """Whether a ModelOpt quantizer of this module is collecting calibration statistics now."""
    return any(getattr(getattr(module, n, None), "_if_calib", False) for n in ("input_quantizer", "weight_quantizer"))


_QUANTIZERS = ("input_quantizer", "weight_quantizer", "output_quantizer")
# ModelOpt's QuantAttention quantizers: enabled, the block's own attention would skip them (plan._attention_reasons)
ATTENTION_QUANTIZERS = ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer", "softmax_quantizer",
                        "bmm2_output_quantizer")
# TensorQuantizer attributes whose identity decides what ModelOpt's forward computes (bools are singletons)
_SWITCHES = ("_disabled", "_if_quant", "_if_calib", "_fake_quant", "_num_bits", "_axis", "_block_sizes",
             "_enable_pre_quant_scale", "_use_constant_amax", "_rotate", "_bias", "_bias_calibrator", "backend")
_QUANTIZER_TENSORS = ("_amax", "_scale", "_pre_quant_scale", "_bias")


def watch_pairs(module: nn.Module | None, names: tuple[str, ...] = _QUANTIZERS,
                ) -> tuple[list[tuple[Any, str, str]], list[tuple[Any, str, str]]]:
    """``(switches, tensors)``: the :class:`~qwen_absorb.watch.Watch` entries of a ModelOpt module's quantizers
    ``names`` (a tensor registered later, as a ``pre_quant_scale``, is watched as an empty slot)."""
    switches: list[tuple[Any, str, str]] = []
    tensors: list[tuple[Any, str, str]] = []
    md = module.__dict__ if module is not None else {}
    d = md.get("_modules") or {}
    for name in names:
        q = d.get(name)
        if not is_modelopt_quantizer(q):
            continue
        for sub in (list(q) if isinstance(q, nn.Sequential) else [q]):
            switches += [(sub, "__dict__", k) for k in _SWITCHES]
            if "_buffers" in sub.__dict__:
                tensors += [(sub, "_buffers", k) for k in _QUANTIZER_TENSORS]
    if "_modules" in md:
        switches += [(module, "_modules", n) for n in names]  # a quantizer replaced
    return switches, tensors


@contextlib.contextmanager
def swaps_undone_on_error(module: nn.Module | None) -> Iterator[None]:
    """Put back what ModelOpt's ``QuantAttention`` swaps process-wide (bmm, SDPA) with no try/finally on errors."""
    saved = [(p, n, getattr(p, n)) for p, n, *_ in getattr(module, "functionals_to_replace", None) or ()]
    try:
        yield
    except BaseException:
        for p, n, f in saved:
            setattr(p, n, f)
        raise
