"""Issue 9: ordinary actions on a patched model give correct numbers or a clear refusal, never a
silent wrong number or a half-patched model. CPU, tiny models, deferral forced where a GPU would
enable it (``defer_bias=True, capabilities={"cpu"}``), so a bias added twice or lost shows.
"""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch

import qwen_absorb
from . import builders as T
from qwen_absorb.block import PatchedForward


def _fp8_model(seed, dtype=torch.float32):
    model = T.tiny_transformer(dtype=dtype, seed=seed)
    with torch.no_grad():  # make the deferrable biases matter
        for blk in model.transformer_blocks:
            for lin in (blk.attn.to_out[0], blk.attn.to_add_out, blk.img_mlp.net[2], blk.txt_mlp.net[2]):
                lin.bias.mul_(8.0)
    T.fp8_quantize(model, [T.transformer_inputs(model, batch_size=2, seed=seed + 1)])
    return model


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _deferred(model):
    report = qwen_absorb.patch(model, defer_bias=True, capabilities={"cpu"})
    assert report.summary["biases_deferred"] == 8
    return report


def _close(out, ref):
    # deferral moves one rounding point; a doubled or lost bias moves the output by >10x more
    assert _rel(out, ref) < 2e-3, _rel(out, ref)


def test_deepcopy_of_patched_model_is_independent_and_right(seed):
    model = _fp8_model(seed)
    inp = T.transformer_inputs(model, batch_size=2, seed=seed + 2)
    ref = T.run_transformer(model, inp)
    _deferred(model)
    patched = T.run_transformer(model, inp)
    _close(patched, ref)
    twin = copy.deepcopy(model)
    assert torch.equal(T.run_transformer(twin, inp), patched)
    assert qwen_absorb.patch_report(twin) is not qwen_absorb.patch_report(model)
    fwd = twin.transformer_blocks[0].forward
    assert isinstance(fwd, PatchedForward) and fwd.block is twin.transformer_blocks[0]
    # the twin's patch is its own: unpatching it leaves the original patched, and vice versa
    qwen_absorb.unpatch(twin)
    assert torch.equal(T.run_transformer(twin, inp), ref)
    assert torch.equal(T.run_transformer(model, inp), patched)


def test_replacing_a_deferred_projection_after_patching(seed):
    model = _fp8_model(seed)
    inp = T.transformer_inputs(model, batch_size=2, seed=seed + 2)
    report = _deferred(model)
    blk = model.transformer_blocks[0]
    new = torch.nn.Linear(blk.attn.to_out[0].in_features, blk.attn.to_out[0].out_features)
    with torch.no_grad():
        new.weight.normal_(0, 0.1)
        new.bias.normal_(0, 1.0)
    blk.attn.to_out[0] = new
    out = T.run_transformer(model, inp)
    qwen_absorb.unpatch(model)
    want = T.run_transformer(model, inp)
    _close(out, want)  # block 0 decided anew for the new linear: its bias once
    assert report.rebuilds and sum(report.rebuilds.values()) == 1, report.rebuilds
    # and patch() again keeps deciding for the new structure
    qwen_absorb.patch(model, defer_bias=True, capabilities={"cpu"})
    _close(T.run_transformer(model, inp), want)


def test_threads_with_deferred_biases(seed):
    # An unquantized model with deferral forced: ModelOpt's own modules are not thread-safe (an
    # unpatched ModelOpt model called from threads fails by itself: QuantAttention swaps global
    # functions, QuantLinear toggles per-module state), so this isolates qwen_absorb's bias handling.
    model = _plain_with_big_biases(seed)
    inputs = [T.transformer_inputs(model, batch_size=1, seed=seed + 10 + i) for i in range(4)]
    ref = [T.run_transformer(model, inp) for inp in inputs]
    _deferred(model)
    want = [T.run_transformer(model, inp) for inp in inputs]
    for w, r in zip(want, ref):
        _close(w, r)
    bad, errors = [], []

    def work(i):
        try:
            for _ in range(12):
                if not torch.equal(T.run_transformer(model, inputs[i]), want[i]):
                    bad.append(i)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not bad, (errors, bad)
    assert not any("meta" in r for r in qwen_absorb.patch_report(model).runtime_fallbacks)


def test_quantize_after_patch_calibrates_and_patch_again_repatches(seed):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    calib = [T.transformer_inputs(T.tiny_transformer(seed=seed), batch_size=2, seed=seed + 1)]
    plain = T.tiny_transformer(seed=seed)
    T.modelopt_calibrate(plain, mtq.FP8_DEFAULT_CFG, calib)  # quantized, never patched
    model = T.tiny_transformer(seed=seed)
    r1 = qwen_absorb.patch(model)
    T.modelopt_calibrate(model, mtq.FP8_DEFAULT_CFG, calib)  # quantized after patching
    inp = T.transformer_inputs(model, batch_size=2, seed=seed + 2)
    want = T.run_transformer(plain, inp)
    assert torch.equal(T.run_transformer(model, inp), want)  # converted: the blocks decided anew
    assert r1.rebuilds and "calibration" in str(r1.runtime_fallbacks)  # diffusers' forward while calibrating
    r2 = qwen_absorb.patch(model)  # the blocks follow the model: the same, current patch
    assert r2 is r1 and r2.summary["quantized_norms"] == 8
    assert torch.equal(T.run_transformer(model, inp), want)
    qwen_absorb.unpatch(model)
    assert torch.equal(T.run_transformer(model, inp), want)  # the norms' quantizers were calibrated


