"""lora_fold: :func:`.lora_add.add_gelu_fp8` (net[0]'s last LoRA branch + GELU(tanh) + e4m3 quantization) with
net[2]'s ``lora_A`` product folded in, one pass over net[0]'s output.

Without it, net[2]'s LoRA branch needs the GELU output ``g`` written and read back by a GEMM. Here the kernel
multiplies ``g`` by net[2]'s lora_A weight while it is in registers and returns ``t2 = g @ A2.T`` (rounded once;
PEFT's ``lora_A(g)`` summed in another order than cuBLAS's: it may differ in its last bit), the codes bit for bit
add_gelu_fp8's. Blocks walk row bands split into ``S`` column segments; a second kernel adds their fp32 sums."""

import torch

from . import _runtime as rt
from . import lora_add
from ._launch import amax_fp32

CU = "lora_gelu_fold.cu"
_THREADS = 512
_BM = _BN = 128
_PITCH = _BN + 32  # QA_LF_YP, QA_LF_AP
STAGES = 2  # QA_LF_STAGES
MAX_RANK = 64  # both ranks: the registers of 512 threads hold net[0]'s t fragments and net[2]'s partial sums
NTILES = (2, 4, 8)  # net[2]'s rank / 8 rounded up to one of these: the kernel's template instances
_LAYOUT = "PPPPPPPqqqiiiiiiif"  # y, t, b, a2, part, codes, amax; ts, bs, a2s; M, N, R, R2, tiles_n, per, S; alpha
_REDUCE_LAYOUT = "PPqi"
_REDUCE_THREADS = 256
MAX_SEGMENTS = 16
_cache: dict[tuple, rt.Launcher] = rt.register_cache({})
_limits: dict[int, tuple[int, int]] = {}


