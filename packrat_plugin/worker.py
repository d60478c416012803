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

We pin here rather than use TorchServe's ``cpu_launcher_enable``: the
launcher splits cores evenly over all workers of a version and restarts every
worker on any scale, which would break active/passive swapping.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from packrat_plugin.plans import InflightCounter, PlanStore, VersionPlan
from packrat_plugin.topology import Slot

logger = logging.getLogger(__name__)


class SlotUnavailableError(RuntimeError):
    """Every slot of the plan is held by a live worker."""


@dataclass
class SlotClaim:
    plan: VersionPlan
    index: int
    slot: Slot
    lock_fd: int
    inflight: InflightCounter


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
        counter = InflightCounter(store.inflight_path(plan.model, plan.version, index))
        return SlotClaim(plan, index, slot, fd, counter)
    raise SlotUnavailableError(
        f"no free Packrat slot for {plan.model} version {plan.version}: all {len(plan.slots)} slots are "
        "held by live workers (more workers than the plan has slots?)"
    )


def pin_process(cores: tuple[int, ...]) -> None:
    """Pin every existing thread of this process to ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread may exit meanwhile
            os.sched_setaffinity(int(tid), cores)


class PackratWorkerMixin:
    """Slot claiming and pinning for a TorchServe handler (no-op without a plan)."""

    packrat_claim: SlotClaim | None = None

    def configure_runtime(self, context: Any) -> None:
        store = PlanStore.from_env()
        if store is None:
            return
        version = str(context.manifest["model"].get("modelVersion", ""))
        plan = store.read(context.model_name, version)
        if plan is None:
            logger.info("no Packrat plan for %s version %s; running unpinned", context.model_name, version)
            return
        claim = claim_slot(store, plan)
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
        claim.inflight.set(requests)
        try:
            yield
        finally:
            claim.inflight.set(0)
