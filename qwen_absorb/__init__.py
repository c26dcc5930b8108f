"""qwen_absorb: fused CUDA kernels for diffusers' Qwen-Image transformer blocks.

``qwen_absorb.patch(pipe)`` makes every ``QwenImageTransformerBlock`` (and Qwen-Image-2.1's
``QwenImage21TransformerBlock``) run the fused ops of :mod:`qwen_absorb.ops`, ModelOpt FP8 linears (LoRA
adapters included) as real FP8 GEMMs, and CUDA graphs on GPU models, and returns a :class:`PatchReport`;
``qwen_absorb.unpatch(pipe)`` undoes it.

Layering (imports only point down; ARCHITECTURE.md has the table): face ``patch``, ``report``,
``cuda_graph``; orchestration ``block``; runners ``attention``, ``ffn``, ``handoff``, ``projection``,
``qwenimage21``, ``fp8_forward``; decisions ``plan``, ``dependencies``, ``gating``, ``watch``; adapters, one foreign library each: ``quant`` and
``modelopt_recipe`` (ModelOpt), ``lora`` (PEFT), ``parallel`` (torch.distributed), ``hooks`` (hook chains),
``sites`` (diffusers' block layout and names); kernels ``ops`` (tensors only).
"""

from . import ops
from .gating import Tuning
from .patch import patch, patch_report, unpatch
from .report import PatchReport

from importlib import metadata as _metadata  # noqa: E402

try:  # the installed distribution's version (pyproject.toml's [project] version), with or without git
    __version__ = _metadata.version("qwen_absorb")
except _metadata.PackageNotFoundError:  # a checkout put on sys.path without installing it
    __version__ = "0+unknown"

__all__ = ["PatchReport", "Tuning", "ops", "patch", "patch_report", "unpatch"]
