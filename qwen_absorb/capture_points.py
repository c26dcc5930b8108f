"""Where a CUDA-graph capture of the transformer call may be cut: at the entry of a patched block.

Replaying one graph of a whole 60-block call leaves the GPU idle while the host launches it (the H200 speed
benchmark: ~4.9 ms of host time before the FP8 call's GPU work starts). A capture cut into consecutive graphs
(one memory pool, replayed in capture order) lets the GPU run the first while the host launches the rest.
The patched block forward calls :func:`block_entry` first thing; only inside :func:`cutting` (the capture, on
its own thread) does anything happen. Elsewhere it is one thread-local read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_local = threading.local()


def block_entry(index: int) -> None:
    """A patched block ``index`` starts (called by :mod:`qwen_absorb.block`)."""
    cut = getattr(_local, "cut", None)
    if cut is not None:
        cut(index)


@contextmanager
def cutting(cut: Callable[[int], None] | None) -> Iterator[None]:
    """While the body runs on this thread, every patched block entry calls ``cut(index)``."""
    prev = getattr(_local, "cut", None)
    _local.cut = cut
    try:
        yield
    finally:
        _local.cut = prev
