"""CUDA-graph mode (qwen_absorb.cuda_graph) on a GPU: replays bit-identical to eager, invalidation, bounds, memory.

    python -m pytest -q -m gpu tests/test_cuda_graph_gpu.py          # all (FP8 and compile cases are also "slow")
    python -m pytest -q -m "gpu and not slow" tests/test_cuda_graph_gpu.py

Tiny random bf16 transformers (2 blocks, 64 wide) on ``cuda``, unpatched and patched with ``qwen_absorb.patch``,
text-to-image and ``zero_cond_t`` (Qwen-Image-Edit-2511). Every comparison is ``torch.equal`` against the same
configuration run eagerly, on inputs drawn fresh per run (``seed`` fixture); a twin model built from the same
seed serves as the eager reference where the graphed model itself is changed (LoRA, weights).
"""

from __future__ import annotations

import collections
import copy
import gc
import logging

import pytest
import torch

import qwen_absorb
from qwen_absorb import cuda_graph as CG
from qwen_absorb import host_originals
from . import builders as T

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
BF16 = torch.bfloat16


def build(seed: int, zero_cond_t: bool = False, patched: bool = False, num_layers: int = 2) -> torch.nn.Module:
    model = T.tiny_transformer(dtype=BF16, zero_cond_t=zero_cond_t, num_layers=num_layers, seed=seed).to(DEV)
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)  # the tests install their own runner
    return model


def inputs(model, seed: int, **kw) -> dict:
    return T.transformer_inputs(model, seed=seed, device=DEV, **kw)


def run(model, kw: dict, mode: str = "no_grad") -> torch.Tensor:
    with torch.inference_mode() if mode == "inference" else torch.no_grad():
        out = model(**kw)
    return out[0] if isinstance(out, tuple) else out.sample


def install(model, **kw):
    fb = collections.Counter()
    return CG.install(model, fallbacks=fb, **kw), fb


def fresh(refs: list[torch.Tensor]) -> None:
    """The inputs differ, so the outputs must: a replay returning a stale output would be caught."""
    for a, b in zip(refs, refs[1:]):
        assert not torch.equal(a, b)


# ------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("mode", ["no_grad", "inference"])
@pytest.mark.parametrize("masked_tail", [0, 2])
@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_replay_bit_identical_to_eager(zero_cond_t, patched, masked_tail, mode, seed):
    model = build(seed, zero_cond_t=zero_cond_t, patched=patched)
    ins = [inputs(model, seed + 1 + i, masked_tail=masked_tail) for i in range(3)]
    refs = [run(model, kw, mode).clone() for kw in ins]
    fresh(refs)
    runner, fb = install(model)
    outs = [run(model, kw, mode) for kw in ins + ins]
    for o, r in zip(outs, refs + refs):
        assert torch.equal(o, r)
    d = runner.describe()
    assert (d["captures"], d["replays"], d["graphs"], d["eager_calls"]) == (1, 5, 1, 0), d
    assert not fb, fb
    assert d["host_us_per_replay"] > 0
    runner.remove()
    assert "forward" not in model.__dict__
    assert torch.equal(run(model, ins[0], mode), refs[0])


def test_return_dict_and_mode_switch(seed):
    model = build(seed, zero_cond_t=True, patched=True)
    ins = [inputs(model, seed + 1 + i) for i in range(2)]
    for kw in ins:
        kw["return_dict"] = True
    refs = [run(model, kw) for kw in ins]
    runner, fb = install(model)
    for mode in ("no_grad", "inference", "no_grad", "inference"):
        for kw, r in zip(ins, refs):
            assert torch.equal(run(model, kw, mode), r)
    d = runner.describe()
    assert d["captures"] == 2 and d["graphs"] == 2 and d["replays"] == 6  # inference mode is part of the key


