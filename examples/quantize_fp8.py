#!/usr/bin/env python
"""A ModelOpt FP8 Qwen-Image transformer from quantization to a patched model: quantize -> save -> load -> patch.

    python examples/quantize_fp8.py                                   # tiny model (--device auto), seconds on a CPU
    python examples/quantize_fp8.py --device cuda --size full --out benchmarks/results/speed

Steps, all with ModelOpt's own API (qwen_absorb.modelopt_recipe builds the config and loads the export):

1. a random transformer (tiny: 6 layers on CPU; full: the 60-layer Qwen-Image geometry) in a pipeline;
   its unquantized output is the reference;
2. mtq.quantize with the Qwen-Image FP8 recipe (FP8_DEFAULT_CFG on the transformer_blocks linears only,
   first and last 2 blocks and img_mod / txt_mod / img_mlp.net.2 left unquantized), calibrated through
   the pipeline on precomputed prompt embeddings;
3. mto.save, then mto.restore into a new transformer: its output must be bit-identical to the saved one;
4. ModelOpt's Hugging Face export (export_hf_checkpoint), loaded back into a diffusers transformer with
   qwen_absorb.modelopt_recipe.load_hf_export: its FP8 codes must be the checkpoint's, its output
   bit-identical to the saved model's (bf16/fp16; fp32 within 5% of the quantization error). ModelOpt's
   export divides by amax/448 where its fake quantization multiplies by 448/amax, which moves some FP8
   codes one step (none in the tiny model; 11.5 M of 10.6 G, 0.11%, in the 60-layer random one on the
   H200, modelopt_journey_h200.json): where it moved any,
   the reload is another FP8 model of the same weights and must be as accurate as the saved one (its
   error against the unquantized reference within 1.05x);
5. qwen_absorb.patch(..., fp8_gemm=True) on the reloaded model (cuda_graph=True on CUDA): every FP8
   linear must run as a real FP8 GEMM where the device can (CUDA sm_89+; on CPU the check uses
   capabilities={"cpu"}); its error against the unquantized reference is reported.

On CUDA it also times the unquantized eager call and the patched call (median of --repeats after
--warmup) and, with --out DIR, writes DIR/modelopt_journey_<gpu>.json (e.g. modelopt_journey_h200.json;
other configurations get their own names).

Exit codes: 0 all checks passed; 1 a check failed (the reload differs, an FP8 linear was not found);
2 bad arguments; 3 cannot run here (ModelOpt missing, not enough device memory or disk); 4 an unexpected
error (traceback printed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

import torch  # noqa: E402

import qwen_absorb  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_BAD_ARGS, EXIT_UNSUPPORTED, EXIT_ERROR = 0, 1, 2, 3, 4

# size -> (layers, image tokens per side, text tokens)
SIZES = {"tiny": (6, 4, 7), "full": (60, 64, 128)}  # full: 1024^2 = 64 x 64 packed tokens, 128 text tokens


# The export stores amax/448, which near the top of a binade a float32 amax shares with its neighbour: a
# bf16/fp16 model's amaxes are bf16/fp16 values and come back exactly (its reload must be bit-identical);
# an fp32 model's may move by an ulp, so its reload may differ by this fraction of the quantization error.
HF_TOLERANCE = 0.05


class Unsupported(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    description, epilog = C.help_texts(__doc__)
    p = C.ArgumentParser(description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=tuple(SIZES), default="tiny", help="random transformer (default tiny)")
    p.add_argument("--num-layers", type=C.positive_int, default=None, help="layers (default: tiny 6, full 60)")
    p.add_argument("--device", type=C.device_arg, default="auto",
                   help="auto (default: cuda if available, else cpu), cpu, cuda, cuda:1")
    p.add_argument("--dtype", type=C.parse_dtype, default=torch.bfloat16,
                   help="activation dtype (default bf16: the real FP8 GEMMs take bf16/fp16 activations)")
    p.add_argument("--keep-first", type=C.nonnegative_int, default=None,
                   help="first blocks left unquantized (default: the recipe's 2)")
    p.add_argument("--keep-last", type=C.nonnegative_int, default=None,
                   help="last blocks left unquantized (default: the recipe's 2)")
    p.add_argument("--sensitive", default=None, metavar="NAMES",
                   help="comma-separated block-relative layers left unquantized (default: img_mod,txt_mod,"
                        "img_mlp.net.2; '' for none)")
    p.add_argument("--calib-prompts", type=C.positive_int, default=2, help="calibration pipeline calls (default 2)")
    p.add_argument("--calib-steps", type=C.positive_int, default=2, help="denoising steps per call (default 2)")
    p.add_argument("--roundtrip", choices=("both", "mto", "hf"), default="both",
                   help="which save/load ways to run (default both: mto.save/restore and the HF export)")
    p.add_argument("--warmup", type=C.nonnegative_int, default=3,
                   help="untimed calls before timing (CUDA; CUDA-graph capture happens in them)")
    p.add_argument("--repeats", type=C.positive_int, default=5, help="timed calls, median reported (CUDA)")
    p.add_argument("--work-dir", default=None, metavar="DIR",
                   help="where the checkpoints are written (default: a temporary folder, removed at the end)")
    p.add_argument("--out", default=None, metavar="DIR", help="write the results JSON into DIR")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    layers, _, _ = SIZES[args.size]
    args.num_layers = args.num_layers or layers
    if args.sensitive is not None:
        args.sensitive = tuple(s.strip() for s in args.sensitive.split(",") if s.strip())
    for d, what in ((args.out, "--out"), (args.work_dir, "--work-dir")):
        if d is not None:
            why = C.writable_dir_problem(Path(d))
            if why:
                p.error(f"{what}: {why}")
    return args


def recipe_kwargs(args) -> dict:
    kw = {}
    if args.keep_first is not None:
        kw["keep_first"] = args.keep_first
    if args.keep_last is not None:
        kw["keep_last"] = args.keep_last
    if args.sensitive is not None:
        kw["sensitive_layers"] = args.sensitive
    return kw


def result_name(args, env) -> str:
    """One file per configuration: the GPU (or tiny + device), then what differs from the defaults."""
    if args.size == "full" and args.device.type == "cuda":
        gpu = env.get("gpu") or "cuda"
        m = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", gpu)
        parts = [(m.group(1) if m else re.sub(r"\W+", "-", gpu)).lower()]
    else:
        parts = [args.size, args.device.type]
    if args.num_layers != SIZES[args.size][0]:
        parts.append(f"{args.num_layers}layers")
    if args.dtype != torch.bfloat16:
        parts.append(C.SHORT_DTYPE[args.dtype])
    for name, value in recipe_kwargs(args).items():
        parts.append(f"{name.replace('_', '-')}-{'+'.join(value) if isinstance(value, tuple) else value}")
    if args.roundtrip != "both":
        parts.append(args.roundtrip)
    return "modelopt_journey_" + "_".join(re.sub(r"[^\w.+-]", "-", x) for x in parts) + ".json"


# ---------------------------------------------------------------------------------------------- checks


def preflight(args, recipe) -> None:
    try:
        recipe.import_modelopt()
        recipe.import_modelopt("modelopt.torch.opt")
        recipe.import_modelopt("modelopt.torch.export")
    except Exception as e:
        raise Unsupported(f"nvidia-modelopt is not importable ({type(e).__name__}: {e}); "
                          "pip install -e '.[modelopt]'") from None
    if args.size != "full":
        return
    outside, per_block = C.full_size_params(args.num_layers)
    weights = (outside + per_block * args.num_layers) * args.dtype.itemsize
    # on the device: the model and its mto-restored copy at once, or the reloaded model and its FP8 weights
    factor = 2.0 if args.roundtrip in ("both", "mto") else 1.5
    avail = C.available_memory(args.device)
    if avail is not None and weights * factor * C.MEMORY_HEADROOM > avail[0]:
        raise Unsupported(f"the {args.num_layers}-layer transformer needs about {weights * factor / 1e9:.1f} GB "
                          f"on {args.device} during the round trips ({weights / 1e9:.1f} GB of weights x "
                          f"{factor:g}); {avail[1]}. Use fewer --num-layers or --roundtrip hf")
    # on disk: the mto checkpoint (all weights) is removed before the HF export (~3/4 of them) is written
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.gettempdir())
    need = weights * (1.0 if args.roundtrip in ("both", "mto") else 0.8)
    free = shutil.disk_usage(work).free
    if need * 1.05 > free:
        raise Unsupported(f"the checkpoints need about {need / 1e9:.1f} GB in {work}, which has "
                          f"{free / 1e9:.1f} GB free; pass --work-dir on a larger disk or --roundtrip hf")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm())


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# ------------------------------------------------------------------------------------------------ run


def build(args):
    """(pipeline, transformer inputs for the comparisons, calibration calls)."""
    T = C.builders()
    layers, side, text = args.num_layers, SIZES[args.size][1], SIZES[args.size][2]
    if args.size == "tiny":
        transformer = T.tiny_transformer(dtype=args.dtype, num_layers=layers, seed=args.seed).to(args.device)
        pipe = T.tiny_pipeline(dtype=args.dtype, seed=args.seed, transformer=transformer).to(args.device)
        height = width = 64
    else:
        pipe = C.full_size_pipeline(args.dtype, args.device, num_layers=layers, seed=args.seed)
        height = width = 1024
    pipe.set_progress_bar_config(disable=True)
    dim = pipe.transformer.config.joint_attention_dim
    calls = []
    for i in range(args.calib_prompts):
        kw = C.random_prompt_kwargs(dim, args.device, args.dtype, seed=args.seed + 100 + i,
                                    length=text, neg_length=max(1, text // 4), padded=0)
        calls.append(kw)
    inputs = T.transformer_inputs(pipe.transformer, height=side, width=side, text_len=text, masked_tail=0,
                                  seed=args.seed + 1, device=args.device, dtype=args.dtype)
    return pipe, inputs, calls, (height, width)


def run_model(model, inputs) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs)[0]


def timed(model, inputs, args) -> float | None:
    """Median ms of one call (CUDA only: elsewhere the fused kernels do not run)."""
    if args.device.type != "cuda":
        return None
    for _ in range(args.warmup):
        run_model(model, inputs)
    times = []
    for _ in range(args.repeats):
        with C.Timer(args.device) as t:
            run_model(model, inputs)
        times.append(t.seconds * 1e3)
    return round(statistics.median(times), 2)


# ModelOpt's warnings that this journey triggers by design, each with why it says nothing here
MODELOPT_NOTICES = (
    # mtq.compress: real quantization is "experimental"; and, per linear, ModelOpt has no real-quant GEMM
    # for it (on CPU, or before qwen_absorb patches it): the example says what runs instead
    "Real quantization has been applied",
    "RealQuantLinear. No real-quant GEMM found",
    # mto.restore: Qwen-Image's LayerNorms have no weights, so ModelOpt cannot read a device off them
    "Could not identify the device for TensorQuantizer states",
    # export_hf_checkpoint builds a scale with torch.tensor(tensor)
    "To copy construct from a tensor",
    # on import: ModelOpt names the transformers releases it was tested with
    "transformers .* is not tested with current version of modelopt",
)


@contextlib.contextmanager
def _quiet_compress():
    with warnings.catch_warnings():
        for message in MODELOPT_NOTICES:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def free(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def journey(args, res: dict, work: Path) -> int:
    from qwen_absorb import modelopt_recipe as recipe

    preflight(args, recipe)
    failures: list[str] = []
    t0 = time.perf_counter()
    pipe, inputs, calls, (height, width) = build(args)
    model = pipe.transformer
    print(f"built a {args.num_layers}-layer {args.size} transformer ({C.SHORT_DTYPE[args.dtype]} on {args.device}) "
          f"in {time.perf_counter() - t0:.1f} s")
    y_ref = run_model(model, inputs)
    res["bf16_eager_ms" if args.dtype == torch.bfloat16 else "unquantized_eager_ms"] = timed(model, inputs, args)

    # 2. quantize with the recipe, calibrating through the pipeline
    cfg = recipe.fp8_recipe_config(model, **recipe_kwargs(args))
    t0 = time.perf_counter()
    with C._quiet_modelopt():  # (the loop is not kept: it holds the pipeline)
        recipe.quantize(model, cfg, recipe.embeds_forward_loop(pipe, calls, num_inference_steps=args.calib_steps,
                                                               height=height, width=width))
    fp8_names = recipe.quantized_linear_names(model)
    res["quantized_linears"] = len(fp8_names)
    res["calibration_s"] = round(time.perf_counter() - t0, 2)
    print(f"quantized {len(fp8_names)} linears with the recipe config in {res['calibration_s']} s "
          f"({args.calib_prompts} calibration calls x {args.calib_steps} steps)")
    y_saved = run_model(model, inputs)
    res["fake_quant_eager_ms"] = timed(model, inputs, args)
    res["fake_quant_rel_err_vs_unquantized"] = rel_err(y_saved, y_ref)

    # 3. mto.save / mto.restore
    if args.roundtrip in ("both", "mto"):
        path = work / "transformer_modelopt.pth"
        t0 = time.perf_counter()
        recipe.save(model, path)
        with C._quiet_modelopt():
            restored = recipe.restore(recipe.empty_transformer(model.config, args.dtype, args.device), path)
        path.unlink()
        same = bool(torch.equal(run_model(restored, inputs), y_saved))
        res["mto_roundtrip"] = {"bit_identical": same, "seconds": round(time.perf_counter() - t0, 2)}
        res["reload_bit_identical"] = same
        print(f"mto.save -> mto.restore: output bit-identical to the saved model: {same}")
        if not same:
            failures.append("the mto.restore'd model's output differs from the saved model's")
        if args.roundtrip == "mto":  # the restored model is the one to patch
            pipe.transformer, model = restored, restored
        del restored
        free(args.device)

    # 4. the Hugging Face export (in place: the quantized model is spent afterwards) and its loader
    reloaded = model
    if args.roundtrip in ("both", "hf"):
        # codes the export writes that are not the ones fake quantization computed with (measured first:
        # the export converts the weights in place)
        moved, total = recipe.export_code_mismatches(model)
        t0 = time.perf_counter()
        with C._quiet_modelopt():
            export_dir = recipe.export_hf(model, work / "hf_export")
        size = sum(f.stat().st_size for f in export_dir.iterdir())
        del model, reloaded
        pipe = None  # it holds the spent model too
        free(args.device)
        with C._quiet_modelopt():
            reloaded = recipe.load_hf_export(export_dir, dtype=args.dtype, device=args.device)
        shutil.rmtree(export_dir)
        # load_hf_export checked that the FP8 linears quantize to the checkpoint's codes byte for byte
        hf = {"fp8_codes_identical_to_checkpoint": True, "checkpoint_gb": round(size / 1e9, 3),
              "fp8_linears_loaded": len(recipe.quantized_linear_names(reloaded)),
              "export_codes_moved": moved, "export_codes_total": total,
              "seconds": round(time.perf_counter() - t0, 2)}
        res["hf_roundtrip"] = hf
        print(f"export_hf_checkpoint -> load_hf_export: {hf['fp8_linears_loaded']} FP8 linears holding the "
              f"checkpoint's FP8 codes byte for byte, {hf['checkpoint_gb']} GB, {hf['seconds']} s")
        y_hf = run_model(reloaded, inputs)
        diff = rel_err(y_hf, y_saved)
        err_hf, err_saved = rel_err(y_hf, y_ref), res["fake_quant_rel_err_vs_unquantized"]
        hf.update({"bit_identical_to_saved": bool(torch.equal(y_hf, y_saved)), "rel_err_vs_saved": diff,
                   "max_abs_diff_vs_saved": max_abs(y_hf, y_saved), "rel_err_vs_unquantized": err_hf})
        print(f"  its output vs the saved model's: bit-identical {hf['bit_identical_to_saved']} (rel {diff:.3g})")
        if moved:
            # ModelOpt's export divides by amax/448 where its fake quantization multiplies by 448/amax: the
            # checkpoint holds a few other codes, so its model is another FP8 model of the same weights.
            # It must be as accurate as the saved one (a deep random model turns any change into a
            # difference of the quantization error's size, so rel_err_vs_saved says nothing here).
            print(f"  the export moved {moved} of {total} FP8 weight codes one step from those of ModelOpt's "
                  f"fake quantization (it divides by amax/448, the fake quantization multiplies by 448/amax); "
                  f"error against the unquantized model: rel {err_hf:.4g} (saved model: {err_saved:.4g})")
            if err_hf > (1 + HF_TOLERANCE) * err_saved:
                failures.append(f"the reloaded export's error {err_hf:.4g} exceeds {1 + HF_TOLERANCE:g} x the saved "
                                f"model's {err_saved:.4g}")
        elif args.dtype != torch.float32 and not hf["bit_identical_to_saved"]:
            failures.append(f"the reloaded export's output differs from the saved model's (rel {diff:.3g})")
        elif diff > HF_TOLERANCE * err_saved:
            failures.append(f"the reloaded export differs from the saved model by rel {diff:.3g}, more than "
                            f"{HF_TOLERANCE:g} x the quantization error")
        res["reload_bit_identical"] = res.get("reload_bit_identical", True) and hf["bit_identical_to_saved"]
        if hf["fp8_linears_loaded"] != len(fp8_names):
            failures.append(f"the export reloaded with {hf['fp8_linears_loaded']} FP8 linears, not {len(fp8_names)}")

    # 5. patch: every FP8 linear a real FP8 GEMM where the device runs them
    kw = {"fp8_gemm": True}
    if args.device.type == "cuda":
        kw["cuda_graph"] = True
    else:
        kw["capabilities"] = {"cpu"}  # real FP8 GEMMs on the CPU: torch._scaled_mm runs there too
    report = qwen_absorb.patch(reloaded, **kw)
    summary = dict(getattr(report, "summary", {}) or {})
    n_real = int(summary.get("fp8_gemm_linears", C.fp8_gemm_count(report)) or 0)
    res["real_fp8_linears"] = n_real
    res["patch_kwargs"] = {k: sorted(v) if isinstance(v, set) else v for k, v in kw.items()}
    res["report_summary"] = C.json_safe(summary)
    y_patched = run_model(reloaded, inputs)
    res["patched_graph_ms" if kw.get("cuda_graph") else "patched_ms"] = timed(reloaded, inputs, args)
    res["rel_err_vs_bf16" if args.dtype == torch.bfloat16 else "rel_err_vs_unquantized"] = rel_err(y_patched, y_ref)
    res["patched_rel_err_vs_fake_quant"] = rel_err(y_patched, y_saved)
    how = "as real FP8 GEMMs" if args.device.type == "cuda" else (
        f"torch._scaled_mm on the {args.device.type}, forced by capabilities={{'cpu'}} to check the path's logic "
        "(fp8_gemm='auto' uses real FP8 GEMMs on validated GPUs only; not a speed path)")
    print(f"qwen_absorb.patch({', '.join(f'{k}={v}' for k, v in kw.items())}): {n_real} of {len(fp8_names)} FP8 "
          f"linears in the blocks run {how}; error against the unquantized model: rel "
          f"{rel_err(y_patched, y_ref):.4g} (fake quant: {res['fake_quant_rel_err_vs_unquantized']:.4g})")
    if n_real != len(fp8_names):
        failures.append(f"qwen_absorb.patch ran {n_real} of the {len(fp8_names)} FP8 linears as real FP8 GEMMs")
    if args.device.type == "cuda":
        print(f"timings (median of {args.repeats} after {args.warmup} warm-up): unquantized eager "
              f"{res.get('bf16_eager_ms', res.get('unquantized_eager_ms'))} ms, fake quant eager "
              f"{res['fake_quant_eager_ms']} ms, patched real FP8 + CUDA graph {res['patched_graph_ms']} ms")
    res["failures"] = failures
    res["status"] = "pass" if not failures else "fail"
    return EXIT_OK if not failures else EXIT_FAILED


def main(argv=None) -> int:
    args = parse_args(argv)
    env = C.environment(args.device)
    res = {"status": "error",
           "config": {"size": args.size, "num_layers": args.num_layers, "device": str(args.device),
                      "dtype": str(args.dtype), "recipe": recipe_kwargs(args) or "defaults",
                      "calib_prompts": args.calib_prompts, "calib_steps": args.calib_steps,
                      "roundtrip": args.roundtrip, "warmup": args.warmup, "repeats": args.repeats},
           "gpu": env.get("gpu"), "date": env["date"], "versions": {
               k: env.get(k) for k in ("torch", "torch_cuda", "diffusers", "nvidia_modelopt", "cupy", "python")},
           "qwen_absorb": getattr(qwen_absorb, "__version__", None), "qwen_absorb_commit": env["qwen_absorb_commit"],
           "environment": env}
    tmp = None
    if args.work_dir:
        work = Path(args.work_dir)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="qwen_absorb_fp8_")
        work = Path(tmp.name)
    t0 = time.perf_counter()
    try:
        with _quiet_compress():
            code = journey(args, res, work)
    except Unsupported as e:
        res["status"], res["error"] = "unsupported", str(e)
        print(f"CANNOT RUN HERE: {e}", file=sys.stderr)
        code = EXIT_UNSUPPORTED
    except Exception as e:
        res["status"], res["error"] = "error", f"{type(e).__name__}: {e}"
        traceback.print_exc()
        print(f"FAILED with an exception: {type(e).__name__}: {e}", file=sys.stderr)
        code = EXIT_ERROR
    finally:
        if tmp is not None:
            tmp.cleanup()
    res["total_s"] = round(time.perf_counter() - t0, 1)
    if args.out:
        path = Path(args.out) / result_name(args, env)
        C.write_atomic(path, json.dumps(C.json_safe(res), indent=2) + "\n")
        print(f"wrote {path}")
    if code == EXIT_OK:
        print("PASS")
    elif code == EXIT_FAILED:
        print("FAIL: " + "; ".join(res["failures"]), file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
