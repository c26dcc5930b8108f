#!/usr/bin/env python
"""SASS of qwen_absorb's kernels without a GPU: instruction counts, registers, spills, opcode histogram.

The LayerNorm-family kernels are bound by instruction issue, and what the compiler makes of a change shows in
the SASS long before a device run (NOTES.md, v5). This compiles template instances of the kernels (the inlined
source CuPy compiles, ``ops._runtime.kernel_source``) with nvcc for sm_90, reads ptxas' register and spill
lines, and disassembles with ``cuobjdump -sass`` (a CUDA toolkit's, or the one in the ``nvidia-cuda-cuobjdump``
wheel: ``pip download nvidia-cuda-cuobjdump``, unzip, pass ``--cuobjdump``).

    python benchmarks/sass_report.py "bias_residual_layer_norm_scale_shift_kernel<QaBF16, 0, 6>"
    python benchmarks/sass_report.py "layer_norm_scale_shift_kernel<QaBF16, 0, 6>" -D QA_LN_MIN_BLOCKS=1 --top 20

The count is static (every path of the kernel, the fast and the generic variants together): compare builds of
the same instance, not instances with each other.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)")
_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
                    r"|Used (\d+) registers")


def opcodes(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count, over the instruction lines of ``cuobjdump -sass`` output."""
    return collections.Counter(m.group(1) for m in map(_INSTR.match, sass.splitlines()) if m)


def ptxas_resources(log: str) -> dict[str, int]:
    """Registers and spill bytes of the last kernel in ptxas' ``-v`` log."""
    out: dict[str, int] = {}
    for m in _PTXAS.finditer(log):
        if m.group(4):
            out["registers"] = int(m.group(4))
        else:
            out.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    return out


def source_of(expr: str) -> str:
    """The csrc file that defines the kernel template named in ``expr``."""
    from qwen_absorb import ops  # noqa: PLC0415

    files = {f for f, e in ops.all_kernel_expressions() if e.split("<")[0] == expr.split("<")[0].strip()}
    if len(files) != 1:
        raise SystemExit(f"no single kernel file defines {expr!r} (found {sorted(files)})")
    return files.pop()


def compile_instance(expr: str, nvcc: str, cuobjdump: str, defines: list[str]) -> tuple[str, str]:
    """(cuobjdump -sass text, ptxas -v log) of one template instance."""
    from qwen_absorb.ops import _runtime  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(_runtime.kernel_source(source_of(expr)) + f"\nvoid* qa_instance = (void*)&{expr};\n")
        cubin = cu.with_suffix(".cubin")
        cmd = [nvcc, "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o", str(cubin), str(cu),
               *(f"-D{d}" for d in defines)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(res.stderr[-4000:])
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return sass, res.stderr


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("expr", nargs="+", help='template instances, e.g. "layer_norm_scale_shift_kernel<QaBF16, 0, 6>"')
    ap.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE compile-time knob")
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "nvcc")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--top", type=int, default=12, help="opcodes to list")
    a = ap.parse_args(argv)
    for expr in a.expr:
        sass, log = compile_instance(expr, a.nvcc, a.cuobjdump, a.defines)
        ops = opcodes(sass)
        res = ptxas_resources(log)
        print(f"{expr}: {sum(ops.values())} instructions, {res}")
        for op, n in ops.most_common(a.top):
            print(f"  {n:6d} {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
