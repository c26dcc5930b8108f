"""CPU: the prompt encoding room (qwen_absorb.text_encoder): bit-identical embeddings, the prompt cache (hit, miss,
a changed prompt, a changed encoder weight in place / via load_state_dict / via .data), unpatch; the rows planned on
the host (nothing moved or read after the encoder), the stock encoder without lm_head, the vision tower unwatched."""

from __future__ import annotations

import re

import pytest
import torch

import qwen_absorb
from . import builders
from qwen_absorb import text_encoder as te_room


class _Batch(dict):
    __getattr__ = dict.__getitem__

    def to(self, device):
        return _Batch({k: v.to(device) for k, v in self.items()})


class WordTokenizer:
    """Words to ids (deterministic, below ``vocab``), right padding like Qwen2's tokenizer; counts its calls."""

    def __init__(self, vocab: int = 500) -> None:
        self.vocab, self.calls = vocab, 0

    def __call__(self, txt, max_length, padding, truncation, return_tensors):
        self.calls += 1
        seqs = [[sum(map(ord, w)) * 31 % (self.vocab - 1) + 1 for w in re.findall(r"\w+|[^\w\s]", t)][:max_length]
                for t in txt]
        n = max(map(len, seqs))
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return _Batch(input_ids=ids, attention_mask=mask)