@pytest.mark.parametrize("patched", [False, True])
def test_true_cfg_outputs_never_alias(patched, seed):
    """Conditional and unconditional calls per step: two signatures (text 7 masked / 5 unmasked), and a third
    call with the conditional signature (an equal-length negative prompt): every output must survive the
    calls after it."""
    model = build(seed, patched=patched)
    cond = [inputs(model, seed + 10 + i, text_len=7, masked_tail=2) for i in range(3)]
    unc = [inputs(model, seed + 20 + i, text_len=5, masked_tail=0) for i in range(3)]
    same = [inputs(model, seed + 30 + i, text_len=7, masked_tail=2) for i in range(3)]
    ref = {n: [run(model, kw) for kw in group] for n, group in (("c", cond), ("u", unc), ("s", same))}
    runner, fb = install(model)
    for i in range(3):
        a = run(model, cond[i])
        b = run(model, unc[i])
        c = run(model, same[i])
        assert torch.equal(a, ref["c"][i]) and torch.equal(b, ref["u"][i]) and torch.equal(c, ref["s"][i])
        assert len({a.data_ptr(), b.data_ptr(), c.data_ptr()}) == 3
    d = runner.describe()
    assert (d["captures"], d["graphs"], d["replays"]) == (2, 2, 7), d
    assert not fb


def test_pipeline_true_cfg_latents_identical(seed):
    pipe = T.tiny_pipeline(dtype=BF16, seed=seed).to(DEV)
    dim = pipe.transformer.config.joint_attention_dim
    pe, pm = T.tiny_prompt_embeds(seq_len=7, dim=dim, masked_tail=2, seed=seed + 1, dtype=BF16, device=DEV)
    npe, npm = T.tiny_prompt_embeds(seq_len=3, dim=dim, masked_tail=0, seed=seed + 2, dtype=BF16, device=DEV)
    kwargs = dict(prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=npe, negative_prompt_embeds_mask=npm,
                  true_cfg_scale=4.0, height=64, width=64, num_inference_steps=3, output_type="latent")

    def generate():
        return pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(seed)).images

    ref = generate()
    runner, fb = install(pipe)
    first, second = generate(), generate()
    assert torch.equal(first, ref) and torch.equal(second, ref)
    d = runner.describe()
    assert d["captures"] == 2 and d["replays"] == 2 * 3 * 2 - 2, d
    assert not fb


# ------------------------------------------------------------------------------------------ invalidation


@pytest.mark.parametrize("patched", [False, True])
def test_lora_invalidates(patched, seed):
    from peft import LoraConfig

    cfg = dict(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj"],
               init_lora_weights=False)
    model, twin = build(seed, patched=patched), build(seed, patched=patched)
    ins = [inputs(model, seed + 1 + i) for i in range(2)]
    runner, fb = install(model)
    before = [run(twin, kw) for kw in ins]
    for kw, r in zip(ins + ins, before + before):
        assert torch.equal(run(model, kw), r)
    captures = runner.describe()["captures"]

    def add(m):
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
            torch.manual_seed(seed + 99)
            m.add_adapter(LoraConfig(**cfg), adapter_name="l")

    add(model)
    add(twin)
    after = [run(twin, kw) for kw in ins]
    assert not torch.equal(after[0], before[0])  # the adapter matters, so a stale graph would be caught
    for kw, r in zip(ins + ins, after + after):
        assert torch.equal(run(model, kw), r)
    d = runner.describe()
    assert d["captures"] == captures + 1 and any("module structure changed" in k for k in d["invalidations"]), d

    steps = [lambda m: m.set_adapters(["l"], weights=[0.5]), lambda m: m.disable_lora(), lambda m: m.enable_lora()]
    for step in steps:
        step(model)
        step(twin)
        for kw in ins + ins:
            assert torch.equal(run(model, kw), run(twin, kw))
    # the LoRA scale per call is part of the key; a power of two, so that diffusers' scale-then-unscale of the
    # layers' Python floats around each eager call is exact (another value drifts by an ulp per call)
    scaled = {**ins[0], "attention_kwargs": {"scale": 0.25}}
    for _ in range(2):
        assert torch.equal(run(model, scaled), run(twin, scaled))
    d = runner.describe()
    assert d["captures"] >= captures + 5 and d["failed_signatures"] == 0, d
    assert not fb


