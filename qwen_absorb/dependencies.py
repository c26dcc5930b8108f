"""What a block's decisions depend on: user hooks, the modules the fused path skips (checked per call), and the
:class:`~qwen_absorb.watch.Watch` of what decisions and derived state were made from."""

import threading
import weakref
from typing import Any

import torch
from torch import nn

from . import hooks, lora, parallel, quant, step_caches, taylorseer
from .sites import LINEAR_TABLE, NORMS, SITE_TABLE, containers, resolve, unwrap_peft
from .watch import Watch

QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_WATCHED_PATHS = (*LINEAR_TABLE, *NORMS, "img_mod.0", "txt_mod.0", "img_mlp.net.0", "img_mlp.net.1",
                  "txt_mlp.net.0", "txt_mlp.net.1", "attn.to_out.1", *(f"attn.{n}" for n in QK_NORMS))
_HOOK_HOLDERS = ("attn", "img_mod", "txt_mod", "img_mlp", "txt_mlp")  # containers whose calls a plan may skip
# plain attributes of watched modules that decisions copy or check (NormInfo.eps, plan.qk_eps; GELU's approximate:
# the FP8 path fuses GELU(tanh) into the codes of net.2's input)
_PLAIN_ATTRS = ("eps", "approximate")
_BLOCK_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BLOCK_LOCKS_GUARD = threading.Lock()


def _layers(block: nn.Module, path: str) -> list[tuple[nn.Module, int]]:
    """``path``'s PEFT wrappers and base module, each with its count of TP style hooks (1: one pre-hook, one hook)."""
    base, wrappers = unwrap_peft(resolve(block, path))
    return [(x, int(isinstance(x, nn.Linear) and parallel.is_dtensor(x._parameters.get("weight"))
                    and parallel.tp_shard_reasons(x, own_forward=False)[0] is not None))
            for x in (*wrappers, base) if x is not None]


def hooked(block: nn.Module, *paths: str) -> str | None:
    """The first of ``paths`` (or a PEFT wrapper / base of it) carrying a user's forward hook, else None."""
    return next((p for p in paths if any(hooks.user_hooked(x.__dict__, n, n) for x, n in _layers(block, p))), None)


def hook_refusal(block: nn.Module, what: str, *paths: str) -> list[str]:
    """A user's hook on a module ``what`` would skip or change: that part runs as its module instead."""
    return [f"a forward hook on {h}: {what}"] if (h := hooked(block, *paths)) is not None else []


def attention_cache_kind(block: nn.Module) -> str | None:
    """The cache, ``block.attn``'s only hook, the block runs around its own attention (TaylorSeer, PAB), or None."""
    attn = block._modules.get("attn")
    if attn is not None and taylorseer.supported_hook(attn) is not None:
        return "TaylorSeer"
    return step_caches.PAB if attn is not None and step_caches.attention_hook(attn) is not None else None


def attention_cache(block: nn.Module) -> bool:
    """``block.attn``'s only hook is a cache the block runs around its own attention (:func:`attention_cache_kind`)."""
    return attention_cache_kind(block) is not None


def attention_hook_refusal(block: nn.Module) -> list[str]:
    """:func:`hook_refusal` for the attention as a whole, except a cache hook the block runs itself."""
    return [] if attention_cache(block) else hook_refusal(block, "the attention runs as its module", "attn")


def weight_moving_hook(block: nn.Module) -> tuple[str, nn.Module, str] | None:
    """``(path, module, category)`` of a module in ``block`` whose weights a hook moves or casts only around its own
    call (leaf offloading, layerwise casting), or None: the fused path reads weights without calling their module."""
    return next(((path, m, kind) for path, m in block.named_modules()
                 if path and (kind := hooks.weight_moving(m)) is not None), None)


