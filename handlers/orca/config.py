"""Orca's settings (``handler.orca`` in model-config.yaml)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, fields, replace
from typing import Any

from handlers.settings import known_settings

POLICIES = ("orca", "request")


class OrcaConfigError(ValueError):
    pass


@dataclass(frozen=True)
class OrcaConfig:
    max_batch: int = 8  # requests in one iteration
    kv_slots: int = 16  # KV memory: room for this many requests of max_tokens tokens, handed out in blocks
    block_size: int = 16  # positions per KV block (a request gets blocks as it grows)
    # > 0: prompts computed at most this many tokens per iteration, so a long prompt does not stall the running
    # requests' decode steps (chunked prefill); 0: whole prompts, as the committed benchmark tables ran.
    prefill_chunk: int = 0
    max_tokens: int = 256  # prompt + max_new_tokens of one request: a slot's size
    max_new_tokens: int = 128  # the most a request may ask for
    default_new_tokens: int = 16  # when a request does not say
    # "orca": iteration-level scheduling; "request": the paper's baseline,
    # request-level batching in the same engine (``scheduler.py``), for benchmarks.
    policy: str = "orca"
    # CUDA: decode iterations replay a CUDA graph per (batch, context) bucket (``decode_programs.py``).
    # Off until measured on a GPU; a CPU ignores it.
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise OrcaConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for f in fields(self):
            if f.name == "policy" or (f.name == "prefill_chunk" and getattr(self, f.name) == 0):
                continue
            if f.name == "cuda_graphs":
                if not isinstance(self.cuda_graphs, bool):
                    raise OrcaConfigError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise OrcaConfigError(f"{f.name} must be an integer ≥ 1, got {value!r}")
        if self.max_tokens > 1024:
            raise OrcaConfigError(f"max_tokens must be ≤ 1024 (GPT-2's positions), got {self.max_tokens}")
        if self.max_new_tokens >= self.max_tokens:
            raise OrcaConfigError(f"max_new_tokens ({self.max_new_tokens}) must leave room for a prompt "
                                  f"in max_tokens ({self.max_tokens})")  # fmt: skip
        if self.default_new_tokens > self.max_new_tokens:
            raise OrcaConfigError(f"default_new_tokens ({self.default_new_tokens}) exceeds max_new_tokens")

    def fitted_to(self, positions: int, given: Collection[str]) -> OrcaConfig:
        """These settings on a checkpoint whose context holds ``positions`` tokens: the ones the user did not
        give (not in ``given``) shrink to fit it, so a small checkpoint serves with no setting added and its
        context bounds the requests; one the user gave that cannot fit is refused by name."""
        if "max_tokens" in given and self.max_tokens > positions:
            raise OrcaConfigError(f"max_tokens ({self.max_tokens}) exceeds the checkpoint's context of "
                                  f"{positions} positions (n_positions)")  # fmt: skip
        max_tokens = self.max_tokens if "max_tokens" in given else min(self.max_tokens, positions)
        max_new = self.max_new_tokens
        if "max_new_tokens" not in given and max_new >= max_tokens:
            max_new = max(1, max_tokens // 2)
        default_new = self.default_new_tokens
        if "default_new_tokens" not in given:
            default_new = min(default_new, max_new)
        if max_tokens < 2:
            raise OrcaConfigError(f"the checkpoint's context of {positions} positions leaves no room to generate")
        return replace(self, max_tokens=max_tokens, max_new_tokens=max_new, default_new_tokens=default_new)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> OrcaConfig:
        raw = known_settings(cls, raw, "orca", OrcaConfigError)
        return cls(**raw)
