"""Stand-ins for torch.cuda's streams and graphs, so that the CUDA-graph capture / replay code path runs on the CPU.

A fake graph "replays" by running the runner's wrapped forward on the static buffers and writing into the static
output (:func:`arm`), which is what a CUDA graph does; the ``fake_cuda`` fixture (tests/conftest.py) installs the
fakes. Exactness of real replays is checked by the GPU tests.
"""

from __future__ import annotations

import contextlib

import torch

from qwen_absorb.cuda_graph import capture as C
from qwen_absorb.cuda_graph import fingerprint
from qwen_absorb.cuda_graph import settings
from qwen_absorb.cuda_graph import signature as S
from qwen_absorb.cuda_graph.runner import GraphedCall


class FakeStream:
    device = torch.device("cpu")

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass


class FakeGraph:  # captured by shape_graphs.recording: capture_begin, the forward, capture_end
    fail = False

    def __init__(self):
        self.fn = None
        self.pool = None  # the pool handle it was captured into

    def capture_begin(self, pool=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local" and pool is not None
        self.pool = pool

    def capture_end(self):
        if FakeGraph.fail:
            raise RuntimeError("operation not permitted when stream is capturing")

    def replay(self):
        if self.fn is None:
            _arm_fbc_owner(self)
        self.fn()


def install(monkeypatch) -> None:
    monkeypatch.setattr(settings, "GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(settings, "ALIGN", 64)  # what the CPU allocator promises (CUDA: 512), so fresh inputs share a key
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(C.HostConstants, "device_types", ("cpu",))
    monkeypatch.setattr(FakeGraph, "fail", False)


def _is_spec(k) -> bool:
    """A call's frozen argument structure: (positional specs, ((name, spec), ...))."""
    return (isinstance(k, tuple) and len(k) == 2 and isinstance(k[0], tuple) and isinstance(k[1], tuple)
            and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in k[1]))


def _spec_of(key):
    """The argument structure inside a graph key, however the runner wrapped the signature key (the patch's tuning,
    TaylorSeer steps): its first element, depth first."""
    while not _is_spec(key):
        key = key[0]
    return key


def arm(runner) -> None:
    """Give every captured fake graph of ``runner`` its replay: the wrapped forward on the static inputs, into the
    static output."""
    for key, entry in runner._graphs.items():
        if entry.graph.fn is not None:
            continue

        def fn(entry=entry, spec=_spec_of(key)):
            args, kwargs = S.thaw_call(spec, entry.statics)
            fresh = runner._inner(*args, **kwargs)
            for dst, src in zip(C.tensors_in(entry.out), C.tensors_in(fresh)):
                dst.copy_(src)

        entry.graph.fn = fn


def _arm_fbc_owner(graph: FakeGraph) -> None:
    """A FirstBlockCache group's block graph replayed before a test armed it: its runner is armed now (these runners
    are made inside a model call, where no test can reach them first; every other runner's graph must be armed by
    its test, so that an unexpected replay fails there)."""
    for r in list(fingerprint._LIVE):
        if getattr(r._shared, "fbc", False) and any(e.graph is graph for e in r._graphs.values()):
            arm(r)
            return


def runner_of(t) -> GraphedCall | None:
    """The graph runner on a transformer: in its forward slot, or inside accelerate's hook (``_old_forward``)."""
    for slot in ("forward", "_old_forward"):
        f = t.__dict__.get(slot)
        if isinstance(f, GraphedCall):
            return f
    return None


def run_tiny_pipeline(pipe, seed, steps, arm_graphs=False, inference=True):
    """One 32^2 true-CFG run of a tiny Qwen-Image pipeline on given prompt embeddings (``output_type="pt"``); with
    ``arm_graphs`` a fake graph captured in a step replays from the next one."""
    from . import builders as T  # noqa: PLC0415

    emb, mask = T.tiny_prompt_embeds(seed=seed, dtype=torch.bfloat16, masked_tail=0)
    neg, nmask = T.tiny_prompt_embeds(seq_len=5, seed=seed + 1, dtype=torch.bfloat16, masked_tail=0)

    def step_end(p, i, t, kwargs):
        r = runner_of(p.transformer)
        if arm_graphs and r is not None:
            arm(r)
        return kwargs

    with torch.inference_mode() if inference else torch.no_grad():
        return pipe(prompt_embeds=emb, prompt_embeds_mask=mask, negative_prompt_embeds=neg,
                    negative_prompt_embeds_mask=nmask, true_cfg_scale=4.0, height=32, width=32,
                    num_inference_steps=steps, output_type="pt", callback_on_step_end=step_end,
                    generator=torch.Generator().manual_seed(seed)).images
