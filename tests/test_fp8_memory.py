"""FP8 at FP8 memory by default (issue 39 A): the original weights of real-FP8 linears live on the host.

The GPU side is faked: ``host_originals.ACCELERATOR_TYPES`` gets "cpu" (so the CPU runs the real-FP8 path with
``capabilities={"cpu"}`` as if it were a GPU, the host being the same memory) and "meta" (so ``.to("meta")`` is a
move to a GPU whose placement can be checked). Every action that needs the originals is compared against a twin
patched with ``offload_original_weights=False`` (today's behaviour: both copies where the model is).
"""

from __future__ import annotations

import copy

import pytest
import torch

import qwen_absorb
from qwen_absorb import host_originals as H
from . import builders as T
from qwen_absorb.plan import PLAN_ATTR
from qwen_absorb.sites import resolve, unwrap_peft

pytest.importorskip("modelopt.torch.quantization")

REAL = {"fp8_gemm": True, "capabilities": {"cpu"}, "cuda_graph": False}


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(H, "ACCELERATOR_TYPES", ("cpu", "meta"))


def _fp8(seed, compress=False):
    model = T.tiny_transformer(dtype=torch.bfloat16, seed=seed)
    kw = T.transformer_inputs(model, seed=seed + 1)
    T.fp8_quantize(model, [kw, T.transformer_inputs(model, seed=seed + 2)], compress=compress)
    return model, T.transformer_inputs(model, seed=seed + 3)


def _real_fp8_bases(model):
    out = []
    for block in model.transformer_blocks:
        plan = block.__dict__[PLAN_ATTR]
        out += [unwrap_peft(resolve(block, p))[0] for p, lp in plan.linears.items() if lp.fp8_gemm]
    return out


def _host_kept(model):
    return [h.module for b in model.transformer_blocks for h in b.__dict__.get(H.HOST_ATTR, [])]


def _intercepted(model):
    return [m for m in model.modules() if "_apply" in m.__dict__]


def _moves(model):  # the patched blocks' own moves (host_originals.BlockMove)
    return {id(b) for b in model.transformer_blocks if isinstance(b.__dict__.get("_apply"), H.BlockMove)}


def _sd_equal(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        x, y = sa[k], sb[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.device == y.device and torch.equal(x, y), k


def test_originals_kept_on_host_for_real_fp8_linears_only(fake_gpu, seed):
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL, offload_original_weights=False)
    out, want = T.run_transformer(model, kw), T.run_transformer(twin, kw)
    assert torch.equal(out, want)
    bases = _real_fp8_bases(model)
    assert len(bases) == 14 * len(model.transformer_blocks)
    assert {id(m) for m in _host_kept(model)} == {id(m) for m in bases}
    assert len(_moves(model)) == len(model.transformer_blocks)
    assert {id(m) for m in _intercepted(model)} == {id(m) for m in bases} | _moves(model)  # nothing else changed
    assert {id(w) for w in H.host_weights(model)} == {id(m._parameters["weight"]) for m in bases}
    for block in model.transformer_blocks:
        assert all(lp.offloaded == lp.fp8_gemm for lp in block.__dict__[PLAN_ATTR].linears.values())
    assert {id(m) for m in _intercepted(twin)} == _moves(twin) and not H.host_weights(twin)  # False: all on device
    # the report says so per linear
    lin = [x for b in qwen_absorb.patch_report(model).to_dict()["blocks"] for x in b["linears"].values()]
    assert sum(bool(x.get("original_weight_offloaded")) for x in lin) == len(bases)


def test_model_moved_to_a_gpu_keeps_originals_on_host(fake_gpu, seed):
    """``.to(<gpu>)`` (what accelerate's model offload does before every call) moves everything but the kept
    originals; the FP8 codes built for the old device are released, the decisions kept for a return
    (``host_originals.BlockMove``); ``unpatch`` puts the originals where the model is."""
    model, kw = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    T.run_transformer(model, kw)
    kept = {id(m._parameters["weight"]) for m in _host_kept(model)}
    names = [n for n, _ in model.named_parameters()]
    model.to("meta")
    for name, p in model.named_parameters():
        assert p.device.type == ("cpu" if id(p) in kept else "meta"), name
    assert all(b.device.type == "meta" for b in model.buffers())
    for block in model.transformer_blocks:
        plan = block.__dict__[PLAN_ATTR]
        assert plan.rt.device == torch.device("cpu") and plan.rt.codes_gone
        assert all(lp.weight is None for lp in plan.linears.values())
    qwen_absorb.unpatch(model)
    assert [n for n, _ in model.named_parameters()] == names
    assert all(p.device.type == "meta" for p in model.parameters())
    assert not _intercepted(model)


@pytest.mark.slow
def test_unpatch_restores_the_exact_model(fake_gpu, seed):
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    want = T.run_transformer(twin, kw)
    qwen_absorb.patch(model, **REAL)
    T.run_transformer(model, kw)
    _sd_equal(model, twin)  # state_dict while patched: the same values (on the host)
    qwen_absorb.unpatch(model)
    _sd_equal(model, twin)
    assert not _intercepted(model) and all(H.HOST_ATTR not in b.__dict__ for b in model.transformer_blocks)
    assert torch.equal(T.run_transformer(model, kw), want)


@pytest.mark.slow
def test_compressed_model_is_not_duplicated(fake_gpu, seed):
    """``mtq.compress``: the FP8 codes the GEMMs read are the module's own storage; nothing is kept twice and
    nothing moves."""
    model, kw = _fp8(seed, compress=True)
    twin, _ = _fp8(seed, compress=True)  # ModelOpt's compressed weights cannot be deep-copied
    qwen_absorb.patch(model, **REAL)
    out = T.run_transformer(model, kw)
    bases = _real_fp8_bases(model)
    assert bases and not _host_kept(model) and {id(m) for m in _intercepted(model)} == _moves(model)
    for block in model.transformer_blocks:
        for p, lp in block.__dict__[PLAN_ATTR].linears.items():
            if lp.fp8_gemm:
                w = unwrap_peft(resolve(block, p))[0]._parameters["weight"]
                assert lp.weight.reused_storage
                assert lp.weight.codes.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
    qwen_absorb.patch(twin, **REAL, offload_original_weights=False)
    assert torch.equal(out, T.run_transformer(twin, kw))
    qwen_absorb.unpatch(model)
    _sd_equal(model, twin)


def _lora(model, seed):
    from peft import LoraConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "net.2"],
                                     init_lora_weights=False), adapter_name="a")
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data = p.data.to(torch.bfloat16)


