"""benchmarks/sass_report.py: its readers of cuobjdump and ptxas output, and (where nvcc and cuobjdump exist)
one real instance compiled and counted."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sass_report.py"
spec = importlib.util.spec_from_file_location("sass_report", SCRIPT)
sass_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_report)

SASS = """
        Function : _Z21layer_norm_scale_shift_kernel
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                        /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                            /* 0x0000000000007919 */
        /*0020*/              @!P0 BRA 0x80 ;                                    /* 0x0000000000088947 */
        /*0030*/               @P1 HFMA2.MMA.BF16_V2 R3, R3, 1, 1, R10 ;         /* 0x3f803f8003037835 */
        /*0040*/                   HADD2.BF16_V2 R10, R10, R6 ;                  /* 0x000000060a0a7230 */
        /*0050*/              @UP0 ULEA UR4, UP1, UR8, UR10, 0x1 ;               /* 0x0000000a08047291 */
        /*0060*/                   HADD2.BF16_V2 R11, R11, 1, 1 ;                /* 0x3c003c000b0b7430 */
        .L_x_1:
"""

PTXAS = """ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'
ptxas info    : Function properties for _Z1kv
    64 bytes stack frame, 88 bytes spill stores, 112 bytes spill loads
ptxas info    : Used 48 registers, used 1 barriers, 64 bytes cumulative stack size, 192 bytes smem
"""


def test_opcodes_count_instructions_by_mnemonic_with_and_without_predicates():
    ops = sass_report.opcodes(SASS)
    assert ops == {"LDC": 1, "S2R": 1, "BRA": 1, "HFMA2": 1, "HADD2": 2, "ULEA": 1}
    assert sass_report.opcodes("Function : x\n.L_x_1:\n") == {}


def test_ptxas_resources():
    assert sass_report.ptxas_resources(PTXAS) == {"stack": 64, "spill_stores": 88, "spill_loads": 112,
                                                  "registers": 48}


def test_unknown_kernel_is_refused():
    with pytest.raises(SystemExit, match="no single kernel file"):
        sass_report.source_of("no_such_kernel<QaBF16, 0, 6>")


@pytest.mark.slow  # an nvcc compile
@pytest.mark.skipif(not (shutil.which("nvcc") and shutil.which("cuobjdump")), reason="needs nvcc and cuobjdump")
def test_a_real_instance_compiles_and_counts():
    sass, log = sass_report.compile_instance("bias_gate_residual_kernel<QaBF16, 8, 3>", shutil.which("nvcc"),
                                             shutil.which("cuobjdump"), [])
    ops = sass_report.opcodes(sass)
    assert ops["LDG"] > 0 and ops["STG"] > 0 and sum(ops.values()) > 50
    assert sass_report.ptxas_resources(log)["registers"] > 0
