"""Real FP8 GEMMs for ModelOpt FP8 linears called as modules (Qwen-Image-2.1's processor, a hooked attention's): each
gets an :class:`Fp8LinearForward` as instance ``forward`` (torch hooks still run around it), rebuilt when its watch
sees a change; a linear wrapped, replaced or converted since runs as ModelOpt runs it. *Gated* forwards run ModelOpt's
forward except for the thread their gate is open for (``block._gated_forwards``)."""

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from . import gating, hooks, quant
from .ops.fp8 import dequant_scale
from .ops.quantize_fp8 import quantize_fp8
from .parallel import is_dtensor
from .plan import LinearPlan, Options
from .projection import fp8_linear
from .sites import ATTN_LINEARS, LINEAR21_TABLE, resolve, unwrap_peft
from .watch import Watch, fingerprint_parts

log = logging.getLogger("qwen_absorb")

LINEARS = tuple(LINEAR21_TABLE)  # the linears of a QwenImage21TransformerBlock, by path under the block
GRAD_FALLBACK = "real-FP8 linear called with grad enabled or under autocast: ModelOpt's forward (no backward)"
ARGS_FALLBACK = "real-FP8 linear called with other than one plain tensor: ModelOpt's forward"
MOVED_FALLBACK = "real-FP8 linear wrapped or replaced since patching (a PEFT adapter added?): ModelOpt's forward"
PEFT_REFUSAL = "PEFT LoRA layer on a Qwen-Image-2.1 linear: runs as PEFT and ModelOpt run it"
INFERENCE_REFUSAL = ("its weight or amax is an inference tensor (made under torch.inference_mode, so a load into "
                     "it cannot be seen): runs as its module")
WRAPPED_REFUSAL = "its forward is replaced on the instance (a hook library or user code): runs as its module"
TP_REFUSAL = "tensor parallelism (DTensor weight): the module runs it"
OnState = Callable[[int, str, bool, list], None]  # block index, path, real FP8, reasons


def refusals(linear: nn.Module, device: torch.device, options: Options) -> list[str]:
    """Why ``linear`` (ModelOpt, not PEFT-wrapped) cannot run as a real FP8 GEMM in its forward slot on ``device``."""
    if options.fp8_gemm is False:
        return ["fp8_gemm=False"]
    r = quant.fp8_linear_refusals(linear, gating.fp8_device_refusals(device, options.fp8_gemm,
                                                                     options.fp8_capabilities))
    if is_dtensor(linear._parameters.get("weight")):
        r.append(TP_REFUSAL)
    if hooks.offload_hooked(linear):
        r.append("an offloading hook manages its weights (group offloading / accelerate): the module runs them")
    wq = getattr(linear, "weight_quantizer", None)
    if any(isinstance(t, torch.Tensor) and t.is_inference() for t in (linear._parameters.get("weight"),
           quant.input_amax(linear), getattr(wq, "_amax", None), getattr(wq, "_scale", None))):
        # no version counter: a load into it in place (load_state_dict) could not be seen by the watch
        r.append(INFERENCE_REFUSAL)
    return r


