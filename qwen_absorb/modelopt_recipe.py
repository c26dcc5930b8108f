"""The ModelOpt FP8 (and NVFP4) recipe for Qwen-Image, from quantization to a patched model, with ModelOpt's own API.

A user's way to a fast FP8 Qwen-Image with qwen_absorb::

    from qwen_absorb import modelopt_recipe as recipe

    cfg = recipe.fp8_recipe_config(pipe.transformer)                 # ModelOpt config, Qwen-Image recipe
    recipe.quantize(pipe.transformer, cfg, recipe.pipeline_forward_loop(pipe, prompts))   # mtq.quantize
    recipe.export_hf(pipe.transformer, "qwen-image-fp8")             # ModelOpt's Hugging Face export
    transformer = recipe.load_hf_export("qwen-image-fp8", dtype=torch.bfloat16, device="cuda")
    qwen_absorb.patch(transformer, fp8_gemm=True, cuda_graph=True)   # the FP8 linears as real FP8 GEMMs

or :func:`save` / :func:`restore` (``mto.save`` / ``mto.restore``) for ModelOpt's own checkpoint format.
Both round trips give back the saved bf16 model bit for bit (examples/quantize_fp8.py checks them).

Everything that quantizes, calibrates, saves, restores or exports is ModelOpt's: ``mtq.quantize``,
``mto.save`` / ``mto.restore``, ``modelopt.torch.export.export_hf_checkpoint``. This module only builds
the configuration (which layers stay in bf16), runs the calibration data through the pipeline, and
loads ModelOpt's Hugging Face export back into a diffusers transformer, which diffusers 0.42.1 cannot
do by itself (:func:`load_hf_export`, from :mod:`qwen_absorb.hf_export`: FP8 and NVFP4 exports,
NVIDIA's ``nvidia/Qwen-Image-NVFP4`` layout included).

ModelOpt is imported through :func:`import_modelopt`, never directly inside a function whose locals hold
a model: see :mod:`qwen_absorb.testing` for why (the first import of ModelOpt keeps the importing call
stack alive for the life of the process).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .hf_export import (  # re-exported: the public names of the recipe
    _amax_from_scale,
    _code_mismatches,
    empty_transformer,
    export_code_mismatches,
    import_modelopt,
    load_hf_export,
    quantized_linear_names,
)

logger = logging.getLogger("qwen_absorb")

__all__ = [
    "DEFAULT_KEEP_FIRST",
    "DEFAULT_KEEP_LAST",
    "SENSITIVE_LAYERS",
    "embeds_forward_loop",
    "empty_transformer",
    "export_code_mismatches",
    "export_hf",
    "fp8_recipe_config",
    "import_modelopt",
    "load_hf_export",
    "nvfp4_recipe_config",
    "pipeline_forward_loop",
    "quantize",
    "quantized_linear_names",
    "restore",
    "save",
]

# ModelOpt's own Qwen-Image recipe (examples/diffusers/quantization/quantize.py --model qwen-image,
# NVIDIA Model-Optimizer PR #1706) quantizes only the linears of ``transformer_blocks`` and keeps the
# first 2 and the last 2 blocks, and everything outside the blocks, in the original precision.
DEFAULT_KEEP_FIRST = 2
DEFAULT_KEEP_LAST = 2

# SGLang's validated FP8 Qwen-Image checkpoints keep, inside the blocks, the modulation linears
# (img_mod / txt_mod) and the image FFN's output linear (img_mlp.net.2) in bf16
# (sglang docs/diffusion/quantization.md, sglang PR #23155). Names are relative to a block.
SENSITIVE_LAYERS: tuple[str, ...] = ("img_mod", "txt_mod", "img_mlp.net.2")

# ------------------------------------------------------------------------------------------ config


def _num_blocks(transformer_or_num_layers: nn.Module | int) -> int:
    if isinstance(transformer_or_num_layers, int):
        return transformer_or_num_layers
    return len(transformer_or_num_layers.transformer_blocks)


# Top-level children of QwenImageTransformer2DModel besides transformer_blocks (diffusers 0.42.1), for a
# config built from a layer count alone
_TOP_LEVEL = ("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out",
              "addition_t_embedding")


def _outside_blocks(transformer_or_num_layers: nn.Module | int) -> list[str]:
    if isinstance(transformer_or_num_layers, int):
        return list(_TOP_LEVEL)
    return [name for name, _ in transformer_or_num_layers.named_children() if name != "transformer_blocks"]


def fp8_recipe_config(
    transformer_or_num_layers: nn.Module | int,
    keep_first: int = DEFAULT_KEEP_FIRST,
    keep_last: int = DEFAULT_KEEP_LAST,
    sensitive_layers: Sequence[str] = SENSITIVE_LAYERS,
    quantize_norm_inputs: bool = False,
    base_config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """ModelOpt's quantization config for the Qwen-Image FP8 recipe: ``mtq.FP8_DEFAULT_CFG`` (FP8 e4m3
    W8A8, per-tensor, max calibration) applied to the linears of ``transformer_blocks`` only, except
    the first ``keep_first`` and last ``keep_last`` blocks and, in every block, the ``sensitive_layers``
    (paths relative to a block, e.g. ``"img_mlp.net.2"``).

    Built with ModelOpt's own mechanism: ``quant_cfg`` is FP8_DEFAULT_CFG's ordered list of
    ``{"quantizer_name": <wildcard>, ...}`` entries, to which this appends ``{"enable": False}`` entries
    (later entries win): every top-level module but ``transformer_blocks``, the kept blocks, the
    sensitive layers. ModelOpt's standard exclusions stay in force: this only disables. The
    block LayerNorms' FP8 input quantizers, which ModelOpt >= 0.44 enables on every LayerNorm, are off
    unless ``quantize_norm_inputs``: ModelOpt's Hugging Face export stores scales for linears only (it
    drops every norm's quantizer), so with them on, the exported checkpoint would compute something
    other than the calibrated model; off, the model, its ``mto.save`` checkpoint and its export agree,
    and the linears' own input quantizers still quantize what the LayerNorms feed them.
    Pass the result to ``mtq.quantize`` or :func:`quantize`. ``base_config`` replaces FP8_DEFAULT_CFG
    (:func:`nvfp4_recipe_config` passes ``NVFP4_DEFAULT_CFG``).
    """
    mtq = import_modelopt()
    n = _num_blocks(transformer_or_num_layers)
    if keep_first < 0 or keep_last < 0:
        raise ValueError(f"keep_first and keep_last must be >= 0, got {keep_first}, {keep_last}")
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if base_config is None else base_config)
    entries = cfg["quant_cfg"]
    if not isinstance(entries, list):
        raise TypeError("this recipe needs ModelOpt >= 0.44 (quant_cfg as a list of entries); "
                        f"got {type(entries).__name__}")

    def off(pattern: str) -> None:
        entries.append({"quantizer_name": pattern, "enable": False})

    # Quantizer names are module paths plus ".weight_quantizer" / ".input_quantizer" / ...; the patterns
    # are fnmatch wildcards over them. Nothing outside transformer_blocks: img_in, txt_in, txt_norm,
    # time_text_embed, norm_out, proj_out, ... (the model's own top-level children when it is given).
    for name in _outside_blocks(transformer_or_num_layers):
        off(f"{name}.*")
    kept = sorted(set(range(min(keep_first, n))) | set(range(max(0, n - keep_last), n)))
    for i in kept:
        off(f"transformer_blocks.{i}.*")  # the dot after the index: block 1 must not match blocks 10-19
    for layer in sensitive_layers:
        layer = layer.strip(".")
        if not layer:
            raise ValueError("an empty name in sensitive_layers would match whole blocks")
        off(f"transformer_blocks.*.{layer}.*")
    if not quantize_norm_inputs:
        for norm in ("norm1", "norm2"):  # img_norm1, txt_norm1, img_norm2, txt_norm2
            off(f"transformer_blocks.*_{norm}.input_quantizer")
    return cfg


# ------------------------------------------------------------------------------------- calibration


def embeds_forward_loop(
    pipe: Any, prompt_embeds: Iterable[dict[str, Any]], num_inference_steps: int = 2, height: int | None = None,
    width: int | None = None, seed: int = 0,
) -> Callable[[nn.Module], None]:
    """A ModelOpt ``forward_loop`` running the pipeline once per entry of ``prompt_embeds`` (dicts of
    pipeline call arguments such as ``prompt_embeds``, ``prompt_embeds_mask``, ``negative_prompt_embeds``,
    ``true_cfg_scale``): for pipelines without a text encoder, or to calibrate on precomputed embeddings."""
    calls = [dict(kw) for kw in prompt_embeds]
    return _pipeline_loop(pipe, calls, num_inference_steps, height, width, seed)


def pipeline_forward_loop(
    pipe: Any, prompts: Iterable[str], num_inference_steps: int = 4, height: int | None = None,
    width: int | None = None, true_cfg_scale: float = 4.0, negative_prompt: str = " ", seed: int = 0,
) -> Callable[[nn.Module], None]:
    """A ModelOpt ``forward_loop`` that generates one image per prompt through ``pipe`` (a few denoising
    steps each, true CFG on so that both branches calibrate), as ModelOpt's diffusers example does."""
    calls = [dict(prompt=p, negative_prompt=negative_prompt, true_cfg_scale=true_cfg_scale) for p in prompts]
    return _pipeline_loop(pipe, calls, num_inference_steps, height, width, seed)


