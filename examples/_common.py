"""Shared helpers for the qwen_absorb examples (compare_outputs.py, benchmark.py).

Nothing here is public API. The random models come from the clone's ``tests/builders.py`` (:func:`builders`)
and a small private fallback covers only what it does not offer.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import importlib
import importlib.metadata as _md
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def ensure_qwen_absorb_importable() -> None:
    """Let the examples run from a checkout that was not pip-installed (e.g. on a GPU box with PYTHONPATH)."""
    try:
        importlib.import_module("qwen_absorb")
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        importlib.import_module("qwen_absorb")


ensure_qwen_absorb_importable()

import torch  # noqa: E402

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
SHORT_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with one-line errors: ``script.py: error: <why> (--help: usage)``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help: usage)\n")


def parse_dtype(name: str) -> torch.dtype:
    """argparse ``type=``: an unknown name is an argument error (exit 2), not a crash."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    """For scripts without ``device_arg``: as :func:`parse_device`, exiting with the reason when it fails."""
    try:
        return parse_device(name)
    except ValueError as e:
        raise SystemExit(f"--device {name}: {e}") from None


def parse_device(name: str) -> torch.device:
    """``auto`` -> cuda if available else cpu; anything else must parse and exist (ValueError says why)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name!r} is not a device torch knows (e.g. auto, cpu, cuda, cuda:1)") from None
    why = device_problem(dev)
    if why:
        raise ValueError(why)
    return dev


def device_problem(dev: torch.device) -> str | None:
    """Why ``dev`` cannot hold the example's tensors on this machine, or None."""
    if dev.type == "cpu":
        return None if dev.index in (None, 0) else f"{dev}: there is one CPU device, use cpu"
    if dev.type == "meta":
        return "meta tensors hold no data: nothing to generate or time"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return f"{dev}: this torch ({torch.__version__}) sees no CUDA device"
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            return f"{dev} does not exist: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}"
        return None
    try:  # other backends (mps, xpu, ...): can a tensor live there at all?
        torch.empty(0, device=dev)
    except Exception as e:
        return f"{dev} is not usable here ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def device_arg(name: str) -> torch.device:
    """argparse ``type=`` for --device: parsed and checked to exist before any work (else exit 2)."""
    try:
        return parse_device(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


# Options that are "auto", True or False in qwen_absorb.patch are spelled auto / true / false on every
# example's command line (bare --cuda-graph also means true); plain switches are --x (and --no-x where both exist).
TRISTATE = ("auto", "true", "false")


def tristate(text: str) -> str:
    """argparse ``type=`` for an option the API takes as ``"auto"``, ``True`` or ``False``."""
    value = text.lower()
    if value not in TRISTATE:
        raise argparse.ArgumentTypeError(f"{text!r}: choose auto, true or false (the API's 'auto', True, False)")
    return value


def tristate_value(text: str) -> str | bool:
    """``"auto"`` / ``"true"`` / ``"false"`` -> the API's ``"auto"`` / ``True`` / ``False``."""
    return {"auto": "auto", "true": True, "false": False}[text]


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts that must be >= 1 (steps, layers, repeats, ...)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def multiple_of_16(text: str) -> int:
    """Image sides: the pipelines pack 2x2 latent pixels of an 8x VAE, so one token is 16x16 pixels;
    other sizes are silently rounded down by diffusers (to 0 below 16, which crashes)."""
    value = positive_int(text)
    if value % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {value}")
    return value


def file_tag(text: str) -> str:
    """--tag becomes part of file names: no path separators (it would write elsewhere), not empty."""
    if not text or any(c in text for c in "/\\\0") or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"{text!r} is not usable in a file name")
    return text


def writable_dir_problem(path: Path) -> str | None:
    """Create ``path`` if needed and write a probe file into it: an unwritable --out is found before
    minutes of work, not after. Returns why it is unusable, or None. (A real write, not os.access:
    os.access says yes to root even on a read-only mount.)"""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create the folder {str(path)!r}: {e.strerror or e}"
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write_probe_")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write into {str(path)!r}: {e.strerror or e}"
    return None