def _grad_call(m, kw):
    with torch.enable_grad():
        return m(**kw)[0].detach()


def _scale_amax(m):
    with torch.no_grad():
        q = m.transformer_blocks[0].attn.to_q
        q.input_quantizer._amax.mul_(1.25)
        m.transformer_blocks[1].img_mlp.net[2].weight_quantizer._amax.mul_(0.75)


def _new_weights(m):
    sd = m.state_dict()
    k = "transformer_blocks.0.attn.add_k_proj.weight"
    sd[k] = sd[k] * 0.5
    m.load_state_dict(sd)


def _inplace_weight(m):
    with torch.no_grad():
        m.transformer_blocks[1].attn.to_v.weight.mul_(1.5)


ACTIONS = {
    "grad_fallback": None,  # diffusers' forward on the originals
    "amax_change": _scale_amax,
    "dtype_move": lambda m: m.to(torch.float32),
    "dtype_round_trip": lambda m: m.to(torch.float32).to(torch.bfloat16),
    "load_state_dict": _new_weights,
    "weight_in_place": _inplace_weight,
    "lora_then_fuse": lambda m: (_lora(m, 5), m.fuse_lora()),
}


@pytest.mark.slow
@pytest.mark.parametrize("action", list(ACTIONS))
def test_actions_that_need_the_originals_match_today(fake_gpu, action, seed):
    """Each action on a model patched with the default against the same action on a twin patched with
    ``offload_original_weights=False``; both also against the unpatched model where the action is defined."""
    model, kw = _fp8(seed)
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL, offload_original_weights=False)
    assert _host_kept(model)
    T.run_transformer(model, kw), T.run_transformer(twin, kw)
    if action == "grad_fallback":
        out, want, ref = _grad_call(model, kw), _grad_call(twin, kw), _grad_call(plain, kw)
        assert torch.equal(out, ref)
        rep = qwen_absorb.patch_report(model)
        assert any("grad enabled" in r for r in rep.runtime_fallbacks)
    else:
        for m in (model, twin):
            ACTIONS[action](m)
        kw2 = {k: (v.to(next(model.parameters()).dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                   else v) for k, v in kw.items()}
        out, want = T.run_transformer(model, kw2), T.run_transformer(twin, kw2)
    assert torch.equal(out, want), action
    _sd_equal(model, twin)
    qwen_absorb.unpatch(model)
    qwen_absorb.unpatch(twin)
    _sd_equal(model, twin)
    assert not _intercepted(model)


def test_lora_linears_keep_their_originals_where_the_model_is(fake_gpu, seed):
    """PEFT merges into the base weight on its device and puts new adapters there: a LoRA linear's weight is
    not kept on the host (loaded after patching: put back at the next decision, adapters with it)."""
    model, kw = _fp8(seed)
    qwen_absorb.patch(model, **REAL)
    T.run_transformer(model, kw)
    n_before = len(_host_kept(model))
    _lora(model, 6)
    T.run_transformer(model, kw)
    lora_bases = [m.base_layer for m in model.modules() if hasattr(m, "lora_A")]
    assert lora_bases and not {id(m) for m in lora_bases} & {id(m) for m in _host_kept(model)}
    assert len(_host_kept(model)) == n_before - len(lora_bases)


def test_offload_original_weights_is_checked(seed):
    model, _ = _fp8(seed)
    with pytest.raises(ValueError, match="offload_original_weights"):
        qwen_absorb.patch(model, offload_original_weights="yes")


def test_codes_and_fingerprints_come_from_the_staged_copy(fake_gpu, seed, monkeypatch):
    """A host-kept weight read on the device (``quant.staged_weight``: one copy to the GPU) is fingerprinted and
    quantized from that copy, never read on the host. A clone stands in for the GPU copy: as it is, the decision
    gives the twin's bits; doubled (poisoned), the codes and the key's fingerprint follow the copy."""
    from qwen_absorb import quant
    from qwen_absorb.watch import content_fingerprint

    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL, offload_original_weights=False)
    T.run_transformer(model, kw), T.run_transformer(twin, kw)
    staged, kept = [], {id(m._parameters["weight"]) for m in _host_kept(model)}

    def stage(m, device, pinned=False, scale=1.0):  # the twin's weights are where it runs: nothing to stage (None)
        w = unwrap_peft(m)[0]._parameters["weight"]
        if id(w) not in kept:
            return None
        staged.append(w.detach() * scale)
        return staged[-1]

    monkeypatch.setattr(quant, "staged_weight", stage)
    for m in (model, twin):
        _scale_amax(m)  # every linear of two blocks decides anew
    assert torch.equal(T.run_transformer(model, kw), T.run_transformer(twin, kw)) and staged
    monkeypatch.setattr(quant, "staged_weight", lambda m, d, pinned=False: stage(m, d, pinned, 2.0))
    staged.clear()
    for m in (model, twin):
        _scale_amax(m)
    out, want = T.run_transformer(model, kw), T.run_transformer(twin, kw)
    assert not torch.equal(out, want)  # the codes are the doubled copy's
    block = model.transformer_blocks[1]  # its img_mlp.net.2 decided anew (a new weight amax), as an FP8 GEMM
    lp = block.__dict__[PLAN_ATTR].linears["img_mlp.net.2"]
    w = unwrap_peft(resolve(block, "img_mlp.net.2"))[0]._parameters["weight"]
    assert lp.fp8_gemm and lp.offloaded
    assert lp.cache_key[2][4] == content_fingerprint(w.detach() * 2.0) != content_fingerprint(w)


