"""NVFP4 emitted by the fused kernels (issue 39 B), on the GPU: every launcher given ``nvfp4_amax`` writes a
second output equal bit for bit to the standalone ``quantize_nvfp4.launch`` of its own plain output (and to
ModelOpt's fake quantization of it where ModelOpt is importable), with its plain output unchanged; the
standalone kernel's activations equal torch's eager activation followed by the quantizer.

Inputs are random with outliers, 16-blocks of zeros and of subnormal-size values (in the fused ops' outputs:
modulation columns with scale -1 and a zero or tiny shift), rows 1, 7 and 4096 + 3, D 64, 3072 and 12288 (the
three LayerNorm variants: one slot a thread, registers, streaming), bf16/fp16/fp32, with and without
per-token modulation rows. Outputs are poisoned (the allocator's next blocks filled with NaN bits first).
"""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from qwen_absorb.ops import _runtime  # noqa: E402

if _runtime.cupy_unavailable_reason() is not None:
    pytest.skip(f"CuPy cannot run the kernels: {_runtime.cupy_unavailable_reason()}", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("NVFP4 fake quantization is ModelOpt's sm_89+ path (Triton, hardware e4m3)", allow_module_level=True)

import qwen_absorb.ops as ops  # noqa: E402

qn = importlib.import_module("qwen_absorb.ops.quantize_nvfp4")
lnss = importlib.import_module("qwen_absorb.ops.layer_norm_scale_shift")
brln = importlib.import_module("qwen_absorb.ops.bias_residual_layer_norm_scale_shift")
lns = importlib.import_module("qwen_absorb.ops.layer_norm_scale")
tgln = importlib.import_module("qwen_absorb.ops.tanh_gate_residual_layer_norm_scale")
swiglu = importlib.import_module("qwen_absorb.ops.swiglu")

DEV = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROWS = [1, 7, 4096 + 3]
DS = [64, 3072, 12288]
EPS = 1e-6


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    bad = (_bits(got) != _bits(want)).reshape(-1)
    if bad.any():
        idx = bad.nonzero().flatten()[:6]
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ; got "
                             f"{got.reshape(-1)[idx].tolist()} want {want.reshape(-1)[idx].tolist()}")


