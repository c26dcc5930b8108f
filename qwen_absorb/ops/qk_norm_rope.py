"""qk_norm_rope: the q/k RMSNorm + RoPE of Qwen-Image's joint attention, one kernel.

Each of img/txt query/key ([B, L, H, DH], any view with unit stride inside a head) goes through diffusers'
``RMSNorm(DH, eps=1e-6)``, then ``apply_rotary_emb_qwen(x, freqs, use_real=False)``, into a new contiguous tensor in
the weight's dtype; one launch does up to four tensors.

Exactness (csrc/qk_norm_rope.cu): everything after the variance is reproduced op for op. The fp32 variance of 128
squares rounds by the order PyTorch's reduction adds them in, which differs between versions: the kernel implements
the candidate orders and :func:`probe_variance_order` finds, once per device, the one in use (none: the reference
runs, with a reason). The kernel needs DH == 128, complex64 freqs, weight.dtype == x.dtype and ``min_rows`` rows.
Two forms give the same bits: a row per warp, 4 elements per lane (every order), and the wide form, a row per
half-warp, 8 elements per lane with 16-byte loads (``WIDE_ORDERS``)."""

import logging
from collections.abc import Sequence
from functools import reduce
from operator import add
from typing import NamedTuple

import torch

from . import _runtime as rt
from ._eligibility import common_reasons, dispatch, kernel_usable_now
from ._validate import check_device, check_dtype, check_eps, check_tensor

log = logging.getLogger("qwen_absorb")
CU = "qk_norm_rope.cu"
WARPS = 4  # QA_QKR_WARPS: warps per block
ROWS_PER_WARP = 4  # the kernel's RPW: consecutive rows a warp loads before reducing the first
WIDE_ORDERS = (0, 10)  # the orders the wide form implements (groups of 4 elements)
MAX_JOBS = 4  # QA_QKR_MAX_JOBS
HEAD_DIM = 128  # the kernel's row width (32 lanes x 4 elements)
_FLT_MAX = torch.finfo(torch.float32).max
# QkNormRopeJob in the .cu: x, weight, freqs, out (pointers); stride_b, stride_l, stride_h, freqs_stride (int64);
# L, H, rows, block_start (int32), eps (float), vec_flags (int32). QkNormRopeParams: MAX_JOBS jobs, then njobs.
JOB_LAYOUT = "4P4q4ifi"
LAYOUT = JOB_LAYOUT * MAX_JOBS + "i"
_fns: dict[tuple, object] = rt.register_cache({})

# The kernel's ORDER: per-lane grouping (ORDER % 10; each lane sums its groups in sequence) and lane tree (shfl_down
# at offsets 1, 2, 4, ... for ORDER < 10, PyTorch's Reduce.cuh before 2.10; ..., 4, 2, 1 for ORDER >= 10).
_GROUPINGS = {0: "vectorized by 4, 32 lanes", 1: "not vectorized, 32 lanes, stride 32", 2: "vectorized by 8, 16 lanes",
              3: "vectorized by 2, 32 lanes, two steps", 4: "vectorized by 16, 8 lanes"}
ORDERS = {**{g: f"{d}, lane offsets increasing" for g, d in _GROUPINGS.items()},
          **{10 + g: f"{d}, lane offsets decreasing" for g, d in _GROUPINGS.items()}}
_PROBE_ROWS = (1, 2, 3, 5, 8, 16, 24, 64, 4096)
_orders: "dict[int, VarianceOrder]" = rt.register_cache({})


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """diffusers' ``RMSNorm.forward`` (0.42.1, the non-NPU branch, elementwise_affine, no bias), op for op."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = x * torch.rsqrt(variance + eps)
    if weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(weight.dtype)
    return hidden_states * weight


def rope_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb_qwen(x, freqs, use_real=False)``, op for op."""
    x_rotated = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    x_out = torch.view_as_real(x_rotated * freqs.unsqueeze(1)).flatten(3)
    return x_out.type_as(x)


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor,
                           eps: float = 1e-6) -> torch.Tensor:
    """``apply_rotary_emb_qwen(RMSNorm(x), freqs, use_real=False)``: the diffusers eager chain."""
    return rope_reference(rms_norm_reference(x, weight, eps), freqs)


