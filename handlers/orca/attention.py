"""Attention for one Orca iteration over the KV cache, shared by the model families (``gpt2.py``, ``llama.py``).

An iteration holds two kinds of request (Orca's *selective batching*):

- **increments** bring one new token each.  They attend together: one
  indexed store writes every new key and value, and one
  ``scaled_dot_product_attention`` call per layer runs over the cache's
  occupied slots, each slot masked to its own length (``DecodeBatch``).  So
  the operators dispatched per decode iteration do not grow with its
  requests, which is the host cost iteration-level batching exists to
  amortise (``tests/unit/test_orca_decode_batch.py``).
- **initiations** bring a whole prompt, of any length, and attend causally
  one by one.

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
    """One request's part of an iteration: its new tokens and where they go."""

    tokens: Sequence[int]
    slot: int  # its KV slot
    start: int  # positions already cached (0 at initiation)


class IterationModel(Protocol):
    """What the engine needs of a model family (``gpt2.SelectiveGPT2``, ``llama.SelectiveLlama``)."""

    layers: int
    positions: int  # the checkpoint's context: positions a request may reach
    vocab: int

    @property
    def dtype(self) -> torch.dtype: ...

    def kv_shape(self, slots: int, max_tokens: int) -> KVShape: ...

    def iterate(self, steps: Sequence[Step], kv: KVCache) -> torch.Tensor: ...


@dataclass(frozen=True)
class DecodeBatch:
    """The increments of one iteration (requests bringing one token each), indexed for one attention call.

    Built once per iteration from plain Python lists (a few tensors, the same
    few whatever the count), and shared by every layer.
    """

    slots: torch.Tensor  # [B] each increment's KV slot
    starts: torch.Tensor  # [B] the position its new token takes
    mask: torch.Tensor  # [slot_span, 1, 1, length]: what each slot's query may see
    rows: torch.Tensor | None  # the increments' rows among the iteration's tokens; None: every row is one
    slot_span: int  # attention runs over slots 0 .. slot_span (the slots in use sit low: ``KVCache.allocate``)
    length: int  # positions attended: the longest increment's, its new token included

    @classmethod
    def of(cls, steps: Sequence[Step], device: torch.device) -> DecodeBatch | None:
        increments = [(row, s) for row, s in first_rows(steps).items() if len(steps[s].tokens) == 1]
        if not increments:
            return None
        chosen = [steps[s] for _, s in increments]
        span = max(step.slot for step in chosen) + 1
        length = max(step.start for step in chosen) + 1
        visible = [0] * span  # a slot with no increment sees position 0 only (a row that is dropped)
        for step in chosen:
            visible[step.slot] = step.start
        limit = torch.tensor(visible, device=device)
        mask = (torch.arange(length, device=device) <= limit.unsqueeze(1)).view(span, 1, 1, length)
        everything = len(increments) == len(steps)
        return cls(
            slots=torch.tensor([step.slot for step in chosen], device=device),
            starts=torch.tensor([step.start for step in chosen], device=device),
            mask=mask,
            rows=None if everything else torch.tensor([row for row, _ in increments], device=device),
            slot_span=span,
            length=length,
        )


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
    decode: DecodeBatch | None,
) -> torch.Tensor:
    """Store the iteration's new keys/values in ``kv`` and attend over everything cached.

    ``q``: ``[tokens, heads, dim]``; ``k``, ``v``: ``[tokens, kv_heads, dim]``,
    the rows in the order of ``steps``.  Returns ``[tokens, heads * dim]``.
    """
    if decode is not None and decode.rows is None:  # increments only: the common decode iteration
        return _decode(q, k, v, layer, kv, decode)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    if decode is not None:
        picked = [t.index_select(0, decode.rows) for t in (q, k, v)]
        out.index_copy_(0, decode.rows, _decode(*picked, layer, kv, decode))
    offset = 0
    for step in steps:
        n = len(step.tokens)
        if n > 1:
            rows = slice(offset, offset + n)
            out[rows] = _prompt(q[rows], k[rows], v[rows], step, layer, kv)
        offset += n
    return out


def _prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, layer: int, kv: KVCache) -> torch.Tensor:
    """One initiation's causal attention: token i sits at position start + i and sees positions ≤ start + i."""
    n = q.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, n, dim]
    kv.write(layer, step.slot, step.start, k, v)
    keys, values = kv.read(layer, step.slot, step.start + n)
    rows = torch.arange(n, device=q.device).unsqueeze(1) + step.start
    mask = torch.arange(step.start + n, device=q.device).unsqueeze(0) <= rows
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=keys.shape[0] != q.shape[0])
    return out.transpose(0, 1).reshape(n, -1)


def _decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, kv: KVCache, decode: DecodeBatch
) -> torch.Tensor:
    """Every increment at once: one write of the new keys/values, one attention call over the cache's
    first ``decode.slot_span`` slots (rows of other slots see one position and are dropped)."""
    b, heads, dim = q.shape
    keys, values = kv.keys[layer], kv.values[layer]
    keys[decode.slots, :, decode.starts] = k  # [B, kv_heads, dim] at each request's next position
    values[decode.slots, :, decode.starts] = v
    span, length = decode.slot_span, decode.length
    queries = q.new_zeros(span, heads, 1, dim)
    queries[decode.slots] = q.unsqueeze(2)
    out = F.scaled_dot_product_attention(
        queries,
        keys[:span, :, :length],
        values[:span, :, :length],
        attn_mask=decode.mask,
        enable_gqa=keys.shape[1] != heads,
    )
    return out[decode.slots].reshape(b, heads * dim)
