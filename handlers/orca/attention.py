"""Attention for one Orca iteration over the KV cache, shared by the model families (``gpt2.py``, ``llama.py``).

An iteration holds two kinds of request (Orca's *selective batching*):

- **increments** bring one new token each.  They attend together: one
  gather per layer reads each one's positions through its block table, and
  one ``scaled_dot_product_attention`` call runs over them all, each row
  masked to its own length (``IterationLayout``).  So
  the operators dispatched per decode iteration do not grow with its
  requests, which is the host cost iteration-level batching exists to
  amortise (``tests/unit/test_orca_decode_batch.py``).
- **initiations** bring a whole prompt, of any length (or what is left of
  it after a shared prefix), and attend causally one by one.

Every new key and value of the iteration, increments' and prompts' alike, is
stored with one indexed store per layer.

Queries come as ``[tokens, heads, dim]`` and keys and values as
``[tokens, kv_heads, dim]``: grouped-query attention (fewer key/value heads,
Llama's) is the same call with ``enable_gqa``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.nn import functional as F

from handlers.orca.kv_cache import KVCache, KVShape


@dataclass(frozen=True)
class Step:
    """One request's part of an iteration: its new tokens and where its keys and values live."""

    tokens: Sequence[int]
    start: int  # positions already cached (0 at initiation; a shared prefix's length when it has one)
    blocks: Sequence[int]  # its block table, covering positions up to start + len(tokens)


class IterationModel(Protocol):
    """What the engine needs of a model family (``gpt2.SelectiveGPT2``, ``llama.SelectiveLlama``)."""

    layers: int
    positions: int  # the checkpoint's context: positions a request may reach
    vocab: int

    @property
    def dtype(self) -> torch.dtype: ...

    def kv_shape(self, blocks: int, block_size: int) -> KVShape: ...

    def iterate(self, steps: Sequence[Step], kv: KVCache) -> torch.Tensor: ...


def _rows(table: Sequence[int], start: int, end: int, size: int) -> list[int]:
    """The cache rows of positions ``start .. end`` of a request with block table ``table``."""
    return [table[p // size] * size + p % size for p in range(start, end)]


@dataclass(frozen=True)
class IterationLayout:
    """Where an iteration's tokens go in the cache and what each attends to, built once and shared by every layer.

    Built from plain Python lists into a few tensors, the same few whatever the
    number of requests, so a decode iteration dispatches the same operators for
    1 or 16 requests.
    """

    write_rows: torch.Tensor  # [ΣL] the cache row of every new token, in step order
    decode_rows: torch.Tensor | None  # the increments' rows among the iteration's tokens; None: every row is one
    gather: torch.Tensor | None  # [B, length] the cache rows each increment attends to (padded)
    mask: torch.Tensor | None  # [B, 1, 1, length] which of them it sees

    @classmethod
    def of(cls, steps: Sequence[Step], block_size: int, device: torch.device) -> IterationLayout:
        size = block_size
        write = [r for s in steps for r in _rows(s.blocks, s.start, s.start + len(s.tokens), size)]
        increments = [(row, s) for row, s in first_rows(steps).items() if len(steps[s].tokens) == 1]
        if not increments:
            return cls(torch.tensor(write, device=device), None, None, None)
        chosen = [steps[s] for _, s in increments]
        width = max(len(step.blocks) for step in chosen)
        table = torch.tensor([list(step.blocks) + [0] * (width - len(step.blocks)) for step in chosen], device=device)
        length = max(step.start for step in chosen) + 1
        position = torch.arange(length, device=device)
        gather = table[:, position // size] * size + position % size  # [B, length]
        seen = torch.tensor([step.start for step in chosen], device=device)
        mask = (position <= seen.unsqueeze(1)).view(len(chosen), 1, 1, length)
        everything = len(increments) == len(steps)
        rows = None if everything else torch.tensor([row for row, _ in increments], device=device)
        return cls(torch.tensor(write, device=device), rows, gather, mask)

    @property
    def decodes(self) -> bool:
        return self.gather is not None


def flat_tokens(steps: Sequence[Step], positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every request's new tokens flattened in step order, and each token's position (``[ΣL]`` each);
    refused when a position reaches past the model's ``positions``."""
    ids = torch.tensor([tok for s in steps for tok in s.tokens], dtype=torch.long, device=device)
    where = [s.start + i for s in steps for i in range(len(s.tokens))]
    if max(where) >= positions:
        raise ValueError(f"a position reaches {max(where)}; the model has {positions}")
    return ids, torch.tensor(where, dtype=torch.long, device=device)


def last_rows(steps: Sequence[Step], device: torch.device) -> torch.Tensor:
    """Each request's last new token among the flattened tokens: the row its next-token logits come from."""
    return torch.tensor([len(s.tokens) for s in steps], device=device).cumsum(0) - 1


def first_rows(steps: Sequence[Step]) -> dict[int, int]:
    """Each step's first row among the iteration's flattened tokens: {row: step index}."""
    rows, row = {}, 0
    for index, step in enumerate(steps):
        rows[row] = index
        row += len(step.tokens)
    return rows


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    steps: Sequence[Step],
    layer: int,
    kv: KVCache,
    layout: IterationLayout,
) -> torch.Tensor:
    """Store the iteration's new keys/values in ``kv`` and attend over everything cached.

    ``q``: ``[tokens, heads, dim]``; ``k``, ``v``: ``[tokens, kv_heads, dim]``,
    the rows in the order of ``steps``.  Returns ``[tokens, heads * dim]``.
    """
    keys, values = kv.keys[layer], kv.values[layer]
    keys[layout.write_rows] = k  # every new token's key and value, one store each
    values[layout.write_rows] = v
    if layout.decodes and layout.decode_rows is None:  # increments only: the common decode iteration
        return _decode(q, keys, values, layout)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if layout.decodes:
        out.index_copy_(0, layout.decode_rows, _decode(q.index_select(0, layout.decode_rows), keys, values, layout))
    offset = 0
    for step in steps:
        n = len(step.tokens)
        if n > 1:
            rows = slice(offset, offset + n)
            out[rows] = _prompt(q[rows], keys, values, step, kv.block_size)
        offset += n
    return out


def _prompt(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step, size: int) -> torch.Tensor:
    """One initiation's causal attention: token i sits at position start + i and sees positions ≤ start + i."""
    n = q.shape[0]
    end = step.start + n
    cached = torch.tensor(_rows(step.blocks, 0, end, size), device=q.device)
    k, v = keys[cached].transpose(0, 1), values[cached].transpose(0, 1)  # [kv_heads, end, dim]
    rows = torch.arange(n, device=q.device).unsqueeze(1) + step.start
    mask = torch.arange(end, device=q.device).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, enable_gqa=k.shape[0] != q.shape[1])
    return out.transpose(0, 1).reshape(n, -1)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: IterationLayout) -> torch.Tensor:
    """Every increment at once: one gather of the positions each attends to, one attention call."""
    b, heads, dim = q.shape
    k = keys[layout.gather].transpose(1, 2)  # [B, kv_heads, length, dim]
    v = values[layout.gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=layout.mask, enable_gqa=k.shape[1] != heads)
    return out.reshape(b, heads * dim)
