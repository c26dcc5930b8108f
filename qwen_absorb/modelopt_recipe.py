"""The ModelOpt FP8 recipe for Qwen-Image, from quantization to a patched model, with ModelOpt's own API.

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
do by itself (see :func:`load_hf_export`).

ModelOpt is imported through :func:`import_modelopt`, never directly inside a function whose locals hold
a model: see :mod:`qwen_absorb.testing` for why (the first import of ModelOpt keeps the importing call
stack alive for the life of the process).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("qwen_absorb")

__all__ = [
    "DEFAULT_KEEP_FIRST",
    "DEFAULT_KEEP_LAST",
    "SENSITIVE_LAYERS",
    "embeds_forward_loop",
    "empty_transformer",
    "export_hf",
    "fp8_recipe_config",
    "import_modelopt",
    "load_hf_export",
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

def import_modelopt(name: str = "modelopt.torch.quantization"):
    """Import a ModelOpt module (default ``modelopt.torch.quantization``) and return it.

    The first import of ModelOpt runs in a short-lived thread, whose call stack holds nothing of the
    caller's: ModelOpt's import chain (``modelopt.torch.opt`` -> ``pulp``) leaves an exception stored on
    a class (PuLP's ``COPT_DLL.err``), and that exception's traceback keeps every frame of the importing
    stack alive, with its local variables, for the life of the process. Imported from a function holding
    a model, the model could never be freed. Later calls find the module in ``sys.modules``.
    """
    if name in sys.modules:
        return sys.modules[name]
    error: list[BaseException] = []

    def target() -> None:
        try:
            importlib.import_module(name)
        except BaseException as e:  # re-raised in the caller's thread, without the thread's frames
            error.append(e)

    t = threading.Thread(target=target, name="qwen_absorb-import-modelopt", daemon=True)
    t.start()
    t.join()
    if error:
        e = error.pop()
        raise type(e)(*e.args) if isinstance(e, ImportError) else e
    return sys.modules[name]


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
    Pass the result to ``mtq.quantize`` or :func:`quantize`.
    """
    mtq = import_modelopt()
    n = _num_blocks(transformer_or_num_layers)
    if keep_first < 0 or keep_last < 0:
        raise ValueError(f"keep_first and keep_last must be >= 0, got {keep_first}, {keep_last}")
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
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


def quantized_linear_names(transformer: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules whose ModelOpt weight quantizer is enabled (the FP8 linears)."""
    out = []
    for name, m in transformer.named_modules():
        q = getattr(m, "weight_quantizer", None)
        if isinstance(m, nn.Linear) and q is not None and getattr(q, "is_enabled", False):
            out.append(name)
    return out


def _code_mismatches(weight: torch.Tensor, amax: torch.Tensor) -> int:
    """Elements of ``weight`` whose e4m3 code under ModelOpt's fake quantization differs from the code its
    Hugging Face export writes. Fake quantization (``tensor_quant._fp8_eager`` and the CUDA extension's
    ``fake_e4m3fy``) multiplies: ``e4m3(clamp(w * (448 / amax)))``; the export divides:
    ``e4m3(w / (amax / 448))`` (``export.quant_utils``, both in float32). The two products differ by a
    float32 ulp now and then, which moves a code where the value sits on a rounding boundary (0.11% of
    the codes of the 60-layer random Qwen-Image recipe model; none in the tiny test model)."""
    a = amax.detach().to(torch.float32).reshape(())
    x = weight.detach().to(torch.float32)
    fake = (x * (448.0 / a)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    exported = (x / (a / 448.0)).to(torch.float8_e4m3fn)
    return int((fake.view(torch.uint8) != exported.view(torch.uint8)).sum())


def export_code_mismatches(transformer: nn.Module) -> tuple[int, int]:
    """``(differing, total)`` FP8 weight codes of ``transformer``'s quantized linears between ModelOpt's
    fake quantization and its Hugging Face export (:func:`_code_mismatches`). Where ``differing > 0``, a
    model loaded from the export (:func:`load_hf_export`) computes with the checkpoint's codes, which are
    not all the codes the exported model computed with: its output cannot be bit-identical to that
    model's. Call it before :func:`export_hf` (which converts the weights in place)."""
    differing = total = 0
    modules = dict(transformer.named_modules())
    with torch.no_grad():
        for name in quantized_linear_names(transformer):
            lin = modules[name]
            amax = getattr(lin.weight_quantizer, "amax", None)
            if amax is None or amax.numel() != 1:
                continue
            differing += _code_mismatches(lin.weight, amax)
            total += lin.weight.numel()
    return differing, total


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


def _read_safetensors(folder: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        files = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(folder / f), device=str(device)))
    return state


def _amax_from_scale(scale: torch.Tensor, dtype: torch.dtype = torch.float32, maxbound: float = 448.0) -> torch.Tensor:
    """An amax for which ``amax / 448`` is exactly the stored float32 ``scale``, in ``dtype`` if one is.

    ModelOpt's export stores ``amax / 448`` rounded to float32, not the amax. ``scale * 448`` misses that
    condition by a float32 ulp for about 9% of values; a neighbour meets it, and near the top of a binade
    more than one does. ModelOpt calibrates a bf16 model's amaxes as bf16 tensors (the max of bf16
    values), so a candidate that ``dtype`` represents exactly is the calibrated amax, returned in
    ``dtype``; otherwise the first float32 candidate. Whichever it is, the FP8 GEMM's dequantization scale
    (``amax / 448``) is the checkpoint's."""
    s = scale.detach().to(torch.float32).reshape(())
    guess = s * maxbound
    candidates = [guess]
    up, down = guess, guess
    for _ in range(3):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.zeros_like(down))
        candidates += [up, down]
    for divide in (lambda c: c / maxbound, lambda c: (c.double() / maxbound).float()):  # the two ways
        exact = [c for c in candidates if torch.equal(divide(c), s)]                     # ModelOpt divides
        if exact:
            narrow = [c for c in exact if torch.equal(c.to(dtype).to(torch.float32), c)]
            return narrow[0].to(dtype) if narrow else exact[0]
    return guess


