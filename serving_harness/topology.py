"""The machine's usable cores, grouped by socket.

Cores are read from ``os.sched_getaffinity`` (a container or ``taskset`` may
allow fewer cores than the machine has) and sockets from /sys, because an
instance split over sockets pays remote-memory latency on every layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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
