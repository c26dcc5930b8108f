"""qwen_absorb: fused CUDA kernels for diffusers' Qwen-Image transformer blocks.

``qwen_absorb.patch(pipe)`` runs every Qwen-Image (and Qwen-Image-2.1) block on the fused ops of
:mod:`qwen_absorb.ops`, ModelOpt FP8 linears (LoRA included) as real FP8 GEMMs and GPU models from CUDA graphs,
and returns a :class:`PatchReport`; ``qwen_absorb.unpatch(pipe)`` undoes it. ARCHITECTURE.md has the layering.
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
