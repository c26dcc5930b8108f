"""Real FP8 GEMMs for the ModelOpt FP8 linears of Qwen-Image-2.1 blocks, in each linear's own forward slot.

Qwen-Image-2.1's linears are called by code that is not ours: ``attn.to_q/to_k/to_v/to_out.0`` by
diffusers' attention processors (segment and flex, with the prefix KV cache), ``img_mlp.*`` by our block
runner or by ``img_mlp.forward``. Rather than reimplementing the attention, :func:`install` puts an
:class:`Fp8LinearForward` in every qualifying linear's instance ``forward`` (``module.__dict__``), which is
what ``nn.Module.__call__`` runs: torch hooks on the linear still run around it (a pre-hook may replace
the input, a forward hook may edit the output), and whoever calls the linear gets a real FP8
``torch._scaled_mm`` where ModelOpt would have fake-quantized.

The codes of the input come from one of two places:

- handed over: the block runner's fused op wrote the activation *and* its e4m3 codes in one launch
  (norm1 for to_q/to_k/to_v, norm2 for gate_layer/proj, SwiGLU for out) and hands the codes over for
  exactly that tensor (:meth:`Fp8LinearForward.hand`): the forward uses them only when called with the
  same tensor object, at the same version (not modified in place since), under the same input amax;
- otherwise quantized here (:func:`qwen_absorb.ops.quantize_fp8`: the kernel on CUDA, the reference
  elsewhere), e.g. ``to_out.0``, whose input the attention processor computes.

Either way the codes are bit-identical to ``quantize_fp8_reference`` of the value the linear receives. The
GEMM is :func:`qwen_absorb.projection.fp8_linear`'s: ``scale_a = input amax / 448``, ``scale_b`` the weight's
dequantization scale, fp32 accumulation (fast accumulation per ``use_fast_accum``), the bias in the epilogue.

Derived state never goes stale: the FP8 weight is built lazily and rebuilt whenever a
:class:`~qwen_absorb.watch.Watch` of its sources reports a change (host metadata, checked at every call:
the weight Parameter by identity / version / address, which sees ``load_state_dict`` with or without
``assign``, ``.to()`` moves and casts; the quantizers' amax and scale buffers; their switches, which see
``mtq.disable_quantizer``; a quantizer replaced). A linear that no longer qualifies runs as its module
(ModelOpt's forward). A linear replaced or wrapped since patching (a PEFT LoRA adapter added, whose merges
write ``weight.data`` without a version bump) is seen through its parent's ``_modules`` slot and runs as
its module too. PEFT LoRA layers present at patch time are refused (they run as PEFT + ModelOpt run them).

The same objects serve the attention linears of a patched Qwen-Image block whose attention runs as its
module because a hook sits on it (a diffusers cache: TaylorSeer hooks every ``attn``): installed *gated*
(``install(..., paths=ATTN_LINEARS, gated=True)``), such an object runs ModelOpt's forward unchanged
except while the block itself calls ``block.attn(...)`` on that path with the gate opened
(:class:`opened`, per object and per thread). Whole-block fallbacks (grad, hooks, diffusers' own
forward) therefore compute exactly what the unpatched model computes. Its FP8 weight is built at its
first opened call, not at install.

Floor: a runner (how one linear runs); it reads ModelOpt only through :mod:`qwen_absorb.quant`.
"""

from __future__ import annotations

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
from .sites import resolve, unwrap_peft
from .watch import Watch, tensor_version

log = logging.getLogger("qwen_absorb")

# The linears of a QwenImage21TransformerBlock, by path under the block.
LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
           "img_mlp.out")
# The attention linears of a QwenImageTransformerBlock, called by diffusers' processor when the attention
# runs as its module (gated forwards).
ATTN_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                "attn.to_out.0", "attn.to_add_out")
GRAD_FALLBACK = "real-FP8 linear called with grad enabled or under autocast: ModelOpt's forward (no backward)"
ARGS_FALLBACK = "real-FP8 linear called with other than one plain tensor: ModelOpt's forward"
MOVED_FALLBACK = "real-FP8 linear wrapped or replaced since patching (a PEFT adapter added?): ModelOpt's forward"
PEFT_REFUSAL = "PEFT LoRA layer on a Qwen-Image-2.1 linear: runs as PEFT and ModelOpt run it"
WRAPPED_REFUSAL = "its forward is replaced on the instance (a hook library or user code): runs as its module"

