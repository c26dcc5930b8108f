"""``PatchReport``: what a patch decided and what runs, as plain data.

It holds no module, tensor or graph (a kept report never keeps a model alive): decisions are copied in, counters keep
counting, dtype and graph are read through a weak reference to the active patch state (then kept as last seen).
``to_dict()`` is complete and JSON-able, for tools; ``str()`` is for people."""

import functools
import itertools
import json
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .plan import BlockPlan
from .quant import NormInfo, ProjectionInfo
from .sites import SITES, STREAMS  # noqa: F401  (re-exported)

REPLACED = "replaced in the model after patch(): the new block runs diffusers' forward until patch() again"
# BlockReport.to_dict's names of the fields it renames
_DICT_NAMES = {"qk_fused": "qk_norm_rope_fused", "qk_reasons": "qk_norm_rope_reasons", "tp_reasons": "tp_local_reasons",
               "handoff": "cross_block_handoff", "handoff_reasons": "cross_block_reasons",
               "handoff_in_reasons": "cross_block_receive_reasons", "handoffs_used": "cross_block_handoffs_taken",
               "fast_accum": "fp8_fast_accum", "attn_forwards": "hooked_attention_fp8",
               "attn_cache": "cache_around_own_attention", "attn_cache_kind": "cache_around_own_attention_kind"}
_NOT_MODELOPT = ("not ModelOpt-quantized", "fp8_gemm=False")
# PatchReport.to_dict's keys before "blocks", in order
_TOP_FIELDS = ("transformer_class", "device", "dtype", "defer_bias", "capabilities", "kernels_available",
               "kernel_unavailable_reasons", "fp8_gemm", "offload_original_weights", "force_reference", "active",
               "tuning", "summary", "runtime_fallbacks", "rebuilds", "cuda_graph_mode", "cuda_graph",
               "cuda_graph_refused", "graph_fallbacks")


class PartReport:
    """Base of a pipeline room's section (``PatchReport.parts``): a dataclass of plain data with ``line()``."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)  # asdict rebuilds a Counter from its (reason, count) pairs as elements: its counts as a dict
        d.update((k, dict(v)) for k, v in vars(self).items() if isinstance(v, Counter))
        return d


def counts(counter: Counter, most: int | None = None) -> str:
    """``3 x reason; 1 x other``: the most common first."""
    return "; ".join(f"{n} x {r}" for r, n in counter.most_common(most))


def _copied(cls: type, src: Any, **given: Any) -> Any:
    """A ``cls`` of ``src``'s attributes of its fields' names (lists copied), but for those ``given``."""
    return cls(**{f.name: given[f.name] if f.name in given else
                  (list(v) if isinstance(v := getattr(src, f.name), list) else v) for f in fields(cls)})


@dataclass
class SiteReport:
    block: int
    stream: str
    site: str
    fused: bool
    reasons: list[str]
    runner: str
    projection: str | None
    bias_deferred: bool
    defer_reasons: list[str]
    norm_quantizer: str | None
    fp8_out: bool
    act_out: bool


@dataclass
class LinearReport:
    path: str
    fp8_gemm: bool
    fp8_reasons: list[str]
    lora: bool
    reused_compressed_storage: bool
    original_weight_offloaded: bool


@dataclass
class BlockReport:
    """One block's decisions, copied from its plan."""

    index: int
    patched: bool
    reasons: list[str]
    install: str
    device: str
    kernels: bool
    kernel_reasons: list[str]
    sites: list[SiteReport]
    linears: dict[str, LinearReport]
    projections: dict[str, ProjectionInfo]
    norms: dict[str, NormInfo]
    qk_fused: bool
    qk_reasons: list[str]
    tp_reasons: dict[str, list[str]]
    handoff: bool  # this block hands its successor's norm1 over (cross-block fusion)
    handoff_reasons: list[str]
    handoff_in_reasons: list[str]
    handoffs_used: int
    fast_accum: bool = False  # its FP8 GEMMs use fast accumulation
    attn_forwards: bool = False  # a hooked attention runs as its module, its linears real FP8 in their forward slots
    fp8_forward_linears: int = 0  # its attention linears holding a gated real-FP8 forward able to run here
    attn_cache: bool = False  # a diffusers cache on its attention runs inside the block, around its own attention
    attn_cache_kind: str = ""  # which: "TaylorSeer" (taylorseer) or "PyramidAttentionBroadcast" (step_caches)

    @classmethod
    def of(cls, p: BlockPlan) -> "BlockReport":
        return _copied(
            cls, p, sites=[_copied(SiteReport, s) for s in p.sites],
            linears={k: _copied(LinearReport, v, original_weight_offloaded=v.offloaded, reused_compressed_storage=bool(
                v.weight is not None and v.weight.reused_storage)) for k, v in p.linears.items()},
            projections={k: ProjectionInfo(**asdict(v)) for k, v in p.projections.items()},
            norms={k: NormInfo(**asdict(v)) for k, v in p.norms.items()},
            tp_reasons={k: list(v) for k, v in p.tp_reasons.items()}, handoff=p.rt.handoff_to is not None,
            handoffs_used=0, fp8_forward_linears=0)

    def site(self, stream: str, name: str) -> SiteReport:
        for s in self.sites:
            if s.stream == stream and s.site == name:
                return s
        raise KeyError((stream, name))

    def to_dict(self) -> dict[str, Any]:
        d = {_DICT_NAMES.get(k, k): v for k, v in asdict(self).items()}  # asdict: deep copies, nested as dicts
        for lin in d["linears"].values():
            lin["lora_branch"] = lin.pop("lora")
        return d


