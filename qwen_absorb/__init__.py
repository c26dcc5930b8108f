"""qwen_absorb: fused CUDA kernels for diffusers' Qwen-Image transformer blocks.

``qwen_absorb.patch(pipe)`` makes every ``QwenImageTransformerBlock`` run the fused ops of
:mod:`qwen_absorb.ops` (deferring output-projection biases of ModelOpt FP8/NVFP4 transformers into
them where validated) and returns a :class:`PatchReport`; ``qwen_absorb.unpatch(pipe)`` undoes it.
"""

from . import ops
from .patch import patch, patch_report, unpatch
from .report import PatchReport

__version__ = "0.1.0"  # = [project] version in pyproject.toml (tests/test_examples.py checks they agree)

__all__ = ["PatchReport", "ops", "patch", "patch_report", "unpatch"]