def tiny_text_pipeline(device="cpu", dtype=torch.float32, hidden=32, heads=2, kv_heads=1, inter=64, layers=2,
                       seed=0, vocab=None):
    """A tiny QwenImagePipeline (tests/builders.py) with a Qwen2.5-VL text encoder and a word tokenizer."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vocab = vocab or (152064 if hidden > 1000 else 512)
    head_dim = hidden // heads
    sect = [head_dim // 8, head_dim * 3 // 16, head_dim * 3 // 16]
    sect[0] += head_dim // 2 - sum(sect)
    text = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=inter, vocab_size=vocab, rope_theta=1e6,
                rope_scaling={"type": "mrope", "mrope_section": sect}, tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                  fullatt_block_indexes=[0])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab - 4,
                           video_token_id=vocab - 3, vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1,
                           bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        te = Qwen2_5_VLForConditionalGeneration(cfg)
    te = te.to(device, dtype).eval()
    pipe = builders.tiny_pipeline()
    pipe.register_modules(text_encoder=te, tokenizer=WordTokenizer(min(vocab, 151000)))
    return pipe


@pytest.fixture
def pipe(seed):
    return tiny_text_pipeline(seed=seed % 1000)


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and ((a[1] is None and b[1] is None) or torch.equal(a[1], b[1]))


@torch.no_grad()
def test_bit_identical_and_cache_hit_miss_changed_prompt(pipe):
    prompts = ["a red fox on a mossy rock", " ", ["a cat", "two dogs and a much longer prompt"]]
    refs = [pipe.encode_prompt(p, device="cpu") for p in prompts]
    rep = te_room.patch(pipe)
    assert rep.on and not rep.reasons
    calls = []
    real = pipe.text_encoder.forward
    pipe.text_encoder.forward = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        for p, r in zip(prompts, refs):
            assert _same(pipe.encode_prompt(p, device="cpu"), r)
        assert rep.cache_misses == 3 and rep.cache_hits == 0 and len(calls) == 3
        got = pipe.encode_prompt(prompts[0], device="cpu")
        assert _same(got, refs[0]) and rep.cache_hits == 1 and len(calls) == 3  # a hit: no encoder call
        got[0].fill_(float("nan"))  # a caller writing into the returned tensor does not poison the cache
        assert _same(pipe.encode_prompt(prompts[0], device="cpu"), refs[0])
        other = pipe.encode_prompt("a red fox on a mossy stone", device="cpu")  # a changed prompt: a miss
        assert rep.cache_misses == 4 and len(calls) == 4
        assert not torch.equal(other[0], refs[0][0][:, : other[0].shape[1]])
    finally:
        del pipe.text_encoder.forward


@pytest.mark.parametrize("how", ["in_place", "load_state_dict", "data"])
@torch.no_grad()
def test_changed_encoder_weight_misses(pipe, how):
    te_room.patch(pipe)
    first = pipe.encode_prompt("a red fox", device="cpu")
    w = pipe.text_encoder.model.language_model.layers[0].mlp.down_proj.weight
    new = torch.randn_like(w)
    if how == "in_place":
        w.copy_(new)
    elif how == "load_state_dict":
        name = next(n for n, p in pipe.text_encoder.named_parameters() if p is w)
        pipe.text_encoder.load_state_dict({name: new}, strict=False)
    else:
        w.data = new
    rep = te_room.report_of(pipe)
    got = pipe.encode_prompt("a red fox", device="cpu")
    assert rep.encoder_changes == 1 and rep.cache_misses == 2
    te_room.unpatch(pipe)
    ref = pipe.encode_prompt("a red fox", device="cpu")
    assert _same(got, ref) and not torch.equal(got[0], first[0])


def _lora_layers(te):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in te.modules() if isinstance(m, BaseTunerLayer)]


_ADAPTER_STEPS = {  # what diffusers' fuse_lora / unfuse_lora / set_adapters / disable_lora do to each PEFT layer
    "merge": lambda layers: [m.merge() for m in layers],
    "unmerge": lambda layers: [m.unmerge() for m in layers],
    "disable": lambda layers: [m.enable_adapters(False) for m in layers],
    "enable": lambda layers: [m.enable_adapters(True) for m in layers],
    "scale": lambda layers: [m.scale_layer(0.5) for m in layers],
}


@torch.no_grad()
def test_peft_adapter_steps_on_the_encoder_are_seen(seed):
    """A LoRA on the text encoder through every adapter step, each against the unpatched twin after the same steps:
    a merge writes ``.data`` (no version moves), the others plain layer state: the kept embeddings are not served."""
    import copy

    from peft import LoraConfig, inject_adapter_in_model

    pipe = tiny_text_pipeline(seed=seed % 1000)
    torch.manual_seed(seed)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                       init_lora_weights=False), pipe.text_encoder, adapter_name="x")
    twin = copy.deepcopy(pipe)
    rep = te_room.patch(pipe)
    prev = pipe.encode_prompt("a red fox", device="cpu")
    assert _same(prev, twin.encode_prompt("a red fox", device="cpu"))
    for name, step in _ADAPTER_STEPS.items():
        changes = rep.encoder_changes
        step(_lora_layers(pipe.text_encoder))
        step(_lora_layers(twin.text_encoder))
        got = pipe.encode_prompt("a red fox", device="cpu")
        assert _same(got, twin.encode_prompt("a red fox", device="cpu")), name
        assert rep.encoder_changes == changes + 1, name
        if name in ("disable", "enable", "scale"):
            assert (got[0] - prev[0]).abs().max() > 1e-3, name  # the step moved the embeddings
        prev = got


@torch.no_grad()
def test_plain_attributes_set_anew_are_seen(pipe):
    """An RMSNorm's eps and the RoPE scale are read by the encoder's arithmetic: set anew, the next encoding is the
    unpatched twin's."""
    import copy

    twin = copy.deepcopy(pipe)
    te_room.patch(pipe)
    first = pipe.encode_prompt("a red fox", device="cpu")
    lm = ("model", "language_model")
    for set_ in (lambda te: setattr(te.get_submodule(".".join(lm + ("norm",))), "variance_epsilon", 0.5),
                 lambda te: setattr(te.get_submodule(".".join(lm + ("rotary_emb",))), "attention_scaling", 2.0)):
        set_(pipe.text_encoder)
        set_(twin.text_encoder)
        got = pipe.encode_prompt("a red fox", device="cpu")
        assert _same(got, twin.encode_prompt("a red fox", device="cpu"))
        assert not torch.equal(got[0], first[0])
        first = got


