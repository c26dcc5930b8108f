"""taylor_seer: one step of diffusers' TaylorSeer cache on factors held in place (graph-replayable).

diffusers' ``TaylorSeerState.update`` (divided differences over ``delta_step``) and ``predict`` (``sum factor_k *
offset^k / k!``) take host scalars, which a CUDA graph cannot replay. These kernels do the same arithmetic with
diffusers' rounding points, in place on caller-owned factors, coefficients read from device memory: :func:`update_`
(``coef[0] = 1 / delta_step`` in fp32, as PyTorch's CUDA division by a host scalar uses it) and :func:`predict`
(``sum_k D(D(f_k) * c_k)`` from zero in the output dtype ``D``, ``c_0 = 1``, ``c_k = coef[k - 1]``). The references,
diffusers' expressions op for op, run wherever the kernels cannot."""

import math

import torch

from . import _runtime as rt
from ._eligibility import kernel_runtime_reasons

MAX_ORDER = 4  # differences a factor set may hold (QA_TS_MAX_ORDERS - 1 in the .cu)
_THREADS = 256
_LAYOUT = "8Pq"  # x, out, f[5], coef; n
_cache: dict[tuple, rt.Launcher] = rt.register_cache({})


def update_coefficients(delta_step: int) -> list[float]:
    """``coef`` of :func:`update_`: the reciprocal PyTorch multiplies by (computed in double, stored fp32)."""
    return [1.0 / delta_step]


def predict_coefficients(offset: int, orders: int) -> list[float]:
    """``coef`` of :func:`predict`: ``offset^k / k!`` for k = 1 .. orders - 1, as diffusers computes them."""
    return [(offset ** k) / math.factorial(k) for k in range(1, orders)]


def update_reference_(x: torch.Tensor, factors: list[torch.Tensor], nprev: int, delta_step: int) -> None:
    """diffusers' update, op for op, written into ``factors[0..nprev]``."""
    new = [x]
    for j in range(nprev):
        new.append((new[j] - factors[j].to(x.dtype)) / delta_step)
    for k, v in enumerate(new):
        factors[k].copy_(v.to(factors[k].dtype))


def predict_reference(factors: list[torch.Tensor], orders: int, offset: int, dtype: torch.dtype) -> torch.Tensor:
    """diffusers' prediction, op for op."""
    out = torch.zeros_like(factors[0], dtype=dtype)
    for k in range(orders):
        out = out + factors[k].to(dtype) * ((offset ** k) / math.factorial(k))
    return out


def reasons(x: torch.Tensor, factors: list[torch.Tensor]) -> list[str]:
    """Why the kernels cannot run on these tensors (empty: they can)."""
    r = []
    if x.dtype not in rt.TRAITS or any(f.dtype not in rt.TRAITS for f in factors):
        r.append("a dtype other than bf16 / fp16 / fp32")
    if len(factors) > MAX_ORDER + 1:
        r.append(f"more than {MAX_ORDER} Taylor orders")
    if any(f.shape != x.shape or not f.is_contiguous() or f.device != x.device for f in factors):
        r.append("factors not contiguous with the features' shape and device")
    return r or kernel_runtime_reasons(x.device)


def _launcher(kind: str, d: torch.dtype, f: torch.dtype, n: int, device: torch.device) -> rt.Launcher:
    idx = rt.device_index(device)
    key = (kind, d, f, n, idx)
    return _cache.get(key) or rt.launcher(_cache, key, "taylor_seer.cu",
                                          f"taylor_seer_{kind}_kernel<{rt.TRAITS[d]}, {rt.TRAITS[f]}, {n}>", idx,
                                          _THREADS, _LAYOUT)


def _grid(n: int) -> int:
    return max(1, min(-(-n // _THREADS), 1 << 16))


def _pointers(factors: list[torch.Tensor]) -> list[int]:
    ps = [f.data_ptr() for f in factors]
    return ps + [0] * (MAX_ORDER + 1 - len(ps))


def update_(x: torch.Tensor, factors: list[torch.Tensor], nprev: int, coef: torch.Tensor) -> None:
    """Kernel: ``factors[0..nprev]`` updated in place (``len(factors) >= nprev + 1``; x contiguous; ``coef``
    fp32 on x's device, ``coef[0] = 1 / delta_step``). Callers check :func:`reasons` first."""
    n = x.numel()
    _launcher("update", x.dtype, factors[0].dtype, nprev, x.device)(_grid(n), x.data_ptr(), 0, *_pointers(factors),
                                                                    coef.data_ptr(), n)


def predict(factors: list[torch.Tensor], orders: int, coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Kernel: the prediction from ``factors[:orders]`` as a new ``dtype`` tensor (``coef[k - 1] = c_k``)."""
    f0 = factors[0]
    out = torch.empty(f0.shape, dtype=dtype, device=f0.device)
    n = f0.numel()
    _launcher("predict", dtype, f0.dtype, orders, f0.device)(_grid(n), 0, out.data_ptr(), *_pointers(factors[:orders]),
                                                             coef.data_ptr(), n)
    return out


def all_kernel_expressions() -> list[tuple[str, str]]:
    counts = (("update", range(MAX_ORDER + 1)), ("predict", range(1, MAX_ORDER + 2)))
    return [("taylor_seer.cu", f"taylor_seer_{kind}_kernel<{d}, {f}, {n}>") for d in rt.TRAITS.values()
            for f in rt.TRAITS.values() for kind, ns in counts for n in ns]
