"""Issue 21, item 4: ModelOpt FP8 linears of Qwen-Image-2.1 as real FP8 GEMMs (qwen_absorb.fp8_forward). CPU,
tiny bf16 ModelOpt FP8 models, through the real-FP8 decision path (``fp8_gemm=True, capabilities={"cpu"}``:
``torch._scaled_mm`` has a CPU implementation; the fused ops run their torch references, whose FP8 codes are
the kernels' bit for bit, tests/test_qwenimage21_gpu.py).

Stale state is checked against a twin that did the same action *before* being patched: both run the same
real-FP8 computation from the same state, so their outputs are bit-identical unless the patched model
serves stale derived state (an old FP8 weight, amax or quantizer switch).
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import fp8_forward as F8
from qwen_absorb import ops
from . import builders as T

from .qwenimage21_helpers import f32 as _f32
from .qwenimage21_helpers import model_inputs, run, run_kv, spy_fp8_linears, tiny_model
from .qwenimage21_helpers import rel as _rel

pytest.importorskip("modelopt")

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}}
LAYERS = 2
N_LINEARS = 7 * LAYERS


def _models(seed: int = 0, flex: bool = False, cond: bool = False):
    """``(fp8 model, its bf16 inputs, the unquantized fp32 model)`` with the same weights."""
    m32 = tiny_model(dtype=torch.float32, seed=seed, layers=LAYERS, flex=flex)
    model = copy.deepcopy(m32).to(torch.bfloat16)
    inp = model_inputs(model, cond=cond, seed=seed + 1)
    T.fp8_quantize(model, [inp, model_inputs(model, cond=not cond, seed=seed + 2)])
    return model, inp, m32


def _fallbacks(report) -> dict:
    """Counted per-call fallbacks other than the CPU's (the fused ops run their references there)."""
    return {k: v for k, v in report.runtime_fallbacks.items() if k != "fused ops ran their torch references"}


def _installed(model) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__ and isinstance(m.__dict__["forward"],
                                                                                          F8.Fp8LinearForward)]


# ---------------------------------------------------------------------------- every linear real FP8


def test_every_linear_real_fp8_and_the_report_says_so(gemms):
    model, inp, _ = _models(0)
    report = qwen_absorb.patch(model, **REAL)
    s = report.summary
    assert s["fp8_gemm_linears"] == s["modelopt_linears"] == N_LINEARS, str(report)
    assert s["fp8_emitting_sites"] == 3 * LAYERS  # norm1, norm2, swiglu in every block
    assert f"real FP8 GEMMs: {N_LINEARS} of {N_LINEARS} ModelOpt linears" in str(report)
    assert s["sites_fused"] == 5 * LAYERS  # QuantLayerNorm norms are fused (their quantizer applied first)
    assert len(_installed(model)) == N_LINEARS
    run(model, inp)
    assert len(gemms) == N_LINEARS
    assert _fallbacks(report) == {}
    d = report.to_dict()
    assert all(lin["fp8_gemm"] for b in d["blocks"] for lin in b["linears"].values())


def test_default_options_on_cpu_refuse_with_reasons_and_stay_bit_identical(gemms):
    """fp8_gemm='auto' on the CPU: every linear runs as its module (ModelOpt fake quant), the report says
    why; the fused QuantLayerNorm sites are bit-identical to diffusers' eager + ModelOpt."""
    model, inp, _ = _models(1)
    want = run(model, inp)
    report = qwen_absorb.patch(model)
    s = report.summary
    assert s["fp8_gemm_linears"] == 0 and s["modelopt_linears"] == N_LINEARS, str(report)
    assert "real FP8 GEMMs need CUDA" in str(report)
    assert torch.equal(run(model, inp), want)
    assert not gemms
    qwen_absorb.unpatch(model)
    report = qwen_absorb.patch(model, fp8_gemm=False)
    assert _installed(model) == [] and report.summary["fp8_gemm_linears"] == 0
    assert torch.equal(run(model, inp), want)


# ---------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("cond", [False, True])
def test_fidelity_against_fp32_compared_with_fake_quant(cond):
    model, inp, m32 = _models(2, cond=cond)
    ref = run(m32, _f32(inp))
    fake = run(model, inp)
    qwen_absorb.patch(model, **REAL)
    real = run(model, inp)
    e_fake, e_real = _rel(fake, ref), _rel(real, ref)
    # tiny CPU models: a few hundred values, so the ratio is noisy; the GPU test gates at 1.05x
    assert e_real <= 2.0 * e_fake, (e_real, e_fake)
    assert _rel(real, fake) < 0.05