def test_pinned_staging_is_the_tunings_choice(fake_gpu, seed, monkeypatch):
    """``Tuning.pinned_staging`` reaches each decision's staging (``quant.staged_weight(..., pinned)``): on by
    default, off with ``pinned_staging=False``; on the host ``staging.to_device`` is a plain copy with the same bits."""
    from qwen_absorb import quant, staging

    seen = []
    real = quant.staged_weight
    monkeypatch.setattr(quant, "staged_weight", lambda m, d, pinned=False: seen.append(pinned) or real(m, d, pinned))
    for tuning, want in ((qwen_absorb.Tuning(), True), (qwen_absorb.Tuning(pinned_staging=False), False)):
        model, kw = _fp8(seed)
        qwen_absorb.patch(model, **REAL, tuning=tuning)
        T.run_transformer(model, kw)
        assert seen and set(seen) == {want}, (tuning, seen)
        seen.clear()
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    y = staging.to_device(x, torch.device("cpu"), chunk=256)
    assert torch.equal(y, x) and y.dtype == x.dtype


def _away_and_back(model):
    """What a model offload does between pipeline calls, for the decisions: the model leaves its device (the FP8
    codes are released, ``host_originals._release``) and its next call decides for the device again. The weights
    stay where they are (a CPU test cannot leave the host and come back with values)."""
    for block in model.transformer_blocks:
        H._release(block, torch.device("meta"))


