"""The optimizer's output: a plan of worker instances, as plain data.

A ``Plan`` is what the optimizer returns, the allocator turns into slots, the
swapper serves and the controller reports.  It lives in its own module so that
those parts depend on the data, not on each other (the optimizer needs
profiles; the allocator and the swapper need only plans).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class PlanItem:
    count: int
    threads: int
    batch: int

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "threads": self.threads, "batch": self.batch}


@dataclass(frozen=True)
class Plan:
    threads: int  # T the plan was asked for
    batch: int  # B the plan serves
    latency_ms: float  # max profiled latency among its items
    instances: tuple[PlanItem, ...]

    @property
    def threads_used(self) -> int:
        return sum(i.count * i.threads for i in self.instances)

    @property
    def instance_count(self) -> int:
        return sum(i.count for i in self.instances)

    @property
    def uniform(self) -> bool:
        return len(self.instances) == 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "batch": self.batch,
            "latency_ms": self.latency_ms,
            "instances": [i.to_dict() for i in self.instances],
        }

    def describe(self) -> str:
        parts = " + ".join(f"{i.count}×⟨t={i.threads}, b={i.batch}⟩" for i in self.instances)
        return f"{parts}  ({self.threads_used}/{self.threads} threads, {self.latency_ms:.1f} ms)"


def format_instances(instances: list[dict[str, int]] | None, labels: bool = False) -> str:
    """``[{count, threads, batch}]`` as ``2×⟨1,4⟩`` (``2×⟨t=1,b=4⟩`` with labels)."""
    if not instances:
        return "-"
    t, b = ("t=", "b=") if labels else ("", "")
    return " + ".join(f"{i['count']}×⟨{t}{i['threads']},{b}{i['batch']}⟩" for i in instances)
