"""Both block families as rows (:data:`QWENIMAGE`, :data:`QWENIMAGE21`): their sites and linears. The only module that
names diffusers' Qwen-Image classes and looks through PEFT wrappers. Paths (``"attn.to_out.0"``) are resolved at call
time (:func:`resolve`): a copied block or a replaced linear is never confused with the old one."""

import functools
from dataclasses import dataclass

from torch import nn

from .hooks import hooked

STREAMS = ("img", "txt")
SITES = ("norm1", "attn_residual", "ffn_residual")


@dataclass(frozen=True)
class Site:
    stream: str
    name: str
    op: str  # the fused op of qwen_absorb.ops that runs it
    norm: str | None  # the block LayerNorm it replaces
    takes_bias_of: str | None  # the projection whose bias it can consume (deferral)
    feeds: tuple[str, ...]  # the linears whose input it produces (FP8 emission)
    with_residual: str | None = None  # the op running it with the residual before it (hand-off); None: ``op``

    @property
    def key(self) -> str:
        return f"{self.stream}.{self.name}"


@dataclass(frozen=True)
class Linear:
    """One linear of the block and where its input comes from."""

    path: str
    stream: str
    input_from: str  # a site key, "attention" (the attention output), "gelu" (GELU of net[0]) or "temb" (SiLU of temb)


def _stream_sites(s: str, qkv: tuple[str, ...], out: str, mlp: str) -> tuple[Site, ...]:
    return (Site(s, "norm1", "layer_norm_scale_shift", f"{s}_norm1", None, qkv, "bias_residual_layer_norm_scale_shift"),
            Site(s, "attn_residual", "bias_residual_layer_norm_scale_shift", f"{s}_norm2", out, (f"{mlp}.net.0.proj",)),
            Site(s, "ffn_residual", "bias_gate_residual", None, f"{mlp}.net.2", ()))


IMG_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
TXT_QKV = ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")

SITE_TABLE: dict[str, Site] = {s.key: s for s in (*_stream_sites("img", IMG_QKV, "attn.to_out.0", "img_mlp"),
                                                  *_stream_sites("txt", TXT_QKV, "attn.to_add_out", "txt_mlp"))}

LINEAR_TABLE: dict[str, Linear] = {lin.path: lin for lin in (
    *(Linear(p, "img", "img.norm1") for p in IMG_QKV), *(Linear(p, "txt", "txt.norm1") for p in TXT_QKV),
    Linear("attn.to_out.0", "img", "attention"), Linear("attn.to_add_out", "txt", "attention"),
    *(Linear(f"{s}_mlp.net.0.proj", s, f"{s}.attn_residual") for s in STREAMS),
    *(Linear(f"{s}_mlp.net.2", s, "gelu") for s in STREAMS), *(Linear(f"{s}_mod.1", s, "temb") for s in STREAMS))}

NORMS = tuple(s.norm for s in SITE_TABLE.values() if s.norm)
# The attention linears, called by diffusers' processor when the attention runs as its module (gated forwards).
ATTN_LINEARS = tuple(p for p in LINEAR_TABLE if p.startswith("attn."))

# Qwen-Image-2.1: one stream; norm2's op is the attention residual and img_norm2 together, swiglu img_mlp's forward
_AB21 = ("img_mlp.gate_layer", "img_mlp.proj")
SITE21_TABLE: dict[str, Site] = {s.key: s for s in (
    Site("img", "norm1", "layer_norm_scale", "img_norm1", None, IMG_QKV),
    Site("img", "attn_residual", "tanh_gate_residual", None, None, ()),
    Site("img", "norm2", "tanh_gate_residual_layer_norm_scale", "img_norm2", None, _AB21),
    Site("img", "swiglu", "swiglu", None, None, ("img_mlp.out",)),
    Site("img", "ffn_residual", "tanh_gate_residual", None, None, ()))}
LINEAR21_TABLE: dict[str, Linear] = {lin.path: lin for lin in (
    *(Linear(p, "img", "img.norm1") for p in IMG_QKV), Linear("attn.to_out.0", "img", "attention"),
    *(Linear(p, "img", "img.norm2") for p in _AB21), Linear("img_mlp.out", "img", "img.swiglu"))}


@dataclass(frozen=True)
class Family:
    """One block family: its block class (by name), its sites and its linears."""

    name: str
    block_class: str
    sites: dict[str, Site]
    linears: dict[str, Linear]

    @property
    def norms(self) -> tuple[str, ...]:
        return tuple(s.norm for s in self.sites.values() if s.norm)


QWENIMAGE = Family("Qwen-Image", "QwenImageTransformerBlock", SITE_TABLE, LINEAR_TABLE)
QWENIMAGE21 = Family("Qwen-Image-2.1", "QwenImage21TransformerBlock", SITE21_TABLE, LINEAR21_TABLE)
FAMILIES = (QWENIMAGE, QWENIMAGE21)