def _device_of(linear: nn.Module) -> torch.device:
    w = linear._parameters.get("weight")
    dev = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Fp8LinearForward:
    """The instance ``forward`` of one ModelOpt FP8 linear and its :class:`LinearPlan` (``lp``); a deep copy decides
    anew. ``slot``: ``(parent._modules, key, parent)``; ``gate``: the thread id it is open for."""

    __slots__ = ("linear", "slot", "path", "index", "options", "counter", "rebuilds", "on_state", "lp",
                 "amax_value", "fast_accum", "device", "watch", "gated", "gate", "generation", "parts", "__weakref__")
    __qwen_absorb__ = True

    def __init__(self, linear: nn.Module, slot: tuple[dict, str, nn.Module], path: str, index: int, options: Options,
                 counter: Counter, rebuilds: Counter, on_state: OnState, gated: bool = False) -> None:
        self.__setstate__((linear, slot, path, index, options, counter, rebuilds, on_state, gated))

    def _clear(self) -> None:
        self.generation += 1
        self.lp, self.amax_value, self.fast_accum = LinearPlan(self.path), 0.0, False
        # parts: the content fingerprint of the weight the codes were made from
        self.device = self.watch = self.parts = None

    @property
    def weight(self) -> quant.Fp8Weight | None:
        return self.lp.weight

    # -- deciding
    def ready(self, device: torch.device) -> bool:
        """Whether the real FP8 GEMM runs for inputs on ``device`` now (rebuilt first if a source changed)."""
        w = self.watch
        if w is None or w.changed():
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # building an FP8 weight syncs: the module runs (what the graph records); the next eager call decides
                self._clear()
                return False
            self._decide(first=w is None)
        return self.lp.fp8_gemm and self.device == device

    def _decide(self, first: bool) -> None:
        lin, dev = self.linear, _device_of(self.linear)
        self.generation += 1
        why = [MOVED_FALLBACK] if self.slot[0].get(self.slot[1]) is not lin else refusals(lin, dev, self.options)
        lp = self.lp = LinearPlan(self.path, fp8_reasons=why)
        if not lp.fp8_reasons:
            try:
                lp.weight = quant.make_fp8_weight(lin, dev)
            except Exception as e:  # an unexpected ModelOpt state: the module's own forward is always right
                lp.fp8_reasons = [f"building the FP8 weight failed ({type(e).__name__}: {e}): runs as its module"]
        if lp.weight is not None:
            lp.fp8_gemm, self.device = True, dev
            self.parts = fingerprint_parts(lin._parameters["weight"])  # on the device: compared at patch() again
            lp.input_scale = dequant_scale(lp.weight.input_amax)
            lp.bias = lin._parameters.get("bias")
            self.amax_value = float(lp.weight.input_amax.reshape(()))  # one sync per rebuild: compared on the host
            self.fast_accum = gating.fast_accum(self.options.use_fast_accum, dev)
        switches, tensors = quant.watch_pairs(lin)
        # the parent's slot (a linear wrapped or replaced there decides anew) and the class too: ModelOpt converts
        # modules in place (mtq.compress: QuantLinear -> RealQuantQuantLinear)
        self.watch = Watch(switches + [(self.slot[2], "_modules", self.slot[1])],
                           tensors + [(lin, "_parameters", "weight"), (lin, "_parameters", "bias")], typed=[lin])
        if not first:
            self.rebuilds[f"real-FP8 linear {self.path}: its weight, quantizers or device changed"] += 1
            log.info("block %d %s: FP8 weight decided anew (%s)", self.index, self.path,
                     "real FP8" if lp.fp8_gemm else "; ".join(lp.fp8_reasons))
        self._tell()

    def content_changed(self) -> bool:
        """Whether the codes' sources moved where no version shows it (writes through ``.data``); it syncs."""
        lp = self.lp
        if lp.weight is None or self.device is None:
            return False
        now = fingerprint_parts(self.linear._parameters.get("weight"))
        return (now is None or self.parts is None or not torch.equal(now, self.parts)
                or quant.fp8_sources_moved(self.linear, lp.weight, self.device))

    def reclaim(self) -> None:
        """Back in the ``forward`` slot where ``mtq.compress`` since kept this as ``_forward_pre_dm`` behind its own
        forward, which fake-quantizes the input first: not what a model compressed before patching runs."""
        d = self.linear.__dict__
        if d.get("_forward_pre_dm") is self and d.get("forward") is not self:
            del d["_forward_pre_dm"]
            d["forward"] = self

    def _tell(self) -> None:
        self.on_state(self.index, self.path, self.lp.fp8_gemm, list(self.lp.fp8_reasons))

    def _displaced(self, why: str) -> None:  # runs as ModelOpt's from now on: derived state goes, the report hears it
        self.counter[why] += 1
        if self.lp.fp8_gemm or not self.lp.fp8_reasons:
            self.generation += 1
            self.lp, self.watch = LinearPlan(self.path, fp8_reasons=[why]), None  # decided anew once it is back
            self._tell()

    # -- running
    def __call__(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        lin = self.linear
        # kept by mtq.compress as _forward_pre_dm: its class forward quantized the input and calls this for the GEMM
        module = quant.modelopt_inner_forward if lin.__dict__.get("_forward_pre_dm") is self else type(lin).forward
        if torch.compiler.is_compiling() or (self.gated and self.gate != threading.get_ident()):
            # closed, or compiling (ModelOpt's modules as before patching): exactly the module, nothing counted
            return module(lin, input, *args, **kwargs)
        if args or kwargs or type(input) is not torch.Tensor:
            self.counter[ARGS_FALLBACK] += 1
            return module(lin, input, *args, **kwargs)
        if torch.is_grad_enabled() or torch.is_autocast_enabled(input.device.type):
            self.counter[GRAD_FALLBACK] += 1
            return module(lin, input)
        if self.slot[0].get(self.slot[1]) is not lin:
            self._displaced(MOVED_FALLBACK)
            return module(lin, input)
        if not self.ready(input.device) or input.dtype != self.lp.weight.out_dtype \
                or input.shape[-1] != self.lp.weight.codes.shape[1]:
            # refused (the report says why), or an input ModelOpt's forward must judge (it raises as unpatched)
            return module(lin, input)
        return self.gemm(self.quantize(input))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:  # the e4m3 codes of x under the input amax
        x3 = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
        if x3.shape[-1] > 1 and x3.stride(-1) != 1:
            x3 = x3.contiguous()
        codes = quantize_fp8(x3, self.lp.weight.input_amax, force_reference=self.options.force_reference)
        return codes if x.dim() == 3 else codes.reshape(x.shape)

    def gemm(self, codes: torch.Tensor) -> torch.Tensor:
        return fp8_linear(codes, self.lp, self)

    def direct(self) -> bool:
        """Whether a runner may call :meth:`gemm` instead of the linear: no hook around it, not moved."""
        lin, d = self.linear, self.linear.__dict__
        return (d.get("forward") is self and not hooks.has_hooks(lin) and self.slot[0].get(self.slot[1]) is lin
                and "_forward_pre_dm" not in d)

    # -- copies
    _STATE = ("linear", "slot", "path", "index", "options", "counter", "rebuilds", "on_state", "gated")

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, n) for n in self._STATE)

    def __setstate__(self, state: tuple) -> None:
        for n, v in zip(self._STATE, state):
            setattr(self, n, v)
        # closed; generation: bumped whenever the derived tensors are dropped or replaced (a graph reading them must
        # not replay); derived state is rebuilt from its own tensors (a copy's) at its first call
        self.gate, self.generation = 0, 0
        self._clear()

    def __repr__(self) -> str:
        return f"<qwen_absorb real-FP8 forward of block {self.index} {self.path}>"


