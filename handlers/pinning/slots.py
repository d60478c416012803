"""Plan files and slot files: the contract between controller and workers.

Layout under the plan directory (``PACKRAT_PLAN_DIR``)::

    <model>/<version>.json            {"model", "version", "threads", "batch",
                                       "slots": [{"cores", "threads", "batch"}], "grouped"}
    <model>/<version>.slot-<i>.lock   held (flock LOCK_EX) by the worker in slot i
    <model>/<version>.slot-<i>.counters   the worker's live counters (``SlotCounters``)
    <model>/<version>.draining        {"pid", "cores", "narrow"} while the version drains after a swap
    <model>/<version>.slot-<i>.startup.json  {"pid", "spawn_s", "load_s", "warmup_s"}

The controller writes plan files; each worker claims one slot for its whole
life by an exclusive ``flock`` on the slot's lock file.  The kernel drops the
lock when the process dies however it dies, so a crashed or killed worker
frees its slot by itself and TorchServe's respawned worker takes it.  The
counters file lets the controller count requests in service (TorchServe's
describe API only reports queued ones) and learn what serving really costs
(time in the handler and in the model, per batch), which the profile, timed
on the model alone, does not say; it carries the writer's pid so a dead
worker's last record is not mistaken for load.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from serving_harness.jsonfile import write_json_atomic
from serving_harness.processes import pid_alive


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

    def narrowed(self) -> Slot:
        """Where this slot's worker runs while its version drains: one thread on its first core.

        The swapper frees the other cores for the new set by this rule and the
        worker follows it, so both must read it from here.
        """
        return Slot(self.cores[:1], 1, self.batch) if self.threads > 1 else self


PLAN_DIR_ENV = "PACKRAT_PLAN_DIR"
_COUNTERS = struct.Struct("<9q")  # the fields of CountersRecord


@dataclass(frozen=True)
class VersionPlan:
    """The slots of one TorchServe model version (one (threads, batch) class)."""

    model: str
    version: str
    threads: int
    batch: int
    slots: tuple[Slot, ...]
    # One worker serves every slot, one pinned lane per slot (a mixed plan,
    # handlers/mixed_plan/instances.py); otherwise one worker per slot.
    grouped: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "threads": self.threads,
            "batch": self.batch,
            "slots": [s.to_dict() for s in self.slots],
            "grouped": self.grouped,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VersionPlan:
        return cls(
            data["model"],
            str(data["version"]),
            int(data["threads"]),
            int(data["batch"]),
            tuple(Slot.from_dict(s) for s in data["slots"]),
            bool(data.get("grouped", False)),
        )


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

    def counters_path(self, model: str, version: str, index: int) -> Path:
        return self.root / model / f"{version}.slot-{index}.counters"

    def draining_path(self, model: str, version: str) -> Path:
        return self.root / model / f"{version}.draining"

    def set_draining(self, model: str, version: str, draining: bool, narrow: bool = False) -> None:
        """Mark a version as draining after a swap, with the cores it keeps and
        the marking process (so a marker left by a controller that died is
        ignored); see ``worker.PackratWorkerMixin.wait_for_drains``.

        ``narrow``: the version's multi-thread workers drain on one thread and
        core each (``Slot.narrowed``), so its other cores go to the new set
        at once.  A grouped plan's one worker keeps all of its cores.
        """
        path = self.draining_path(model, version)
        if not draining:
            path.unlink(missing_ok=True)
            return
        plan = self.read(model, version)
        narrow = narrow and plan is not None and not plan.grouped
        slots = [slot.narrowed() if narrow else slot for slot in plan.slots] if plan else []
        cores = sorted({c for slot in slots for c in slot.cores})
        write_json_atomic(path, {"pid": os.getpid(), "cores": cores, "narrow": narrow})

    def drain_markers(self, model: str) -> dict[str, DrainMarker]:
        """The versions of ``model`` draining now (live markers only), in one directory scan."""
        markers: dict[str, DrainMarker] = {}
        try:
            entries = list(os.scandir(self.root / model))
        except FileNotFoundError:
            return markers
        for entry in entries:
            if not entry.name.endswith(".draining"):
                continue
            try:
                data = json.loads(Path(entry.path).read_text())
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(data, dict) and pid_alive(int(data.get("pid", 0))):
                cores = frozenset(int(c) for c in data.get("cores", ()))
                markers[entry.name.removesuffix(".draining")] = DrainMarker(cores, bool(data.get("narrow", False)))
        return markers

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
            if pid_alive(int(data.get("pid", 0))):
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

    def counters(self, model: str, version: str) -> VersionCounters:
        """What the live workers of this version are doing and have served (one read of each slot)."""
        plan = self.read(model, version)
        in_service, totals = 0, ServiceTotals()
        for index in range(len(plan.slots) if plan else 0):
            record = read_counters(self.counters_path(model, version, index))
            if record is None or not pid_alive(record.pid):
                continue
            in_service += max(0, record.in_service)
            totals = totals + ServiceTotals(
                record.batches, record.requests, record.handler_ns / 1e9, record.model_ns / 1e9,
                record.model_cpu_ns / 1e9,
            )  # fmt: skip
        return VersionCounters(in_service, totals)

    def in_service(self, model: str, version: str) -> int:
        """Requests being processed right now by live workers of this version."""
        return self.counters(model, version).in_service

    def service_totals(self, model: str, version: str) -> ServiceTotals:
        """What the live workers of this version have served since they started."""
        return self.counters(model, version).totals


@dataclass(frozen=True)
class ServiceTotals:
    """Cumulative service counters of a set of workers."""

    batches: int = 0
    requests: int = 0
    handler_s: float = 0.0  # whole ``handle()``: decode, model, encode
    model_s: float = 0.0  # the model's forward pass alone
    # The worker process's CPU time over those forward passes (all its threads): under ``threads × model_s``
    # by the time its threads were not running, which is what other processes on its cores cost it.
    model_cpu_s: float = 0.0

    def __add__(self, other: ServiceTotals) -> ServiceTotals:
        return ServiceTotals(self.batches + other.batches, self.requests + other.requests,
                             self.handler_s + other.handler_s, self.model_s + other.model_s,
                             self.model_cpu_s + other.model_cpu_s)  # fmt: skip

    def __sub__(self, other: ServiceTotals) -> ServiceTotals:
        return ServiceTotals(self.batches - other.batches, self.requests - other.requests,
                             self.handler_s - other.handler_s, self.model_s - other.model_s,
                             self.model_cpu_s - other.model_cpu_s)  # fmt: skip


class DrainMarker(NamedTuple):
    """A draining version: the cores it keeps, and whether its multi-thread workers narrow to them."""

    cores: frozenset[int]
    narrow: bool


def draining_cores(markers: dict[str, DrainMarker], except_version: str) -> frozenset[int]:
    """Cores that versions other than ``except_version`` keep while they drain (from ``PlanStore.drain_markers``)."""
    return frozenset(c for version, marker in markers.items() if version != except_version for c in marker.cores)


@dataclass(frozen=True)
class VersionCounters:
    in_service: int
    totals: ServiceTotals


class CountersRecord(NamedTuple):
    """One slot's counters file, as ``SlotCounters`` writes it."""

    seq: int
    pid: int
    in_service: int
    batches: int
    requests: int
    handler_ns: int
    model_ns: int
    model_cpu_ns: int
    seq_again: int


