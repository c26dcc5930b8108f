"""CPU: the pipeline's module walks (qwen_absorb.pipeline_walks) answer as diffusers' own: ``_execution_device``
under group offloading, accelerate hooks, split devices and ``torch.compile``, and ``maybe_free_model_hooks``'s
resets and re-offload, each against diffusers' function on the same pipeline; the gate; unpatch; copies; a
patched pipeline call against an unpatched twin."""

from __future__ import annotations

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import qwen_absorb
from qwen_absorb import pipeline_walks as walks
from . import builders

diffusers = pytest.importorskip("diffusers")
from diffusers import DiffusionPipeline  # noqa: E402
from diffusers.hooks import HookRegistry, ModelHook  # noqa: E402
from diffusers.hooks.group_offloading import _GROUP_OFFLOADING  # noqa: E402

ORIGINAL_DEVICE = DiffusionPipeline._execution_device.fget
ORIGINAL_FREE = DiffusionPipeline.maybe_free_model_hooks
mirrored = pytest.mark.skipif(walks.source_sha256() != walks.MIRRORED_SHA256,
                              reason="this diffusers' walks differ from the mirrored ones (the gate refuses)")


class Stateful(ModelHook):
    _is_stateful = True

    def __init__(self, log: list, tag: str) -> None:
        super().__init__()
        self.log, self.tag = log, tag

    def reset_state(self, module):
        self.log.append((self.tag, id(module)))
        return module


class FakeGroupOffload(ModelHook):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.config = SimpleNamespace(onload_device=device)


def _pipe(seed: int = 0):
    return builders.tiny_pipeline(seed=seed % 1000)


def _patched(seed: int = 0):
    pipe = _pipe(seed)
    rep = qwen_absorb.patch(pipe, capabilities={"cpu"}, vae=False, text_encoder=False)
    return pipe, rep


@mirrored
def test_installs_as_a_subclass_of_the_same_name_and_unpatch_restores_the_class(seed):
    pipe = _pipe(seed)
    cls = type(pipe)
    rep = qwen_absorb.patch(pipe, capabilities={"cpu"})
    part = rep.parts["pipeline"]
    assert part.on and part.to_dict() == {"on": True, "reason": ""} and "done once" in part.line()
    assert isinstance(pipe, cls) and type(pipe) is not cls and isinstance(pipe, walks.FastWalks)
    assert type(pipe).__name__ == cls.__name__ and type(pipe).__module__ == cls.__module__
    assert "_execution_device" not in pipe.__dict__  # the class answers, not an instance slot
    qwen_absorb.patch(pipe, capabilities={"cpu"})  # patching again keeps one subclass, not a subclass of it
    assert type(pipe).__bases__ == (walks.FastWalks, cls)
    qwen_absorb.unpatch(pipe)
    assert type(pipe) is cls
    rep = qwen_absorb.patch(pipe, capabilities={"cpu"}, pipeline_walks=False)
    assert type(pipe) is cls and "pipeline" not in rep.parts
    qwen_absorb.unpatch(pipe)


@mirrored
@pytest.mark.parametrize("setup", ["plain", "group_offload_nested", "group_offload_vae", "accelerate",
                                   "accelerate_no_device", "split_devices", "compiled", "excluded"])
def test_execution_device_answers_as_diffusers(seed, setup):
    pipe, _ = _patched(seed)
    t, vae = pipe.transformer, pipe.vae
    if setup == "group_offload_nested":  # diffusers finds the first group hook in module order
        HookRegistry.check_if_exists_or_initialize(t.transformer_blocks[1].attn).register_hook(
            FakeGroupOffload(torch.device("cuda", 3)), _GROUP_OFFLOADING)
        HookRegistry.check_if_exists_or_initialize(t.transformer_blocks[0]).register_hook(
            Stateful([], "x"), "other")  # a registry without a group hook on the way
    elif setup == "group_offload_vae":
        HookRegistry.check_if_exists_or_initialize(vae.decoder).register_hook(
            FakeGroupOffload(torch.device("cuda", 5)), _GROUP_OFFLOADING)
    elif setup in ("accelerate", "accelerate_no_device"):
        for comp in (t, vae):
            comp._hf_hook = SimpleNamespace(execution_device=None)
        if setup == "accelerate":
            t.transformer_blocks[0].attn.to_q._hf_hook = SimpleNamespace(execution_device=torch.device("cuda", 1))
    elif setup == "split_devices":  # a component on meta: diffusers prefers a non-CPU, non-meta one, else the first
        pipe.vae = vae.to("meta")
    elif setup == "compiled":  # torch.compile's wrapper answers attribute reads through __getattr__
        HookRegistry.check_if_exists_or_initialize(t).register_hook(
            FakeGroupOffload(torch.device("cuda", 2)), _GROUP_OFFLOADING)
        pipe.transformer = torch.compile(t)
    elif setup == "excluded":
        pipe._exclude_from_cpu_offload = ["vae"]
        t._hf_hook = SimpleNamespace(execution_device=None)
    want = ORIGINAL_DEVICE(pipe)
    assert pipe._execution_device == want
    if setup.startswith("group_offload") or setup in ("accelerate", "compiled"):
        assert want.type == "cuda"  # the case really reached the hook
    qwen_absorb.unpatch(pipe)


