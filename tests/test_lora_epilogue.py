"""The LoRA branches of a real-FP8 linear written first and the GEMM accumulating into them (issue 18), and the
watch's C-level checks of hook dicts and module classes: what runs without a GPU.

On the CPU no cuBLASLt call is made: the rule, the operand checks, the branch products and the fallback to
adding the branches after the GEMM are what is tested here (tests/test_cublaslt_gpu.py runs the GEMM).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import qwen_absorb
from qwen_absorb import cublaslt, lora, projection
from qwen_absorb import testing as T
from qwen_absorb.watch import Watch

peft = pytest.importorskip("peft")


def _branches(gen, m, n, r=(4, 3)):
    return [(torch.randn(m, k, generator=gen).bfloat16(), (torch.randn(n, k, generator=gen) * 0.1).bfloat16(),
             0.5 + i) for i, k in enumerate(r)]


def test_write_products_overwrites_poison_and_equals_adding_to_zero(seed):
    gen = torch.Generator().manual_seed(seed)
    br = _branches(gen, 9, 16)
    y = torch.full((9, 16), float("nan"), dtype=torch.bfloat16)
    lora.write_products(y, br)
    assert not y.isnan().any()
    want = lora.add_products(torch.zeros(9, 16, dtype=torch.bfloat16), br)
    assert torch.equal(y, want)
    ref = sum(s * (t.float() @ b.float().t()) for t, b, s in br)
    assert ((y.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-2).all()


def test_write_products_into_a_row_slice_leaves_the_other_rows(seed):
    gen = torch.Generator().manual_seed(seed)
    joint = torch.randn(12, 16, generator=gen).bfloat16()
    before = joint.clone()
    lora.write_products(joint[5:], _branches(gen, 7, 16))
    assert torch.equal(joint[:5], before[:5]) and not torch.equal(joint[5:], before[5:])


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


@pytest.mark.parametrize("mode,n,k,want", [("auto", 12288, 3072, True), ("auto", 6144, 3072, True),
                                           ("auto", 3072, 3072, False), ("auto", 3072, 12288, False),
                                           (True, 3072, 12288, True), (False, 12288, 3072, False)])
def test_lora_epilogue_rule(mode, n, k, want):
    assert projection.lora_epilogue_wanted(mode, n, k) is want


def test_scaled_mm_reasons_name_each_bad_operand():
    e4 = torch.float8_e4m3fn
    a, b = torch.zeros(8, 32, dtype=e4), torch.zeros(16, 32, dtype=e4)
    out = torch.empty(8, 16, dtype=torch.bfloat16)
    ok_but_cpu = cublaslt.scaled_mm_reasons(a, b, None, out)
    assert ok_but_cpu == ["operands are not on one CUDA device"]
    r = " | ".join(cublaslt.scaled_mm_reasons(a.bfloat16(), b, None, out))
    assert "not float8_e4m3fn" in r
    assert "bf16 or fp16 only" in " ".join(cublaslt.scaled_mm_reasons(a, b, None, out.float()))
    assert "do not agree" in " ".join(cublaslt.scaled_mm_reasons(a, b[:, :16], None, out))
    assert "not row-major" in " ".join(cublaslt.scaled_mm_reasons(a, b, None, torch.empty(16, 8, dtype=torch.bfloat16).t()))
    assert "16 bytes" in " ".join(cublaslt.scaled_mm_reasons(a[:, :24], b[:, :24], None, out))
    assert "bias" in " ".join(cublaslt.scaled_mm_reasons(a, b, torch.zeros(16), out))
    assert "2-D" in " ".join(cublaslt.scaled_mm_reasons(a[None], b, None, out))


def test_epilogue_forced_on_cpu_falls_back_to_adding_after(monkeypatch, seed):
    """With the epilogue forced on, a CPU model still adds the branches after the GEMM (no cuBLASLt): the same
    bits as with it off."""
    model = T.tiny_transformer(dtype=torch.bfloat16, num_layers=2, seed=seed % 1000)
    inp = T.transformer_inputs(model, seed=seed % 1000 + 1, masked_tail=0)
    T.fp8_quantize(model, [inp])
    model.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                      target_modules=["to_q", "img_mlp.net.0.proj", "txt_mlp.net.0.proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    rep = qwen_absorb.patch(model, fp8_gemm=True, capabilities={"cpu"}, cuda_graph=False)
    assert rep.summary["fp8_gemm_lora_linears"] == 6
    calls = []
    monkeypatch.setattr(cublaslt, "scaled_mm", lambda *a, **k: calls.append(a) or True)
    monkeypatch.setattr(projection, "LORA_EPILOGUE", True)
    on = T.run_transformer(model, inp)
    monkeypatch.setattr(projection, "LORA_EPILOGUE", False)
    off = T.run_transformer(model, inp)
    assert torch.equal(on, off) and not calls
    qwen_absorb.unpatch(model)
    assert torch.allclose(T.run_transformer(model, inp).float(), off.float(), rtol=0.1, atol=0.1)


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
