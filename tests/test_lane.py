"""ops.lane without a GPU: work on CPU tensors runs in line, nothing is forked or held, settle has nothing to do."""

from __future__ import annotations

import torch

from qwen_absorb.ops import lane


def test_cpu_work_runs_in_line_and_nothing_is_held():
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    a = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    n = lane.forks()
    with lane.active():
        with lane.active():  # nested: the outer exit joins
            t = lane.aside(lambda: x @ a.t(), x)
        lane.settle()
        lane.settle(torch.device("cpu"))
    assert torch.equal(t, x @ a.t())
    assert lane.forks() == n
    st = lane._local
    assert st.depth == 0
    assert all(not ln.pending and not ln.caller_held and not ln.lane_held for ln in st.lanes.values())


def test_outside_active_the_work_runs_in_line_even_on_cuda_inputs_absent():
    calls = []
    out = lane.aside(lambda: calls.append(1) or 7, None)
    assert out == 7 and calls == [1]


def test_regions_on_the_cpu_run_in_line():
    x = torch.arange(6.0)
    with lane.active():
        with lane.region(torch.device("cpu"), "txt", reads=(x,)) as r:
            y = x * 2
            r.give(y)
            r.hold(x)
        assert not r.on_lane and (torch.device("cpu"), "txt") not in lane._local.lanes
        assert lane.lane_for(torch.device("cpu"), "txt") is None
    assert torch.equal(y, x * 2)
