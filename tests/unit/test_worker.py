"""The worker side of Packrat: slot claims, counters, and holding batches while another version drains."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from handlers.pinning.slots import PlanStore, ServiceTotals, Slot, VersionPlan
from handlers.pinning.worker import PackratWorkerMixin, claim_slot

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a 2-thread slot needs two usable cores")


@pytest.fixture
def swap_in_progress(tmp_path):
    """An old fat version on both cores and a new one-core version, each with a worker."""
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    store = PlanStore(tmp_path)
    old = VersionPlan("m", "t2b1", 2, 1, (Slot(cores, 2, 1),))
    new = VersionPlan("m", "t1b1", 2, 2, (Slot(cores[:1], 1, 1), Slot(cores[1:], 1, 1)))
    workers = {}
    for plan in (old, new):
        store.write(plan)
        workers[plan.version] = PackratWorkerMixin()
        workers[plan.version].packrat_claim = claim_slot(store, plan)
    return store, workers


def finishes_within(fn, seconds: float) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(seconds)
    return thread


def test_a_new_worker_holds_its_batch_until_the_old_version_on_its_cores_has_drained(swap_in_progress):
    store, workers = swap_in_progress
    store.set_draining("m", "t2b1", True)
    assert json.loads(store.draining_path("m", "t2b1").read_text())["cores"] == sorted(os.sched_getaffinity(0))[:2]
    assert workers["t2b1"].wait_for_drains() is None  # the draining version itself serves on, at full strength
    held = finishes_within(workers["t1b1"].wait_for_drains, 0.3)
    assert held.is_alive()  # still holding: the old set has the cores
    store.set_draining("m", "t2b1", False)
    held.join(1.0)
    assert not held.is_alive()


def test_a_drain_marker_of_a_dead_controller_or_a_long_drain_does_not_hold_a_worker_for_ever(swap_in_progress):
    store, workers = swap_in_progress
    dead = subprocess.Popen(["true"])
    dead.wait()
    store.draining_path("m", "t2b1").write_text(json.dumps({"pid": dead.pid, "cores": [0, 1]}))
    assert not finishes_within(workers["t1b1"].wait_for_drains, 1.0).is_alive()
    store.set_draining("m", "t2b1", True)  # a live marker that nobody removes
    workers["t1b1"].packrat_claim.max_drain_yield_s = 0.2
    started = time.monotonic()
    workers["t1b1"].wait_for_drains()
    assert 0.2 <= time.monotonic() - started < 1.0


def test_served_batches_are_counted_per_version(swap_in_progress):
    store, workers = swap_in_progress
    with workers["t2b1"].in_service(3):
        assert store.in_service("m", "t2b1") == 3
    workers["t2b1"].record_batch(1, handler_ns=2_000_000, model_ns=1_000_000)
    assert store.in_service("m", "t2b1") == 0
    assert store.service_totals("m", "t2b1") == ServiceTotals(1, 1, 0.002, 0.001)
    assert store.service_totals("m", "t1b1") == ServiceTotals()