def _spy_quantize(monkeypatch) -> list:
    """The ``(block, path)`` of every real-FP8 linear that quantizes its input itself."""
    quantized, real_quantize = [], F8.Fp8LinearForward.quantize

    def quantize(self, x):
        quantized.append((self.index, self.path))
        return real_quantize(self, x)

    monkeypatch.setattr(F8.Fp8LinearForward, "quantize", quantize)
    return quantized


def test_codes_passed_to_the_gemms_equal_the_reference_quantization(monkeypatch):
    """Unhooked, the runner calls every GEMM but to_out.0's with the codes norm1 (to_q/k/v), norm2 (gate_layer/proj)
    and SwiGLU (out) emitted. With a (no-op) pre-hook on every linear each is called as a module and quantizes what
    it received, bit-identical to the reference quantizer of that tensor: the same output, bit for bit."""
    model, inp, _ = _models(3)
    qwen_absorb.patch(model, **REAL)
    quantized = _spy_quantize(monkeypatch)
    plain = run(model, inp)
    assert sorted(p for _, p in quantized) == ["attn.to_out.0"] * LAYERS
    monkeypatch.undo()

    seen, used, quantized = spy_fp8_linears(model, monkeypatch)
    hooked = run(model, inp)
    assert len(used) == N_LINEARS and len(quantized) == N_LINEARS
    for key, codes in used:
        lin = model.transformer_blocks[key[0]].get_submodule(key[1])
        want = ops.quantize_fp8_reference(seen[key], lin.input_quantizer._amax)
        assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8)), key
    assert torch.equal(hooked, plain)


def test_a_pre_hook_that_replaces_or_modifies_the_input_gets_its_own_codes(monkeypatch):
    """A pre-hook returning another tensor (to_k), or modifying the input in place (to_q of block 1): the emitted
    codes are not used for that block's q/k/v (the hook runs in the linear's call), each quantizes what it receives."""
    model, inp, _ = _models(12)
    qwen_absorb.patch(model, **REAL)
    plain = run(model, inp)
    quantized = _spy_quantize(monkeypatch)
    b0, b1 = model.transformer_blocks
    h0 = b0.attn.to_k.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    h1 = b1.attn.to_q.register_forward_pre_hook(lambda m, args: args[0].add_(0))  # same values, in place
    doubled = run(model, inp)
    assert sorted(quantized) == [(i, p) for i in (0, 1) for p in ("attn.to_k", "attn.to_out.0", "attn.to_q",
                                                                     "attn.to_v")]
    assert not torch.equal(doubled, plain)
    h0.remove()
    quantized.clear()
    assert torch.equal(run(model, inp), plain)  # add_(0): the codes of the same values
    h1.remove()


def test_patching_again_with_other_options_reinstalls():
    model, inp, _ = _models(13)
    fake = run(model, inp)
    qwen_absorb.patch(model, **REAL)
    real = run(model, inp)
    report = qwen_absorb.patch(model, fp8_gemm=False)
    assert _installed(model) == [] and report.summary["fp8_gemm_linears"] == 0
    assert torch.equal(run(model, inp), fake)
    assert qwen_absorb.patch(model, **REAL).summary["fp8_gemm_linears"] == N_LINEARS
    assert torch.equal(run(model, inp), real)


# ---------------------------------------------------------------------------- stale state


def _same_after(action, seed: int, kwargs=REAL, dtype=None):
    model, inp, _ = _models(seed)
    twin = copy.deepcopy(model)
    report = qwen_absorb.patch(model, **kwargs)
    assert report.summary["fp8_gemm_linears"] == N_LINEARS
    before = run(model, inp)
    action(model)
    if dtype is not None:
        inp = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inp.items()}
    out = run(model, inp)
    action(twin)
    twin_report = qwen_absorb.patch(twin, **kwargs)
    want = run(twin, inp)
    assert torch.equal(out, want), _rel(out, want)
    return before, out, report, twin_report


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_of_another_checkpoint(assign):
    other, _, _ = _models(40)
    sd = other.state_dict()
    before, out, report, _ = _same_after(lambda m: m.load_state_dict(sd, assign=assign), 4)
    assert not torch.equal(before, out)
    assert report.rebuilds and report.summary["fp8_gemm_linears"] == N_LINEARS


def test_weight_modified_in_place_and_amax_recalibrated():
    def action(m):
        with torch.no_grad():
            m.transformer_blocks[0].img_mlp.gate_layer.weight.mul_(1.5)
            m.transformer_blocks[1].attn.to_q.input_quantizer._amax.mul_(2.0)  # to_q now differs from to_k/to_v

    before, out, report, _ = _same_after(action, 5)
    assert not torch.equal(before, out)
    s = report.summary  # block 1's norm1 no longer emits (its consumers disagree on the amax)
    assert s["fp8_gemm_linears"] == N_LINEARS and s["fp8_emitting_sites"] == 3 * LAYERS - 1, str(report)


