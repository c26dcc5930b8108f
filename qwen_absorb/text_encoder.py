"""Qwen-Image's prompt encoding off the host: a cache of prompt embeddings and CUDA graphs of the text encoder.

:class:`PromptEncoder` (the pipeline's instance ``_get_qwen_prompt_embeds``) is diffusers 0.42.1's method, bit for bit:
- exact inputs encoded before (host tokens and mask, template, drop index, dtype, device; the encoder by a watch)
  return clones of the kept embeddings (true CFG's empty negative prompt is encoded once);
- on CUDA the encoder replays a graph per (token shape, exact mask): the 7B encoder is host-bound (1,232 kernels
  for 7.4 ms of GPU work at 110 tokens). Under capture transformers would build an explicit attention mask instead
  of SDPA's causal flag, so the warm-up's masks are replayed there (:class:`MaskConstants`);
- an unhooked stock encoder runs as its base model (``lm_head``'s logits, 1.1 GB of weights read, go unused), any
  stock one without a KV cache (``use_cache=False``: two concatenations a layer, which the pipeline never reads);
- the rows are planned on the host mask and copied with the inputs (diffusers reads the device mask after the
  encoder): nothing after the replay's launch waits for the device.
The watch (weights replaced or given new ``.data``, a norm's eps, a PEFT adapter's state) of the modules a text prompt
runs (not the vision tower) empties the cache and drops the graphs. Hooked encoders (offloading) run eager, whole; the
cache still applies."""

import contextlib
import sys
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import lora
from .component_patch import ComponentReport, Slot, current, install, remove
from .hooks import HOOK_DICTS
from .gating import check_tristate
from .pipeline_walks import source_hash
from .report import counts
from .watch import Watch

CONTRACT = "bit-identical to diffusers' _get_qwen_prompt_embeds (its logits not made; cache keyed on the exact inputs)"
# source_hash of diffusers 0.42.1's QwenImagePipeline._get_qwen_prompt_embeds (copied in Img2Img, Inpaint,
# ControlNet). Edit and Layered pipelines and other versions' are left alone.
REPLICATED = frozenset({"a4173bdc2ad8840d"})
# plain attributes the encoder's arithmetic reads (RMSNorm eps, RoPE and attention scales, causality): set anew, renew
_PLAIN_ATTRS = ("eps", "variance_epsilon", "attention_scaling", "scaling", "is_causal")
# hooks that run inside the captured call and only keep its tensors: transformers 5's output recording (each
# decoder layer's output for ``output_hidden_states``), installed at the encoder's first call
_CAPTURED_HOOKS = frozenset({"transformers.utils.output_capturing"})
# transformers' Qwen2.5-VL forward: ``self.model(...)`` (the hidden states), then ``lm_head`` (the logits)
_STOCK_FORWARD = ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration.forward")


@dataclass
class TextEncoderReport(ComponentReport):
    """The ``text_encoder`` section of a patch report."""

    contract: str = CONTRACT
    cache_size: int = 8
    graphs_off: str | None = None  # "cuda_graph=False": the encoder runs eager on CUDA
    cache_hits: int = 0
    cache_misses: int = 0
    encoder_changes: int = 0
    graph_refusals: Counter = field(default_factory=Counter)  # encoder calls run eager on CUDA, by reason

    def line(self) -> str:
        if not self.on:
            return "prompt encoding: diffusers' (" + "; ".join(self.reasons) + ")"
        g = self.graph_counts()
        s = f"prompt encoding: cache {self.cache_hits} hits / {self.cache_misses} misses" + (", " + g if g else "")
        if self.graph_refusals:
            s += "; eager encoder: " + counts(self.graph_refusals, 3)
        return s


