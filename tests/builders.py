"""Builders for tests, examples and benchmarks: random Qwen-Image transformers and pipelines.

Not part of the installed package (it used to be ``qwen_absorb.testing``): tests import it as
``from . import builders``, scripts as ``tests.builders`` with the clone's root on ``sys.path``.

Stable names (other code imports them):

- :func:`tiny_transformer`          a 2-block, 64-wide QwenImageTransformer2DModel (CPU friendly)
- :func:`full_size_transformer`     the real Qwen-Image geometry (3072 = 24 x 128), fast random init
- :func:`transformer_inputs`        keyword arguments for a transformer forward (text-to-image or edit)
- :func:`tiny_pipeline`             any Qwen-Image pipeline class with a tiny transformer and VAE,
                                    ``text_encoder=None`` / ``tokenizer=None`` (use precomputed embeds)
- :func:`tiny_prompt_embeds`        ``(prompt_embeds, prompt_embeds_mask)`` for those pipelines
- :func:`fp8_quantize`              ModelOpt FP8 (``FP8_DEFAULT_CFG``) with a calibration loop
- :func:`nvfp4_weight_only_compress` ModelOpt NVFP4 weight-only, calibrated and compressed
- :func:`modelopt_calibrate`        ``mtq.quantize`` with a loop over transformer kwargs
- :func:`run_transformer`           ``transformer(**inputs)[0]`` without grad
- :func:`tiny_qwenimage21_pipeline` a ``QwenImage21Pipeline`` with the tiny 2.1 transformer and a 16x VAE,
                                    ``text_encoder=None`` / ``processor=None`` (use precomputed embeds)
- :func:`qwenimage21_prompt_embeds` ``(prompt_embeds, prompt_embeds_mask)`` for it

Weights are random; nothing is downloaded. Every builder takes a ``seed`` and draws from its own
generator, so building a model never disturbs the caller's global RNG stream. Models are built in their
dtype without diffusers' "should be kept in float32" warning (see :func:`_in_dtype`).

ModelOpt and memory: the first ``import modelopt`` of a process pins the call stack that ran it. ModelOpt
imports PuLP (``modelopt.torch.opt.searcher``), whose ``COPT_DLL`` class keeps the exception it caught
while looking for the COPT solver as a class attribute (``COPT_DLL.err``); that exception's traceback
holds the import frames, and through their ``f_back`` links every frame above them, with their local
variables, for the life of the process. When that import ran inside ``fp8_quantize(model, ...)``, the
model stayed resident after ``unpatch()`` and ``del``. The helpers here therefore import ModelOpt through
:func:`qwen_absorb.modelopt_recipe.import_modelopt`, which runs the first import in a short-lived thread
whose stack holds nothing of the caller's (tests/test_modelopt_journey.py checks that the model is freed).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from qwen_absorb.modelopt_recipe import import_modelopt

__all__ = [
    "TINY_CONFIG",
    "fp8_quantize",
    "full_size_transformer",
    "modelopt_calibrate",
    "nvfp4_weight_only_compress",
    "nvfp4_weight_only_config",
    "run_transformer",
    "tiny_pipeline",
    "tiny_prompt_embeds",
    "tiny_transformer",
    "tiny_vae",
    "transformer_inputs",
]

# inner_dim 64 = 2 heads x 32: a multiple of 16, so NVFP4's 16-element blocks fit; the three rope
# axes add up to the head dim as diffusers requires.
TINY_CONFIG: dict[str, Any] = dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
    num_attention_heads=2, joint_attention_dim=32, guidance_embeds=False, axes_dims_rope=(8, 12, 12),
)

FULL_SIZE_CONFIG: dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)


def _mtq():
    """``modelopt.torch.quantization``, first imported in a frame that holds no model (module docstring)."""
    return import_modelopt()


def _in_dtype(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with its floating-point parameters and buffers in ``dtype``.

    diffusers 0.42.1's ``ModelMixin.to`` logs "There are modules in ... that should be kept in float32"
    on every cast to a dtype, even for classes that keep nothing in float32 (``_keep_in_fp32_modules``
    is None; its check ``fp32_modules is not None`` tests ``... or []``). A freshly built model is
    already in float32, so no cast is made for float32; for other dtypes the Qwen-Image classes keep no
    module in float32, so nn.Module's cast does exactly what diffusers' would. A class that does keep
    modules in float32 goes through diffusers' own ``to`` and its warning."""
    tensors = [*module.parameters(), *module.buffers()]
    if all(t.dtype == dtype or not t.is_floating_point() for t in tensors):
        return module
    if getattr(module, "_keep_in_fp32_modules", None):
        return module.to(dtype)
    return nn.Module.to(module, dtype)