@pytest.mark.parametrize("patched", [False, True])
def test_weight_changes_invalidate(patched, seed):
    model, twin = build(seed, zero_cond_t=True, patched=patched), build(seed, zero_cond_t=True, patched=patched)
    ins = [inputs(model, seed + 1 + i) for i in range(2)]
    runner, fb = install(model)

    def check(expect_capture: str) -> None:
        n = runner.describe()["captures"]
        for kw in ins + ins:
            assert torch.equal(run(model, kw), run(twin, kw))
        d = runner.describe()
        assert d["captures"] == n + 1, d
        assert any(k.startswith(expect_capture) for k in d["invalidations"]), d

    for kw in ins:
        assert torch.equal(run(model, kw), run(twin, kw))
    gen = torch.Generator(DEV).manual_seed(seed + 5)
    w = model.transformer_blocks[0].attn.to_q.weight
    new = torch.randn(w.shape, generator=gen, device=DEV, dtype=w.dtype) * w.float().std().to(w.dtype)
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight.copy_(new)
        twin.transformer_blocks[0].attn.to_q.weight.copy_(new)
    check("weights modified in place (transformer_blocks.0.attn.to_q.weight)")

    lin = torch.nn.Linear(model.proj_out.in_features, model.proj_out.out_features).to(DEV, BF16)
    model.proj_out, twin.proj_out = lin, copy.deepcopy(lin)
    check("module structure changed")

    for m in (model, twin):
        m.img_in.weight.data = m.img_in.weight.data * 1.5
    check("weights moved or replaced")

    # a round trip through the host: the caching allocator may hand the same addresses back (then the graph
    # reads the right weights where it always did); either way the outputs must be the twin's
    n = runner.describe()["captures"]
    for m in (model, twin):
        m.to("cpu")
        m.to(DEV)
    for kw in ins + ins:
        assert torch.equal(run(model, kw), run(twin, kw))
    assert runner.describe()["captures"] <= n + 1
    assert not fb


# ------------------------------------------------------------------------------------------ bounds


def test_graph_count_bounded(seed):
    model = build(seed, patched=True)
    shapes = [(2, 2), (2, 4), (4, 4)]
    ins = {s: inputs(model, seed + 1, height=s[0], width=s[1]) for s in shapes}
    refs = {s: run(model, kw) for s, kw in ins.items()}
    runner, fb = install(model, max_graphs=2)
    for _ in range(2):
        for s in shapes:
            assert torch.equal(run(model, ins[s]), refs[s])
            assert runner.describe()["graphs"] <= 2
    d = runner.describe()
    assert (d["graphs"], d["captures"], d["evictions"]) == (2, 6, 4), d
    for _ in range(3):
        assert torch.equal(run(model, ins[(4, 4)]), refs[(4, 4)])
    assert runner.describe()["replays"] == 3


@pytest.mark.parametrize("patched", [False, True])
def test_memory_does_not_grow(patched, seed):
    model = build(seed, zero_cond_t=True, patched=patched)
    kw = inputs(model, seed + 1, masked_tail=2)
    ref = run(model, kw)
    runner, fb = install(model)
    for _ in range(3):
        assert torch.equal(run(model, kw), ref)
    gc.collect()  # garbage of earlier tests (models in reference cycles) freed now, not during the loop
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(100):
        out = run(model, kw)
        del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert runner.describe()["replays"] == 102
    held = torch.cuda.memory_allocated()
    runner.remove()
    gc.collect()
    assert torch.cuda.memory_allocated() < held  # static buffers and graph outputs are released


