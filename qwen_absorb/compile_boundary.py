"""A patched Qwen-Image block under ``torch.compile``: one opaque custom op around its eager patched forward.

Traced by Dynamo, a patched block loses what makes it fast and exact: Inductor re-fuses the chains (slower than
eager) without eager's roundings (flipping FP8 codes), and the per-call checks are not traced. So by default the
traced forward is one call of ``qwen_absorb::qwen_image_block`` running the eager patched forward (registered by
:mod:`qwen_absorb.block`, above this module). The op takes the block's ``attn.norm_q.weight`` (a graph input: one
graph serves all blocks) and finds the block by its storage."""

import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from .plan import PLAN_ATTR

_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_blocks: weakref.WeakSet = weakref.WeakSet()  # every block a PatchedForward was made for
_by_ptr: dict[int, weakref.ref] = {}
_lock = threading.Lock()


def register_forward(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The eager patched forward ``fn(block, hidden_states, encoder_hidden_states, mask, temb, rope,
    joint_attention_kwargs, modulate_index)`` the op runs."""
    global _forward
    _forward = fn


def track(block: nn.Module) -> None:
    """A block that may be called through the op (its patched forward was installed, copied or unpickled)."""
    with _lock:
        _blocks.add(block)


def handle(block: nn.Module) -> Any:
    """The parameter the op identifies ``block`` by (traced: plain attribute reads), or None."""
    w = getattr(getattr(getattr(block, "attn", None), "norm_q", None), "weight", None)
    return w if isinstance(w, torch.Tensor) else None


def call(block: nn.Module, hidden_states: Any, encoder_hidden_states: Any, encoder_hidden_states_mask: Any,
         temb: Any, image_rotary_emb: Any, joint_attention_kwargs: Any,
         modulate_index: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Under ``torch.compile``: the block's outputs from the op, or None where it cannot carry the call (traced)."""
    h, rope = handle(block), image_rotary_emb
    if (joint_attention_kwargs or h is None
            or not all(isinstance(t, torch.Tensor) for t in (hidden_states, encoder_hidden_states, temb))
            or not all(t is None or isinstance(t, torch.Tensor) for t in (encoder_hidden_states_mask, modulate_index))
            or not (rope is None or isinstance(rope, (tuple, list)) and len(rope) == 2
                    and all(isinstance(f, torch.Tensor) for f in rope))):
        return None
    if encoder_hidden_states.dtype != hidden_states.dtype or temb.dtype != hidden_states.dtype:
        return None  # the outputs' dtype would follow diffusers' type promotion: traced instead
    f_img, f_txt = (None, None) if rope is None else rope
    return torch.ops.qwen_absorb.qwen_image_block(h, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                                  temb, f_img, f_txt, modulate_index)


def _find(h: torch.Tensor) -> nn.Module:
    """The tracked block holding ``h``; a patched one where an unpatched copy shares it."""
    ptr = h.data_ptr()
    b = ref() if (ref := _by_ptr.get(ptr)) is not None else None
    if b is not None and _ptr(b) == ptr:
        return b
    with _lock:
        found = [b for b in list(_blocks) if _ptr(b) == ptr]
        if len(found) > 1:
            found = [b for b in found if PLAN_ATTR in b.__dict__]
        if len(found) == 1:
            if len(_by_ptr) > 4 * len(_blocks) + 64:  # forget addresses of freed or moved parameters
                _by_ptr.clear()
            _by_ptr[ptr] = weakref.ref(found[0])
            return found[0]
    if not found:
        raise RuntimeError("qwen_absorb: a compiled patched Qwen-Image block was called with an attn.norm_q.weight "
                           "no patched block holds; call torch._dynamo.reset() and compile again")
    raise RuntimeError("qwen_absorb: several patched blocks share the storage of attn.norm_q.weight, so the "
                       "compiled op cannot tell them apart; patch with kernels_under_compile=True or False")


def _ptr(b: nn.Module) -> int | None:
    h = handle(b)
    return h.data_ptr() if h is not None else None


def _own(out: torch.Tensor, like: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """``out`` as the op's fake promised it: ``like``'s dtype, contiguous, not aliasing an input."""
    if out.dtype != like.dtype or out.shape != like.shape:
        raise RuntimeError(f"qwen_absorb: the patched block returned {out.dtype} {tuple(out.shape)} where "
                           f"{like.dtype} {tuple(like.shape)} was traced")
    out = out.contiguous()
    ptr = out.untyped_storage().data_ptr()
    if any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == ptr for t in inputs):
        out = out.clone()
    return out


@torch.library.custom_op("qwen_absorb::qwen_image_block", mutates_args=())
def _op(handle_: torch.Tensor, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None, temb: torch.Tensor, img_freqs: torch.Tensor | None,
        txt_freqs: torch.Tensor | None, modulate_index: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if _forward is None:
        raise RuntimeError("qwen_absorb: the patched block forward is not registered (qwen_absorb.block not imported)")
    block = _find(handle_)
    rope = None if img_freqs is None else (img_freqs, txt_freqs)
    txt, img = _forward(block, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, rope, None,
                        modulate_index)
    inputs = (hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, img_freqs, txt_freqs,
              modulate_index, handle_)
    return _own(txt, encoder_hidden_states, inputs), _own(img, hidden_states, inputs)


@_op.register_fake
def _(handle_, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, img_freqs, txt_freqs,
      modulate_index):
    return (torch.empty_like(encoder_hidden_states, memory_format=torch.contiguous_format),
            torch.empty_like(hidden_states, memory_format=torch.contiguous_format))
