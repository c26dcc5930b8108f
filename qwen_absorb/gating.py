"""Policy as data: when a bias may be deferred, where real FP8 GEMMs and fast accumulation run, the tuning record.
Every decision is a function returning readable reasons (empty: yes). Deferral moves a bf16 rounding point (the bias
is added in fp32 inside the fused op), so ``"auto"`` defers only where ``benchmarks/fidelity.py`` (patched error <=
1.05x unpatched) passed. Capabilities are ``(major, minor)`` for CUDA, else the device type (``{"cpu"}`` lets CPU tests
exercise deferral on the ops' torch references)."""

from collections.abc import Collection
from dataclasses import dataclass, fields

import torch
from torch import nn

from .ops.lane import NAMES as LANES
from .parallel import tp_defer_refusals
from .quant import FP8_E4M3, FP8_GEMM_MIN_CAPABILITY, ProjectionInfo

# (major, minor) -> GPU and date of the passing fidelity run (gate <= 1.05x); an entry only from a committed run.
_H200 = "NVIDIA H200 (driver 580.159.04, torch 2.11, CuPy 14.2), 2026-11-30"
# 60 blocks, 4096 image tokens, ModelOpt FP8: deferred-bias error 0.9969x (forward) and 0.9996x (4-step latents) of
# the unpatched FP8 error: benchmarks/results/transformer/fidelity.md
VALIDATED_DEFER_CAPABILITIES: dict[tuple[int, int], str] = {(9, 0): _H200}
# the real FP8 GEMM path, 60 blocks, 4096 image + 128 text tokens: error 0.9997x (forward) and 0.9985x (4-step
# latents) of ModelOpt fake quant's: benchmarks/results/transformer/fp8_gemm.json (benchmarks/transformer_suite.py)
VALIDATED_FP8_CAPABILITIES: dict[tuple[int, int], str] = {(9, 0): _H200}
# torch._scaled_mm's fast accumulation (use_fast_accum="auto"), the same run: error against fp32 1.0025x (forward)
# and 0.9999x (4-step latents) of ModelOpt fake quant's: fp8_gemm.json, "fast_accum"
VALIDATED_FAST_ACCUM_CAPABILITIES: dict[tuple[int, int], str] = {(9, 0): _H200}


