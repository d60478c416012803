"""The machine's usable cores, grouped by socket, whole physical cores first.

Three things limit what a process may use, and all three are read here:

- its **affinity** (``os.sched_getaffinity``): a ``taskset`` or a cgroup
  ``cpuset`` allows fewer CPUs than the machine has;
- its cgroup's **CPU quota** (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` /
  ``cpu.cfs_period_us``): a Kubernetes pod with ``cpu: 4`` on a 64-core node
  usually gets a quota, not a cpuset, and the kernel throttles a process that
  runs more threads than the quota pays for.  The usable count is the quota
  rounded down to whole cores (at least one), taken from the allowed CPUs;
- **SMT**: two hardware threads of one physical core share its execution
  units, so for a GEMM they are not two cores.  Within a socket, CPUs are
  ordered first thread of every physical core first, sibling threads after
  (``thread_siblings_list``), so an instance carved from the front of a
  socket's list gets whole physical cores before it gets a sibling.

Sockets come from /sys too, because an instance split over sockets pays
remote-memory latency on every layer.  ``source`` says in words where the
count came from, for status output.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _socket_of(cpu: int, sys_root: Path) -> int:
    path = sys_root / f"cpu{cpu}" / "topology" / "physical_package_id"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return 0


def parse_cpu_list(text: str) -> list[int]:
    """The kernel's CPU list format (``0-3,8,10-11``) as CPU ids."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def _siblings_of(cpu: int, sys_root: Path) -> list[int]:
    path = sys_root / f"cpu{cpu}" / "topology" / "thread_siblings_list"
    try:
        return parse_cpu_list(path.read_text()) or [cpu]
    except (OSError, ValueError):
        return [cpu]


def physical_first(cpus: list[int], sys_root: Path) -> list[int]:
    """``cpus`` ordered by their rank among their core's hardware threads, then by core: every physical core's
    first thread before any core's second."""

    def key(cpu: int) -> tuple[int, int]:
        siblings = sorted(_siblings_of(cpu, sys_root))
        rank = siblings.index(cpu) if cpu in siblings else 0
        return rank, siblings[0]

    return sorted(cpus, key=key)


@dataclass(frozen=True)
class CpuQuota:
    """Whole cores a cgroup CPU quota pays for (None: no quota), and where that was read."""

    cores: int | None
    source: str


def _cgroup_paths(proc_cgroup: Path) -> dict[str, str]:
    """Controller name (``""`` for v2's unified hierarchy) → this process's cgroup path."""
    paths: dict[str, str] = {}
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return paths
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                paths[controller] = parts[2]
    return paths


def _ancestors(root: Path, relative: str) -> list[Path]:
    """``root/relative`` and every folder above it up to ``root``: a parent's quota limits its children too."""
    folder = root / relative.lstrip("/")
    out = [folder]
    while folder != root and root in folder.parents:
        folder = folder.parent
        out.append(folder)
    return out


def _quota_v2(folder: Path) -> float | None:
    try:
        fields = (folder / "cpu.max").read_text().split()
        return None if fields[0] == "max" else int(fields[0]) / int(fields[1])
    except (OSError, ValueError, IndexError, ZeroDivisionError):
        return None


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def read_cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> CpuQuota:
    """The tightest CPU quota on this process's cgroup or any cgroup above it, v2 or v1."""
    paths = _cgroup_paths(proc_cgroup)
    found: list[tuple[float, str]] = []
    if "" in paths:
        for folder in _ancestors(cgroup_root, paths[""]):
            value = _quota_v2(folder)
            if value is not None:
                found.append((value, f"cgroup v2 {folder / 'cpu.max'}"))
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        mount = cgroup_root / controller
        if "cpu" in paths and mount.is_dir():
            for folder in _ancestors(mount, paths["cpu"]):
                value = _quota_v1(folder)
                if value is not None:
                    found.append((value, f"cgroup v1 {folder / 'cpu.cfs_quota_us'}"))
    if not found:
        return CpuQuota(None, "no CPU quota")
    value, where = min(found)
    return CpuQuota(max(1, math.floor(value + 1e-9)), f"{where}: {value:g} CPUs of time")


@dataclass(frozen=True)
class CpuTopology:
    """Usable cores grouped by socket (socket id → core ids, whole physical cores first)."""

    sockets: dict[int, tuple[int, ...]]
    source: str = field(default="given", compare=False)

    @property
    def cores(self) -> list[int]:
        return sorted(c for cores in self.sockets.values() for c in cores)

    @classmethod
    def from_system(
        cls,
        sys_root: Path = SYS_CPU,
        cgroup_root: Path = CGROUP_ROOT,
        proc_cgroup: Path = PROC_CGROUP,
        affinity: set[int] | None = None,
    ) -> CpuTopology:
        allowed = sorted(affinity if affinity is not None else os.sched_getaffinity(0))
        socket = {cpu: _socket_of(cpu, sys_root) for cpu in allowed}
        ordered = physical_first(allowed, sys_root)
        quota = read_cpu_quota(cgroup_root, proc_cgroup)
        source = f"{len(allowed)} CPUs in the affinity mask"
        if quota.cores is not None and quota.cores < len(ordered):
            # Whole physical cores first, socket by socket: an instance as large as the quota stays on one socket.
            compact = sorted(ordered, key=socket.__getitem__)  # stable: physical-first kept
            kept = set(compact[: quota.cores])
            ordered = [cpu for cpu in ordered if cpu in kept]
            source += f", limited to {quota.cores} by {quota.source}"
        elif quota.cores is not None:
            source += f" (the quota, {quota.source}, allows them all)"
        by_socket: dict[int, list[int]] = {}
        for cpu in ordered:
            by_socket.setdefault(socket[cpu], []).append(cpu)
        return cls({s: tuple(c) for s, c in sorted(by_socket.items())}, source)

    @classmethod
    def uniform(cls, sockets: int, cores_per_socket: int) -> CpuTopology:
        """A synthetic topology (tests, what-if planning)."""
        return cls(
            {s: tuple(range(s * cores_per_socket, (s + 1) * cores_per_socket)) for s in range(sockets)}, "synthetic"
        )