_UMASK = os.umask(0o022)  # read the process umask (the only way is to set it) and put it back
os.umask(_UMASK)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path``, then rename it over ``path``: a reader
    (or a run killed mid-write) sees the old complete file or the new one, never half of one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are meant to be shared like any file
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def plural(n: int, word: str) -> str:
    """"1 layer", "8 layers"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def help_texts(doc: str) -> tuple[str, str]:
    """(description, epilog) for argparse from a script's docstring: its first paragraph, then the rest,
    so that ``--help`` prints every line once."""
    first, _, rest = doc.strip("\n").partition("\n\n")
    return first, rest


def timings_are_speed(device: torch.device) -> bool:
    """Only CUDA timings say anything about qwen_absorb's speed: elsewhere the kernels do not run, and
    CPU wall-clock of these small runs swung from 0.07x to 21x between identical runs."""
    return device.type == "cuda"


CPU_TIMING_NOTE = ("not a speed measurement: the fused kernels need CUDA, and CPU wall-clock of these runs "
                   "varies many-fold between identical runs")


# ----------------------------------------------------------------------------------------------------
# Options of qwen_absorb.patch that the examples expose


def patch_options(args) -> dict:
    """Keyword arguments for ``qwen_absorb.patch`` from --cuda-graph / --fp8-gemm.

    Only non-default choices are passed, so the default path works with a qwen_absorb that predates
    these options (it would raise TypeError for an unknown keyword).
    """
    kw = {}
    for name in ("cuda_graph", "fp8_gemm"):
        value = getattr(args, name, "auto")
        if value != "auto":
            kw[name] = tristate_value(value)
    return kw


def patch_supports(name: str, patch_fn=None) -> bool:
    """Whether ``qwen_absorb.patch`` (or ``patch_fn``) takes the keyword ``name``."""
    fn = patch_fn or importlib.import_module("qwen_absorb").patch
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def unsupported_patch_options(kwargs: dict, patch_fn=None) -> str | None:
    """A sentence naming the requested patch options this qwen_absorb lacks, or None."""
    missing = [k for k in kwargs if not patch_supports(k, patch_fn)]
    if not missing:
        return None
    return (f"this qwen_absorb's patch() has no {', '.join(f'{k}=' for k in missing)} option "
            "(it predates it); update qwen_absorb or leave the switch at its default")


# ----------------------------------------------------------------------------------------------------
# Memory needed by the full-size random transformer


FAMILIES = ("qwenimage", "qwenimage21")  # --family: Qwen-Image, Qwen-Image-2.1
FAMILY_NAMES = {"qwenimage": "Qwen-Image", "qwenimage21": "Qwen-Image-2.1"}


def _param_count(num_layers: int, family: str = "qwenimage") -> int:
    """Parameters of the full-size transformer of ``family`` with ``num_layers`` blocks, counted on meta."""
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel

    with torch.device("meta"):
        if family == "qwenimage21":  # diffusers' default config is the full-size 2.1 geometry
            model = QwenImage21Transformer2DModel(num_layers=num_layers)
        else:
            model = QwenImageTransformer2DModel(**{**builders().FULL_SIZE_CONFIG, "num_layers": num_layers})
    return sum(p.numel() for p in model.parameters())


def full_size_params(num_layers: int, family: str = "qwenimage") -> tuple[int, int]:
    """(parameters outside the blocks, parameters per block) of the full-size transformer: Qwen-Image
    (``tests/builders.py``'s ``FULL_SIZE_CONFIG``) about 40.5 M + 340 M per block, 20.4 B for 60 blocks;
    Qwen-Image-2.1 about 7.1 B for 32 blocks. Built on meta: no memory, well under a second."""
    outside = _param_count(0, family)
    return outside, _param_count(1, family) - outside


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """(bytes free for new tensors, where) on ``device``, or None where it cannot be told."""
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        free, _ = torch.cuda.mem_get_info(idx)
        return free, f"{device} ({torch.cuda.get_device_name(idx)}) has {free / 1e9:.1f} GB free"
    if device.type == "cpu":
        avail = _host_available_bytes()
        return None if avail is None else (avail, f"this host has {avail / 1e9:.1f} GB of RAM available")
    return None


def _host_available_bytes() -> int | None:
    try:  # Linux: MemAvailable counts reclaimable page cache, unlike the free pages sysconf reports
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


MEMORY_HEADROOM = 1.10  # activations, the VAE and ModelOpt's quantizer state on top of the weights


def full_size_memory_problem(num_layers: int, dtype: torch.dtype, device: torch.device,
                             family: str = "qwenimage") -> str | None:
    """Why a full-size ``family`` transformer of ``num_layers`` blocks in ``dtype`` will not fit on ``device``, or None.

    Refusing up front beats an out-of-memory kill (or a swapping host) after minutes: 60 fp32 blocks are
    ~82 GB of weights alone.
    """
    avail = available_memory(device)
    if avail is None:
        return None
    free, where = avail
    outside, per_block = full_size_params(num_layers, family)
    size = dtype.itemsize
    need = (outside + per_block * num_layers) * size
    if need * MEMORY_HEADROOM <= free:
        return None
    fit = int((free / MEMORY_HEADROOM - outside * size) // (per_block * size))
    hint = f"at most --num-layers {fit} fits" if fit >= 1 else "not even one layer fits"
    return (f"the full-size {FAMILY_NAMES[family]} transformer with {plural(num_layers, 'layer')} in "
            f"{SHORT_DTYPE.get(dtype, dtype)} needs about "
            f"{need / 1e9:.1f} GB for its weights alone ({(outside + per_block * num_layers) / 1e9:.2f} B "
            f"parameters x {size} bytes, {per_block * size / 1e9:.2f} GB per layer), plus about "
            f"{(MEMORY_HEADROOM - 1) * 100:.0f}% for activations; {where}. {hint[0].upper() + hint[1:]} here; "
            "use fewer --num-layers, a 2-byte --dtype, or a device with more memory")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------
# Environment record (for JSON results)


def _version(dist: str) -> str | None:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None


def cupy_version() -> str | None:
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy"):
        v = _version(dist)
        if v:
            return f"{dist} {v}"
    return None


def environment(device: torch.device) -> dict:
    env = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "nvidia_modelopt": _version("nvidia-modelopt"),
        "cupy": cupy_version(),
        "qwen_absorb": importlib.import_module("qwen_absorb").__version__,
        "qwen_absorb_commit": git_commit(),
        "device": str(device),
        "gpu": None,
        "gpu_capability": None,
        "driver": None,
    }
    if device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        env["gpu"] = torch.cuda.get_device_name(idx)
        cap = torch.cuda.get_device_capability(idx)
        env["gpu_capability"] = f"sm_{cap[0]}{cap[1]}"
        env["driver"] = nvidia_driver_version()
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["cpu_threads"] = torch.get_num_threads()
    return env


def nvidia_driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        line = out.stdout.strip().splitlines()
        return line[0].strip() if out.returncode == 0 and line else None
    except Exception:
        return None


def git_commit() -> str | None:
    head = REPO_ROOT / ".git" / "HEAD"
    try:
        ref = head.read_text().strip()
        if ref.startswith("ref: "):
            ref_path = REPO_ROOT / ".git" / ref[5:]
            if ref_path.exists():
                return ref_path.read_text().strip()[:12]
            packed = REPO_ROOT / ".git" / "packed-refs"
            for line in packed.read_text().splitlines() if packed.exists() else []:
                if line.endswith(ref[5:]):
                    return line.split()[0][:12]
            return None
        return ref[:12]
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------------
# Models


def builders():
    """The clone's tests/builders.py. It is not part of the installed package (nor of the wheel's
    qwen_absorb_examples), so the random models need a clone: its root goes on sys.path, since
    ``python examples/x.py`` puts only examples/ there."""
    if not (REPO_ROOT / "tests" / "builders.py").is_file():
        raise RuntimeError("the random models are built by tests/builders.py of a qwen_absorb clone, "
                           f"not found under {REPO_ROOT}; run the example from a clone, or pass --model")
    if str(REPO_ROOT) not in sys.path:
        sys.path.append(str(REPO_ROOT))
    return importlib.import_module("tests.builders")


def tiny_vae(z_dim: int, scale_factor: int = 4, dtype=torch.float32, device="cpu"):
    """A tiny random Qwen-Image VAE. ``scale_factor`` 4 or 8 (pixels per latent pixel)."""
    from diffusers import AutoencoderKLQwenImage

    if scale_factor == 4:
        dim_mult, down = [1, 2, 4], [False, True]
    elif scale_factor == 8:
        dim_mult, down = [1, 2, 4, 4], [False, True, True]
    else:
        raise ValueError("scale_factor must be 4 or 8")
    vae = AutoencoderKLQwenImage(
        base_dim=4 * 6, z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=1, temperal_downsample=down,
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    )
    return builders()._in_dtype(vae, dtype).to(device).eval()  # no diffusers "keep in float32" warning


def tiny_pipeline(dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The embedded tiny random QwenImagePipeline (no text encoder) from tests/builders.py."""
    t = builders()
    pipe = t.tiny_pipeline(dtype=dtype, seed=seed)
    return pipe.to(device)


