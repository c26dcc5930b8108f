"""The kernels of a finished ``torch.profiler`` session: what "GPU busy" sums in the benchmarks.

Device-side events only (``device_type == DeviceType.CUDA``), GPU user annotations left out (they are
ranges, not kernels), memcpy / memset left out. Importing this module imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def kernels(prof: Any) -> Iterator[tuple[str, float]]:
    """``(kernel name, duration us)`` of every kernel the profiler recorded."""
    from torch.autograd import DeviceType  # noqa: PLC0415

    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        low = e.name.lower()
        if "memcpy" in low or "memset" in low:
            continue
        yield e.name, float(e.time_range.elapsed_us())
