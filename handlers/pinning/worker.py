"""Worker side of Packrat: claim a slot, pin the process, set its threads.

``PackratWorkerMixin`` is mixed into the project's CPU handler.  In
``initialize()`` it looks for this model version's plan under
``PACKRAT_PLAN_DIR`` (TorchServe passes its environment on to workers).
Without a plan directory or a plan for this version it does nothing, so the
handler works in plain TorchServe.  With one, it:

1. claims a free slot with an exclusive, non-blocking ``flock`` held for the
   life of the process (the kernel releases it when the worker dies);
2. pins every thread of the process (each entry of /proc/self/task) to the
   slot's cores; threads created later inherit the affinity of the thread
   that creates them, so OpenMP's pool, started after this, stays inside;
3. calls ``torch.set_num_threads(t)``.

Start-up is where a swap's time goes (DESIGN.md: the new set must be READY
before it serves), so the worker measures it: seconds from process spawn to
``initialize`` (interpreter, ``ts`` and torch imports), model load and warm-up,
written beside its slot as ``<version>.slot-<i>.startup.json`` for the
controller's swap report.  While it starts, the worker runs at low CPU
priority (nice 10): a worker set brought up beside a serving one (a swap, a
standby set) then takes only the cycles the serving set leaves.

We pin here rather than use TorchServe's ``cpu_launcher_enable``: the
launcher splits cores evenly over all workers of a version and restarts every
worker on any scale, which would break active/passive swapping.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from handlers.pinning.slots import PlanStore, Slot, SlotCounters, VersionPlan, draining_cores
from serving_harness.jsonfile import write_json_atomic

logger = logging.getLogger(__name__)


class SlotUnavailableError(RuntimeError):
    """Every slot of the plan is held by a live worker."""


@dataclass
class SlotClaim:
    plan: VersionPlan
    index: int
    slot: Slot
    lock_fd: int
    counters: SlotCounters
    store: PlanStore
    max_drain_yield_s: float = 10.0  # a batch waits at most this long for another version's drain
    narrowed: bool = False  # serving on one thread and core while this worker's version drains
    # A grouped plan's worker holds every slot: one instance each, with its own counters.
    instances: tuple[Slot, ...] = ()
    instance_counters: tuple[SlotCounters, ...] = ()


def claim_group(store: PlanStore, plan: VersionPlan) -> SlotClaim:
    """The one worker of a grouped plan takes all of its slots (lock 0 says it is taken)."""
    path = store.lock_path(plan.model, plan.version, 0)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SlotUnavailableError(
            f"{plan.model} version {plan.version} is a grouped plan served by one worker, and a live worker "
            "holds it (scale this version to one worker)"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    counters = tuple(SlotCounters(store.counters_path(plan.model, plan.version, i)) for i in range(len(plan.slots)))
    cores = tuple(sorted({c for slot in plan.slots for c in slot.cores}))
    whole = Slot(cores, sum(s.threads for s in plan.slots), sum(s.batch for s in plan.slots))
    return SlotClaim(plan, 0, whole, fd, counters[0], store, instances=plan.slots, instance_counters=counters)


def claim_slot(store: PlanStore, plan: VersionPlan) -> SlotClaim:
    for index, slot in enumerate(plan.slots):
        path = store.lock_path(plan.model, plan.version, index)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        counter = SlotCounters(store.counters_path(plan.model, plan.version, index))
        return SlotClaim(plan, index, slot, fd, counter, store)
    raise SlotUnavailableError(
        f"no free Packrat slot for {plan.model} version {plan.version}: all {len(plan.slots)} slots are "
        "held by live workers (more workers than the plan has slots?)"
    )


def pin_process(cores: tuple[int, ...]) -> None:
    """Pin every existing thread of this process to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread may exit meanwhile
            os.sched_setaffinity(int(tid), cores)


STARTUP_NICE = 10


def _set_nice_of_all_threads(value: int) -> None:
    # Linux keeps a nice value per thread; threads created later inherit the
    # creating thread's, so setting every existing one covers OpenMP's pool.
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(tid), value)