@torch.no_grad()
def test_patch_again_catches_up_with_a_data_write(pipe):
    """A user's in-place write through ``.data`` moves no version: no watch sees it (the cache serves the kept
    embedding, as documented), and ``patch()`` again forgets what was made from the encoder."""
    import copy

    twin = copy.deepcopy(pipe)
    rep = qwen_absorb.patch(pipe)
    pipe.encode_prompt("a red fox", device="cpu")
    for p in (pipe, twin):
        p.text_encoder.model.language_model.embed_tokens.weight.data.mul_(2)
    want = twin.encode_prompt("a red fox", device="cpu")
    assert not _same(pipe.encode_prompt("a red fox", device="cpu"), want)  # the limit this test pins
    assert qwen_absorb.patch(pipe).parts["text_encoder"] is rep.parts["text_encoder"]
    assert _same(pipe.encode_prompt("a red fox", device="cpu"), want)


@torch.no_grad()
def test_patch_of_pipeline_and_unpatch_restore(pipe):
    ref = pipe.encode_prompt("a cat on a mat", device="cpu")
    sd = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    report = qwen_absorb.patch(pipe)
    assert report.parts["text_encoder"].on and "text_encoder" in report.to_dict()
    assert "prompt encoding: cache" in str(report)
    assert _same(pipe.encode_prompt("a cat on a mat", device="cpu"), ref)
    qwen_absorb.unpatch(pipe)
    assert "_get_qwen_prompt_embeds" not in pipe.__dict__
    assert all(torch.equal(v, sd[k]) for k, v in pipe.text_encoder.state_dict().items())
    assert _same(pipe.encode_prompt("a cat on a mat", device="cpu"), ref)
    off = qwen_absorb.patch(pipe, text_encoder=False)
    assert "text_encoder" not in off.parts and "_get_qwen_prompt_embeds" not in pipe.__dict__
    qwen_absorb.unpatch(pipe)


def test_refusals_and_bad_arguments():
    pipe = builders.tiny_pipeline()  # no text encoder, no tokenizer
    rep = te_room.patch(pipe)
    assert not rep.on and any("no text encoder" in r for r in rep.reasons)
    assert "_get_qwen_prompt_embeds" not in pipe.__dict__
    with pytest.raises(ValueError):
        te_room.patch(pipe, cache_size=-1)
    with pytest.raises(ValueError):
        te_room.patch(pipe, cuda_graph="yes")
    with pytest.raises(ValueError):
        qwen_absorb.patch(pipe, vae="no")


