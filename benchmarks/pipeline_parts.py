"""A whole ``QwenImagePipeline`` built locally: the Qwen2.5-VL-7B text encoder (random weights), a tokenizer with
the real vocabulary size and special tokens, the full VAE, and a pipeline call timed stage by stage.

Nothing is downloaded. The tokenizer is a byte-level BPE (Qwen2's pre-tokenizer) whose merges are trained on the
pipeline's prompt template and a few prompts, so a prompt takes about as many tokens as with the real one; its
vocabulary is padded to Qwen2's 151,643 regular tokens, and the 22 special tokens follow with their real ids
(``<|im_start|>`` 151644, ``<|im_end|>`` 151645, ...). Used by ``pipeline_e2e.py`` and ``journey.py``.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import harness as H

import torch

# Qwen2.5-VL-7B-Instruct (the text encoder of Qwen-Image): the text model and the vision tower.
TE_TEXT = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6,
               rope_theta=1000000.0, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
               sliding_window=32768, use_sliding_window=False, hidden_act="silu", tie_word_embeddings=False)
TE_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                 fullatt_block_indexes=[7, 15, 23, 31], in_chans=3, hidden_act="silu", tokens_per_second=2)
TINY_TEXT = dict(TE_TEXT, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=64, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
TINY_VISION = dict(TE_VISION, depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                   fullatt_block_indexes=[0])
REGULAR_TOKENS = 151643  # Qwen2's byte-level BPE vocabulary; the special tokens follow
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                  "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
PROMPT = ("A red fox sitting on a mossy rock in a misty pine forest at dawn, soft golden light through the trees, "
          "dew on the grass, a small wooden sign with the text 'Trail 7' on the left, shallow depth of field, "
          "photorealistic, highly detailed fur, calm mood, muted green and orange colors")
CORPUS = [PROMPT, "A cat, a dog and a bird on a blue table.", "Describe the image by detailing the color, shape, "
          "size, texture, quantity, text, spatial relationships of the objects and background:", "system user "
          "assistant image photo of the a an with in on at"]
SCHEDULER = dict(base_image_seq_len=256, base_shift=1.0986, max_image_seq_len=8192, max_shift=1.0986,
                 num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                 use_dynamic_shifting=True)  # Qwen-Image's scheduler_config.json


def _trained_bpe(template: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE vocabulary and merges learned from the template and :data:`CORPUS` (seconds)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([template] + CORPUS * 4, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def build_tokenizer(template: str) -> Any:
    """A Qwen2 fast tokenizer with the real vocabulary size (``len(tok) == 151665``), special tokens at their
    real ids, and merges that cut the pipeline's template and prompts into about as many tokens as Qwen2's."""
    import transformers  # noqa: PLC0415

    vocab, merges = _trained_bpe(template)
    vocab.update({f"<|filler_{i}|>": i for i in range(len(vocab), REGULAR_TOKENS)})  # never produced by a merge
    if int(transformers.__version__.split(".")[0]) >= 5:  # one tokenizers-backed class: vocabulary and merges
        tok = transformers.Qwen2Tokenizer(vocab=vocab, merges=merges)
    else:  # transformers 4.x: the fast class reads files
        d = Path(tempfile.mkdtemp(prefix="qwen2_tok_"))
        (d / "vocab.json").write_text(json.dumps(vocab))
        (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
        tok = transformers.Qwen2TokenizerFast(vocab_file=str(d / "vocab.json"), merges_file=str(d / "merges.txt"))
    tok.add_special_tokens({"additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in tok.get_vocab()]})
    ids = tok.convert_tokens_to_ids(SPECIAL_TOKENS)
    if ids != list(range(REGULAR_TOKENS, REGULAR_TOKENS + len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special token ids {ids[:3]}... are not Qwen2's ({REGULAR_TOKENS}...)")
    tok.pad_token = "<|endoftext|>"
    return tok


def build_text_encoder(tiny: bool, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Qwen2.5-VL (7B geometry, or a tiny one) with random weights, made directly on ``device`` in ``dtype``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: PLC0415

    text, vision = (TINY_TEXT, TINY_VISION) if tiny else (TE_TEXT, TE_VISION)
    vision = {**vision, "in_channels": vision["in_chans"]}  # the name in transformers >= 5
    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    if getattr(getattr(cfg, "text_config", None), "hidden_size", None) != text["hidden_size"]:
        cfg = Qwen2_5_VLConfig(**text, vision_config=vision, **ids)  # transformers < 4.5x: text keys at the top
    cfg.tie_word_embeddings = False
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            te = Qwen2_5_VLForConditionalGeneration(cfg)
    finally:
        torch.set_default_dtype(old)
    return te.to(dtype).eval()


def build_vae(tiny: bool, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The Qwen-Image VAE: ``AutoencoderKLQwenImage()``'s default (full) config, or the harness's tiny one."""
    from diffusers import AutoencoderKLQwenImage  # noqa: PLC0415

    if tiny:
        return H.tiny_vae(4, 4, dtype, device)
    with torch.device(device):
        vae = AutoencoderKLQwenImage()
    return vae.to(dtype).eval()


