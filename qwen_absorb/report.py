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
from dataclasses import dataclass, field
from typing import Any

from .plan import BlockPlan, SitePlan
from .sites import SITE_TABLE, SITES, STREAMS  # noqa: F401  (SITES, STREAMS: re-exported)

# The projection whose bias each site can consume (read off the site table).
SITE_PROJECTION = {(s.stream, s.name): s.takes_bias_of for s in SITE_TABLE.values() if s.takes_bias_of}
# The report's block and site records are the plans themselves: one record of every decision.
BlockReport = BlockPlan
SiteReport = SitePlan


@dataclass
class PatchReport:
    """The result of :func:`qwen_absorb.patch` (also kept on the transformer while patched)."""

    transformer_class: str
    dtype: str
    defer_bias: str | bool
    capabilities: list[str]
    fp8_gemm: str | bool = "auto"
    force_reference: bool = False
    blocks: list[BlockPlan] = field(default_factory=list)
    runtime_fallbacks: Counter = field(default_factory=Counter)
    active: bool = True  # False once unpatched
    cuda_graph: Any = None  # the qwen_absorb.cuda_graph runner when patch(cuda_graph=True)
    offload_original_weights: bool = False

    def _decided(self) -> BlockPlan | None:
        return next((b for b in self.blocks if b.patched), self.blocks[0] if self.blocks else None)

    @property
    def device(self) -> str:
        """The device the current decisions were made for (where the blocks last ran or will run)."""
        b = self._decided()
        return b.device if b is not None else "?"

    @property
    def kernels_available(self) -> bool:
        b = self._decided()
        return b is not None and not b.kernel_reasons

    @property
    def kernel_unavailable_reasons(self) -> list[str]:
        b = self._decided()
        return list(b.kernel_reasons) if b is not None else ["no blocks"]

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
            "fp8_gemm_linears": sum(lp.fp8_gemm for b in self.blocks for lp in b.linears.values()),
            "fp8_emitting_sites": sum(s.fp8_out for s in sites),
            "qk_norm_rope_fused_blocks": sum(b.qk_fused for b in self.blocks),
            "cross_block_links": sum(b.handoff_to is not None for b in self.blocks),
            "cross_block_handoffs_taken": sum(b.handoffs_used for b in self.blocks),
            "runtime_fallbacks": sum(self.runtime_fallbacks.values()),
            "kernels_available": self.kernels_available,
        }

    def to_dict(self) -> dict[str, Any]:
        d = {
            "transformer_class": self.transformer_class, "device": self.device, "dtype": self.dtype,
            "defer_bias": self.defer_bias, "capabilities": list(self.capabilities),
            "kernels_available": self.kernels_available,
            "kernel_unavailable_reasons": list(self.kernel_unavailable_reasons),
            "fp8_gemm": self.fp8_gemm, "offload_original_weights": self.offload_original_weights,
            "force_reference": self.force_reference, "active": self.active,
            "summary": self.summary, "runtime_fallbacks": dict(self.runtime_fallbacks),
            "cuda_graph": self.cuda_graph.describe() if self.cuda_graph is not None else None,
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
        if s["fp8_gemm_linears"] or any(lp.fp8_reasons for b in self.blocks for lp in b.linears.values()
                                        if lp.fp8_reasons and lp.fp8_reasons[0] != "not ModelOpt-quantized"):
            lines.append(f"  real FP8 GEMMs: {s['fp8_gemm_linears']} linears (fp8_gemm={self.fp8_gemm!r}); "
                         f"FP8-emitting fused sites: {s['fp8_emitting_sites']}")
        if s["quantized_projections"]:
            fmt = ", ".join(f"{k} x{v}" for k, v in sorted(s["quantized_projections"].items()))
            lines.append(f"  ModelOpt output projections: {fmt} ({s['compressed_projections']} compressed); "
                         f"quantized block norms: {s['quantized_norms']}")
        lines += _grouped("  not patched", [(r, b.index) for b in self.blocks for r in b.reasons])
        lines += _grouped("  not fused", [(r, x.block) for x in self.sites for r in x.reasons])
        lines += _grouped(
            "  linear not run as a real FP8 GEMM",
            [(f"{lp.path}: {r}", b.index) for b in self.blocks for lp in b.linears.values()
             if not lp.fp8_gemm and lp.fp8_reasons and lp.fp8_reasons[0] not in ("not ModelOpt-quantized",
                                                                                  "fp8_gemm=False")
             for r in lp.fp8_reasons],
        )
        if self.cuda_graph is not None:
            lines.append(f"  CUDA graph mode: {self.cuda_graph.describe()}")
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
