"""Active/passive worker-set swapping through TorchServe's management API.

One TorchServe version holds one ``batch_size``, so each (threads, batch)
class of a uniform plan is a version of its own, named ``t<threads>b<batch>``
(a copy of the user's archive whose manifest says so).  One version is
active (the default, serving); others may be kept *warm*: registered, with
their workers started, pinned to their slots and idle, so that swapping to
them costs no worker start.  An idle TorchServe worker uses no CPU (measured:
0 %) but keeps its memory (ResNet-50 TorchScript: ~0.65 GB unique per
worker), so the controller bounds how many are kept (``standby``).

Applying a plan:

- same class as the active version: scale the active version to the new
  instance count (its slot list covers every instance that fits, so no
  worker moves);
- otherwise: bring the target version up unless it is warm (register if
  needed, scale to the plan's count, wait until every worker is READY), make
  it the default (new requests go to it), wait until the old version has
  nothing queued and nothing in service, then retire the old version: scale
  it to zero, or to its standby count if the controller keeps it warm.
  While the old version drains no core is shared: the new workers on its
  cores hold their batches (or, with ``SwapperConfig.narrow_drains``, the
  old workers narrow to one core each and the freed cores serve at once).

A failure before ``set-default`` (a worker that cannot start, a timeout)
unregisters the half-built version and leaves the active one serving: the
old version never loses its workers before the new one serves.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handlers.pinning.slots import PlanStore, VersionPlan
from packrat_plugin import failpoints
from packrat_plugin.allocator import allocate
from packrat_plugin.archives import versioned_copy
from packrat_plugin.plan_types import Plan, PlanItem
from serving_harness.clients import ManagementClient, TorchServeAPIError
from serving_harness.topology import CpuTopology

logger = logging.getLogger(__name__)


def ready_counts(versions: list[dict[str, Any]]) -> dict[str, int]:
    """READY workers per version, from a describe-all answer."""
    return {str(v["modelVersion"]): sum(w.get("status") == "READY" for w in v.get("workers", [])) for v in versions}


def version_name(item: PlanItem, core_tag: str = "") -> str:
    """The TorchServe version that serves instances of ``item``'s class.

    ``core_tag`` names the cores when the model has a share of the server
    (``division.py``): the same class on other cores is another worker set.
    """
    return f"t{item.threads}b{item.batch}{core_tag}"


def mixed_version_name(plan: Plan, core_tag: str = "") -> str:
    """The TorchServe version of a mixed plan: ``mix-1x1t4b-1x1t2b`` (count × threads t, batch b)."""
    return "mix-" + "-".join(f"{i.count}x{i.threads}t{i.batch}b" for i in plan.instances) + core_tag


_VERSION = re.compile(r"t(\d+)b(\d+)(-c[\d-]+)?")


def parse_version_name(version: str) -> tuple[int, int, str] | None:
    """``(threads, batch, core_tag)`` of a uniform version Packrat names (``version_name``); None for any
    other name (a user's own version, or a mixed plan's, which is not adopted)."""
    match = _VERSION.fullmatch(version)
    return None if match is None else (int(match.group(1)), int(match.group(2)), match.group(3) or "")


def cores_tag(topology: CpuTopology) -> str:
    """``-c0-1`` for cores 0 and 1: a version name's suffix for a model's share of the cores."""
    return "-c" + "-".join(str(c) for c in topology.cores)


class SwapError(RuntimeError):
    """A reconfiguration failed; the previous configuration keeps serving."""


@dataclass
class SwapReport:
    kind: str  # "initial" | "scale" | "swap" | "none"
    before: list[dict[str, int]] | None
    after: list[dict[str, int]]
    started: float  # wall clock
    seconds: float
    active_version: str
    # Seconds per step of a swap: "bring_up" (register + workers READY; near
    # zero when the target was warm), "switch" (set-default), "drain" (old
    # version empties; the new set's workers on its cores hold their batches
    # until then), "settle" (the old version stays empty for the settle
    # window), "retire" (old version scaled down).  The new plan takes
    # requests after bring_up + switch; drain, settle and retire finish
    # requests already queued on the old one.
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    warm: bool = False  # the target version's workers were already running
    # Where a cold bring-up's time went, per worker (median over workers):
    # "spawn_s" (process start + imports), "load_s", "warmup_s"; from the
    # timings workers write beside their slots (worker.py).
    worker_startup: dict[str, float] = field(default_factory=dict)

    @property
    def serving_after_s(self) -> float:
        """Seconds until requests went to the new plan."""
        return self.phases.get("bring_up", self.seconds) + self.phases.get("switch", 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "serving_after_s": self.serving_after_s}


@dataclass
class SwapperConfig:
    max_batch_delay_ms: int = 5
    response_timeout_s: int = 120
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 300.0
    poll_s: float = 0.02
    # A drained version's zeros must hold this long (plus the batch delay where it batches) before its workers
    # are stopped: a job TorchServe has taken off the queue is in transit to the worker for milliseconds before
    # the worker counts it in service.  The new set's hold ends at the first zero, not after this window: every
    # 0.1 s of hold is 0.1 s in which the new plan serves nothing (1.4 requests at 14/s) after a rise, and a job
    # that lands on the old set after the hold only shares the cores for its one batch.
    drain_settle_s: float = 0.1
    # Off (the default): every new worker on the old set's cores holds its batches until the drain ends, and the
    # old set drains at full strength.  On: the old set's multi-thread workers drain on one thread and core each
    # and the new workers on the cores this frees serve at once (handlers/pinning/worker.py, ``wait_for_drains``).
    # On the 2-core VM narrowing measured worse (the quick step's mean 1.22x the held drains', A/B in one run);
    # it frees more cores where the old workers are wider.
    narrow_drains: bool = False


def version_slots(model: str, version: str, item: PlanItem, topology: CpuTopology) -> VersionPlan:
    """Every slot of this (threads, batch) class that fits the cores.

    Listing all of them, not just ``item.count``, makes a scale-only change a
    pure TorchServe scale: workers that stay keep their slots, new ones take
    free slots, and slots never overlap.
    """
    fit = len(topology.cores) // item.threads
    if fit < item.count:
        raise SwapError(f"{item.count} instances of {item.threads} threads do not fit {len(topology.cores)} cores")
    slots = allocate(
        Plan(len(topology.cores), fit * item.batch, 0.0, (PlanItem(fit, item.threads, item.batch),)), topology
    )
    return VersionPlan(model, version, item.threads, item.batch, tuple(slots))


@dataclass
class ActivePassiveSwapper:
    management: ManagementClient
    store: PlanStore
    model: str
    archive: Path  # the user's archive; versions are copies of it
    model_store: Path  # TorchServe's model store, where the copies go
    topology: CpuTopology
    config: SwapperConfig = field(default_factory=SwapperConfig)
    active: str | None = None
    active_item: PlanItem | None = None  # the active uniform class (None while a mixed plan serves)
    active_plan: Plan | None = None
    registered: set[str] = field(default_factory=set)
    standby: dict[str, PlanItem] = field(default_factory=dict)  # version → workers kept warm
    core_tag: str = ""  # see version_name

    def version_for(self, item: PlanItem) -> str:
        return version_name(item, self.core_tag)

    def retarget(self, topology: CpuTopology, tag: str) -> None:
        """Serve the next plans on other cores: stop the standby sets pinned to the old ones.

        The active version keeps serving where it is until ``apply`` swaps
        it for a version on the new cores (its name differs by ``tag``).
        """
        for version in list(self.standby):
            if version != self.active and version in self.registered:
                self._scale(version, 0)
        self.standby = {}
        self.topology, self.core_tag = topology, tag

    def adopt(self, versions: list[dict[str, Any]], default: str) -> Plan:
        """Take over the worker sets an earlier controller left serving, from a describe-all answer and the
        default version's name: the default version becomes the active one, and every other version with
        workers joins the standby set once it has drained (a swap interrupted between set-default and
        retire ends here).  Returns the plan the active version serves.  A version that is not one of
        Packrat's uniform versions on these cores is refused with SwapError before anything is touched."""
        classes: dict[str, PlanItem] = {}
        for v in versions:
            name = str(v["modelVersion"])
            parsed = parse_version_name(name)
            if parsed is None or parsed[2] != self.core_tag:
                raise SwapError(f"{self.model} version {name} is not one Packrat serves on these cores "
                                f"(t<threads>b<batch>{self.core_tag})")  # fmt: skip
            classes[name] = PlanItem(len(v.get("workers", [])), parsed[0], parsed[1])
        item = classes.get(default)
        if item is None or item.count == 0:
            raise SwapError(f"{self.model}'s default version {default} has no workers to adopt")
        for name, other in classes.items():
            if name != default and other.count > 0:
                self._drain(name)
                self.standby[name] = other
        self.registered = set(classes)
        plan = Plan(item.count * item.threads, item.count * item.batch, math.nan, (item,))
        self._set_active(default, plan)
        return plan

    def archive_name(self, version: str) -> str:
        return f"{self.model}.packrat-{version}.mar"

    def ready_workers(self) -> dict[str, int]:
        """READY workers per registered version (one describe call)."""
        try:
            versions = self.management.describe(self.model, "all")
        except TorchServeAPIError as exc:
            if exc.status == 404:
                return {}
            raise
        return {str(v["modelVersion"]): sum(w.get("status") == "READY" for w in v.get("workers", [])) for v in versions}

    def is_warm(self, item: PlanItem, ready: dict[str, int] | None = None) -> bool:
        ready = self.ready_workers() if ready is None else ready
        return ready.get(self.version_for(item), 0) >= item.count

    def keep_warm(self, items: list[PlanItem]) -> None:
        """Keep these classes' workers running beside the active version; stop the rest.

        Asynchronous: TorchServe starts the workers in the background (at low
        priority, see worker.py) and ``is_warm`` says when they are READY.
        """
        wanted = {self.version_for(i): i for i in items if self.version_for(i) != self.active}
        for version in list(self.standby):
            if version not in wanted and version != self.active and version in self.registered:
                self._scale(version, 0)
        for version, item in wanted.items():
            if version not in self.registered:
                self._register(version, item, workers=0)
            self._scale(version, item.count, synchronous=False)
        self.standby = wanted

    def wait_warm(self, timeout_s: float) -> bool:
        """Wait until every standby version is READY; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self.ready_workers()
            if all(self.is_warm(item, ready) for item in self.standby.values()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.25)

    def apply(self, plan: Plan, standby: list[PlanItem] | None = None) -> SwapReport:
        """Serve ``plan``; ``standby``: the classes to keep warm afterwards.

        A uniform plan is a version of its class with one worker per
        instance; a mixed plan is a version of its own served by one worker
        that runs every instance on its own pinned lane (``grouped``, see
        handlers/mixed_plan/handler.py).  The old set is retired *into* the
        standby set when its class is in ``standby``: scaling it to zero and
        letting ``keep_warm`` start it again would cost a cold start-up
        (imports, model load, warm-up: ~4 s of a core for ResNet-50) right
        when the new set needs the cores.
        """
        grouped = not plan.uniform
        item = plan.instances[0]
        before = self.active_plan_dicts()
        after = [i.to_dict() for i in plan.instances]
        start_wall, start = time.time(), time.monotonic()
        warm = False
        startup: dict[str, float] = {}

        phases: dict[str, float] = {}
        mark = [start]

        def phase(name: str) -> None:
            now = time.monotonic()
            phases[name] = now - mark[0]
            mark[0] = now

        def report(kind: str) -> SwapReport:
            seconds = time.monotonic() - start
            return SwapReport(
                kind, before, after, start_wall, seconds, self.active or "", phases,
                warm=warm, worker_startup=startup,
            )  # fmt: skip

        new = mixed_version_name(plan, self.core_tag) if grouped else self.version_for(item)
        workers = 1 if grouped else item.count
        if self.active is None:
            self._bring_up(new, plan)
            startup = self._startup_summary(new)
            self._set_active(new, plan)
            return report("initial")
        if new == self.active:
            if grouped or item.count == self.active_item.count:
                return report("none")
            try:
                self.management.scale(self.model, item.count, version=self.active, synchronous=True)
                self._wait_ready(self.active, item.count)
            except TorchServeAPIError as exc:
                raise SwapError(f"scaling version {self.active} to {item.count} workers failed: {exc}") from exc
            self._set_active(new, plan)
            return report("scale")
        old = self.active
        ready = self.ready_workers()
        warm = ready.get(new, 0) >= workers
        if warm:
            if ready[new] > workers:  # a standby set larger than this plan: stop the extra workers
                self._scale(new, workers)
        else:
            self._bring_up(new, plan)
            startup = self._startup_summary(new)
        phase("bring_up")
        failpoints.reach("ready")
        try:
            self.management.set_default(self.model, new)
        except TorchServeAPIError as exc:
            if new not in self.standby:
                self._discard(new)
            raise SwapError(f"set-default to version {new} failed: {exc}") from exc
        self._set_active(new, plan)
        phase("switch")
        failpoints.reach("switched")
        self.store.set_draining(self.model, old, True, narrow=self.config.narrow_drains)
        try:
            failpoints.reach("draining")
            self._drain(old, settle=False)  # the new set holds its batches until the old one is first empty
        finally:
            self.store.set_draining(self.model, old, False)
        phase("drain")
        self._drain(old)  # empty for the settle window before its workers stop: a job in transit is served
        phase("settle")
        failpoints.reach("drained")
        kept = self.standby if standby is None else {self.version_for(i): i for i in standby}
        keep = kept.get(old)
        self._scale(old, keep.count if keep else 0)
        self.standby.pop(new, None)
        phase("retire")
        return report("swap")

    def _set_active(self, version: str, plan: Plan) -> None:
        self.active, self.active_plan = version, plan
        self.active_item = plan.instances[0] if plan.uniform else None

    def active_plan_dicts(self) -> list[dict[str, int]] | None:
        return [i.to_dict() for i in self.active_plan.instances] if self.active_plan else None

    # -- steps -----------------------------------------------------------------

    def _register(self, version: str, plan: Plan | PlanItem, workers: int) -> None:
        """Register ``version`` for a uniform class (a ``PlanItem``) or a mixed ``Plan`` (grouped)."""
        grouped = isinstance(plan, Plan) and not plan.uniform
        item = plan.instances[0] if isinstance(plan, Plan) and plan.uniform else plan
        target = self.model_store / self.archive_name(version)
        if not target.exists():
            versioned_copy(self.archive, target, version, grouped, self.config.max_batch_delay_ms)
        if grouped:
            slots = tuple(allocate(plan, self.topology))
            total = sum(i.count * i.batch for i in plan.instances)
            self.store.write(VersionPlan(self.model, version, plan.threads_used, total, slots, grouped=True))
            batch_size, delay = 1, 0  # async mode: the worker batches per instance
        else:
            self.store.write(version_slots(self.model, version, item, self.topology))
            batch_size, delay = item.batch, self.config.max_batch_delay_ms
        self.management.register(
            self.archive_name(version),
            model_name=self.model,
            initial_workers=workers,
            batch_size=batch_size,
            max_batch_delay_ms=delay,
            response_timeout_s=self.config.response_timeout_s,
            synchronous=True,
        )
        self.registered.add(version)

    def _scale(self, version: str, workers: int, synchronous: bool = True) -> None:
        try:
            self.management.scale(self.model, workers, version=version, synchronous=synchronous)
        except TorchServeAPIError as exc:
            logger.warning("could not scale %s/%s to %d workers: %s", self.model, version, workers, exc)

    def _bring_up(self, version: str, plan: Plan | PlanItem) -> None:
        """``version`` with its workers READY, or roll back."""
        grouped = isinstance(plan, Plan) and not plan.uniform
        item = plan.instances[0] if isinstance(plan, Plan) and plan.uniform else plan
        workers = 1 if grouped else item.count
        try:
            if version not in self.registered:
                self._register(version, plan if grouped else item, workers=workers)
                if self.active is not None:  # a swap's bring-up, not the first plan's
                    failpoints.reach("registered")
            # An archive's own minWorkers/maxWorkers override initial_workers
            # at register time; the scale API sets the count we planned.
            self.management.scale(self.model, workers, version=version, synchronous=True)
            self._wait_ready(version, workers)
        except (TorchServeAPIError, SwapError, OSError, ValueError) as exc:
            self._discard(version)
            self.standby.pop(version, None)
            what = plan.describe() if grouped else item.to_dict()
            raise SwapError(f"version {version} of {self.model} failed to start {what}: {exc}") from exc

    def _startup_summary(self, version: str) -> dict[str, float]:
        timings = self.store.startup_timings(self.model, version)
        keys = ("spawn_s", "load_s", "warmup_s")
        out = {}
        for key in keys:
            values = sorted(t[key] for t in timings if key in t)
            if values:
                out[key] = values[len(values) // 2]
        return out

    def _discard(self, version: str) -> None:
        try:
            self.management.unregister(self.model, version)
        except TorchServeAPIError as exc:
            if exc.status != 404:
                logger.warning("could not unregister %s/%s: %s", self.model, version, exc)
        self.registered.discard(version)

    def _describe(self, version: str) -> dict[str, Any]:
        return self.management.describe(self.model, version)[0]

    def _wait_ready(self, version: str, count: int) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            workers = self._describe(version).get("workers", [])
            ready = sum(w.get("status") == "READY" for w in workers)
            if ready >= count:
                return
            if time.monotonic() > deadline:
                raise SwapError(f"only {ready}/{count} workers of version {version} READY after "
                                f"{self.config.ready_timeout_s:.0f} s")  # fmt: skip
            time.sleep(0.1)

    def _drain(self, version: str, settle: bool = True) -> None:
        """Wait until ``version`` has nothing queued or in service, stably.

        ``settle``: the zeros must also hold for ``drain_settle_s`` (before
        its workers stop); without it, for the batch delay alone where the
        version batches, or the first zero where it does not (the end of the
        new set's hold).

        TorchServe's batch aggregator takes jobs off the queue up to
        ``max_batch_delay`` before the worker starts on them (a version of
        batch 1 sends each job at once), and a job is in transit to the worker
        for a moment, so a single zero reading can miss it: require zeros for
        longer than that window.
        """
        plan = self.store.read(self.model, version)
        # A version whose plan file is gone is treated as batching (the longer, safe window).
        batches = max((slot.batch for slot in plan.slots), default=1) if plan else 2
        stable_s = (self.config.drain_settle_s if settle else 0.0) + (
            self.config.max_batch_delay_ms / 1000 if batches > 1 else 0.0
        )
        deadline = time.monotonic() + self.config.drain_timeout_s
        zero_since: float | None = None
        while True:
            pending = self._describe(version)["jobQueueStatus"]["pendingRequests"]
            busy = self.store.in_service(self.model, version)
            now = time.monotonic()
            if pending == 0 and busy == 0:
                zero_since = zero_since or now
                if now - zero_since >= stable_s:
                    return
            else:
                zero_since = None
            if now > deadline:
                raise SwapError(f"version {version} still had {pending} queued / {busy} in service "
                                f"after {self.config.drain_timeout_s:.0f} s; left its workers running")  # fmt: skip
            time.sleep(self.config.poll_s)
