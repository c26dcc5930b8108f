"""GPU: the prompt encoding's CUDA graphs (qwen_absorb.text_encoder) against diffusers' eager encoding, bit for bit,
on a reduced-depth Qwen2.5-VL-7B text model (full width, 2 layers); nothing after a replay synchronizes."""

from __future__ import annotations

import pytest
import torch

from qwen_absorb import text_encoder as te_room
from tests.test_text_encoder_patch import WordTokenizer, tiny_text_pipeline

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@torch.no_grad()
def test_graphs_bit_identical_to_eager(seed):
    pipe = tiny_text_pipeline(device="cuda", dtype=torch.bfloat16, hidden=3584, heads=28, kv_heads=4,
                              inter=18944, layers=2, seed=seed)
    prompts = ["a red fox on a rock , misty forest", " ", ["a cat", "two dogs and a much longer prompt here"]]
    refs = [pipe.encode_prompt(p, device=torch.device("cuda")) for p in prompts]
    rep = te_room.patch(pipe, cuda_graph=True, cache_size=0)  # graphs are opt-in ("auto" leaves the encoder eager)
    assert pipe.__dict__["_get_qwen_prompt_embeds"].body is pipe.text_encoder.model  # replayed without lm_head
    for _ in range(2):
        for p, r in zip(prompts, refs):
            got = pipe.encode_prompt(p, device=torch.device("cuda"))
            assert torch.equal(got[0], r[0])
            assert (got[1] is None and r[1] is None) or torch.equal(got[1], r[1])
    assert rep.graphs.get("replays", 0) >= 3, rep.to_dict()
    te_room.unpatch(pipe)
    assert "_get_qwen_prompt_embeds" not in pipe.__dict__


@torch.no_grad()
def test_auto_captures_a_key_at_its_second_call(seed):
    """The default ("auto", as ``qwen_absorb.patch(pipe)`` installs it): a prompt length seen once runs eager, the
    second call of a (shape, mask) captures, the third replays; every call bit for bit diffusers' encoding."""
    pipe = tiny_text_pipeline(device="cuda", dtype=torch.bfloat16, hidden=3584, heads=28, kv_heads=4,
                              inter=18944, layers=2, seed=seed)
    dev = torch.device("cuda")
    prompts = ["a red fox on a rock", "a blue fox on a log", "a grey owl on a branch at night"]  # 1st, 2nd: one key
    refs = [pipe.encode_prompt(p, device=dev) for p in prompts]
    rep = te_room.patch(pipe, cache_size=0)
    got = [pipe.encode_prompt(p, device=dev) for p in prompts]
    assert rep.graphs.get("captures", 0) == 1 and rep.graphs.get("replays", 0) == 1, rep.to_dict()
    got += [pipe.encode_prompt(p, device=dev) for p in prompts]
    assert rep.graphs.get("captures", 0) == 2 and rep.graphs.get("replays", 0) >= 4, rep.to_dict()
    for g, r in zip(got, refs + refs):
        assert torch.equal(g[0], r[0])
        assert (g[1] is None and r[1] is None) or torch.equal(g[1], r[1])
    te_room.unpatch(pipe)


@torch.no_grad()
def test_nothing_after_the_replay_waits_for_the_device(seed, monkeypatch):
    """The rows are planned on the host and copied before the replay is launched: from the replay to the
    embeddings nothing synchronizes (torch's sync debug mode raises at a blocking host-to-device copy or a read
    of the device), so that host work overlaps the GPU's."""
    pipe = tiny_text_pipeline(device="cuda", dtype=torch.bfloat16, seed=seed)
    dev = torch.device("cuda")
    prompts = ["a red fox on a rock", ["a cat", "two dogs and a much longer prompt"]]  # unpadded, padded
    refs = [pipe.encode_prompt(p, device=dev) for p in prompts]
    rep = te_room.patch(pipe, cuda_graph=True, cache_size=0)
    enc = pipe.__dict__["_get_qwen_prompt_embeds"]
    real_replay, encode = torch.cuda.CUDAGraph.replay, enc._encode

    def replay(graph):
        real_replay(graph)
        torch.cuda.set_sync_debug_mode("error")

    def encode_then_allow(*a):
        try:
            return encode(*a)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    enc._encode = encode_then_allow
    try:
        for _ in range(2):
            for p, r in zip(prompts, refs):
                got = pipe.encode_prompt(p, device=dev)
                assert torch.equal(got[0], r[0])
                assert (got[1] is None and r[1] is None) or torch.equal(got[1], r[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rep.graphs.get("replays", 0) == 4 and not rep.graph_refusals, rep.to_dict()
