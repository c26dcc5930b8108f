"""Context or tensor parallelism (diffusers 0.42.1) with and without qwen_absorb, on N GPUs (or CPU processes).

Launch one process per GPU with torchrun. Rank 0 first runs the model on one GPU (the reference,
unless --no-single), then every rank runs it with diffusers' parallelism, unpatched and patched:

    torchrun --nproc_per_node=2 examples/parallel.py --mode cp --ulysses 2 --patch
    torchrun --nproc_per_node=2 examples/parallel.py --mode tp --patch --num-layers 8 --resolution 2048
    torchrun --nproc_per_node=2 examples/parallel.py --mode cp --ring 2 --attn-backend _native_cudnn --no-mask
    torchrun --nproc_per_node=2 examples/parallel.py --mode cp --ulysses 2 --patch --quant fp8 --num-layers 4
    torchrun --nproc_per_node=2 examples/parallel.py --mode tp --patch --quant fp8 --num-layers 4
    torchrun --nproc_per_node=2 examples/parallel.py --size tiny --pipeline --mode tp --patch   # CPU: gloo

It prints the forward (or pipeline) time on one GPU and in parallel, unpatched and patched, and
whether the outputs agree: patched parallel vs unpatched parallel (bit-identical when no bias is
deferred and no kernel rounds differently, i.e. always for bf16/fp16/fp32 models; up to rounding
with deferred FP8 biases) and parallel vs one GPU (equal up to reduction order).

Models are random (nothing is downloaded): ``--size full`` is the real Qwen-Image geometry
(``--num-layers`` of the 60 blocks, bf16, ~0.34 GB per block), ``--size tiny`` the 2-block test
model (fp32). Without CUDA the processes use gloo on the CPU (diffusers needs two small
monkey-patches for that, applied by ``qwen_absorb.parallel.allow_cpu_parallelism``).

Notes: CP splits the image and text sequences across ranks, so both must be divisible by the CP
degree (``--text-len``; image tokens are (resolution/16)^2). TP needs the head count (24, tiny: 2)
divisible by the world size; diffusers 0.42.1 cannot tensor-parallelise a ModelOpt-quantized model
(with ``--quant fp8 --mode tp`` the model is parallelised first, then quantized, and there is no
one-GPU run). Ring attention needs a backend that returns the LSE
(``--attn-backend _native_cudnn`` or flash), the default ``native`` supports Ulysses only.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TINY_HEADS, FULL_HEADS = 2, 24


def parse_args(argv=None) -> argparse.Namespace:
    description, _, epilog = __doc__.strip("\n").partition("\n\n")  # every line of the docstring once
    p = argparse.ArgumentParser(description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("cp", "tp"), required=True, help="context (cp) or tensor (tp) parallelism")
    p.add_argument("--ulysses", type=int, default=None, help="CP: Ulysses degree (default: world size)")
    p.add_argument("--ring", type=int, default=None, help="CP: ring degree (needs an LSE backend, see --attn-backend)")
    p.add_argument("--attn-backend", default=None,
                   help="diffusers attention backend (default: native; ring needs e.g. _native_cudnn)")
    p.add_argument("--patch", action="store_true", help="also run the model patched by qwen_absorb")
    p.add_argument("--patch-order", choices=("after", "before"), default="after",
                   help="patch after enable_parallelism (default) or before it")
    p.add_argument("--quant", choices=("none", "fp8"), default="none", help="ModelOpt FP8 (fake quant, calibrated)")
    p.add_argument("--defer-bias", choices=("auto", "true", "false"), default="auto")
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on CUDA, tiny on CPU")
    p.add_argument("--num-layers", type=int, default=None, help="blocks (default: full 60, tiny 2)")
    p.add_argument("--pipeline", action="store_true", help="run a tiny QwenImagePipeline (needs --size tiny)")
    p.add_argument("--resolution", type=int, default=None,
                   help="image side in pixels, a multiple of 16 (default: full 1024, tiny 64)")
    p.add_argument("--text-len", type=int, default=None, help="text tokens (default: full 128, tiny 8)")
    p.add_argument("--no-mask", action="store_true", help="no text padding mask (all tokens valid)")
    p.add_argument("--steps", type=int, default=2, help="--pipeline: denoising steps")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default: full bf16, tiny fp32")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed runs (median reported)")
    p.add_argument("--no-single", action="store_true", help="skip the one-GPU reference on rank 0")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless patched parallel == unpatched parallel bit for bit (when no bias is deferred)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    _validate(p, a)
    return a


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ or world < 2:
        p.error("launch with torchrun --nproc_per_node=N, N >= 2 (one process per GPU)")
    import torch  # noqa: PLC0415

    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: this torch sees no CUDA device")
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", world)):
            p.error(f"{os.environ.get('LOCAL_WORLD_SIZE', world)} processes on this node but only "
                    f"{torch.cuda.device_count()} GPUs")
    a.size = a.size or ("full" if a.device == "cuda" else "tiny")
    if a.pipeline and a.size != "tiny":
        p.error("--pipeline runs the tiny pipeline only (no full-size VAE / text encoder): add --size tiny")
    a.num_layers = a.num_layers if a.num_layers is not None else (60 if a.size == "full" else 2)
    if not 1 <= a.num_layers <= 60:
        p.error("--num-layers must be in 1..60")
    if a.size == "full" and a.device == "cpu" and a.num_layers > 2:
        p.error("--size full on the CPU: at most --num-layers 2 (each block is ~0.34 GB in bf16 and slow); "
                "use --size tiny")
    a.resolution = a.resolution or (1024 if a.size == "full" else 64)
    a.text_len = a.text_len or (128 if a.size == "full" else 8)
    a.dtype = a.dtype or ("bf16" if a.size == "full" else "fp32")
    if a.resolution % 16 or a.resolution < 16:
        p.error("--resolution must be a positive multiple of 16")
    if a.text_len < 1 or a.iters < 1 or a.warmup < 0 or a.steps < 1:
        p.error("--text-len, --iters and --steps must be >= 1, --warmup >= 0")
    if a.mode == "tp":
        if a.ulysses or a.ring:
            p.error("--ulysses / --ring are for --mode cp")
        heads = FULL_HEADS if a.size == "full" else TINY_HEADS
        if heads % world:
            p.error(f"--mode tp: the world size {world} must divide the {heads} attention heads")
        if a.quant != "none":
            # diffusers 0.42.1 cannot tensor-parallelise a ModelOpt-quantized model (parallelize_module
            # fails on the quantizer submodules): enable_parallelism first, then mtq.quantize. The model
            # on one GPU would then be another calibration, so there is no one-GPU reference.
            if a.patch and a.patch_order == "before":
                p.error("--mode tp --quant fp8 quantizes after enable_parallelism: patch after it (--patch-order after)")
            a.no_single = True
        a.degree = world
    else:
        u, r = a.ulysses or 1, a.ring or 1
        if a.ulysses is None and a.ring is None:
            u = world
        if u < 1 or r < 1 or u * r != world:
            p.error(f"--mode cp: ulysses ({u}) x ring ({r}) must equal the world size ({world})")
        a.ulysses, a.ring, a.degree = u, r, u * r
        if r > 1 and a.attn_backend in (None, "native"):
            p.error("ring attention needs a backend that returns the LSE: pass --attn-backend _native_cudnn "
                    "(or flash); diffusers' native backend supports Ulysses only")
        img_tokens = (a.resolution // 16) ** 2 if a.size == "full" else (a.resolution // 8) ** 2
        if img_tokens % a.degree or a.text_len % a.degree:
            p.error(f"--mode cp: image tokens ({img_tokens}) and --text-len ({a.text_len}) must be divisible by "
                    f"the CP degree {a.degree}")


# ------------------------------------------------------------------------------------------ setup


def init_distributed(device_type: str):
    import datetime  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    return rank, world, device


def sync(device) -> None:
    import torch  # noqa: PLC0415

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain(t):
    """The model output as a plain tensor: CP's all-gathered output is an AsyncCollectiveTensor."""
    from qwen_absorb.parallel import local_view  # noqa: PLC0415

    v, why = local_view(t)
    if v is None:
        raise RuntimeError(f"model output is not a full local tensor: {why}")
    return v


