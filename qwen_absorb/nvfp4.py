"""An NVFP4 linear on Hopper at bf16 speed: ModelOpt's NVFP4 fake quantization without its per-call cost.

A ModelOpt W4A4 NVFP4 linear computes ``F.linear(fq(x, input_amax), fq(W, weight_amax), bias)``, ``fq`` ModelOpt's
Triton fake quantization (:mod:`qwen_absorb.ops.quantize_nvfp4`). :class:`Nvfp4Linear` computes the same bits with
``fq(W)`` cached (not held where it equals ``W``); in a patched model the fused op producing a linear's input emits
``fq(x)`` where it can (:func:`decide_rows`)."""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from . import quant
from .hf_export import import_modelopt
from .ops.quantize_nvfp4 import emit_reasons, launch as launch_nvfp4, quantize_nvfp4, quantize_nvfp4_reference
from .sites import LINEAR_TABLE, SITE_TABLE, containers, resolve
from .watch import fingerprint_parts, tensor_version

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_CAPABILITY = (8, 9)  # where ModelOpt's NVFP4 fake quantization is the Triton kernel reproduced here


def _quantizer_reasons(q, what: str) -> list[str]:
    if quant.quantizer_format(q) != quant.NVFP4:
        return [f"{what} is not an enabled NVFP4 quantizer ({quant.quantizer_format(q)})"]
    blocks, amax = getattr(q, "block_sizes", None) or {}, getattr(q, "_amax", None)
    checks = (
        (blocks.get("type", "static") != "dynamic", "static block scales (only ModelOpt's dynamic NVFP4 is emulated)"),
        (blocks.get("four_over_six", False), "four-over-six scale selection"),
        (getattr(q, "pre_quant_scale", None) is not None, "pre_quant_scale is set"),
        (getattr(q, "backend", None) is not None, "custom backend"),
        (getattr(q, "rotate_is_enabled", False), "rotation enabled"),
        (getattr(q, "_if_calib", False) or not getattr(q, "_if_quant", True) or not getattr(q, "_fake_quant", True),
         "calibrating, switched off, or real quantization"),
        (not isinstance(amax, torch.Tensor) or amax.numel() != 1 or amax.device.type == "meta",
         "no single calibrated amax"),
    )
    return [f"{what}: {why}" for bad, why in checks if bad]


def nvfp4_linear_reasons(lin: nn.Module) -> list[str]:
    """Why ``lin`` is not a ModelOpt W4A4 NVFP4 linear that :class:`Nvfp4Linear` reproduces (empty: it is)."""
    if not isinstance(lin, nn.Linear):
        return [f"{type(lin).__name__} is not an nn.Linear"]
    r = _quantizer_reasons(getattr(lin, "weight_quantizer", None), "weight quantizer")
    r += _quantizer_reasons(getattr(lin, "input_quantizer", None), "input quantizer")
    if quant.quantizer_enabled(getattr(lin, "output_quantizer", None)):
        r.append("output quantizer enabled")
    w = lin._parameters.get("weight")
    if w is None or type(w.data) is not torch.Tensor:
        r.append("weight is not a plain tensor (tensor parallelism, offloading, compressed storage)")
    elif w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        r.append(f"weight dtype {w.dtype} (compressed storage)")
    if _hooked(lin):
        r.append("a hook sits on it (it runs as its module)")
    return r


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or getattr(m, "_hf_hook", None) is not None)


def nvfp4_linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not nvfp4_linear_reasons(m)]


def _tensor_key(t: torch.Tensor, watched: bool = False) -> tuple:
    v = tensor_version(t)  # -1: an inference tensor, whose content the plan watches (watched), else unknowable
    return (id(t), t.data_ptr(), v if v >= 0 or watched else object(), t.dtype)  # object(): remade at every call