def build_pipeline(transformer: torch.nn.Module, tiny: bool, device: torch.device) -> Any:
    """``QwenImagePipeline`` with the text encoder, local tokenizer, VAE and Qwen-Image's scheduler config."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline  # noqa: PLC0415

    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=build_vae(tiny, device),
                             text_encoder=build_text_encoder(tiny, device), tokenizer=build_tokenizer(TEMPLATE),
                             transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    if getattr(pipe, "prompt_template_encode", TEMPLATE) != TEMPLATE:  # merges trained on another template
        H.log("note: this diffusers' prompt template differs from the one the tokenizer's merges learned")
    return pipe


TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
            "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
            "<|im_start|>assistant\n")  # QwenImagePipeline.prompt_template_encode (diffusers 0.42.1)


_ABSENT = object()


@contextlib.contextmanager
def stage_timer(pipe: Any, device: torch.device, marks: list | None = None) -> Iterator[dict[str, float]]:
    """Time the pipeline's stages for the calls inside: ``encode_prompt`` (both prompts under true CFG),
    ``vae.decode`` and the conversion to PIL (``image_processor.postprocess``), each synchronized at its entry
    and exit (the three syncs the pipeline's own decode makes anyway, near enough). Seconds, summed. Where
    ``marks`` is given, each stage's end and start are appended to it as ``(name, host_s, cuda_event)``."""
    acc = {"encode_s": 0.0, "decode_s": 0.0, "postprocess_s": 0.0}
    slots = [(pipe, "encode_prompt", "encode_s"), (pipe.vae, "decode", "decode_s"),
             (pipe.image_processor, "postprocess", "postprocess_s")]

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def run(*args: Any, **kw: Any) -> Any:
            H.sync(device)
            t0 = time.perf_counter()
            _mark(marks, key + ":start", t0)
            out = fn(*args, **kw)
            H.sync(device)
            acc[key] += time.perf_counter() - t0
            _mark(marks, key + ":end", time.perf_counter())
            return out
        return run

    # the instance slots found here are put back as they were: the postprocess patch lives in one of them
    kept = [(obj, name, obj.__dict__.get(name, _ABSENT)) for obj, name, _ in slots]
    for obj, name, key in slots:
        setattr(obj, name, timed(getattr(obj, name), key))
    try:
        yield acc
    finally:
        for obj, name, had in kept:
            if had is _ABSENT:
                obj.__dict__.pop(name, None)
            else:
                obj.__dict__[name] = had


def _mark(marks: list | None, name: str, host_s: float) -> None:
    if marks is not None:  # an event recorded, never waited on: the loop stays asynchronous
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((name, host_s, ev))


def call(pipe: Any, device: torch.device, **kw: Any) -> tuple[float, dict[str, Any], Any]:
    """One synchronized pipeline call: ``(wall_s, stages, output)``; stages from :func:`stage_timer`, with
    ``denoise_s`` = wall minus them (the loop: transformer calls, scheduler, CFG, latent packing). On CUDA,
    ``step_gpu_ms`` is the median GPU time from one step's end to the next's, and ``segments`` the call cut at
    its start and end, each stage's start and end and each step's end: ``[to_name, gpu_ms, host_ms]`` (a host
    time far below the GPU time: the host ran ahead; far above it: the host was the bound)."""
    marks: list[Any] = [] if device.type == "cuda" else None
    step_marks: list[Any] = []

    def step_end(p: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        _mark(step_marks, f"step{i}", time.perf_counter())
        return kwargs

    if device.type == "cuda" and "callback_on_step_end" not in kw:
        kw["callback_on_step_end"] = step_end
    with stage_timer(pipe, device, marks) as st, torch.inference_mode():
        H.sync(device)
        t0 = time.perf_counter()
        _mark(marks, "call:start", t0)
        out = pipe(**kw)
        H.sync(device)
        wall = time.perf_counter() - t0
        _mark(marks, "call:end", t0 + wall)
    st["denoise_s"] = wall - sum(st.values())
    st = {k: round(v, 4) for k, v in st.items()}
    if len(step_marks) > 2:  # the GPU time from one step's end to the next's: the step's calls, scheduler, CFG
        st["step_gpu_ms"] = round(statistics.median(
            a[2].elapsed_time(b[2]) for a, b in zip(step_marks, step_marks[1:])), 3)
    if marks:
        marks[-1][2].synchronize()  # call:end was recorded after the last sync: complete before it is read
        line = sorted(marks + step_marks, key=lambda m: m[1])
        st["segments"] = [[b[0], round(a[2].elapsed_time(b[2]), 2), round(1e3 * (b[1] - a[1]), 2)]
                          for a, b in zip(line, line[1:])]
    return wall, st, out


def _parts(pipe: Any) -> list[tuple[str, Any, Any]]:
    """qwen_absorb's pipeline parts beside the transformer: ``(name, module, what it patches)``."""
    from qwen_absorb import text_encoder, vae  # noqa: PLC0415

    return [("vae", vae, pipe.vae), ("text_encoder", text_encoder, pipe)]


def patch_pipeline(pipe: Any, **kw: Any) -> dict[str, Any]:
    """``qwen_absorb.patch(pipe, **kw)``, then the VAE's and the text encoder's patches where ``patch`` did not
    install them: ``{part: report}``."""
    import qwen_absorb  # noqa: PLC0415

    reps: dict[str, Any] = {"transformer": qwen_absorb.patch(pipe, **kw)}
    for name, mod, target in _parts(pipe):
        reps[name] = mod.report_of(target) or mod.patch(target)
    return reps


def unpatch_pipeline(pipe: Any) -> None:
    import qwen_absorb  # noqa: PLC0415

    qwen_absorb.unpatch(pipe)
    for _, mod, target in _parts(pipe):
        mod.unpatch(target)