def build(a, device, dtype):
    """(model or pipeline, transformer, call) for this configuration; same weights on every rank."""
    import torch  # noqa: PLC0415

    from tests import builders as T  # noqa: PLC0415 - the clone's root is on sys.path (top of this file)

    if a.size == "full":
        tr = T.full_size_transformer(num_layers=a.num_layers, dtype=dtype, device=device, seed=a.seed)
    else:
        tr = T.tiny_transformer(dtype=dtype, num_layers=a.num_layers, seed=a.seed).to(device)
    if a.attn_backend:
        tr.set_attention_backend(a.attn_backend)
    if not a.pipeline:
        side = a.resolution // 16 if a.size == "full" else a.resolution // 8
        inputs = T.transformer_inputs(tr, height=side, width=side, text_len=a.text_len,
                                      masked_tail=0 if a.no_mask else 2, seed=a.seed, device=device, dtype=dtype)
        if a.quant == "fp8":
            tr._example_quantize = lambda: T.fp8_quantize(tr, inputs)

        def call():
            with torch.inference_mode():
                return plain(tr(**inputs)[0])
        return tr, tr, call

    pipe = T.tiny_pipeline(dtype=dtype, seed=a.seed, transformer=tr).to(device)
    embeds, mask = T.tiny_prompt_embeds(seq_len=a.text_len, masked_tail=0 if a.no_mask else 2, seed=a.seed,
                                        dtype=dtype, device=device)
    if a.quant == "fp8":
        side = a.resolution // 8
        tr._example_quantize = lambda: T.fp8_quantize(
            tr, T.transformer_inputs(tr, height=side, width=side, text_len=a.text_len, device=device))

    def call():
        gen = torch.Generator(device="cpu").manual_seed(a.seed)
        with torch.inference_mode():
            return pipe(prompt_embeds=embeds, prompt_embeds_mask=mask, height=a.resolution, width=a.resolution,
                        num_inference_steps=a.steps, generator=gen, output_type="pt", true_cfg_scale=1.0).images
    return pipe, tr, call