def _fake_quant(t: torch.Tensor, amax: torch.Tensor, use_kernel: bool) -> torch.Tensor:
    return quantize_nvfp4(t, amax) if use_kernel else quantize_nvfp4_reference(t, amax)


class Nvfp4Linear:
    """Runs one ModelOpt NVFP4 linear as ``F.linear(fq(x), fq(W), bias)`` with ``fq(W)`` cached; ``use_kernel``: the
    CUDA kernel for both fake quantizations (bit-identical to ModelOpt on CUDA), else the torch reference."""

    __slots__ = ("lin", "use_kernel", "watched", "_key", "_weight", "shares_weight", "_amax_key", "_amax32", "_parts",
                 "_weight_amax")

    def __init__(self, lin: nn.Linear, use_kernel: bool, watched: bool = False) -> None:
        if reasons := nvfp4_linear_reasons(lin):
            raise ValueError("not a ModelOpt W4A4 NVFP4 linear: " + "; ".join(reasons))
        self.lin, self.use_kernel, self.watched, self.shares_weight = lin, use_kernel, watched, False
        # _parts: the content fingerprint of the weight fq(W) was made from; _weight_amax: a copy of its amax's value
        self._amax_key = self._amax32 = self._key = self._weight = self._parts = self._weight_amax = None

    def weight(self) -> torch.Tensor:
        """``fq(W)``: the linear's own weight where exact, else a copy kept per identity, pointer and version of the
        weight and its amax (an inference tensor's remade per call unless ``watched``: the plan's watch checks it)."""
        key = (*_tensor_key(self.lin.weight, self.watched), *_tensor_key(self.lin.weight_quantizer._amax, self.watched))
        if key != self._key or self._weight is None:
            with torch.no_grad():
                w = self.lin.weight.detach()
                fq = _fake_quant(w, self.lin.weight_quantizer._amax, self.use_kernel)
                self.shares_weight = torch.equal(fq.view(torch.int16 if fq.element_size() == 2 else torch.int32),
                                                 w.view(torch.int16 if w.element_size() == 2 else torch.int32))
                self._weight = w if self.shares_weight else fq
                self._parts = None if self.shares_weight else fingerprint_parts(w)
                self._weight_amax = self.lin.weight_quantizer._amax.detach().clone()
            self._key = key
        return self._weight

    def content_changed(self) -> bool:
        """Whether the weight or amaxes moved since read where no version shows it (through ``.data``); it syncs."""
        amax = self.lin.input_quantizer._amax
        if self._amax32 is not None and not torch.equal(self._amax32, amax.detach().float().reshape(1)):
            return True
        if self._weight is None:
            return False  # not made yet: made from the current values at its first use
        if not torch.equal(self._weight_amax, self.lin.weight_quantizer._amax):
            return True
        if self._parts is None:
            return False  # fq(W) is the weight itself: nothing kept to go stale
        now = fingerprint_parts(self.lin.weight)
        return now is None or not torch.equal(now, self._parts)

    def input_amax32(self) -> torch.Tensor:
        amax = self.lin.input_quantizer._amax
        key = _tensor_key(amax, self.watched)
        if key != self._amax_key or self._amax32 is None:
            self._amax32, self._amax_key = amax.detach().float().reshape(1), key
        return self._amax32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # the checked-once launch where what a call alone can change allows it (the plan decided the rest)
        if (self.use_kernel and type(x) is torch.Tensor and x.is_cuda and x.dtype in _KERNEL_DTYPES
                and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())):
            xq = launch_nvfp4(x, self.input_amax32())
        else:
            xq = _fake_quant(x, self.lin.input_quantizer._amax, self.use_kernel)
        return F.linear(xq, self.weight(), self.lin.bias)

    def extra_bytes(self) -> int:  # device memory held beyond the model's own weight
        return 0 if self._weight is None or self.shares_weight else self._weight.numel() * self._weight.element_size()