@mirrored
@pytest.mark.parametrize("compiled_block", [False, True])
def test_maybe_free_model_hooks_resets_the_same_hooks_in_the_same_order(seed, compiled_block):
    pipe, _ = _patched(seed)
    log: list = []
    t = pipe.transformer
    if compiled_block:  # diffusers looks through torch.compile's wrapper: the block's hooks reset twice
        t.transformer_blocks[0] = torch.compile(t.transformer_blocks[0])
    places = [(t, "root"), (t.transformer_blocks[0], "block0"), (t.transformer_blocks[1].attn.to_q, "to_q"),
              (t.transformer_blocks[1].attn.to_q, "to_q_second"), (pipe.vae.decoder, "decoder"), (pipe.vae, "vae")]
    for m, tag in places:
        HookRegistry.check_if_exists_or_initialize(m).register_hook(Stateful(log, tag), f"s_{tag}")
    pipe.maybe_free_model_hooks()
    ours = list(log)
    log.clear()
    ORIGINAL_FREE(pipe)
    # the VAE is no CacheMixin: diffusers resets the transformer's hooks only
    tags = ["root", "block0", "block0", "to_q_second", "to_q"] if compiled_block else \
        ["root", "block0", "to_q_second", "to_q"]
    assert ours == log and [tag for tag, _ in ours] == tags
    qwen_absorb.unpatch(pipe)


@mirrored
def test_maybe_free_model_hooks_offloads_again_where_model_offload_was_enabled(seed):
    pipe, _ = _patched(seed)
    calls = []
    pipe.enable_model_cpu_offload = lambda **kw: calls.append(kw)
    pipe._offload_device = torch.device("cuda", 1)
    pipe._all_hooks = ["hook"]
    pipe.maybe_free_model_hooks()
    ORIGINAL_FREE(pipe)
    assert calls == [{"device": torch.device("cuda", 1)}] * 2
    pipe._all_hooks = []
    pipe.maybe_free_model_hooks()
    assert len(calls) == 2
    qwen_absorb.unpatch(pipe)


@mirrored
def test_no_attribute_miss_per_plain_module(seed, monkeypatch):
    """The cost: diffusers asks every module for ``_diffusers_hook`` and each miss raises inside
    ``nn.Module.__getattr__``; the mirrored walks read ``__dict__`` instead."""
    pipe, _ = _patched(seed)
    misses = []
    plain = nn.Module.__getattr__

    def counting(self, name):
        misses.append(name)
        return plain(self, name)

    monkeypatch.setattr(nn.Module, "__getattr__", counting)
    ORIGINAL_DEVICE(pipe)
    ORIGINAL_FREE(pipe)
    theirs = misses.count("_diffusers_hook")
    misses.clear()
    pipe._execution_device
    pipe.maybe_free_model_hooks()
    # what is left: the roots of the components whose class has its own __getattr__ (diffusers' ModelMixin)
    assert theirs > 50 and misses.count("_diffusers_hook") <= 2
    monkeypatch.undo()
    qwen_absorb.unpatch(pipe)


def test_gate_keeps_diffusers_walks_where_its_code_differs(seed, monkeypatch):
    monkeypatch.setattr(walks, "MIRRORED_SHA256", "0" * 64)
    pipe = _pipe(seed)
    cls = type(pipe)
    rep = qwen_absorb.patch(pipe, capabilities={"cpu"})
    part = rep.parts["pipeline"]
    assert not part.on and "differ" in part.reason and "module walks (" in part.line()
    assert type(pipe) is cls
    qwen_absorb.unpatch(pipe)


@mirrored
def test_gate_keeps_a_pipeline_class_that_defines_its_own_walks(seed):
    class Mine(diffusers.QwenImagePipeline):
        @property
        def _execution_device(self):
            return torch.device("cpu")

    pipe = builders.tiny_pipeline(Mine, seed=seed % 1000)
    rep = qwen_absorb.patch(pipe, capabilities={"cpu"})
    assert not rep.parts["pipeline"].on and "_execution_device" in rep.parts["pipeline"].reason
    assert type(pipe) is Mine
    qwen_absorb.unpatch(pipe)


def test_bad_value_is_refused_without_side_effects(seed):
    pipe = _pipe(seed)
    cls = type(pipe)
    with pytest.raises(ValueError, match="pipeline_walks"):
        qwen_absorb.patch(pipe, capabilities={"cpu"}, pipeline_walks="yes")
    assert type(pipe) is cls
    assert qwen_absorb.patch_report(pipe) is None  # nor the transformer: refused before anything is patched
    qwen_absorb.unpatch(pipe)