def _replaced_blocks(state: Any) -> set[int]:
    """The indexes whose patched block is no longer at its place in the model (the patch's state, live)."""
    now = getattr(getattr(state, "model", None), "transformer_blocks", None)
    if now is None:
        return set()
    now = list(now)
    return {i for i, b in enumerate(state.blocks) if i >= len(now) or now[i] is not b}


def _as_replaced(b: BlockReport) -> "BlockReport":
    """What runs at a replaced block's place: diffusers' forward, every site eager, every linear its module."""
    why = [REPLACED]
    return replace(b, patched=False, reasons=why, install="", qk_fused=False, handoff=False, attn_forwards=False,
                   attn_cache=False, fp8_forward_linears=0,
                   sites=[replace(s, fused=False, runner="eager", bias_deferred=False, reasons=why, fp8_out=False,
                                  act_out=False) for s in b.sites],
                   linears={k: replace(v, fp8_gemm=False, fp8_reasons=why) for k, v in b.linears.items()})


@dataclass
class PatchReport:
    """The result of :func:`qwen_absorb.patch` (see the module docstring)."""

    transformer_class: str
    defer_bias: str | bool
    capabilities: list[str]
    fp8_gemm: str | bool = "auto"
    force_reference: bool = False
    offload_original_weights: bool = False
    cuda_graph_mode: str | bool = False
    tuning: str = ""  # the measurement switches that differ from the defaults (qwen_absorb.Tuning.describe)
    cuda_graph_refused: str | None = None  # why graph mode was not installed although asked for
    runtime_fallbacks: Counter = field(default_factory=Counter)  # calls that could not take the fused path
    graph_fallbacks: Counter = field(default_factory=Counter)  # cuda_graph="auto": calls run eager, by reason
    rebuilds: Counter = field(default_factory=Counter)  # decisions made again, by what changed
    handoffs: Counter = field(default_factory=Counter)  # cross-block hand-overs taken, by block index
    _blocks: list[BlockReport] = field(default_factory=list, repr=False)
    _state: Any = field(default=None, repr=False, compare=False)  # weakref to the patch state
    _seen: dict[str, Any] = field(default_factory=lambda: {"dtype": "?", "graph": None}, repr=False)
    # Qwen-Image: per block, {attention linear path: its gated real-FP8 forward may run (qwen_absorb.fp8_forward)}
    _fwd: dict[int, dict] = field(default_factory=dict, repr=False)
    # a pipeline's room sections (PartReport: to_dict() and line()), set by patch() when its target is a pipeline
    parts: dict[str, Any] = field(default_factory=dict, repr=False)

    def record(self, plan: BlockPlan) -> None:
        self._blocks += [None] * (plan.index + 1 - len(self._blocks))  # type: ignore[list-item]
        self._blocks[plan.index] = BlockReport.of(plan)

    def record_forward(self, index: int, path: str, fp8: bool, reasons: list[str]) -> None:
        """A Qwen-Image attention linear's gated real-FP8 forward decided (at install, then at each decision)."""
        self._fwd.setdefault(index, {})[path] = bool(fp8)

    def bind(self, state: Any) -> None:
        self._state = weakref.ref(state)

    def _live(self) -> Any:
        st = self._state() if self._state is not None else None
        if st is None or not st.active:
            return None
        # in place: a pipeline's view (patch_report) shares it, and so what was last seen after unpatch
        self._seen.update(dtype=st.dtype(), graph=st.graph.describe() if st.graph is not None else None)
        return st

    def freeze(self) -> None:
        self._live()
        self._state = None

    @property
    def active(self) -> bool:
        return self._live() is not None

    @property
    def blocks(self) -> list[BlockReport]:
        out, gone = [], _replaced_blocks(self._live())
        for b in self._blocks:
            if b is not None:
                b.handoffs_used = self.handoffs[b.index]
                b.fp8_forward_linears = sum(self._fwd.get(b.index, {}).values()) if b.patched else 0
                out.append(_as_replaced(b) if b.index in gone else b)
        return out

    @property
    def dtype(self) -> str:
        self._live()
        return self._seen["dtype"]

    @property
    def cuda_graph(self) -> dict[str, Any] | None:
        """The CUDA-graph runner's description (plain data), or None without graph mode."""
        self._live()
        return self._seen["graph"]

    def __getstate__(self) -> dict[str, Any]:
        # a copy holds the decisions as of now; a patch state copied with the model binds its own report again
        self._live()
        return {**self.__dict__, "_state": None}

    def _decided(self, blocks: list[BlockReport]) -> BlockReport | None:
        return next((b for b in blocks if b.patched), blocks[0] if blocks else None)

    @property
    def device(self) -> str:
        """The device the current decisions were made for (where the blocks last ran or will run)."""
        b = self._decided(self.blocks)
        return b.device if b is not None else "?"

    @property
    def kernels_available(self) -> bool:
        b = self._decided(self.blocks)
        return b is not None and not b.kernel_reasons

    @property
    def kernel_unavailable_reasons(self) -> list[str]:
        b = self._decided(self.blocks)
        return list(b.kernel_reasons) if b is not None else ["no blocks"]

    @property
    def sites(self) -> list[SiteReport]:
        return [s for b in self.blocks for s in b.sites]

    def _summary(self, blocks: list[BlockReport]) -> dict[str, Any]:
        sites = [s for b in blocks for s in b.sites]
        patched = [b for b in blocks if b.patched]
        projections = [p for b in blocks for p in b.projections.values() if p.modelopt]
        runners = Counter(s.runner for b in patched for s in b.sites if s.fused)
        linears = [lp for b in patched for lp in b.linears.values()]
        d = self._decided(blocks)
        return {
            "blocks": len(blocks), "blocks_patched": len(patched),
            "sites": len(sites), "sites_fused": sum(s.fused for s in sites),
            "sites_on_kernels": runners["kernel"], "sites_on_references": runners["reference"],
            "biases_deferrable_sites": sum(s.projection is not None for s in sites),
            "biases_deferred": sum(s.bias_deferred for s in sites),
            "quantized_projections": dict(Counter(p.weight_format or "none" for p in projections)),
            "compressed_projections": sum(p.compressed for p in projections),
            "quantized_norms": sum(n.input_quantizer_enabled for b in blocks for n in b.norms.values()),
            "fp8_gemm_linears": sum(lp.fp8_gemm for lp in linears),
            "fp8_gemm_lora_linears": sum(lp.fp8_gemm and lp.lora for lp in linears),
            "modelopt_linears": sum(lp.fp8_gemm or bool(lp.fp8_reasons and lp.fp8_reasons[0] not in _NOT_MODELOPT)
                                    for lp in linears),
            "fp8_emitting_sites": sum(s.fp8_out for s in sites),
            "fp8_forward_linears": sum(b.fp8_forward_linears for b in patched),
            "hooked_attention_fp8_blocks": sum(b.attn_forwards for b in patched),
            "taylorseer_attention_blocks": sum(b.attn_cache and b.attn_cache_kind == "TaylorSeer" for b in patched),
            "pab_attention_blocks": sum(b.attn_cache and b.attn_cache_kind == "PyramidAttentionBroadcast"
                                        for b in patched),
            "qk_norm_rope_fused_blocks": sum(b.qk_fused for b in blocks),
            "cross_block_links": sum(b.handoff for b in blocks),
            "cross_block_handoffs_taken": sum(b.handoffs_used for b in blocks),
            "runtime_fallbacks": sum(self.runtime_fallbacks.values()), "rebuilds": sum(self.rebuilds.values()),
            "kernels_available": d is not None and not d.kernel_reasons,
        }

    @property
    def summary(self) -> dict[str, Any]:
        return self._summary(self.blocks)

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _TOP_FIELDS}
        out.update({k: dict(v) for k, v in out.items() if isinstance(v, Counter)}, capabilities=list(self.capabilities))
        out["blocks"] = [b.to_dict() for b in self.blocks]
        out.update((name, part.to_dict()) for name, part in self.parts.items())
        json.dumps(out)  # fail here, not in the caller's serialiser, if something is not JSON-able
        return out

    def __str__(self) -> str:
        blocks = self.blocks
        s = self._summary(blocks)
        d = self._decided(blocks)
        device = d.device if d is not None else "?"
        kernel_why = "; ".join(d.kernel_reasons) if d is not None else ""
        plain = functools.partial(_plain, device=device, why=kernel_why)
        state = "active" if self.active else "unpatched"
        lines = [f"qwen_absorb PatchReport ({state}): {self.transformer_class} on {device}, {self.dtype}",
                 f"  blocks patched {s['blocks_patched']}/{s['blocks']}", "  " + _sites_line(s, device, kernel_why)]
        if self.tuning:
            lines.append(f"  tuning (not the default): {self.tuning}")
        if s["modelopt_linears"]:  # the linears inside the blocks (a whole-model count also has those outside)
            n = s["fp8_gemm_linears"]
            lora = f", {s['fp8_gemm_lora_linears']} with LoRA branches" if s["fp8_gemm_lora_linears"] else ""
            fast = " with fast accumulation" if n and any(b.fast_accum for b in blocks if b.patched) else ""
            where = ""
            if n and not device.startswith("cuda"):
                where = (f"; on {device} they run torch._scaled_mm's {device} implementation (fp8_gemm=True with "
                         f"capabilities={{'{device}'}}): a test of the logic, not a speed path")
            lines.append(f"  real FP8 GEMMs: {n} of {s['modelopt_linears']} ModelOpt linears in the blocks{lora}"
                         f"{fast} (fp8_gemm={self.fp8_gemm!r}); sites emitting their FP8 codes: "
                         f"{s['fp8_emitting_sites']}{where}")
        if s["fp8_forward_linears"] and s["hooked_attention_fp8_blocks"]:  # standby forwards: said only when used
            lines.append(f"  hooked attention (run as its module, e.g. by a diffusers cache): "
                         f"{s['fp8_forward_linears']} attention linears run real FP8 in their forward slots there; "
                         f"attention hooked now in {s['hooked_attention_fp8_blocks']} blocks")
        for name, key in (("TaylorSeer", "taylorseer_attention_blocks"), ("PyramidAttentionBroadcast",
                                                                           "pab_attention_blocks")):
            if s[key]:
                lines.append(f"  diffusers' {name} cache run inside {s[key]} blocks, around their own attention "
                             "(qwen_absorb.attention.run; graph mode replays its steps)")
        if s["quantized_projections"]:
            fmt = ", ".join(f"{k} x{v}" for k, v in sorted(s["quantized_projections"].items()))
            lines.append(f"  ModelOpt output projections: {fmt} ({s['compressed_projections']} compressed); "
                         f"quantized block norms: {s['quantized_norms']}")
        # deferral applies to ModelOpt-quantized projections (or defer_bias=True): a bf16 model gets no section
        deferral_applies = s["biases_deferrable_sites"] and (
            s["biases_deferred"] or self.defer_bias is True or s["quantized_projections"])
        if deferral_applies:
            lines.append(f"  biases deferred into the op that follows their projection: {s['biases_deferred']}/"
                         f"{s['biases_deferrable_sites']} (defer_bias={self.defer_bias!r})")
        lines += _grouped("  blocks not patched", "block", [(b.reasons, b.index) for b in blocks if b.reasons], plain)
        lines += _grouped("  sites not fused (run as diffusers' ops)", "site",
                          [(x.reasons, x.block) for b in blocks for x in b.sites if x.reasons], plain)
        lines += _grouped(
            "  ModelOpt linears not run as real FP8 GEMMs", "linear",
            [(lp.fp8_reasons, b.index) for b in blocks for lp in b.linears.values()
             if not lp.fp8_gemm and lp.fp8_reasons and lp.fp8_reasons[0] not in _NOT_MODELOPT], plain, limit=8)
        if deferral_applies:
            lines += _grouped("  biases kept in the GEMM", "site",
                              [(x.defer_reasons, x.block) for b in blocks for x in b.sites
                               if x.projection and not x.bias_deferred], plain)
        g = self.cuda_graph
        if g is not None and g.get("decided") is False:
            lines.append(f"  CUDA graphs (cuda_graph={self.cuda_graph_mode!r}): decided at the first call on a GPU")
        elif g is not None:
            per = g.get("mode") == "per block"  # Qwen-Image-2.1: one runner per block, counts in block calls
            where = f" over {g.get('blocks', 0)} blocks" if per else ""
            lines.append(f"  CUDA graphs{' per block' if per else ''} (cuda_graph={self.cuda_graph_mode!r}): "
                         f"{g.get('graphs', 0)} kept{where}, {g.get('captures', 0)} captured, "
                         f"{g.get('replays', 0)} replays, {g.get('eager_calls', 0)} {'block ' if per else ''}"
                         f"call{'' if g.get('eager_calls', 0) == 1 else 's'} eager")
            fbc = g.get("first_block_cache")
            if fbc and fbc.get("installed"):
                lines.append(f"    FirstBlockCache: graphs per block: {fbc['graphs']} kept over {fbc['blocks']} "
                             f"blocks, {fbc['captures']} captured, {fbc['replays']} block replays, "
                             f"{fbc['eager_calls']} block calls eager")
            if self.graph_fallbacks:
                lines.append("    eager because: " + counts(self.graph_fallbacks, 4))
        elif self.cuda_graph_refused:
            lines.append(f"  CUDA graphs: off ({self.cuda_graph_refused})")
        elif self.cuda_graph_mode == "auto":
            lines.append("  CUDA graphs: off (cuda_graph='auto' leaves Qwen-Image-2.1 blocks eager, measured no "
                         "slower; cuda_graph=True graphs them)")
        if self.rebuilds:
            lines.append("  decided anew (block calls): " + counts(self.rebuilds))
        if self.runtime_fallbacks:
            lines.append("  runtime fallbacks (block calls):")
            lines += [f"    {n:>6}  {plain(r)}" for r, n in self.runtime_fallbacks.most_common()]
        lines += [f"  {part.line()}" for part in self.parts.values()]
        return "\n".join(lines)

    __repr__ = __str__


