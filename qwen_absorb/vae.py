"""The Qwen-Image VAE's decode (``AutoencoderKLQwenImage``) as the 2-D network it computes for one frame.

diffusers pads every causal 3-D convolution with two zero frames, so for one frame only the last temporal slice of
each kernel meets data: a 2-D convolution at a third of the work. :class:`FastDecode` (the VAE's instance
``_decode``: ``decode``'s hooks, slicing and accelerate keep working) runs it channels-last, on CUDA from a graph per
shape. Contract: other cuDNN kernels reorder the convolutions' sums (gated by :func:`fidelity`); each RMS norm +
SiLU is one kernel with eager's rounding points; every other op is the same torch op on the same values. The
replicated diffusers code is pinned by :data:`REPLICATED`; a watch of the decoder remakes the 2-D weights (copies)."""

import functools
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from torch import nn

from .component_patch import ComponentReport, Slot, current, install, remove
from .hooks import HOOK_DICTS, global_hook_count
from .gating import check_tristate
from .ops import rms_norm_silu as norm_op
from .pipeline_walks import source_hash
from .report import counts
from .watch import Watch

GATE = 1.05  # patched error vs fp32 <= GATE x unpatched error vs fp32 (issue 40)
CONTRACT = ("fidelity-gated: 2-D channels-last convolutions reorder sums; error vs an fp32 decode <= "
            f"{GATE}x the unpatched decode's (vae.fidelity)")
# the decoder's classes whose forwards the 2-D path computes (their order: the hash's)
_DECODER = ("QwenImageDecoder3d", "QwenImageMidBlock", "QwenImageUpBlock", "QwenImageResidualBlock",
            "QwenImageAttentionBlock", "QwenImageResample", "QwenImageRMS_norm", "QwenImageCausalConv3d",
            "QwenImageUpsample")
_KNOWN = {*_DECODER, "ModuleList", "Sequential", "Identity", "Dropout", "Conv2d", "SiLU"}
# plain attributes the 2-D path reads, by class (and each convolution's geometry, kept by Weights2d)
_PLAIN_ATTRS = {"QwenImageRMS_norm": ("scale", "bias", "channel_first"), "QwenImageResample": ("mode",),
                "Dropout": ("training", "p")}
REPLICATED = frozenset({"7f9c2b764c273595"})  # source_hash of the diffusers 0.42.1 methods the 2-D path computes
_REPLICATED_METHODS = (("AutoencoderKLQwenImage", "_decode"), *((c, "forward") for c in _DECODER))
_CONV, _NORM = ("QwenImageCausalConv3d",), ("QwenImageRMS_norm",)
_CONV_GEOMETRY = ("stride", "padding", "_padding", "dilation", "groups")
# what the 2-D path reads in each slot (Weights2d.decode): any other module there runs diffusers' decode
_SLOTS = {
    "QwenImageResidualBlock": {"norm1": _NORM, "norm2": _NORM, "conv1": _CONV, "conv2": _CONV,
                               "conv_shortcut": (*_CONV, "Identity")},
    "QwenImageAttentionBlock": {"norm": _NORM, "to_qkv": ("Conv2d",), "proj": ("Conv2d",)},
    "QwenImageDecoder3d": {"conv_in": _CONV, "norm_out": _NORM, "conv_out": _CONV, "mid_block": ("QwenImageMidBlock",)},
    "QwenImageUpBlock": {"resnets": ("ModuleList",)},
    "QwenImageMidBlock": {"resnets": ("ModuleList",), "attentions": ("ModuleList",)},
}


@dataclass
class VaeReport(ComponentReport):
    """The ``vae`` section of a patch report."""

    contract: str = CONTRACT
    cpu: bool = False  # the 2-D path on the CPU too (off by default: measured and gated on CUDA only)
    postprocess: bool = False  # the pipeline's PIL conversion on the device (FastPostprocess)
    fuse_norm: bool = True  # asked: the norm + SiLU chains as one kernel each (ops.rms_norm_silu)
    norm_silu_kernel: bool = False  # they run as that kernel (known after the first 2-D call)
    norm_silu_reasons: list[str] = field(default_factory=list)
    fast_calls: int = 0
    fallbacks: Counter = field(default_factory=Counter)  # calls run by diffusers' _decode, by reason
    rebuilds: int = 0

    def line(self) -> str:
        if not self.on:
            return "VAE decode: diffusers' (" + "; ".join(self.reasons) + ")"
        fused = ", norm + SiLU as one kernel" if self.norm_silu_kernel else ""
        where = " on CUDA" + (" and the CPU" if self.cpu else "")
        s = (f"VAE decode: 2-D channels-last path{where}{fused} ({self.fast_calls} calls, "
             f"{self.graph_counts() or 'no CUDA graphs'})")
        if self.postprocess:
            s += "; PIL conversion on the device"
        if self.fallbacks:
            s += "; diffusers' decode: " + counts(self.fallbacks, 3)
        return s