def read_counters(path: Path, attempts: int = 3) -> CountersRecord | None:
    """One slot's record, or None (no file, or torn by a concurrent write each time)."""
    for _ in range(attempts):
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if len(raw) < _COUNTERS.size:
            return None
        record = CountersRecord(*_COUNTERS.unpack_from(raw))
        if record.seq == record.seq_again:
            return record
    return None


class SlotCounters:
    """A worker's side of its slot's counters file.

    One 72-byte ``pwrite`` per update, framed by a sequence number at both
    ends: a reader that races a write sees two different numbers and reads
    again, so it never adds up half of one record and half of another.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._pid = os.getpid()
        self._seq = 0
        self.in_service = 0
        self.batches = 0
        self.requests = 0
        self.handler_ns = 0
        self.model_ns = 0
        self.model_cpu_ns = 0
        self._write()

    def set_in_service(self, count: int) -> None:
        self.in_service = count
        self._write()

    def add_batch(self, requests: int, handler_ns: int, model_ns: int, model_cpu_ns: int = 0) -> None:
        self.batches += 1
        self.requests += requests
        self.handler_ns += handler_ns
        self.model_ns += model_ns
        self.model_cpu_ns += model_cpu_ns
        self._write()

    def _write(self) -> None:
        self._seq += 1
        fields = (self._pid, self.in_service, self.batches, self.requests, self.handler_ns, self.model_ns,
                  self.model_cpu_ns)  # fmt: skip
        os.pwrite(self._fd, _COUNTERS.pack(self._seq, *fields, self._seq), 0)
