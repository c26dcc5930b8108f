"""Shared fixtures of the patch tests (tests/test_patch_*.py).

Random inputs are drawn fresh on every run: the ``seed`` fixture picks a new seed each time and
prints it, so a failure can be replayed with ``QWEN_ABSORB_TEST_SEED=<seed>``.
"""

from __future__ import annotations

import logging
import os
import random
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=".*transformers .* is not tested with current version of modelopt.*")
# diffusers logs this for every .to(dtype) of a tiny model; it says nothing about our code.
logging.getLogger("diffusers.models.modeling_utils").setLevel(logging.ERROR)


@pytest.fixture
def seed(request) -> int:
    fixed = os.environ.get("QWEN_ABSORB_TEST_SEED")
    s = int(fixed) if fixed else random.SystemRandom().randrange(2**31)
    request.node.user_properties.append(("seed", s))
    print(f"[seed {s}]")
    return s


@pytest.fixture(autouse=True)
def _no_force_reference_env(monkeypatch):
    # The patch tests rely on the default dispatch (references on CPU anyway); a developer's
    # QWEN_ABSORB_FORCE_REFERENCE=1 would only change report texts.
    monkeypatch.delenv("QWEN_ABSORB_FORCE_REFERENCE", raising=False)


@pytest.fixture(autouse=True)
def _threads():
    # 2-core CI runners: avoid oversubscription by intra-op threads in the tiny models.
    n = torch.get_num_threads()
    torch.set_num_threads(min(n, 2))
    yield
    torch.set_num_threads(n)


@pytest.fixture
def gemms(monkeypatch):
    """The ``torch._scaled_mm`` calls of the test, by activation shape (the real GEMM still runs)."""
    calls = []
    real = torch._scaled_mm

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's streams and graphs replaced by CPU stand-ins (tests/cuda_graph_fakes.py), CPU tensors allowed
    into graphs: the capture / replay code path of qwen_absorb.cuda_graph runs on the CPU."""
    from . import cuda_graph_fakes

    cuda_graph_fakes.install(monkeypatch)