def load_hf_export(
    export_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
    compress: bool = False,
) -> nn.Module:
    """Load ModelOpt's Hugging Face export of a Qwen-Image transformer (:func:`export_hf`) into a diffusers
    ``QwenImageTransformer2DModel`` with ModelOpt FP8 quantizers, ready for ``qwen_absorb.patch``.

    Why a loader: diffusers 0.42.1's ``from_pretrained`` reads the export's ``quantization_config``
    (``quant_method: modelopt``) with its ``NVIDIAModelOptConfig``, which raises ``TypeError`` with
    nvidia-modelopt >= 0.44 (ModelOpt issue #2001; the diffusers fix, PR #14536, is not released), and
    even where it loads, it has no place for the export's float8 weights and ``weight_scale`` /
    ``input_scale`` tensors. So, with ModelOpt's own API:

    1. build the transformer from the export's ``config.json`` (without its ``quantization_config``);
    2. ``mtq.quantize`` it with ``FP8_DEFAULT_CFG``, enabled exactly on the linears that have a
       ``weight_scale`` in the checkpoint, without calibration;
    3. load the state: unquantized tensors as they are; each quantized linear's weight as its float8
       codes times ``weight_scale``, and its quantizers' amax such that ``amax / 448`` is the stored
       ``weight_scale`` / ``input_scale`` (:func:`_amax_from_scale`);
    4. check that every FP8 linear quantizes back to the checkpoint's float8 bytes;
    5. with ``compress``, ``mtq.compress``: the FP8 linears then store the float8 codes themselves (half
       the memory) and ModelOpt runs them with its own FP8 GEMM (compiled by ``torch.compile`` at the
       first call on CUDA); its dequantizing forward is not bit-identical to its fake quantization.

    The loaded model computes with the checkpoint's FP8 codes and scales. For a bf16/fp16 model that is
    the exported model bit for bit (tests/test_modelopt_journey.py): its amaxes are bf16/fp16 values,
    which :func:`_amax_from_scale` recovers exactly from ``amax / 448``. A float32 model's amax can share
    its scale with a float32 neighbour and come back one ulp off. The LayerNorm input quantizers stay off
    (the export has none). ``dtype`` defaults to the dtype of the export's unquantized weights.
    """
    from diffusers import QwenImageTransformer2DModel  # noqa: PLC0415

    mtq = import_modelopt()
    folder = Path(export_dir)
    config = dict(QwenImageTransformer2DModel.load_config(str(folder)))
    device = torch.device(device)
    state = _read_safetensors(folder, device)
    quantized = sorted(k[: -len(".weight_scale")] for k in state if k.endswith(".weight_scale"))
    if dtype is None:
        dtype = next((t.dtype for k, t in state.items() if t.is_floating_point() and t.dtype.itemsize > 1
                      and k.endswith(".weight")), torch.float32)
    model = empty_transformer(config, dtype, device)

    # the weights first (ModelOpt's quantize calibrates weight quantizers on them even without a loop);
    # the FP8 linears' weights one at a time, so that only one dequantized copy exists at once
    codes = {name: state.pop(f"{name}.weight") for name in quantized}
    scales = {name: (state.pop(f"{name}.weight_scale").to(torch.float32), state.pop(f"{name}.input_scale", None))
              for name in quantized}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, c in codes.items():
            params[f"{name}.weight"].copy_(c.to(torch.float32) * scales[name][0])
        missing, unexpected = model.load_state_dict(state, strict=False)
    del state
    missing = sorted(set(missing) - {f"{name}.weight" for name in quantized})
    if missing or unexpected:
        raise ValueError(f"{folder}: the export does not match the transformer built from its config "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "*", "enable": False})
    for name in quantized:
        for q in ("weight_quantizer", "input_quantizer"):
            cfg["quant_cfg"].append({"quantizer_name": f"{name}.{q}", "enable": True})
    mtq.quantize(model, cfg, forward_loop=None)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (w_scale, in_scale) in scales.items():
            lin = modules[name]
            lin.weight_quantizer.amax = _amax_from_scale(w_scale, dtype)
            if in_scale is not None:
                lin.input_quantizer.amax = _amax_from_scale(in_scale, dtype)
            else:  # a weight-only export
                lin.input_quantizer.disable()
    with torch.no_grad():  # the weights must quantize back to the checkpoint's bytes
        wrong = [name for name in quantized if not _same_bytes(
            (params[f"{name}.weight"].to(torch.float32) / scales[name][0]).to(codes[name].dtype), codes[name])]
    if compress and not wrong:
        mtq.compress(model)
        wrong = [name for name in quantized if not _same_bytes(modules[name]._parameters["weight"], codes[name])]
    if wrong:
        raise ValueError(f"{folder}: {len(wrong)} FP8 linears do not reproduce the checkpoint's float8 codes "
                         f"(first: {wrong[0]})")
    del codes
    logger.info("loaded ModelOpt export %s: %d FP8 linears", folder, len(quantized))
    return model.eval()