def _lane_groups(grouping: int) -> tuple[int, list[list[list[int]]]]:
    """(lanes, per lane its accumulators' element indices) of a grouping (ORDER % 10)."""
    if grouping == 1:
        return 32, [[[u + 32 * i] for i in range(4)] for u in range(32)]
    if grouping == 3:
        return 32, [[[2 * u + i, 2 * u + 64 + i] for i in range(2)] for u in range(32)]
    v = {0: 4, 2: 8, 4: 16}[grouping]  # v consecutive elements per lane
    return 128 // v, [[[v * u + i] for i in range(v)] for u in range(128 // v)]


def variance_in_order(x: torch.Tensor, order: int) -> torch.Tensor:
    """``x.float().pow(2).mean(-1)`` summed in the kernel's ``order`` ([..., 128] -> [...]), bit for bit."""
    lanes, groups = _lane_groups(order % 10)
    xf = x.float()
    sq = xf * xf  # torch's pow(x, 2) is x * x
    # each lane: its groups' sums, left to right, each group's elements left to right
    p = torch.stack([reduce(add, [reduce(add, [sq[..., i] for i in g]) for g in groups[u]]) for u in range(lanes)], -1)
    while p.shape[-1] > 1:
        if order >= 10:  # shfl_down at offsets n/2, ..., 1: lane i adds lane i + n/2
            half = p.shape[-1] // 2
            p = p[..., :half] + p[..., half:]
        else:  # offsets 1, 2, ...: lane 2i adds lane 2i + 1
            p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0] * (1.0 / 128)


class VarianceOrder(NamedTuple):
    """What :func:`probe_variance_order` found on one device."""

    order: int | None  # the kernel ORDER equal to PyTorch's on every probed batch (None: none)
    min_rows: int  # the smallest probed row count from which on that holds
    detail: str  # which candidates matched, for the reasons and the logs


def probe_variance_order(device: torch.device | int) -> VarianceOrder:
    """Which kernel order PyTorch's ``x.float().pow(2).mean(-1)`` uses on this device, probed once (cached) on
    random rows at several row counts. Not inside a CUDA-graph capture (it syncs)."""
    idx = device if isinstance(device, int) else rt.device_index(device)
    hit = _orders.get(idx)
    if hit is not None:
        return hit
    if torch.cuda.is_current_stream_capturing():
        return VarianceOrder(None, 0, "not probed yet, and a CUDA graph is being captured")
    gen = torch.Generator(device=f"cuda:{idx}").manual_seed(1234)
    dev = torch.device("cuda", idx)
    ok: dict[int, list[bool]] = {o: [] for o in ORDERS}
    with torch.no_grad():
        for n in _PROBE_ROWS:
            # fp32 values of wide range: every candidate order rounds differently (bf16 squares would often not)
            x = torch.randn(n, HEAD_DIM, generator=gen, device=dev) * torch.exp(
                torch.randn(n, HEAD_DIM, generator=gen, device=dev) * 2)
            want = x.to(torch.float32).pow(2).mean(-1)  # diffusers' RMSNorm, as it runs
            for o in ORDERS:
                ok[o].append(bool(torch.equal(variance_in_order(x, o).view(torch.int32), want.view(torch.int32))))
    big = [i for i, n in enumerate(_PROBE_ROWS) if n >= 16]
    hits = [o for o, v in ok.items() if all(v[i] for i in big)]
    counts = "; ".join(f"order {o}: {sum(v)}/{len(v)} batches" for o, v in ok.items())
    if len(hits) != 1:
        result = VarianceOrder(None, 0, ("no candidate order matches PyTorch's" if not hits
                                         else f"orders {hits} all match: the probe cannot tell") + f" ({counts})")
    else:
        o, v = hits[0], ok[hits[0]]
        first = max((i + 1 for i, hit in enumerate(v) if not hit), default=0)  # after the last batch it missed
        result = VarianceOrder(o, _PROBE_ROWS[first], f"order {o} ({ORDERS[o]}) from {_PROBE_ROWS[first]} rows on")
    log.debug("qk_norm_rope variance order on cuda:%d: %s", idx, result.detail)
    _orders[idx] = result
    return result


