"""ModelOpt's Hugging Face exports of a Qwen-Image transformer (FP8, NVFP4, or a mix), loaded back into diffusers.

Per linear: **FP8** ``weight`` float8_e4m3fn, fp32 per-tensor ``weight_scale`` = amax / 448, optional
``input_scale``; **NVFP4** ``weight`` uint8 [out, in / 2] (two e2m1 codes a byte, even column in the low nibble),
``weight_scale`` float8_e4m3fn [out, in / 16], ``weight_scale_2`` = amax / (6 * 448), ``input_scale`` likewise.
Why a loader: diffusers 0.42.1's ``NVIDIAModelOptConfig`` raises with ModelOpt >= 0.44 and has no place for scales."""

import copy
import importlib
import json
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("qwen_absorb")

FP8_MAX = 448.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# e2m1 code -> value (bit 3 the sign; ModelOpt's table decodes code 8, "-0", as +0)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def import_modelopt(name: str = "modelopt.torch.quantization"):
    """Import a ModelOpt module, the first time in a short-lived thread: ModelOpt's import chain stores an exception on
    a class (PuLP's ``COPT_DLL.err``) whose traceback keeps the importing stack's locals (a model) alive forever."""
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


def quantized_linear_names(transformer: nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules whose ModelOpt weight quantizer is enabled."""
    return [name for name, m in transformer.named_modules()
            if isinstance(m, nn.Linear) and getattr(getattr(m, "weight_quantizer", None), "is_enabled", False)]


def _code_mismatches(weight: torch.Tensor, amax: torch.Tensor) -> int:
    """Elements of ``weight`` whose e4m3 code under ModelOpt's fake quantization, ``e4m3(clamp(w * (448 / amax)))``
    (an amax <= 2^-24 taken as 1), differs from its export's, ``e4m3(w / (amax / 448))`` (raw amax)."""
    a = amax.detach().to(torch.float32).reshape(())
    x = weight.detach().to(torch.float32)
    safe = torch.where(a <= 1.0 / (1 << 24), torch.ones_like(a), a)
    fake = (x * (448.0 / safe)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    exported = (x / (a / 448.0)).to(torch.float8_e4m3fn)
    return int((fake.view(torch.uint8) != exported.view(torch.uint8)).sum())


def export_code_mismatches(transformer: nn.Module) -> tuple[int, int]:
    """``(differing, total)`` FP8 weight codes between fake quantization and the export; call before exporting."""
    differing = total = 0
    with torch.no_grad():
        for lin in map(dict(transformer.named_modules()).__getitem__, quantized_linear_names(transformer)):
            q = lin.weight_quantizer
            amax = getattr(q, "amax", None)
            if amax is not None and amax.numel() == 1 and q.block_sizes is None and q.num_bits == (4, 3):
                differing, total = differing + _code_mismatches(lin.weight, amax), total + lin.weight.numel()
    return differing, total


def _read_safetensors(folder: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file  # noqa: PLC0415

    index = sorted(folder.glob("*.safetensors.index.json"))
    files = (sorted(set(json.loads(index[0].read_text())["weight_map"].values())) if index
             else sorted(p.name for p in folder.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return {k: t for f in files for k, t in load_file(str(folder / f), device=str(device)).items()}


def read_quant_algo(folder: Path) -> str | None:
    """The export's ``quant_algo`` from ``config.json`` or ``hf_quant_config.json``; None if neither says."""
    algo = (json.loads((folder / "config.json").read_text()).get("quantization_config") or {}).get("quant_algo")
    if algo is None and (side := folder / "hf_quant_config.json").is_file():
        algo = (json.loads(side.read_text()).get("quantization") or {}).get("quant_algo")
    return algo


def _amax_from_scale(scale: torch.Tensor, dtype: torch.dtype, maxbound: float, cuda_first: bool) -> torch.Tensor:
    """An amax for which ``amax / maxbound`` is exactly the stored float32 ``scale`` (``scale * maxbound`` misses by
    an ulp now and then, a neighbour meets it); in ``dtype`` where it represents one exactly. ``cuda_first``
    (NVFP4): first the division as ModelOpt's NVFP4 fake quantization does it on CUDA (times the reciprocal)."""
    s = scale.detach().to(torch.float32).reshape(())
    guess = up = down = s * maxbound
    candidates = [guess]
    for _ in range(3):  # the guess, then its neighbours outwards
        up, down = torch.nextafter(up, torch.full_like(up, float("inf"))), torch.nextafter(down, torch.zeros_like(down))
        candidates += [up, down]
    inv = float(torch.tensor(1.0 / maxbound, dtype=torch.float32))
    ways = [lambda c: c * inv] * cuda_first + [lambda c: c / maxbound, lambda c: (c.double() / maxbound).float()]
    for divide in ways:
        exact = [c for c in candidates if torch.equal(divide(c), s)]
        if exact:
            narrow = [c for c in exact if torch.equal(c.to(dtype).to(torch.float32), c)]
            return narrow[0].to(dtype) if narrow else exact[0]
    return guess


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 codes [..., n / 2] -> one a byte [..., n]; "-0" (8) as +0 (both dequantize to zero)."""
    p = packed.view(torch.uint8)
    codes = torch.stack(((p & 0x0F), (p >> 4)), dim=-1).flatten(-2)
    return torch.where(codes == 8, torch.zeros_like(codes), codes)


class _Entry:
    """One quantized linear of the export: its format, stored tensors, and the model's weight shape."""

    __slots__ = ("name", "fmt", "weight", "scale", "scale_2", "input_scale")

    def __init__(self, name: str, state: dict[str, torch.Tensor]) -> None:
        self.name, self.scale = name, state.pop(f"{name}.weight_scale")
        self.weight, self.scale_2, self.input_scale = (state.pop(f"{name}.{k}", None)
                                                       for k in ("weight", "weight_scale_2", "input_scale"))
        self.fmt = "nvfp4" if self.scale_2 is not None else "fp8"

    def problems(self, shape: torch.Size | None) -> list[str]:
        """Why this entry cannot be the weight of a linear of ``shape`` (empty: it can)."""
        n, w = self.name, self.weight
        if shape is None:
            return [f"{n}: the export quantizes it, the model built from config.json has no such linear"]
        if w is None:
            return [f"{n}: weight_scale without a weight"]
        if self.input_scale is not None and self.input_scale.numel() != 1:
            return [f"{n}: input_scale has {self.input_scale.numel()} values (per-tensor expected)"]
        if self.fmt == "fp8":
            if w.dtype != torch.float8_e4m3fn:
                return [f"{n}: FP8 weight of dtype {w.dtype} (float8_e4m3fn expected)"]
            if self.scale.numel() != 1:
                return [f"{n}: a per-channel FP8 weight_scale of {self.scale.numel()} values is not supported "
                        "(per-tensor FP8 only)"]
            return [] if w.shape == shape else [f"{n}: weight {tuple(w.shape)}, the model's linear is {tuple(shape)}"]
        out_f, in_f = shape
        if w.dtype != torch.uint8 or self.scale.dtype != torch.float8_e4m3fn or self.scale_2.numel() != 1:
            return [f"{n}: NVFP4 tensors of dtypes {w.dtype} / {self.scale.dtype} / "
                    f"{self.scale_2.numel()} scale_2 values (uint8 / float8_e4m3fn / 1 expected)"]
        if in_f % NVFP4_BLOCK:
            return [f"{n}: in_features {in_f} is not a multiple of {NVFP4_BLOCK}"]
        want_w, want_s = (out_f, in_f // 2), (out_f, in_f // NVFP4_BLOCK)
        if tuple(w.shape) == want_w and tuple(self.scale.shape) == want_s:
            return []
        return [f"{n}: NVFP4 weight {tuple(w.shape)} / weight_scale {tuple(self.scale.shape)}, the model's linear "
                f"{tuple(shape)} needs {want_w} / {want_s} (a padded or swizzled single-file layout is not supported)"]

    def bad_scale(self) -> str | None:
        """Why a stored scale cannot be ModelOpt's (not finite and positive; block scales: non-negative), else None."""
        per_tensor = [("input_scale", self.input_scale), ("weight_scale_2", self.scale_2)]
        per_tensor += [("weight_scale", self.scale)] if self.fmt == "fp8" else []
        for what, t in per_tensor:
            if t is not None and not bool(((v := t.float()) > 0).all() and torch.isfinite(v).all()):
                return f"{self.name}: {what} {v.flatten()[:4].tolist()} is not a finite positive number"
        if self.fmt == "nvfp4" and not bool(((v := self.scale.float()) >= 0).all() and torch.isfinite(v).all()):
            return f"{self.name}: weight_scale holds a block scale that is NaN or negative"
        return None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the checkpoint stores: codes times their scales (ModelOpt's order)."""
        if self.fmt == "fp8":
            return self.weight.to(torch.float32) * self.scale.to(torch.float32)
        vals = torch.tensor(_E2M1, dtype=torch.float32, device=self.weight.device)[_codes(self.weight).long()]
        block = self.scale.to(torch.float32) * self.scale_2.to(torch.float32).reshape(())
        return (vals.unflatten(-1, (-1, NVFP4_BLOCK)) * block.unsqueeze(-1)).flatten(-2)

    def reproduces_codes(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` (the loaded parameter) quantizes back to the checkpoint's bytes."""
        w = weight.detach().to(torch.float32)
        if self.fmt == "fp8":
            return _same_bytes((w / self.scale.to(torch.float32)).to(self.weight.dtype), self.weight)
        nvfp4 = import_modelopt("modelopt.torch.quantization.qtensor.nvfp4_tensor").NVFP4QTensor
        s2 = self.scale_2.to(torch.float32).reshape(())
        # codes under the checkpoint's block scales, then the block scales recomputed from the weight
        # (blocks with a nonzero code only: an all-zero block's stored scale is not recoverable)
        qt, _, _ = nvfp4.quantize(w.clone(), NVFP4_BLOCK, weights_scaling_factor=self.scale,
                                  weights_scaling_factor_2=s2)
        if not torch.equal(_codes(qt._quantized_data), _codes(self.weight)):
            return False
        scale, _ = nvfp4.get_weights_scaling_factor(w, NVFP4_BLOCK, s2)
        live = (_codes(self.weight) != 0).view(w.shape[0], -1, NVFP4_BLOCK).any(-1)
        return torch.equal(scale.view(torch.uint8)[live], self.scale.view(torch.uint8)[live])


def _same_bytes(weight: torch.Tensor, codes: torch.Tensor) -> bool:
    data = getattr(weight, "data", weight)
    return data.dtype == codes.dtype and data.shape == codes.shape and torch.equal(
        data.view(torch.uint8), codes.view(torch.uint8))


def _quant_cfg(entries: list[_Entry]) -> dict[str, Any]:
    """A ModelOpt config enabling exactly the export's quantizers with their format's default cfg."""
    mtq = import_modelopt()

    def defaults(base: dict) -> dict[str, dict]:
        return {e["quantizer_name"][1:]: copy.deepcopy(e["cfg"]) for e in base["quant_cfg"]
                if e.get("quantizer_name") in ("*weight_quantizer", "*input_quantizer") and "cfg" in e}

    per_fmt = {"fp8": defaults(mtq.FP8_DEFAULT_CFG), "nvfp4": defaults(mtq.NVFP4_DEFAULT_CFG)}
    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    cfg["quant_cfg"] = [{"quantizer_name": "*", "enable": False}] + [
        {"quantizer_name": f"{e.name}.{q}", "cfg": per_fmt[e.fmt][q], "enable": True}
        for e in entries for q in ("weight_quantizer", "input_quantizer")]
    return cfg


def load_hf_export(export_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                   compress: bool = False) -> nn.Module:
    """ModelOpt's Hugging Face export (``export_dir`` may be a pipeline folder) as a diffusers
    ``QwenImageTransformer2DModel`` with ModelOpt quantizers, ready for ``qwen_absorb.patch``: weights loaded as codes
    times scales (then ``dtype``, default the unquantized weights'), amaxes giving exactly the stored scales, every
    quantized linear checked to quantize back to the checkpoint's codes. ``compress`` (FP8 only): ``mtq.compress``."""
    from diffusers import QwenImageTransformer2DModel  # noqa: PLC0415

    mtq = import_modelopt()
    folder = Path(export_dir)
    if not (folder / "config.json").is_file() and (folder / "transformer" / "config.json").is_file():
        folder = folder / "transformer"  # a whole pipeline folder: its transformer
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{export_dir}: no config.json (a ModelOpt Hugging Face export of a transformer)")
    algo = read_quant_algo(folder)
    if algo not in (None, "FP8", "NVFP4", "MIXED_PRECISION"):
        raise ValueError(f"{folder}: quant_algo {algo!r} is not supported (FP8, NVFP4 or a mix of them)")
    config = dict(QwenImageTransformer2DModel.load_config(str(folder)))
    device = torch.device(device)
    state = _read_safetensors(folder, device)
    entries = [_Entry(n, state) for n in sorted(k[:-13] for k in state if k.endswith(".weight_scale"))]
    if dtype is None:
        dtype = next((t.dtype for k, t in state.items() if t.is_floating_point() and t.dtype.itemsize > 1
                      and k.endswith(".weight")), torch.float32)
    try:
        model = empty_transformer(config, dtype, device)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{folder}: config.json does not describe a QwenImageTransformer2DModel: {e}") from e
    _check_matches(folder, model, entries, state)
    if (bad := next((b for e in entries if (b := e.bad_scale()) is not None), None)) is not None:
        raise ValueError(f"{folder}: {bad}")
    if compress and any(e.fmt == "nvfp4" for e in entries):
        raise ValueError("compress=True supports FP8 exports only (ModelOpt's NVFP4 compressed forward "
                         "dequantizes on every call and is not its fake quantization)")

    params = dict(model.named_parameters())
    with torch.no_grad():
        for e in entries:  # one dequantized copy at a time
            params[f"{e.name}.weight"].copy_(e.dequantized())
        model.load_state_dict(state, strict=False)
    del state
    mtq.quantize(model, _quant_cfg(entries), forward_loop=None)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for e in entries:
            lin, nv = modules[e.name], e.fmt == "nvfp4"
            bound = E2M1_MAX * FP8_MAX if nv else FP8_MAX
            lin.weight_quantizer.amax = _amax_from_scale(e.scale_2 if nv else e.scale, dtype, bound, cuda_first=nv)
            if e.input_scale is not None:
                lin.input_quantizer.amax = _amax_from_scale(e.input_scale, dtype, bound, cuda_first=nv)
            else:  # a weight-only export
                lin.input_quantizer.disable()
        wrong = [e.name for e in entries if not e.reproduces_codes(params[f"{e.name}.weight"])]
    if compress and not wrong:
        mtq.compress(model)
        wrong = [e.name for e in entries if not _same_bytes(modules[e.name]._parameters["weight"], e.weight)]
    if wrong:
        raise ValueError(f"{folder}: {len(wrong)} quantized linears do not reproduce the checkpoint's codes "
                         f"(first: {wrong[0]})")
    counts = {f: sum(e.fmt == f for e in entries) for f in ("fp8", "nvfp4")}
    logger.info("loaded ModelOpt export %s: %d FP8 and %d NVFP4 linears", folder, counts["fp8"], counts["nvfp4"])
    return model.eval()


def _check_matches(folder: Path, model: nn.Module, entries: list[_Entry], state: dict[str, torch.Tensor]) -> None:
    """The loader's "does not match" error, naming the first problems, unless stored and model tensors pair up."""
    own = model.state_dict()
    problems = [p for e in entries for p in e.problems(getattr(own.get(f"{e.name}.weight"), "shape", None))]
    quantized = {f"{e.name}.weight" for e in entries}
    for k, t in state.items():
        if k not in own:
            problems.append(f"{k}: not in the model built from config.json")
        elif tuple(own[k].shape) != tuple(t.shape):
            problems.append(f"{k}: stored {tuple(t.shape)}, the model's is {tuple(own[k].shape)}")
    problems += [f"{k}: missing from the export" for k in sorted(own) if k not in state and k not in quantized]
    if problems:
        raise ValueError(f"{folder}: the export does not match the transformer built from its config.json "
                         f"({len(problems)} problems; first: {'; '.join(problems[:4])})")


def empty_transformer(config: dict[str, Any], dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """A ``QwenImageTransformer2DModel`` of ``config``, empty weights, its rope rebuilt (tables not in buffers)."""
    from diffusers import QwenImageTransformer2DModel  # noqa: PLC0415
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedLayer3DRope, QwenEmbedRope  # noqa: PLC0415

    config = {k: v for k, v in dict(config).items() if not k.startswith("_") and k != "quantization_config"}
    with torch.device("meta"):
        model = QwenImageTransformer2DModel.from_config(config)
    # nn.Module's cast: diffusers' ModelMixin.to would log modules "should be kept in float32" (it has none)
    nn.Module.to(model, dtype=dtype)
    model.to_empty(device=torch.device(device))
    rope = QwenEmbedLayer3DRope if config.get("use_layer3d_rope", False) else QwenEmbedRope
    model.pos_embed = rope(theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True)
    return model.eval()