HOST_CODES = qwen_absorb.Tuning(host_fp8_codes=True)  # opt-in (off by default: benchmarks/NOTES.md)


def _quantizations(monkeypatch):
    from qwen_absorb import quant

    made = []
    real = quant.quantize_fp8_reference
    monkeypatch.setattr(quant, "quantize_fp8_reference", lambda x, amax: made.append(x.shape) or real(x, amax))
    return made


def test_a_model_back_on_its_device_takes_its_codes_from_the_host(fake_gpu, seed, monkeypatch):
    """Model offload: the first departure copies each real-FP8 linear's codes to the host, a return with unchanged
    sources copies them back and quantizes nothing, with the bits of a twin that rebuilds them
    (the default, ``host_fp8_codes=False``). A second departure copies nothing again."""
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL, tuning=HOST_CODES)
    qwen_absorb.patch(twin, **REAL)  # the default: each return rebuilds the codes
    want = T.run_transformer(twin, kw)
    assert torch.equal(T.run_transformer(model, kw), want)
    codes = {(i, p): lp.weight.codes for i, b in enumerate(model.transformer_blocks)
             for p, lp in b.__dict__[PLAN_ATTR].linears.items() if lp.fp8_gemm}
    _away_and_back(model), _away_and_back(twin)
    stores = [b.__dict__[PLAN_ATTR].rt.host_codes for b in model.transformer_blocks]
    assert {(i, p) for i, s in enumerate(stores) for p in s} == set(codes)
    assert all(torch.equal(s[p].codes.view(torch.uint8), codes[i, p].view(torch.uint8)) and s[p].codes.device.type == "cpu"
               for i, s in enumerate(stores) for p in s)
    assert not any(b.__dict__[PLAN_ATTR].rt.host_codes for b in twin.transformer_blocks)
    made = _quantizations(monkeypatch)
    for _ in range(2):
        assert torch.equal(T.run_transformer(model, kw), want)
        assert not made  # every code came back from the host
        held = [dict(s) for s in stores]
        _away_and_back(model)
        assert all(s[p] is h[p] for s, h in zip(stores, held) for p in h)  # nothing copied again
    assert torch.equal(T.run_transformer(twin, kw), want) and len(made) == len(codes)  # the twin rebuilt them


def test_host_codes_follow_their_sources(fake_gpu, seed, monkeypatch):
    """Away from the device, an in-place write to a host-kept original (its version) and a new weight amax (its
    value) each make that linear's codes again on return, as the twin's; the others still come from the host."""
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL, tuning=HOST_CODES)
    qwen_absorb.patch(twin, **REAL)  # the default: each return rebuilds the codes
    T.run_transformer(model, kw), T.run_transformer(twin, kw)
    _away_and_back(model), _away_and_back(twin)
    for m in (model, twin):
        with torch.no_grad():
            m.transformer_blocks[0].attn.to_k.weight.mul_(0.5)
            m.transformer_blocks[1].img_mlp.net[2].weight_quantizer._amax.mul_(0.75)
    made = _quantizations(monkeypatch)
    assert torch.equal(T.run_transformer(model, kw), T.run_transformer(twin, kw))
    n_twin = sum(lp.fp8_gemm for b in twin.transformer_blocks for lp in b.__dict__[PLAN_ATTR].linears.values())
    assert len(made) == 2 + n_twin  # the two changed linears here, every linear in the twin
    store = model.transformer_blocks[0].__dict__[PLAN_ATTR].rt.host_codes
    assert "attn.to_k" not in store and "attn.to_q" in store  # the changed one is forgotten until it leaves again