OnState = Callable[[int, str, bool, list, bool, float, bool], None]


_version = tensor_version  # -1 for inference tensors (no version counter)


def refusals(linear: nn.Module, device: torch.device, options: Any) -> list[str]:
    """Why ``linear`` (a ModelOpt linear, not PEFT-wrapped) cannot run as a real FP8 GEMM on ``device``
    under ``options`` (a :class:`qwen_absorb.plan.Options`); empty: it can."""
    dev = gating.fp8_device_refusals(device, options.fp8_gemm, options.fp8_capabilities)
    if dev == ["fp8_gemm=False"]:
        return dev
    r = quant.fp8_gemm_reasons(linear) + dev
    w = linear._parameters.get("weight")
    if isinstance(w, torch.Tensor):
        if is_dtensor(w):
            r.append("tensor parallelism (DTensor weight): the module runs it")
        elif type(w.data) is not torch.Tensor and type(w).__name__ != "QTensorWrapper":
            r.append(f"weight is a {type(w.data).__name__}: the GEMM must stay the module's")
        if w.device.type == "meta":
            r.append("weight on the meta device (offload hook)")
        if getattr(w, "metadata", {}).get("dtype", w.dtype) not in (torch.bfloat16, torch.float16):
            r.append("activations are not bf16/fp16")
    if hooks.offload_hooked(linear):
        r.append("an offloading hook manages its weights (group offloading / accelerate): the module runs them")
    return r