def tiny_prompt_kwargs(pipe, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """Precomputed prompt embeddings (and negative ones, so true CFG runs) for a pipeline without text encoder."""
    t = builders()
    dim = pipe.transformer.config.joint_attention_dim
    pe, mask = t.tiny_prompt_embeds(seq_len=7, dim=dim, masked_tail=2, seed=seed + 1, dtype=dtype, device=device)
    npe, nmask = t.tiny_prompt_embeds(seq_len=3, dim=dim, masked_tail=0, seed=seed + 2, dtype=dtype, device=device)
    return {
        "prompt_embeds": pe,
        "prompt_embeds_mask": mask,
        "negative_prompt_embeds": npe,
        "negative_prompt_embeds_mask": nmask,
        "true_cfg_scale": 4.0,
    }


def random_prompt_kwargs(dim: int, device: torch.device, dtype: torch.dtype, seed: int = 0,
                         length: int = 7, neg_length: int = 3, padded: int = 2) -> dict:
    """Random prompt embeddings with a padded mask, plus all-ones negative ones (true CFG on)."""
    g = torch.Generator().manual_seed(seed + 1234)
    pe = torch.randn(1, length, dim, generator=g)
    mask = torch.ones(1, length, dtype=torch.long)
    if padded:
        mask[:, length - padded:] = 0
    npe = torch.randn(1, neg_length, dim, generator=g)
    nmask = torch.ones(1, neg_length, dtype=torch.long)
    return {
        "prompt_embeds": pe.to(device=device, dtype=dtype),
        "prompt_embeds_mask": mask.to(device),
        "negative_prompt_embeds": npe.to(device=device, dtype=dtype),
        "negative_prompt_embeds_mask": nmask.to(device),
        "true_cfg_scale": 4.0,
    }


def full_size_pipeline(dtype: torch.dtype, device: torch.device, num_layers: int, seed: int = 0):
    """A full-width (hidden 3072, 24x128 heads) random transformer with a tiny random VAE (8x), no text encoder."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    transformer = full_size_transformer(num_layers=num_layers, dtype=dtype, device=device, seed=seed)
    vae = tiny_vae(z_dim=transformer.config.out_channels, scale_factor=8, dtype=dtype, device=device)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
        transformer=transformer,
    )
    return pipe


def full_size_transformer(num_layers: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    t = builders()
    return t.full_size_transformer(num_layers=num_layers, dtype=dtype, device=device, seed=seed).eval()


def tiny_transformer(dtype: torch.dtype, device: torch.device, seed: int = 0, num_layers: int = 2):
    return builders().tiny_transformer(dtype=dtype, num_layers=num_layers, seed=seed).to(device).eval()


def qwenimage21_pipeline(size: str, dtype: torch.dtype, device: torch.device, num_layers: int, seed: int = 0,
                         cfg: float = 4.0):
    """A random QwenImage21Pipeline (no text encoder, no processor) and its call / calibration arguments:
    ``(pipe, call_kwargs, calib_kwargs(i))``. ``size`` "tiny": tests/builders.py's 2-block 2.1 transformer;
    "full": the real 2.1 geometry (4096 = 32 x 128) with ``num_layers`` blocks; both with a tiny 16x VAE.
    Prompt embeddings are random, text only (the pipeline takes no precomputed condition-image embeddings);
    negative ones too, so ``cfg`` > 1 runs true CFG as for Qwen-Image."""
    t = builders()
    transformer = None
    if size == "full":
        transformer = t.random_qwenimage21_transformer(num_layers=num_layers, dtype=dtype, device=device, seed=seed)
    pipe = t.tiny_qwenimage21_pipeline(dtype=dtype, seed=seed, transformer=transformer).to(device)
    length = 7 if size == "tiny" else 32

    def embeds(s: int) -> dict:
        dim = pipe.transformer.config.context_in_dim
        pe, pm = t.qwenimage21_prompt_embeds(seq_len=length, dim=dim, seed=s + 1, dtype=dtype, device=device)
        ne, nm = t.qwenimage21_prompt_embeds(seq_len=3, dim=dim, seed=s + 2, dtype=dtype, device=device)
        return {"prompt_embeds": pe, "prompt_embeds_mask": pm, "negative_prompt_embeds": ne,
                "negative_prompt_embeds_mask": nm, "true_cfg_scale": cfg}

    return pipe, embeds(seed), lambda i: embeds(seed + 100 + i)


class ModelArgumentError(Exception):
    """--model names nothing loadable: a missing folder, a hub id offline and not cached, a repository
    that does not exist. The scripts print it as one line and exit 2."""


def model_problem(model: str) -> str | None:
    """Why ``--model`` cannot be loaded, found without loading anything (so in a second), or None.

    A local folder must exist and hold ``model_index.json``; anything that is not a folder must be a valid
    hub id, and with ``HF_HUB_OFFLINE=1`` it must be in the local Hugging Face cache."""
    path = Path(model).expanduser()
    looks_local = path.is_absolute() or model.startswith((".", "~")) or path.exists() or model.count("/") > 1
    if path.is_dir():
        return None if (path / "model_index.json").is_file() else (
            f"{model} is a folder without model_index.json: not a diffusers pipeline")
    if looks_local:
        return f"{model}: no such folder" if not path.exists() else f"{model} is a file, not a pipeline folder"
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:  # pragma: no cover - diffusers depends on huggingface_hub
        return None
    try:
        validate_repo_id(model)
    except HFValidationError:
        return f"{model!r} is neither a folder nor a valid Hugging Face hub id (owner/name)"
    if hub_offline() and cached_snapshot(model) is None:
        return (f"{model}: the hub is offline (HF_HUB_OFFLINE=1) and this id is not in the local Hugging Face "
                "cache; download it first or pass a local folder")
    return None


def hub_offline() -> bool:
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a hub pipeline, or None if its model_index.json is not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "model_index.json")
    except Exception:
        return None
    return Path(found).parent if isinstance(found, str) else None


def _safetensors_params(files) -> tuple[int, int]:
    """(parameters, files read) from the headers of safetensors files (8-byte length + JSON header)."""
    import struct

    total = read = 0
    for f in files:
        try:
            with open(f, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
        except (OSError, ValueError, struct.error):
            continue
        read += 1
        for name, meta in header.items():
            if name != "__metadata__":
                total += math.prod(meta.get("shape", [])) if meta.get("shape") else 1
    return total, read


def model_memory_problem(model: str, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the pipeline ``model`` in ``dtype`` will not fit on ``device``, or None (also when it cannot be
    told: a hub id that is not cached locally). Counted from the safetensors headers of every component,
    since ``.to(device)`` moves them all."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        folder = cached_snapshot(model)
        if folder is None:
            return None
    files = sorted(folder.glob("*/*.safetensors")) + sorted(folder.glob("*.safetensors"))
    params, read = _safetensors_params(files)
    avail = available_memory(device)
    if not read or avail is None:
        return None
    need = params * dtype.itemsize
    free, where = avail
    if need * MEMORY_HEADROOM <= free:
        return None
    return (f"{model} has {params / 1e9:.2f} B parameters in its components, about {need / 1e9:.1f} GB in "
            f"{SHORT_DTYPE.get(dtype, dtype)} plus about {(MEMORY_HEADROOM - 1) * 100:.0f}% for activations; "
            f"{where}. Use a 2-byte --dtype or a device with more memory")


def load_pipeline(model: str, dtype: torch.dtype, device: torch.device):
    """Real weights: a local folder or a hub id (needs the hub for an id that is not cached).

    Failures that mean the argument names nothing loadable raise :class:`ModelArgumentError`."""
    from diffusers import DiffusionPipeline

    why = model_problem(model)
    if why:
        raise ModelArgumentError(why)
    try:
        pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype)
    except (OSError, ValueError) as e:  # hub errors (not found, offline, gated) are OSErrors / ValueErrors
        if not _is_lookup_error(e):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        first = first.replace(" Please check out the root cause in the stacktrace above.", "")  # none is printed
        raise ModelArgumentError(f"{model}: {first}") from None
    return pipe.to(device)


def _is_lookup_error(e: BaseException) -> bool:
    names = {type(x).__name__ for x in (e, e.__cause__, e.__context__) if x is not None}
    return bool(names & {"RepositoryNotFoundError", "GatedRepoError", "LocalEntryNotFoundError",
                         "EntryNotFoundError", "RevisionNotFoundError", "HFValidationError",
                         "OfflineModeIsEnabled", "FileNotFoundError"}) or "does not appear to have" in str(e)


# ----------------------------------------------------------------------------------------------------
# ModelOpt quantization

QUANT_FORMATS = ("none", "fp8", "nvfp4")


def import_modelopt(name: str = "modelopt.torch.quantization"):
    """ModelOpt, first imported in a thread whose stack holds no model: ModelOpt's first import pins the
    frames that run it (qwen_absorb.modelopt_recipe.import_modelopt says why)."""
    return importlib.import_module("qwen_absorb.modelopt_recipe").import_modelopt(name)


def quant_unavailable_reason(fmt: str, device: torch.device) -> str | None:
    """Why ``fmt`` cannot run here, or None."""
    if fmt == "none":
        return None
    try:
        import_modelopt()
    except Exception as e:  # ImportError, or modelopt failing to import its own deps
        return f"nvidia-modelopt is not importable ({type(e).__name__}: {e}); pip install 'qwen_absorb[modelopt]'"
    if fmt == "nvfp4" and device.type != "cuda":
        return ("ModelOpt's NVFP4 fake quantization (dynamic 16-element block scales for activations) runs "
                "only on CUDA: its quantizer asserts that amax is a CUDA tensor. Run --quant nvfp4 on a GPU.")
    return None


def quantize_transformer(transformer, fmt: str, forward_loop) -> dict:
    """``mtq.quantize`` the transformer in place with ModelOpt's stock config for ``fmt``.

    ``forward_loop(model)`` runs calibration data through the model (max calibration of the static amaxes).
    Returns a small description for the results.
    """
    mtq = import_modelopt()
    cfg = {"fp8": mtq.FP8_DEFAULT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG}[fmt]
    t0 = time.perf_counter()
    with _quiet_modelopt():
        mtq.quantize(transformer, copy.deepcopy(cfg), forward_loop)
    n_enabled = n_in_blocks = 0
    for name, m in transformer.named_modules():
        q = getattr(m, "weight_quantizer", None)
        if q is not None and getattr(q, "is_enabled", False):
            n_enabled += 1
            n_in_blocks += name.startswith("transformer_blocks.")
    return {
        "format": fmt,
        "config": {"fp8": "mtq.FP8_DEFAULT_CFG", "nvfp4": "mtq.NVFP4_DEFAULT_CFG"}[fmt],
        "quantized_linears": n_enabled,
        # the report counts these: the patch runs the blocks; the rest (img_in, txt_in, the time embedding,
        # proj_out) run as ModelOpt runs them
        "quantized_linears_in_blocks": n_in_blocks,
        "calibration_s": round(time.perf_counter() - t0, 3),
    }


@contextlib.contextmanager
def _quiet_modelopt():
    """ModelOpt prints one line per inserted quantizer group; keep the example output readable."""
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        yield


# ----------------------------------------------------------------------------------------------------
# Report helpers (the PatchReport API of qwen_absorb.patch)


def report_dict(report) -> dict:
    try:
        return report.to_dict()
    except Exception as e:  # keep the example useful even if the report cannot be serialised
        return {"error": f"report.to_dict() failed: {type(e).__name__}: {e}", "str": str(report)}


def kernels_note(report) -> str | None:
    """A plain sentence when the fused CUDA kernels could not run, else None."""
    if getattr(report, "kernels_available", False):
        return None
    # the reason itself is in the report printed just before: said once
    return ("The fused CUDA kernels could NOT run here (why: the report above). The patched blocks ran the torch "
            "references (diffusers' expressions, same rounding): this run checks the patch's wiring and exactness, "
            "not speed. A CUDA GPU with CuPy runs the kernels.")


def fp8_gemm_count(report) -> int:
    """Linears the patch runs as real FP8 GEMMs (entries ``{"path": ..., "fp8_gemm": True}`` anywhere in
    ``report.to_dict()``); 0 for a qwen_absorb without the fp8_gemm option. Read from the report rather
    than from the request: ``fp8_gemm=True`` still refuses a linear where it would be wrong or cannot run."""
    def walk(node) -> int:
        if isinstance(node, dict):
            own = int(node.get("fp8_gemm") is True and "path" in node)
            return own + sum(walk(v) for v in node.values())
        if isinstance(node, (list, tuple)):
            return sum(walk(v) for v in node)
        return 0

    try:
        return walk(report.to_dict())
    except Exception:  # a report that cannot serialise says nothing either way
        return 0


def runtime_fallbacks(report) -> dict:
    fb = getattr(report, "runtime_fallbacks", None)
    return {str(k): int(v) for k, v in dict(fb or {}).items()}


# ----------------------------------------------------------------------------------------------------
# Image metrics (scikit-image) and the side-by-side PNG


def to_hwc(images: torch.Tensor):
    """[B, C, H, W] in [0, 1] -> numpy float64 [B, H, W, C] (C = 3; 4 for Qwen-Image-2.1's RGBA VAE)."""
    return images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().double().numpy()


def image_metrics(ref, test) -> dict:
    """max abs / mean abs difference, PSNR and SSIM (scikit-image) of two [B, H, W, C] arrays in [0, 1]."""
    import numpy as np
    from skimage.metrics import peak_signal_noise_ratio, structural_similarity

    diff = np.abs(ref - test)
    psnrs, ssims = [], []
    for a, b in zip(ref, test):
        if np.array_equal(a, b):
            psnrs.append(math.inf)
            ssims.append(1.0)
            continue
        psnrs.append(float(peak_signal_noise_ratio(a, b, data_range=1.0)))
        win = min(7, a.shape[0], a.shape[1])
        win -= 1 - win % 2  # odd
        ssims.append(float(structural_similarity(a, b, data_range=1.0, channel_axis=-1, win_size=win)))
    return {
        "identical": bool(np.array_equal(ref, test)),
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "mean_abs": float(diff.mean()) if diff.size else 0.0,
        "psnr_db": min(psnrs),
        "ssim": min(ssims),
        "differing_pixels_fraction": float((diff.max(axis=-1) > 0).mean()) if diff.size else 0.0,
    }


def json_safe(obj):
    """inf/nan -> strings, tensors/paths -> str, recursively."""
    if isinstance(obj, float):
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        if math.isnan(obj):
            return "nan"
        return obj
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj)
    return str(obj)


def fmt_psnr(v: float) -> str:
    return "inf (identical)" if math.isinf(v) else f"{v:.2f} dB"


def side_by_side_png(ref, test, path: Path, caption_lines: list[str], amplify: float | None = None,
                     min_panel: int = 256, max_panel: int = 512,
                     titles: tuple[str, str] = ("unpatched", "patched (qwen_absorb)")) -> float:
    """Save ref | test | amplified |difference| of the first image, with a caption below.

    ``titles`` name the first two panels. Returns the amplification factor used.
    """
    import numpy as np
    from PIL import Image, ImageDraw

    a, b = ref[0], test[0]
    diff = np.abs(a - b)
    dmax = float(diff.max())
    if amplify is None:
        amplify = 1.0 if dmax == 0 else float(min(1000.0, max(1.0, 1.0 / dmax)))
    d = np.clip(diff * amplify, 0, 1)
    h, w = a.shape[:2]
    scale = max(1, math.ceil(min_panel / max(h, w)))
    panels = []
    for arr in (a, b, d):
        im = Image.fromarray((arr * 255).round().astype(np.uint8)).convert("RGB")  # RGBA: the metrics keep alpha
        if scale > 1:
            im = im.resize((w * scale, h * scale), Image.NEAREST)
        elif max(h, w) > max_panel:  # keep the PNG small; the JSON has the exact metrics
            f = max_panel / max(h, w)
            im = im.resize((max(1, round(w * f)), max(1, round(h * f))), Image.LANCZOS)
        panels.append(im)
    pw, ph = panels[0].size
    gap = 8
    font = _font(max(14, (3 * pw) // 60))
    titles = [*titles, "identical (difference is zero)" if dmax == 0 else f"|difference| x {amplify:.3g}"]
    fsize = max(14, (3 * pw) // 60)
    line_h = fsize + 6
    width = 3 * pw + 4 * gap
    lines = [ln for text in caption_lines for ln in _wrap(text, max(20, int(width / (0.56 * fsize))))]
    height = gap + line_h + ph + gap + line_h * len(lines) + gap
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (panel, title) in enumerate(zip(panels, titles)):
        x = gap + i * (pw + gap)
        draw.text((x, gap), title, fill=(0, 0, 0), font=font)
        canvas.paste(panel, (x, gap + line_h))
    y = gap + line_h + ph + gap
    for ln in lines:
        draw.text((gap, y), ln, fill=(0, 0, 0), font=font)
        y += line_h
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")  # atomic, as write_atomic: never a truncated PNG
    canvas.save(tmp, format="PNG")
    os.replace(tmp, path)
    return amplify


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType sizes
        return ImageFont.load_default()


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width=width) or [""]


# ----------------------------------------------------------------------------------------------------
# Timing


class Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0
        return False


def disable_tqdm_if_not_tty() -> bool:
    """tqdm bars only when stderr is a terminal, unless QWEN_ABSORB_PROGRESS=1 forces them."""
    if os.environ.get("QWEN_ABSORB_PROGRESS") == "1":
        return False
    return not sys.stderr.isatty()
