"""CUDA graphs per block: one :class:`~.runner.GraphedCall` on each block, all sharing one :class:`~.shared.Shared`.

diffusers' ``QwenImage21Transformer2DModel.forward`` syncs with the host before its block loop (``tolist()`` on the
token masks), so its whole call can never be captured; its blocks can. Refusals are counted per block call.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

from torch import nn

from .attach import install
from .group import BlockGraphs
from .runner import GraphedCall
from .shared import Shared

log = logging.getLogger("qwen_absorb")


def install_blocks(blocks: Sequence[nn.Module], *, fallbacks: collections.Counter, parent: nn.Module | None = None,
                   max_graphs: int = 8, capture_after: int = 0,
                   indices: Sequence[int] | None = None) -> BlockGraphs:
    """A :class:`GraphedCall` on each of ``blocks``, sharing one :class:`Shared`, as a group. ``parent``: the module
    around the blocks, whose hooks refuse the blocks' calls too; ``indices``: the blocks' indices in the model. A block
    that already carries a runner of its own keeps it and is left out."""
    idx = list(indices) if indices is not None else list(range(len(blocks)))
    if len(idx) != len(blocks):
        raise ValueError(f"indices: {len(idx)} for {len(blocks)} blocks")
    shared = Shared(parent)

    def put(i: int, block: nn.Module) -> GraphedCall | None:
        r = install(block, fallbacks=fallbacks, max_graphs=max_graphs, capture_after=capture_after, shared=shared)
        if r._shared is shared:
            return r
        log.warning("block %d already carries a CUDA-graph runner of its own; it is left as it is", i)
        return None

    group = BlockGraphs.install(shared, zip(idx, blocks), put, parent, max_graphs, capture_after)
    log.info("CUDA graphs per block installed on %d blocks (max %d graphs each%s)", len(group.runners), max_graphs,
             f", capture after {capture_after} eager calls" if capture_after else "")
    return group