@dataclass(frozen=True)
class Tuning:
    """The measurement switches: which of two exact ways runs. In the plan, the graph key and the report (when not
    default); each default is the faster way as measured (the H200; the offload switches on an H100; where two
    ways tie, the one that holds less memory) (``benchmarks/NOTES.md``, "Tuning defaults")."""

    qk_fusion: bool = True  # the four q/k RMSNorm + RoPE chains as one qk_norm_rope launch (where bit-exact)
    qk_wide: bool = True  # qk_norm_rope's wide-lane kernel (16-byte vectors) where the layout allows
    joint_outputs: bool = True  # q/k/v GEMMs write the joint sequence in place (no concatenation copies)
    tp_local: bool = True  # tensor-parallel linears on their local shards (False: through DTensor)
    lora_gelu_kernel: bool = True  # net[0]'s last LoRA branch added inside its GELU + e4m3 quantization
    lora_fold: bool = True  # ... with net[2]'s lora_A product out of the same kernel (ops.lora_fold)
    lora_add_tiles: bool = True  # ops.lora_add's tiled kernel where the layout allows (else its row kernel)
    lanes: frozenset = frozenset(LANES)  # the ops.lane lanes captures may use ("branch", "txt")
    # graphs inside accelerate's CpuOffload hook (enable_model_cpu_offload(): captured once per run, replayed by the
    # other steps; journey_offload_h200.json); leaf-level offloading, which crashed them, is gated
    # (block.WEIGHT_HOOK_FALLBACK). False: that hook's calls run eager, with the reason
    model_offload_graphs: bool = True
    # host-kept originals cross to the GPU at a decision through two pinned 64 MiB buffers (staging.py) rather than
    # from pageable memory, several times faster (journey_offload_h100.json); the same bits
    pinned_staging: bool = True
    # a model back on the GPU takes its FP8 codes from a host copy made at its first departure when their sources
    # are unchanged (host_codes.py), rather than quantizing the host-kept originals again; the same bits. Off: no
    # faster (H100, 8 steps under model offload: 7.13 against 7.08 s; the run waits on the blocks' decisions, not
    # on the 0.39 s of GPU work it saves) for 19 GiB more host memory (journey_offload_h100.json, round 34)
    host_fp8_codes: bool = False
    # a block moved to another device and back with nothing changed keeps its decisions, only its FP8 codes made
    # again (host_originals.BlockMove); False: it decides anew at the first call back, as before round 35. The host's
    # share of a return 234 against 493 ms on the CPU (60 tiny FP8 blocks, offload_host_cpu.json); GPU A/B to run
    move_keeps_decisions: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "lanes":
                if isinstance(v, str) or not set(v) <= set(LANES):
                    raise ValueError(f"Tuning.lanes must be a subset of {LANES}, got {v!r}")
                object.__setattr__(self, "lanes", frozenset(v))
            elif type(v) is not bool:
                raise TypeError(f"Tuning.{f.name} must be a bool, got {v!r}")

    def changed(self) -> dict[str, object]:
        """The fields that differ from the defaults (empty: the default tuning)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def describe(self) -> str:
        return ", ".join(f"{k}={sorted(v) if isinstance(v, frozenset) else v}" for k, v in self.changed().items())


def check_tuning(tuning: object) -> Tuning:
    if tuning is not None and not isinstance(tuning, Tuning):
        raise TypeError(f"tuning must be a qwen_absorb.Tuning, got {type(tuning).__name__}")
    return Tuning() if tuning is None else tuning


# NVFP4 is not: its contract is ModelOpt's fake quantization bit for bit, and a deferred bias rounds differently
DEFERRABLE_FORMATS = (FP8_E4M3,)

CapabilityKey = tuple[int, int] | str


def capability_key(device: torch.device) -> CapabilityKey:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]
    return device.type


_DEVICE_TYPES = ("cpu", "cuda", "meta", "mps", "xpu", "hip")


def normalize_capabilities(capabilities: Collection[CapabilityKey] | None,
                           validated: dict | None = None) -> frozenset[CapabilityKey]:
    """``capabilities`` if given, else the validated set (deferral's unless another is named), checked."""
    if capabilities is None:
        return frozenset(VALIDATED_DEFER_CAPABILITIES if validated is None else validated)
    if isinstance(capabilities, str) or _is_cap_tuple(capabilities):
        capabilities = [capabilities]  # a single key given bare
    if not isinstance(capabilities, Collection):
        raise ValueError(f"capabilities must be a collection of (major, minor) pairs, got {capabilities!r}")
    for c in capabilities:
        if not (c in _DEVICE_TYPES if isinstance(c, str) else _is_cap_tuple(c)):
            raise ValueError(f"capabilities: {c!r} is neither (major, minor) nor a device type {_DEVICE_TYPES}")
    return frozenset(c if isinstance(c, str) else (int(c[0]), int(c[1])) for c in capabilities)


def _is_cap_tuple(c: object) -> bool:
    return isinstance(c, tuple) and len(c) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                        for v in c)