def test_captures_keep_the_allocators_cache(seed):
    """A capture leaves torch's cached device blocks in place: ``torch.cuda.graph`` hands every one back to the
    driver before it captures, and the calls after it allocate them again (``shape_graphs.recording``). Both
    capturers: the transformer's runner and ``ShapeGraphs`` (the text encoder's and the VAE's)."""
    from qwen_absorb.shape_graphs import ShapeGraphs

    model = build(seed, patched=True)
    kw = inputs(model, seed + 1)
    ref = run(model, kw)
    runner, fb = install(model)
    assert torch.equal(run(model, kw), ref)  # eager: the signature's first call

    def cached_block() -> int:
        torch.cuda.synchronize()
        block = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
        del block  # freed, so cached by torch's allocator
        return torch.cuda.memory_reserved()

    before = cached_block()
    assert torch.equal(run(model, kw), ref)  # captured
    assert runner.describe()["captures"] == 1
    assert torch.cuda.memory_reserved() >= before
    x = torch.randn(64, 64, device=DEV, generator=torch.Generator(DEV).manual_seed(seed))
    sg = ShapeGraphs(lambda t: t.float().exp(), capture_after=0)
    before = cached_block()
    out = sg("k", (x,))
    assert sg.counts["captures"] == 1 and torch.equal(out, x.float().exp())
    assert torch.cuda.memory_reserved() >= before


def test_remove_frees_model_graphs_and_buffers(seed):
    """After remove() + del nothing of the runner keeps the model, its weights, the static buffers or the graphs
    alive (the runner object itself is still held, as a report would hold it)."""
    import weakref

    model = build(seed, zero_cond_t=True)
    kw = inputs(model, seed + 1, masked_tail=2)
    ref = run(model, kw)
    runner, fb = install(model)
    for _ in range(3):
        assert torch.equal(run(model, kw), ref)
    assert runner.describe()["replays"] == 2
    entry = next(iter(runner._graphs.values()))
    dead = {"model": weakref.ref(model), "weight": weakref.ref(model.proj_out.weight),
            "static input": weakref.ref(entry.statics[0]), "graph": weakref.ref(entry.graph)}
    del entry
    torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    held = torch.cuda.memory_allocated()
    runner.remove()
    del model
    gc.collect()
    torch.cuda.synchronize()
    assert [n for n, r in dead.items() if r() is not None] == []
    assert torch.cuda.memory_allocated() <= held - weights
    d = runner.describe()
    assert d["installed"] is False and d["captures"] == 1 and d["graphs"] == 0 and not fb


# ------------------------------------------------------------------------------------------ refusals, failures


def test_refusals_on_gpu(seed):
    from diffusers import FirstBlockCacheConfig

    model = build(seed, num_layers=3)
    kw = inputs(model, seed + 1)
    ref = run(model, kw)
    runner, fb = install(model)
    assert torch.equal(run(model, kw), ref) and torch.equal(run(model, kw), ref)
    with torch.enable_grad():
        out = model(**kw)[0]
    assert torch.equal(out.detach(), ref)
    assert fb == collections.Counter({"cuda_graph: grad enabled": 1})
    assert runner.describe()["graphs"] == 1  # a grad call does not cost the graphs

    model.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    with torch.no_grad(), model.cache_context("cond"):
        model(**kw)
    assert sum(n for k, n in fb.items() if k.startswith("cuda_graph: FirstBlockCache: ")) == 1  # its own reason
    assert runner.describe()["graphs"] == 0
    model.disable_cache()
    assert torch.equal(run(model, kw), ref) and torch.equal(run(model, kw), ref)
    assert runner.describe()["graphs"] == 1

    model.enable_group_offload(onload_device=torch.device(DEV), offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1)
    assert torch.equal(run(model, kw), ref)
    assert fb["cuda_graph: offloading hook"] == 1
    assert runner.describe()["graphs"] == 0  # dropped: offloading needs the memory


def test_capture_failure_falls_back_for_that_signature(seed, caplog):
    model = build(seed)
    norm_forward = model.norm_out.forward

    def syncing(*a, **k):  # .item() synchronizes: not allowed while a stream is capturing
        out = norm_forward(*a, **k)
        out.float().sum().item()
        return out

    model.norm_out.forward = syncing
    ins = [inputs(model, seed + 1 + i) for i in range(2)]
    refs = [run(model, kw) for kw in ins]
    runner, fb = install(model)
    with caplog.at_level(logging.WARNING, logger="qwen_absorb"):
        for kw, r in zip(ins + ins, refs + refs):
            assert torch.equal(run(model, kw), r)
    d = runner.describe()
    assert d["failed_signatures"] == 1 and d["captures"] == 0 and d["graphs"] == 0, d
    assert fb == collections.Counter({"cuda_graph: capture failed (this signature runs eager)": 4})
    assert len([r for r in caplog.records if "capture failed" in r.getMessage()]) == 1
    # the device is fine afterwards: another model captures and replays
    other = build(seed + 7)
    kw = inputs(other, seed + 8)
    r = run(other, kw)
    runner2, _ = install(other)
    assert torch.equal(run(other, kw), r) and torch.equal(run(other, kw), r)
    assert runner2.describe()["replays"] == 1