def _same_bytes(weight: torch.Tensor, codes: torch.Tensor) -> bool:
    data = getattr(weight, "data", weight)
    return data.dtype == codes.dtype and data.shape == codes.shape and torch.equal(
        data.view(torch.uint8), codes.view(torch.uint8))


def empty_transformer(config: dict[str, Any], dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """A ``QwenImageTransformer2DModel`` of ``config`` (e.g. ``model.config``) in ``dtype`` on ``device``
    with uninitialised weights, built in no time: the model to :func:`restore` or load a checkpoint into.
    The rope module is rebuilt for real (its frequency tables are plain attributes made in ``__init__``)."""
    from diffusers import QwenImageTransformer2DModel  # noqa: PLC0415
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope  # noqa: PLC0415

    config = {k: v for k, v in dict(config).items() if not k.startswith("_") and k != "quantization_config"}
    device = torch.device(device)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(config)
    # nn.Module's cast (meta: nothing is computed); diffusers' ModelMixin.to would log that modules
    # "should be kept in float32", which this class has none of
    nn.Module.to(model, dtype=dtype)
    model.to_empty(device=device)
    if not config.get("use_layer3d_rope", False):
        model.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True)
    else:
        from diffusers.models.transformers.transformer_qwenimage import QwenEmbedLayer3DRope  # noqa: PLC0415

        model.pos_embed = QwenEmbedLayer3DRope(theta=10000, axes_dim=list(config["axes_dims_rope"]),
                                               scale_rope=True)
    return model.eval()