def _static_reasons(pipe: Any) -> list[str]:
    reasons = [] if isinstance(getattr(pipe, "text_encoder", None), nn.Module) else ["the pipeline has no text encoder"]
    if getattr(pipe, "tokenizer", None) is None:
        reasons.append("the pipeline has no tokenizer")
    reasons += [f"the pipeline has no {a} (not a QwenImagePipeline-like prompt encoding)" for a in (
        "prompt_template_encode", "prompt_template_encode_start_idx", "tokenizer_max_length") if not hasattr(pipe, a)]
    if not callable(method := getattr(type(pipe), "_get_qwen_prompt_embeds", None)):
        reasons.append("the pipeline has no _get_qwen_prompt_embeds")
    elif source_hash([method]) not in REPLICATED:
        reasons.append(f"{type(pipe).__name__}._get_qwen_prompt_embeds is not the one PromptEncoder replicates "
                       "(QwenImagePipeline's text-only encoding of diffusers 0.42.1)")
    return reasons


def _watch(mods: list[nn.Module]) -> Watch:
    tensors = [(m, d, n) for m in mods for d in ("_parameters", "_buffers") for n in m.__dict__[d]]
    entries = [(m, "_modules", n) for m in mods for n in m._modules]
    entries += [(m, "__dict__", "forward") for m in mods]
    entries += [(m, "__dict__", k) for m in mods for k in _PLAIN_ATTRS if k in m.__dict__]
    # PEFT layers: a merge or unmerge writes .data (no version moves), disable / set_adapters / scale_layer write
    # plain state: each seen through the layer's own state
    stateful = [(m, lora.output_state) for m in mods if lora.is_lora_layer(m)]
    return Watch(entries=entries, tensors=tensors, stateful=stateful, typed=mods)


def _foreign(m: nn.Module) -> list:
    """``m``'s hooks that may change what the encoder returns: all but transformers' output recording."""
    return [fn for fn in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
            if getattr(getattr(fn, "func", fn), "__module__", None) not in _CAPTURED_HOOKS]


def _foreign_hooks(mods: list[nn.Module]) -> tuple:
    return tuple((id(m), id(fn)) for m in mods for fn in _foreign(m))


def _hooked(mods: list[nn.Module]) -> str | None:
    """Why a replay of the encoder would skip something its call runs (None: nothing)."""
    for m in mods:
        if hasattr(m, "_hf_hook") or "forward" in m.__dict__:
            return f"{type(m).__name__}'s forward is wrapped (offloading or another hook)"
        if _foreign(m):
            return f"{type(m).__name__} carries hooks"
    return None


class MaskConstants:
    """transformers' mask builders answered under capture (capturing thread only) with their warm-up answers: under
    capture ``is_tracing`` is true and an explicit mask would replace SDPA's causal flag (other kernels, other bits).
    The answers depend only on the mask and shapes, which key the graph; their tensors are kept with the graph."""

    NAMES = ("create_causal_mask", "create_sliding_window_causal_mask")

    def __init__(self, encoder: nn.Module) -> None:
        mods = {type(m).__module__ for m in encoder.modules()}
        self.modules = [sys.modules[n] for n in sorted(mods) if n in sys.modules
                        and any(callable(sys.modules[n].__dict__.get(f)) for f in self.NAMES)]
        self.recorded: list[tuple[str, Any]] = []

    def capture(self) -> Any:
        return self.warmup(iter(list(self.recorded)))

    @contextlib.contextmanager
    def warmup(self, answers: Any = None) -> Any:
        """The mask builders replaced, for this thread: recording their answers (the warm-up) or giving ``answers``."""
        owner = threading.get_ident()

        def wrap(name: str, real: Any) -> Any:
            def builder(*a: Any, **k: Any) -> Any:
                if threading.get_ident() != owner:
                    return real(*a, **k)
                if answers is None:
                    self.recorded.append((name, real(*a, **k)))
                    return self.recorded[-1][1]
                got, out = next(answers, (None, None))
                if got != name:
                    raise RuntimeError(f"{name} called out of the warm-up's order under capture")
                return out
            return builder

        saved = [(mod, n, real) for mod in self.modules for n in self.NAMES if callable(real := mod.__dict__.get(n))]
        for mod, name, real in saved:
            mod.__dict__[name] = wrap(name, real)
        try:
            yield
        finally:
            for mod, name, real in saved:
                mod.__dict__[name] = real


