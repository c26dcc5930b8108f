"""What a block's decisions depend on, compared on every call without a device sync.

A :class:`Watch` holds ``(owner, holder, key)`` entries (``holder``: ``"__dict__"`` or a module dict in it; a copy is
rebuilt on the copy's own objects). It compares ``entries`` by identity; ``tensors`` also by ``_version`` and
``data_ptr`` (inference tensors by :func:`content_fingerprint`); ``sized`` by length (hooks); ``typed`` by class;
``stateful`` ``(object, fn)`` by ``fn(object)``; and sees any registration into a watched ``_modules`` slot. C-level
``map`` loops: 60 blocks ask ~700 values each per eager call."""

import contextlib
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


_BY_ID = ("_modules", "_parameters")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SAMPLE = 4096


def content_fingerprint(t: Any) -> tuple[int, ...] | None:
    """A cheap fingerprint of ``t``'s values where versions cannot be trusted (inference tensors, ``.data`` writes):
    bit-pattern integer sum and ``torch.hash_tensor``, and a position-weighted sum of ~4k strided samples (a
    permutation). One read, one sync; None for meta or subclasses."""
    return content_fingerprints([t])[0]


def content_fingerprints(ts: Sequence[Any]) -> list[tuple[int, ...] | None]:
    """:func:`content_fingerprint` of each of ``ts``, read back with one sync per device."""
    out: list[tuple[int, ...] | None] = [None] * len(ts)
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(ts):
        if (parts := fingerprint_parts(t)) is not None:
            by_device.setdefault(parts.device, []).append((i, parts))
    for group in by_device.values():
        with contextlib.suppress(Exception):  # unreadable (a sticky device error): no fingerprints, as one at a time
            for (i, _), v in zip(group, torch.stack([p for _, p in group]).tolist()):
                out[i] = tuple(v)
    return out


def fingerprint_parts(t: Any) -> torch.Tensor | None:
    """The three int64 parts of ``t``'s fingerprint on its device (nothing read back), or None."""
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


def tensor_key(t: Any) -> tuple | None:
    """Identity, version, address, dtype and (without a version counter) content fingerprint of a tensor."""
    if not isinstance(t, torch.Tensor):
        return None
    v = tensor_version(t)
    return (id(t), v, t.data_ptr(), t.dtype, content_fingerprint(t) if v < 0 else None)


# module -> the watches holding one of its ``_modules`` slots: a registration there (PEFT's wrap and unwrap) is a change
# even when the slot holds the same module again by the next check (a LoRA added, fused and unloaded between calls)
_SLOT_WATCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_slots_lock = threading.Lock()


def _on_module_registered(module: nn.Module, name: str, submodule: Any) -> None:
    """torch's global module registration hook (while a watch of a ``_modules`` slot lives: ``_REGISTRATIONS``)."""
    with contextlib.suppress(Exception):  # a registration must never fail because of us
        for w in list(_SLOT_WATCHES.get(module) or ()):
            w.dirty = True


_REGISTRATIONS = HeldGlobalHooks(
    lambda: [nn.modules.module.register_module_module_registration_hook(_on_module_registered)])