def _sites_line(s: dict[str, Any], device: str, kernel_why: str) -> str:
    """What the sites ran on, counts adding up to all sites: the word "fused" only where kernels ran."""
    total, kernels, refs = s["sites"], s["sites_on_kernels"], s["sites_on_references"]
    why = f" (no CUDA kernels on {device}: {kernel_why})" if kernel_why else ""
    parts = [f"{n} {what}" for n, what in ((kernels, "on fused CUDA kernels"), (refs, "on torch references" + why),
                                          (total - kernels - refs, "as diffusers' ops (below)")) if n]
    if len(parts) == 1:
        return f"{total} sites {parts[0].split(' ', 1)[1]}"
    return f"{total} sites: " + ", ".join(parts)


def _plain(reason: str, device: str, why: str) -> str:
    """A reason as the report says it: the kernels' unavailability (``why``) is said once, on the sites line;
    reasons repeating it point there instead."""
    if not why:
        return reason
    short = f"no CUDA kernels on {device}"
    if reason == "fused ops ran their torch references: " + why:
        return f"ran the torch references ({short})"
    if reason == f"tensors are on {device}; real FP8 GEMMs need CUDA":
        # what examples/quantize_fp8.py forces on a CPU, said here so the two read alike
        return reason + f" (fp8_gemm=True with capabilities={{'{device}'}} runs them here, for tests)"
    return (reason.replace("fused CUDA path unavailable: " + why, short)
            .replace("its bias is fused in the GEMM", "its bias is added by the GEMM"))


def _grouped(title: str, noun: str, items: list[tuple[list[str], int]], plain: Callable[[str], str],
             limit: int = 0) -> list[str]:
    """One line per distinct set of reasons (as ``plain`` says each), with how many items share it (counts add
    up) and their blocks."""
    if not items:
        return []
    by: dict[str, list[int]] = {}
    for reasons, block in items:
        by.setdefault("; ".join(map(plain, reasons)), []).append(block)
    rows = sorted(by.items(), key=lambda kv: -len(kv[1]))
    out = [f"{title}:"]
    out += [f"    {reason}  [{len(b)} {noun}{'s' if len(b) != 1 else ''}, blocks {_ranges(sorted(set(b)))}]"
            for reason, b in rows[:limit or None]]
    if limit and len(rows) > limit:
        rest = sum(len(b) for _, b in rows[limit:])
        out.append(f"    ... {len(rows) - limit} more reasons for {rest} {noun}s (report.to_dict() has all)")
    return out


def _ranges(ix: list[int]) -> str:
    """``0-3,7``: sorted indices as runs."""
    runs = [[i for _, i in g] for _, g in itertools.groupby(enumerate(sorted(ix)), lambda t: t[1] - t[0])]
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
