"""GPT-2 for one Orca iteration over any set of requests (selective batching).

An iteration takes each scheduled request's new tokens: its whole prompt the
first time (initiation), its last generated token after that (increment).
Requests differ in how many new tokens they bring and how many positions
they have cached; only attention cares which request a token belongs to.
Orca's *selective batching* follows from that: the tokens of all requests
are flattened to one ``[ΣL, H]`` tensor for the embeddings, layer norms, the
QKV projection, the output projection and the MLP, and attention reads each
request's own keys and values from the KV cache (``attention.py``: the
increments in one call per layer, the prompts in another).

The weights are the catalog GPT-2's (``transformers.GPT2LMHeadModel`` with
seeded weights), taken as they are, so greedy decoding here can be checked
token for token against the plain model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from handlers.orca.attention import IterationLayout, Step, attend, run_steps
from handlers.orca.kv_cache import KVCache, KVShape


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

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.wte.weight.dtype

    def kv_shape(self, blocks: int, block_size: int) -> KVShape:
        return KVShape(self.layers, self.heads, self.head_dim, blocks, block_size)

    @torch.inference_mode()
    def iterate(self, steps: Sequence[Step], kv: KVCache) -> torch.Tensor:
        """One iteration for ``steps``: the next-token logits of each request, ``[len(steps), vocab]``."""
        return run_steps(self, steps, kv, self.transformer.wte.weight.device)

    def run_layout(
        self, ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout, kv: KVCache,
        last: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The iteration from its tensors alone (``decode_programs.py`` captures this): the logits of the rows
        ``last`` picks (None: every row, a decode iteration's)."""
        t = self.transformer
        x = t.wte(ids) + t.wpe(positions)  # [ΣL, H]: every request's new tokens, flattened
        for layer, block in enumerate(t.h):
            h = F.layer_norm(x, (self.hidden,), block.ln_1.weight, block.ln_1.bias, self.eps)
            qkv = torch.addmm(block.attn.c_attn.bias, h, block.attn.c_attn.weight)  # batched over all tokens
            q, k, v = (t.view(-1, self.heads, self.head_dim) for t in qkv.split(self.hidden, dim=1))
            a = attend(q, k, v, layer, kv, layout)
            x = x + torch.addmm(block.attn.c_proj.bias, a, block.attn.c_proj.weight)
            h = F.layer_norm(x, (self.hidden,), block.ln_2.weight, block.ln_2.bias, self.eps)
            h = _gelu_new(torch.addmm(block.mlp.c_fc.bias, h, block.mlp.c_fc.weight))
            x = x + torch.addmm(block.mlp.c_proj.bias, h, block.mlp.c_proj.weight)
        x = x if last is None else x[last]
        x = F.layer_norm(x, (self.hidden,), t.ln_f.weight, t.ln_f.bias, self.eps)
        return F.linear(x, self.lm_head.weight)  # GPT-2 ties it to the token embedding; no bias
