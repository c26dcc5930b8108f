"""PEFT LoRA layers as the real-FP8 path sees them: the one reader of PEFT's per-layer state.

PEFT adds ``lora_B(lora_A(dropout(x))) * scaling`` per active adapter to ``base_layer(x)``; the FP8 path adds them to
its GEMM's output as ``y.addmm_(lora_A(x), lora_B.weight.T, alpha=scaling)`` (one dtype, identity dropout), else as
PEFT's expression op for op."""

from typing import Any

import torch
from torch import nn

Products = list[tuple[torch.Tensor, torch.Tensor, Any]]  # [(x @ A.T, lora_B.weight, scaling)]


def is_lora_layer(module: nn.Module | None) -> bool:
    """A PEFT LoRA layer (it wraps the original module as ``base_layer``)."""
    return (module is not None and isinstance(getattr(module, "base_layer", None), nn.Module)
            and isinstance(getattr(module, "lora_A", None), nn.ModuleDict))


def _flag_dict(layer: nn.Module, name: str) -> bool:  # a flag, or {adapter: flag} (peft >= 0.14's lora_bias)
    v = getattr(layer, name, None)
    return any(bool(x) for x in v.values()) if isinstance(v, dict) else bool(v)


def has_lora_bias(layer: nn.Module) -> bool:
    return _flag_dict(layer, "lora_bias")


def unsupported_reasons(layer: nn.Module) -> list[str]:
    """Why the FP8 path cannot compute this PEFT layer's branches as PEFT does (empty: it can)."""
    if not is_lora_layer(layer):
        return [f"{type(layer).__name__} is a PEFT wrapper but not a LoRA layer"]
    r = []
    if type(layer).__name__ != "Linear" or not type(layer).__module__.startswith("peft."):
        r.append(f"PEFT layer {type(layer).__name__} is not peft's lora.Linear")
    if is_lora_layer(layer.base_layer):
        r.append("nested PEFT LoRA wrappers")
    if _flag_dict(layer, "use_dora") or getattr(layer, "lora_variant", None):
        r.append("DoRA or another LoRA variant")
    if has_lora_bias(layer):
        r.append("an adapter with lora_bias")
    for name, a in layer.lora_A.items():
        b = layer.lora_B[name] if name in layer.lora_B else None
        if type(a) is not nn.Linear or type(b) is not nn.Linear or a.bias is not None or b.bias is not None:
            r.append(f"adapter {name!r}: lora_A/lora_B are not bias-free nn.Linear")
            break
        if type(a.weight.data) is not torch.Tensor:
            r.append(f"adapter {name!r}: weights are a {type(a.weight.data).__name__}")
            break
    if getattr(layer, "fan_in_fan_out", False):
        r.append("fan_in_fan_out layer")
    return r


def state(layer: nn.Module) -> tuple:
    """What of a LoRA layer decides what runs, besides ``scaling`` (read per call): a change means decide again."""
    d = layer.__dict__
    active = d.get("_active_adapter")
    return (tuple(d.get("merged_adapters") or ()), bool(d.get("_disable_adapters")),
            tuple(active) if isinstance(active, (list, tuple)) else (active,),
            tuple(layer.lora_A._modules), tuple(getattr(layer, "lora_variant", None) or ()))


def output_state(layer: nn.Module) -> tuple:  # state() and scaling: what a kept output was computed with
    scaling = layer.__dict__.get("scaling")
    return state(layer), tuple(sorted(scaling.items())) if isinstance(scaling, dict) else scaling


def call_refusal(layer: nn.Module) -> str | None:
    """Why this call cannot take the FP8 path: PEFT's forward unmerges a disabled, merged layer first."""
    d = layer.__dict__
    return ("a PEFT layer with merged adapters was disabled (PEFT unmerges inside its forward)"
            if d.get("_disable_adapters") and d.get("merged_adapters") else None)


