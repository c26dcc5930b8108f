"""Cross-block fusion (qwen_absorb.handoff): block i's FFN residual computes block i+1's norm1 and
hands it over. On the CPU the fused ops run their torch references, so these tests check the
hand-off logic itself: taken on the plain transformer loop, refused (and counted) whenever anything
could touch hidden_states between two blocks, and always bit-identical to diffusers."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch

import qwen_absorb
from qwen_absorb import handoff
from . import builders as T

LAYERS = 4


def _model(dtype=torch.bfloat16, seed=0, **kw):
    m = T.tiny_transformer(dtype=dtype, num_layers=LAYERS, seed=seed, **kw)
    return m, T.transformer_inputs(m, seed=seed + 1)


def _taken(report) -> int:
    return report.summary["cross_block_handoffs_taken"]


def _refusals(report, needle: str) -> int:
    return sum(n for r, n in report.runtime_fallbacks.items() if needle in r)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_taken_on_the_transformer_loop_and_bit_identical(dtype, zero_cond_t):
    m, inp = _model(dtype, seed=3, zero_cond_t=zero_cond_t)
    ref = T.run_transformer(m, inp)
    rep = qwen_absorb.patch(m)
    assert rep.summary["cross_block_links"] == LAYERS - 1
    for call in range(2):
        out = T.run_transformer(m, inp)
        assert torch.equal(out, ref)
        assert _taken(rep) == (call + 1) * (LAYERS - 1)
    assert _refusals(rep, "cross-block") == 0
    assert not rep.blocks[-1].handoff and "last block" in rep.blocks[-1].handoff_reasons[0]
    qwen_absorb.unpatch(m)
    assert torch.equal(T.run_transformer(m, inp), ref)


def test_controlnet_residuals_make_the_next_block_recompute():
    """The transformer adds a ControlNet sample between blocks (a new tensor): every hand-off is
    refused by its receiver, counted, and the output equals diffusers' with the same samples."""
    m, inp = _model(seed=5)
    gen = torch.Generator().manual_seed(6)
    inner = m.config.num_attention_heads * m.config.attention_head_dim
    shape = (*inp["hidden_states"].shape[:2], inner)
    samples = [torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2)]
    inp = {**inp, "controlnet_block_samples": samples}
    ref = T.run_transformer(m, inp)
    rep = qwen_absorb.patch(m)
    assert torch.equal(T.run_transformer(m, inp), ref)
    assert _taken(rep) == 0
    assert _refusals(rep, "cross-block hand-off refused") == LAYERS - 1


def test_in_place_hook_between_blocks_refuses_the_handoff():
    """A user's forward hook that edits block 1's output in place (identity kept) must not be
    bypassed: blocks with hooks neither give nor take."""
    m, inp = _model(seed=7)

    def hook(mod, args, out):
        out[1].mul_(1.5)

    m.transformer_blocks[1].register_forward_hook(hook)
    with torch.inference_mode():  # no version counters here: only the hook check can tell
        ref = T.run_transformer(m, inp)
        rep = qwen_absorb.patch(m)
        out = T.run_transformer(m, inp)
    assert torch.equal(out, ref)
    # block 0 -> 1 (1 has a hook) and 1 -> 2 (1 has a hook) are refused; 2 -> 3 is taken
    assert _refusals(rep, "forward hook") == 2
    assert _taken(rep) == 1


def test_blocks_called_outside_the_transformer_loop_do_not_hand_off():
    m, inp = _model(seed=9)
    args = _block_args(m, inp)
    rep = qwen_absorb.patch(m)
    b0, b1 = m.transformer_blocks[0], m.transformer_blocks[1]
    with torch.no_grad():
        enc, h = b0(**args)
        h2 = h.clone()  # what a caller could do between two blocks
        b1(**{**args, "hidden_states": h2, "encoder_hidden_states": enc})
    assert _refusals(rep, "not called from the transformer's forward loop") == 2  # b0 and b1 both link on
    assert _taken(rep) == 0


def _block_args(m, inp):
    """The inputs the transformer hands its first block (captured with a pre-hook)."""
    got = {}

    def grab(mod, args, kwargs):
        got.update(kwargs)

    h = m.transformer_blocks[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        T.run_transformer(m, inp)
    finally:
        h.remove()
    return got


def test_cross_block_false_and_fp16():
    m, inp = _model(seed=11)
    ref = T.run_transformer(m, inp)
    rep = qwen_absorb.patch(m, cross_block=False)
    assert rep.summary["cross_block_links"] == 0
    assert all("cross_block=False" in b.handoff_reasons[0] for b in rep.blocks[:-1])
    assert torch.equal(T.run_transformer(m, inp), ref) and _taken(rep) == 0

    m16, inp16 = _model(torch.float16, seed=12)
    ref16 = T.run_transformer(m16, inp16)
    rep16 = qwen_absorb.patch(m16)
    assert all(any("float16" in r for r in b.handoff_in_reasons) for b in rep16.blocks)
    assert torch.equal(T.run_transformer(m16, inp16), ref16) and _taken(rep16) == 0


def test_copies_hand_off_among_their_own_blocks():
    m, inp = _model(seed=13)
    ref = T.run_transformer(m, inp)
    qwen_absorb.patch(m)
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        rep = qwen_absorb.patch_report(twin)
        assert all(b.handoff for b in rep.blocks[:-1])
        assert torch.equal(T.run_transformer(twin, inp), ref)
        assert _taken(rep) == LAYERS - 1


def test_threads_each_hand_off_their_own():
    m, inp = _model(seed=15)
    ref = T.run_transformer(m, inp)
    rep = qwen_absorb.patch(m)
    outs, errors = [], []

    def work():
        try:
            for _ in range(3):
                outs.append(T.run_transformer(m, inp))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and len(outs) == 9
    assert all(torch.equal(o, ref) for o in outs)
    assert _taken(rep) == 9 * (LAYERS - 1)


def test_record_is_dropped_by_the_next_patched_call():
    m, inp = _model(seed=17)
    qwen_absorb.patch(m)
    T.run_transformer(m, inp)
    assert getattr(handoff._local, "rec", None) is None  # the last block consumes, gives nothing
