"""Orca's KV memory bookkeeping: fixed-size blocks, reference counts, and prompt prefixes shared between requests.

Pure bookkeeping, no tensors (``kv_cache.py`` holds the memory, the
scheduler decides who gets blocks).  A request's keys and values live in
blocks of ``block_size`` positions, listed in its block table; it gets a
block when it grows into one, not a reservation for its whole life.

Prefix sharing: a block that is full and holds positions a request's prompt
has already computed is registered under the exact tokens before its end
(the whole prefix, so two blocks are the same only when everything they
attend to is).  A later request whose tokens begin the same way takes those
blocks instead of computing them again.  A block whose last user finished
stays registered while it sits free, oldest-freed first out, so a system
prompt that every chat request repeats is computed once for as long as
memory allows.  Shared blocks are only read: a request writes past its
shared prefix, into blocks of its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVFull(RuntimeError):
    """More blocks asked for than are free (the scheduler checks first; this is a bug if raised)."""


def blocks_for(positions: int, block_size: int) -> int:
    """Blocks that hold ``positions`` positions."""
    return -(-positions // block_size)


class BlockAllocator:
    """Blocks ``0 .. blocks-1``: who holds each (a count), which are free, which hold a registered prefix."""

    def __init__(self, blocks: int, block_size: int) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError(f"need ≥ 1 block of ≥ 1 position, got {blocks} of {block_size}")
        self.blocks = blocks
        self.block_size = block_size
        self._holders = [0] * blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(blocks))  # oldest freed first
        self._prefix_of: dict[int, tuple[int, ...]] = {}  # registered block → the tokens up to its end
        self._block_of: dict[tuple[int, ...], int] = {}
        self.shared = 0  # blocks handed out from a registered prefix instead of computed (a counter)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks of new content (the oldest freed first; a registered one forgets its prefix)."""
        if count > len(self._free):
            raise KVFull(f"{count} blocks asked for, {len(self._free)} free")
        out = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            prefix = self._prefix_of.pop(block, None)
            if prefix is not None:
                del self._block_of[prefix]
            self._holders[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """A request lets go of its blocks; a block nobody holds is free (and keeps its prefix until reused)."""
        for block in blocks:
            if self._holders[block] < 1:
                raise ValueError(f"block {block} is not held")
            self._holders[block] -= 1
            if self._holders[block] == 0:
                self._free[block] = None

    def share_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The registered blocks that hold ``tokens``' longest computed prefix, now held by one more request.

        At least the last token is left to compute (its logits are the next token's), so a prefix covers
        whole blocks before it only."""
        size = self.block_size
        shared: list[int] = []
        for end in range(size, len(tokens), size):  # blocks that end before the last token
            block = self._block_of.get(tuple(tokens[:end]))
            if block is None:
                break
            shared.append(block)
        for block in shared:
            if self._holders[block] == 0:
                del self._free[block]
            self._holders[block] += 1
        self.shared += len(shared)
        return shared

    def register(self, tokens: Sequence[int], blocks: Sequence[int], computed: int) -> None:
        """Offer the full blocks among ``blocks`` that hold ``tokens``' first ``computed`` positions for sharing."""
        size = self.block_size
        for i in range(computed // size):
            prefix = tuple(tokens[: (i + 1) * size])
            if prefix in self._block_of:
                continue  # already offered (by this request's own shared prefix, or an equal one)
            block = blocks[i]
            if block in self._prefix_of:
                continue
            self._prefix_of[block] = prefix
            self._block_of[prefix] = block