def family_of(block: nn.Module) -> Family | None:
    """The family whose block class ``block`` is (or derives from), by name; None: neither."""
    names = {c.__name__ for c in type(block).__mro__}
    return next((f for f in FAMILIES if f.block_class in names), None)


# diffusers' modules are imported once, lazily (a slow import); Qwen-Image-2.1's may be missing (None).
@functools.lru_cache(maxsize=1)
def classes() -> tuple[type, type, type]:
    """diffusers' Qwen-Image model, block and processor classes."""
    from diffusers.models.transformers import transformer_qwenimage as m  # noqa: PLC0415

    return m.QwenImageTransformer2DModel, m.QwenImageTransformerBlock, m.QwenDoubleStreamAttnProcessor2_0


@functools.lru_cache(maxsize=1)
def classes21() -> tuple[type, type] | None:
    """diffusers' ``(QwenImage21Transformer2DModel, QwenImage21TransformerBlock)``."""
    try:
        from diffusers.models.transformers import transformer_qwenimage21 as m  # noqa: PLC0415
        return m.QwenImage21Transformer2DModel, m.QwenImage21TransformerBlock
    except (ImportError, AttributeError):  # this diffusers has no Qwen-Image-2.1
        return None


def model_classes() -> tuple[type, ...]:
    """Every transformer class :func:`qwen_absorb.patch` patches."""
    c21 = classes21()
    return (classes()[0],) + ((c21[0],) if c21 is not None else ())


@functools.lru_cache(maxsize=1)
def attention21_functions() -> tuple | None:
    """What Qwen-Image-2.1's processor uses (dispatch, rope, attention and processor classes, RMSNorm)."""
    try:
        from diffusers.models.normalization import RMSNorm  # noqa: PLC0415
        from diffusers.models.transformers import transformer_qwenimage21 as m  # noqa: PLC0415
    except ImportError:
        return None
    return m.dispatch_attention_fn, m.apply_rotary_emb_qwen, m.QwenImage21Attention, m.QwenImage21AttnProcessor, RMSNorm


@functools.lru_cache(maxsize=1)
def attention_functions() -> tuple:
    """diffusers' ``(dispatch_attention_fn, apply_rotary_emb_qwen)`` the joint attention calls."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn  # noqa: PLC0415
    from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen  # noqa: PLC0415

    return dispatch_attention_fn, apply_rotary_emb_qwen


def unwrap_peft(module: nn.Module | None) -> tuple[nn.Module | None, list[nn.Module]]:
    """``(innermost base layer, [wrappers outermost first])`` through PEFT's (possibly nested) ``.base_layer``."""
    wrappers = []
    while module is not None:
        # from _modules: getattr's miss on a ModelOpt module goes through its Python __getattr__ (slow)
        inner = module.__dict__.get("_modules", {}).get("base_layer")
        if not isinstance(inner, nn.Module):
            break
        wrappers.append(module)
        module = inner
    return module, wrappers


def containers(path: str) -> tuple[str, ...]:
    """The containers a block skips around a linear it computes itself (their hooks would not run)."""
    top = path.split(".")[0]
    return ((top, f"{top}.0") if top.endswith("_mod") else
            (top, f"{top}.net.0", f"{top}.net.1") if top.endswith("_mlp") else ())


def resolve(block: nn.Module, path: str) -> nn.Module | None:
    """The module at ``path`` under ``block`` now (None if absent): ``_modules`` walked directly, cheap per call."""
    m: nn.Module | None = block
    for part in path.split("."):
        mods = m.__dict__.get("_modules") if m is not None else None
        if mods is None or (m := mods.get(part)) is None:
            return None
    return m


def swiglu21_refusals(block: nn.Module) -> list[str]:
    """Why ``block.img_mlp`` is not diffusers' SwiGLU feed-forward the fused op reproduces (hooks: per call)."""
    mlp, name = block._modules.get("img_mlp"), "QwenImage21SwiGLUFeedForward"
    if (own := next((c.forward for c in type(mlp).__mro__ if c.__name__ == name), None)) is None:
        return [f"img_mlp is a {type(mlp).__name__}, not diffusers' {name}"]
    if type(mlp).forward is not own:
        return ["img_mlp's class overrides forward"]
    if hooked(mlp):
        return ["img_mlp has a hook or a wrapped forward (the fused path calls its linears directly)"]
    act = mlp._modules.get("activation_fn")
    if type(act) is not nn.SiLU or hooked(act):
        return [f"img_mlp.activation_fn is a {type(act).__name__}, not an unhooked nn.SiLU"]
    return [f"img_mlp.{n}: missing" for n in ("gate_layer", "proj", "out")
            if not isinstance(mlp._modules.get(n), nn.Module)]
