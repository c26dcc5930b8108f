"""What a call is, for a graph: the frozen structure of its arguments (every non-tensor value exactly, with its
type), the metadata of every tensor (shape, strides, dtype, device, address alignment) and the process-wide
switches that change which kernels a call picks, as one hashable key; and the refusals found on the way."""

import enum
import inspect
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..plan import PLAN_ATTR
from . import settings

try:  # diffusers' attention backend switch (set_attention_backend / attention_backend(...))
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
except Exception:  # noqa: BLE001 - another diffusers version: no process-wide backend to key on
    _AttentionBackendRegistry = None

# Top-level arguments diffusers expects as tensors: a Python number there would be baked into the graph.
TENSOR_SLOTS = frozenset({"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
                          "guidance", "additional_t_cond"})
# Values frozen as themselves (with their type, so that 1, True and 1.0 stay apart).
ATOMS = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout, torch.memory_format)


class Refusal(Exception):  # raised while reading the arguments: the call runs eager, for ``reason``
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason, self.detail = reason, detail


class _TensorSlot:  # a tensor's place in a frozen argument structure
    __slots__ = ()

    def __repr__(self) -> str:
        return "<tensor>"

    def __reduce__(self) -> str:  # pickled as the module's singleton
        return "TENSOR"


TENSOR = _TensorSlot()


def freeze(x: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable description of an argument; its tensors are appended to ``tensors``. Type tags keep ``1`` /
    ``True`` / ``1.0`` and lists / tuples apart (diffusers branches on ``isinstance(..., list)``)."""
    tx = type(x)
    if isinstance(x, torch.Tensor):
        if tx is not torch.Tensor and tx is not nn.Parameter:
            raise Refusal("unsupported argument type", f"tensor subclass {tx.__name__}")
        tensors.append(x)
        return TENSOR
    if tx in ATOMS:
        return (tx, x)
    if tx is float:
        return (float, x.hex())  # exact, and NaN equals itself
    if tx is complex:
        return (complex, x.real.hex(), x.imag.hex())
    if tx is list or tx is tuple:
        return (tx, tuple(freeze(v, tensors) for v in x))
    if tx is torch.Size:
        return (tx, tuple(x))
    if tx is dict:
        items = []
        for k, v in x.items():
            if type(k) not in ATOMS:
                raise Refusal("unsupported argument type", f"dict key of type {type(k).__name__}")
            items.append((k, freeze(v, tensors)))
        return (dict, tuple(items))
    if isinstance(x, enum.Enum):
        return (tx, x)
    raise Refusal("unsupported argument type", tx.__name__)


def thaw(spec: Any, it: Iterator[torch.Tensor]) -> Any:
    """The argument ``spec`` describes, its tensors taken in order from ``it``."""
    if spec is TENSOR:
        return next(it)
    tx = spec[0]
    if tx is float:
        return float.fromhex(spec[1])
    if tx is complex:
        return complex(float.fromhex(spec[1]), float.fromhex(spec[2]))
    if tx is list or tx is tuple:
        return tx(thaw(v, it) for v in spec[1])
    if tx is torch.Size:
        return torch.Size(spec[1])
    if tx is dict:
        return {k: thaw(v, it) for k, v in spec[1]}
    return spec[1]


def thaw_call(spec: Any, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:  # (args, kwargs) of Call.spec
    return thaw(spec[0], it := iter(tensors)), {k: thaw(v, it) for k, v in spec[1]}


def align_class(ptr: int) -> int:
    """The largest power of two dividing ``ptr``, capped at ``settings.ALIGN``: what kernels' alignment checks see."""
    return min(ptr & -ptr, settings.ALIGN) if ptr else settings.ALIGN


def tensor_meta(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.stride(), x.dtype, x.device, align_class(x.data_ptr()))


def global_flags() -> tuple:
    """Process-wide switches that change which kernels a call picks (and so what a graph baked in)."""
    m = torch.backends.cuda.matmul
    autocast = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return (
        torch.is_inference_mode_enabled(), autocast, m.allow_tf32,
        getattr(m, "allow_bf16_reduced_precision_reduction", None),
        getattr(m, "allow_fp16_reduced_precision_reduction", None), torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(), getattr(torch.backends.cuda, "cudnn_sdp_enabled", bool)(),
        torch.are_deterministic_algorithms_enabled(), os.environ.get("QWEN_ABSORB_FORCE_REFERENCE"),
        str(getattr(_AttentionBackendRegistry, "_active_backend", None)), getattr(m, "allow_fp16_accumulation", None),
        getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", bool)(), _blas_library(),
    )


def _blas_library() -> str:  # cuBLAS or cuBLASLt for the GEMMs
    try:
        return str(torch.backends.cuda.preferred_blas_library())
    except Exception:  # noqa: BLE001 - a build without it
        return ""


def patch_tuning(t: nn.Module) -> Any:
    """The :class:`qwen_absorb.Tuning` of the patch on ``t`` (a transformer or a block), or None."""
    for b in getattr(t, "transformer_blocks", None) or (t,):
        plan = b.__dict__.get(PLAN_ATTR)
        if plan is not None:
            return getattr(getattr(plan, "options", None), "tuning", None)
    return None


def describe_arg(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}[{','.join(map(str, x.shape))}]"
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."


def signature(args: tuple, kwargs: dict, positional: tuple[str, ...]) -> tuple[Any, list[torch.Tensor], tuple]:
    """``(spec, tensors, key)`` of a call: its frozen arguments, its tensors, and the graphs' key (structure,
    per-tensor metadata, global switches). Raises :class:`Refusal` for arguments a graph cannot take."""
    names = (positional[i] if i < len(positional) else f"arg{i}" for i in range(len(args)))
    for name, v in (*zip(names, args), *kwargs.items()):
        if name in TENSOR_SLOTS and type(v) in (int, float):
            raise Refusal("python number argument (would be baked into the graph)", f"{name}={v!r}")
    tensors: list[torch.Tensor] = []
    spec = (freeze(args, tensors), tuple((k, freeze(v, tensors)) for k, v in kwargs.items()))
    return spec, tensors, (spec, tuple(map(tensor_meta, tensors)), global_flags())


class Call:  # one call's arguments, read once: tensors, their frozen structure, the key, the device
    __slots__ = ("args", "kwargs", "tensors", "spec", "key", "device")

    def __init__(self, args: tuple, kwargs: dict, positional: tuple[str, ...]) -> None:
        self.args, self.kwargs = args, kwargs
        self.spec, self.tensors, self.key = signature(args, kwargs, positional)
        if not self.tensors:
            raise Refusal("no tensor argument", "")
        dev, types = self.tensors[0].device, settings.GRAPH_DEVICE_TYPES
        for x in self.tensors:
            if x.device.type not in types:
                raise Refusal(f"input on {x.device.type}", "")
            if x.device != dev:
                raise Refusal("inputs on several devices", f"{dev} and {x.device}")
            if x.numel() > 1 and torch._debug_has_internal_overlap(x) == 1:
                raise Refusal("input with overlapping memory (expanded)", describe_arg(x))
        self.device = dev

    def describe(self, positional: tuple[str, ...]) -> str:
        parts = [f"{positional[i] if i < len(positional) else i}={describe_arg(v)}" for i, v in enumerate(self.args)]
        parts += [f"{k}={describe_arg(v)}" for k, v in self.kwargs.items()]
        return " ".join(parts)


def positional_names(cls: type) -> tuple[str, ...]:
    """The names of ``cls.forward``'s positional parameters (after ``self``)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
