"""Orca's KV block bookkeeping on plain data: counts, the free order, prefixes shared and forgotten."""

from __future__ import annotations

import pytest

from handlers.orca.kv_blocks import BlockAllocator, KVFull, blocks_for


def test_blocks_for_rounds_up():
    assert [blocks_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_a_block_is_free_when_its_last_holder_lets_go_and_the_oldest_freed_goes_out_first():
    blocks = BlockAllocator(4, 2)
    a = blocks.allocate(3)
    assert a == [0, 1, 2] and blocks.free == 1
    blocks.release([1])
    blocks.release([0])
    assert blocks.allocate(2) == [3, 1]  # never used first, then the oldest freed
    with pytest.raises(KVFull):
        blocks.allocate(2)
    with pytest.raises(ValueError, match="not held"):
        blocks.release([3, 3])


def test_a_registered_prefix_is_shared_while_held_and_after_until_its_block_is_reused():
    blocks = BlockAllocator(6, 2)
    tokens = (5, 6, 7, 8, 9)
    table = blocks.allocate(3)
    blocks.register(tokens, table, computed=5)  # two full blocks: (5, 6) and (5, 6, 7, 8)
    assert blocks.share_prefix((5, 6, 7, 8, 1)) == table[:2] and blocks.shared == 2
    assert blocks.share_prefix((5, 6, 7, 8)) == table[:1]  # the last token is always left to compute
    assert blocks.share_prefix((5, 7, 7, 8, 1)) == []  # the whole prefix must match, not the block alone
    blocks.release(table)
    blocks.release(table[:2])
    blocks.release(table[:1])
    assert blocks.free == 6
    assert blocks.share_prefix((5, 6, 7, 8, 0)) == table[:2]  # free, but still holding the prefix: revived
    assert blocks.free == 4
    blocks.release(table[:2])
    blocks.allocate(6)  # every block reused: the prefixes are forgotten
    blocks.release(list(range(6)))
    assert blocks.share_prefix((5, 6, 7, 8, 0)) == []
