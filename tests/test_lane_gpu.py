"""GPU tests of ops.lane: work beside the caller's stream (a product beside the caller's GEMMs, in CUDA graphs too)
gives the same bits as in line, and neither stream reuses memory the other may still read."""

from __future__ import annotations

import pytest
import torch

from qwen_absorb.ops import _runtime, lane

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or _runtime.cupy_unavailable_reason() is not None:
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

DEV = "cuda"


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def test_aside_holds_the_callers_input_until_the_join():
    """The lane reads x while the caller drops it and fills fresh tensors of its size with junk: held, x's memory is
    not handed out again before the join, so every lane product equals the one computed in line."""
    g = _gen(1)
    w = torch.randn(512, 8192, generator=g, device=DEV, dtype=torch.bfloat16)
    xs = [torch.randn(8192, 8192, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(4)]
    want = [x @ w.t() for x in xs]
    torch.cuda.synchronize()
    got = []
    with lane.active():
        for i in range(4):
            x = xs[i].clone()
            t = lane.aside(lambda x=x: x @ w.t(), x)
            del x  # the caller's last reference
            junk = [torch.full((8192, 8192), float("nan"), device=DEV, dtype=torch.bfloat16) for _ in range(2)]
            del junk
            lane.settle(torch.device(DEV))
            got.append(t.clone())
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_aside_in_a_captured_graph_equals_in_line():
    g = _gen(2)
    x = torch.randn(4096, 3072, generator=g, device=DEV, dtype=torch.bfloat16)
    a = torch.randn(192, 3072, generator=g, device=DEV, dtype=torch.bfloat16) / 64
    b = torch.randn(3072, 3072, generator=g, device=DEV, dtype=torch.bfloat16) / 64
    bl = torch.randn(3072, 192, generator=g, device=DEV, dtype=torch.bfloat16) / 16

    def step():
        t = lane.aside(lambda: x @ a.t(), x)
        y = x @ b.t()
        lane.settle(x.device)
        return y.addmm_(t, bl.t(), alpha=0.5)

    want = step()  # no lane active: in line
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), lane.active():
        step()  # warm-up on the lane
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    n = lane.forks()
    with torch.cuda.graph(graph), lane.active():
        out = step()
    assert lane.forks() == n + 1
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
