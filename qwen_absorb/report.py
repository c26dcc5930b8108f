"""PatchReport: what :func:`qwen_absorb.patch` did, per block and per site, and what happened since.

Sites, per block and per stream (``img``, ``txt``):

- ``norm1``          norm1 + modulation                   -> ``layer_norm_scale_shift``
- ``attn_residual``  attention bias + gated residual + norm2 + modulation
                                                          -> ``bias_residual_layer_norm_scale_shift``
- ``ffn_residual``   FFN bias + gated residual            -> ``bias_gate_residual``

``runtime_fallbacks`` is a live ``Counter`` (reason -> number of site calls) that the patched
forwards update in eager mode; calls traced by ``torch.compile`` are not counted.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .quant import NormInfo, ProjectionInfo

SITES = ("norm1", "attn_residual", "ffn_residual")
STREAMS = ("img", "txt")
# The projection whose bias each site can consume.
SITE_PROJECTION = {
    ("img", "attn_residual"): "attn.to_out.0",
    ("txt", "attn_residual"): "attn.to_add_out",
    ("img", "ffn_residual"): "img_mlp.net.2",
    ("txt", "ffn_residual"): "txt_mlp.net.2",
}


@dataclass
class SiteReport:
    block: int
    stream: str
    site: str
    fused: bool
    reasons: list[str] = field(default_factory=list)  # why not fused
    projection: str | None = None  # the projection whose bias this site can take
    bias_deferred: bool = False
    defer_reasons: list[str] = field(default_factory=list)  # why the bias stays in the GEMM
    norm_quantizer: str | None = None  # "fp8-fused", "applied-before-op" or None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BlockReport:
    index: int
    patched: bool
    reasons: list[str] = field(default_factory=list)  # why the block forward was not replaced
    install: str = ""  # where the patched forward went: "forward", "diffusers hook chain", ...
    sites: list[SiteReport] = field(default_factory=list)
    projections: dict[str, ProjectionInfo] = field(default_factory=dict)
    norms: dict[str, NormInfo] = field(default_factory=dict)

    def site(self, stream: str, site: str) -> SiteReport:
        for s in self.sites:
            if s.stream == stream and s.site == site:
                return s
        raise KeyError((stream, site))

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "patched": self.patched, "reasons": list(self.reasons), "install": self.install,
            "sites": [s.to_dict() for s in self.sites],
            "projections": {k: v.to_dict() for k, v in self.projections.items()},
            "norms": {k: v.to_dict() for k, v in self.norms.items()},
        }


@dataclass
class PatchReport:
    """The result of :func:`qwen_absorb.patch` (also kept on the transformer while patched)."""

    transformer_class: str
    device: str
    dtype: str
    defer_bias: str | bool
    capabilities: list[str]
    kernels_available: bool
    kernel_unavailable_reasons: list[str]
    force_reference: bool = False
    blocks: list[BlockReport] = field(default_factory=list)
    runtime_fallbacks: Counter = field(default_factory=Counter)
    active: bool = True  # False once unpatched

    @property
    def sites(self) -> list[SiteReport]:
        return [s for b in self.blocks for s in b.sites]

    @property
    def summary(self) -> dict[str, Any]:
        sites = self.sites
        formats: Counter = Counter()
        compressed = 0
        for b in self.blocks:
            for p in b.projections.values():
                if p.modelopt:
                    formats[p.weight_format or "none"] += 1
                    compressed += p.compressed
        return {
            "blocks": len(self.blocks),
            "blocks_patched": sum(b.patched for b in self.blocks),
            "sites": len(sites),
            "sites_fused": sum(s.fused for s in sites),
            "biases_deferrable_sites": sum(s.projection is not None for s in sites),
            "biases_deferred": sum(s.bias_deferred for s in sites),
            "quantized_projections": dict(formats),
            "compressed_projections": compressed,
            "quantized_norms": sum(
                n.input_quantizer_enabled for b in self.blocks for n in b.norms.values()
            ),
            "runtime_fallbacks": sum(self.runtime_fallbacks.values()),
            "kernels_available": self.kernels_available,
        }

    def to_dict(self) -> dict[str, Any]:
        d = {
            "transformer_class": self.transformer_class, "device": self.device, "dtype": self.dtype,
            "defer_bias": self.defer_bias, "capabilities": list(self.capabilities),
            "kernels_available": self.kernels_available,
            "kernel_unavailable_reasons": list(self.kernel_unavailable_reasons),
            "force_reference": self.force_reference, "active": self.active,
            "summary": self.summary, "runtime_fallbacks": dict(self.runtime_fallbacks),
            "blocks": [b.to_dict() for b in self.blocks],
        }
        json.dumps(d)  # fail here, not in the caller's serialiser, if something is not JSON-able
        return d

    def __str__(self) -> str:
        s = self.summary
        lines = [
            f"qwen_absorb PatchReport ({'active' if self.active else 'unpatched'}): {self.transformer_class} "
            f"on {self.device}, {self.dtype}",
            f"  blocks patched {s['blocks_patched']}/{s['blocks']}; sites fused {s['sites_fused']}/{s['sites']}; "
            f"biases deferred {s['biases_deferred']}/{s['biases_deferrable_sites']} (defer_bias={self.defer_bias!r})",
            f"  CUDA kernels: {'available' if self.kernels_available else 'unavailable'}"
            + ("" if self.kernels_available else " (" + "; ".join(self.kernel_unavailable_reasons) + ")"),
        ]
        if s["quantized_projections"]:
            fmt = ", ".join(f"{k} x{v}" for k, v in sorted(s["quantized_projections"].items()))
            lines.append(f"  ModelOpt output projections: {fmt} ({s['compressed_projections']} compressed); "
                         f"quantized block norms: {s['quantized_norms']}")
        lines += _grouped("  not patched", [(r, b.index) for b in self.blocks for r in b.reasons])
        lines += _grouped("  not fused", [(r, x.block) for x in self.sites for r in x.reasons])
        lines += _grouped(
            "  bias kept in GEMM",
            [(r, x.block) for x in self.sites if x.projection and not x.bias_deferred for r in x.defer_reasons],
        )
        if self.runtime_fallbacks:
            lines.append("  runtime fallbacks (site calls):")
            lines += [f"    {n:>6}  {r}" for r, n in self.runtime_fallbacks.most_common()]
        return "\n".join(lines)

    __repr__ = __str__


def _grouped(title: str, items: list[tuple[str, int]]) -> list[str]:
    """One line per distinct reason, with the blocks it applies to (keeps 60-block reports short)."""
    if not items:
        return []
    by_reason: dict[str, list[int]] = {}
    for reason, block in items:
        by_reason.setdefault(reason, []).append(block)
    out = [f"{title}:"]
    for reason, blocks in by_reason.items():
        out.append(f"    {reason}  [{len(blocks)} site(s), blocks {_ranges(sorted(set(blocks)))}]")
    return out


def _ranges(ix: list[int]) -> str:
    ix = sorted(ix)
    parts, start, prev = [], ix[0], ix[0]
    for i in ix[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(parts)
