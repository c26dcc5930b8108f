"""The LoRA branch kernel's host side on the CPU (the kernel itself: tests/test_lora_add_gpu.py).

- The launcher's struct layout is the CUDA source's, field for field, and fits 512 bytes.
- Every instance is registered for the compile test; the kernel refuses what it cannot take, with reasons.
- The FP8 path's deferred branch additions (``projection.add_deferred``) are ``addmm_`` in each output's own
  branch order: the per-output sums.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch

from qwen_absorb import ops, projection
from qwen_absorb.ops import _runtime
from qwen_absorb.ops import lora_add

from .ops_helpers import lora_add_


def _kinds(body: str) -> str:
    out = ""
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = decl.strip()
        if decl:
            out += ("P" if "*" in decl else "q" if decl.startswith("qa_i64") else "f" if decl.startswith("float")
                    else "i") * (1 + decl.count(","))
    return out


def test_layout_matches_the_cuda_structs():
    src = _runtime.kernel_source("lora_add.cu")
    problem = _kinds(re.search(r"struct LoraProblem\s*\{(.*?)\};", src, re.S).group(1))
    params = re.search(r"struct LoraAddParams\s*\{(.*?)\};", src, re.S).group(1)
    maxp = int(re.search(r"#define QA_LA_MAXP (\d+)", src).group(1))
    assert maxp == lora_add.MAX_PROBLEMS
    assert problem == lora_add._PROBLEM
    assert _kinds(params.replace("LoraProblem p[QA_LA_MAXP];", "")) == "iiiPPP"
    assert struct.calcsize("@" + lora_add._LAYOUT) == 520  # 6 x 80-byte problems, nprob, units, per_block, 3 pointers
    assert "struct LoraAddParams" in _runtime.kernel_source(lora_add.TILES_CU)  # both kernels take the one struct


def test_instances_registered_and_reasons():
    mine = lora_add.all_kernel_expressions()
    assert len(mine) == 32 and set(mine) <= set(ops.all_kernel_expressions())
    assert sum(cu == lora_add.TILES_CU for cu, _ in mine) == 16
    y = torch.zeros(4, 6, dtype=torch.bfloat16)
    t, b = torch.zeros(4, 2, dtype=torch.bfloat16), torch.zeros(6, 2, dtype=torch.bfloat16)
    assert any("CUDA" in r for r in lora_add.reasons(y, t, b))
    assert any("dtypes" in r for r in lora_add.reasons(y.float(), t, b))
    assert any("chain" in r for r in lora_add.reasons(y, t, b[:5]))
    t3, b3 = torch.zeros(4, 3, dtype=torch.bfloat16), torch.zeros(6, 3, dtype=torch.bfloat16)
    assert any("even ranks" in r for r in lora_add.reasons(y, t3, b3))
    assert any("contiguous" in r for r in lora_add.reasons(y.t(), torch.zeros(6, 2, dtype=torch.bfloat16),
                                                           torch.zeros(4, 2, dtype=torch.bfloat16)))


def test_staged_rows_fit_shared_memory_for_every_launch():
    """A grouped launch pads every problem to its largest rank: the columns per block follow the launch's pitch
    (a rank-64 problem grouped with a rank-128 one overflowed shared memory on the H200: illegal address)."""
    src = _runtime.kernel_source("lora_add.cu")
    assert "#define QA_LA_SMEM (256 * 72)" in src and lora_add.SMEM_ELEMENTS == 256 * 72
    for ks in lora_add.KSTEPS:
        for m in (1, 128, 256, 257, 4096):
            bnb = lora_add.columns_per_block(m, ks)
            assert bnb % 64 == 0 and bnb * (16 * ks + 8) <= lora_add.SMEM_ELEMENTS
    y = torch.zeros(4096, 3072, dtype=torch.bfloat16)
    t, b = torch.zeros(4096, 64, dtype=torch.bfloat16), torch.zeros(3072, 64, dtype=torch.bfloat16)
    fields, _ = lora_add._fields(y, t, b, 0.5, 0, ks=8)  # grouped with a rank-128 problem
    bnb = fields[lora_add._PROBLEM.index("f") - 1]
    assert bnb * (16 * 8 + 8) <= lora_add.SMEM_ELEMENTS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deferred_branches_equal_per_output_sums(dtype):
    g = torch.Generator().manual_seed(3)
    outs, want = [], []
    for m, n, ranks in ((5, 8, (4, 2)), (5, 6, (3,)), (7, 8, (2, 2, 2))):
        y = torch.randn(m, n, generator=g).to(dtype)
        prods = [(torch.randn(m, r, generator=g).to(dtype), torch.randn(n, r, generator=g).to(dtype), 0.5 + r)
                 for r in ranks]
        ref = y.clone()
        for t, b, s in prods:  # branch by branch, each rounded: the order matters
            ref = torch.addmm(ref, t, b.t(), alpha=s)
        outs.append((y, prods))
        want.append(ref)
    deferred = list(outs)
    projection.add_deferred(deferred)
    assert deferred == []
    for (y, _), ref in zip(outs, want):
        assert torch.equal(y, ref)


def test_tiled_kernel_constants_and_shared_memory():
    """The host's tile geometry is the CUDA source's; a rank-64 block leaves room for two per H200 SM (228 KiB),
    rank 128 for one."""
    src = _runtime.kernel_source(lora_add.TILES_CU)
    const = {k: re.search(rf"#define {k} \(?([^\n/]+?)\)?\s*(//|\n)", src).group(1).strip()
             for k in ("QA_LT_BM", "QA_LT_BN", "QA_LT_YP", "QA_LT_STAGES", "QA_LT_MIN_BLOCKS")}
    assert (int(const["QA_LT_BM"]), int(const["QA_LT_BN"]), int(const["QA_LT_STAGES"]),
            int(const["QA_LT_MIN_BLOCKS"])) == (lora_add.TILE_ROWS, lora_add.TILE_COLS, lora_add.TILE_STAGES,
                                                lora_add.TILE_MIN_BLOCKS)
    assert lora_add.TILE_DEFAULTS == {"rows": 64, "stages": 3, "min_blocks": 2}
    assert const["QA_LT_YP"].replace(" ", "") == "QA_LT_BN+32" and lora_add._TILE_Y_PITCH == lora_add.TILE_COLS + 32
    per_sm = 228 * 1024
    assert 2 * (lora_add.tile_smem_bytes(4) + 1024) <= per_sm < 2 * (lora_add.tile_smem_bytes(8) + 1024)
    assert lora_add.tile_smem_bytes(8) <= 227 * 1024


@pytest.mark.parametrize("units,slots", [(6144, 264), (1536, 264), (48, 264), (7, 3), (1, 1), (265, 264)])
def test_tile_grid_covers_every_tile_once(units, slots):
    blocks, per = lora_add.tile_grid(units, slots)
    assert blocks <= max(slots, 1) and blocks * per >= units > (blocks - 1) * per


def test_tile_reasons():
    y = torch.zeros(64, 136, dtype=torch.bfloat16)
    t, b = torch.zeros(64, 16, dtype=torch.bfloat16), torch.zeros(136, 16, dtype=torch.bfloat16)
    assert lora_add.tile_reasons(y, t, b) == []
    assert any("multiples of 8" in r for r in lora_add.tile_reasons(y[:, :130], t, b[:130]))
    assert any("multiples of 8" in r for r in lora_add.tile_reasons(y, t[:, :12], b[:, :12]))
    wide = torch.zeros(64, 40, dtype=torch.bfloat16)
    assert any("aligned" in r for r in lora_add.tile_reasons(y, wide[:, 2:18], b))


def test_configure_tiles_sets_the_defines_and_restores_them():
    try:
        lora_add.configure_tiles(rows=32, stages=2, min_blocks=4)
        assert (lora_add.TILE_ROWS, lora_add.TILE_STAGES, lora_add.TILE_MIN_BLOCKS) == (32, 2, 4)
        assert {"-DQA_LT_BM=32", "-DQA_LT_STAGES=2", "-DQA_LT_MIN_BLOCKS=4"} <= set(_runtime.NVRTC_OPTIONS)
        assert lora_add.tile_smem_bytes(4) == 2 * (128 * 72 + 2 * 32 * (160 + 72))
        with pytest.raises(ValueError):
            lora_add.configure_tiles(rows=48)
    finally:
        lora_add.configure_tiles()
    assert (lora_add.TILE_ROWS, lora_add.TILE_STAGES, lora_add.TILE_MIN_BLOCKS) == (64, 3, 2)
    assert not any("QA_LT" in o for o in _runtime.NVRTC_OPTIONS)


def test_launches_pick_the_tiled_kernel_where_the_layout_allows(monkeypatch):
    """Which kernel a launch takes and what the tiled one is told: every problem's first tile, the launch's tiles
    and tiles per block (a block walks a balanced run of them)."""
    rec = []
    monkeypatch.setattr(lora_add, "_launcher", lambda act, dtype, ks, device, tiles=False:
                        (lambda grid, *v: rec.append((act, ks, tiles, grid, v))))
    monkeypatch.setattr(lora_add, "tile_slots", lambda device, ks: 264)
    bf = torch.bfloat16
    y, t, b = torch.zeros(4096, 3072, dtype=bf), torch.zeros(4096, 64, dtype=bf), torch.zeros(3072, 64, dtype=bf)
    y2, t2 = torch.zeros(128, 3072, dtype=bf), torch.zeros(128, 32, dtype=bf)
    b2 = torch.zeros(3072, 32, dtype=bf)
    lora_add_([(y, t, b, 0.5), (y2, t2, b2, 0.25)])
    act, ks, tiles, grid, v = rec[-1]
    np_ = len(lora_add._PROBLEM)
    units = 64 * 24 + 2 * 24
    assert (act, ks, tiles) == (0, 4, True)  # the smaller rank is padded to the launch's k steps
    assert v[np_ + lora_add._PROBLEM.index("i") + 4] == 64 * 24  # the second problem's first tile
    assert v[np_ * lora_add.MAX_PROBLEMS:np_ * lora_add.MAX_PROBLEMS + 3] == (2, units, 6) and grid == 264
    y3, t3, b3 = torch.zeros(77, 130, dtype=bf), torch.zeros(77, 12, dtype=bf), torch.zeros(130, 12, dtype=bf)
    lora_add_([(y3, t3, b3, 1.0)])  # width and rank not multiples of 8: the row kernel
    assert rec[-1][2] is False and rec[-1][4][np_ * lora_add.MAX_PROBLEMS + 1:][:2] == (0, 0)
    codes, g = lora_add.add_gelu_fp8(y, t, b, 0.5, torch.tensor([2.0]), act_out=True)
    assert rec[-1][:3] == (1, 4, True) and codes.shape == y.shape and g is not None
    assert rec[-1][4][-3:] == (codes.data_ptr(), g.data_ptr(), rec[-1][4][-1]) and rec[-1][4][-1] != 0
    lora_add_([(y, t, b, 0.5)], tiles=False)  # the row kernel, as Tuning(lora_add_tiles=False) asks
    assert rec[-1][2] is False
    lora_add.add_gelu_fp8(y, t, b, 0.5, torch.tensor([2.0]), tiles=False)
    assert rec[-1][2] is False
    monkeypatch.setattr(lora_add, "tile_slots", lambda device, ks: 0)  # a block does not fit: the row kernel
    lora_add_([(y, t, b, 0.5)])
    assert rec[-1][2] is False