def test_host_codes_are_forgotten_by_patch_and_unpatch(fake_gpu, seed):
    """``patch()`` again forgets them (a ``.data`` write shows to neither key: patch() is where it is seen), and
    ``unpatch()`` frees them with the rest of the patch; the default (``host_fp8_codes=False``) keeps none."""
    model, kw = _fp8(seed)
    qwen_absorb.patch(model, **REAL, tuning=HOST_CODES)
    T.run_transformer(model, kw)
    _away_and_back(model)
    rts = [b.__dict__[PLAN_ATTR].rt for b in model.transformer_blocks]
    assert all(rt.host_codes for rt in rts)
    qwen_absorb.patch(model, **REAL, tuning=HOST_CODES)
    assert not any(rt.host_codes for rt in rts)
    T.run_transformer(model, kw)
    _away_and_back(model)
    rts = [b.__dict__[PLAN_ATTR].rt for b in model.transformer_blocks]
    assert all(rt.host_codes for rt in rts)
    qwen_absorb.unpatch(model)
    assert not any(rt.host_codes for rt in rts)
    qwen_absorb.patch(model, **REAL)
    T.run_transformer(model, kw)
    _away_and_back(model)
    assert not any(b.__dict__[PLAN_ATTR].rt.host_codes for b in model.transformer_blocks)


@pytest.mark.slow
def test_a_lora_baked_in_while_away_is_served_on_return(fake_gpu, seed):
    """diffusers' "bake a LoRA" recipe while the model is offloaded: add, fuse, unload. PEFT merges through
    ``.data`` (no version moves), but the wrap and unwrap are registrations into watched slots: the return makes the
    codes from the merged originals, as a twin patched after the same recipe."""
    peft = pytest.importorskip("peft")
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL, tuning=HOST_CODES)
    before = T.run_transformer(model, kw)
    _away_and_back(model)
    assert all(b.__dict__[PLAN_ATTR].rt.host_codes for b in model.transformer_blocks)
    for m in (model, twin):
        torch.manual_seed(seed)
        m.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                      target_modules=["to_q", "img_mlp.net.2"]), adapter_name="x")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # gaussian init leaves lora_B at zero: give every branch a value
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        m.fuse_lora()
        m.unload_lora()
    out = T.run_transformer(model, kw)
    qwen_absorb.patch(twin, **REAL)
    want = T.run_transformer(twin, kw)
    assert torch.equal(out, want) and not torch.equal(out, before)


def test_a_copy_carries_no_host_codes(fake_gpu, seed):
    """A deep copy (or pickle) of a model whose codes are kept on the host starts without them: they would match
    none of the copy's weights, and for the 60-layer model they are 19 GiB. The copy still computes the same."""
    model, kw = _fp8(seed)
    qwen_absorb.patch(model, **REAL, tuning=HOST_CODES)
    want = T.run_transformer(model, kw)
    _away_and_back(model)
    assert all(b.__dict__[PLAN_ATTR].rt.host_codes for b in model.transformer_blocks)
    twin = copy.deepcopy(model)
    assert not any(b.__dict__[PLAN_ATTR].rt.host_codes for b in twin.transformer_blocks)
    assert torch.equal(T.run_transformer(twin, kw), want) and torch.equal(T.run_transformer(model, kw), want)


def _away(model, monkeypatch):
    """Model offload's departure as the blocks see it: their tensors in new storage (a clone, on the host: a CPU
    test cannot leave it and come back with values), announced as a move to another device."""
    with monkeypatch.context() as m:
        m.setattr(H, "_destination", lambda block, fn: (torch.device("meta"), True))
        model._apply(lambda t: t.clone())


def _back(model):  # the return: new storage again, on the device the blocks decided for
    model._apply(lambda t: t.clone())


def _decisions(monkeypatch):
    from qwen_absorb import block as B

    made, real = [], B.decide
    monkeypatch.setattr(B, "decide", lambda plan, block, device: made.append(block) or real(plan, block, device))
    return made


KEEP_NOT = qwen_absorb.Tuning(move_keeps_decisions=False)