def _key_of(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype, t.contiguous().view(torch.uint8).numpy().tobytes())


def _plan(mask: torch.Tensor, drop_idx: int) -> tuple[torch.Tensor, int, bool]:
    """diffusers' rows (each prompt's masked-in tokens from ``drop_idx`` on, padded to the longest) from the host
    mask: the output mask (B, W), then each row's index into the flattened hidden states (0 where padded), in one
    tensor (one copy to the device); W; and whether a row is padded."""
    keep = mask.bool()
    col = keep.cumsum(1) - 1 - drop_idx  # each masked-in token's row in its prompt's output
    keep &= col >= 0
    lens = keep.sum(1)
    out_mask = (torch.arange(int(lens.max())) < lens[:, None]).long()
    rows = torch.zeros_like(out_mask)
    b, t = keep.nonzero(as_tuple=True)
    rows[b, col[b, t]] = b * mask.shape[1] + t
    return torch.cat([out_mask.flatten(), rows.flatten()]), out_mask.shape[1], not bool(out_mask.all())


class PromptEncoder(Slot):
    """The pipeline's instance ``_get_qwen_prompt_embeds`` (see the module docstring)."""

    ATTR, REPORT = "_get_qwen_prompt_embeds", TextEncoderReport

    def __init__(self, pipe: Any, report: TextEncoderReport, had_instance: Any) -> None:
        self.pipe = pipe
        self._take_encoder()
        self.cache: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        super().__init__(report, had_instance)
        report.graphs_off = "cuda_graph=False" if self.mode is False else None

    def _uncopied(self) -> dict[str, Any]:
        return {"cache": OrderedDict()}  # the kept embeddings may be autograd non-leaves, which deepcopy refuses

    def _aid(self) -> MaskConstants:
        return MaskConstants(self.encoder)

    def _run(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(input_ids=ids, attention_mask=mask, output_hidden_states=True, **self.run_kw).hidden_states[-1]

    def _take_encoder(self) -> None:
        te = self.encoder = self.pipe.text_encoder
        # the modules a text prompt runs: not the vision tower (pixel inputs only; 363 of the 7B encoder's 735)
        self.mods = [m for n, m in te.named_modules() if "visual" not in n.split(".")]
        self.watch, self.hooks = _watch(self.mods), _foreign_hooks(self.mods)
        # the hook dicts by length: a hook added or removed (_foreign_hooks says whether it matters)
        self.hook_watch = Watch(sized=[(m, "__dict__", h) for m in self.mods for h in HOOK_DICTS])
        self.hooked = _hooked(self.mods)  # why a replay would skip something (None: nothing)
        # an unhooked stock encoder whose forward is ``self.model`` (with ``language_model``), then ``lm_head``: the
        # base model gives the same hidden states without the logits
        fn = type(te).forward
        stock = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) == _STOCK_FORWARD
        base = getattr(te, "model", None)
        self.body = base if stock and not self.hooked and "language_model" in getattr(base, "_modules", ()) else te
        self.run_kw = {"use_cache": False} if stock else {}

    def renew(self) -> None:
        """Forget what was made from the encoder (kept embeddings, graphs) and watch the pipeline's encoder anew."""
        self._take_encoder()
        self.cache.clear()
        self.graphs.clear()

    def __call__(self, prompt: str | list[str] = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        pipe = self.pipe
        changed = pipe.text_encoder is not self.encoder or self.watch.changed()
        if not changed and self.hook_watch.changed():
            self.hook_watch.take()
            changed = _foreign_hooks(self.mods) != self.hooks  # transformers' own recording hooks: no change
        if changed:
            self.report.encoder_changes += 1
            self.renew()
        te = self.encoder
        device, dtype = device or pipe._execution_device, dtype or te.dtype
        prompt = [prompt] if isinstance(prompt, str) else prompt
        template, drop_idx = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
        tok = pipe.tokenizer([template.format(e) for e in prompt], max_length=pipe.tokenizer_max_length + drop_idx,
                             padding=True, truncation=True, return_tensors="pt")
        ids, mask = tok.input_ids, tok.attention_mask
        if ids.device.type != "cpu" or mask.device.type != "cpu":
            raise ValueError("the tokenizer returned tensors off the host; the prompt cache keys host tokens")
        if torch.is_grad_enabled():  # autograd (prompt tuning, an encoder LoRA trained): fresh embeddings with
            return self._encode(ids, mask, device, dtype, drop_idx)  # their graph, nothing kept (eager: _encode)
        key = (template, drop_idx, _key_of(ids), _key_of(mask), str(torch.device(device)), dtype, te.training,
               getattr(getattr(te, "config", None), "_attn_implementation", None))
        if (hit := self.cache.get(key)) is not None:
            self.cache.move_to_end(key)
            self.report.cache_hits += 1
            return hit[0].clone(), hit[1].clone()
        self.report.cache_misses += 1
        embeds, out_mask = self._encode(ids, mask, device, dtype, drop_idx)
        if self.report.cache_size > 0:
            self.cache[key] = (embeds.clone(), out_mask.clone())
            while len(self.cache) > self.report.cache_size:
                self.cache.popitem(last=False)
        return embeds, out_mask

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor, device: Any, dtype: torch.dtype,
                drop_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every host-to-device copy (each waits for the device) before the encoder is launched: none after it
        plan, width, padded = _plan(mask, drop_idx)
        ids_d, mask_d, plan = ids.to(device), mask.to(device), plan.to(device)
        hidden = None
        if ids_d.device.type == "cuda" and self.mode is not False:
            why = self.hooked or (torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and "autograd")
            if not why:
                hidden = self.graphs((tuple(ids.shape), _key_of(mask), ids_d.device), (ids_d, mask_d))
                self.report.graphs = self.graphs.describe()
            else:
                self.report.graph_refusals[why] += 1
        if hidden is None:
            hidden = self._run(ids_d, mask_d)
        # diffusers' _extract_masked_hidden, [drop_idx:], zero padding and stack: one gather of the planned rows
        out_mask = plan[: mask.shape[0] * width].view(mask.shape[0], width)
        embeds = hidden.flatten(0, 1).index_select(0, plan[out_mask.numel():]).view(*out_mask.shape, hidden.shape[-1])
        if padded:
            embeds = embeds.masked_fill(out_mask.unsqueeze(-1) == 0, 0)
        return embeds.to(dtype=dtype, device=device), out_mask


def patch(pipe: Any, *, cuda_graph: str | bool = "auto", cache_size: int = 8) -> TextEncoderReport:
    """Install :class:`PromptEncoder` as ``pipe._get_qwen_prompt_embeds``; returns the ``text_encoder`` report
    section (``on`` False with reasons, nothing installed, without a Qwen prompt encoding). ``cuda_graph=True``
    replays the encoder per (token shape, exact mask), captured at first sight; ``"auto"`` at the second call of a
    key; ``False`` leaves it eager. The prompt cache (``cache_size`` entries, 0: none) is on in every mode."""
    check_tristate("cuda_graph", cuda_graph)
    if type(cache_size) is not int or cache_size < 0:
        raise ValueError(f"cache_size must be an int >= 0, not {cache_size!r}")
    if not hasattr(pipe, "__dict__") or pipe is None:
        raise TypeError(f"text_encoder.patch needs a diffusers pipeline, got {type(pipe).__name__}")
    return install(pipe, PromptEncoder, _static_reasons, "prompt encoding", cuda_graph, cache_size=cache_size)


def unpatch(pipe: Any) -> None:
    """Restore diffusers' ``_get_qwen_prompt_embeds`` and release the cache and graphs; a no-op if not patched."""
    remove(pipe, PromptEncoder)


def report_of(pipe: Any) -> TextEncoderReport | None:
    return getattr(current(pipe, PromptEncoder), "report", None)