def _pipeline_loop(pipe, calls, steps, height, width, seed):
    if not calls:
        raise ValueError("calibration needs at least one prompt")
    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}

    def forward_loop(model: nn.Module) -> None:
        # ModelOpt passes the model being calibrated: the pipeline's transformer
        if model is not pipe.transformer:
            raise ValueError("this forward_loop calibrates the pipeline's own transformer")
        for i, kw in enumerate(calls):
            gen = torch.Generator("cpu").manual_seed(seed + i)
            with torch.no_grad():  # not inference_mode: the amaxes it creates must stay ordinary tensors
                pipe(**kw, **size, num_inference_steps=steps, generator=gen, output_type="latent")

    return forward_loop


def nvfp4_recipe_config(
    transformer_or_num_layers: nn.Module | int, keep_first: int = DEFAULT_KEEP_FIRST,
    keep_last: int = DEFAULT_KEEP_LAST, sensitive_layers: Sequence[str] = (),
) -> dict[str, Any]:
    """The recipe of :func:`fp8_recipe_config` on ``mtq.NVFP4_DEFAULT_CFG`` (W4A4 NVFP4: e2m1 values,
    dynamic e4m3 scales per 16 inputs, a calibrated per-tensor second-level scale): the layout of
    NVIDIA's Qwen-Image NVFP4 export, whose first and last 2 blocks stay in bf16. Calibration runs on
    CPU (ModelOpt's NVFP4 fake quantization itself needs CUDA: a Triton kernel on sm_89+)."""
    mtq = import_modelopt()
    return fp8_recipe_config(transformer_or_num_layers, keep_first, keep_last, sensitive_layers,
                             base_config=mtq.NVFP4_DEFAULT_CFG)


