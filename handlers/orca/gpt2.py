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

    def _attention(self, qkv: torch.Tensor, steps: Sequence[Step], layer: int, kv: KVCache) -> torch.Tensor:
        """Per request: store the new keys/values, attend over everything cached; merged back to [ΣL, H]."""
        outputs = []
        offset = 0
        for step in steps:
            n = len(step.tokens)
            q, k, v = qkv[offset : offset + n].split(self.hidden, dim=1)
            offset += n
            q, k, v = (t.view(n, self.heads, self.head_dim).transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
            kv.write(layer, step.slot, step.start, k, v)
            keys, values = kv.read(layer, step.slot, step.start + n)
            if n == 1:  # an increment: its one token sees every cached position
                mask = None
            else:  # token i sits at position start + i and sees positions ≤ start + i
                rows = torch.arange(n, device=qkv.device).unsqueeze(1) + step.start
                mask = torch.arange(step.start + n, device=qkv.device).unsqueeze(0) <= rows
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            outputs.append(out.transpose(0, 1).reshape(n, self.hidden))
        return torch.cat(outputs)

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
        for layer, block in enumerate(t.h):
            h = F.layer_norm(x, (self.hidden,), block.ln_1.weight, block.ln_1.bias, self.eps)
            qkv = torch.addmm(block.attn.c_attn.bias, h, block.attn.c_attn.weight)  # batched over all tokens
            a = self._attention(qkv, steps, layer, kv)  # split per request
            x = x + torch.addmm(block.attn.c_proj.bias, a, block.attn.c_proj.weight)
            h = F.layer_norm(x, (self.hidden,), block.ln_2.weight, block.ln_2.bias, self.eps)
            h = _gelu_new(torch.addmm(block.mlp.c_fc.bias, h, block.mlp.c_fc.weight))
            x = x + torch.addmm(block.mlp.c_proj.bias, h, block.mlp.c_proj.weight)
        last = torch.tensor([len(s.tokens) for s in steps], device=device).cumsum(0) - 1  # each request's last token
        x = F.layer_norm(x[last], (self.hidden,), t.ln_f.weight, t.ln_f.bias, self.eps)
        return F.linear(x, self.lm_head.weight)  # GPT-2 ties it to the token embedding; no bias
