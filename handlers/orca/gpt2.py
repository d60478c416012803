"""GPT-2 for one Orca iteration over any set of requests (selective batching).

An iteration takes each scheduled request's new tokens: its whole prompt the
first time (initiation), its last generated token after that (increment).
Requests differ in how many new tokens they bring and how many positions
they have cached, so their attention cannot share one batched tensor; every
other operator does not care which request a token belongs to.  Orca's
*selective batching* follows from that: the tokens of all requests are
flattened to one ``[ΣL, H]`` tensor for the embeddings, layer norms, the
QKV projection, the output projection and the MLP, and only attention is
split per request, each with its own keys and values from the KV cache,
then merged back.

The weights are the catalog GPT-2's (``transformers.GPT2LMHeadModel`` with
seeded weights), taken as they are, so greedy decoding here can be checked
token for token against the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from handlers.orca.kv_cache import KVCache, KVShape


@dataclass(frozen=True)
class Step:
    """One request's part of an iteration: its new tokens and where they go."""

    tokens: Sequence[int]
    slot: int  # its KV slot
    start: int  # positions already cached (0 at initiation)


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
        increments = [(row, s) for row, s in _first_rows(steps).items() if len(steps[s].tokens) == 1]
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


def _first_rows(steps: Sequence[Step]) -> dict[int, int]:
    """Each step's first row among the iteration's flattened tokens: {row: step index}."""
    rows, row = {}, 0
    for index, step in enumerate(steps):
        rows[row] = index
        row += len(step.tokens)
    return rows


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (the tanh approximation, as transformers' ``gelu_new``)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class SelectiveGPT2(nn.Module):
    """A GPT-2 language model that runs Orca iterations; weights shared with ``hf`` (no copy)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        cfg = hf.config
        self.transformer = hf.transformer
        self.lm_head = hf.lm_head
        self.heads = cfg.n_head
        self.hidden = cfg.n_embd
        self.head_dim = cfg.n_embd // cfg.n_head
        self.layers = cfg.n_layer
        self.positions = cfg.n_positions
        self.vocab = cfg.vocab_size
        self.eps = cfg.layer_norm_epsilon

    def kv_shape(self, slots: int, max_tokens: int) -> KVShape:
        if max_tokens > self.positions:
            raise ValueError(f"GPT-2 has {self.positions} positions; a slot of {max_tokens} cannot be used")
        return KVShape(self.layers, self.heads, self.head_dim, slots, max_tokens)

    def _attention(
        self, qkv: torch.Tensor, steps: Sequence[Step], layer: int, kv: KVCache, decode: DecodeBatch | None
    ) -> torch.Tensor:
        """Store the new keys/values and attend over everything cached; merged back to [ΣL, H].

        Increments (one new token each) attend together in one call over the
        cache (``DecodeBatch``); initiations (a whole prompt) one by one.
        """
        if decode is not None and decode.rows is None:  # increments only: the common decode iteration
            return self._decode_attention(qkv, layer, kv, decode)
        out = qkv.new_empty(qkv.shape[0], self.hidden)
        if decode is not None:
            out.index_copy_(0, decode.rows, self._decode_attention(qkv.index_select(0, decode.rows), layer, kv, decode))
        offset = 0
        for step in steps:
            n = len(step.tokens)
            if n > 1:
                out[offset : offset + n] = self._prompt_attention(qkv[offset : offset + n], step, layer, kv)
            offset += n
        return out

    def _prompt_attention(self, qkv: torch.Tensor, step: Step, layer: int, kv: KVCache) -> torch.Tensor:
        """One initiation's causal attention: token i sits at position start + i and sees positions ≤ start + i."""
        n = qkv.shape[0]
        q, k, v = (t.view(n, self.heads, self.head_dim).transpose(0, 1) for t in qkv.split(self.hidden, dim=1))
        kv.write(layer, step.slot, step.start, k, v)
        keys, values = kv.read(layer, step.slot, step.start + n)
        rows = torch.arange(n, device=qkv.device).unsqueeze(1) + step.start
        mask = torch.arange(step.start + n, device=qkv.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return out.transpose(0, 1).reshape(n, self.hidden)

    def _decode_attention(self, qkv: torch.Tensor, layer: int, kv: KVCache, decode: DecodeBatch) -> torch.Tensor:
        """Every increment at once: one write of the new keys/values, one attention call over the
        cache's first ``decode.slot_span`` slots (rows of other slots are masked to one position
        and dropped), so the operators dispatched do not grow with the requests."""
        b = qkv.shape[0]
        q, k, v = (t.view(b, self.heads, self.head_dim) for t in qkv.split(self.hidden, dim=1))
        keys, values = kv.keys[layer], kv.values[layer]
        keys[decode.slots, :, decode.starts] = k  # [B, heads, d] at each request's next position
        values[decode.slots, :, decode.starts] = v
        span, length = decode.slot_span, decode.length
        queries = q.new_zeros(span, self.heads, 1, self.head_dim)
        queries[decode.slots] = q.unsqueeze(2)
        out = F.scaled_dot_product_attention(
            queries, keys[:span, :, :length], values[:span, :, :length], attn_mask=decode.mask
        )
        return out[decode.slots].reshape(b, self.hidden)

    @torch.inference_mode()
    def iterate(self, steps: Sequence[Step], kv: KVCache) -> torch.Tensor:
        """One iteration for ``steps``: the next-token logits of each request, ``[len(steps), vocab]``."""
        if not steps:
            raise ValueError("an iteration needs at least one request")
        t = self.transformer
        device = t.wte.weight.device
        ids = torch.tensor([tok for s in steps for tok in s.tokens], dtype=torch.long, device=device)
        positions = torch.tensor(
            [s.start + i for s in steps for i in range(len(s.tokens))], dtype=torch.long, device=device
        )
        if int(positions.max()) >= self.positions:
            raise ValueError(f"a position reaches {int(positions.max())}; GPT-2 has {self.positions}")
        x = t.wte(ids) + t.wpe(positions)  # [ΣL, H]: every request's new tokens, flattened
        decode = DecodeBatch.of(steps, device)
        for layer, block in enumerate(t.h):
            h = F.layer_norm(x, (self.hidden,), block.ln_1.weight, block.ln_1.bias, self.eps)
            qkv = torch.addmm(block.attn.c_attn.bias, h, block.attn.c_attn.weight)  # batched over all tokens
            a = self._attention(qkv, steps, layer, kv, decode)
            x = x + torch.addmm(block.attn.c_proj.bias, a, block.attn.c_proj.weight)
            h = F.layer_norm(x, (self.hidden,), block.ln_2.weight, block.ln_2.bias, self.eps)
            h = _gelu_new(torch.addmm(block.mlp.c_fc.bias, h, block.mlp.c_fc.weight))
            x = x + torch.addmm(block.mlp.c_proj.bias, h, block.mlp.c_proj.weight)
        last = torch.tensor([len(s.tokens) for s in steps], device=device).cumsum(0) - 1  # each request's last token
        x = F.layer_norm(x[last], (self.hidden,), t.ln_f.weight, t.ln_f.bias, self.eps)
        return F.linear(x, self.lm_head.weight)  # GPT-2 ties it to the token embedding; no bias
