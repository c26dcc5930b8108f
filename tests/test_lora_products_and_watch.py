"""The LoRA branch products of a real-FP8 linear (:func:`qwen_absorb.lora.products`, issue 18) and the watch's
C-level checks of hook dicts, module classes and switch values (issues 18, 19): what runs without a GPU."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from qwen_absorb import lora
from qwen_absorb.watch import Watch

peft = pytest.importorskip("peft")


def _lora_linear(seed, dropout=0.0, adapters=("one",)):
    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(32, 24))
    model = None
    for name in adapters:
        cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0"],
                              init_lora_weights="gaussian")
        model = peft.get_peft_model(base, cfg, adapter_name=name) if model is None else model
        if name != adapters[0]:
            model.add_adapter(name, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    layer = model.base_model.model[0]
    return layer


def test_products_follow_active_adapters_and_refuse_what_peft_must_run(seed):
    layer = _lora_linear(seed, adapters=("one", "two"))
    x = torch.randn(5, 32)
    layer.set_adapter(["one", "two"])
    prods = lora.products(layer, x, torch.float32)
    assert len(prods) == 2
    y = layer.base_layer(x)
    got = lora.add_products(y.clone(), prods)
    assert torch.allclose(got, layer(x), atol=1e-5)
    layer.set_adapter("one")
    assert len(lora.products(layer, x, torch.float32)) == 1
    layer.enable_adapters(False)
    assert lora.products(layer, x, torch.float32) == []
    layer.enable_adapters(True)
    assert lora.products(layer, x, torch.bfloat16) is None  # output dtype differs from the adapters'
    drop = _lora_linear(seed, dropout=0.5).train()
    assert lora.products(drop, x, torch.float32) is None


class _Other(nn.Linear):
    pass


def _watch_of(mods):
    entries = [(m, "__dict__", "forward") for m in mods]
    sized = [(m, "__dict__", d) for m in mods for d in ("_forward_pre_hooks", "_forward_hooks")]
    return Watch(entries, [(m, "_parameters", "weight") for m in mods], sized=sized, typed=mods)


def test_watch_sees_hooks_forward_slots_and_classes():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    w = _watch_of([a, b])
    assert not w.changed()
    h = b.register_forward_hook(lambda *args: None)
    assert w.changed()
    w.take()
    assert not w.changed()
    h.remove()
    assert w.changed()
    w.take()
    p = a.register_forward_pre_hook(lambda *args: None)
    assert w.changed()
    p.remove()
    w.take()
    a.forward = lambda x: x
    assert w.changed()
    del a.forward
    w.take()
    b.__class__ = _Other
    assert w.changed()
    b.__class__ = nn.Linear
    w.take()
    assert not w.changed()


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_watch_copies_watch_the_copy(how):
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    seq.w = _watch_of(list(seq))
    twin = copy.deepcopy(seq) if how == "deepcopy" else pickle.loads(pickle.dumps(seq))
    assert not twin.w.changed()
    assert len(twin.w) == len(seq.w)
    twin[1].register_forward_hook(lambda *args: None)
    assert twin.w.changed() and not seq.w.changed()
    twin[0].__class__ = _Other
    assert not seq.w.changed()


def test_batched_fingerprints_equal_one_at_a_time_and_see_changes():
    """``content_fingerprints`` (one read-back per device) gives what ``content_fingerprint`` gives for each tensor,
    None where that gives None, and sees an in-place change to any one of them."""
    from qwen_absorb.watch import content_fingerprint, content_fingerprints

    g = torch.Generator().manual_seed(11)
    ts = [torch.randn(37, 5, generator=g).to(torch.bfloat16), torch.randn(9000, generator=g),
          torch.randint(-9, 9, (64,), generator=g, dtype=torch.int8), torch.empty(0, dtype=torch.float16),
          torch.empty(4, device="meta"), torch.randn(3, 3, generator=g, dtype=torch.float64),
          torch.randint(0, 255, (17,), generator=g, dtype=torch.uint8), "not a tensor"]
    with torch.inference_mode():  # what watches fingerprint: inference tensors
        ts.append(torch.randn(128, generator=g))
    want = [content_fingerprint(t) for t in ts]
    assert content_fingerprints(ts) == want
    assert [w is None for w in want] == [False, False, False, True, True, False, False, True, False]  # empty: None
    for i in (0, 1, 2, 5, 6, 8):
        with torch.inference_mode():
            ts[i].view(-1)[ts[i].numel() // 2] += 1
        got = content_fingerprints(ts)
        assert got[i] != want[i] and got[:i] + got[i + 1:] == want[:i] + want[i + 1:], i
        want = got