def timed(call, device, warmup: int, iters: int, barrier: bool):
    """(median ms, last output). With ``barrier`` all ranks start each run together."""
    import torch.distributed as dist  # noqa: PLC0415

    out = None
    for _ in range(warmup):
        out = call()
    times = []
    for _ in range(iters):
        if barrier:
            dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        out = call()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), out


def compare(a_, b_) -> dict:
    import torch  # noqa: PLC0415

    a32, b32 = a_.float(), b_.float()
    diff = (a32 - b32).abs()
    return {"bit_identical": bool(torch.equal(a_, b_)), "max_abs": float(diff.max()),
            "rel_err": float(diff.norm() / b32.norm().clamp_min(1e-30))}


def parallel_config(a):
    from diffusers import ContextParallelConfig, TensorParallelConfig  # noqa: PLC0415

    if a.mode == "tp":
        return TensorParallelConfig(tp_degree=a.degree)
    return ContextParallelConfig(ulysses_degree=a.ulysses, ring_degree=a.ring)


def main(argv=None) -> int:
    a = parse_args(argv)
    import contextlib  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import qwen_absorb  # noqa: PLC0415
    from qwen_absorb.parallel import allow_cpu_parallelism  # noqa: PLC0415

    rank, world, device = init_distributed(a.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    defer = {"auto": "auto", "true": True, "false": False}[a.defer_bias]
    say = print if rank == 0 else (lambda *x, **k: None)
    say(f"{a.mode} over {world} ranks ({device.type}), {a.size} model, {a.num_layers} blocks, {a.dtype}, "
        f"quant {a.quant}, {'pipeline ' + str(a.steps) + ' steps' if a.pipeline else 'forward'}, "
        f"{a.resolution}^2, text {a.text_len}", flush=True)
    cpu_ctx = allow_cpu_parallelism() if device.type == "cpu" else contextlib.nullcontext()
    with cpu_ctx:
        target, tr, call = build(a, device, dtype)
        quantize = tr.__dict__.pop("_example_quantize", None)
        if quantize is not None and a.mode == "cp":
            quantize()  # CP leaves the weights alone: quantize once, for the one-GPU run too
        rows, outs = {}, {}
        if not a.no_single:
            if rank == 0:
                rows["single unpatched"], outs["single"] = timed(call, device, a.warmup, a.iters, False)
                if a.patch:
                    qwen_absorb.patch(target, defer_bias=defer)
                    rows["single patched"], outs["single patched"] = timed(call, device, a.warmup, a.iters, False)
                    qwen_absorb.unpatch(target)
            dist.barrier()
        report = None
        if a.patch and a.patch_order == "before":
            report = qwen_absorb.patch(target, defer_bias=defer)
        tr.enable_parallelism(config=parallel_config(a))
        if quantize is not None and a.mode == "tp":
            quantize()  # after enable_parallelism: ModelOpt calibrates the sharded weights
        if report is None:
            rows["parallel unpatched"], outs["parallel"] = timed(call, device, a.warmup, a.iters, True)
        if a.patch:
            if report is None:
                report = qwen_absorb.patch(target, defer_bias=defer)
            rows["parallel patched"], outs["parallel patched"] = timed(call, device, a.warmup, a.iters, True)
            if a.patch_order == "before":
                qwen_absorb.unpatch(target)
                rows["parallel unpatched"], outs["parallel"] = timed(call, device, a.warmup, a.iters, True)

    # every rank holds the full output (TP and CP replicate it); they must agree
    ref_out = outs.get("parallel patched", outs["parallel"]).contiguous()
    gathered = [torch.empty_like(ref_out) for _ in range(world)]
    dist.all_gather(gathered, ref_out)
    ranks_agree = all(torch.equal(g, gathered[0]) for g in gathered)
    slow = {k: torch.tensor(v, dtype=torch.float64, device=device) for k, v in rows.items() if "parallel" in k}
    for v in slow.values():
        dist.all_reduce(v, op=dist.ReduceOp.MAX)  # a parallel step is as slow as its slowest rank
    rc = 0
    if rank == 0:
        base = rows.get("single unpatched")
        if device.type != "cuda":  # gloo on CPU: a test of the wiring, not of speed
            say(f"\n{device.type} wall-clock, not a speed measurement (median of {a.iters} after {a.warmup} warm-up):")
        say(f"\n{'run':<22}{'median ms':>12}{'vs 1 GPU':>10}")
        for k, v in rows.items():
            v = float(slow[k]) if k in slow else v
            say(f"{k:<22}{v:>12.2f}{(base / v if base else float('nan')):>9.2f}x")
        say(f"\nranks agree on the output: {ranks_agree}")
        if "parallel patched" in outs:
            c = compare(outs["parallel patched"], outs["parallel"])
            deferred = report.summary["biases_deferred"] if report is not None else 0
            say(f"patched vs unpatched {a.mode}: bit-identical {c['bit_identical']}, max |diff| {c['max_abs']:.3g}, "
                f"rel err {c['rel_err']:.3g} (biases deferred: {deferred})")
            say(f"runtime fallbacks: {dict(report.runtime_fallbacks) or 'none'}")
            if a.check and deferred == 0 and not c["bit_identical"]:
                rc = 1
        if "single" in outs:
            for k in ("parallel", "parallel patched"):
                if k in outs:
                    c = compare(outs[k], outs["single"])
                    say(f"{k} vs 1 GPU: max |diff| {c['max_abs']:.3g}, rel err {c['rel_err']:.3g}")
        if not ranks_agree:
            rc = 1
    rc_t = torch.tensor(rc, device=device)
    dist.broadcast(rc_t, 0)
    dist.destroy_process_group()
    return int(rc_t)


if __name__ == "__main__":
    sys.exit(main())