def block_runners(block: nn.Module, paths, use_kernel: bool) -> dict[nn.Module, object]:
    """The NVFP4 runners at ``paths`` by module; none below sm_89 (ModelOpt runs another kernel there)."""
    linears: dict[nn.Module, Nvfp4Linear] = {}
    for p in paths:
        if (m := resolve(block, p)) is None:
            continue
        dev = m.weight.device if isinstance(getattr(m, "weight", None), torch.Tensor) else None
        if dev is not None and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < MIN_CAPABILITY:
            return {}
        if not nvfp4_linear_reasons(m):
            linears[m] = Nvfp4Linear(m, use_kernel, watched=True)
            if use_kernel:  # on the GPU made now, never inside a graph capture; on CPU at first use
                linears[m].weight()
    return linears


def _row_ok(block: nn.Module, path: str, context_reasons) -> bool:
    """Whether the block may compute around the linear as diffusers would, no hook on the containers it skips."""
    return not context_reasons(block, path) and not any(
        m is None or _hooked(m) for m in (resolve(block, q) for q in containers(path)))


def _site_row(plan, block: nn.Module, s, sp, context_reasons) -> None:
    """Where every consumer of site ``s`` is an NVFP4 linear under one input amax, its op emits their input
    (``sp.nvfp4_amax``) for their GEMMs; else they quantize their inputs themselves (the reason joins their plans)."""
    runners = [plan.nvfp4.get(resolve(block, p)) for p in s.feeds]
    ok = [isinstance(r, Nvfp4Linear) and _row_ok(block, p, context_reasons) for r, p in zip(runners, s.feeds)]
    if not any(ok):
        return
    why = None
    if not all(ok):
        why = f"not all of {', '.join(s.feeds)} are NVFP4 linears in diffusers' context, unhooked"
    elif not sp.fused:
        why = f"{s.key} is not fused"
    elif emit_reasons(runners[0].lin.in_features):
        why = emit_reasons(runners[0].lin.in_features)[0]
    elif any(not torch.equal(r.input_amax32(), runners[0].input_amax32()) for r in runners[1:]):
        why = "different input amax: one emission cannot serve all"
    if why is not None:
        for p in s.feeds:
            plan.linears[p].fp8_reasons.append(f"NVFP4 input not emitted by {s.key} ({why}): the linear quantizes it")
        return
    sp.nvfp4_amax = runners[0].input_amax32()
    for p, r in zip(s.feeds, runners):
        plan.linears[p].nvfp4 = r


def decide_rows(plan, block: nn.Module, context_reasons) -> None:
    """NVFP4 as rows, after the runners and FP8 emissions: sites emit their consumers' input (:func:`_site_row`);
    linears fed by GELU, temb or the attention read ``quantize_nvfp4`` of it where the context is diffusers'."""
    for s in SITE_TABLE.values():
        if s.feeds and not any(plan.linears[p].fp8_gemm for p in s.feeds):
            _site_row(plan, block, s, plan.site_plan(s.key), context_reasons)
    for p, lp in plan.linears.items():
        src, r = LINEAR_TABLE[p].input_from, plan.nvfp4.get(resolve(block, p))
        if isinstance(r, Nvfp4Linear) and src in ("gelu", "temb", "attention") and _row_ok(block, p, context_reasons):
            lp.nvfp4 = r


@contextlib.contextmanager
def modelopt_fake_quant_on_cpu() -> Iterator[None]:
    """ModelOpt's NVFP4 fake quantization on CPU (where it has none) through :func:`quantize_nvfp4_reference`
    (the tests' and the benchmarks' CPU runs)."""
    tq = import_modelopt("modelopt.torch.quantization.tensor_quant")
    original = tq.dynamic_block_quantize_op

    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        if (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4) and amax is not None:
            return quantize_nvfp4_reference(inputs, amax)
        return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)

    tq.dynamic_block_quantize_op = op
    try:
        yield
    finally:
        tq.dynamic_block_quantize_op = original
