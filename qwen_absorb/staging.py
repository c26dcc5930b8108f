"""A host tensor in pageable memory copied to a GPU through two pinned buffers (``Tuning.pinned_staging``).

A plain ``tensor.to("cuda")`` from pageable memory runs at the driver's staging rate: 7.6 GB/s on the H100 host,
against 54.9 GB/s from pinned memory (``benchmarks/results/journey_offload_h100.json``). Under model offload the
host-kept originals cross every run (38 GiB for the 60-layer model: 5.8 s of a 9.7 s 8-step run). Pinning them
where they live is not an option: torch's pinned allocator rounds each allocation up to a power of two (up to 2x
the host memory), and packing them into shared pinned blocks would make ``state_dict`` tensors share storage. So
the CPU copies each chunk into one of two pinned buffers (torch's copy is multithreaded) while the other crosses.
The bits are the same as ``tensor.to(device)``'s."""

import torch

# 64 MiB: a power of two, which torch's pinned allocator rounds every size up to (nothing wasted); two of them
CHUNK = 1 << 26


def to_device(src: torch.Tensor, device: torch.device, chunk: int = CHUNK, pinned: bool = True) -> torch.Tensor:
    """``src`` (a plain host tensor) on ``device``: through pinned chunks where ``pinned`` (the caller's
    ``Tuning.pinned_staging``), ``device`` is a CUDA device and ``src`` is larger than one chunk and not pinned
    already, else ``src.to(device)``."""
    n = src.numel() * src.element_size()
    if not pinned or device.type != "cuda" or src.device.type != "cpu" or src.is_pinned() or n <= chunk:
        return src.to(device, non_blocking=src.is_pinned())
    src = src.contiguous()
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    s8, d8 = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    crossed: list[torch.cuda.Event | None] = [None, None]
    stream = torch.cuda.current_stream(device)
    for i, off in enumerate(range(0, n, chunk)):
        k, m = i % 2, min(chunk, n - off)
        if crossed[k] is not None:
            crossed[k].synchronize()  # the buffer's last chunk has reached the GPU: it may be refilled
        bufs[k][:m].copy_(s8[off:off + m])
        d8[off:off + m].copy_(bufs[k][:m], non_blocking=True)  # on the current stream, before what reads dst
        crossed[k] = torch.cuda.Event()
        crossed[k].record(stream)
    for e in crossed:  # the buffers go back to torch's pinned cache only once nothing reads them
        if e is not None:
            e.synchronize()
    return dst