@functools.cache
def _code_key(module: str) -> str | None:
    return source_hash(getattr(getattr(sys.modules.get(module), c), m) for c, m in _REPLICATED_METHODS)


def _static_reasons(vae: nn.Module) -> list[str]:
    """Why the decoder cannot run the 2-D path at all (empty: it can)."""
    if type(vae).__name__ != "AutoencoderKLQwenImage":
        return [f"{type(vae).__name__} is not AutoencoderKLQwenImage"]
    if _code_key(type(vae).__module__) not in REPLICATED:
        return ["this diffusers' Qwen-Image VAE code is not the one the 2-D path replicates (diffusers 0.42.1)"]
    if (dec := getattr(vae, "decoder", None)) is None or type(dec).__name__ != "QwenImageDecoder3d":
        return ["the VAE has no QwenImageDecoder3d"]
    reasons = []
    for name, m in [("post_quant_conv", vae.post_quant_conv), *(("decoder." + n, m) for n, m in dec.named_modules())]:
        cls = type(m).__name__
        if cls not in _KNOWN:
            reasons.append(f"{name}: {cls} is not a module the 2-D path knows")
        if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            reasons.append(f"{name}: carries hooks or a replaced forward")
        if cls == "QwenImageCausalConv3d" and (m.stride[0] != 1 or m.dilation != (1, 1, 1) or m.groups != 1
                                               or m.kernel_size[0] != m._padding[4] + 1 or m._padding[5]):
            reasons.append(f"{name}: not a causal convolution whose last time slice alone meets one frame")
        if cls == "QwenImageResample" and m.mode not in ("upsample2d", "upsample3d", "none"):
            reasons.append(f"{name}: resample mode {m.mode!r}")
        if cls == "QwenImageRMS_norm" and not m.channel_first:
            reasons.append(f"{name}: a channel-last RMS norm")
        if cls == "Dropout" and m.p and m.training:
            reasons.append(f"{name}: dropout active")
        bad = [k for k, classes in _SLOTS.get(cls, {}).items() if type(m._modules.get(k)).__name__ not in classes]
        if cls == "QwenImageResample" and m.mode != "none":
            seq = m._modules.get("resample")
            if type(seq).__name__ != "Sequential" or [type(x).__name__ for x in seq] != ["QwenImageUpsample", "Conv2d"]:
                bad.append("resample")
        reasons += [f"{name}.{k}: not the module the 2-D path computes" for k in bad]
    acts = (dec, *dec.mid_block.resnets, *(r for u in dec.up_blocks for r in u.resnets))
    off = next((m for m in acts if type(getattr(m, "nonlinearity", None)).__name__ != "SiLU"), None)
    return reasons + ([f"{type(off).__name__}: non-linearity is not SiLU"] if off is not None else [])


def _modules(vae: nn.Module) -> list[nn.Module]:
    """The VAE, its post_quant_conv and every decoder module (those present: a VAE edited since may lack one)."""
    pq, dec = vae._modules.get("post_quant_conv"), vae._modules.get("decoder")
    return [vae, *([pq] if pq is not None else []), *(dec.modules() if dec is not None else ())]


def _watch(vae: nn.Module) -> Watch:
    mods = _modules(vae)
    entries = [(m, "_modules", n) for m in mods for n in m._modules]
    entries += [(m, "__dict__", "forward") for m in mods[1:]]
    entries += [(m, "__dict__", a) for m in mods for a in _PLAIN_ATTRS.get(type(m).__name__, ())]
    entries += [(m, "__dict__", a) for m in mods if type(m).__name__ in ("QwenImageCausalConv3d", "Conv2d")
                for a in _CONV_GEOMETRY if a in m.__dict__]
    return Watch(entries=entries, tensors=[(m, "_parameters", n) for m in mods[1:] for n in m._parameters],
                 sized=[(m, "__dict__", h) for m in mods[1:] for h in HOOK_DICTS], typed=mods)


