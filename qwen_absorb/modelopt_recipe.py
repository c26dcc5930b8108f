"""The ModelOpt FP8 (and NVFP4) recipe for Qwen-Image, from quantization to a patched model (README.md)::

    cfg = recipe.fp8_recipe_config(pipe.transformer)
    recipe.quantize(pipe.transformer, cfg, recipe.pipeline_forward_loop(pipe, prompts))   # mtq.quantize
    recipe.export_hf(pipe.transformer, "qwen-image-fp8")   # or save / restore (mto); both round trips are bit-exact
    transformer = recipe.load_hf_export("qwen-image-fp8", dtype=torch.bfloat16, device="cuda")

Quantizing, calibrating, saving and exporting are ModelOpt's; this module builds the config and the calibration loop."""

import copy
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .hf_export import (  # noqa: F401  (re-exported: the public names of the recipe; _code_mismatches for tests)
    _code_mismatches, empty_transformer, export_code_mismatches, import_modelopt, load_hf_export, quantized_linear_names
)

# ModelOpt's own Qwen-Image recipe (examples/diffusers/quantization): only ``transformer_blocks``, the first 2 and
# last 2 kept in the original precision; SGLang's validated FP8 checkpoints keep these linears in bf16 too.
DEFAULT_KEEP_FIRST = DEFAULT_KEEP_LAST = 2
SENSITIVE_LAYERS: tuple[str, ...] = ("img_mod", "txt_mod", "img_mlp.net.2")

# top-level children besides transformer_blocks (diffusers 0.42.1), for a config built from a layer count alone
_TOP_LEVEL = ("pos_embed", "time_text_embed", "txt_norm", "img_in", "txt_in", "norm_out", "proj_out",
              "addition_t_embedding")


def fp8_recipe_config(transformer_or_num_layers: nn.Module | int, keep_first: int = DEFAULT_KEEP_FIRST,
                      keep_last: int = DEFAULT_KEEP_LAST, sensitive_layers: Sequence[str] = SENSITIVE_LAYERS,
                      quantize_norm_inputs: bool = False, base_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """ModelOpt's config for the Qwen-Image FP8 recipe: ``mtq.FP8_DEFAULT_CFG`` (or ``base_config``) with
    ``{"enable": False}`` entries appended (later entries win) for everything outside ``transformer_blocks``, the
    first ``keep_first`` and last ``keep_last`` blocks, the ``sensitive_layers`` (block-relative) and, unless
    ``quantize_norm_inputs``, the block LayerNorms' input quantizers (the Hugging Face export drops them)."""
    mtq, t = import_modelopt(), transformer_or_num_layers
    n, outside = (t, _TOP_LEVEL) if isinstance(t, int) else (
        len(t.transformer_blocks), [name for name, _ in t.named_children() if name != "transformer_blocks"])
    if keep_first < 0 or keep_last < 0:
        raise ValueError(f"keep_first and keep_last must be >= 0, got {keep_first}, {keep_last}")
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if base_config is None else base_config)
    entries = cfg["quant_cfg"]
    if not isinstance(entries, list):
        raise TypeError("this recipe needs ModelOpt >= 0.44 (quant_cfg as a list of entries); "
                        f"got {type(entries).__name__}")
    # fnmatch wildcards over quantizer names (module path + ".weight_quantizer" ...): nothing outside the blocks
    off = [f"{name}.*" for name in outside]
    kept = sorted(set(range(min(keep_first, n))) | set(range(max(0, n - keep_last), n)))
    off += [f"transformer_blocks.{i}.*" for i in kept]  # the dot after the index: block 1 must not match blocks 10-19
    for layer in (name.strip(".") for name in sensitive_layers):
        if not layer:
            raise ValueError("an empty name in sensitive_layers would match whole blocks")
        off.append(f"transformer_blocks.*.{layer}.*")
    if not quantize_norm_inputs:  # img_norm1, txt_norm1, img_norm2, txt_norm2
        off += [f"transformer_blocks.*_{norm}.input_quantizer" for norm in ("norm1", "norm2")]
    entries += [{"quantizer_name": pattern, "enable": False} for pattern in off]
    return cfg


def embeds_forward_loop(pipe: Any, prompt_embeds: Iterable[dict[str, Any]], num_inference_steps: int = 2,
                        height: int | None = None, width: int | None = None,
                        seed: int = 0) -> Callable[[nn.Module], None]:
    """A ModelOpt ``forward_loop`` running the pipeline once per dict of call arguments (precomputed embeddings)."""
    return _pipeline_loop(pipe, [dict(kw) for kw in prompt_embeds], num_inference_steps, height, width, seed)


def pipeline_forward_loop(pipe: Any, prompts: Iterable[str], num_inference_steps: int = 4, height: int | None = None,
                          width: int | None = None, true_cfg_scale: float = 4.0, negative_prompt: str = " ",
                          seed: int = 0) -> Callable[[nn.Module], None]:
    """A ModelOpt ``forward_loop`` generating one image per prompt (true CFG on: both branches calibrate)."""
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


def nvfp4_recipe_config(transformer_or_num_layers: nn.Module | int, keep_first: int = DEFAULT_KEEP_FIRST,
                        keep_last: int = DEFAULT_KEEP_LAST, sensitive_layers: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`fp8_recipe_config` on ``mtq.NVFP4_DEFAULT_CFG``: NVIDIA's Qwen-Image NVFP4 layout."""
    return fp8_recipe_config(transformer_or_num_layers, keep_first, keep_last, sensitive_layers,
                             base_config=import_modelopt().NVFP4_DEFAULT_CFG)


def quantize(transformer: nn.Module, config: dict[str, Any], forward_loop: Callable[[nn.Module], None] | None):
    """``mtq.quantize(transformer, config, forward_loop)`` (in place; returns the transformer)."""
    return import_modelopt().quantize(transformer, copy.deepcopy(config), forward_loop=forward_loop)


def save(transformer: nn.Module, path: str | Path) -> None:
    """``mto.save``: ModelOpt's checkpoint (its state plus the full state dict)."""
    import_modelopt("modelopt.torch.opt").save(transformer, str(path))


def restore(transformer: nn.Module, path: str | Path) -> nn.Module:
    """``mto.restore`` into an unquantized transformer of the same config (:func:`empty_transformer`), bit for bit."""
    return import_modelopt("modelopt.torch.opt").restore(transformer, str(path))


def export_hf(transformer: nn.Module, export_dir: str | Path) -> Path:
    """ModelOpt's Hugging Face checkpoint, converted in float32 (in bf16 ``weight / scale`` rounds first, moving
    codes). **In place**: ``transformer`` then holds float8 weights."""
    export = import_modelopt("modelopt.torch.export")
    export.export_hf_checkpoint(transformer, dtype=torch.float32, export_dir=Path(export_dir))
    return Path(export_dir)