def order_reasons(device: torch.device, rows: int) -> list[str]:
    """Why the kernel cannot reproduce PyTorch's variance for ``rows`` rows on ``device``."""
    vo = probe_variance_order(device)
    if vo.order is None:
        return [f"PyTorch's fp32 reduction order on this device is not one the kernel implements: {vo.detail}"]
    if rows < vo.min_rows:
        return [f"{rows} rows < {vo.min_rows}: PyTorch's reduction layout for so few rows is not the kernel's"]
    return []


def launch(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], freqs: Sequence[torch.Tensor],
    eps: Sequence[float], into: Sequence[torch.Tensor] | None = None, wide: bool = True) -> list[torch.Tensor]:
    """Checked-once entry: ``out[i] = qk_norm_rope(xs[i], weights[i], freqs[i], eps[i])`` for up to four tensors
    in ONE launch, into new tensors or ``into`` (contiguous views, e.g. the text and image rows of one joint tensor).
    The caller guarantees what :func:`qk_norm_rope_multi` checks and finds no reason against."""
    n = len(xs)
    if n > MAX_JOBS:
        raise ValueError(f"qk_norm_rope.launch takes at most {MAX_JOBS} tensors, got {n}")
    x0, rpw = xs[0], ROWS_PER_WARP
    dev = x0.get_device()
    key = (x0.dtype, dev, rpw, wide)
    entry = _fns.get(key)
    if entry is None:
        order = probe_variance_order(dev).order  # cached: the caller's checks probed it
        if order is None:
            raise RuntimeError("qk_norm_rope.launch: PyTorch's variance order on this device is not the kernel's")
        form = wide and order in WIDE_ORDERS and rpw % 2 == 0
        fn = rt.function(CU, _expression(rt.TRAITS[x0.dtype], order, rpw, form), dev)
        entry = _fns[key] = (rt.Launcher(fn, WARPS * 32, LAYOUT, dev), 8 if form else 4)
    (launcher, per_lane), esize = entry, x0.element_size()
    a = per_lane * esize  # one lane's elements: the vector loads' alignment
    vals, outs, blocks = [], [], 0
    for i, (x, w, f) in enumerate(zip(xs, weights, freqs, strict=True)):
        if (type(x) is not torch.Tensor or type(w) not in (torch.Tensor, torch.nn.Parameter)
                or type(f) is not torch.Tensor):  # a DTensor / AsyncCollectiveTensor: its data_ptr is not the data
            raise TypeError("qwen_absorb kernels take plain tensors; got "
                            + ", ".join(type(t).__name__ for t in (x, w, f)))
        B, L, H, _ = x.shape
        out = torch.empty((B, L, H, HEAD_DIM), dtype=x.dtype, device=x.device) if into is None else into[i]
        outs.append(out)
        rows = B * L * H
        sb, sl, sh, _ = x.stride()
        xp, wp, fp, fs = x.data_ptr(), w.data_ptr(), f.data_ptr(), 2 * f.stride(0)
        flags = (((xp | sb * esize | sl * esize | sh * esize) % a == 0)
                 | ((wp % a == 0) << 1) | (((fp | fs * 4) % 16 == 0) << 2))
        vals += (xp, wp, fp, out.data_ptr(), sb, sl, sh, fs, L, H, rows, blocks, eps[i], flags)
        blocks += (rows + WARPS * rpw - 1) // (WARPS * rpw)
    vals += ((0,) * 11 + (blocks, 0.0, 0)) * (MAX_JOBS - n)  # unused jobs: no pointers, no rows, block_start last
    if blocks:
        launcher(blocks, *vals, n)
    return outs