def defer_refusals(info: ProjectionInfo, *, mode: str | bool, consumer_fused: bool, device: torch.device,
                   capabilities: frozenset[CapabilityKey], kernel_reasons: list[str]) -> list[str]:
    """Why this projection's bias is not deferred under ``defer_bias=mode`` (empty: it is)."""
    if mode is False:
        return ["defer_bias=False"]
    r = []  # first why deferring would be wrong or impossible (even if forced), then what "auto" adds
    if not info.bias_holder_ok:
        r.append(f"{info.name} keeps no bias parameter")
    elif not info.has_bias:
        r.append(f"{info.name} has no bias")
    if info.output_quantizer_enabled:
        r.append(f"{info.name} has an enabled output quantizer: Q(xW + b) != Q(xW) + b")
    if info.lora_bias:
        r.append(f"{info.name} has a PEFT adapter with lora_bias")
    if not consumer_fused:
        r.append("the site consuming the output is not fused")
    if mode != "auto":
        return r
    if not info.modelopt:
        r.append(f"{info.name} is not ModelOpt-quantized (the bias stays in the GEMM)")
    elif info.weight_format not in DEFERRABLE_FORMATS:
        r.append(f"{info.name} is {info.weight_format or 'not weight-quantized'}; deferral is for FP8 "
                 "(an NVFP4 bias stays in its GEMM: bit for bit ModelOpt)")
    key = capability_key(device)
    if kernel_reasons and not (isinstance(key, str) and key in capabilities):  # {"cpu"}: the references, on purpose
        r.append("fused CUDA path unavailable: " + "; ".join(kernel_reasons))
    if key not in capabilities:
        if isinstance(key, tuple):
            r.append(f"GPU sm_{key[0]}{key[1]} is not in the validated set {describe_capabilities(capabilities)}")
        else:
            r.append(f"bias deferral is validated on GPUs only ({describe_capabilities(capabilities)}); "
                     f"this model runs on the {key}")
    return r


def describe_capabilities(capabilities: Collection[CapabilityKey]) -> str:
    """``sm_90, cpu``: capability keys as people read them."""
    keys = sorted(capabilities, key=lambda c: (isinstance(c, str), str(c)))
    return ", ".join(f"sm_{c[0]}{c[1]}" if isinstance(c, tuple) else str(c) for c in keys) or "none"


def tp_bias_refusals(base: nn.Module | None, mode: str | bool) -> list[str]:
    """Why a projection's DTensor bias stays in its GEMM. Only ``defer_bias=True`` defers it: the FP8 model under TP
    ran slower with its row-wise biases deferred (2 H200s, benchmarks/results/parallel/parallel.md)."""
    b = getattr(base, "_parameters", {}).get("bias") if base is not None else None
    if b is None or type(b) is torch.nn.Parameter or type(b.data) is torch.Tensor:
        return []
    return tp_defer_refusals(base) or (["tensor parallelism: defer_bias='auto' leaves row-wise biases in the GEMM"]
                                       if mode == "auto" else [])


def check_tristate(name: str, mode: object) -> str | bool:
    """``mode`` if it is ``"auto"``, ``True`` or ``False`` (not 1, 0 or "yes"), else a ValueError."""
    if mode is not True and mode is not False and mode != "auto":
        raise ValueError(f"{name} must be 'auto', True or False, got {mode!r}")
    return mode  # type: ignore[return-value]


def fast_accum(mode: str | bool, device: torch.device) -> bool:
    """Whether the FP8 GEMMs on ``device`` use fast accumulation: ``"auto"`` on validated GPUs."""
    if mode != "auto":
        return bool(mode)
    return device.type == "cuda" and capability_key(device) in VALIDATED_FAST_ACCUM_CAPABILITIES


def fp8_device_refusals(device: torch.device, mode: str | bool,
                        fp8_capabilities: Collection[CapabilityKey]) -> list[str]:
    """Why a real FP8 GEMM may not run on ``device`` under ``fp8_gemm=mode``. ``fp8_gemm=True`` with the device type in
    ``fp8_capabilities`` runs ``torch._scaled_mm``'s CPU implementation: a test of the logic, not a speed path."""
    if mode is False:
        return ["fp8_gemm=False"]
    if device.type != "cuda":
        return [] if mode is True and device.type in fp8_capabilities else \
            [f"tensors are on {device.type}; real FP8 GEMMs need CUDA"]
    cap, need = capability_key(device), FP8_GEMM_MIN_CAPABILITY
    if cap < need:
        return [f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs {need[0]}.{need[1]})"]
    if mode == "auto" and cap not in fp8_capabilities:
        return [f"GPU sm_{cap[0]}{cap[1]} is not in the FP8-validated set {describe_capabilities(fp8_capabilities)}"]
    return []