class Watch:
    __slots__ = ("entries", "tentries", "dicts", "keys", "ids", "rdicts", "rkeys", "rvals", "tdicts", "tkeys", "tids",
                 "vers", "ptrs", "vless", "fps", "sentries", "sdicts", "skeys", "lens", "typed", "types", "stateful",
                 "states", "pending", "dirty", "__weakref__")

    def __init__(self, entries: Iterable[Entry] = (), tensors: Iterable[Entry] = (),
                 stateful: Iterable[tuple[Any, Callable[[Any], Any]]] = (), sized: Iterable[Entry] = (),
                 typed: Iterable[Any] = ()) -> None:
        entries, tensors, self.stateful, self.typed = list(entries), list(tensors), list(stateful), list(typed)
        self.sentries = [e for e in sized if _dict(e).get(e[2]) is not None]
        entries += [e for e in self.sentries if e not in entries]
        # tensors only where one is present now; a slot that is empty now is watched by identity
        self.tentries = [e for e in tensors if isinstance(_dict(e).get(e[2]), torch.Tensor)]
        self.entries = entries + [e for e in tensors if not isinstance(_dict(e).get(e[2]), torch.Tensor)]
        self._resolve()

    def _resolve(self) -> None:
        self.pending = False
        # module and parameter slots by id (the watch keeps no replaced one alive); the other (small) values by
        # reference, which compares without making an id object per value
        by_id = [e for e in self.entries if e[1] in _BY_ID]
        by_ref = [e for e in self.entries if e[1] not in _BY_ID]
        self.dicts, self.keys = [_dict(e) for e in by_id], [e[2] for e in by_id]
        self.rdicts, self.rkeys = [_dict(e) for e in by_ref], [e[2] for e in by_ref]
        self.tdicts, self.tkeys = [_dict(e) for e in self.tentries], [e[2] for e in self.tentries]
        self.sdicts, self.skeys = [_dict(e) for e in self.sentries], [e[2] for e in self.sentries]
        self.take()
        owners = {id(e[0]): e[0] for e in by_id if e[1] == "_modules" and isinstance(e[0], nn.Module)}
        if owners:
            _REGISTRATIONS.hold(self)  # the hook lives while a watch of a slot does
            with _slots_lock:
                for o in owners.values():
                    _SLOT_WATCHES.setdefault(o, weakref.WeakSet()).add(self)

    @classmethod
    def _restored(cls, entries: list[Entry], tentries: list[Entry], stateful: list, sentries: list[Entry] = (),
                  typed: list = ()) -> "Watch":
        """A copy whose owners are still being rebuilt (deepcopy, unpickling): resolved at its first use."""
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
        self.vers = [tensor_version(t) for t in cur]
        self.ptrs = list(map(_data_ptr, cur))
        # inference tensors (an in-place load under inference_mode bumps nothing) by content too
        self.vless = [t for t, v in zip(cur, self.vers) if v < 0]
        self.fps = content_fingerprints(self.vless)
        self.lens = list(map(len, map(dict.get, self.sdicts, self.skeys)))
        self.types = list(map(type, self.typed))
        self.states = [fn(obj) for obj, fn in self.stateful]

    def changed(self) -> bool:
        if self.pending:
            self._resolve()
            return False
        cur = list(map(dict.get, self.tdicts, self.tkeys))
        return (self.dirty or list(map(id, map(dict.get, self.dicts, self.keys))) != self.ids
                or any(map(is_not, map(dict.get, self.rdicts, self.rkeys), self.rvals))
                or list(map(id, cur)) != self.tids or _versions(cur, self.vless) != self.vers
                or list(map(_data_ptr, cur)) != self.ptrs
                or bool(self.vless and not _capturing(self.vless) and content_fingerprints(self.vless) != self.fps)
                or list(map(len, map(dict.get, self.sdicts, self.skeys))) != self.lens
                or list(map(type, self.typed)) != self.types
                or any(fn(obj) != s for (obj, fn), s in zip(self.stateful, self.states)))

    def __reduce__(self) -> tuple:
        return (Watch._restored, (self.entries, self.tentries, self.stateful, self.sentries, self.typed))

    def __len__(self) -> int:
        return len(self.entries) + len(self.tentries) + len(self.typed) + len(self.stateful)  # sized: in entries


def _versions(cur: list, vless: list) -> list[int]:
    """The versions as :meth:`Watch.take` read them (a Parameter given inference data still reads a ``_version``)."""
    if not vless:
        try:
            return list(map(_version_of, cur))
        except Exception:  # noqa: BLE001 - an inference tensor made since: one at a time
            pass
    return [tensor_version(t) for t in cur]


def _capturing(ts: list) -> bool:
    """A CUDA-graph capture runs (no sync possible: the fingerprints are compared at the next eager call)."""
    return any(t.is_cuda for t in ts) and torch.cuda.is_current_stream_capturing()


def _dict(e: Entry) -> dict:
    d = e[0].__dict__
    return d if e[1] == "__dict__" else d[e[1]]