def _transformer_cls():
    from diffusers import QwenImageTransformer2DModel  # noqa: PLC0415

    return QwenImageTransformer2DModel


def tiny_transformer(
    dtype: torch.dtype = torch.float32, zero_cond_t: bool = False, num_layers: int = 2, seed: int = 0,
    **overrides: Any,
) -> nn.Module:
    """A tiny random ``QwenImageTransformer2DModel`` on CPU in eval mode (config: :data:`TINY_CONFIG`).

    diffusers' default init gives non-zero biases everywhere, so bias deferral is exercised.
    ``overrides`` replace config entries (e.g. ``use_additional_t_cond=True`` for Layered).
    """
    cfg = {**TINY_CONFIG, "num_layers": num_layers, "zero_cond_t": zero_cond_t, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _transformer_cls()(**cfg)
    return _in_dtype(model, dtype).eval()


@torch.no_grad()
def full_size_transformer(
    num_layers: int = 60, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda",
    seed: int = 0, bias_std: float = 0.02, **overrides: Any,
) -> nn.Module:
    """The real Qwen-Image transformer geometry with random weights, built in seconds on ``device``.

    The model is created on the meta device and materialised directly in ``dtype`` on ``device``
    (60 blocks are ~20.4 B parameters: ~41 GB in bf16, ~82 GB in fp32), so no fp32 CPU copy is
    ever made. Init: weights N(0, 1/fan_in) (unit-gain, which keeps activations O(1) through 60
    gated residual blocks), biases N(0, ``bias_std``) (non-zero so bias deferral matters), RMSNorm
    weights 1. The rope module keeps its CPU frequency tables, as diffusers builds them.
    """
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope  # noqa: PLC0415

    cfg = {**FULL_SIZE_CONFIG, "num_layers": num_layers, **overrides}
    device = torch.device(device)
    with torch.device("meta"):
        model = _transformer_cls()(**cfg)
    _in_dtype(model, dtype)
    model.to_empty(device=device)
    if not cfg.get("use_layer3d_rope", False):
        # QwenEmbedRope's frequency tables are plain attributes (complex), built in __init__: on
        # meta they would be empty, so rebuild the module for real (it is tiny and has no weights).
        model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(cfg["axes_dims_rope"]), scale_rope=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            p.normal_(0.0, bias_std, generator=gen)
        elif p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
        else:  # RMSNorm weights (txt_norm, norm_q/k, norm_added_q/k)
            p.fill_(1.0)
    for b in model.buffers():  # none today; keep any future buffer defined
        b.zero_()
    return model.eval()


def transformer_inputs(
    transformer: nn.Module, batch_size: int = 1, height: int = 4, width: int = 4, text_len: int = 7,
    masked_tail: int = 2, num_cond_images: int | None = None, timestep: float = 0.5, seed: int = 0,
    device: str | torch.device | None = None, dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``transformer(**kwargs)``: random latents and text embeddings.

    ``height``/``width`` are in packed latent tokens (the image has ``height*width`` tokens).
    ``num_cond_images`` (default: 1 when the model has ``zero_cond_t``, else 0) appends condition
    images of the same size, as the Edit pipelines do. ``masked_tail`` text tokens of sample 0 are
    masked out (0 -> mask None).
    """
    cfg = transformer.config
    # the first parameter in a compute dtype (compressed ModelOpt weights are float8 / uint8)
    p = next((q for q in transformer.parameters() if q.dtype in (torch.float32, torch.bfloat16, torch.float16)), None)
    if device is None:
        device = p.device if p is not None and p.device.type != "meta" else torch.device("cpu")
    device = torch.device(device)
    dtype = dtype or (p.dtype if p is not None else torch.float32)
    if num_cond_images is None:
        num_cond_images = 1 if cfg.zero_cond_t else 0
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n_img = height * width * (1 + num_cond_images)
    in_ch = cfg.in_channels
    hidden = torch.randn(batch_size, n_img, in_ch, generator=gen)
    ehs = torch.randn(batch_size, text_len, cfg.joint_attention_dim, generator=gen)
    mask = None
    if masked_tail:
        mask = torch.ones(batch_size, text_len, dtype=torch.long)
        mask[0, text_len - masked_tail:] = 0
    shapes = [(1, height, width)] * (1 + num_cond_images)
    kwargs: dict[str, Any] = dict(
        hidden_states=hidden.to(device, dtype),
        encoder_hidden_states=ehs.to(device, dtype),
        encoder_hidden_states_mask=None if mask is None else mask.to(device),
        timestep=torch.full((batch_size,), timestep, device=device, dtype=dtype),
        img_shapes=[shapes] * batch_size,
        attention_kwargs={},
        return_dict=False,
    )
    if getattr(cfg, "use_additional_t_cond", False):
        kwargs["additional_t_cond"] = torch.zeros(batch_size, dtype=torch.long, device=device)
    return kwargs


def tiny_vae(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random ``AutoencoderKLQwenImage`` (z_dim 4, spatial factor 4)."""
    from diffusers import AutoencoderKLQwenImage  # noqa: PLC0415

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLQwenImage(
            base_dim=4 * 6, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
        )
    return _in_dtype(vae, dtype).eval()


def tiny_pipeline(
    pipeline_cls: type | None = None, dtype: torch.dtype = torch.float32, zero_cond_t: bool = False,
    seed: int = 0, transformer: nn.Module | None = None,
) -> Any:
    """A Qwen-Image pipeline of class ``pipeline_cls`` (default ``QwenImagePipeline``) with a tiny
    transformer and VAE, a FlowMatch scheduler and ``text_encoder=None, tokenizer=None`` (and
    ``processor=None`` where the class takes one). Call it with ``prompt_embeds`` from
    :func:`tiny_prompt_embeds`. ControlNet pipelines get a tiny ``QwenImageControlNetModel``;
    Layered gets ``use_additional_t_cond`` and the 3D rope, like the real checkpoint.
    """
    import inspect  # noqa: PLC0415

    import diffusers  # noqa: PLC0415

    pipeline_cls = pipeline_cls or diffusers.QwenImagePipeline
    params = inspect.signature(pipeline_cls.__init__).parameters
    overrides: dict[str, Any] = {}
    if "Layered" in pipeline_cls.__name__:
        overrides = dict(use_additional_t_cond=True, use_layer3d_rope=True)
    if transformer is None:
        transformer = tiny_transformer(dtype=dtype, zero_cond_t=zero_cond_t, seed=seed, **overrides)
    components: dict[str, Any] = dict(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(seed=seed + 1, dtype=dtype),
        text_encoder=None, tokenizer=None, transformer=transformer,
    )
    for optional in ("processor", "image_processor"):
        if optional in params:
            components[optional] = None
    if "controlnet" in params:
        cfg = {k: v for k, v in TINY_CONFIG.items() if k not in ("guidance_embeds",)}
        cfg["num_layers"] = 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 2)
            components["controlnet"] = _in_dtype(diffusers.QwenImageControlNetModel(**cfg), dtype).eval()
    components = {k: v for k, v in components.items() if k in params}
    return pipeline_cls(**components)


def tiny_prompt_embeds(
    batch_size: int = 1, seq_len: int = 7, dim: int = 32, masked_tail: int = 2, seed: int = 0,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(prompt_embeds [B, L, dim], prompt_embeds_mask [B, L] long)``; the last
    ``masked_tail`` tokens of sample 0 are masked (a mask of all ones becomes None in the pipelines)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    embeds = torch.randn(batch_size, seq_len, dim, generator=gen).to(device, dtype)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if masked_tail:
        mask[0, seq_len - masked_tail:] = 0
    return embeds, mask.to(device)


# ---------------------------------------------------------------- ModelOpt helpers


def _as_calib_list(calib_inputs: dict[str, Any] | Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [calib_inputs] if isinstance(calib_inputs, dict) else list(calib_inputs)


def modelopt_calibrate(
    transformer: nn.Module, config: dict[str, Any], calib_inputs: dict[str, Any] | Iterable[dict[str, Any]],
) -> nn.Module:
    """``mtq.quantize(transformer, config, forward_loop)`` where the loop runs the transformer on
    each kwargs dict of ``calib_inputs`` (one dict or several) under ``torch.no_grad()``."""
    mtq = _mtq()
    batches = _as_calib_list(calib_inputs)

    def forward_loop(model: nn.Module) -> None:
        with torch.no_grad():
            for kw in batches:
                model(**kw)

    mtq.quantize(transformer, copy.deepcopy(config), forward_loop=forward_loop)
    return transformer


def fp8_quantize(
    transformer: nn.Module, calib_inputs: dict[str, Any] | Iterable[dict[str, Any]], compress: bool = False,
) -> nn.Module:
    """ModelOpt FP8 e4m3 W8A8 per-tensor (``mtq.FP8_DEFAULT_CFG``), calibrated on ``calib_inputs``
    (fake quant; block LayerNorms get enabled FP8 input quantizers). ``compress=True`` then runs
    ``mtq.compress`` (real-quant float8 weights). In place; returns the transformer."""
    mtq = _mtq()
    modelopt_calibrate(transformer, mtq.FP8_DEFAULT_CFG, calib_inputs)
    if compress:
        mtq.compress(transformer)
    return transformer


def nvfp4_weight_only_config() -> dict[str, Any]:
    """``NVFP4_DEFAULT_CFG`` with every input quantizer disabled: weight-only NVFP4 (runs on CPU)."""
    mtq = _mtq()
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    qc = cfg["quant_cfg"]
    off = {"enable": False}
    if isinstance(qc, dict):
        qc["*input_quantizer"] = off
    else:  # modelopt >= 0.44: an ordered list of {"quantizer_name": ..., ...} entries; later wins
        qc.append({"quantizer_name": "*input_quantizer", "enable": False})
    return cfg


def nvfp4_weight_only_compress(
    transformer: nn.Module, calib_inputs: dict[str, Any] | Iterable[dict[str, Any]], compress: bool = True,
) -> nn.Module:
    """ModelOpt NVFP4 weight-only (16-element blocks, e4m3 scales), calibrated, then ``mtq.compress``
    (uint8 packed weights; on CPU / Hopper the forward dequantizes). In place; returns the transformer."""
    mtq = _mtq()
    modelopt_calibrate(transformer, nvfp4_weight_only_config(), calib_inputs)
    if compress:
        mtq.compress(transformer)
    return transformer


def run_transformer(transformer: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """``transformer(**inputs)[0]`` under ``torch.no_grad()``."""
    with torch.no_grad():
        return transformer(**inputs)[0]


# ---------------------------------------------------------------- Qwen-Image-2.1

# The tiny geometry of the 2.1 tests (tests/qwenimage21_helpers.py): 2 heads x 16 (flex attention needs a head dim
# >= 16), rope axes summing to the head dim, latents unpatched (patch_size 1) as 2.1 consumes them.
QWENIMAGE21_TINY_CONFIG: dict[str, Any] = dict(
    patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    context_in_dim=32, mlp_ratio=3, axes_dims_rope=(4, 6, 6),
)

__all__ += ["QWENIMAGE21_TINY_CONFIG", "qwenimage21_inputs", "random_qwenimage21_transformer"]


@torch.no_grad()
def random_qwenimage21_transformer(
    num_layers: int = 32, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cuda", seed: int = 0,
    bias_std: float = 0.02, **overrides: Any,
) -> nn.Module:
    """A ``QwenImage21Transformer2DModel`` with random weights, built in seconds on ``device``, eval mode.

    The config is diffusers' default, which is the full-size geometry (32 blocks, 4096 = 32 x 128, SwiGLU 3x,
    ~7.1 B parameters: ~14 GB in bf16), with ``num_layers`` and ``overrides`` replacing entries
    (``**QWENIMAGE21_TINY_CONFIG`` gives the tiny CPU model). As :func:`full_size_transformer`: built on the meta
    device and materialised in ``dtype`` on ``device`` (no fp32 copy); weights N(0, 1/fan_in), biases (2.1 has
    none today) N(0, ``bias_std``), RMSNorm weights 1 and the zero-centred text RMSNorm weight 0 (its scale is
    ``weight + 1``). The rope tables (plain attributes, on CPU as diffusers builds them) and the timestep
    frequencies (a non-persistent buffer, in ``dtype`` as ``model.to(dtype)`` leaves it) are rebuilt for real."""
    from diffusers import QwenImage21Transformer2DModel  # noqa: PLC0415
    from diffusers.models.transformers.transformer_qwenimage21 import (  # noqa: PLC0415
        QwenImage21Rope,
        QwenImage21TemporalTimesteps,
        QwenImage21ZeroCenterRMSNorm,
    )

    device = torch.device(device)
    with torch.device("meta"):
        model = QwenImage21Transformer2DModel(**{"num_layers": num_layers, **overrides})
    _in_dtype(model, dtype)
    model.to_empty(device=device)
    model.pos_embed = QwenImage21Rope(theta=model.pos_embed.theta, axes_dim=list(model.pos_embed.axes_dim))
    old = model.time_text_embed.time_proj
    model.time_text_embed.time_proj = QwenImage21TemporalTimesteps(old.timestep_dim, time_factor=old.time_factor).to(
        device=device, dtype=dtype)
    unknown = [n for n, _ in model.named_buffers() if n != "time_text_embed.time_proj.freqs"]
    if unknown:  # a buffer this builder does not know how to rebuild would hold uninitialised memory
        raise RuntimeError(f"random_qwenimage21_transformer: unknown buffers {unknown}; extend the builder")
    zero_centred = {id(m.weight) for m in model.modules() if isinstance(m, QwenImage21ZeroCenterRMSNorm)}
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
        elif name.endswith("bias"):
            p.normal_(0.0, bias_std, generator=gen)
        elif id(p) in zero_centred:
            p.zero_()
        else:  # RMSNorm weights (attn.norm_q / norm_k)
            p.fill_(1.0)
    return model.eval()


def qwenimage21_inputs(
    transformer: nn.Module, batch_size: int = 1, height: int = 64, width: int = 64, text_len: int = 128,
    timestep: float = 0.5, seed: int = 0, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a text-to-image ``QwenImage21Transformer2DModel`` forward as QwenImage21Pipeline passes
    them (no condition image, no KV cache, a prompt without padding: ``encoder_hidden_states_mask`` None).

    ``height`` x ``width`` target latent tokens (the VAE is 16x and the latents are unpatched: 1024^2 = 64 x 64 =
    4096 tokens, 2048^2 = 128 x 128); ``img_mask`` holds the ``text_len`` text slots, then one slot per 2 x 2
    group of target tokens, so ``height * width`` must be a multiple of 4. Random latents and embeddings N(0, 1)."""
    if (height * width) % 4:
        raise ValueError(f"qwenimage21_inputs: height * width = {height * width} is not a multiple of 4")
    cfg = transformer.config
    p = next((q for q in transformer.parameters() if q.dtype in (torch.float32, torch.bfloat16, torch.float16)), None)
    device = torch.device(device if device is not None else (p.device if p is not None else "cpu"))
    dtype = dtype or (p.dtype if p is not None else torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(batch_size, height * width, cfg.in_channels, generator=gen)
    ehs = torch.randn(batch_size, text_len, cfg.context_in_dim, generator=gen)
    img_mask = torch.tensor([False] * text_len + [True] * (height * width // 4)).expand(batch_size, -1).clone()
    return dict(
        hidden_states=hidden.to(device, dtype),
        encoder_hidden_states=ehs.to(device, dtype),
        timestep=torch.full((batch_size,), timestep, device=device, dtype=dtype),
        img_shapes=[[(1, height, width)]] * batch_size,
        img_mask=img_mask.to(device),
        encoder_hidden_states_mask=None,
        return_dict=False,
    )


__all__ += ["qwenimage21_prompt_embeds", "tiny_qwenimage21_pipeline", "tiny_qwenimage21_vae"]


def tiny_qwenimage21_vae(z_dim: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random ``AutoencoderKLQwenImage21`` (~30 k parameters for ``z_dim`` 4): 16x spatial as the real one
    (four 2x stages, 8 channels wide, one res block each, no temporal downsampling), RGBA in and out as the real
    one; latents mean 0, std 1. ``z_dim`` must be the transformer's ``in_channels`` (4 tiny, 64 full size)."""
    from diffusers import AutoencoderKLQwenImage21  # noqa: PLC0415

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False] * 4, latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
        )
    return _in_dtype(vae, dtype).eval()


class _InitOnlyProcessor:
    """What ``QwenImage21Pipeline.__init__`` reads from its ``Qwen3VLProcessor`` (diffusers 0.42.1): the token count
    of the system message (``apply_chat_template``) and the id of ``<|image_pad|>`` (``tokenizer.encode``), kept as
    ``_drop_idx`` / ``_img_token_id`` for prompt encoding only. A real processor needs tokenizer files (a download);
    with precomputed embeddings neither number is used, so this answers both for the constructor and is then
    replaced by None (:func:`tiny_qwenimage21_pipeline`)."""

    class tokenizer:  # noqa: N801 (the attribute name the pipeline reads)
        @staticmethod
        def encode(text: str) -> list[int]:
            return [1]

    @staticmethod
    def apply_chat_template(conversation: Any, tokenize: bool = True, return_dict: bool = False) -> list[list[int]]:
        return [[0]]


def tiny_qwenimage21_pipeline(
    dtype: torch.dtype = torch.float32, seed: int = 0, transformer: nn.Module | None = None, num_layers: int = 2,
) -> Any:
    """A ``diffusers.QwenImage21Pipeline`` with random weights that runs on a CPU in well under a second: the
    tiny 2.1 transformer (:data:`QWENIMAGE21_TINY_CONFIG`, ``num_layers`` blocks, or ``transformer``), a tiny 16x
    VAE (:func:`tiny_qwenimage21_vae`), a FlowMatch scheduler, ``text_encoder=None`` and ``processor=None``.

    Call it with ``prompt_embeds`` / ``prompt_embeds_mask`` from :func:`qwenimage21_prompt_embeds` (and the
    negative ones with ``true_cfg_scale > 1``); sides a multiple of 32. Embeddings supplied that way are text
    only: ``__call__`` passes no ``image_pad_mask``, so condition images need the real text encoder."""
    import diffusers  # noqa: PLC0415

    if transformer is None:
        transformer = random_qwenimage21_transformer(
            **{**QWENIMAGE21_TINY_CONFIG, "num_layers": num_layers}, dtype=dtype, device="cpu", seed=seed)
    vae = tiny_qwenimage21_vae(z_dim=transformer.config.in_channels, seed=seed + 1, dtype=dtype)
    vae = vae.to(next(transformer.parameters()).device)
    pipe = diffusers.QwenImage21Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
        processor=_InitOnlyProcessor(), transformer=transformer,
    )
    pipe.processor = None  # registered as (None, None): nothing here can encode a prompt
    return pipe


def qwenimage21_prompt_embeds(
    batch_size: int = 1, seq_len: int = 7, dim: int = 32, padded: int = 0, seed: int = 0,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(prompt_embeds [B, L, dim], prompt_embeds_mask [B, L] long)`` shaped as
    ``QwenImage21Pipeline.encode_prompt`` returns them: each sample's tokens first, then right padding with zero
    embeddings; sample 0 is the longest and every later one ends in ``padded`` padding tokens. ``dim`` is the
    transformer's ``context_in_dim``. The pipeline adds the rest itself (an all-text ``image_pad_mask``, the
    target slots of ``img_mask``) and turns a mask of all ones into None."""
    if not 0 <= padded < seq_len:
        raise ValueError(f"qwenimage21_prompt_embeds: padded={padded} must be in [0, seq_len={seq_len})")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    embeds = torch.randn(batch_size, seq_len, dim, generator=gen)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    if padded:
        mask[1:, seq_len - padded:] = 0
        embeds[1:, seq_len - padded:] = 0.0
    return embeds.to(device, dtype), mask.to(device)