def test_exception_while_installing_leaves_nothing_patched(seed, monkeypatch):
    import importlib

    P = importlib.import_module("qwen_absorb.patch")  # the module (qwen_absorb.patch is the function)

    model = T.tiny_transformer(seed=seed)
    inp = T.transformer_inputs(model, seed=seed + 1)
    ref = T.run_transformer(model, inp)
    real = P._install
    calls = []

    def flaky(block, fwd):
        calls.append(block)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(block, fwd)

    monkeypatch.setattr(P, "_install", flaky)
    with pytest.raises(KeyboardInterrupt):
        qwen_absorb.patch(model)
    monkeypatch.setattr(P, "_install", real)
    assert qwen_absorb.patch_report(model) is None
    assert all("forward" not in b.__dict__ and "_qwen_absorb_plan" not in b.__dict__ for b in model.transformer_blocks)
    assert torch.equal(T.run_transformer(model, inp), ref)
    assert qwen_absorb.patch(model).summary["blocks_patched"] == 2


def _plain_with_big_biases(seed):
    model = T.tiny_transformer(seed=seed)
    with torch.no_grad():
        for blk in model.transformer_blocks:
            for lin in (blk.attn.to_out[0], blk.attn.to_add_out, blk.img_mlp.net[2], blk.txt_mlp.net[2]):
                lin.bias.mul_(8.0)
    return model


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_pickled_patched_model_stays_patched(seed, how):
    # unquantized with deferral forced: ModelOpt's converted classes cannot be pickled at all
    model = _plain_with_big_biases(seed)
    inp = T.transformer_inputs(model, batch_size=2, seed=seed + 2)
    _deferred(model)
    patched = T.run_transformer(model, inp)
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    report = qwen_absorb.patch_report(loaded)
    assert report is not None and report.active
    assert all(isinstance(b.forward, PatchedForward) and b.forward.block is b for b in loaded.transformer_blocks)
    assert torch.equal(T.run_transformer(loaded, inp), patched)
    qwen_absorb.unpatch(loaded)
    assert torch.equal(T.run_transformer(loaded, inp), T.run_transformer(_unpatched(model), inp))


def _unpatched(model):
    qwen_absorb.unpatch(model)
    return model


def test_patch_through_a_compiled_transformer(seed):
    pipe = T.tiny_pipeline(seed=seed)
    pipe.transformer = torch.compile(pipe.transformer)
    report = qwen_absorb.patch(pipe)
    assert report.summary["blocks_patched"] == 2
    qwen_absorb.unpatch(pipe)


@pytest.mark.parametrize("bad", [(9,), (9, 0, 1), "sm_90", [(9, "0")], (True, False), 90])
def test_capabilities_argument_is_checked(bad):
    model = T.tiny_transformer()
    with pytest.raises(ValueError, match="capabilities"):
        qwen_absorb.patch(model, capabilities=bad)


def test_no_kernels_warns_once_at_the_first_call(seed, caplog):
    model = T.tiny_transformer(seed=seed)
    inp = T.transformer_inputs(model, seed=seed + 1)
    with caplog.at_level("WARNING", logger="qwen_absorb"):
        qwen_absorb.patch(model)  # a model patched on the CPU may move to CUDA next: nothing said yet
        assert not [r for r in caplog.records if r.levelname == "WARNING"]
        T.run_transformer(model, inp)
        T.run_transformer(model, inp)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "tensors are on cpu" in warnings[0].getMessage()
    assert not any(r.getMessage().startswith("qwen_absorb:") for r in caplog.records)  # one prefix: the logger's


def test_group_offloading_keeps_fp8_linears_on_their_module_path(seed):
    """Issue 9 item 5 (found on the H200): leaf-level group offloading onloads a linear's weights only
    inside its own forward, so a linear under such a hook never runs as qwen_absorb's FP8 GEMM."""
    model = _fp8_model(seed, dtype=torch.bfloat16)
    model.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                               offload_type="leaf_level")
    inp = T.transformer_inputs(model, batch_size=2, seed=seed + 2)
    ref = T.run_transformer(model, inp)
    report = qwen_absorb.patch(model, fp8_gemm=True, defer_bias=False, capabilities={"cpu"})
    assert report.summary["fp8_gemm_linears"] == 0
    reasons = {r for b in report.blocks for lp in b.linears.values() for r in lp.fp8_reasons}
    assert any("offloading hook" in r for r in reasons), reasons
    assert torch.equal(T.run_transformer(model, inp), ref)