def test_a_return_with_nothing_changed_keeps_the_decisions(fake_gpu, seed, monkeypatch):
    """A move away drops the FP8 codes and keeps the decisions; the first call back makes the codes again from the
    originals (each fingerprinted once, nothing decided) with the bits of a twin that decides anew
    (``move_keeps_decisions=False``), hand-offs included from the next call."""
    from qwen_absorb import plan as PL

    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL, tuning=KEEP_NOT)
    want = T.run_transformer(twin, kw)
    assert torch.equal(T.run_transformer(model, kw), want)
    plans = [b.__dict__[PLAN_ATTR] for b in model.transformer_blocks]
    n_fp8 = sum(lp.fp8_gemm for p in plans for lp in p.linears.values())
    for m in (model, twin):
        _away(m, monkeypatch)
    assert all(p.rt.codes_gone and p.rt.device == torch.device("cpu") for p in plans)
    assert all(lp.weight is None and lp.input_scale is None for p in plans for lp in p.linears.values())
    for m in (model, twin):
        _back(m)
    decided, made = _decisions(monkeypatch), _quantizations(monkeypatch)
    reads = []
    monkeypatch.setattr(PL, "content_fingerprint", lambda t: reads.append(t) or None)
    assert torch.equal(T.run_transformer(model, kw), want)
    assert not decided and len(reads) == len(made) == n_fp8
    assert not any(p.rt.codes_gone for p in plans)
    rebuilds = qwen_absorb.patch_report(model).rebuilds
    assert rebuilds["back on cpu: decisions kept, FP8 codes made again"] == len(plans)
    handoffs = sum(plans[0].rt.handoffs.values())
    assert torch.equal(T.run_transformer(model, kw), want)
    assert sum(plans[0].rt.handoffs.values()) == handoffs + len(plans) - 1
    monkeypatch.undo()
    assert torch.equal(T.run_transformer(twin, kw), want)
    assert not qwen_absorb.patch_report(twin).rebuilds.get("back on cpu: decisions kept, FP8 codes made again")
    qwen_absorb.unpatch(model)
    assert not _intercepted(model)


@pytest.mark.parametrize("when", ["away", "back"])
def test_a_change_around_a_move_is_decided_anew(fake_gpu, seed, monkeypatch, when):
    """An in-place write to a host-kept original, a bias and an input amax, made while the model is away or after it
    is back but before its next call: the blocks decide anew and compute what a twin patched afterwards does."""
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    T.run_transformer(model, kw)
    _away(model, monkeypatch)

    def change(m):
        with torch.no_grad():
            m.transformer_blocks[0].attn.to_k.weight.mul_(0.5)
            m.transformer_blocks[1].attn.to_q.bias.add_(0.25)
            m.transformer_blocks[1].img_mlp.net[2].input_quantizer._amax.mul_(1.5)

    if when == "away":
        change(model)
    _back(model)
    if when == "back":
        change(model)
    change(twin)
    decided = _decisions(monkeypatch)
    out = T.run_transformer(model, kw)
    assert {id(b) for b in decided} == {id(b) for b in model.transformer_blocks[:2]}
    monkeypatch.undo()
    qwen_absorb.patch(twin, **REAL)
    assert torch.equal(out, T.run_transformer(twin, kw))


def test_a_dtype_move_is_decided_anew(fake_gpu, seed):
    """``.to(dtype)`` changes more than the device: no decision is kept (the watch sees the new tensors), and the
    model computes what a twin that keeps none does."""
    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    qwen_absorb.patch(twin, **REAL, tuning=KEEP_NOT)
    T.run_transformer(model, kw), T.run_transformer(twin, kw)
    for m in (model, twin):
        m.to(torch.float32)
    assert not any(b.__dict__[PLAN_ATTR].rt.codes_gone for b in model.transformer_blocks)
    kw32 = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
    assert torch.equal(T.run_transformer(model, kw32), T.run_transformer(twin, kw32))
    assert "the model changed (modules, weights, quantizers or LoRA adapters)" in qwen_absorb.patch_report(model).rebuilds


def test_a_data_write_while_away_is_served_and_keyed(fake_gpu, seed, monkeypatch):
    """A write through ``.data`` while the model is away (PEFT's way: no version moves, the decisions are kept): the
    codes made at the return are the written original's (a twin patched afterwards gives the same bits), and their
    key says so (``patch()`` again finds nothing changed)."""
    from qwen_absorb import plan as PL

    model, kw = _fp8(seed)
    twin = copy.deepcopy(model)
    qwen_absorb.patch(model, **REAL)
    before = T.run_transformer(model, kw)
    _away(model, monkeypatch)
    delta = torch.randn(64, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16) * 0.05
    for m in (model, twin):
        m.transformer_blocks[0].attn.to_k.weight.data += delta
    _back(model)
    out = T.run_transformer(model, kw)
    assert not qwen_absorb.patch_report(model).rebuilds.get("the model changed (modules, weights, quantizers or "
                                                            "LoRA adapters)")  # decisions kept
    qwen_absorb.patch(twin, **REAL)
    assert torch.equal(out, T.run_transformer(twin, kw)) and not torch.equal(out, before)
    block = model.transformer_blocks[0]
    assert not PL.content_changed(block.__dict__[PLAN_ATTR], block)