@torch.no_grad()
def test_mask_constants_replay_the_warmup_masks(pipe, monkeypatch):
    """What a capture of the encoder sees of transformers' mask builders: the warm-up's answers, in order."""
    te = pipe.text_encoder
    aid = te_room.MaskConstants(te)
    assert aid.modules, "no module of the encoder builds masks by a name MaskConstants knows"
    ids = torch.randint(1, 400, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # padding: the builder returns a tensor
    with aid.warmup():
        ref = te(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert aid.recorded and aid.recorded[0][0] == "create_causal_mask"
    calls = []
    mod = aid.modules[0]
    real = mod.create_causal_mask
    monkeypatch.setattr(mod, "create_causal_mask", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    aid.modules = [mod]
    with aid.capture():
        got = te(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(got, ref) and not calls  # answered from the warm-up, the builder not run
    assert mod.create_causal_mask is not real and calls == []  # the monkeypatched one is back in place
    with aid.capture(), pytest.raises(RuntimeError):  # one more builder call than recorded: the capture fails
        te(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        te(input_ids=ids, attention_mask=mask, output_hidden_states=True)


def test_graph_modes_capture_after(pipe):
    """"auto": a key captured at its second call; True: at its first; False: none (and said so)."""
    for mode, after, off in (("auto", 1, None), (True, 0, None), (False, 1, "cuda_graph=False")):
        rep = te_room.patch(pipe, cuda_graph=mode)
        assert rep.graphs_off == off and pipe.__dict__["_get_qwen_prompt_embeds"].graphs.capture_after == after
        te_room.unpatch(pipe)


@torch.no_grad()
def test_hooks_first_call_and_foreign_hook(seed):
    pipe = tiny_text_pipeline(seed=seed % 1000)  # never called: transformers adds its recording hooks at call 1
    rep = te_room.patch(pipe)
    a = pipe.encode_prompt(" ", device="cpu")
    b = pipe.encode_prompt(" ", device="cpu")
    assert rep.cache_misses == 1 and rep.cache_hits == 1 and rep.encoder_changes == 0 and _same(a, b)
    layer = pipe.text_encoder.model.language_model.layers[0]
    h = layer.register_forward_hook(lambda m, i, o: (o[0] * 2,) + tuple(o[1:]) if isinstance(o, tuple) else o * 2)
    c = pipe.encode_prompt(" ", device="cpu")  # a hook that changes the output: a miss, the hook's result
    assert rep.encoder_changes == 1 and rep.cache_misses == 2 and not torch.equal(c[0], a[0])
    h.remove()
    te_room.unpatch(pipe)
    assert _same(pipe.encode_prompt(" ", device="cpu"), a)


def test_only_the_replicated_encoding_is_taken_over(pipe):
    import diffusers

    edit = diffusers.QwenImageEditPipeline.__new__(diffusers.QwenImageEditPipeline)
    edit.__dict__.update(pipe.__dict__)  # a text encoder and a tokenizer, but the Edit pipeline's own method
    rep = te_room.patch(edit)
    assert not rep.on and any("replicates" in r for r in rep.reasons)
    assert "_get_qwen_prompt_embeds" not in edit.__dict__
    assert te_room.patch(pipe).on


def test_a_copied_patched_pipeline_encodes_alike_and_apart(seed):
    """``copy.deepcopy`` of a patched pipeline whose cache holds embeddings computed with grad on (non-leaf tensors,
    which deepcopy refuses): the copy carries the patch, bound to its own encoder, without the kept embeddings;
    both give diffusers' bits; an edit of the copy's encoder does not reach the original."""
    import copy  # noqa: PLC0415

    pipe = tiny_text_pipeline(seed=seed % 1000)
    want = pipe.encode_prompt("a cat on a mat", device="cpu")[0].detach()
    te_room.patch(pipe)
    pipe.encode_prompt("a cat on a mat", device="cpu")  # kept, requires grad
    twin = copy.deepcopy(pipe)
    enc = twin.__dict__["_get_qwen_prompt_embeds"]
    assert isinstance(enc, te_room.PromptEncoder) and enc.pipe is twin and not enc.cache
    assert torch.equal(twin.encode_prompt("a cat on a mat", device="cpu")[0], want)
    with torch.no_grad():
        twin.text_encoder.get_input_embeddings().weight.mul_(-1.0)
    assert not torch.equal(twin.encode_prompt("a cat on a mat", device="cpu")[0], want)
    assert torch.equal(pipe.encode_prompt("a cat on a mat", device="cpu")[0], want)


def test_encodings_with_grad_bypass_the_cache(pipe):
    """Prompt tuning or an encoder LoRA trained: with grad enabled each encoding is fresh, with its graph (a hit
    returned a clone tied to the first call's graph: a second backward raised; after a no-grad encode it returned
    embeddings without grad), and nothing is kept; under no_grad the cache works as before."""
    import copy

    twin = copy.deepcopy(pipe)
    rep = te_room.patch(pipe)
    with torch.no_grad():
        pipe.encode_prompt("a red fox", device="cpu")
    for p in (pipe, twin):
        p.text_encoder.model.language_model.norm.weight.requires_grad_(True)
    hits = rep.cache_hits
    got = [pipe.encode_prompt("a red fox", device="cpu")[0] for _ in range(2)]
    want = twin.encode_prompt("a red fox", device="cpu")[0]
    assert all(g.requires_grad and torch.equal(g, want) for g in got)
    for g in got:
        g.sum().backward()  # each its own graph
    assert rep.cache_hits == hits
    with torch.no_grad():
        pipe.encode_prompt("a red fox", device="cpu")
    assert rep.cache_hits == hits + 1


def _diffusers_rows(pipe, hidden, mask, drop_idx):
    """diffusers 0.42.1's steps after the encoder (``_get_qwen_prompt_embeds``), on given hidden states."""
    split = [e[drop_idx:] for e in pipe._extract_masked_hidden(hidden, mask)]
    width = max(e.size(0) for e in split)
    embeds = torch.stack([torch.cat([u, u.new_zeros(width - u.size(0), u.size(1))]) for u in split])
    ones = [torch.ones(e.size(0), dtype=torch.long) for e in split]
    return embeds, torch.stack([torch.cat([u, u.new_zeros(width - u.size(0))]) for u in ones])


@torch.no_grad()
def test_rows_planned_on_the_host_are_diffusers_rows(pipe, seed):
    """The host plan and its one gather against diffusers' extraction on the whole encoder's hidden states: right
    and left padding, holes, prompts shorter than the dropped template (padded rows, or none left at all)."""
    te_room.patch(pipe)
    enc = pipe.__dict__["_get_qwen_prompt_embeds"]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 400, (3, 12), generator=gen)
    right = torch.tensor([[1] * 12, [1] * 7 + [0] * 5, [1] * 3 + [0] * 9])
    masks = {"right": right, "left": right.flip(1), "holes": (torch.rand(3, 12, generator=gen) < 0.7).long(),
             "one": right[:1]}
    masks["holes"][:, 0] = 1
    for name, mask in masks.items():
        hidden = pipe.text_encoder(input_ids=ids[: len(mask)], attention_mask=mask,
                                   output_hidden_states=True).hidden_states[-1]
        for drop in (0, 2, 5, 12):
            want = _diffusers_rows(pipe, hidden, mask, drop)
            got = enc._encode(ids[: len(mask)], mask, "cpu", torch.float32, drop)
            assert got[0].shape == want[0].shape and torch.equal(got[0], want[0]), (name, drop)
            assert torch.equal(got[1], want[1]), (name, drop)


class _AfterEncoder(torch.overrides.TorchFunctionMode):
    """The torch calls made between the encoder's return and ``_encode``'s."""

    def __init__(self):
        super().__init__()
        self.on, self.calls = False, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def test_nothing_after_the_encoder_moves_or_reads_host_data(pipe):
    """On CUDA a host-to-device copy or a read of the device waits for the encoder's replay, and the host work
    behind it no longer overlaps the GPU: every copy of host data goes before the encoder is called, so after it
    only the embeddings' own ops run (no integer tensor moved, nothing read back, no tensor made from host data)."""
    te_room.patch(pipe)
    enc = pipe.__dict__["_get_qwen_prompt_embeds"]
    mode = _AfterEncoder()
    run, encode = enc._run, enc._encode

    def run_then_watch(*a):
        out = run(*a)
        mode.on = True
        return out

    def encode_then_stop(*a):
        try:
            return encode(*a)
        finally:
            mode.on = False

    enc._run, enc._encode = run_then_watch, encode_then_stop
    host_reads = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu,
                  torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__, torch.tensor, torch.arange}
    with mode:
        for p in ("a red fox", ["a cat", "two dogs and a much longer prompt"]):  # unpadded, padded
            pipe.encode_prompt(p, device="cpu")
    assert mode.calls and not [f for f, _ in mode.calls if f in host_reads]
    moved = [a[0] for f, a in mode.calls if f is torch.Tensor.to]
    assert moved and all(t.is_floating_point() for t in moved)  # the embeddings' cast, as diffusers' last step


class _CountingLinear(torch.nn.Linear):
    def forward(self, x):
        self.calls += 1
        return super().forward(x)


@torch.no_grad()
def test_the_stock_encoder_runs_without_its_lm_head(pipe):
    """The logits are never used: the stock encoder's base model is called (the GEMM of the 152k-row lm_head,
    ~1.1 GB of weight read per 7B encoding, is skipped), its hidden states bit for bit the whole encoder's."""
    te = pipe.text_encoder
    te.lm_head.__class__, te.lm_head.calls = _CountingLinear, 0
    ref = pipe.encode_prompt("a red fox on a mossy rock", device="cpu")
    assert te.lm_head.calls == 1  # diffusers runs it
    te_room.patch(pipe, cache_size=0)
    assert pipe.__dict__["_get_qwen_prompt_embeds"].body is te.model
    assert _same(pipe.encode_prompt("a red fox on a mossy rock", device="cpu"), ref)
    assert te.lm_head.calls == 1


@pytest.mark.parametrize("hooked", [False, True])
@torch.no_grad()
def test_the_stock_encoder_keeps_no_kv_cache(pipe, monkeypatch, hooked):
    """The pipeline never reads the encoder's KV cache: a stock encoder (hooked or not) runs with
    ``use_cache=False`` (no cache made, none of its per-layer concatenations), its embeddings bit for bit."""
    import transformers.cache_utils as cu  # noqa: PLC0415
    made = []
    real = cu.DynamicCache.__init__
    monkeypatch.setattr(cu.DynamicCache, "__init__", lambda self, *a, **k: (made.append(1), real(self, *a, **k))[1])
    if hooked:
        pipe.text_encoder.register_forward_pre_hook(lambda m, args: None)
    ref = pipe.encode_prompt("a red fox on a mossy rock", device="cpu")
    assert made  # diffusers' call makes one
    made.clear()
    te_room.patch(pipe, cache_size=0)
    assert _same(pipe.encode_prompt("a red fox on a mossy rock", device="cpu"), ref)
    assert not made


@pytest.mark.parametrize("how", ["hook", "subclass"])
@torch.no_grad()
def test_a_hooked_or_subclassed_encoder_runs_whole(pipe, how):
    """A forward hook on the encoder or a subclass's forward may change the hidden states: the whole encoder is
    called, as diffusers calls it."""
    te = pipe.text_encoder

    def double(out):
        out.hidden_states[-1].mul_(2)
        return out

    if how == "hook":
        te.register_forward_hook(lambda m, i, o: double(o))
    else:
        te.__class__ = type("Doubled", (type(te),), {"forward": lambda self, *a, **k: double(super(
            type(self), self).forward(*a, **k))})
    ref = pipe.encode_prompt("a red fox", device="cpu")
    te_room.patch(pipe, cache_size=0)
    assert pipe.__dict__["_get_qwen_prompt_embeds"].body is te
    assert _same(pipe.encode_prompt("a red fox", device="cpu"), ref)


@torch.no_grad()
def test_the_vision_tower_is_not_watched(pipe):
    """A text prompt never runs the vision tower: a write into it or a hook on it is not an encoder change (the
    kept embeddings are still diffusers'), and leaves the encoder unhooked (replayed, without its lm_head)."""
    import copy

    twin = copy.deepcopy(pipe)
    rep = te_room.patch(pipe)
    first = pipe.encode_prompt("a red fox", device="cpu")
    visual = pipe.text_encoder.model.visual
    next(visual.parameters()).add_(1.0)
    visual.blocks[0].register_forward_hook(lambda m, i, o: o * 2)
    got = pipe.encode_prompt("a red fox", device="cpu")
    assert rep.encoder_changes == 0 and rep.cache_hits == 1 and _same(got, first)
    assert _same(got, twin.encode_prompt("a red fox", device="cpu"))
    enc = pipe.__dict__["_get_qwen_prompt_embeds"]
    enc.renew()
    assert enc.hooked is None and enc.body is pipe.text_encoder.model
    pipe.text_encoder.model.language_model.norm.weight.add_(1.0)  # the text path still is watched
    pipe.encode_prompt("a red fox", device="cpu")
    assert rep.encoder_changes == 1
