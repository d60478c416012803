"""Preallocated key/value memory for Orca, in slots of a fixed number of tokens.

Orca reserves a request's keys and values for its whole life (prompt plus
``max_new_tokens``) when the scheduler first picks it, so a running request
can never run out of memory halfway and nothing is ever evicted.  Here a
reservation is one *slot*: ``max_tokens`` positions per layer, allocated
once at start-up.  A slot goes back to the free list when its request
finishes; the scheduler (``scheduler.py``) decides who gets the next one.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


class KVFull(RuntimeError):
    """No free slot: the scheduler asked for more than it had checked was free."""


@dataclass(frozen=True)
class KVShape:
    layers: int
    heads: int
    head_dim: int
    slots: int
    max_tokens: int  # positions per slot: a request's prompt + max_new_tokens must fit


class KVCache:
    """``keys[layer][slot, head, position, dim]`` and ``values`` likewise, with a free list of slots."""

    def __init__(self, shape: KVShape, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        self.shape = shape
        size = (shape.slots, shape.heads, shape.max_tokens, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=device) for _ in range(shape.layers)]
        # A heap: the lowest free slot goes out first, so the slots in use stay packed at the low end
        # and a decode iteration attends over few more slots than it has requests (``gpt2.DecodeBatch``).
        self._free = list(range(shape.slots))

    @property
    def free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise KVFull(f"all {self.shape.slots} KV slots are reserved")
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.shape.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not reserved")
        heapq.heappush(self._free, slot)

    def write(self, layer: int, slot: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ([heads, n, dim]) at positions ``start .. start+n`` of ``slot``."""
        end = start + k.shape[1]
        if end > self.shape.max_tokens:
            raise ValueError(f"positions up to {end} exceed the slot's {self.shape.max_tokens}")
        self.keys[layer][slot, :, start:end] = k
        self.values[layer][slot, :, start:end] = v

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0 .. length`` of ``slot`` ([heads, length, dim] views)."""
        return self.keys[layer][slot, :, :length], self.values[layer][slot, :, :length]
