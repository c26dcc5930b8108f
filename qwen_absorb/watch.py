"""What a block's decisions depend on, compared on every call without a device sync.

A :class:`Watch` holds ``(owner, holder, key)`` entries, ``owner.__dict__`` (``"__dict__"``) or a module dict in
it (``"_parameters"``, ``"_modules"``, ``"_buffers"``), so a copy (``deepcopy``, pickle) is rebuilt on the copy's
own objects. It compares: ``entries`` by identity (a module, parameter or buffer replaced; a bool switch
flipped: singletons); ``tensors`` also by ``_version`` and ``data_ptr`` (in place, ``param.data = ...``; an
inference tensor by :func:`content_fingerprint`); ``sized`` (present now) by length (a hook added or removed);
``typed`` by class (a module converted in place, as ``mtq.quantize`` does); ``stateful`` ``(object, fn)`` by
``fn(object)`` (PEFT layers); and a submodule registered into a watched ``_modules`` slot since, even where the slot
holds the same module again (torch's registration hook). All but the last in C-level ``map`` loops: a block's watch holds ~700 values, asked
by each of 60 blocks per eager call. A change means the derived state may be stale: the block decides again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter, is_not
from typing import Any

import torch
from torch import nn

from .hooks import HeldGlobalHooks

Entry = tuple[Any, str, str]  # (owner object, "__dict__" or the name of a dict in it, key)

_version_of = attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr


def tensor_version(t: Any) -> int:
    """``t._version``, or -1 for an inference tensor (asked first: torch's exception costs tens of microseconds)."""
    if t.is_inference():
        return -1
    try:
        return t._version
    except Exception:
        return -1


_version = tensor_version
_BY_ID = ("_modules", "_parameters")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAMPLE = 4096


def content_fingerprint(t: Any) -> tuple[int, ...] | None:
    """A cheap fingerprint of ``t``'s values where versions cannot be trusted (inference tensors; writes through
    ``.data``: PEFT's merges, ``fuse_lora``): over the bit patterns, integer sum and xor (``torch.hash_tensor``:
    together they see any change short of an exact compensation) and a position-weighted sum of ~4k strided
    samples (a permutation). One read, no temporary of its size, one sync; None for meta or subclasses."""
    return content_fingerprints([t])[0]


def content_fingerprints(ts: Sequence[Any]) -> list[tuple[int, ...] | None]:
    """:func:`content_fingerprint` of each of ``ts``, read back with one sync per device rather than one per
    tensor (a watch over a block's inference tensors, each bias and norm weight of it, under model offload)."""
    out: list[tuple[int, ...] | None] = [None] * len(ts)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(ts):
        parts = fingerprint_parts(t)
        if parts is not None:
            by_device.setdefault(parts.device, []).append((i, parts))
    for group in by_device.values():
        try:
            values = torch.stack([p for _, p in group]).tolist()
        except Exception:  # noqa: BLE001 - unreadable (a sticky device error): no fingerprints, as one at a time
            continue
        for (i, _), v in zip(group, values):
            out[i] = tuple(v)
    return out


def fingerprint_parts(t: Any) -> torch.Tensor | None:
    """The three int64 parts of ``t``'s fingerprint, on its device (nothing read back), or None: kept where a
    source's content is compared only at ``patch()`` again (:meth:`qwen_absorb.nvfp4.Nvfp4Linear.content_changed`)."""
    try:
        x = t.detach()
        if x.device.type == "meta" or type(x) is not torch.Tensor or x.element_size() not in _BITS:
            return None
        flat = x.reshape(-1).view(_BITS[x.element_size()])
        sample = flat[:: max(1, flat.numel() // _SAMPLE)].to(torch.int64)
        weights = torch.arange(1, sample.numel() + 1, device=sample.device, dtype=torch.int64)
        return torch.stack([flat.sum(dtype=torch.int64), torch.hash_tensor(flat).view(torch.int64),
                            (sample * weights).sum()])
    except Exception:  # noqa: BLE001 - a tensor this cannot read: no fingerprint (identity, pointer still watched)
        return None


def tensor_key(t: Any, content: bool = False) -> tuple | None:
    """What a tensor's derived state was made from: identity, version, address, dtype, and its content fingerprint
    where ``content`` asks for it or the tensor has no version counter (None for a non-tensor)."""
    if not isinstance(t, torch.Tensor):
        return None
    v = tensor_version(t)
    return (id(t), v, t.data_ptr(), t.dtype, content_fingerprint(t) if content or v < 0 else None)


# module -> the watches holding one of its ``_modules`` slots: a submodule registered there (``setattr``: PEFT's wrap
# and unwrap, a module replaced) makes them report a change, even when the slot holds the same module again by the
# next check (an adapter added, fused and unloaded between two calls: only the weight's content moved)
_SLOT_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def _on_module_registered(module: nn.Module, name: str, submodule: Any) -> None:
    """torch's global module registration hook (while a watch of a ``_modules`` slot lives: ``_REGISTRATIONS``)."""
    try:
        watches = _SLOT_WATCHES.get(module)
        for w in list(watches) if watches else ():
            w.dirty = True
    except Exception:  # noqa: BLE001 - a registration must never fail because of us
        pass


_REGISTRATIONS = HeldGlobalHooks(
    lambda: [nn.modules.module.register_module_module_registration_hook(_on_module_registered)])


def _watch_slots(watch: Watch, owners: Iterable[Any]) -> None:
    owners = [o for o in owners if isinstance(o, nn.Module)]
    if not owners:
        return
    _REGISTRATIONS.hold(watch)  # the hook lives while a watch of a slot does
    with _slots_lock:
        for o in owners:
            ws = _SLOT_WATCHES.get(o)
            if ws is None:
                ws = _SLOT_WATCHES[o] = weakref.WeakSet()
            ws.add(watch)


class Watch:
    __slots__ = ("entries", "tentries", "dicts", "keys", "ids", "rdicts", "rkeys", "rvals", "tdicts", "tkeys", "tids",
                 "vers", "ptrs", "vless", "fps",
                 "sentries", "sdicts", "skeys", "lens", "typed", "types", "stateful", "states", "pending", "dirty",
                 "__weakref__")

    def __init__(self, entries: Iterable[Entry] = (), tensors: Iterable[Entry] = (),
                 stateful: Iterable[tuple[Any, Callable[[Any], Any]]] = (), sized: Iterable[Entry] = (),
                 typed: Iterable[Any] = ()) -> None:
        entries, tensors, self.stateful = list(entries), list(tensors), list(stateful)
        self.typed = list(typed)
        self.sentries = [e for e in sized if _dict(e).get(e[2]) is not None]
        entries += [e for e in self.sentries if e not in entries]
        # tensors only where one is present now; a slot that is empty now is watched by identity
        present = [e for e in tensors if isinstance(_dict(e).get(e[2]), torch.Tensor)]
        self.entries = entries + [e for e in tensors if not isinstance(_dict(e).get(e[2]), torch.Tensor)]
        self.tentries = present
        self._resolve()

    def _resolve(self) -> None:
        self.pending = False
        # module and parameter slots by id (a replaced module or weight is not kept alive by the watch); the
        # other values (switches, forward slots, processors, amax buffers: small) by reference, which
        # compares without making an id object per value
        by_id = [e for e in self.entries if e[1] in _BY_ID]
        by_ref = [e for e in self.entries if e[1] not in _BY_ID]
        self.dicts, self.keys = [_dict(e) for e in by_id], [e[2] for e in by_id]
        self.rdicts, self.rkeys = [_dict(e) for e in by_ref], [e[2] for e in by_ref]
        self.tdicts, self.tkeys = [_dict(e) for e in self.tentries], [e[2] for e in self.tentries]
        self.sdicts, self.skeys = [_dict(e) for e in self.sentries], [e[2] for e in self.sentries]
        self.take()
        _watch_slots(self, {id(e[0]): e[0] for e in by_id if e[1] == "_modules"}.values())

    @classmethod
    def _restored(cls, entries: list[Entry], tentries: list[Entry], stateful: list, sentries: list[Entry] = (),
                  typed: list = ()) -> Watch:
        """A copy: its owners are still being rebuilt (deepcopy / unpickling): resolved, with the copy's values, at
        its first use."""
        w = cls.__new__(cls)
        w.entries, w.tentries, w.stateful, w.pending = entries, tentries, stateful, True
        w.sentries, w.typed = list(sentries), list(typed)
        return w

    def take(self) -> None:
        """Record the current values as the ones decided for."""
        self.dirty = False
        self.ids = list(map(id, map(dict.get, self.dicts, self.keys)))
        self.rvals = list(map(dict.get, self.rdicts, self.rkeys))
        cur = list(map(dict.get, self.tdicts, self.tkeys))
        self.tids = list(map(id, cur))
        self.vers = [_version(t) for t in cur]
        self.ptrs = list(map(_data_ptr, cur))
        # inference tensors (an in-place load under inference_mode bumps nothing) by content too: a fingerprint
        # each per check, paid only by models holding such tensors
        self.vless = [t for t, v in zip(cur, self.vers) if v < 0]
        self.fps = content_fingerprints(self.vless)
        self.lens = list(map(len, map(dict.get, self.sdicts, self.skeys)))
        self.types = list(map(type, self.typed))
        self.states = [fn(obj) for obj, fn in self.stateful]

    def changed(self) -> bool:
        if self.pending:
            self._resolve()
            return False
        if self.dirty:
            return True
        if list(map(id, map(dict.get, self.dicts, self.keys))) != self.ids:
            return True
        if any(map(is_not, map(dict.get, self.rdicts, self.rkeys), self.rvals)):
            return True
        cur = list(map(dict.get, self.tdicts, self.tkeys))
        if list(map(id, cur)) != self.tids:
            return True
        if self.vless:  # read as take() read them: a Parameter given inference data still reads a _version
            if [_version(t) for t in cur] != self.vers:
                return True
        else:
            try:
                if list(map(_version_of, cur)) != self.vers:
                    return True
            except Exception:  # an inference tensor made since: one at a time
                if [_version(t) for t in cur] != self.vers:
                    return True
        if list(map(_data_ptr, cur)) != self.ptrs:
            return True
        if self.vless and not _capturing(self.vless) and content_fingerprints(self.vless) != self.fps:
            return True
        if list(map(len, map(dict.get, self.sdicts, self.skeys))) != self.lens:
            return True
        if list(map(type, self.typed)) != self.types:
            return True
        return any(fn(obj) != s for (obj, fn), s in zip(self.stateful, self.states))

    def __reduce__(self) -> tuple:
        return (Watch._restored, (self.entries, self.tentries, self.stateful, self.sentries, self.typed))

    def __len__(self) -> int:
        return len(self.entries) + len(self.tentries) + len(self.typed) + len(self.stateful)  # sized: in entries


def _capturing(ts: list) -> bool:
    """A CUDA-graph capture runs (no sync possible: the fingerprints are compared at the next eager call)."""
    return any(t.is_cuda for t in ts) and torch.cuda.is_current_stream_capturing()


def _dict(e: Entry) -> dict:
    d = e[0].__dict__
    return d if e[1] == "__dict__" else d[e[1]]
