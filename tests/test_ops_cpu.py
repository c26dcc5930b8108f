"""CPU tests of qwen_absorb.ops: references == literal diffusers expressions, validation, gating,
custom ops under torch.compile, and an nvcc/NVRTC compile of every kernel variant."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from collections import defaultdict

import pytest
import torch

import qwen_absorb.ops as ops
from qwen_absorb.ops import _runtime
from qwen_absorb.quant import fp8_quantizer_reasons, norm_input_fp8
from qwen_absorb.ops.fp8 import Fp8PerTensorQuant

from .ops_helpers import (
    EPS,
    assert_bit_identical,
    chunk_views,
    diffusers_layer_norm,
    diffusers_modulate,
    make_index,
    make_mod_params,
    qwen_image_chain,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _case(seed):
    rnd = random.Random(seed)
    return rnd.choice([1, 2, 3]), rnd.choice([0, 1, 5, 33]), rnd.choice([1, 3, 8, 64, 100])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_index", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_references_equal_diffusers_block_expressions(dtype, with_index, seed):
    gen = torch.Generator().manual_seed(1000 + seed)
    B, L, D = _case(seed + 10 * with_index)
    rows = 2 * B if with_index else B
    index = make_index(B, L, "cpu", gen) if with_index else None
    h = torch.randn(B, L, D, generator=gen).to(dtype)
    attn = torch.randn(B, L, D, generator=gen).to(dtype)
    ffn = torch.randn(B, L, D, generator=gen).to(dtype)
    b_attn = torch.randn(D, generator=gen).to(dtype)
    b_ffn = torch.randn(D, generator=gen).to(dtype)
    mod1 = make_mod_params(rows, D, dtype, "cpu", gen)
    mod2 = make_mod_params(rows, D, dtype, "cpu", gen)

    # diffusers, literally (the bias as a separate add, as when it is deferred out of the GEMM)
    m1, g1 = diffusers_modulate(diffusers_layer_norm(h), mod1, index)
    h2 = h + g1 * (attn + b_attn)
    m2, g2 = diffusers_modulate(diffusers_layer_norm(h2), mod2, index)
    h3 = h2 + g2 * (ffn + b_ffn)
    h2_nob = h + g1 * attn

    sh1, sc1, _ = chunk_views(mod1)
    sh2, sc2, ga2 = chunk_views(mod2, as_3d=bool(seed % 2))
    _, _, ga1 = chunk_views(mod1, as_3d=not seed % 2)
    out1 = ops.layer_norm_scale_shift(h, shift=sh1, scale=sc1, eps=EPS, index=index)
    assert_bit_identical(out1, m1, "layer_norm_scale_shift")
    nr, out2 = ops.bias_residual_layer_norm_scale_shift(
        h, attn, bias=b_attn, gate=ga1, shift=sh2, scale=sc2, eps=EPS, index=index
    )
    assert_bit_identical(nr, h2, "new_residual")
    assert_bit_identical(out2, m2, "modulated")
    nr_nob, _ = ops.bias_residual_layer_norm_scale_shift(
        h, attn, bias=None, gate=ga1, shift=sh2, scale=sc2, eps=EPS, index=index
    )
    assert_bit_identical(nr_nob, h2_nob, "new_residual without bias")
    out3 = ops.bias_gate_residual(h2, ffn, bias=b_ffn, gate=ga2, index=index)
    assert_bit_identical(out3, h3, "bias_gate_residual")


def test_reference_rounds_like_eager_not_fused():
    """The bf16 rounding points matter: a single fp32 evaluation gives different bits."""
    gen = torch.Generator().manual_seed(7)
    r = torch.randn(4, 64, 256, generator=gen).bfloat16()
    x = torch.randn(4, 64, 256, generator=gen).bfloat16()
    g = torch.randn(4, 256, generator=gen).bfloat16()
    b = torch.randn(256, generator=gen).bfloat16()
    eager = ops.bias_gate_residual(r, x, bias=b, gate=g)
    fused_fp32 = (r.float() + g.float()[:, None] * (x.float() + b.float())).bfloat16()
    assert not torch.equal(eager, fused_fp32)


def test_fp8_reference_matches_modelopt_quantizer():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.nn import TensorQuantizer

    gen = torch.Generator().manual_seed(3)
    for dtype in DTYPES:
        x = (torch.randn(2, 33, 64, generator=gen) * 30).to(dtype)
        x[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30]).to(dtype)
        q = TensorQuantizer(mtq.config.QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
        q.amax = torch.tensor(37.3)
        got = norm_input_fp8(q)[0].reference(x)
        assert_bit_identical(got, q(x), f"fp8 {dtype}")
        q.amax = torch.tensor(0.0)  # amax <= 2^-24 counts as 1
        assert_bit_identical(norm_input_fp8(q)[0].reference(x), q(x), "fp8 zero amax")


def test_fp8_formulas_differ_only_in_scale_rounding():
    x = torch.randn(1, 8, 64).bfloat16()
    for amax in (0.3, 1.7, 448.0, 1000.0):
        a = torch.tensor(amax)
        ext = Fp8PerTensorQuant(a, "cuda_ext").reference(x)
        eager = Fp8PerTensorQuant(a, "eager").reference(x)
        assert ((ext.float() - eager.float()).abs() <= 2 ** -6 * x.float().abs().max()).all()


def test_modelopt_quantizer_qualification():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization.nn import TensorQuantizer

    q = TensorQuantizer(mtq.config.QuantizerAttributeConfig(num_bits=(4, 3), axis=None))
    assert "no static amax (dynamic quantization or not calibrated)" in fp8_quantizer_reasons(q)
    q.amax = torch.tensor(2.0)
    assert fp8_quantizer_reasons(q) == []
    q.disable()
    assert "quantizer is disabled" in fp8_quantizer_reasons(q)
    nv = TensorQuantizer(
        mtq.config.QuantizerAttributeConfig(
            num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
        )
    )
    reasons = fp8_quantizer_reasons(nv)
    assert any("num_bits" in r for r in reasons) and any("block" in r for r in reasons)
    x = torch.randn(1, 2, 16)
    p = torch.randn(1, 16)
    assert norm_input_fp8(nv)[0] is None and norm_input_fp8(nv)[1]
    with pytest.raises(TypeError, match="norm_input_quant"):  # ops take descriptions, not ModelOpt objects
        ops.bias_residual_layer_norm_scale_shift(x, x, bias=None, gate=p, shift=p, scale=p, norm_input_quant=nv)


def _args(B=2, L=3, D=8, dtype=torch.float32):
    x = torch.randn(B, L, D, dtype=dtype)
    p = torch.randn(B, D, dtype=dtype)
    return x, p


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (lambda a: a.update(x=a["x"][0]), ValueError, "x must have shape"),
        (lambda a: a.update(x=a["x"].to(torch.int32)), TypeError, "x has dtype"),
        (lambda a: a.update(x=a["x"].double(), residual=a["residual"].double()), TypeError, "x has dtype"),
        (lambda a: a.update(residual=a["residual"].bfloat16()), TypeError, "residual has dtype"),
        (lambda a: a.update(residual=a["residual"][:, :2]), ValueError, "residual has shape"),
        (lambda a: a.update(gate=a["gate"][:1]), ValueError, "gate must have shape"),
        (lambda a: a.update(gate=a["gate"].bfloat16()), TypeError, "gate has dtype"),
        (lambda a: a.update(shift=torch.randn(2, 24)[:, 8:16]), None, None),
        (lambda a: a.update(scale=torch.randn(8, 2).t()), ValueError, "scale must have stride 1"),
        (lambda a: a.update(bias=torch.randn(7)), ValueError, "bias must have shape"),
        (lambda a: a.update(index=torch.zeros(2, 3)), TypeError, "index must be an integer"),
        (lambda a: a.update(index=torch.zeros(2, 4, dtype=torch.long)), ValueError, "index must have shape"),
        (lambda a: a.update(index=torch.full((2, 3), 2)), ValueError, "2B rows|index must contain"),
        (lambda a: a.update(eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda a: a.update(eps="x"), TypeError, "eps must be a float"),
        (lambda a: a.update(x=[1, 2]), TypeError, "x must be a torch.Tensor"),
    ],
)
def test_validation_errors_name_the_argument(mutate, exc, match):
    x, p = _args()
    a = dict(residual=x.clone(), x=x, bias=torch.randn(8), gate=p, shift=p.clone(), scale=p.clone(), eps=1e-6, index=None)
    mutate(a)
    if exc is None:  # a valid variation: must run
        ops.bias_residual_layer_norm_scale_shift(**{k: v for k, v in a.items() if k not in ("residual", "x")}, residual=a["residual"], x=a["x"])
        return
    with pytest.raises(exc, match=match):
        ops.bias_residual_layer_norm_scale_shift(
            a["residual"], a["x"], bias=a["bias"], gate=a["gate"], shift=a["shift"], scale=a["scale"],
            eps=a["eps"], index=a["index"],
        )


def test_index_values_checked_on_cpu():
    x, _ = _args()
    p = torch.randn(4, 8)
    with pytest.raises(ValueError, match="index must contain only 0 and 1"):
        ops.bias_gate_residual(x, x, bias=None, gate=p, index=torch.full((2, 3), 2))
    with pytest.raises(ValueError, match="shift must have shape"):
        ops.layer_norm_scale_shift(x, shift=p[:2], scale=p, index=torch.zeros(2, 3, dtype=torch.long))


def test_not_supported_reasons_are_data():
    x, p = _args()
    r = ops.layer_norm_scale_shift_not_supported_reasons(x, shift=p, scale=p)
    assert r and "cpu" in r[0]
    r = ops.bias_gate_residual_not_supported_reasons(x, x, bias=None, gate=p, force_reference=True)
    assert any("forced" in s for s in r)
    xg = x.clone().requires_grad_()
    r = ops.bias_residual_layer_norm_scale_shift_not_supported_reasons(xg, x, bias=None, gate=p, shift=p, scale=p)
    assert any("autograd" in s for s in r)
    with torch.no_grad():
        r = ops.bias_residual_layer_norm_scale_shift_not_supported_reasons(xg, x, bias=None, gate=p, shift=p, scale=p)
    assert not any("autograd" in s for s in r)


def test_force_reference_env(monkeypatch):
    x, p = _args()
    monkeypatch.setenv(ops.FORCE_REFERENCE_ENV, "1")
    r = ops.bias_gate_residual_not_supported_reasons(x, x, bias=None, gate=p)
    assert any(ops.FORCE_REFERENCE_ENV in s for s in r)


def test_custom_ops_compile_fullgraph_on_cpu():
    gen = torch.Generator().manual_seed(5)
    B, L, D = 2, 9, 32
    h = torch.randn(B, L, D, generator=gen).bfloat16()
    a = torch.randn(B, L, D, generator=gen).bfloat16()
    bias = torch.randn(D, generator=gen).bfloat16()
    mod = make_mod_params(2 * B, 6 * D // 3, torch.bfloat16, "cpu", gen)
    index = make_index(B, L, "cpu", gen)

    torch._dynamo.reset()
    compiled = torch.compile(qwen_image_chain, fullgraph=True, backend="eager")
    for got, want in zip(compiled(h, a, bias, mod, index), qwen_image_chain(h, a, bias, mod, index)):
        assert_bit_identical(got, want, "compiled chain")
    # the trace really goes through the registered custom ops
    gm = torch._dynamo.export(qwen_image_chain)(h, a, bias, mod, index).graph_module
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("qwen_absorb" in t for t in targets), targets


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 5, 16, dtype=torch.bfloat16)
        g = torch.empty(2, 1, 16, dtype=torch.bfloat16)
        out = torch.ops.qwen_absorb.bias_residual_layer_norm_scale_shift(x, x, None, g, g, g, 1e-6, None, None, 0, None)
        assert [tuple(t.shape) for t in out] == [(2, 5, 16), (2, 5, 16), (0,)]
        amax = torch.empty(1)
        out = torch.ops.qwen_absorb.bias_residual_layer_norm_scale_shift(x, x, None, g, g, g, 1e-6, None, None, 0, amax)
        assert out[2].shape == (2, 5, 16) and out[2].dtype == torch.float8_e4m3fn
        a, b = torch.ops.qwen_absorb.quantize_fp8(x, 2, amax, amax, "")
        assert a.shape == (2, 2, 16) and b.shape == (2, 3, 16)


def test_kernel_source_inlines_headers():
    src = _runtime.kernel_source("bias_residual_layer_norm_scale_shift.cu")
    assert "#include \"" not in src and src.count("struct QaWelford {") == 1


def _nvcc() -> str | None:
    return shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc") or None


def _pairwise_cover(exprs: list[str]) -> list[str]:
    """Instances such that every pair of template-argument values (by position) that occurs in ``exprs`` occurs in
    one of them: each template is compiled with every value of every argument, beside every value of every other
    (a full compile of the 844 instances takes ~9 min; the cover ~1/4 of that). Greedy, deterministic."""
    def pairs(e: str) -> set:
        args = [a.strip() for a in e[e.index("<") + 1:e.rindex(">")].split(",")] if "<" in e else []
        args = [e[:e.index("<")] if "<" in e else e] + args
        return {(i, a, j, b) for i, a in enumerate(args) for j, b in enumerate(args) if i < j} | {(0, args[0], 0, "")}
    todo, chosen = set().union(*(pairs(e) for e in exprs)), []
    while todo:
        best = max(exprs, key=lambda e: len(pairs(e) & todo))
        chosen.append(best)
        todo -= pairs(best)
    return chosen


@pytest.mark.slow  # nvcc compiles the kernel variants: ~2 min (QWEN_ABSORB_COMPILE_ALL=1: every instance, ~9 min)
@pytest.mark.skipif(_nvcc() is None, reason="no nvcc on this machine")
def test_every_kernel_variant_compiles_for_sm90(tmp_path):
    """Instantiates the templates the launchers can request (every instance with QWEN_ABSORB_COMPILE_ALL=1, else a
    pairwise cover of their arguments) and compiles them for sm_90 with nvcc (the device compiles each instance it
    launches with NVRTC at run time; the GPU suite launches them)."""
    by_file = defaultdict(list)
    for f, expr in ops.all_kernel_expressions():
        by_file[f].append(expr)
    if os.environ.get("QWEN_ABSORB_COMPILE_ALL") != "1":
        by_file = {f: _pairwise_cover(e) for f, e in by_file.items()}
    for f, exprs in by_file.items():
        src = _runtime.kernel_source(f) + "\nvoid* qa_instances[] = {\n" + ",\n".join(f"(void*)&{e}" for e in exprs) + "};\n"
        path = tmp_path / f
        path.write_text(src)
        cmd = [_nvcc(), "-arch=sm_90", "-std=c++17", "-cubin", "-o", str(path.with_suffix(".cubin")), str(path)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        assert res.returncode == 0, f"{f}:\n{res.stderr[-4000:]}"
        assert "warning" not in res.stderr.lower(), res.stderr[-2000:]


def _struct_kinds(source: str, struct_name: str) -> str:
    """The field kinds of a kernel's parameter struct, read from its CUDA source, one letter per field in
    declaration order: pointers P, qa_i64 q, int i, float f."""
    import re

    body = re.search(r"struct\s+" + struct_name + r"\s*\{(.*?)\};", source, re.S).group(1)
    kinds = ""
    for decl in re.sub(r"//[^\n]*", "", body).split(";"):
        decl = decl.strip()
        if decl:
            head = decl.split(",")[0]
            kind = "P" if "*" in head else "q" if head.startswith("qa_i64") else "f" if head.startswith("float") else "i"
            kinds += kind * (1 + decl.count(","))
    return kinds


def _expand(layout: str) -> str:
    """``"6P3qiii"`` -> ``"PPPPPPqqqiii"``."""
    import re

    return "".join(c * int(n or 1) for n, c in re.findall(r"(\d*)([A-Za-z])", layout))


@pytest.mark.parametrize("module", ["bias_gate_residual", "bias_residual_layer_norm_scale_shift", "layer_norm_scale",
                                    "layer_norm_scale_shift", "tanh_gate_residual",
                                    "tanh_gate_residual_layer_norm_scale"])
def test_kernel_layouts_match_the_c_structs(module):
    """The host packs the parameter struct by ``Kernels.layout``: it must be the .cu struct, field for field
    (a field added on one side only shifts every later one: wrong pointers, not an error)."""
    import importlib
    import re
    from pathlib import Path

    mod = importlib.import_module(f"qwen_absorb.ops.{module}")
    k = mod.KERNELS
    src = (Path(mod.__file__).parent / "csrc" / k.cu).read_text()
    struct_name = re.search(k.name + r"\(const (\w+) p\)", src).group(1)
    assert _struct_kinds(src, struct_name) == _expand(k.layout)


def test_quantize_fp8_layouts_match_the_c_structs():
    import importlib
    from pathlib import Path

    qf8 = importlib.import_module("qwen_absorb.ops.quantize_fp8")  # ops.quantize_fp8 is also the op
    src = (Path(qf8.__file__).parent / "csrc" / qf8.CU).read_text()
    assert _struct_kinds(src, "QuantizeFp8Params") == _expand(qf8.LAYOUT)
    assert len(qf8.all_kernel_expressions()) == 3 * 3 * 2  # dtypes x activations x (scalar, vector)


def test_norm_quant_amax_fp32_is_converted_once_per_value():
    """A bf16 model's norm-input quantizers hold bf16 amaxes; the kernels read fp32. The conversion is
    kept while the amax keeps its version and address, and redone after an in-place change."""
    from qwen_absorb.ops.fp8 import Fp8PerTensorQuant

    amax = torch.tensor(3.3, dtype=torch.bfloat16)
    q = Fp8PerTensorQuant(amax=amax)
    a = q.amax_fp32(torch.device("cpu"))
    assert a.dtype == torch.float32 and a.shape == () and a.item() == amax.float().item()
    assert q.amax_fp32(torch.device("cpu")) is a  # no conversion per call
    amax.mul_(2)  # recalibrated in place
    b = q.amax_fp32(torch.device("cpu"))
    assert b is not a and b.item() == amax.float().item()
    with torch.no_grad():
        amax.copy_(torch.tensor(0.5))  # load_state_dict's way
    assert q.amax_fp32(torch.device("cpu")).item() == 0.5
    f32 = torch.tensor(1.25)
    assert Fp8PerTensorQuant(amax=f32).amax_fp32(torch.device("cpu")).data_ptr() == f32.data_ptr()
    with torch.inference_mode():
        inf = torch.tensor(2.0, dtype=torch.bfloat16)
    qi = Fp8PerTensorQuant(amax=inf)
    assert qi.amax_fp32(torch.device("cpu")).item() == 2.0  # no version counter: converted each call
    assert q == Fp8PerTensorQuant(amax=amax) and hash(q) == hash(Fp8PerTensorQuant(amax=amax))