def _device_limits(device: torch.device) -> tuple[int, int]:
    """``(SMs, shared memory a block may opt in to)`` of ``device``, read once (no host cost per call)."""
    idx = rt.device_index(device)
    hit = _limits.get(idx)
    if hit is None:
        props = torch.cuda.get_device_properties(idx)
        hit = _limits[idx] = (props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", 48 << 10))
    return hit


def smem_bytes(ks: int, na: int) -> int:
    """Dynamic shared memory of a launch: STAGES x (y tile, lora_B's rows for its columns, A2's slice)."""
    return 2 * STAGES * (_BM * _PITCH + _BN * (16 * ks + 8) + 8 * na * _PITCH)


def _ntiles(r2: int) -> int:
    return next(n for n in NTILES if 8 * n >= r2)


def reasons(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, a2: torch.Tensor) -> list[str]:
    """Why the fold cannot compute ``add_gelu_fp8(y, t, b, ...)`` and ``g @ a2.T`` (empty: it can)."""
    r = lora_add.reasons(y, t, b) + lora_add.tile_reasons(y, t, b)  # net[0]'s branch as the tiled kernel adds it
    if r:
        return r
    if not y.is_contiguous():
        r.append("y not contiguous")
    if y.shape[1] % _BN or not y.shape[1]:
        r.append(f"width {y.shape[1]} not a positive multiple of {_BN}")
    if a2.dtype != y.dtype or a2.device != y.device or a2.dim() != 2 or a2.shape[1] != y.shape[1] \
            or a2.stride(1) != 1:
        r.append("net[2]'s lora_A weight is not a [R2, N] row-major tensor of y's dtype and device")
    elif a2.shape[0] % 8 or not 0 < a2.shape[0] <= MAX_RANK or not rt.aligned(a2, 16):
        r.append(f"net[2]'s rank {a2.shape[0]}: the fold takes multiples of 8 up to {MAX_RANK}, 16-byte aligned rows")
    if t.shape[1] > MAX_RANK:
        r.append(f"net[0]'s rank {t.shape[1]} above {MAX_RANK}")
    if not r:
        sms, smem = _device_limits(y.device)
        need = smem_bytes(lora_add.ksteps(t.shape[1]), _ntiles(a2.shape[0]))
        if need > smem:
            r.append(f"{need} bytes of shared memory per block do not fit the device")
        else:
            r += size_reasons(y.shape[0], sms)
    return r


def size_reasons(m: int, sms: int) -> list[str]:
    """Why the fold does not pay at ``m`` rows on a GPU of ``sms`` SMs (empty: it does): row bands split into
    :data:`MAX_SEGMENTS` segments at most must keep at least half the SMs busy."""
    busy = -(-m // _BM) * MAX_SEGMENTS * 2 >= sms
    return [] if busy else [f"{m} rows: the fold's row bands would keep fewer than half the SMs busy"]


def segments(tiles_m: int, tiles_n: int, sms: int) -> int:
    """Column segments per row band: the divisor of ``tiles_n`` up to :data:`MAX_SEGMENTS` whose grid takes the
    fewest tile steps, waves x tiles per block (one block fits an SM); the fewest segments among equals."""
    divisors = [s for s in range(1, min(tiles_n, MAX_SEGMENTS) + 1) if tiles_n % s == 0]
    return min(divisors, key=lambda s: (-(-tiles_m * s // max(sms, 1)) * (tiles_n // s), s))


def _launchers(dtype: torch.dtype, ks: int, na: int, device: torch.device) -> tuple[rt.Launcher, rt.Launcher]:
    idx = rt.device_index(device)
    key, ty = (dtype, ks, na, idx), lora_add.DTYPE_TRAITS[dtype]
    fold = _cache.get(key) or rt.launcher(_cache, key, CU, f"lora_gelu_fold_kernel<{ty}, {ks}, {na}>", idx, _THREADS,
                                          _LAYOUT, smem_bytes(ks, na))
    return fold, _cache.get((dtype, idx)) or rt.launcher(_cache, (dtype, idx), CU, f"lora_fold_reduce_kernel<{ty}>",
                                                         idx, _REDUCE_THREADS, _REDUCE_LAYOUT)


def add_gelu_fp8_fold(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, alpha: float, amax: torch.Tensor,
                      a2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernels: ``(codes, t2)``: the codes of :func:`qwen_absorb.ops.lora_add.add_gelu_fp8` and ``t2 = g @ a2.T``
    ([M, R2], y's dtype) of its GELU output ``g``; :func:`reasons` must be empty. ``y`` is only read."""
    (m, n), r2 = y.shape, a2.shape[0]
    codes = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=y.device)
    t2 = torch.empty((m, r2), dtype=y.dtype, device=y.device)
    if not m:
        return codes, t2
    ks, na = lora_add.ksteps(t.shape[1]), _ntiles(r2)
    fold, red = _launchers(y.dtype, ks, na, y.device)
    tiles_m, tiles_n = -(-m // _BM), n // _BN
    s = segments(tiles_m, tiles_n, _device_limits(y.device)[0])
    part = torch.empty((s, m, r2), dtype=torch.float32, device=y.device)
    a = amax_fp32(amax)  # held until the launch is queued
    fold(tiles_m * s, y.data_ptr(), t.data_ptr(), b.data_ptr(), a2.data_ptr(), part.data_ptr(), codes.data_ptr(),
         a.data_ptr(), t.stride(0), b.stride(0), a2.stride(0), m, n, t.shape[1], r2, tiles_n, tiles_n // s, s,
         float(alpha))
    count = m * r2
    red(-(-count // _REDUCE_THREADS), part.data_ptr(), t2.data_ptr(), count, s)
    return codes, t2


def all_kernel_expressions() -> list[tuple[str, str]]:
    return ([(CU, f"lora_gelu_fold_kernel<{d}, {k}, {a}>") for d in lora_add.DTYPE_TRAITS.values()
             for k in lora_add.KSTEPS if 16 * k <= MAX_RANK for a in NTILES]
            + [(CU, f"lora_fold_reduce_kernel<{d}>") for d in lora_add.DTYPE_TRAITS.values()])
