"""CPU topology and the core allocator: a plan becomes pinned slots.

A slot is ``{cores, threads, batch}``: one worker instance, pinned to
``cores`` and running ``threads`` intra-op threads on batches of ``batch``.
Slots are disjoint (no two instances share a core), never run more threads
than they have cores, and stay on one socket whenever the instance fits in
one, because an instance split over sockets pays remote-memory latency on
every layer.  Cores are read from ``os.sched_getaffinity`` (a container or
taskset may allow fewer cores than the machine has) and sockets from /sys.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrat_plugin.plan_types import Plan


class AllocationError(ValueError):
    """A plan does not fit the usable cores."""


@dataclass(frozen=True)
class Slot:
    cores: tuple[int, ...]
    threads: int
    batch: int

    def __post_init__(self) -> None:
        if self.threads > len(self.cores):
            raise AllocationError(f"slot would run {self.threads} threads on {len(self.cores)} cores")

    def to_dict(self) -> dict[str, Any]:
        return {"cores": list(self.cores), "threads": self.threads, "batch": self.batch}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Slot:
        return cls(tuple(int(c) for c in data["cores"]), int(data["threads"]), int(data["batch"]))


def _socket_of(cpu: int, sys_root: Path) -> int:
    path = sys_root / f"cpu{cpu}" / "topology" / "physical_package_id"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


@dataclass(frozen=True)
class CpuTopology:
    """Usable cores grouped by socket (socket id → sorted core ids)."""

    sockets: dict[int, tuple[int, ...]]

    @property
    def cores(self) -> list[int]:
        return sorted(c for cores in self.sockets.values() for c in cores)

    @classmethod
    def from_system(cls, sys_root: Path = Path("/sys/devices/system/cpu")) -> CpuTopology:
        usable = sorted(os.sched_getaffinity(0))
        by_socket: dict[int, list[int]] = {}
        for cpu in usable:
            by_socket.setdefault(_socket_of(cpu, sys_root), []).append(cpu)
        return cls({s: tuple(c) for s, c in sorted(by_socket.items())})

    @classmethod
    def uniform(cls, sockets: int, cores_per_socket: int) -> CpuTopology:
        """A synthetic topology (tests, what-if planning)."""
        return cls({s: tuple(range(s * cores_per_socket, (s + 1) * cores_per_socket)) for s in range(sockets)})


def allocate(plan: Plan, topology: CpuTopology) -> list[Slot]:
    """Pin each instance of ``plan`` to its own cores.

    First-fit decreasing: largest instances first, each onto the socket with
    the most free cores that can hold it whole (which spreads instances round
    robin over sockets), taking that socket's lowest free cores.  An instance
    larger than any socket takes whole sockets, then the rest.
    """
    wanted = plan.threads_used
    available = len(topology.cores)
    if wanted > available:
        raise AllocationError(f"plan needs {wanted} cores but only {available} are usable: {plan.describe()}")
    free = {s: list(cores) for s, cores in topology.sockets.items()}
    largest_socket = max(len(c) for c in topology.sockets.values())
    slots: list[Slot] = []
    instances = sorted(((item.threads, item.batch) for item in plan.instances for _ in range(item.count)), reverse=True)
    for threads, batch in instances:
        if threads <= largest_socket:
            fitting = [s for s, cores in free.items() if len(cores) >= threads]
            if not fitting:
                raise AllocationError(
                    f"no socket has {threads} free cores for an instance (free per socket: "
                    f"{ {s: len(c) for s, c in free.items()} }); plan: {plan.describe()}"
                )
            socket = max(fitting, key=lambda s: (len(free[s]), -s))
            cores, free[socket] = free[socket][:threads], free[socket][threads:]
        else:
            cores = []
            for socket in sorted(free, key=lambda s: -len(free[s])):
                take = min(threads - len(cores), len(free[socket]))
                cores += free[socket][:take]
                free[socket] = free[socket][take:]
        slots.append(Slot(tuple(sorted(cores)), threads, batch))
    return slots