def _expression(traits: str, order: int, rpw: int, wide: bool) -> str:
    return f"qk_norm_rope_{'wide_' if wide else ''}kernel<{traits}, {order}, {rpw}>"


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(CU, _expression(t, o, ROWS_PER_WARP, w)) for w, orders in ((False, ORDERS), (True, WIDE_ORDERS))
            for t in rt.TRAITS.values() for o in orders]


def _validate(x, weight, freqs, eps, i: int | None = None) -> float:
    name, wn, fn = ("x", "weight", "freqs") if i is None else (f"xs[{i}]", f"weights[{i}]", f"freqs[{i}]")
    check_tensor(name, x, ": the op is token-local")
    if x.dim() != 4:
        raise ValueError(f"{name} must have shape [B, L, H, DH], got {tuple(x.shape)}")
    check_dtype(name, x)
    DH = x.shape[3]
    if DH < 2 or DH % 2:
        raise ValueError(f"{name} needs an even head dim DH >= 2 (RoPE pairs), got {tuple(x.shape)}")
    check_tensor(wn, weight)
    check_dtype(wn, weight)
    if tuple(weight.shape) != (DH,):
        raise ValueError(f"{wn} must have shape [DH] = [{DH}], got {tuple(weight.shape)}")
    check_device(wn, weight, x, name)
    check_tensor(fn, freqs)
    if not freqs.is_complex():
        raise TypeError(f"{fn} must be a complex tensor (torch.polar(...), as diffusers' QwenEmbedRope makes it), "
                        f"got dtype {freqs.dtype}")
    if tuple(freqs.shape) != (x.shape[1], DH // 2):
        raise ValueError(f"{fn} must have shape [L, DH/2] = [{x.shape[1]}, {DH // 2}], got {tuple(freqs.shape)}")
    check_device(fn, freqs, x, name)
    return check_eps(eps)


def _kernel_reasons(x, weight, freqs, eps, force_reference: bool) -> list[str]:
    """Why the kernel would not run for one (validated) tensor."""
    r = common_reasons([x, weight, freqs], force_reference) + _input_reasons(x, weight, freqs, eps)
    if not r and not torch.compiler.is_compiling():
        r = order_reasons(x.device, x.numel() // HEAD_DIM)
    return r


def _input_reasons(x, weight, freqs, eps) -> list[str]:
    reasons = []
    if x.shape[3] != HEAD_DIM:
        reasons.append(f"head dim {x.shape[3]} != {HEAD_DIM} (the kernel's row width)")
    if weight.dtype != x.dtype:
        reasons.append(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if freqs.dtype != torch.complex64:
        reasons.append(f"freqs dtype {freqs.dtype} (the kernel reads complex64)")
    if x.numel() and x.stride(3) != 1:
        reasons.append(f"x must have unit stride inside a head, got strides {x.stride()}")
    if weight.stride(0) != 1:
        reasons.append(f"weight must be contiguous, got stride {weight.stride()}")
    if freqs.numel() and freqs.stride(1) != 1:
        reasons.append(f"freqs must have unit stride in its last dimension, got strides {freqs.stride()}")
    if not (float(eps) <= _FLT_MAX):
        reasons.append(f"eps = {eps} is not representable in fp32")
    return reasons


def qk_norm_rope_not_supported_reasons(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, *,
                                       eps: float = 1e-6, force_reference: bool = False) -> list[str]:
    """Why the CUDA kernel would not run for these inputs (empty list: it runs)."""
    _validate(x, weight, freqs, eps)
    return _kernel_reasons(x, weight, freqs, eps, force_reference)


def _reference_multi(xs, weights, freqs, eps_l) -> list[torch.Tensor]:
    return [qk_norm_rope_reference(x, w, f, e) for x, w, f, e in zip(xs, weights, freqs, eps_l)]


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, freqs: torch.Tensor, *, eps: float = 1e-6,
                 force_reference: bool = False) -> torch.Tensor:
    """``apply_rotary_emb_qwen(RMSNorm(x), freqs, use_real=False)``, fused on CUDA: x [B, L, H, DH], weight [DH],
    freqs complex [L, DH/2] (one of diffusers' QwenEmbedRope pair); a contiguous [B, L, H, DH] in weight's dtype."""
    eps = _validate(x, weight, freqs, eps)
    return dispatch(_kernel_reasons(x, weight, freqs, eps, force_reference),
                    lambda: qk_norm_rope_reference(x, weight, freqs, eps),
                    lambda: torch.ops.qwen_absorb.qk_norm_rope([x], [weight], [freqs], [eps])[0],
                    lambda: launch([x], [weight], [freqs], [eps])[0])


def qk_norm_rope_multi(
    xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], freqs: Sequence[torch.Tensor], *,
    eps: float | Sequence[float] = 1e-6, force_reference: bool = False) -> list[torch.Tensor]:
    """:func:`qk_norm_rope` of up to four tensors in one launch (``xs=[img_q, img_k, txt_q, txt_k]``,
    ``freqs=[img_f, img_f, txt_f, txt_f]``): the kernel only when every tensor qualifies, in one dtype."""
    for nm, seq in (("xs", xs), ("weights", weights), ("freqs", freqs)):
        if not isinstance(seq, (list, tuple)):
            raise TypeError(f"{nm} must be a list or tuple of tensors, got {type(seq).__name__}")
    n = len(xs)
    if not 1 <= n <= MAX_JOBS:
        raise ValueError(f"xs must hold 1 to {MAX_JOBS} tensors, got {n}")
    if len(weights) != n or len(freqs) != n:
        raise ValueError(f"xs, weights and freqs must have the same length, got {n}, {len(weights)}, {len(freqs)}")
    if isinstance(eps, (list, tuple)) and len(eps) != n:
        raise ValueError(f"eps must be one float or {n} floats, got {len(eps)}")
    eps_l = [float(check_eps(e)) for e in eps] if isinstance(eps, (list, tuple)) else [check_eps(eps)] * n
    for i in range(n):
        _validate(xs[i], weights[i], freqs[i], eps_l[i], i)
        check_device(f"xs[{i}]", xs[i], xs[0], "xs[0]")
    xs, weights, freqs = list(xs), list(weights), list(freqs)
    reasons = list(dict.fromkeys(r for i in range(len(xs))  # each reason once, in order
                                 for r in _kernel_reasons(xs[i], weights[i], freqs[i], eps_l[i], force_reference)))
    if any(x.dtype != xs[0].dtype for x in xs):
        reasons.append("one launch needs all tensors in one dtype")
    return dispatch(reasons, lambda: _reference_multi(xs, weights, freqs, eps_l),
                    lambda: list(torch.ops.qwen_absorb.qk_norm_rope(xs, weights, freqs, eps_l)),
                    lambda: launch(xs, weights, freqs, eps_l))


@torch.library.custom_op("qwen_absorb::qk_norm_rope", mutates_args=())
def _custom_op(xs: list[torch.Tensor], weights: list[torch.Tensor], freqs: list[torch.Tensor],
               eps: list[float]) -> list[torch.Tensor]:
    if kernel_usable_now(xs[0]) and not any(
            x.dtype != xs[0].dtype or _input_reasons(x, w, f, e) or order_reasons(x.device, x.numel() // HEAD_DIM)
            for x, w, f, e in zip(xs, weights, freqs, eps)):
        return launch(xs, weights, freqs, eps)
    return _reference_multi(xs, weights, freqs, eps)


# RMSNorm returns the weight's dtype whatever x's, and RoPE's type_as keeps it
_custom_op.register_fake(lambda xs, weights, freqs, eps: [x.new_empty(x.shape, dtype=w.dtype)
                                                          for x, w in zip(xs, weights)])
