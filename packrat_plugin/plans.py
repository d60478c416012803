"""Plan files and slot files: the contract between controller and workers.

Layout under the plan directory (``PACKRAT_PLAN_DIR``)::

    <model>/<version>.json            {"model", "version", "threads", "batch",
                                       "slots": [{"cores", "threads", "batch"}]}
    <model>/<version>.slot-<i>.lock   held (flock LOCK_EX) by the worker in slot i
    <model>/<version>.slot-<i>.inflight   8+8 bytes: worker pid, requests in service
    <model>/<version>.slot-<i>.startup.json  {"pid", "spawn_s", "load_s", "warmup_s"}

The controller writes plan files; each worker claims one slot for its whole
life by an exclusive ``flock`` on the slot's lock file.  The kernel drops the
lock when the process dies however it dies, so a crashed or killed worker
frees its slot by itself and TorchServe's respawned worker takes it.  The
in-flight file lets the controller count requests in service (TorchServe's
describe API only reports queued ones); it carries the writer's pid so a
dead worker's last count is not mistaken for load.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packrat_plugin.profile import write_json_atomic
from packrat_plugin.topology import Slot

PLAN_DIR_ENV = "PACKRAT_PLAN_DIR"
_INFLIGHT = struct.Struct("<qq")


@dataclass(frozen=True)
class VersionPlan:
    """The slots of one TorchServe model version (one (threads, batch) class)."""

    model: str
    version: str
    threads: int
    batch: int
    slots: tuple[Slot, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "threads": self.threads,
            "batch": self.batch,
            "slots": [s.to_dict() for s in self.slots],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VersionPlan:
        return cls(
            data["model"],
            str(data["version"]),
            int(data["threads"]),
            int(data["batch"]),
            tuple(Slot.from_dict(s) for s in data["slots"]),
        )


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PlanStore:
    """Reads and writes plan and slot files under one directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @classmethod
    def from_env(cls) -> PlanStore | None:
        root = os.environ.get(PLAN_DIR_ENV)
        return cls(root) if root else None

    def plan_path(self, model: str, version: str) -> Path:
        return self.root / model / f"{version}.json"

    def lock_path(self, model: str, version: str, index: int) -> Path:
        return self.root / model / f"{version}.slot-{index}.lock"

    def inflight_path(self, model: str, version: str, index: int) -> Path:
        return self.root / model / f"{version}.slot-{index}.inflight"

    def startup_path(self, model: str, version: str, index: int) -> Path:
        return self.root / model / f"{version}.slot-{index}.startup.json"

    def startup_timings(self, model: str, version: str) -> list[dict[str, float]]:
        """Start-up timings the live workers of this version wrote (see worker.py)."""
        plan = self.read(model, version)
        out = []
        for index in range(len(plan.slots) if plan else 0):
            try:
                data = json.loads(self.startup_path(model, version, index).read_text())
            except (FileNotFoundError, ValueError):
                continue
            if _pid_alive(int(data.get("pid", 0))):
                out.append(data)
        return out

    def write(self, plan: VersionPlan) -> Path:
        path = self.plan_path(plan.model, plan.version)
        write_json_atomic(path, plan.to_dict())
        return path

    def read(self, model: str, version: str) -> VersionPlan | None:
        path = self.plan_path(model, version)
        if not path.exists():
            return None
        return VersionPlan.from_dict(json.loads(path.read_text()))

    def in_service(self, model: str, version: str) -> int:
        """Requests being processed right now by live workers of this version."""
        plan = self.read(model, version)
        if plan is None:
            return 0
        total = 0
        for index in range(len(plan.slots)):
            try:
                raw = self.inflight_path(model, version, index).read_bytes()
            except FileNotFoundError:
                continue
            if len(raw) >= _INFLIGHT.size:
                pid, count = _INFLIGHT.unpack_from(raw)
                if count > 0 and _pid_alive(pid):
                    total += count
        return total


class InflightCounter:
    """A worker's view of its slot's in-flight file."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._pid = os.getpid()
        self.set(0)

    def set(self, count: int) -> None:
        # One aligned 16-byte pwrite: readers see the old or the new record.
        os.pwrite(self._fd, _INFLIGHT.pack(self._pid, count), 0)