class Fp8LinearForward:
    """The instance ``forward`` of one ModelOpt FP8 linear of a patched Qwen-Image-2.1 block.

    A plain object holding the linear (``copy.deepcopy`` rebinds it to the copy; the copy rebuilds its
    derived state at its first call). ``slot`` is the parent's ``_modules`` dict and key under which the
    linear was installed. ``gated``: it runs the real FP8 GEMM only while :class:`opened` in this thread
    (``gate`` holds that thread's id; 0: closed), else ModelOpt's forward.
    ``on_state(index, path, fp8, reasons, reused_storage, input_amax, fast_accum)`` tells the report after
    every decision; ``counter`` / ``rebuilds`` are the report's counters.
    """

    __slots__ = ("linear", "slot", "path", "index", "options", "counter", "rebuilds", "on_state",
                 "weight", "input_scale", "amax_value", "fast_accum", "device", "reasons", "watch", "handed",
                 "gated", "gate", "generation", "__weakref__")
    __qwen_absorb__ = True

    def __init__(self, linear: nn.Module, slot: tuple[dict, str], path: str, index: int, options: Any,
                 counter: Counter, rebuilds: Counter, on_state: OnState | None, gated: bool = False) -> None:
        self.linear, self.slot, self.path, self.index, self.options = linear, slot, path, index, options
        self.counter, self.rebuilds, self.on_state = counter, rebuilds, on_state
        self.gated, self.gate = gated, 0
        # bumped whenever the derived tensors are dropped or replaced: a CUDA graph that read them must not be
        # replayed after (the graph runner compares it before every launch, see cuda_graph.fingerprint)
        self.generation = 0
        self._clear()

    def _clear(self) -> None:
        self.generation += 1
        self.weight: quant.Fp8Weight | None = None
        self.input_scale: torch.Tensor | None = None
        self.amax_value = 0.0
        self.fast_accum = False
        self.device: torch.device | None = None
        self.reasons: list[str] = []
        self.watch: Watch | None = None
        self.handed: dict[int, tuple] = {}  # id(x) -> (x, version of x, input amax, codes of x)

    # -- deciding
    def ready(self, device: torch.device) -> bool:
        """Whether the real FP8 GEMM runs for inputs on ``device`` now, its derived state rebuilt first
        if any of its sources changed (host metadata only: no device sync unless something changed)."""
        w = self.watch
        if w is None or w.changed():
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # building an FP8 weight syncs (and would allocate from the graph's pool): not inside a
                # CUDA-graph capture. The module runs (ModelOpt's forward, what the graph records); the
                # next eager call decides.
                self.weight, self.watch = None, None
                self.generation += 1
                return False
            self._decide(first=w is None)
        return self.weight is not None and self.device == device

    def _decide(self, first: bool) -> None:
        lin = self.linear
        w = lin._parameters.get("weight")
        dev = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        self.weight, self.input_scale = None, None
        self.generation += 1
        r = refusals(lin, dev, self.options)
        fw = None
        if not r:
            try:
                fw = quant.make_fp8_weight(lin, dev)
            except Exception as e:  # an unexpected ModelOpt state: the module's own forward is always right
                r = [f"building the FP8 weight failed ({type(e).__name__}: {e}): runs as its module"]
        if fw is not None:
            self.weight, self.device = fw, dev
            self.input_scale = dequant_scale(fw.input_amax)
            self.amax_value = float(fw.input_amax.reshape(()))  # one sync per rebuild: groups compare on the host
            self.fast_accum = gating.fast_accum(self.options.use_fast_accum, dev)
        self.reasons = r
        switches, tensors = quant.watch_pairs(lin)
        # the class too: ModelOpt converts modules in place (mtq.compress: QuantLinear -> RealQuantQuantLinear)
        self.watch = Watch(switches, tensors + [(lin, "_parameters", "weight")], typed=[lin])
        if not first:
            self.rebuilds[f"real-FP8 linear {self.path}: its weight, quantizers or device changed"] += 1
            log.info("block %d %s: FP8 weight decided anew (%s)", self.index, self.path,
                     "real FP8" if fw is not None else "; ".join(r))
        if self.on_state is not None:
            self.on_state(self.index, self.path, fw is not None, list(r), bool(fw is not None and fw.reused_storage),
                          self.amax_value, self.fast_accum)

    # -- running
    def __call__(self, input: Any, *args: Any, **kwargs: Any) -> Any:
        lin = self.linear
        compiling = torch.compiler.is_compiling()
        if self.gated and (compiling or self.gate != threading.get_ident()):
            return type(lin).forward(lin, input, *args, **kwargs)  # closed: exactly the module, nothing counted
        why = None
        if compiling:
            pass  # ModelOpt's modules, as before patching (traced or not is torch.compile's business)
        elif args or kwargs or type(input) is not torch.Tensor:
            why = ARGS_FALLBACK
        elif torch.is_grad_enabled() or torch.is_autocast_enabled(input.device.type):
            why = GRAD_FALLBACK
        elif self.slot[0].get(self.slot[1]) is not lin:
            why = MOVED_FALLBACK
        if compiling or why is not None:
            if why is not None:
                self.counter[why] += 1
            return type(lin).forward(lin, input, *args, **kwargs)
        if not self.ready(input.device) or input.dtype != self.weight.out_dtype \
                or input.shape[-1] != self.weight.codes.shape[1]:
            # refused (the report says why), or an input ModelOpt's forward must judge (it raises as unpatched)
            return type(lin).forward(lin, input)
        codes = self._handed(input) if self.handed else None
        if codes is None:
            codes = self.quantize(input)
        return self.gemm(codes)

    def hand(self, x: torch.Tensor, codes: torch.Tensor, amax_value: float) -> None:
        """The e4m3 codes of ``x`` under ``amax_value``, for this linear's next call with ``x``."""
        self.handed[id(x)] = (x, _version(x), amax_value, codes)

    def take_back(self, x: torch.Tensor) -> None:
        self.handed.pop(id(x), None)

    def _handed(self, x: torch.Tensor) -> torch.Tensor | None:
        h = self.handed.get(id(x))
        if h is None or h[0] is not x or h[1] != _version(x) or h[2] != self.amax_value:
            return None  # another tensor (a pre-hook replaced it), modified in place, or another amax
        return h[3]

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The e4m3 codes of ``x`` under the input amax: the kernel on CUDA, the reference elsewhere."""
        x3 = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
        if x3.shape[-1] > 1 and x3.stride(-1) != 1:
            x3 = x3.contiguous()
        codes = quantize_fp8(x3, self.weight.input_amax, force_reference=self.options.force_reference)
        return codes if x.dim() == 3 else codes.reshape(x.shape)

    def gemm(self, codes: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` from the codes of ``x`` ([..., K]) -> [..., N] in the linear's dtype: the GEMM of
        :func:`qwen_absorb.projection.fp8_linear` (the bias in the epilogue when it has the output's dtype)."""
        w = self.weight
        a = codes.reshape(-1, codes.shape[-1])
        if not a.is_contiguous():
            a = a.contiguous()
        bias = self.linear._parameters.get("bias")
        fuse = bias is not None and bias.dtype == w.out_dtype and w.out_dtype != torch.float32
        out = torch._scaled_mm(a, w.codes.t(), scale_a=self.input_scale, scale_b=w.scale,
                               bias=bias if fuse else None, out_dtype=w.out_dtype, use_fast_accum=self.fast_accum)
        if bias is not None and not fuse:
            out = out + bias.to(out.dtype)
        return out.reshape(*codes.shape[:-1], out.shape[-1])

    def direct(self) -> bool:
        """Whether a runner may call :meth:`gemm` instead of the linear: nothing else would run around
        the forward (no torch / diffusers / accelerate hook; the block runner checks global hooks)."""
        lin = self.linear
        return (lin.__dict__.get("forward") is self and not hooks.has_hooks(lin)
                and self.slot[0].get(self.slot[1]) is lin)

    # -- copies
    def __getstate__(self) -> tuple:
        return (self.linear, self.slot, self.path, self.index, self.options, self.counter, self.rebuilds,
                self.on_state, self.gated)

    def __setstate__(self, state: tuple) -> None:
        (self.linear, self.slot, self.path, self.index, self.options, self.counter, self.rebuilds,
         self.on_state, self.gated) = state
        self.gate, self.generation = 0, 0  # a copy starts closed
        self._clear()  # derived state is rebuilt from the copy's own tensors at its first call

    def __repr__(self) -> str:
        return f"<qwen_absorb real-FP8 forward of block {self.index} {self.path}>"


