"""lora_add: a LoRA branch ``y + alpha * t @ B.T`` on tensor cores; :func:`add_gelu_fp8` adds net[0].proj's last
branch inside the GELU(tanh) + e4m3 quantization feeding net[2] (the sum never written).

``t`` = ``x @ A.T`` ([M, R]), ``B`` lora_B's weight ([N, R]), ``y`` the base output ([M, N]), all bf16 or all fp16.
The sum is accumulated in fp32 and rounded once (``torch.addmm_``'s expression; cuBLAS's ``addmm_`` is not, at rank
>= 32, and the kernel is never further from the exact sum). The kernels' in-place form (ACT 0, up to
:data:`MAX_PROBLEMS` outputs a launch) runs in no library path (it lost to ``addmm_`` in the call: NOTES.md), only
in the GPU tests, which check the sums by it (``tests/ops_helpers.lora_add_``). ``lora_add_tiles.cu`` (16-byte
aligned rows, widths and ranks multiples of 8; faster) and ``lora_add.cu`` (any layout) compute the same sums bit for
bit. Where :func:`reasons` refuses, callers run the torch expressions."""

from collections.abc import Sequence

import torch

from . import _runtime as rt
from ._eligibility import kernel_runtime_reasons
from ._launch import amax_fp32

MAX_PROBLEMS = 6
_THREADS = 256
_BM = 128
KSTEPS = (1, 2, 4, 8)  # rank / 16 rounded up to one of these: the kernel's template instances
MAX_RANK = 16 * KSTEPS[-1]
_PROBLEM = "PPPqqqiiiiiiif"  # y, t, b; strides; M, N, R, tiles_n, tile_begin, vec, bnb; alpha
_LAYOUT = _PROBLEM * MAX_PROBLEMS + "iiiPPP"  # nprob, units, per_block; codes, act_out, amax
_EMPTY = [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1 << 30, 0, 64, 0.0]  # an unused problem's fields (tile_begin past all)
DTYPE_TRAITS = {torch.bfloat16: "QaBF16", torch.float16: "QaF16"}
SMEM_ELEMENTS = 256 * 72  # QA_LA_SMEM: lora_B's staged rows, bnb * (16 ks + 8) elements at most
_cache: dict[tuple, rt.Launcher] = rt.register_cache({})
Problem = tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]  # (y, t, B, alpha)

# lora_add_tiles.cu: the same sums laid out for the copy rate (cp.async ring of y / t tiles, lora_B staged once
# per column range, a balanced run of tiles per block). tiles=False: every launch takes lora_add_kernel.
TILES_CU = "lora_add_tiles.cu"
TILE_COLS = 128  # QA_LT_BN
_TILE_Y_PITCH = TILE_COLS + 32  # QA_LT_YP
TILE_DEFAULTS = {"rows": 64, "stages": 3, "min_blocks": 2}  # QA_LT_BM, QA_LT_STAGES, QA_LT_MIN_BLOCKS
TILE_ROWS, TILE_STAGES, TILE_MIN_BLOCKS = TILE_DEFAULTS.values()
_slots: dict[tuple[int, int], int] = {}  # tile_slots' memo