@mirrored
def test_copies_and_pickles_are_of_the_original_class(seed):
    pipe, _ = _patched(seed)
    cls = walks.original_class(pipe)
    assert type(copy.deepcopy(pipe)) is cls
    assert type(pickle.loads(pickle.dumps(pipe.scheduler))) is type(pipe.scheduler)
    state = pipe.__reduce_ex__(4)
    assert state[1][0] is cls
    for protocol in (2, 5):  # the pipeline itself (pickle checks copyreg.__newobj__'s class against type(obj))
        back = pickle.loads(pickle.dumps(pipe, protocol=protocol))
        assert type(back) is cls and back.transformer is not pipe.transformer
    qwen_absorb.unpatch(pipe)


def test_unpatch_marks_the_walks_section_and_survives_a_removed_transformer(seed):
    """The report kept after ``unpatch(pipe)`` says the walks are diffusers' again (it said on); ``unpatch`` of a
    pipeline whose transformer was set to None still undoes the pipeline's own patches (it raised TypeError and
    left them)."""
    pipe, report = _patched(seed)
    assert report.to_dict()["pipeline"]["on"]
    qwen_absorb.unpatch(pipe)
    assert report.to_dict()["pipeline"] == {"on": False, "reason": "unpatched"}
    pipe = _pipe(seed)
    qwen_absorb.patch(pipe, capabilities={"cpu"})  # the VAE decode too
    cls = walks.original_class(pipe)
    assert "_decode" in pipe.vae.__dict__
    pipe.transformer = None
    qwen_absorb.unpatch(pipe)
    assert type(pipe) is cls and "_decode" not in pipe.vae.__dict__


@mirrored
@torch.no_grad()
def test_a_patched_pipeline_call_matches_an_unpatched_twin(seed):
    twin = _pipe(seed)
    pipe, _ = _patched(seed)
    embeds, mask = builders.tiny_prompt_embeds(seed=seed % 1000)
    kw = dict(prompt_embeds=embeds, prompt_embeds_mask=mask, num_inference_steps=2, height=32, width=32,
              output_type="latent")
    want = twin(**kw, generator=torch.Generator().manual_seed(1)).images
    got = pipe(**kw, generator=torch.Generator().manual_seed(1)).images
    assert torch.equal(got, want) and got.abs().sum() > 0
    qwen_absorb.unpatch(pipe)


@mirrored
def test_modelopt_modules_are_read_from_their_dict_and_answer_as_diffusers(seed):
    """ModelOpt's quantized modules have their own ``__getattr__`` (hparams, dynamic attributes): the walk reads
    their ``__dict__``, and finds a group hook on one as diffusers does."""
    pytest.importorskip("modelopt")
    pipe = _pipe(seed)
    t = pipe.transformer
    builders.fp8_quantize(t, builders.transformer_inputs(t, seed=seed % 1000))
    qwen_absorb.patch(pipe, capabilities={"cpu"}, vae=False, text_encoder=False)
    q = t.transformer_blocks[1].img_mlp.net[2]
    assert type(q).__getattr__ is not nn.Module.__getattr__  # a ModelOpt module really is in the walk
    assert qwen_absorb.quant.hook_attrs_in_dict(type(q))
    assert not qwen_absorb.quant.hook_attrs_in_dict(type(t))  # ModelMixin's own __getattr__: asked
    assert pipe._execution_device == ORIGINAL_DEVICE(pipe)
    HookRegistry.check_if_exists_or_initialize(q).register_hook(FakeGroupOffload(torch.device("cuda", 4)),
                                                                 _GROUP_OFFLOADING)
    assert pipe._execution_device == ORIGINAL_DEVICE(pipe) == torch.device("cuda", 4)
    qwen_absorb.unpatch(pipe)


@mirrored
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@torch.no_grad()
def test_real_group_offloading_answers_and_generates_as_an_unpatched_twin(seed, offload_type):
    """diffusers' own group offloading (onload to the CPU here): the execution device and the images agree."""
    twin = _pipe(seed)
    pipe, _ = _patched(seed)
    for p in (twin, pipe):
        p.transformer.enable_group_offload(onload_device=torch.device("cpu"), offload_device=torch.device("cpu"),
                                           offload_type=offload_type, num_blocks_per_group=1)
    assert pipe._execution_device == ORIGINAL_DEVICE(pipe) == torch.device("cpu")
    assert walks._group_offload_hook(pipe.transformer) is not None  # answered from the hook, not the weights
    embeds, mask = builders.tiny_prompt_embeds(seed=seed % 1000)
    kw = dict(prompt_embeds=embeds, prompt_embeds_mask=mask, num_inference_steps=2, height=32, width=32,
              output_type="latent")
    want = twin(**kw, generator=torch.Generator().manual_seed(2)).images
    got = pipe(**kw, generator=torch.Generator().manual_seed(2)).images
    assert torch.equal(got, want)
    qwen_absorb.unpatch(pipe)