# ---------------------------------------------------------------------------- the patch floor's calls


def install(block: nn.Module, index: int, options: Any, counter: Counter, rebuilds: Counter,
            on_state: OnState | None, paths: Sequence[str] = LINEARS,
            gated: bool = False) -> dict[str, tuple[bool, list[str]]]:
    """Put an :class:`Fp8LinearForward` on every ModelOpt linear of ``block`` among ``paths`` that may
    become a real FP8 GEMM (the device is decided per call: a model patched on the CPU and moved to CUDA
    gets them there). Returns ``{path: (installed, reasons)}`` for the ModelOpt linears; linears refused
    here (PEFT-wrapped, forward already replaced, ``fp8_gemm=False``; gated: a DTensor weight) are reported
    through ``on_state`` with the reason. ``gated``: installed closed (see :class:`opened`), the FP8 weight
    built at the first opened call; the report hears ``refusals`` for the weight's device meanwhile."""
    out: dict[str, tuple[bool, list[str]]] = {}
    for path in paths:
        m = resolve(block, path)
        base, wrappers = unwrap_peft(m)
        if base is None or not quant.is_modelopt_quantizer(getattr(base, "weight_quantizer", None)):
            continue  # not ModelOpt-quantized: nothing of ours to do (not counted as a ModelOpt linear)
        why = []
        if options.fp8_gemm is False:
            why = ["fp8_gemm=False"]
        elif wrappers:
            why = [PEFT_REFUSAL]
        elif "forward" in m.__dict__:
            why = [WRAPPED_REFUSAL]
        elif gated and is_dtensor(m._parameters.get("weight")):
            why = ["tensor parallelism (DTensor weight): the module runs it"]
        if why:
            out[path] = (False, why)
            if on_state is not None:
                on_state(index, path, False, why, False, 0.0, False)
            continue
        parent_path, _, name = path.rpartition(".")
        parent = resolve(block, parent_path)
        fwd = Fp8LinearForward(m, (parent._modules, name), path, index, options, counter, rebuilds, on_state, gated)
        object.__setattr__(m, "forward", fwd)
        w = m._parameters.get("weight")
        dev = w.device if isinstance(w, torch.Tensor) else torch.device("cpu")
        if gated:  # no FP8 weight until it runs; what it would decide now, for the report
            r = refusals(m, dev, options)
            if on_state is not None:
                on_state(index, path, not r, list(r), False, 0.0, False)
            out[path] = (True, r)
            continue
        fwd.ready(dev)  # decide now, so the report says what runs
        out[path] = (True, list(fwd.reasons))
    return out


