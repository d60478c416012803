"""Orca's settings (``handler.orca`` in model-config.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from handlers.settings import known_settings

POLICIES = ("orca", "request")


class OrcaConfigError(ValueError):
    pass


@dataclass(frozen=True)
class OrcaConfig:
    max_batch: int = 8  # requests in one iteration
    kv_slots: int = 16  # requests holding KV memory at once (each reserves max_tokens positions)
    max_tokens: int = 256  # prompt + max_new_tokens of one request: a slot's size
    max_new_tokens: int = 128  # the most a request may ask for
    default_new_tokens: int = 16  # when a request does not say
    # "orca": iteration-level scheduling; "request": the paper's baseline,
    # request-level batching in the same engine (``scheduler.py``), for benchmarks.
    policy: str = "orca"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise OrcaConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for f in fields(self):
            if f.name == "policy":
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

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> OrcaConfig:
        raw = known_settings(cls, raw, "orca", OrcaConfigError)
        return cls(**raw)
