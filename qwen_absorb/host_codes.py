"""Real-FP8 codes kept on the host while their model is away from the GPU (model offload).

Under ``enable_model_cpu_offload()`` the transformer leaves the GPU after every pipeline call. Each return is a
decision, which made every FP8 weight again from its host-kept original: for the 60-layer model, 38 GiB across the
bus, a content fingerprint and a quantization per linear. The codes depend only on the original and the weight
quantizer's amax. So, with ``Tuning(host_fp8_codes=True)``, the first departure copies them to the host (19 GiB,
once), and a return whose sources are unchanged copies them back (half the bytes, nothing computed); with the option
off, :func:`keep` and :func:`take` only clear the store. Unchanged: the same amax value and the same original data
(identity, version counter, address, dtype: every in-place write, ``load_state_dict``, dtype move or new ``.data``
shows there). A write through ``weight.data`` shows in neither, just as it does not show to a resident model's codes
between decisions (PEFT's merges do show: a LoRA wrap or unwrap since the last decision forgets the block's codes);
``patch()`` again forgets these codes. Opt-in: measured on an H100 it saved the GPU work but not the run's time,
which the blocks' decisions at each return bound, for 19 GiB more host memory (``benchmarks/NOTES.md``, "Tuning
defaults"); by default each return rebuilds the codes."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import staging
from .sites import resolve, unwrap_peft
from .watch import tensor_version

HOST = torch.device("cpu")


@dataclass
class HostCodes:
    source: tuple  # (id, version, address, dtype) of the original, then its content fingerprint
    amax: torch.Tensor  # the weight quantizer's amax the codes were made with (fp32 [1], host)
    codes: torch.Tensor  # e4m3 [out, in], host


def _original(block: nn.Module, path: str) -> tuple[nn.Module | None, tuple | None]:
    """The plain linear at ``path`` and its weight's source key (None where wrapped, absent or version-less)."""
    base, wrappers = unwrap_peft(resolve(block, path))
    w = base._parameters.get("weight") if base is not None else None
    if wrappers or type(w) is not nn.Parameter or type(w.data) is not torch.Tensor:
        return None, None
    v = tensor_version(w)
    return base, (None if v < 0 else (id(w), v, w.data_ptr(), w.dtype))


def keep(plan: Any, block: nn.Module) -> None:
    """Before the model leaves ``plan``'s device: the codes of each host-kept original on the host, copied only
    where the host holds none for the same sources (one sync for the amaxes)."""
    store: dict[str, HostCodes] = plan.rt.host_codes
    if not plan.options.tuning.host_fp8_codes:
        store.clear()
        return
    todo = []
    for p, lp in plan.linears.items():
        fp = lp.weight
        _, src = _original(block, p)
        # codes made from these exact sources (the key of their last build), not from an older state of the weight
        if fp is None or not lp.offloaded or fp.reused_storage or fp.amax is None or src is None \
                or len(lp.cache_key) < 3 or src != lp.cache_key[2][:4]:
            store.pop(p, None)
            continue
        todo.append((p, src + (lp.cache_key[2][4],), fp))
    if not todo:
        return
    amaxes = torch.cat([fp.amax.reshape(1) for _, _, fp in todo]).to(HOST)
    for (p, src, fp), amax in zip(todo, amaxes.split(1)):
        have = store.get(p)
        if have is None or have.source != src or not torch.equal(have.amax, amax):
            store[p] = HostCodes(src, amax.clone(), fp.codes.to(HOST))


def take(plan: Any, block: nn.Module, device: torch.device) -> dict[str, tuple[torch.Tensor, tuple]]:
    """``{path: (codes on device, content fingerprint)}`` of the host codes whose sources are unchanged (one sync
    for the amaxes); the others are forgotten."""
    store: dict[str, HostCodes] = plan.rt.host_codes
    # a module registered into a watched slot since the last decision (PEFT's wrap and unwrap: a LoRA fused while
    # away merges through ``.data``, which no version shows)
    if not plan.options.tuning.host_fp8_codes or getattr(plan.rt.watch, "dirty", True):
        store.clear()
    todo = []
    for p, hc in list(store.items()):
        lp = plan.linears.get(p)
        base, src = _original(block, p)
        amax = getattr(getattr(base, "weight_quantizer", None), "_amax", None)
        if lp is None or not lp.fp8_gemm or src != hc.source[:4] or amax is None or amax.numel() != 1:
            del store[p]
            continue
        todo.append((p, hc, amax))
    if not todo:
        return {}
    now = torch.cat([a.detach().float().reshape(1).to(device) for _, _, a in todo]).to(HOST)
    out = {}
    pinned = plan.options.tuning.pinned_staging
    for (p, hc, _), amax in zip(todo, now.split(1)):
        if torch.equal(amax, hc.amax):
            out[p] = (staging.to_device(hc.codes, device, pinned=pinned), hc.source[4])
        else:
            del store[p]
    return out
