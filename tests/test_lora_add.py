"""The LoRA branch kernel's host side on the CPU (the kernel itself: tests/test_lora_add_gpu.py).

- The launcher's struct layout is the CUDA source's, field for field, and fits 512 bytes.
- Every instance is registered for the compile test; the kernel refuses what it cannot take, with reasons.
- The FP8 path's branch additions (``projection.add_products`` / ``add_deferred``) fall back to ``addmm_`` off
  CUDA, in each output's own branch order, and equal the per-output sums.
"""

from __future__ import annotations

import re
import struct

import pytest
import torch

from qwen_absorb import lora, ops, projection
from qwen_absorb.ops import _runtime
from qwen_absorb.ops import lora_add


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
    assert _kinds(params.replace("LoraProblem p[QA_LA_MAXP];", "")) == "iPPP"
    assert struct.calcsize("@" + lora_add._LAYOUT) == 512  # 6 x 80-byte problems, nprob, 3 pointers


def test_instances_registered_and_reasons():
    mine = lora_add.all_kernel_expressions()
    assert len(mine) == 16 and set(mine) <= set(ops.all_kernel_expressions())
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
    assert f"#define QA_LA_SMEM (256 * 72)" in src and lora_add.SMEM_ELEMENTS == 256 * 72
    for ks in lora_add.KSTEPS:
        for m in (1, 128, 256, 257, 4096):
            bnb = lora_add.columns_per_block(m, ks)
            assert bnb % 64 == 0 and bnb * (16 * ks + 8) <= lora_add.SMEM_ELEMENTS
    y = torch.zeros(4096, 3072, dtype=torch.bfloat16)
    t, b = torch.zeros(4096, 64, dtype=torch.bfloat16), torch.zeros(3072, 64, dtype=torch.bfloat16)
    fields, _ = lora_add._fields(y, t, b, 0.5, 0, ks=8)  # grouped with a rank-128 problem
    bnb = fields[lora_add._PROBLEM.index("f") - 1]
    assert bnb * (16 * 8 + 8) <= lora_add.SMEM_ELEMENTS


class _Plan:
    kernels = False


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
    projection.add_deferred(_Plan(), deferred)
    assert deferred == []
    for (y, _), ref in zip(outs, want):
        assert torch.equal(y, ref)
    y = torch.randn(5, 8, generator=g).to(dtype)
    prods = outs[0][1]
    y2 = y.clone()
    projection.add_products(_Plan(), y, prods)
    lora.add_products(y2, prods)
    assert torch.equal(y, y2)