def install(block: nn.Module, index: int, options: Options, counter: Counter, rebuilds: Counter,
            on_state: OnState, paths: Sequence[str] = LINEARS, gated: bool = False,
            ) -> dict[str, Fp8LinearForward]:
    """An :class:`Fp8LinearForward` on each eligible ModelOpt linear at ``paths``, by path."""
    installed: dict[str, Fp8LinearForward] = {}
    for path in paths:
        m = resolve(block, path)
        base, wrappers = unwrap_peft(m)
        if base is None or not quant.is_modelopt_quantizer(getattr(base, "weight_quantizer", None)):
            continue  # not ModelOpt-quantized: nothing of ours to do (not counted as a ModelOpt linear)
        why = (["fp8_gemm=False"] if options.fp8_gemm is False else [PEFT_REFUSAL] if wrappers
               else [WRAPPED_REFUSAL] if "forward" in m.__dict__
               else [TP_REFUSAL] if gated and is_dtensor(m._parameters.get("weight")) else [])
        if why:
            on_state(index, path, False, why)
            continue
        parent_path, _, name = path.rpartition(".")
        parent = resolve(block, parent_path)
        fwd = Fp8LinearForward(m, (parent._modules, name, parent), path, index, options, counter, rebuilds,
                               on_state, gated)
        object.__setattr__(m, "forward", fwd)
        installed[path] = fwd
        if gated:  # no FP8 weight until it runs; what it would decide now, for the report
            r = refusals(m, _device_of(m), options)
            on_state(index, path, not r, list(r))
        else:
            fwd.ready(_device_of(m))  # decide now, so the report says what runs
    return installed


def stale_reason(block: nn.Module, fwds: dict[str, Fp8LinearForward]) -> str | None:
    """Why the forwards :func:`install` put on ``block`` no longer match it where no call sees it, else None."""
    for path, f in fwds.items():
        base, wrappers = unwrap_peft(resolve(block, path))
        if wrappers:
            continue  # PEFT runs it now (the forward stands aside per call; an unwrap is seen by its watch)
        if base is not f.linear or of(base, converted=True) is not f:
            return f"{path} was replaced or moved since patching"
        if f.content_changed():
            return f"{path}: its weight or amaxes changed where no version shows it"
    return None


def remove(block: nn.Module, elsewhere: Sequence[Fp8LinearForward] = ()) -> None:
    """Every :class:`Fp8LinearForward` out of ``block``'s modules (``_forward_pre_dm`` too) and ``elsewhere``'s."""
    for m in [*block.modules(), *(f.linear for f in elsewhere)]:
        for slot in ("forward", "_forward_pre_dm"):
            f = m.__dict__.get(slot)
            if type(f) is Fp8LinearForward:
                del m.__dict__[slot]
                f._clear()


def of(module: nn.Module | None, converted: bool = False) -> Fp8LinearForward | None:
    """The real-FP8 forward installed on ``module``, if any; ``converted``: also one kept as ``_forward_pre_dm``."""
    d = module.__dict__ if module is not None else {}
    f = d.get("forward")
    f = d.get("_forward_pre_dm") if type(f) is not Fp8LinearForward and converted else f
    return f if type(f) is Fp8LinearForward else None


def group(parent: nn.Module, names: Sequence[str], device: torch.device) -> list[Fp8LinearForward] | None:
    """The real-FP8 forwards of ``parent``'s linears ``names`` if all run on ``device`` now under one input amax and
    may be called as their GEMM (one emission serves all), else None."""
    mods = parent.__dict__.get("_modules") or {}
    out = []
    for n in names:
        f = of(mods.get(n))
        if f is None or not f.ready(device) or not f.direct():
            return None
        out.append(f)
    a = out[0].amax_value
    return out if all(f.amax_value == a for f in out[1:]) else None
