"""The folded GELU + net[2] lora_A kernel's host side on the CPU (the kernel: tests/test_lora_fold_gpu.py).

- The launchers' struct layouts and tile constants are the CUDA source's; every launch's shared memory fits an
  H200 block; every instance is registered for the compile test.
- The split of a row band into column segments divides the tiles evenly and takes the fewest tile steps.
- The kernel refuses what it cannot take, with reasons.
- ``lora.foldable_branch``: only one active, inference-mode adapter of the activation's dtype folds.
- The FeedForward hands net[2] the folded products where the fold runs (the kernels replaced by their
  expressions): the same output as net[2]'s branch computed from the GELU output.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch
from torch import nn

from qwen_absorb import lora, ops, projection
from qwen_absorb.gating import Tuning
from qwen_absorb.ops import _runtime, lora_add, lora_fold
from qwen_absorb.plan import Options

from .test_lora_add import _kinds


def test_layouts_and_constants_match_the_cuda_source():
    src = _runtime.kernel_source(lora_fold.CU)
    assert _kinds(re.search(r"struct LoraFoldParams\s*\{(.*?)\};", src, re.S).group(1)) == lora_fold._LAYOUT
    assert _kinds(re.search(r"struct LoraFoldReduceParams\s*\{(.*?)\};", src, re.S).group(1)) \
        == lora_fold._REDUCE_LAYOUT
    const = {k: re.search(rf"#define {k} \(?([^\n/]+?)\)?\s*(//|\n)", src).group(1).strip()
             for k in ("QA_LF_THREADS", "QA_LF_BM", "QA_LF_BN", "QA_LF_YP", "QA_LF_AP", "QA_LF_STAGES")}
    assert int(const["QA_LF_THREADS"]) == lora_fold._THREADS
    assert int(const["QA_LF_BM"]) == lora_fold._BM and int(const["QA_LF_BN"]) == lora_fold._BN
    assert const["QA_LF_YP"].replace(" ", "") == const["QA_LF_AP"].replace(" ", "") == "QA_LF_BN+32"
    assert int(const["QA_LF_STAGES"]) == lora_fold.STAGES
    assert struct.calcsize("@" + lora_fold._LAYOUT) == 7 * 8 + 3 * 8 + 7 * 4 + 4


def test_shared_memory_fits_and_instances_are_registered():
    for ks in lora_add.KSTEPS:
        if 16 * ks > lora_fold.MAX_RANK:
            continue
        for na in lora_fold.NTILES:
            need = lora_fold.smem_bytes(ks, na)
            assert need <= 227 * 1024, (ks, na)
            xch = 8 * na * 4 * 32 * 4  # the two warps' exchange of partial sums reuses the ring
            assert xch <= need
    mine = lora_fold.all_kernel_expressions()
    assert len(mine) == 2 * 3 * 3 + 2 and set(mine) <= set(ops.all_kernel_expressions())


@pytest.mark.parametrize("tiles_m,tiles_n,sms", [(32, 96, 132), (1, 96, 132), (3, 24, 1), (3, 24, 7),
                                                 (3, 24, 1000), (1, 1, 132), (128, 96, 132), (7, 7, 132)])
def test_segments_divide_the_columns_and_take_the_fewest_steps(tiles_m, tiles_n, sms):
    s = lora_fold.segments(tiles_m, tiles_n, sms)
    assert tiles_n % s == 0 and 1 <= s <= lora_fold.MAX_SEGMENTS

    def steps(k):
        return -(-tiles_m * k // sms) * (tiles_n // k)

    others = [k for k in range(1, min(tiles_n, lora_fold.MAX_SEGMENTS) + 1) if tiles_n % k == 0]
    assert steps(s) == min(steps(k) for k in others)
    assert all(steps(k) > steps(s) for k in others if k < s)
    if (tiles_m, tiles_n, sms) == (32, 96, 132):
        assert s == 4  # 128 blocks of 24 tiles: one wave on an H200


def test_reasons():
    bf = torch.bfloat16
    y, t, b = torch.zeros(64, 256, dtype=bf), torch.zeros(64, 16, dtype=bf), torch.zeros(256, 16, dtype=bf)
    a2 = torch.zeros(8, 256, dtype=bf)
    assert any("CUDA" in r for r in lora_fold.reasons(y, t, b, a2))  # on the CPU: the kernels' runtime


def test_reasons_past_the_runtime(monkeypatch):
    monkeypatch.setattr(lora_add, "reasons", lambda y, t, b: [])
    monkeypatch.setattr(lora_fold, "_device_limits", lambda device: (8, 227 * 1024))  # a small GPU: 8 SMs
    bf = torch.bfloat16
    y, t, b = torch.zeros(64, 256, dtype=bf), torch.zeros(64, 16, dtype=bf), torch.zeros(256, 16, dtype=bf)
    a2 = torch.zeros(8, 256, dtype=bf)
    assert lora_fold.reasons(y, t, b, a2) == []
    assert any("multiple of 128" in r for r in lora_fold.reasons(y[:, :136], t, b[:136], a2[:, :136]))
    assert any("multiple of 128" in r for r in lora_fold.reasons(y[:, :0], t, b[:0], a2[:, :0]))
    assert any("rank 12" in r for r in lora_fold.reasons(y, t, b, torch.zeros(12, 256, dtype=bf)))
    assert any("rank 72" in r for r in lora_fold.reasons(y, t, b, torch.zeros(72, 256, dtype=bf)))
    assert any("row-major" in r for r in lora_fold.reasons(y, t, b, a2.float()))
    assert any("row-major" in r for r in lora_fold.reasons(y, t, b, torch.zeros(256, 8, dtype=bf).t()))
    t80, b80 = torch.zeros(64, 80, dtype=bf), torch.zeros(256, 80, dtype=bf)
    assert any("rank 80 above" in r for r in lora_fold.reasons(y, t80, b80, a2))
    monkeypatch.setattr(lora_fold, "_device_limits", lambda device: (132, 227 * 1024))  # an H200
    assert any("half the SMs" in r for r in lora_fold.reasons(y, t, b, a2))  # one row band: 16 blocks at most
    y5, t5 = torch.zeros(640, 256, dtype=bf), torch.zeros(640, 16, dtype=bf)
    assert lora_fold.reasons(y5, t5, b, a2) == []  # 5 row bands: 80 blocks
    assert lora_fold.size_reasons(4096, 132) == [] and lora_fold.size_reasons(512, 132) != []
    monkeypatch.setattr(lora_fold, "_device_limits", lambda device: (132, 48 * 1024))
    assert any("shared memory" in r for r in lora_fold.reasons(y5, t5, b, a2))


def _peft_linear(n_in, n_out, adapters, dtype=torch.bfloat16, dropout=0.0):
    peft = pytest.importorskip("peft")
    holder = nn.Sequential(nn.Linear(n_in, n_out, dtype=dtype))
    for i, name in enumerate(adapters):
        cfg = peft.LoraConfig(r=8, lora_alpha=8, target_modules=["0"], lora_dropout=dropout,
                              init_lora_weights="gaussian")
        if i == 0:
            holder = peft.get_peft_model(holder, cfg, adapter_name=name)
        else:
            holder.add_adapter(name, cfg)
    layer = holder.base_model.model[0]
    for p in layer.parameters():
        if p.dtype != dtype:
            p.data = p.data.to(dtype)
    return holder, layer


def test_only_one_active_inference_adapter_of_the_activation_dtype_folds():
    _, layer = _peft_linear(16, 8, ["one"])
    got = lora.foldable_branch(layer, torch.bfloat16, torch.device("cpu"))
    assert got is not None and got[0] is layer.lora_A["one"].weight and got[1] is layer.lora_B["one"].weight
    assert got[2] == layer.scaling["one"]
    assert lora.foldable_branch(layer, torch.float16, torch.device("cpu")) is None
    layer.scaling["one"] = 0.25  # read at the call, as PEFT reads it
    assert lora.foldable_branch(layer, torch.bfloat16, torch.device("cpu"))[2] == 0.25
    layer.enable_adapters(False)
    assert lora.foldable_branch(layer, torch.bfloat16, torch.device("cpu")) is None
    layer.enable_adapters(True)
    holder, layer2 = _peft_linear(16, 8, ["one", "two"])
    layer2.set_adapter(["one", "two"])
    assert lora.foldable_branch(layer2, torch.bfloat16, torch.device("cpu")) is None
    layer2.set_adapter("two")
    assert lora.foldable_branch(layer2, torch.bfloat16, torch.device("cpu"))[0] is layer2.lora_A["two"].weight
    holder3, layer3 = _peft_linear(16, 8, ["one"], dropout=0.1)
    holder3.train()
    assert lora.foldable_branch(layer3, torch.bfloat16, torch.device("cpu")) is None
    holder3.eval()
    assert lora.foldable_branch(layer3, torch.bfloat16, torch.device("cpu")) is not None


def test_the_feedforward_hands_net2_the_folded_products(monkeypatch):
    """projection.fp8_linear_gelu_fp8 with the kernels replaced by their expressions: where net[2]'s one branch
    folds, no GELU output is handed over and net[2] gets ``[(g @ A2.T, B2, scaling)]``; the FeedForward's output
    equals the one from net[2]'s branch computed from g."""
    from qwen_absorb.ops.fp8 import quantize_fp8_reference

    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    m, k, n = 6, 16, 256
    _, up = _peft_linear(k, n, ["one"])
    _, down = _peft_linear(n, k, ["one"])
    for layer in (up, down):
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=gen).to(bf) * 0.3
    x = torch.randn(m, k, generator=gen).to(bf)

    class W:
        def __init__(self, w):
            self.codes = w.to(torch.float8_e4m3fn)
            self.scale = torch.ones(())
            self.out_dtype = bf
            self.input_amax = torch.tensor(4.0)

    class LP:
        def __init__(self, layer):
            self.weight, self.lora, self.lora_active, self.fp8_gemm = W(layer.base_layer.weight), True, True, True
            self.tp, self.bias, self.input_scale = None, None, torch.ones(())

    class Plan:
        kernels, fast_accum, options = True, False, Options()

    lp_up, lp_down = LP(up), LP(down)

    def gemm(codes, lp, plan, out, *a, **kw):  # the FP8 GEMM in fp32, then the branches as the path adds them
        out.copy_((codes.float() @ lp.weight.codes.float().t()).to(out.dtype))
        prods = a[2] if len(a) > 2 else kw.get("branches")
        if prods:
            lora.add_products(out, prods)
        return out

    def gelu_ref(y, t, b, s, amax, act_out=False, tiles=True):
        h = y.clone().addmm_(t, b.t(), alpha=s)
        g = torch.nn.functional.gelu(h, approximate="tanh")
        return quantize_fp8_reference(g, amax), (g if act_out else None)

    def fold_ref(y, t, b, s, amax, a2):
        c, g = gelu_ref(y, t, b, s, amax, True)
        return c, torch.nn.functional.linear(g, a2)

    monkeypatch.setattr(projection, "fp8_linear_into", gemm)
    monkeypatch.setattr(lora_add, "reasons", lambda y, t, b: [])  # the CPU tensors: as if the kernel took them
    monkeypatch.setattr(lora_add, "add_gelu_fp8", gelu_ref)
    monkeypatch.setattr(lora_fold, "add_gelu_fp8_fold", fold_ref)
    monkeypatch.setattr(lora_fold, "reasons", lambda *a: [])
    codes = x.to(torch.float8_e4m3fn)
    c, g, branches = projection.fp8_linear_gelu_fp8(codes, lp_up, lp_down, Plan(), x, up, down)
    assert g is None and len(branches) == 1
    t2, b2, s2 = branches[0]
    assert b2 is down.lora_B["one"].weight and s2 == down.scaling["one"]
    off = Plan()
    off.options = Options(tuning=Tuning(lora_fold=False))  # the fold switched off through the API
    c_old, g_old, none = projection.fp8_linear_gelu_fp8(codes, lp_up, lp_down, off, x, up, down)
    assert none is None and g_old is not None
    assert torch.equal(c.view(torch.uint8), c_old.view(torch.uint8))
    assert torch.equal(t2, torch.nn.functional.linear(g_old, down.lora_A["one"].weight))
    # net[2] as the FeedForward runs it: the folded products, or its own products of g
    out_fold = torch.empty(m, k, dtype=bf)
    gemm(c, lp_down, Plan(), out_fold, None, down, branches)
    out_old = torch.empty(m, k, dtype=bf)
    gemm(c_old, lp_down, Plan(), out_old, None, down, lora.products(down, g_old, bf))
    assert torch.equal(out_fold, out_old)