def bypassed(plan: Any, block: nn.Module) -> tuple[tuple[dict, int, int], ...]:
    """The modules whose hooks the fused path would skip or show other values to."""
    paths: list[str] = [s.norm for s in SITE_TABLE.values() if s.norm and plan.site_plan(s.key).fused]
    for proj in plan.deferred_paths():
        paths += ["attn" if proj.startswith("attn.") else proj.split(".")[0], proj]
    paths += [q for p, lp in plan.linears.items() if lp.fp8_gemm for q in (p, *containers(p))]
    if plan.own_attention:
        if not plan.attn_cache:  # a TaylorSeer / PAB hook on attn runs inside the block (its cache's run)
            paths.append("attn")
        if plan.qk_fused:
            paths += [f"attn.{n}" for n in QK_NORMS]
    # torch's TP style hooks: one of each
    return tuple({id(x.__dict__): (x.__dict__, n, n) for p in paths for x, n in _layers(block, p)}.values())


def derived_only_sources(plan: Any, block: nn.Module) -> list[torch.Tensor]:
    """The tensors only derived state is made from (FP8 linears' weights, amaxes; unaliased): no graph reads them."""
    derived, sources = set(), []
    for p, lp in plan.linears.items():
        w = lp.weight
        if not lp.fp8_gemm or w is None:
            continue
        derived.update(map(_storage_ptr, (w.codes, w.scale, w.input_amax, lp.input_scale, lp.bias)))
        if (base := unwrap_peft(resolve(block, p))[0]) is None:
            continue
        wq = getattr(base, "weight_quantizer", None)
        sources += [base._parameters.get("weight"), quant.input_amax(base), getattr(wq, "_amax", None),
                    getattr(wq, "_scale", None)]
    return [t for t in sources if (ptr := _storage_ptr(t)) is not None and ptr not in derived]


def _storage_ptr(t: Any) -> int | None:
    """Where ``t``'s storage starts; None for a non-tensor or a tensor without one (e.g. a DTensor)."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensor subclasses without storage
        return None


def block_lock(block: nn.Module) -> threading.RLock:
    """The one lock of ``block`` for all its plans (an old plan's call may run during ``patch()`` / ``unpatch()``)."""
    with _BLOCK_LOCKS_GUARD:
        return _BLOCK_LOCKS.setdefault(block, threading.RLock())


def watch(block: nn.Module) -> Watch:
    """Everything the decisions and the derived state depend on (see :mod:`qwen_absorb.watch`)."""
    entries, tensors, sized, modules, stateful = {}, {}, {}, {}, []  # (id, dict, key) -> watched entry; id -> module

    def add(into: dict, *es: tuple) -> None:
        for e in es:
            into.setdefault((id(e[0]), e[1], e[2]), e)

    for path in _WATCHED_PATHS:
        m: nn.Module | None = block
        for part in path.split("."):  # the chain of _modules entries down to it: replacement is seen
            if m is not None and "_modules" in m.__dict__:
                add(entries, (m, "_modules", part))
                m = m._modules.get(part)
            else:
                m = None
        if m is None:
            continue
        base, wrappers = unwrap_peft(m)
        for x in (*wrappers, base):
            modules[id(x)] = x  # (its forward and hook dicts: below)
            # a norm's eps set anew (the fused ops take the decided one)
            add(entries, *((x, "__dict__", k) for k in _PLAIN_ATTRS if k in x.__dict__))
            add(tensors, (x, "_parameters", "weight"), (x, "_parameters", "bias"))
            for into, es in zip((entries, tensors), quant.watch_pairs(x)):
                add(into, *es)
            if "base_layer" in x._modules:
                add(entries, (x, "_modules", "base_layer"))
        stateful += [(w, lora.state) for w in wrappers if lora.is_lora_layer(w)]
    if (attn := block._modules.get("attn")) is not None:
        add(entries, (attn, "__dict__", "processor"), (attn, "__dict__", "heads"))  # heads: the fused head split
        for into, es in zip((entries, tensors), quant.watch_pairs(attn, quant.ATTENTION_QUANTIZERS)):
            add(into, *es)  # ModelOpt's QuantAttention: enabled after
    modules.update((id(m), m) for p in _HOOK_HOLDERS if (m := resolve(block, p)) is not None)
    for m in modules.values():  # a hook added or removed: decide again
        add(entries, (m, "__dict__", "forward"))
        add(sized, *((m, "__dict__", name) for name in hooks.HOOK_DICTS))
    # typed: a class converted in place (mtq.quantize)
    return Watch(entries.values(), tensors.values(), stateful, sized=sized.values(), typed=modules.values())
