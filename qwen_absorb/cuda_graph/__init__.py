"""CUDA-graph mode for the Qwen-Image transformer call: capture the call once per input signature, then replay it.
Eager Qwen-Image is host-bound (thousands of launches per call); a replayed graph runs the same kernels with no
Python in between. :func:`install` puts a :class:`GraphedCall` where the transformer's forward is called from
(``remove()`` restores it). Per call it **refuses** (runs the wrapped forward, counted in ``fallbacks`` as
``"cuda_graph: <reason>"``) when a replay could differ from eager (grad, training, hooks that move or cast weights
inside the call, forward hooks, calibration, inputs off the GPU, Python numbers that would be baked in); **drops**
every graph when what they baked in changed (:mod:`.fingerprint`); **captures** a new signature (:mod:`.capture`) or
**replays** its graph and returns a clone of the static output (graphs share one pool). Outputs are bit-identical
to eager. Not seen by the fingerprint (call ``invalidate()`` after them): ``del`` of a submodule or parameter, direct
writes into ``_parameters`` / ``_modules``. Per block (Qwen-Image-2.1): :func:`install_blocks`; under diffusers'
FirstBlockCache: :mod:`.first_block_cache`."""

from .attach import FirstUse, install, install_blocks
from .runner import GraphedCall
from .shared import BlockGraphs, Shared

__all__ = ["BlockGraphs", "FirstUse", "GraphedCall", "Shared", "install", "install_blocks"]