def test_deepcopy_with_graphs(seed):
    model = build(seed, zero_cond_t=True, patched=True)
    ins = [inputs(model, seed + 1 + i) for i in range(2)]
    refs = [run(model, kw) for kw in ins]
    runner, fb = install(model)
    for kw, r in zip(ins, refs):
        assert torch.equal(run(model, kw), r)
    twin = copy.deepcopy(model)
    r2 = twin.__dict__["forward"]
    assert r2 is not runner and r2.describe()["graphs"] == 0 and runner.describe()["graphs"] == 1
    for kw, r in zip(ins + ins, refs + refs):
        assert torch.equal(run(twin, kw), r) and torch.equal(run(model, kw), r)
    assert r2.describe()["captures"] == 1 and runner.describe()["captures"] == 1


# ------------------------------------------------------------------------------------------ FP8, compile


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True])
def test_modelopt_fp8_replay(patched, seed):
    pytest.importorskip("modelopt.torch.quantization")
    model = build(seed)
    T.fp8_quantize(model, [inputs(model, seed + 50 + i) for i in range(2)])
    options = {}
    if patched:
        qwen_absorb.patch(model, cuda_graph=False)
        # the originals of the real-FP8 linears are kept on the host (the default): the graph may read none
        options["host_tensors"] = lambda: host_originals.host_weights(model)
    ins = [inputs(model, seed + 1 + i, masked_tail=2) for i in range(3)]
    refs = [run(model, kw) for kw in ins]
    _replays_equal_eager(model, ins, refs, **options)


def _replays_equal_eager(model, ins, refs, **options):
    """Graph mode on: three inputs of one signature, each run twice, give the eager outputs (one capture, no fallback)."""
    fresh(refs)
    runner, fb = install(model, **options)
    for kw, r in zip(ins + ins, refs + refs):
        assert torch.equal(run(model, kw), r)
    d = runner.describe()
    assert (d["captures"], d["replays"], d["failed_signatures"]) == (1, 5, 0), d
    assert not fb


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True])
def test_on_top_of_compile_repeated_blocks(patched, seed):
    model = build(seed, zero_cond_t=True, patched=patched)
    model.compile_repeated_blocks()
    ins = [inputs(model, seed + 1 + i) for i in range(3)]
    refs = [run(model, kw) for kw in ins]  # compiles
    _replays_equal_eager(model, ins, refs)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs need sm_89+")
def test_offloaded_original_weights_with_host_tensors(seed):
    """patch(fp8_gemm=True, offload_original_weights=True) keeps the original weights of the real-FP8 linears in
    host memory: refused without host_tensors ("model not on CUDA"), replayed bit-identically with them."""
    pytest.importorskip("modelopt.torch.quantization")
    model = build(seed)
    T.fp8_quantize(model, [inputs(model, seed + 50 + i) for i in range(2)])
    qwen_absorb.patch(model, fp8_gemm=True, offload_original_weights=True, cuda_graph=False)
    host = [p for p in model.parameters() if p.device.type == "cpu"]
    assert host, "offload_original_weights moved nothing to the host"
    ins = [inputs(model, seed + 1 + i, masked_tail=0) for i in range(3)]  # as test_fp8_gpu: no mask
    refs = [run(model, kw) for kw in ins]
    runner, fb = install(model)
    assert torch.equal(run(model, ins[0]), refs[0])
    assert fb == collections.Counter({"cuda_graph: model not on CUDA": 1}), fb
    runner.remove()
    _replays_equal_eager(model, ins, refs, host_tensors=lambda: host)
    qwen_absorb.unpatch(model)