def test_disable_quantizer_is_honoured():
    mtq = pytest.importorskip("modelopt.torch.quantization")

    def action(m):
        mtq.disable_quantizer(m, "*img_mlp.out.input_quantizer")

    _, _, report, twin_report = _same_after(action, 6)
    for r in (report, twin_report):
        assert r.summary["fp8_gemm_linears"] == N_LINEARS - LAYERS, str(r)
        assert "input quantizer: quantizer is disabled" in str(r)


def test_mtq_compress_after_patching():
    """mtq.compress swaps the weights for ModelOpt's FP8 storage (and the class in place): the FP8 GEMMs
    then reuse ModelOpt's stored codes."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    _, _, report, twin_report = _same_after(mtq.compress, 14)
    for r in (report, twin_report):
        assert r.summary["fp8_gemm_linears"] == N_LINEARS, str(r)
        assert all(lin.reused_compressed_storage for b in r.blocks for lin in b.linears.values())


def test_dtype_move_rebuilds():
    _, out, report, _ = _same_after(lambda m: m.to(torch.float16), 7, dtype=torch.float16)
    assert out.dtype == torch.float16 and report.summary["fp8_gemm_linears"] == N_LINEARS


# ---------------------------------------------------------------------------- hooks, PEFT, unpatch, copies


def test_forward_hooks_on_linears_run_and_edit_the_output():
    model, inp, _ = _models(8)
    qwen_absorb.patch(model, **REAL)
    plain = run(model, inp)
    calls = []

    def hook(m, args, out):
        calls.append(out.dtype)
        return out * 0.5

    handles = [model.transformer_blocks[0].attn.to_q.register_forward_hook(hook),
               model.transformer_blocks[1].img_mlp.gate_layer.register_forward_hook(hook)]
    edited = run(model, inp)
    assert calls == [torch.bfloat16, torch.bfloat16]
    assert not torch.equal(edited, plain)
    twin = copy.deepcopy(model)  # a copy carries the hooks and the patch, and rebuilds its own FP8 weights
    assert torch.equal(run(twin, inp), edited)
    for h in handles:
        h.remove()
    assert torch.equal(run(model, inp), plain)


def test_peft_lora_linears_run_as_their_modules():
    peft = pytest.importorskip("peft")
    model, inp, _ = _models(9)
    twin = copy.deepcopy(model)
    cfg = peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian", target_modules=["to_q"])

    def add(m):
        m.add_adapter(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_A" in n or "lora_B" in n:  # both drawn here: the twin gets the same adapter
                    p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)

    report = qwen_absorb.patch(model, **REAL)  # patched, then LoRA: to_q is wrapped since patching
    add(model)
    out = run(model, inp)
    assert report.runtime_fallbacks[F8.MOVED_FALLBACK] == LAYERS
    add(twin)  # LoRA, then patched: to_q refused with the reason
    twin_report = qwen_absorb.patch(twin, **REAL)
    assert twin_report.summary["fp8_gemm_linears"] == N_LINEARS - LAYERS
    assert F8.PEFT_REFUSAL in str(twin_report)
    assert torch.equal(out, run(twin, inp))


def test_unpatch_restores_exactly():
    model, inp, _ = _models(10)
    want = run(model, inp)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    qwen_absorb.patch(model, **REAL)
    assert model.state_dict().keys() == sd.keys()
    assert not torch.equal(run(model, inp), want)  # real FP8 is not fake quant
    qwen_absorb.unpatch(model)
    assert _installed(model) == []
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(run(model, inp), want)
    after = model.state_dict()
    assert after.keys() == sd.keys() and all(torch.equal(after[k], v) for k, v in sd.items())


# ---------------------------------------------------------------------------- the KV cache


@pytest.mark.slow
@pytest.mark.parametrize("flex", [False, True])
def test_kv_cache_extract_then_cached(gemms, flex):
    model, inp, m32 = _models(11, flex=flex, cond=True)
    inp_c = model_inputs(model, cond=True, seed=50)
    ref = run_kv(m32, _f32(inp), _f32(inp_c))
    fake = run_kv(model, inp, inp_c)
    report = qwen_absorb.patch(model, **REAL)
    real = run_kv(model, inp, inp_c)
    assert len(gemms) == 2 * N_LINEARS
    for r, f, e in zip(real, fake, ref):
        assert _rel(r, e) <= 2.0 * _rel(f, e), (_rel(r, e), _rel(f, e))
    assert _fallbacks(report) == {}