class Weights2d:
    """Each convolution's 2-D weight (the last time slice, channels-last copy), bias and padding."""

    def __init__(self, vae: nn.Module, fuse: bool = True) -> None:
        self.fused_reasons: list[str] = []  # why the norm + SiLU chains run as torch ops (empty: one kernel each)
        self.conv, self.gamma = {}, {}  # by id(module): (2-D weight, bias, stride, padding); gamma as (C, 1, 1)
        with torch.no_grad():
            for m in _modules(vae)[1:]:
                cls = type(m).__name__
                if cls in ("QwenImageCausalConv3d", "Conv2d"):
                    causal, w = cls == "QwenImageCausalConv3d", m.weight.detach()
                    w = (w[:, :, -1] if causal else w).contiguous(memory_format=torch.channels_last)
                    geometry = ((tuple(m.stride[1:]), (m._padding[2], m._padding[0])) if causal
                                else (tuple(m.stride), tuple(m.padding)))
                    self.conv[id(m)] = (w, None if m.bias is None else m.bias.detach(), *geometry)
                elif cls == "QwenImageRMS_norm":
                    self.gamma[id(m)] = m.gamma.detach().reshape(-1, 1, 1)  # a view: (C,1,1[,1]) -> (C,1,1)
                    if isinstance(m.bias, torch.Tensor):
                        self.fused_reasons.append("an RMS norm with a bias tensor")
        self.fused_reasons += [] if fuse else ["fuse_norm=False"]
        if not self.fused_reasons:  # the fused kernel where it runs (compiled here, outside any graph capture)
            norm = vae.decoder.norm_out
            g = self.gamma[id(norm)].reshape(-1)
            probe = torch.randn(1, g.numel(), 2, 2, device=g.device).to(g.dtype, memory_format=torch.channels_last)
            self.fused_reasons += norm_op.not_supported_reasons(probe, g)
            if not self.fused_reasons:
                try:
                    norm_op.launch(probe, g, norm.scale)
                except Exception as e:  # noqa: BLE001  (a kernel that does not compile leaves the torch ops)
                    self.fused_reasons.append(f"the kernel failed: {type(e).__name__}: {e}"[:200])

    def norm_silu(self, x: torch.Tensor, m: nn.Module, silu: bool = True) -> torch.Tensor:
        if not self.fused_reasons and x.shape[1] % 2 == 0 and x.shape[1] <= norm_op.MAX_C \
                and x.is_contiguous(memory_format=torch.channels_last):
            return norm_op.launch(x, self.gamma[id(m)].reshape(-1), m.scale, silu)
        y = self.norm(x, m)
        return F.silu(y) if silu else y

    def conv2d(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        return F.conv2d(x, *self.conv[id(m)])  # weight, bias, stride, padding

    def norm(self, x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        # diffusers' QwenImageRMS_norm: normalize in fp32 (16-bit and narrower dtypes; others in their own), round
        # to x's dtype, then * scale * gamma (+ 0.0 dropped)
        low = x.dtype in (torch.float16, torch.bfloat16) or any(t in str(x.dtype) for t in ("float4_", "float8_"))
        y = F.normalize(x.float() if low else x, dim=1).to(x.dtype) * m.scale * self.gamma[id(m)]
        if isinstance(m.bias, torch.Tensor):
            y = y + m.bias.detach().reshape(-1, 1, 1)
        elif m.bias:  # a number set in place of diffusers' 0.0
            y = y + m.bias
        return y

    def resblock(self, x: torch.Tensor, blk: nn.Module) -> torch.Tensor:
        h = x if isinstance(blk.conv_shortcut, nn.Identity) else self.conv2d(x, blk.conv_shortcut)
        x = self.conv2d(self.norm_silu(x, blk.norm1), blk.conv1)
        x = self.conv2d(self.norm_silu(x, blk.norm2), blk.conv2)
        return x + h

    def attention(self, x: torch.Tensor, blk: nn.Module) -> torch.Tensor:
        bt, c, h, w = x.shape
        qkv = self.conv2d(self.norm_silu(x, blk.norm, silu=False), blk.to_qkv)
        # channels-last (bt, 3c, h, w) is (bt, h*w, 3c) in memory: diffusers' permuted copy, as a view
        qkv = qkv.permute(0, 2, 3, 1).reshape(bt, 1, h * w, 3 * c)
        y = F.scaled_dot_product_attention(*qkv.chunk(3, dim=-1))  # q, k, v
        y = y.squeeze(1).permute(0, 2, 1).reshape(bt, c, h, w)  # channels-last view
        return self.conv2d(y, blk.proj) + x

    def resample(self, x: torch.Tensor, r: nn.Module) -> torch.Tensor:
        if r.mode == "none":
            return x
        up, conv = r.resample[0], r.resample[1]
        # nearest-exact copies values: diffusers' fp32 round trip gives the same bits, but for fp64 (rounded there)
        if x.dtype == torch.float64:
            x = x.float().double()
        x = F.interpolate(x, up.size, up.scale_factor, up.mode, up.align_corners,
                          recompute_scale_factor=up.recompute_scale_factor)
        return self.conv2d(x, conv)

    def decode(self, vae: nn.Module, z: torch.Tensor) -> torch.Tensor:
        """``z`` [B, C, H, W] channels-last -> the clamped image [B, 3, 1, H', W'] (contiguous)."""
        dec = vae.decoder
        x = self.conv2d(self.conv2d(z, vae.post_quant_conv), dec.conv_in)
        x = self.resblock(x, dec.mid_block.resnets[0])
        for attn, res in zip(dec.mid_block.attentions, dec.mid_block.resnets[1:]):
            if attn is not None:
                x = self.attention(x, attn)
            x = self.resblock(x, res)
        for up in dec.up_blocks:
            for res in up.resnets:
                x = self.resblock(x, res)
            if up.upsamplers is not None:
                x = self.resample(x, up.upsamplers[0])
        x = self.conv2d(self.norm_silu(x, dec.norm_out), dec.conv_out)
        out = torch.empty((x.shape[0], x.shape[1], 1, x.shape[2], x.shape[3]), dtype=x.dtype, device=x.device)
        torch.clamp(x, -1.0, 1.0, out=out[:, :, 0])
        return out


class FastDecode(Slot):
    """The VAE's instance ``_decode``: the 2-D path where it applies, diffusers' ``_decode`` elsewhere."""

    ATTR, REPORT = "_decode", VaeReport

    def __init__(self, vae: nn.Module, report: VaeReport, had_instance: Any) -> None:
        self.vae, self.watch, self.weights = vae, _watch(vae), None
        # diffusers' DecoderOutput, as the VAE's own module names it (no diffusers import here)
        self.output_class = getattr(sys.modules[type(vae).__module__], "DecoderOutput")
        super().__init__(report, had_instance)

    def _run(self, z: torch.Tensor) -> torch.Tensor:
        return self.weights.decode(self.vae, z)

    def _why_not(self, z: Any) -> str | None:
        vae = self.vae
        if not isinstance(z, torch.Tensor) or z.dim() != 5:
            return "input is not a 5-D latent tensor"
        if z.numel() == 0:
            return "an empty latent (diffusers decides what it gives)"
        if global_hook_count():
            return "torch's global module forward hooks are registered (they run on every module diffusers calls)"
        if z.shape[2] != 1:
            return "several frames (video): the causal time path"
        ratio = vae.spatial_compression_ratio
        if vae.use_tiling and (z.shape[-1] > vae.tile_sample_min_width // ratio
                               or z.shape[-2] > vae.tile_sample_min_height // ratio):
            return "tiled decode"
        w = vae.post_quant_conv.weight
        if z.dtype != w.dtype or z.device != w.device:
            return "latents' dtype or device differ from the VAE's"
        if torch.is_grad_enabled() and (z.requires_grad or w.requires_grad):
            return "autograd"
        if z.device.type != "cuda" and not self.report.cpu:
            return f"on {z.device.type}: the 2-D path is gated on CUDA (vae.patch(cpu=True) runs it here)"
        return None

    def __call__(self, z: torch.Tensor, return_dict: bool = True) -> Any:
        if self.watch.changed():
            self.renew()
        if (why := self.report.reasons[0] if self.report.reasons else self._why_not(z)) is not None:
            self.report.fallbacks[why] += 1
            return type(self.vae)._decode(self.vae, z, return_dict=return_dict)
        if self.weights is None:
            self.weights = Weights2d(self.vae, self.report.fuse_norm)
            self.report.norm_silu_kernel = not self.weights.fused_reasons
            self.report.norm_silu_reasons = list(self.weights.fused_reasons)
        z2 = z[:, :, 0].contiguous(memory_format=torch.channels_last)
        graphed = z.device.type == "cuda" and self.mode is not False
        out = self.graphs((tuple(z2.shape), z2.dtype, z2.device), (z2,)) if graphed else None
        if out is None:
            with torch.no_grad():
                out = self._run(z2)
        self.report.fast_calls += 1
        self.report.graphs = self.graphs.describe()
        return self.output_class(sample=out) if return_dict else (out,)

    def renew(self) -> None:
        self.report.rebuilds += 1
        self.weights = None
        self.graphs.clear()
        self.report.reasons = reasons = _static_reasons(self.vae)
        self.report.on = not reasons
        self.watch = _watch(self.vae)  # anew: modules replaced since are the ones to watch now

    def _uncopied(self) -> dict[str, Any]:
        return {"weights": None}


def patch(vae: nn.Module, *, cuda_graph: str | bool = "auto", cpu: bool = False, fuse_norm: bool = True) -> VaeReport:
    """Install :class:`FastDecode` as ``vae._decode``; returns the ``vae`` report section (``on`` False with
    reasons, nothing installed, for a VAE the 2-D path does not know). ``cpu``: the 2-D path on the CPU too
    (tests). ``fuse_norm``: each RMS norm + SiLU as one kernel where it runs."""
    check_tristate("cuda_graph", cuda_graph)
    if not isinstance(vae, nn.Module):
        raise TypeError(f"vae.patch needs a diffusers VAE module, got {type(vae).__name__}")
    if not isinstance(cpu, bool) or not isinstance(fuse_norm, bool):
        raise ValueError(f"cpu and fuse_norm must be True or False, got {cpu!r} and {fuse_norm!r}")
    return install(vae, FastDecode, _static_reasons, "VAE decode", cuda_graph, cpu=cpu, fuse_norm=fuse_norm)


def unpatch(vae: nn.Module) -> None:
    """Restore diffusers' ``_decode`` (or the instance one found at patch time); a no-op if not patched."""
    remove(vae, FastDecode)


def report_of(vae: nn.Module) -> VaeReport | None:
    return getattr(current(vae, FastDecode), "report", None)


def fidelity(vae: nn.Module, z: torch.Tensor) -> dict[str, float]:
    """The gate, measured: mean absolute errors of the patched and unpatched decodes of ``z`` against an fp32
    decode by a fresh twin, and their ratio (the patch holds where ``ratio <= GATE``)."""
    with torch.no_grad():
        twin = type(vae).from_config(vae.config).to(z.device).eval()
        twin.load_state_dict({k: v.float() for k, v in vae.state_dict().items()})
        ref = twin._decode(z.float()).sample.double()
        del twin  # its memory back before the two decodes
        fast = vae._decode(z).sample.double()
        eager = type(vae)._decode(vae, z).sample.double()
    err_fast, err_eager = ((x - ref).abs().mean().item() for x in (fast, eager))
    return {"err_patched": err_fast, "err_unpatched": err_eager,
            "ratio": err_fast / err_eager if err_eager else (1.0 if err_fast == 0 else float("inf")),
            "bit_identical": bool(torch.equal(fast, eager)),
            "max_abs_patched_vs_unpatched": (fast - eager).abs().max().item()}


class FastPostprocess:
    """The pipeline's ``image_processor.postprocess`` for ``output_type="pil"`` on a CUDA image: the fp32 product by
    255, round-half-even and cast run on the device and only uint8 pixels travel (the same bytes). Other output types,
    host images, grayscale and non-finite values (numpy's and torch's uint8 casts of NaN differ) run diffusers'."""

    ATTR = "postprocess"

    def __init__(self, processor: Any, had_instance: Any) -> None:
        self.processor, self.had_instance, self.calls = processor, had_instance, Counter()
        self.original = type(processor).postprocess.__get__(processor)

    def __call__(self, image: torch.Tensor, output_type: str = "pil", do_denormalize: list[bool] | None = None) -> Any:
        if (output_type == "pil" and isinstance(image, torch.Tensor) and image.device.type == "cuda"
                and image.dim() == 4 and image.shape[1] == 3
                and (images := self.pil_images(image, do_denormalize)) is not None):
            self.calls["device"] += 1
            return images
        self.calls["diffusers"] += 1
        return self.original(image, output_type=output_type, do_denormalize=do_denormalize)

    def pil_images(self, image: torch.Tensor, do_denormalize: list[bool] | None) -> list[PIL.Image.Image] | None:
        """The conversion where ``image`` lies (None: a non-finite value, left to diffusers)."""
        x = self.processor._denormalize_conditionally(image, do_denormalize).float()
        pixels = (x * 255).round_()
        finite = torch.isfinite(pixels).all()
        pixels = pixels.to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu()  # the one sync: the copy
        # ``finite`` read after the copy: no further wait
        return [PIL.Image.fromarray(p) for p in np.asarray(pixels.numpy())] if bool(finite) else None


def patch_postprocess(proc: Any) -> bool:
    """Install :class:`FastPostprocess` on a pipeline's ``image_processor`` (True when installed or already there)."""
    if not callable(getattr(type(proc), "postprocess", None)) or not hasattr(proc, "_denormalize_conditionally"):
        return False
    cur = proc.__dict__.get("postprocess")
    if not isinstance(cur, FastPostprocess):
        proc.__dict__["postprocess"] = FastPostprocess(proc, cur)
    return True


def unpatch_postprocess(proc: Any) -> None:
    remove(proc, FastPostprocess)