def _poison(nbytes: int) -> None:
    """The next cached blocks filled with 0xFFFF (NaN in bf16, fp16 and fp32): an element a kernel does not
    write shows as NaN, which no NVFP4 value is."""
    junk = [torch.full((max(nbytes, 1 << 20) // 2 + 8,), -1, dtype=torch.int16, device=DEV) for _ in range(3)]
    del junk


def _amax(v: float) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.float32, device=DEV)


def _amaxes(out: torch.Tensor) -> list[torch.Tensor]:
    """The calibrated amax as it would be (the output's), a larger one (small block scales, the 1e-5 floor)
    and a tiny one (every block scale saturated at 448 * gs)."""
    return [out.float().abs().amax().reshape(1), _amax(200.0), _amax(1e-30)]


def _modelopt():
    """ModelOpt's CUDA NVFP4 fake quantization (its Triton kernel), or skip the calling test."""
    pytest.importorskip("modelopt.torch.quantization")
    from qwen_absorb.hf_export import import_modelopt

    tq = import_modelopt("modelopt.torch.quantization.tensor_quant")
    return lambda x, amax: tq.dynamic_block_quantize_op(x, 16, amax.reshape(()), 4, 2, 8, 4)


def _gen(*key) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(zlib.crc32(repr(key).encode()))  # the same seed every run


def _like_eager(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """A LayerNorm-family plain output against the eager expression, by the standard of tests/test_ops_gpu.py
    (at least 99.9% bit-identical, at most 1 ulp apart; a one-row output may have 2 elements 1 ulp off): the fused
    ops' outputs are what the NVFP4 outputs are checked against, so they must be the ones the model computes."""
    from .ops_helpers import ln_output_stats

    assert torch.equal(got.isnan(), want.isnan()), what
    st = ln_output_stats(got, want)
    differ = round((1.0 - st["identical"]) * got.numel())
    assert st["max_ulp"] <= 1 and differ <= max(2, got.numel() // 1000), f"{what}: {st}"


def _activation(B: int, L: int, D: int, dtype, g, misaligned: bool = False) -> torch.Tensor:
    """[B, L, D] random with outliers (a misaligned one: a contiguous view one element into its buffer)."""
    n = B * L * D
    base = torch.randn(n + 1, generator=g, device=DEV) * 3
    base[::97] *= 40  # outliers: a few elements far above their block's others
    base = base.to(dtype)
    return (base[1:] if misaligned else base[:n]).view(B, L, D)


def _modulation(R: int, D: int, dtype, g, shift: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scale, shift) rows [R, D]: columns 16:32 give an all-zero output block (scale -1, shift 0), columns
    32:48 a block of subnormal-size values (scale -1, shift ~1e-6; the 2.1 ops have no shift: their block is
    signed zeros), column 50 an outlier shift."""
    sc = (torch.randn(R, D, generator=g, device=DEV) * 0.5).to(dtype)
    sc[:, 16:48] = -1
    if not shift:
        return sc, None
    sh = torch.randn(R, D, generator=g, device=DEV).to(dtype)
    sh[:, 16:32] = 0
    sh[:, 32:48] = (torch.randn(R, 16, generator=g, device=DEV) * 1e-6).to(dtype)
    sh[:, 50] = 500
    return sc, sh


def _check_emitter(run, plain_out: torch.Tensor, what: str) -> None:
    """``run(out, nvfp4_amax) -> (out or None, second)``: for each amax, the second output equals the
    standalone kernel on the plain output, the plain output is the plain launch's, and out=False gives the
    same second output."""
    for amax in _amaxes(plain_out):
        _poison(plain_out.numel() * plain_out.element_size())
        o, q = run(True, amax)
        _same_bits(o, plain_out, f"{what}: out of the NVFP4 instance")
        _same_bits(q, qn.launch(o, amax), f"{what}: second output, amax {float(amax)}")
        assert not torch.isnan(q).any(), what
        _poison(plain_out.numel() * plain_out.element_size())
        none, q2 = run(False, amax)
        assert none is None
        _same_bits(q2, q, f"{what}: second output with out=False")


# ---------------------------------------------------------------------------- Qwen-Image


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("L", ROWS)
@pytest.mark.parametrize("misaligned", [False, True])
def test_layer_norm_scale_shift_emits_nvfp4(dtype, D, L, misaligned):
    g = _gen("lnss", str(dtype), D, L, misaligned)
    x = _activation(1, L, D, dtype, g, misaligned)
    scale, shift = _modulation(1, D, dtype, g)
    plain, _ = lnss.launch(x, shift, scale, EPS, None)
    _like_eager(plain, ops.layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=EPS), "plain vs eager")

    def run(out, amax):
        return lnss.launch(x, shift, scale, EPS, None, out=out, nvfp4_amax=amax)

    _check_emitter(run, plain, f"layer_norm_scale_shift {dtype} D={D} L={L} misaligned={misaligned}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L", [7, 4096 + 3])
def test_layer_norm_scale_shift_emits_nvfp4_with_index_rows(dtype, L):
    g = _gen("lnss-index", str(dtype), L)
    B, D = 2, 3072
    x = _activation(B, L, D, dtype, g)
    scale, shift = _modulation(2 * B, D, dtype, g)
    index = (torch.rand(B, L, generator=g, device=DEV) > 0.5).long()
    plain, _ = lnss.launch(x, shift, scale, EPS, index)
    _like_eager(plain, ops.layer_norm_scale_shift_reference(x, shift=shift, scale=scale, eps=EPS, index=index),
                "plain vs eager")
    _check_emitter(lambda out, amax: lnss.launch(x, shift, scale, EPS, index, out=out, nvfp4_amax=amax), plain,
                   f"layer_norm_scale_shift index {dtype} L={L}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("L", ROWS)
@pytest.mark.parametrize("indexed", [False, True])
def test_bias_residual_layer_norm_scale_shift_emits_nvfp4(dtype, D, L, indexed):
    g = _gen("brln", str(dtype), D, L, indexed)
    B = 2 if indexed else 1
    R = 2 * B if indexed else B
    residual, x = _activation(B, L, D, dtype, g), _activation(B, L, D, dtype, g)
    bias = torch.randn(D, generator=g, device=DEV).to(dtype)
    gate = torch.randn(R, D, generator=g, device=DEV).to(dtype)
    scale, shift = _modulation(R, D, dtype, g)
    index = (torch.rand(B, L, generator=g, device=DEV) > 0.5).long() if indexed else None
    h, plain, _ = brln.launch(residual, x, bias, gate, shift, scale, EPS, index, None, 0)
    want_h, want = ops.bias_residual_layer_norm_scale_shift_reference(
        residual, x, bias=bias, gate=gate, shift=shift, scale=scale, eps=EPS, index=index)
    _same_bits(h, want_h, "residual vs eager")
    _like_eager(plain, want, "plain vs eager")

    def run(out, amax):
        h2, o, q = brln.launch(residual, x, bias, gate, shift, scale, EPS, index, None, 0, out=out, nvfp4_amax=amax)
        _same_bits(h2, h, "new residual of the NVFP4 instance")
        return o, q

    _check_emitter(run, plain, f"bias_residual_layer_norm_scale_shift {dtype} D={D} L={L} indexed={indexed}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_scale_shift_nan_and_inf_rows(dtype):
    """A row holding NaN or inf normalises to NaN: its blocks take ModelOpt's NaN policy (the all-NaN block
    max saturates the scale, every element becomes -6 s) in the fused path as in the standalone one."""
    g = _gen("lnss-nan", str(dtype))
    x = _activation(1, 9, 3072, dtype, g)
    x[0, 2, 5], x[0, 4, 100], x[0, 6, 7] = float("nan"), float("inf"), -float("inf")
    scale, shift = _modulation(1, 3072, dtype, g)
    plain, _ = lnss.launch(x, shift, scale, EPS, None)
    assert plain.isnan().any()
    _check_emitter(lambda out, amax: lnss.launch(x, shift, scale, EPS, None, out=out, nvfp4_amax=amax),
                   plain, f"layer_norm_scale_shift NaN rows {dtype}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 3072])
def test_fused_second_outputs_are_modelopts_fake_quantization(dtype, D):
    """The end-to-end claim of issue 39 B for the Qwen-Image sites: the emitted NVFP4 input of to_q/to_k/to_v
    (norm1) and of net[0].proj (norm2) is what ModelOpt's NVFP4 input quantizer computes from the same output."""
    modelopt = _modelopt()
    g = _gen("modelopt", str(dtype), D)
    B, L = 2, 4096 + 3
    x, attn = _activation(B, L, D, dtype, g), _activation(B, L, D, dtype, g)
    scale, shift = _modulation(2 * B, D, dtype, g)
    gate = torch.randn(2 * B, D, generator=g, device=DEV).to(dtype)
    index = (torch.rand(B, L, generator=g, device=DEV) > 0.5).long()
    o1, _ = lnss.launch(x, shift, scale, EPS, index)
    _, o2, _ = brln.launch(x, attn, None, gate, shift, scale, EPS, index, None, 0)
    for amax in _amaxes(o1):
        _poison(o1.numel() * o1.element_size())
        _, q1 = lnss.launch(x, shift, scale, EPS, index, out=False, nvfp4_amax=amax)
        _same_bits(q1, modelopt(o1, amax), f"norm1 vs ModelOpt, amax {float(amax)}")
        _, _, q2 = brln.launch(x, attn, None, gate, shift, scale, EPS, index, None, 0, out=False, nvfp4_amax=amax)
        _same_bits(q2, modelopt(o2, amax), f"norm2 vs ModelOpt, amax {float(amax)}")


# ---------------------------------------------------------------------------- Qwen-Image-2.1


def _mask(L: int, g) -> torch.Tensor:
    return torch.rand(L, generator=g, device=DEV) > 0.3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("L", ROWS)
@pytest.mark.parametrize("masked", [False, True])
def test_layer_norm_scale_emits_nvfp4(dtype, D, L, masked):
    g = _gen("lns", str(dtype), D, L, masked)
    B = 2
    x = _activation(B, L, D, dtype, g, misaligned=(L == 7))  # L = 7: the rowwise (one element a lane) layout
    scale, _ = _modulation(B + 1 if masked else B, D, dtype, g, shift=False)
    mask = _mask(L, g) if masked else None
    plain, _ = lns.launch(x, scale, EPS, mask)
    _like_eager(plain, ops.layer_norm_scale_reference(x, scale=scale, eps=EPS, target_token_mask=mask),
                "plain vs eager")
    _check_emitter(lambda out, amax: lns.launch(x, scale, EPS, mask, out=out, nvfp4_amax=amax), plain,
                   f"layer_norm_scale {dtype} D={D} L={L} masked={masked}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("L", ROWS)
@pytest.mark.parametrize("masked", [False, True])
def test_tanh_gate_residual_layer_norm_scale_emits_nvfp4(dtype, D, L, masked):
    g = _gen("tgln", str(dtype), D, L, masked)
    B = 2
    R = B + 1 if masked else B
    residual, x = _activation(B, L, D, dtype, g), _activation(B, L, D, dtype, g)
    gate = torch.randn(R, D, generator=g, device=DEV).to(dtype)
    scale, _ = _modulation(R, D, dtype, g, shift=False)
    mask = _mask(L, g) if masked else None
    clip = dtype == torch.float16
    h, plain, _ = tgln.launch(residual, x, gate, scale, EPS, mask, clip)
    want_h, want = ops.tanh_gate_residual_layer_norm_scale_reference(
        residual, x, gate=gate, scale=scale, eps=EPS, target_token_mask=mask, clip_fp16=clip)
    _same_bits(h, want_h, "residual vs eager")
    _like_eager(plain, want, "plain vs eager")

    def run(out, amax):
        h2, o, q = tgln.launch(residual, x, gate, scale, EPS, mask, clip, out=out, nvfp4_amax=amax)
        _same_bits(h2, h, "new residual of the NVFP4 instance")
        return o, q

    _check_emitter(run, plain, f"tanh_gate_residual_layer_norm_scale {dtype} D={D} L={L} masked={masked}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", DS)
@pytest.mark.parametrize("rows", ROWS)
def test_swiglu_emits_nvfp4(dtype, D, rows):
    g = _gen("swiglu", str(dtype), D, rows)
    a = (torch.randn(rows, D, generator=g, device=DEV) * 3).to(dtype)
    b = (torch.randn(rows, D, generator=g, device=DEV) * 3).to(dtype)
    b[:, 16:32] = 0  # an all-zero block
    b[:, 32:48] *= 1e-6  # subnormal-size values (fp16 subnormals)
    b[:, ::97] *= 40  # outliers
    plain, _ = swiglu.launch(a, b)
    _same_bits(plain, ops.swiglu_reference(a, b), "plain vs eager")
    _check_emitter(lambda out, amax: swiglu.launch(a, b, out=out, nvfp4_amax=amax), plain,
                   f"swiglu {dtype} D={D} rows={rows}")


# ---------------------------------------------------------------------------- the standalone kernel's activations


ACTS = {None: lambda x: x, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
qf8 = importlib.import_module("qwen_absorb.ops.quantize_fp8")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [40, *DS])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("act", list(ACTS))
def test_quantize_nvfp4_activation_is_eager_then_quantize(dtype, D, rows, act):
    """``quantize_nvfp4.launch(x, amax, act)`` is the quantizer on the activation as quantize_fp8's kernel
    computes and rounds it (the same device code: exact), which is torch's eager activation (exact for bf16 and
    fp16, as quantize_fp8's GELU measured on the H200; fp32 is allowed a few boundary elements per million,
    counted in the log). D = 40: a padded last block. Also through the public op."""
    g = _gen("qact", str(dtype), D, rows, act)
    x = (torch.randn(rows, D, generator=g, device=DEV) * 3).to(dtype)
    x[:, ::37] *= 20
    x[:, :16] = 0
    eager = ACTS[act](x)
    if act is None:
        own = x
    else:
        _, _, own = qf8.launch(x.view(1, rows, D), 0, None, _amax(1.0), act, act_out=True)
        own = own.view(rows, D)
    for amax in _amaxes(eager):
        what = f"{act} {dtype} D={D} rows={rows} amax {float(amax)}"
        _poison(x.numel() * x.element_size())
        got = qn.launch(x, amax, act)
        _same_bits(got, qn.launch(own, amax), f"{what}: vs quantize_fp8's activation")
        want = qn.launch(eager, amax)
        if dtype == torch.float32 and act == "gelu_tanh":
            differ = int((_bits(got) != _bits(want)).sum())
            print(f"NVFP4 of GELU(tanh) fp32 D={D} rows={rows}: {differ} of {got.numel()} differ from eager's")
            assert differ <= max(1, got.numel() // 100_000), what
        else:
            _same_bits(got, want, f"{what}: vs eager activation")
        _same_bits(ops.quantize_nvfp4(x, amax, activation=act), got, f"{what}: public op")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_quantize_nvfp4_activation_is_modelopts(dtype, act):
    """ModelOpt's NVFP4 input quantizer of net[2] / img_mod[1] sees torch's eager activation."""
    modelopt = _modelopt()
    g = _gen("qact-modelopt", str(dtype), act)
    x = (torch.randn(2, 4096 + 3, 3072, generator=g, device=DEV) * 3).to(dtype)
    eager = ACTS[act](x)
    for amax in _amaxes(eager):
        _same_bits(qn.launch(x, amax, act), modelopt(eager, amax), f"{act} vs ModelOpt, amax {float(amax)}")