def active_branches(layer: nn.Module) -> list[tuple[nn.Linear, nn.Linear, nn.Module, Any]]:
    """``[(lora_A, lora_B, dropout, scaling)]`` that PEFT's forward adds to the base output now."""
    d = layer.__dict__
    if d.get("_disable_adapters") or d.get("merged_adapters"):
        return []
    active = d.get("_active_adapter")
    names = [active] if isinstance(active, str) else list(active or ())
    mods_a, mods_b, drops = layer.lora_A._modules, layer.lora_B._modules, layer.lora_dropout._modules
    scaling = layer.scaling
    return [(mods_a[n], mods_b[n], drops[n], scaling[n]) for n in names if n in mods_a]


def _identity_dropout(m: nn.Module) -> bool:
    return type(m) is nn.Identity or (isinstance(m, nn.Dropout) and (m.p == 0.0 or not m.training))


def _plain_branch(a: nn.Linear, b: nn.Linear, drop: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    """Dropout is the identity and both adapter weights have ``dtype`` and ``device`` (no cast, no copy)."""
    wa, wb = a.weight, b.weight
    return _identity_dropout(drop) and wa.dtype == dtype == wb.dtype and wa.device == device == wb.device


def shared_input_branches(layers: list[nn.Module], x: torch.Tensor, out_dtype: torch.dtype) -> list[Products] | None:
    """Per layer :data:`Products` of LoRA layers reading one input, the ``lora_A`` products from one GEMM; None for
    fewer than two branches or no fast path. Never cached: hotswap writes through ``.data``."""
    per = [active_branches(layer) for layer in layers]
    flat = [br for bs in per for br in bs]
    if len(flat) < 2 or not all(x.dtype == out_dtype and _plain_branch(a, b, drop, x.dtype, x.device)
                                and type(a.weight.data) is torch.Tensor for a, b, drop, _ in flat):
        return None
    t = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), torch.cat([a.weight for a, _, _, _ in flat], 0))
    parts = iter(t.split([a.weight.shape[0] for a, _, _, _ in flat], dim=1))
    return [[(next(parts), b.weight, s) for _, b, _, s in bs] for bs in per]


def foldable_branch(layer: nn.Module, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
    """``(lora_A weight, lora_B weight, scaling)`` of a layer's one active plain branch (``ops.lora_fold``), or None."""
    if len(branches := active_branches(layer)) != 1:
        return None
    a, b, drop, s = branches[0]
    ok = _plain_branch(a, b, drop, dtype, device) and type(a.weight.data) is torch.Tensor
    return (a.weight, b.weight, s) if ok else None


def add_products(y: torch.Tensor, branches: Products) -> torch.Tensor:
    """``y`` plus ``scaling * (x @ A.T) @ B.T`` in place: one fp32-accumulated ``addmm_`` each."""
    y2 = y.view(-1, y.shape[-1])
    for t, wb, s in branches:
        y2.addmm_(t, wb.t(), alpha=s)
    return y


def products(layer: nn.Module, x: torch.Tensor, out_dtype: torch.dtype) -> Products | None:
    """``[(x @ A.T, lora_B.weight, scaling)]`` of the active branches, or None where PEFT's own expression must run."""
    if not (branches := active_branches(layer)):
        return []
    if x.dtype != out_dtype or not all(_plain_branch(a, b, drop, x.dtype, x.device) for a, b, drop, _ in branches):
        return None
    x2 = x.reshape(-1, x.shape[-1])
    return [(torch.nn.functional.linear(x2, a.weight), b.weight, s) for a, b, _, s in branches]


def add_branches(layer: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y`` plus every active branch: in place via :func:`products` where it applies, else PEFT's expression."""
    prods = products(layer, x, y.dtype) if y.is_contiguous() else None
    if prods is not None:
        return add_products(y, prods) if prods else y
    out_dtype, cast = y.dtype, getattr(layer, "cast_input_dtype_enabled", True)
    for a, b, drop, s in active_branches(layer):
        if cast and x.dtype != a.weight.dtype:
            x = x.to(a.weight.dtype)
        y = y + b(a(drop(x))) * s
    return y.to(out_dtype)
