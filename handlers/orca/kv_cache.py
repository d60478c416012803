"""Orca's key/value memory: blocks of positions, allocated at start-up, handed out as requests grow.

One tensor per layer for keys and one for values, ``[blocks × block_size,
kv_heads, head_dim]``: position ``p`` of a request whose block table is
``table`` lives at row ``table[p // block_size] * block_size + p %
block_size``.  An iteration turns its requests' tables into row indices once
(``attention.IterationLayout``) and every layer writes its new keys with one
indexed store and reads them with one gather.  Which request holds which
block is ``kv_blocks.BlockAllocator``'s bookkeeping; when blocks run out the
scheduler preempts a request, which computes its keys again later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from handlers.orca.kv_blocks import BlockAllocator, KVFull, blocks_for

__all__ = ["KVCache", "KVFull", "KVShape", "blocks_for"]


@dataclass(frozen=True)
class KVShape:
    layers: int
    heads: int  # key/value heads (fewer than the query heads under grouped-query attention)
    head_dim: int
    blocks: int
    block_size: int  # positions per block


class KVCache:
    """``keys[layer][row, head, dim]`` and ``values`` likewise, rows in blocks; ``blocks`` says who holds which."""

    def __init__(self, shape: KVShape, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.shape = shape
        size = (shape.blocks * shape.block_size, shape.heads, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.blocks = BlockAllocator(shape.blocks, shape.block_size)

    @property
    def block_size(self) -> int:
        return self.shape.block_size

    def table_for(self, positions: int) -> list[int]:
        """A fresh block table for ``positions`` positions (for tests and benchmarks that drive a model alone)."""
        return self.blocks.allocate(blocks_for(positions, self.shape.block_size))