# ------------------------------------------------------------------------------------- quantize


def quantize(transformer: nn.Module, config: dict[str, Any], forward_loop: Callable[[nn.Module], None] | None):
    """``mtq.quantize(transformer, config, forward_loop)`` (in place; returns the transformer)."""
    mtq = import_modelopt()
    return mtq.quantize(transformer, copy.deepcopy(config), forward_loop=forward_loop)


# ------------------------------------------------------------------------------ save and restore


def save(transformer: nn.Module, path: str | Path) -> None:
    """``mto.save``: ModelOpt's checkpoint (its state plus the full state dict, quantizer amaxes included)."""
    mto = import_modelopt("modelopt.torch.opt")
    mto.save(transformer, str(path))


def restore(transformer: nn.Module, path: str | Path) -> nn.Module:
    """``mto.restore`` into ``transformer``, an unquantized ``QwenImageTransformer2DModel`` of the same
    config (:func:`empty_transformer` builds one without initialising 20 B weights); returns the
    restored model, bit for bit the one that was saved."""
    mto = import_modelopt("modelopt.torch.opt")
    return mto.restore(transformer, str(path))


# ------------------------------------------------------------------------ Hugging Face export


def export_hf(transformer: nn.Module, export_dir: str | Path) -> Path:
    """``modelopt.torch.export.export_hf_checkpoint(transformer, dtype=torch.float32, export_dir=...)``:
    ModelOpt's unified Hugging Face checkpoint (``config.json`` with a ``quantization_config``, safetensors
    with float8 weights and float32 ``weight_scale`` / ``input_scale`` per quantized linear).

    ``dtype=torch.float32`` is the dtype ModelOpt converts the quantized weights in (``weight / scale``,
    then float8); the other weights are saved as the model holds them. With the model's own bf16, the
    division rounds to bf16 before the float8 rounding, which moves about 2% of the FP8 codes one step away
    from those of ModelOpt's own fake quantization (measured on the tiny model); in float32 they are the
    same codes.

    ModelOpt converts the weights **in place**: afterwards ``transformer`` holds float8 weights that its
    quantizers cannot run, so compute anything you need from it first, and load the export back with
    :func:`load_hf_export`. The export keeps no LayerNorm input quantizer (only linears get scales), which
    is why :func:`fp8_recipe_config` leaves them off by default.
    """
    export = import_modelopt("modelopt.torch.export")
    export_dir = Path(export_dir)
    export.export_hf_checkpoint(transformer, dtype=torch.float32, export_dir=export_dir)
    return export_dir
