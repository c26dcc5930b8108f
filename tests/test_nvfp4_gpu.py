"""NVFP4 on the GPU: the quantize_nvfp4 kernel against ModelOpt's own CUDA fake quantization (its Triton
kernel, through ModelOpt's op), and NVFP4 linears / a tiny NVFP4 model run by qwen_absorb.nvfp4 against
ModelOpt's fake-quantized ones, eager and in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")
pytest.importorskip("modelopt.torch.quantization")

from qwen_absorb import nvfp4  # noqa: E402
from . import builders as T  # noqa: E402
from qwen_absorb.hf_export import import_modelopt  # noqa: E402
from qwen_absorb.ops import quantize_nvfp4, quantize_nvfp4_not_supported_reasons, quantize_nvfp4_reference  # noqa: E402

DEV = torch.device("cuda")


def _modelopt(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's CUDA NVFP4 fake quantization, through the op its TensorQuantizer calls."""
    tq = import_modelopt("modelopt.torch.quantization.tensor_quant")
    return tq.dynamic_block_quantize_op(x, 16, amax, 4, 2, 8, 4)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    """'' when bit-identical, else the count and the first differing values (for the log)."""
    bad = (_bits(got) != _bits(want)).reshape(-1)
    if not bad.any():
        return ""
    idx = bad.nonzero().flatten()[:6]
    return (f"{int(bad.sum())} of {bad.numel()} differ; got {got.reshape(-1)[idx].tolist()} "
            f"want {want.reshape(-1)[idx].tolist()}")


def _poisoned_call(x, amax):
    # fill the allocator's next blocks with NaN so an unwritten output element shows
    junk = torch.full((x.numel() + 4096,), float("nan"), dtype=x.dtype, device=x.device)
    del junk
    return quantize_nvfp4(x, amax)


def test_modelopt_takes_its_triton_path_here():
    kern = import_modelopt("modelopt.torch.kernels.quantization.gemm")
    assert kern.IS_AVAILABLE and hasattr(kern, "fp4_fake_quant_block"), "ModelOpt would not use its Triton kernel"


SHAPES = [(1, 16), (3, 40), (7, 1000), (129, 3072), (2, 77, 3072), (4, 12288), (5, 24)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_is_bit_identical_to_modelopt(shape, dtype):
    g = torch.Generator(device="cuda").manual_seed(hash((shape, str(dtype))) % 2**31)
    x = (torch.randn(shape, generator=g, device=DEV) * 3).to(dtype)
    for amax in (x.float().abs().amax(), x.float().abs().amax() * 0.5, torch.tensor(200.0, device=DEV)):
        assert not quantize_nvfp4_not_supported_reasons(x, amax)
        got, want = _poisoned_call(x, amax), _modelopt(x, amax)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert not _mismatch(got, want), f"amax {float(amax)}: {_mismatch(got, want)}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_edges_subnormals_zero_blocks_nan_inf(dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(64, 3072, generator=g, device=DEV)).to(dtype)
    x[0, :16] = 0                                   # a zero block
    x[1] *= 1e-4                                    # block scales below e4m3's normal range, and the 1e-5 floor
    x[2] = torch.finfo(dtype).tiny / 4              # subnormal inputs
    x[3, 5], x[3, 40], x[3, 41] = float("nan"), float("inf"), -float("inf")
    x[4, 16:32] = float("nan")                      # an all-NaN block
    x[5, ::2] = -0.0
    for amax in (torch.tensor(4.0, device=DEV), torch.tensor(0.0, device=DEV), torch.tensor(1e-30, device=DEV)):
        got, want = _poisoned_call(x, amax), _modelopt(x, amax)
        assert not _mismatch(got, want), f"amax {float(amax)}: {_mismatch(got, want)}"


def test_kernel_reads_strided_rows_and_the_reference_is_close():
    g = torch.Generator(device="cuda").manual_seed(4)
    big = torch.randn(300, 4096, generator=g, device=DEV).bfloat16()
    x = big[:, 512:512 + 3072]  # rows 4096 apart
    amax = x.float().abs().amax()
    assert torch.equal(_bits(quantize_nvfp4(x, amax)), _bits(_modelopt(x.contiguous(), amax)))
    # the reference divides with IEEE rounding, ModelOpt's Triton kernel with div.full.f32: rare elements differ
    # (894 of 921,600 here on the H200, round 25: about 1e-3)
    ref = quantize_nvfp4_reference(x, amax)
    differ = int((_bits(ref) != _bits(_modelopt(x.contiguous(), amax))).sum())
    assert differ <= x.numel() * 2e-3, differ


def _nvfp4_model(dtype=torch.bfloat16):
    from qwen_absorb import modelopt_recipe as recipe  # noqa: PLC0415

    model = T.tiny_transformer(num_layers=4, dtype=dtype).to(DEV)
    inputs = T.transformer_inputs(model, device=DEV)
    recipe.quantize(model, recipe.nvfp4_recipe_config(model, keep_first=1, keep_last=1),
                    lambda m: T.run_transformer(m, inputs))
    return model, inputs


def test_nvfp4_linears_eager_and_graphed_are_modelopts():
    model, _ = _nvfp4_model()
    modules = dict(model.named_modules())
    g = torch.Generator(device="cuda").manual_seed(6)
    for name in nvfp4.nvfp4_linear_names(model):
        lin = modules[name]
        runner = nvfp4.Nvfp4Linear(lin, use_kernel=True)
        x = (torch.randn(2, 33, lin.in_features, generator=g, device=DEV) * 2).bfloat16()
        with torch.no_grad():
            assert torch.equal(runner(x), lin(x)), name
            static_x = x.clone()
            runner(static_x)  # warm: the weight is made outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_y = runner(static_x)
            fresh = (torch.randn(static_x.shape, generator=g, device=DEV) * 3).bfloat16()
            static_x.copy_(fresh)
            graph.replay()
            assert torch.equal(static_y, lin(fresh)), name


def test_model_with_nvfp4_runners_is_bit_identical_to_modelopt_fake_quant():
    model, inputs = _nvfp4_model()
    want = T.run_transformer(model, inputs)
    modules = dict(model.named_modules())
    names = nvfp4.nvfp4_linear_names(model)
    runners = {n: nvfp4.Nvfp4Linear(modules[n], use_kernel=True) for n in names}
    try:
        for n, r in runners.items():
            modules[n].forward = r
        got = T.run_transformer(model, inputs)
    finally:
        for n in runners:
            del modules[n].forward
    assert torch.equal(got, want)
    # on-grid weights (an export's): fake quantization is the identity on them and the runner shares them
    with torch.no_grad():
        for n in names:
            lin = modules[n]
            lin.weight.copy_(_modelopt(lin.weight, lin.weight_quantizer.amax))
    shared = [nvfp4.Nvfp4Linear(modules[n], use_kernel=True) for n in names]
    for r in shared:
        r.weight()
    assert all(r.shares_weight for r in shared)


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_patched_nvfp4_model_is_bit_identical_to_fake_quant(cuda_graph):
    import qwen_absorb  # noqa: PLC0415

    model, inputs = _nvfp4_model()
    want = T.run_transformer(model, inputs)
    rep = qwen_absorb.patch(model, cuda_graph=cuda_graph)
    try:
        plan = getattr(model.transformer_blocks[1], "_qwen_absorb_plan")
        assert plan.nvfp4, rep
        outs = [T.run_transformer(model, inputs) for _ in range(3)]  # warm-up, capture, replay
    finally:
        qwen_absorb.unpatch(model)
    for got in outs:
        assert torch.equal(got, want)
    assert torch.equal(T.run_transformer(model, inputs), want)