def _can_restore_nice(original: int) -> bool:
    """Raising priority back needs root or an RLIMIT_NICE that allows it."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    # setpriority(2): an unprivileged thread may lower its nice value down to 20 - RLIMIT_NICE.
    return soft == resource.RLIM_INFINITY or 20 - soft <= original


@contextlib.contextmanager
def startup_priority(nice: int = STARTUP_NICE) -> Iterator[None]:
    """Run a worker's start-up at low CPU priority, then restore it.

    Skipped where the priority could not be restored afterwards: a worker that
    stayed niced would serve slower for its whole life.
    """
    original = os.getpriority(os.PRIO_PROCESS, 0)
    if nice <= original or not _can_restore_nice(original):
        yield
        return
    _set_nice_of_all_threads(nice)
    try:
        yield
    finally:
        try:
            _set_nice_of_all_threads(original)
        except PermissionError:
            logger.warning("could not restore this worker's CPU priority to %d after start-up", original)


def process_age_s() -> float:
    """Seconds since this process was spawned (interpreter start, imports included)."""
    import psutil

    return max(0.0, time.time() - psutil.Process().create_time())


class PackratWorkerMixin:
    """Slot claiming and pinning for a TorchServe handler (no-op without a plan)."""

    packrat_claim: SlotClaim | None = None

    @property
    def slot_batch(self) -> int | None:
        """The batch size this worker's slot serves (None outside Packrat)."""
        return self.packrat_claim.slot.batch if self.packrat_claim else None

    def record_startup(self, phases: dict[str, float]) -> None:
        """Write this worker's start-up timings beside its slot (Packrat only)."""
        claim = self.packrat_claim
        store = PlanStore.from_env()
        if claim is None or store is None:
            return
        path = store.startup_path(claim.plan.model, claim.plan.version, claim.index)
        write_json_atomic(path, {"pid": os.getpid(), **{k: round(v, 4) for k, v in phases.items()}})

    def configure_runtime(self, context: Any) -> None:
        store = PlanStore.from_env()
        if store is None:
            return
        version = str(context.manifest["model"].get("modelVersion", ""))
        plan = store.read(context.model_name, version)
        if plan is None:
            logger.info("no Packrat plan for %s version %s; running unpinned", context.model_name, version)
            return
        claim = claim_group(store, plan) if plan.grouped else claim_slot(store, plan)
        pin_process(claim.slot.cores)
        import torch

        torch.set_num_threads(claim.slot.threads)
        self.packrat_claim = claim
        logger.info(
            "Packrat slot %d of %s v%s: cores %s, %d threads, batch %d",
            claim.index, plan.model, plan.version, list(claim.slot.cores), claim.slot.threads, claim.slot.batch,
        )  # fmt: skip

    @contextlib.contextmanager
    def in_service(self, requests: int) -> Iterator[None]:
        """Publish how many requests this worker is processing, for the controller."""
        claim = self.packrat_claim
        if claim is None:
            yield
            return
        claim.counters.set_in_service(requests)
        try:
            yield
        finally:
            claim.counters.set_in_service(0)

    def wait_for_drains(self, poll_s: float = 0.005, cores: tuple[int, ...] | None = None) -> None:
        """Follow a swap's drain at the start of a batch: narrow this worker if
        its own version drains, hold the batch if another version drains on
        this slot's cores.

        After a swap the old set serves its backlog while the new set already
        takes new requests, on the same cores.  Sharing a core is the worst of
        both: a multi-threaded old worker's OpenMP threads wait at every
        barrier for whichever of them the scheduler has just descheduled
        (measured on a 2-core VM: 20 requests drained in 9 s while both new
        workers ran at half speed).  So cores are never shared.  By default
        the marker lists all of the old set's cores and every new worker on
        them holds its batch: the old set serves its backlog at full strength,
        roughly in arrival order.  With a narrowed drain (the swapper's
        ``narrow_drains``) the marker lists only each old slot's first core,
        a draining multi-thread worker narrows to one thread there
        (``Slot.narrowed``) and the new workers on the freed cores serve at
        once.  On the 2-core VM that measured worse, A/B in one run (the quick
        step's mean 1.22× the held drains'): the backlog waited behind a
        one-thread worker.

        A hold ends when the swapper removes the marker (its pid must be
        alive, so a dead controller's marker does not count) or after
        ``claim.max_drain_yield_s``, checked once per poll (one directory scan).
        Call it before timing a batch: the hold is the swap's, not serving's.
        ``cores``: the cores this batch runs on, where it is one lane of a
        grouped plan's worker (default: the whole slot).
        """
        claim = self.packrat_claim
        if claim is None:
            return
        store, model, version = claim.store, claim.plan.model, claim.plan.version
        markers = store.drain_markers(model)
        own = markers.get(version)
        self._follow_own_drain(claim, own is not None and own.narrow)
        deadline = None
        mine = set(claim.slot.cores if cores is None else cores)
        while mine & draining_cores(markers, version):
            now = time.monotonic()
            if deadline is None:
                deadline = now + claim.max_drain_yield_s
                logger.info("Packrat slot %d: holding a batch while another version drains", claim.index)
            elif now >= deadline:
                logger.warning("Packrat slot %d: a drain on my cores outlasted %.0f s; serving anyway",
                               claim.index, claim.max_drain_yield_s)  # fmt: skip
                return
            time.sleep(poll_s)
            markers = store.drain_markers(model)

    @staticmethod
    def _follow_own_drain(claim: SlotClaim, narrow: bool) -> None:
        """Narrow to ``Slot.narrowed`` while this worker's version drains; restore the slot after."""
        narrow = narrow and not claim.instances and claim.slot.threads > 1
        if narrow == claim.narrowed:
            return
        import torch

        slot = claim.slot.narrowed() if narrow else claim.slot
        pin_process(slot.cores)
        torch.set_num_threads(slot.threads)
        claim.narrowed = narrow
        state = f"draining on core {slot.cores[0]}, one thread" if narrow else "serving on its slot again"
        logger.info("Packrat slot %d: %s", claim.index, state)

    def record_instance_batch(self, instance: int, requests: int, model_ns: int) -> None:
        """A grouped plan's instance served a batch: count it in that instance's slot."""
        claim = self.packrat_claim
        if claim is not None and claim.instance_counters and requests > 0:
            claim.instance_counters[instance].add_batch(requests, model_ns, model_ns)

    def record_batch(self, requests: int, handler_ns: int, model_ns: int, model_cpu_ns: int = 0) -> None:
        """Add one served batch to the slot's counters: what serving really costs,
        decode and encode included, for the controller's calibration; ``model_cpu_ns``:
        the process's CPU time over the forward pass (0: not measured)."""
        if self.packrat_claim is not None and requests > 0:
            self.packrat_claim.counters.add_batch(requests, handler_ns, model_ns, model_cpu_ns)
