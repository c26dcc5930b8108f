"""qwen_absorb.ops: fused CUDA kernels (CuPy/NVRTC) for Qwen-Image block chains, with exact torch references (the
diffusers eager expressions), run where an op's ``*_not_supported_reasons`` is not empty.

One op is one module (reference, checked-once ``launch`` for the block runners, reasons, custom op for
``torch.compile``) and one ``.cu``; its docstring says what it fuses (``lora_add`` / ``lora_fold``, ``taylor_seer``,
``rms_norm_silu`` are called directly). ``*_fp8`` variants also emit the e4m3 codes of their output; the LayerNorm
ops' and ``swiglu``'s launchers take ``nvfp4_amax`` instead to emit its NVFP4 fake quantization. Force the
references with ``force_reference=True`` or ``QWEN_ABSORB_FORCE_REFERENCE=1``."""

from types import ModuleType as _ModuleType

from ._eligibility import FORCE_REFERENCE_ENV, kernel_runtime_reasons
from .bias_gate_residual import (bias_gate_residual, bias_gate_residual_not_supported_reasons,
                                 bias_gate_residual_reference)
from .bias_residual_layer_norm_scale_shift import (
    bias_residual_layer_norm_scale_shift, bias_residual_layer_norm_scale_shift_fp8,
    bias_residual_layer_norm_scale_shift_not_supported_reasons, bias_residual_layer_norm_scale_shift_reference)
from .fp8 import Fp8PerTensorQuant, dequant_scale, quant_scale, quantize_fp8_reference
from .layer_norm_scale import (layer_norm_scale, layer_norm_scale_fp8, layer_norm_scale_not_supported_reasons,
                               layer_norm_scale_reference)
from .layer_norm_scale_shift import (layer_norm_scale_shift, layer_norm_scale_shift_fp8,
                                     layer_norm_scale_shift_not_supported_reasons, layer_norm_scale_shift_reference)
from .quantize_fp8 import quantize_fp8, quantize_fp8_split
from .quantize_nvfp4 import quantize_nvfp4, quantize_nvfp4_not_supported_reasons, quantize_nvfp4_reference
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_multi, qk_norm_rope_not_supported_reasons, qk_norm_rope_reference
from .swiglu import swiglu, swiglu_fp8, swiglu_not_supported_reasons, swiglu_reference
from .tanh_gate_residual import (tanh_gate_residual, tanh_gate_residual_not_supported_reasons,
                                 tanh_gate_residual_reference)
from .tanh_gate_residual_layer_norm_scale import (
    tanh_gate_residual_layer_norm_scale, tanh_gate_residual_layer_norm_scale_fp8,
    tanh_gate_residual_layer_norm_scale_not_supported_reasons, tanh_gate_residual_layer_norm_scale_reference)


def all_kernel_expressions() -> list[tuple[str, str]]:
    """Every (csrc file, template instance) the launchers can ask for (the compile test builds them)."""
    import importlib  # noqa: PLC0415  (the op functions above shadow their modules' names)

    mods = ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift", "bias_gate_residual", "quantize_fp8",
            "qk_norm_rope", "layer_norm_scale", "tanh_gate_residual_layer_norm_scale", "tanh_gate_residual", "swiglu",
            "taylor_seer", "lora_add", "lora_fold", "quantize_nvfp4")
    return [e for m in mods for e in importlib.import_module(f"{__name__}.{m}").all_kernel_expressions()]


# the public names: the ops, their references and reasons, and the helpers imported above
__all__ = sorted(n for n, v in globals().items() if not n.startswith("_") and not isinstance(v, _ModuleType))
