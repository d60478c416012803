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
  it after a shared prefix, or a chunk of it).  They attend together too:
  one gather of every prompt's cached positions, padded to the longest,
  and one causal ``scaled_dot_product_attention`` call, each prompt's rows
  masked to its own positions.  So a burst of new requests costs an
  iteration the same operators as one new request.

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

    def run_layout(
        self, ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout, kv: KVCache,
        last: torch.Tensor | None,
    ) -> torch.Tensor: ...  # fmt: skip


def _rows(table: Sequence[int], start: int, end: int, size: int) -> list[int]:
    """The cache rows of positions ``start .. end`` of a request with block table ``table``."""
    return [table[p // size] * size + p % size for p in range(start, end)]


@dataclass(frozen=True)
class IterationLayout:
    """Where an iteration's tokens go in the cache and what each attends to, built once and shared by every layer.

    Built from plain Python lists into a few tensors, the same few whatever the
    number of requests, so an iteration dispatches the same operators for 1 or
    16 requests of each kind.
    """

    write_rows: torch.Tensor  # [ΣL] the cache row of every new token, in step order
    decode_rows: torch.Tensor | None  # the increments' rows among the iteration's tokens; None: every row is one
    gather: torch.Tensor | None  # [B, length] the cache rows each increment attends to (padded)
    mask: torch.Tensor | None  # [B, 1, 1, length] which of them it sees
    prompts: PromptLayout | None = None  # the initiations', when the iteration has any

    @classmethod
    def of(cls, steps: Sequence[Step], block_size: int, device: torch.device) -> IterationLayout:
        size = block_size
        write = torch.tensor(
            [r for s in steps for r in _rows(s.blocks, s.start, s.start + len(s.tokens), size)], device=device
        )
        firsts = first_rows(steps)
        increments = [(row, steps[s]) for row, s in firsts.items() if len(steps[s].tokens) == 1]
        initiations = [(row, steps[s]) for row, s in firsts.items() if len(steps[s].tokens) > 1]
        prompts = PromptLayout.of(initiations, size, device, every=not increments) if initiations else None
        if not increments:
            return cls(write, None, None, None, prompts)
        chosen = [step for _, step in increments]
        width = max(len(step.blocks) for step in chosen)
        table = torch.tensor([list(step.blocks) + [0] * (width - len(step.blocks)) for step in chosen], device=device)
        length = max(step.start for step in chosen) + 1
        position = torch.arange(length, device=device)
        gather = table[:, position // size] * size + position % size  # [B, length]
        seen = torch.tensor([step.start for step in chosen], device=device)
        mask = (position <= seen.unsqueeze(1)).view(len(chosen), 1, 1, length)
        rows = None if not initiations else torch.tensor([row for row, _ in increments], device=device)
        return cls(write, rows, gather, mask, prompts)

    @property
    def decodes(self) -> bool:
        return self.gather is not None


@dataclass(frozen=True)
class PromptLayout:
    """Every initiation of an iteration as one padded causal attention call.

    Prompt ``p`` brings ``n_p`` tokens at positions ``start_p .. start_p + n_p - 1``;
    padded to ``N`` query rows and ``E`` cached positions (the longest of each),
    query ``i`` of ``p`` sees position ``j`` when ``j ≤ start_p + min(i, n_p - 1)``:
    its own causal prefix, and a padding row the same as ``p``'s last (never an
    empty row, which would be NaN; its output is dropped).
    """

    rows: torch.Tensor | None  # [ΣN] the prompts' rows among the iteration's tokens; None: every row is one
    queries: torch.Tensor  # [P, N] the iteration's token row each padded query reads
    gather: torch.Tensor  # [P, E] the cache rows each prompt attends to (padded)
    mask: torch.Tensor  # [P, 1, N, E]
    real: torch.Tensor  # [ΣN] where each prompt token's output sits among the P·N padded ones, in ``rows`` order

    @classmethod
    def of(cls, initiations: Sequence[tuple[int, Step]], size: int, device: torch.device, every: bool) -> PromptLayout:
        counts = [len(step.tokens) for _, step in initiations]
        width = max(counts)
        queries = [[row + min(i, n - 1) for i in range(width)] for (row, _), n in zip(initiations, counts, strict=True)]
        real = [p * width + i for p, n in enumerate(counts) for i in range(n)]
        ends = [step.start + n for (_, step), n in zip(initiations, counts, strict=True)]
        length = max(ends)
        gather = [_rows(step.blocks, 0, end, size) for (_, step), end in zip(initiations, ends, strict=True)]
        gather = [rows + [rows[0]] * (length - len(rows)) for rows in gather]
        query = torch.arange(width, device=device)
        last = torch.tensor([n - 1 for n in counts], device=device)
        starts = torch.tensor([step.start for _, step in initiations], device=device)
        sees = starts.unsqueeze(1) + torch.minimum(query.unsqueeze(0), last.unsqueeze(1))  # [P, N]
        mask = torch.arange(length, device=device).view(1, 1, length) <= sees.unsqueeze(2)  # [P, N, E]
        rows = None if every else torch.tensor([row + i for row, step in initiations for i in range(len(step.tokens))],
                                               device=device)  # fmt: skip
        return cls(
            rows,
            torch.tensor(queries, device=device),
            torch.tensor(gather, device=device),
            mask.unsqueeze(1),
            torch.tensor(real, device=device),
        )


def run_steps(model: IterationModel, steps: Sequence[Step], kv: KVCache, device: torch.device) -> torch.Tensor:
    """One iteration of ``model`` for ``steps`` (the families' ``iterate``): the next-token logits of each
    request, ``[len(steps), vocab]``, from the tokens flattened, the layout built once and the model run on them."""
    if not steps:
        raise ValueError("an iteration needs at least one request")
    ids, positions = flat_tokens(steps, model.positions, device)
    layout = IterationLayout.of(steps, kv.block_size, device)
    return model.run_layout(ids, positions, layout, kv, last_rows(steps, device))


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
    layer: int,
    kv: KVCache,
    layout: IterationLayout,
) -> torch.Tensor:
    """Store the iteration's new keys/values in ``kv`` and attend over everything cached.

    ``q``: ``[tokens, heads, dim]``; ``k``, ``v``: ``[tokens, kv_heads, dim]``,
    the rows in the iteration's order.  Returns ``[tokens, heads * dim]``.
    """
    keys, values = kv.keys[layer], kv.values[layer]
    keys[layout.write_rows] = k  # every new token's key and value, one store each
    values[layout.write_rows] = v
    prompts = layout.prompts
    if not layout.decodes:  # initiations only
        return _prompts(q, keys, values, prompts)
    if prompts is None:  # increments only: the common decode iteration
        return _decode(q, keys, values, layout)
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    out.index_copy_(0, layout.decode_rows, _decode(q.index_select(0, layout.decode_rows), keys, values, layout))
    out.index_copy_(0, prompts.rows, _prompts(q, keys, values, prompts))
    return out


def _prompts(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: PromptLayout) -> torch.Tensor:
    """Every initiation at once (``PromptLayout``): ``[ΣN, heads * dim]``, its rows in ``layout.rows`` order."""
    prompts, width = layout.queries.shape
    heads, dim = q.shape[1], q.shape[2]
    queries = q[layout.queries].transpose(1, 2)  # [P, heads, N, dim]
    k = keys[layout.gather].transpose(1, 2)  # [P, kv_heads, E, dim]
    v = values[layout.gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=layout.mask, enable_gqa=k.shape[1] != heads)
    return out.transpose(1, 2).reshape(prompts * width, heads * dim).index_select(0, layout.real)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: IterationLayout) -> torch.Tensor:
    """Every increment at once: one gather of the positions each attends to, one attention call."""
    b, heads, dim = q.shape
    k = keys[layout.gather].transpose(1, 2)  # [B, kv_heads, length, dim]
    v = values[layout.gather].transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=layout.mask, enable_gqa=k.shape[1] != heads)
    return out.reshape(b, heads * dim)
