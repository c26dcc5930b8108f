"""NVFP4 emitted by the fused kernels (issue 39 B), on the CPU: the launchers' argument checks, the parameter
structs and template instances the host asks for, the lane layout the kernels' shared block arithmetic relies
on, and the references the GPU tests compose (tests/test_ops_nvfp4_emit_gpu.py runs the kernels)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import qwen_absorb.ops as ops
from qwen_absorb.ops import _launch, _runtime
from qwen_absorb.ops._launch import LN_MODES, layout

from .test_ops_cpu import _struct_kinds  # the parameter structs read from the CUDA sources, one way

qn = importlib.import_module("qwen_absorb.ops.quantize_nvfp4")  # ops.quantize_nvfp4 is the op
LN_MODULES = ("layer_norm_scale_shift", "bias_residual_layer_norm_scale_shift", "layer_norm_scale",
              "tanh_gate_residual_layer_norm_scale")
CSRC = Path(_runtime.CSRC)


def _mod(name: str):
    return importlib.import_module(f"qwen_absorb.ops.{name}")


def _amax(v: float = 3.0, dtype=torch.float32, n: int = 1) -> torch.Tensor:
    return torch.full((n,), v, dtype=dtype)


def _call(name: str, D: int, *, dtype=torch.bfloat16, fp8_amax=None, nvfp4_amax=None):
    """The launcher of op ``name`` on CPU tensors [2, 3, D] (it must refuse before touching a device)."""
    g = torch.Generator().manual_seed(D)
    x = torch.randn(2, 3, D, generator=g).to(dtype)
    p = torch.randn(2, D, generator=g).to(dtype)
    m = _mod(name)
    kw = {"fp8_amax": fp8_amax, "nvfp4_amax": nvfp4_amax}
    if name == "layer_norm_scale_shift":
        return m.launch(x, p, p, 1e-6, None, **kw)
    if name == "bias_residual_layer_norm_scale_shift":
        return m.launch(x, x, None, p, p, p, 1e-6, None, None, 0, **kw)
    if name == "layer_norm_scale":
        return m.launch(x, p, 1e-6, None, **kw)
    if name == "tanh_gate_residual_layer_norm_scale":
        return m.launch(x, x, p, p, 1e-6, None, **kw)
    assert name == "swiglu"
    return m.launch(x, x, **kw)


EMITTERS = (*LN_MODULES, "swiglu")


@pytest.mark.parametrize("name", EMITTERS)
def test_fp8_and_nvfp4_outputs_are_exclusive(name):
    with pytest.raises(ValueError, match="exclusive"):
        _call(name, 64, fp8_amax=_amax(), nvfp4_amax=_amax())


@pytest.mark.parametrize("name", EMITTERS)
@pytest.mark.parametrize("D", [8, 40, 3080 + 4])
def test_nvfp4_needs_rows_of_whole_blocks(name, D):
    with pytest.raises(ValueError, match="multiple of 16"):
        _call(name, D, nvfp4_amax=_amax())


@pytest.mark.parametrize("name", EMITTERS)
def test_nvfp4_amax_must_be_one_fp32_value(name):
    with pytest.raises(TypeError, match="float32"):
        _call(name, 64, nvfp4_amax=_amax(dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="one-element"):
        _call(name, 64, nvfp4_amax=_amax(n=2))


@pytest.mark.parametrize("name", EMITTERS)
def test_nvfp4_emission_refuses_other_dtypes(name):
    with pytest.raises(TypeError, match="NVFP4 emission supports"):
        _call(name, 64, dtype=torch.float64, nvfp4_amax=_amax())


def test_emit_reasons_gate_on_whole_blocks():
    assert qn.emit_reasons(16) == [] and qn.emit_reasons(3072) == [] and qn.emit_reasons(12288) == []
    for D in (1, 8, 24, 3076):
        (why,) = qn.emit_reasons(D)
        assert f"D = {D}" in why and "16" in why


def test_quantize_nvfp4_activation_names_are_checked():
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="act must be one of"):
        qn.launch(x, _amax(), act="relu")
    with pytest.raises(ValueError, match="activation must be one of"):
        ops.quantize_nvfp4(x, _amax(), activation="gelu")


def test_outputs_gives_a_second_output_in_the_activation_dtype():
    x = torch.randn(2, 3, 32, dtype=torch.float16)
    o, q = _launch.outputs(x, (x,), out=False, nvfp4=True)
    assert o is None and q.dtype == torch.float16 and q.shape == x.shape and q.is_contiguous()
    h, o, q = _launch.outputs(x, (x,), new_residual=True, nvfp4=True)
    assert h.shape == o.shape == q.shape == x.shape and q.dtype == x.dtype
    _, codes = _launch.outputs(x, (x,), codes=True)
    assert codes.dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------------------- structs and instances


def _expand(layout_: str) -> str:
    return "".join(c * int(n or 1) for n, c in re.findall(r"(\d*)([A-Za-z])", layout_))


@pytest.mark.parametrize("name", LN_MODULES)
def test_ln_structs_name_the_second_output_and_match_the_host_layout(name):
    k = _mod(name).KERNELS
    src = (CSRC / k.cu).read_text()
    struct_name = re.search(k.name + r"\(const (\w+) p\)", src).group(1)
    body = re.search(r"struct\s+" + struct_name + r"\s*\{(.*?)\};", src, re.S).group(1)
    assert "void* out2;" in body and "const float* out2_amax;" in body and "out_fp8" not in body
    assert _struct_kinds(src, struct_name) == _expand(k.layout)
    # the NVFP4 instance is a template argument with a default: the plain names stay what they were
    assert re.search(r"template <class T, int MODE, int NV, int NVFP4 = 0>\s*__global__", src)


def test_swiglu_and_quantize_nvfp4_structs_match_the_host_layout():
    sw = _mod("swiglu")
    assert _struct_kinds((CSRC / sw.CU).read_text(), "SwigluParams") == _expand(sw.LAYOUT)
    assert _struct_kinds((CSRC / qn.CU).read_text(), "QuantizeNvfp4Params") == _expand(qn.LAYOUT)


@pytest.mark.parametrize("name", LN_MODULES)
def test_every_ln_kernel_lists_its_nvfp4_instances(name):
    k = _mod(name).KERNELS
    exprs = [e for _, e in k.expressions()]
    plain = [e for e in exprs if e.count(", ") == 2]  # name<T, MODE, NV>
    nv4 = [e for e in exprs if e.count(", ") == 3]    # name<T, MODE, NV, 1>
    assert len(plain) + len(nv4) == len(exprs) and all(e.endswith(", 1>") for e in nv4)
    assert len(plain) == len(nv4) == len(_runtime.TRAITS) * len(LN_MODES) * (len(k.nv_choices) + 1)
    assert {e[:-len(", 1>")] + ">" for e in nv4} == set(plain)
    assert set(k.expressions()) <= set(ops.all_kernel_expressions())


def test_swiglu_and_quantize_nvfp4_list_their_new_instances():
    sw = _mod("swiglu").all_kernel_expressions()
    assert len(sw) == 2 * len(_runtime.TRAITS) and sum(e.count(", ") == 3 for _, e in sw) == len(_runtime.TRAITS)
    q = qn.all_kernel_expressions()
    assert len(q) == len(_runtime.TRAITS) * 2 * 3  # dtypes x (scalar, vector) x activations
    assert {e.split(", ")[-1] for _, e in q if e.count(",") == 2} == {"1>", "2>"}
    assert set(sw) | set(q) <= set(ops.all_kernel_expressions())


def test_ln_launcher_requests_the_nvfp4_instance_only_with_nvfp4(monkeypatch):
    """Kernels.ln compiles ``name<T, A, NV, 1>`` for an NVFP4 launch and the plain name otherwise, and keeps
    them apart in its cache (the CuPy compile is replaced by a recorder)."""
    asked = []
    monkeypatch.setattr(_runtime, "function", lambda cu, expr, dev, smem=0: asked.append(expr) or object())
    monkeypatch.setattr(_runtime, "Launcher", lambda *a, **k: object())
    k = _launch.Kernels("layer_norm_scale_shift.cu", "layer_norm_scale_shift_kernel", "8P4qifiii", nvfp4=True)
    x = torch.empty(1, 1, 3072, dtype=torch.bfloat16)
    x.get_device = lambda: 0  # a CPU tensor says -1; the cache key only needs a number
    a = k.ln(x, 3072, True)
    b = k.ln(x, 3072, True, True)
    assert a is not b and asked == ["layer_norm_scale_shift_kernel<QaBF16, 0, 6>",
                                    "layer_norm_scale_shift_kernel<QaBF16, 0, 6, 1>"]
    plain = _launch.Kernels("bias_gate_residual.cu", "bias_gate_residual_kernel", "7P", threads=256)
    with pytest.raises(ValueError, match="no NVFP4 instance"):
        plain.ln(x, 3072, True, True)


def test_the_block_arithmetic_has_one_copy():
    """nvfp4.cuh is the only definition of the NVFP4 device functions; every emitting kernel includes it."""
    defs = {f.name: f.read_text() for f in CSRC.iterdir() if f.suffix in (".cu", ".cuh")}
    for fn in ("qa_e2m1_magnitude", "qa_nvfp4_block_scale", "qa_nvfp4_value", "qa_nvfp4_global_scale"):
        holders = [n for n, s in defs.items() if re.search(r"__device__[^;{]*\b" + fn + r"\(", s)]
        assert holders == ["nvfp4.cuh"], (fn, holders)
    for cu in ("quantize_nvfp4.cu", "swiglu.cu", *(f"{m}.cu" for m in LN_MODULES)):
        src = _runtime.kernel_source(cu)
        assert src.count("qa_nvfp4_block_scale(float bmax") == 1, cu


# ---------------------------------------------------------------------------- the lane layout


def _ln_groups(D: int, vectorized: bool) -> list[list[tuple[int, int]]]:
    """For each 16-element block of a row: the (thread, slot index k) pairs that hold it in the LayerNorm
    kernels' layout (thread t holds slots t + k * TH of CH elements each)."""
    _, th, ch, _ = layout(D, vectorized)
    nslots = D // ch
    owners: dict[int, list[tuple[int, int]]] = {}
    for slot in range(nslots):
        t, k = slot % th, slot // th
        for e in range(slot * ch, slot * ch + ch):
            owners.setdefault(e // 16, [])
            if (t, k) not in owners[e // 16]:
                owners[e // 16].append((t, k))
    return [owners[b] for b in sorted(owners)]


@pytest.mark.parametrize("D", [16, 48, 64, 1008, 3072, 4096, 12288, 16 * 1025])
@pytest.mark.parametrize("vectorized", [True, False])
def test_every_block_is_one_aligned_lane_group_of_one_slot_step(D, vectorized):
    """What qa_nvfp4_quantize's shuffles assume of the LayerNorm layouts when D % 16 == 0: a block is held by
    16 / CH adjacent lanes of one warp, starting at a multiple of that count, all at the same slot step k
    (so they are active or inactive together, whatever the row's last slots are)."""
    g = 16 // layout(D, vectorized)[2]
    for holders in _ln_groups(D, vectorized):
        ts = sorted(t for t, _ in holders)
        assert len(holders) == g and len({k for _, k in holders}) == 1
        assert ts == list(range(ts[0], ts[0] + g)) and ts[0] % g == 0 and ts[0] // 32 == ts[-1] // 32


def test_a_row_that_is_not_whole_blocks_breaks_the_lane_groups():
    """The gate's reason: with D % 16 != 0 some block is split across rows or slot steps."""
    D = 3076  # D % 4 == 0: the vectorized layout, one slot step spans 512 elements
    row_blocks = _ln_groups(D, True)
    assert any(len(h) != 4 or len({k for _, k in h}) != 1 for h in row_blocks)


@pytest.mark.parametrize("dtype", list(_runtime.TRAITS))
def test_swiglu_vectors_tile_blocks(dtype):
    """swiglu: element e is in vector (e % span) // (TH * VEC) ... of thread ((e % (TH * VEC)) // VEC) of CUDA
    block e // span (span = TH * VEC * UNROLL). With n % 16 == 0 a 16-block is 16 / VEC adjacent lanes of one
    warp from a multiple of 16 / VEC, at one unroll step, and no thread takes the element-wise tail."""
    sw = _mod("swiglu")
    vec = 16 // torch.empty(0, dtype=dtype).element_size()
    g, th = 16 // vec, sw.THREADS
    span = th * vec * sw.UNROLL
    for n in (16, 48, 7 * 3072, span + 16):
        for blk in range(n // 16):
            holders = set()
            for e in range(16 * blk, 16 * blk + 16):
                cta, r = divmod(e, span)
                holders.add((cta, r // (th * vec), (r % (th * vec)) // vec))
            ctas, steps, ts = {h[0] for h in holders}, {h[1] for h in holders}, sorted(h[2] for h in holders)
            assert len(ctas) == 1 and len(steps) == 1 and len(ts) == g
            assert ts == list(range(ts[0], ts[0] + g)) and ts[0] % g == 0 and ts[0] // 32 == ts[-1] // 32
        assert all(base + vec <= n for base in range(0, n, vec))  # every vector whole: never the tail branch


# ---------------------------------------------------------------------------- references


def test_references_compose_per_row_and_per_block():
    """The GPU tests compare a fused second output with quantize_nvfp4 of the fused plain output; on the CPU
    the references show what that composition is: blocks are independent, a row's blocks never mix rows,
    and the LayerNorm reference followed by the NVFP4 reference is one fake-quantized tensor per element."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 64, generator=g).bfloat16()
    shift, scale = (torch.randn(2, 64, generator=g).bfloat16() for _ in range(2))
    out = ops.layer_norm_scale_shift_reference(x, shift=shift, scale=scale)
    amax = out.float().abs().amax()
    q = qn.quantize_nvfp4_reference(out, amax)
    assert q.dtype == out.dtype and q.shape == out.shape
    by_block = torch.cat([qn.quantize_nvfp4_reference(out[..., i:i + 16].contiguous(), amax)
                          for i in range(0, 64, 16)], dim=-1)
    assert torch.equal(q.view(torch.int16), by_block.view(torch.int16))
    by_row = torch.stack([qn.quantize_nvfp4_reference(r, amax) for r in out.reshape(-1, 64)]).view_as(out)
    assert torch.equal(q.view(torch.int16), by_row.view(torch.int16))
    # NVFP4 values: at most 8 magnitudes per block, so the composition really quantized
    assert max(len(set(b.abs().tolist())) for b in q.float().reshape(-1, 16)) <= 8
    assert not torch.equal(q, out)


@pytest.mark.parametrize("activation", [None, "gelu_tanh", "silu"])
def test_quantize_nvfp4_activation_reference_is_the_eager_activation_then_the_quantizer(activation):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(7, 48, generator=g) * 3).bfloat16()
    amax = torch.tensor(6.0)
    act = {None: x, "gelu_tanh": F.gelu(x, approximate="tanh"), "silu": F.silu(x)}[activation]
    got = ops.quantize_nvfp4(x, amax, activation=activation)  # on the CPU: the reference path
    assert torch.equal(got.view(torch.int16), qn.quantize_nvfp4_reference(act, amax).view(torch.int16))
    if activation is not None:
        assert not torch.equal(got, qn.quantize_nvfp4_reference(x, amax))