def remove(block: nn.Module) -> int:
    """Take every :class:`Fp8LinearForward` out of ``block``'s modules (wherever they are now: a linear
    wrapped by PEFT since still holds one); their FP8 weights go with them. Returns how many."""
    n = 0
    for m in block.modules():
        f = m.__dict__.get("forward")
        if type(f) is Fp8LinearForward:
            del m.__dict__["forward"]
            f._clear()
            n += 1
    return n


def release(block: nn.Module, paths: Sequence[str] = ATTN_LINEARS) -> None:
    """Drop the derived state (FP8 weights) of the gated forwards of ``block``'s ``paths``: the plan runs
    those linears otherwise now; an opened call later rebuilds it."""
    for p in paths:
        f = of(resolve(block, p))
        if f is not None and f.gated and f.watch is not None:
            f._clear()


class opened:  # noqa: N801  (a context manager, named for the with statement)
    """``with opened(fwds):`` the gated forwards ``fwds`` run real FP8 GEMMs for calls from this thread
    (another thread calling the same linears meanwhile gets ModelOpt's forward); closed again after,
    whatever happens (nesting restores the outer state)."""

    __slots__ = ("fwds", "prev")

    def __init__(self, fwds: Sequence[Fp8LinearForward]) -> None:
        self.fwds, self.prev = fwds, []

    def __enter__(self) -> None:
        me = threading.get_ident()
        self.prev = [f.gate for f in self.fwds]
        for f in self.fwds:
            f.gate = me

    def __exit__(self, *exc: object) -> None:
        for f, g in zip(self.fwds, self.prev):
            f.gate = g


def gated(block: nn.Module, paths: Sequence[str] = ATTN_LINEARS) -> list[Fp8LinearForward]:
    """The gated forwards installed on ``block``'s linears ``paths`` now (a linear replaced or PEFT-wrapped
    since is not found: it runs as its module)."""
    out = []
    for p in paths:
        f = of(resolve(block, p))
        if f is not None and f.gated:
            out.append(f)
    return out


def of(module: nn.Module | None) -> Fp8LinearForward | None:
    """The real-FP8 forward installed on ``module``, if any."""
    f = module.__dict__.get("forward") if module is not None else None
    return f if type(f) is Fp8LinearForward else None


def group(parent: nn.Module, names: Sequence[str], device: torch.device) -> list[Fp8LinearForward] | None:
    """The real-FP8 forwards of ``parent``'s linears ``names`` when every one runs a real FP8 GEMM on
    ``device`` now under one input amax (so one emission serves all), else None."""
    mods = parent.__dict__.get("_modules") or {}
    out = []
    for n in names:
        f = of(mods.get(n))
        if f is None or not f.ready(device):
            return None
        out.append(f)
    a = out[0].amax_value
    return out if all(f.amax_value == a for f in out[1:]) else None


def hand(fwds: Sequence[Fp8LinearForward], x: torch.Tensor, codes: torch.Tensor) -> None:
    for f in fwds:
        f.hand(x, codes, fwds[0].amax_value)


def take_back(fwds: Sequence[Fp8LinearForward], x: torch.Tensor) -> None:
    for f in fwds:
        f.take_back(x)


__all__ = ["ATTN_LINEARS", "LINEARS", "Fp8LinearForward", "gated", "group", "hand", "install", "of", "opened",
           "refusals", "release", "remove", "take_back"]
