"""CUDA-graph mode for the Qwen-Image transformer call: capture the call once per input signature, then replay it.

Eager Qwen-Image is host-bound (thousands of launches per call, each paying Python and dispatcher cost); a
replayed CUDA graph runs the same kernels with no Python in between. :func:`install` puts a
:class:`GraphedCall` on the transformer as its instance attribute ``forward``, wrapping whatever forward was
current (the class forward, a hook's wrapper; patched by ``qwen_absorb.patch`` or not, compiled blocks or
not); ``GraphedCall.remove()`` restores it. Per call:

- **refuse** (run the wrapped forward, count ``"cuda_graph: <reason>"`` in ``fallbacks``) when a replay could
  differ from eager: grad enabled, training mode, diffusers hooks (``enable_cache``, offloading, casting,
  parallelism), accelerate hooks, forward hooks on submodules, ModelOpt calibration, a model or input off
  CUDA (except the tensors ``host_tensors`` allows), a Python number where a tensor is expected (it would be
  baked in), arguments a signature cannot describe, a signature whose capture failed;
- **invalidate** (drop every graph) when what graphs baked in changed: a per-call fingerprint of parameter
  and buffer ``data_ptr`` / ``_version``, module attributes and hooks, the forwards, processors, ModelOpt and
  PEFT LoRA state (merged adapters, scaling, enabled, active), plus torch's registration hooks for assigned
  modules and parameters;
- **key** a graph by tensor shapes, strides, dtypes, devices and alignment, every non-tensor argument by value,
  and the global switches that change kernel choice; at most ``max_graphs`` graphs, least recently used first;
- **capture** a new signature (after ``capture_after`` eager calls of it): inputs copied into static buffers,
  one eager warm-up on a side stream (its output answers this call), then capture into the runner's one
  memory pool. ``torch.tensor(host data, device=cuda)`` (the edit models' ``modulate_index``, the text length
  next to a mask) cannot be captured: during the capture that exact call is answered by a device copy of what
  the warm-up created;
- **replay**: ``copy_`` into the static buffers, ``replay()``, return a **clone** of the static output. A
  clone because true CFG's two calls may share a signature (equal text lengths) and because graphs share
  one pool, so a static output may be another graph's scratch memory; it is one small copy.

Outputs are bit-identical to the wrapped forward run eagerly. Not thread-safe (one runner, one thread, replays
on the caller's current stream). Not seen by the fingerprint, so call ``invalidate()`` after them: writes
through ``param.data`` (replay reads the new values anyway; only caches derived from weights would be stale),
``del`` of a submodule or parameter, direct writes into ``_parameters`` / ``_modules``.

Per block (Qwen-Image-2.1, whose forward syncs with the host before its block loop, so its whole call cannot be
captured): :func:`install_blocks` puts a :class:`GraphedCall` on every block, all sharing one :class:`Shared`
(one memory pool and side stream per device, one lock, one static buffer per argument position and tensor
metadata); :class:`BlockGraphs` removes, invalidates and describes them as one.

The package, bottom up (imports only point down): ``settings`` (the tunables), ``signature`` (arguments
frozen into keys, the refusals they raise), ``fingerprint`` (what graphs baked in, the verdict, torch's
registration hooks), ``capture`` (static buffers, host constants, RoPE tables kept, the capture itself),
``shared`` (what a group of runners shares), ``runner`` (:class:`GraphedCall`), ``attach`` (:func:`install`),
``first_use`` (:class:`FirstUse`: graphs decided at a model's first call on a GPU), ``blocks``
(:class:`BlockGraphs`, :func:`install_blocks`). Hook chains are read through :mod:`qwen_absorb.hooks`.
"""

from __future__ import annotations

from .blocks import BlockGraphs, install_blocks
from .attach import install
from .first_use import FirstUse
from .runner import GraphedCall
from .shared import Shared

__all__ = ["BlockGraphs", "FirstUse", "GraphedCall", "Shared", "install", "install_blocks"]
