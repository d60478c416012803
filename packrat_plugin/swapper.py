"""Active/passive worker-set swapping through TorchServe's management API.

One TorchServe version holds one ``batch_size``, so a Packrat plan that needs a
different (threads, batch) class is a different version.  Each model has two
versions, ``a`` and ``b``; one is active (the default, serving), the other
passive.  Applying a plan:

- same (threads, batch) as the active version: scale the active version to
  the new instance count (its slot list already covers every instance that
  fits, so no worker moves);
- otherwise: unregister the passive version if it is registered (it has zero
  workers), write its slot plan, register it with the plan's batch size and
  instance count, wait until every worker is READY, make it the default
  (new requests go to it), wait until the old version has nothing queued and
  nothing in service, then scale the old version to zero.

A failure before ``set-default`` (a worker that cannot start, a timeout)
unregisters the half-built passive version and leaves the active one serving:
the old version never loses its workers before the new one serves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from packrat_plugin.clients import ManagementClient, TorchServeAPIError
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.plans import PlanStore, VersionPlan
from packrat_plugin.topology import CpuTopology, allocate

logger = logging.getLogger(__name__)

VERSIONS = ("a", "b")


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
    # Seconds per step of a swap: "bring_up" (register + workers READY),
    # "switch" (set-default), "drain" (old version empties), "retire"
    # (old version scaled to zero).  The new plan serves after bring_up +
    # switch; drain and retire finish requests already queued on the old one.
    phases: dict[str, float] = field(default_factory=dict)
    error: str | None = None

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
    archives: dict[str, str]  # version → archive file name in the model store
    topology: CpuTopology
    config: SwapperConfig = field(default_factory=SwapperConfig)
    active: str | None = None
    active_item: PlanItem | None = None
    registered: set[str] = field(default_factory=set)

    def apply(self, plan: Plan) -> SwapReport:
        if not plan.uniform:
            raise SwapError("a TorchServe version serves one (threads, batch) class; ask for a uniform plan")
        item = plan.instances[0]
        before = [self.active_item.to_dict()] if self.active_item else None
        start_wall, start = time.time(), time.monotonic()

        phases: dict[str, float] = {}
        mark = [start]

        def phase(name: str) -> None:
            now = time.monotonic()
            phases[name] = now - mark[0]
            mark[0] = now

        def report(kind: str) -> SwapReport:
            seconds = time.monotonic() - start
            return SwapReport(kind, before, [item.to_dict()], start_wall, seconds, self.active or "", phases)

        if self.active is None:
            self._bring_up(VERSIONS[0], item)
            self.active, self.active_item = VERSIONS[0], item
            return report("initial")
        current = self.active_item
        if (item.threads, item.batch) == (current.threads, current.batch):
            if item.count == current.count:
                return report("none")
            try:
                self.management.scale(self.model, item.count, version=self.active, synchronous=True)
                self._wait_ready(self.active, item.count)
            except TorchServeAPIError as exc:
                raise SwapError(f"scaling version {self.active} to {item.count} workers failed: {exc}") from exc
            self.active_item = item
            return report("scale")
        old = self.active
        new = VERSIONS[1] if old == VERSIONS[0] else VERSIONS[0]
        self._bring_up(new, item)
        phase("bring_up")
        try:
            self.management.set_default(self.model, new)
        except TorchServeAPIError as exc:
            self._discard(new)
            raise SwapError(f"set-default to version {new} failed: {exc}") from exc
        self.active, self.active_item = new, item
        phase("switch")
        self._drain(old)
        phase("drain")
        self.management.scale(self.model, 0, version=old, synchronous=True)
        phase("retire")
        return report("swap")

    # -- steps -----------------------------------------------------------------

    def _bring_up(self, version: str, item: PlanItem) -> None:
        """Register ``version`` with ``item``'s workers, READY, or roll back."""
        if version in self.registered:
            self._discard(version)
        self.store.write(version_slots(self.model, version, item, self.topology))
        try:
            self.management.register(
                self.archives[version],
                model_name=self.model,
                initial_workers=item.count,
                batch_size=item.batch,
                max_batch_delay_ms=self.config.max_batch_delay_ms,
                response_timeout_s=self.config.response_timeout_s,
                synchronous=True,
            )
            self.registered.add(version)
            # An archive's own minWorkers/maxWorkers override initial_workers
            # at register time; the scale API sets the count we planned.
            self.management.scale(self.model, item.count, version=version, synchronous=True)
            self._wait_ready(version, item.count)
        except (TorchServeAPIError, SwapError, OSError) as exc:
            self._discard(version)
            raise SwapError(f"version {version} of {self.model} failed to start {item.to_dict()}: {exc}") from exc

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

    def _drain(self, version: str) -> None:
        """Wait until ``version`` has nothing queued or in service, stably.

        TorchServe's batch aggregator takes jobs off the queue up to
        ``max_batch_delay`` before the worker starts on them, so a single
        zero reading can miss a batch in transit: require zeros for longer
        than that window.
        """
        stable_s = self.config.max_batch_delay_ms / 1000 + 0.25
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
