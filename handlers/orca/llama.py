"""The Llama family for one Orca iteration: RoPE, RMSNorm, grouped-query attention, SwiGLU.

The shapes of Llama, Qwen2 and SmolLM checkpoints (``LlamaForCausalLM``,
``Qwen2ForCausalLM``): every request's new tokens flattened to one
``[ΣL, H]`` tensor for the norms, projections and MLP, as for GPT-2
(``gpt2.py``), with the rotary position embedding applied to each token's
query and key at its own position before they meet the cache
(``attention.py``; fewer key/value heads than query heads is one
``enable_gqa`` call).  The norms, projections and rotary tables are the
checkpoint's own modules, called as they are, so greedy decoding can be
checked token for token against ``generate``.

Settings this does not compute are refused by name when the model is
wrapped (a sliding attention window, per-head query/key norms, a non-SiLU
MLP), so a checkpoint is either served exactly or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from handlers.orca.attention import IterationLayout, Step, attend, run_steps
from handlers.orca.kv_cache import KVCache, KVShape
from model_store.user_models import UnsupportedCheckpoint, check_llama_config


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class SelectiveLlama(nn.Module):
    """A Llama-family causal LM that runs Orca iterations; weights shared with ``hf`` (no copy)."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        cfg = hf.config
        check_llama_config(cfg)
        self.model = hf.model
        self.lm_head = hf.lm_head
        attn = self.model.layers[0].self_attn
        for name in ("q_norm", "k_norm"):
            if hasattr(attn, name):
                raise UnsupportedCheckpoint(f"per-head {name} ({type(hf).__name__}) is not supported")
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.layers = cfg.num_hidden_layers
        self.positions = cfg.max_position_embeddings
        self.vocab = cfg.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def kv_shape(self, blocks: int, block_size: int) -> KVShape:
        return KVShape(self.layers, self.kv_heads, self.head_dim, blocks, block_size)

    @torch.inference_mode()
    def iterate(self, steps: Sequence[Step], kv: KVCache) -> torch.Tensor:
        """One iteration for ``steps``: the next-token logits of each request, ``[len(steps), vocab]``."""
        return run_steps(self, steps, kv, self.model.embed_tokens.weight.device)

    def run_layout(
        self, ids: torch.Tensor, positions: torch.Tensor, layout: IterationLayout, kv: KVCache,
        last: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The iteration from its tensors alone (``decode_programs.py`` captures this): the logits of the rows
        ``last`` picks (None: every row, a decode iteration's)."""
        m = self.model
        x = m.embed_tokens(ids)  # [ΣL, H]
        cos, sin = m.rotary_emb(x, positions.unsqueeze(0))  # [1, ΣL, head_dim]: each token at its own position
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # broadcast over heads
        for layer, block in enumerate(m.layers):
            h = block.input_layernorm(x)
            a = block.self_attn
            q = a.q_proj(h).view(-1, self.heads, self.head_dim)
            k = a.k_proj(h).view(-1, self.kv_heads, self.head_dim)
            v = a.v_proj(h).view(-1, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            x = x + a.o_proj(attend(q, k, v, layer, kv, layout))
            h = block.post_attention_layernorm(x)
            mlp = block.mlp
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return self.lm_head(m.norm(x if last is None else x[last]))