def reasons(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> list[str]:
    """Why the kernel cannot add ``alpha * t @ b.T`` to ``y`` (empty: it can)."""
    r = []
    if not (y.dtype == t.dtype == b.dtype) or y.dtype not in DTYPE_TRAITS:
        r.append(f"dtypes {y.dtype}, {t.dtype}, {b.dtype}: the kernel takes one of bf16 / fp16 for all")
    if y.dim() != 2 or t.dim() != 2 or b.dim() != 2:
        r.append("not 2-D")
    elif t.shape[0] != y.shape[0] or b.shape[0] != y.shape[1] or t.shape[1] != b.shape[1]:
        r.append(f"shapes {tuple(y.shape)}, {tuple(t.shape)}, {tuple(b.shape)} do not chain")
    elif any(u.stride(1) != 1 for u in (y, t, b)) or y.numel() >= 1 << 31 or y.shape[0] >= 1 << 30:
        r.append("inner dimensions not contiguous, or too large for 32-bit tile indices")
    elif t.shape[1] % 2 or t.shape[1] > MAX_RANK or not rt.aligned(t, 4):
        r.append(f"rank {t.shape[1]}: the kernel takes even ranks up to {MAX_RANK} with 4-byte aligned lora_A rows")
    if not (y.device == t.device == b.device):
        r.append("tensors on different devices")
    return r or kernel_runtime_reasons(y.device)  # (its sm_80 floor is also mma.sync m16n8k16's with bf16)


def ksteps(rank: int) -> int:
    return next(k for k in KSTEPS if 16 * k >= rank)


def _launcher(act: int, dtype: torch.dtype, ks: int, device: torch.device, tiles: bool = False) -> rt.Launcher:
    idx = rt.device_index(device)
    key = (act, dtype, ks, idx, tiles)
    hit = _cache.get(key)
    if hit is None:
        cu, name = (TILES_CU, "lora_add_tiles_kernel") if tiles else ("lora_add.cu", "lora_add_kernel")
        expr = f"{name}<{DTYPE_TRAITS[dtype]}, {act}, {ks}>"
        hit = rt.launcher(_cache, key, cu, expr, idx, _THREADS, _LAYOUT, tile_smem_bytes(ks) if tiles else 0)
    return hit


def configure_tiles(rows: int | None = None, stages: int | None = None, min_blocks: int | None = None) -> None:
    """Recompile the tiled kernel with another geometry (rows per tile 32 or 64, ring stages, blocks per SM the
    registers must allow), for measurements; no arguments: the defaults. Resets every op's compile-time defines."""
    global TILE_ROWS, TILE_STAGES, TILE_MIN_BLOCKS
    d = TILE_DEFAULTS
    TILE_ROWS, TILE_STAGES, TILE_MIN_BLOCKS = rows or d["rows"], stages or d["stages"], min_blocks or d["min_blocks"]
    if TILE_ROWS not in (32, 64) or TILE_STAGES < 2 or TILE_MIN_BLOCKS < 1:
        raise ValueError(f"tile geometry rows={TILE_ROWS} stages={TILE_STAGES} min_blocks={TILE_MIN_BLOCKS}")
    _slots.clear()
    changed = (TILE_ROWS, TILE_STAGES, TILE_MIN_BLOCKS) != tuple(d.values())
    rt.set_defines({"QA_LT_BM": TILE_ROWS, "QA_LT_STAGES": TILE_STAGES, "QA_LT_MIN_BLOCKS": TILE_MIN_BLOCKS}
                   if changed else None)


def tile_smem_bytes(ks: int) -> int:
    """Dynamic shared memory of a tiled launch: lora_B's rows for one column range, then the ring of (y tile,
    t tile) stages (pitches as in lora_add_tiles.cu)."""
    ld = 16 * ks + 8
    return 2 * (TILE_COLS * ld + TILE_STAGES * TILE_ROWS * (_TILE_Y_PITCH + ld))


def tile_reasons(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> list[str]:
    """Why the tiled kernel cannot take a problem :func:`reasons` accepts (lora_add_kernel then runs it)."""
    r = []
    if y.shape[1] % 8 or t.shape[1] % 8:
        r.append(f"width {y.shape[1]} / rank {t.shape[1]} not multiples of 8 (16-byte pieces)")
    if not all(rt.aligned(u, 16) for u in (y, t, b)):
        r.append("rows not 16-byte aligned")
    return r


def tile_slots(device: torch.device, ks: int) -> int:
    """Blocks of a tiled launch resident at once on ``device`` (SMs x blocks per SM by shared memory, at most
    the ``TILE_MIN_BLOCKS`` the kernel's register bound guarantees); 0 where one block does not fit."""
    idx = rt.device_index(device)
    hit = _slots.get((idx, ks))
    if hit is None:
        props = torch.cuda.get_device_properties(idx)
        need = tile_smem_bytes(ks)
        per_block = getattr(props, "shared_memory_per_block_optin", 48 * 1024)
        per_sm = getattr(props, "shared_memory_per_multiprocessor", per_block)
        fit = 0 if need > per_block else min(TILE_MIN_BLOCKS, per_sm // (need + 1024))  # 1 KiB reserved per block
        hit = _slots[(idx, ks)] = props.multi_processor_count * fit
    return hit


def tile_grid(units: int, slots: int) -> tuple[int, int]:
    """``(blocks, tiles per block)``: every resident block walks the same number of tiles (the last fewer)."""
    per = -(-units // max(slots, 1))
    return -(-units // per), per


def columns_per_block(m: int, ks: int) -> int:
    """Columns per block: lora_B's staged rows must fit ``SMEM_ELEMENTS`` at the launch's pitch (a grouped launch
    pads every problem to its largest rank); a short problem (the text stream) wants blocks more than reuse."""
    bnb = 64 if m <= 256 else 256
    while bnb * (16 * ks + 8) > SMEM_ELEMENTS:
        bnb //= 2
    return bnb


def _fields(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, alpha: float, begin: int, ks: int,
            tiled: bool = False) -> tuple[list, int]:
    """One problem's struct fields and tile count, for the tiled kernel (its fixed geometry) or lora_add_kernel."""
    (m, n), r = y.shape, t.shape[1]
    if tiled:
        bnb, rows, vec = TILE_COLS, TILE_ROWS, 3
    else:
        bnb, rows = columns_per_block(m, ks), _BM
        vec = int(r % 8 == 0 and rt.aligned(b, 16)) | 2 * int(n % 8 == 0 and rt.aligned(y, 16))
    tiles_n = -(-n // bnb)
    return [y.data_ptr(), t.data_ptr(), b.data_ptr(), y.stride(0), t.stride(0), b.stride(0), m, n, r, tiles_n,
            begin, vec, bnb, float(alpha)], -(-m // rows) * tiles_n


def _launch(act: int, chunk: Sequence[Problem], ks: int, tiles: bool, codes: int = 0, act_out: int = 0,
            amax: int = 0) -> None:
    """One launch over ``chunk`` (<= MAX_PROBLEMS problems): the tiled kernel where ``tiles`` is on, every problem
    suits it and a block fits the device's shared memory (a balanced run of tiles per block), else lora_add_kernel."""
    y0 = chunk[0][0]
    slots = tiles and not any(tile_reasons(y, t, b) for y, t, b, _ in chunk) and tile_slots(y0.device, ks)
    fields, units = [], 0
    for y, t, b, alpha in chunk:
        f, n = _fields(y, t, b, alpha, units, ks, bool(slots))
        fields += f
        units += n
    fields += _EMPTY * (MAX_PROBLEMS - len(chunk))
    blocks, per = tile_grid(units, slots) if slots else (units, 0)  # lora_add_kernel: one block per tile
    _launcher(act, y0.dtype, ks, y0.device, tiles=bool(slots))(blocks, *fields, len(chunk), units if slots else 0, per,
                                                               codes, act_out, amax)


def add_gelu_fp8(y: torch.Tensor, t: torch.Tensor, b: torch.Tensor, alpha: float, amax: torch.Tensor,
                 act_out: bool = False, tiles: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kernel: ``(codes, g or None)`` with ``g = GELU_tanh(y + alpha * t @ B.T)`` (each rounded to y's dtype) and
    ``codes`` its e4m3 codes under ``amax`` (fp32, one element); ``y`` [M, N] contiguous is only read."""
    if not y.is_contiguous():
        raise ValueError("add_gelu_fp8 needs a contiguous y")
    codes = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=y.device)
    g = torch.empty_like(y) if act_out else None
    if y.numel():
        a = amax_fp32(amax)  # held until the launch is queued
        _launch(1, [(y, t, b, alpha)], ksteps(t.shape[1]), tiles, codes.data_ptr(), rt.ptr(g), a.data_ptr())
    return codes, g


def all_kernel_expressions() -> list[tuple[str, str]]:
    return [(cu, f"{name}<{d}, {a}, {k}>") for cu, name in (("lora_add.cu", "lora_add_kernel"),
                                                             (TILES_CU, "lora_add_tiles_kernel"))
            for d in DTYPE_TRAITS.values() for a in (0, 1) for k in KSTEPS]
