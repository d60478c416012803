"""The worker side of Packrat: slot claims, counters, and holding batches while another version drains."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest

from handlers.pinning.slots import PlanStore, ServiceTotals, Slot, VersionPlan, draining_cores
from handlers.pinning.worker import PackratWorkerMixin, claim_slot, pin_process

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


@pytest.fixture
def restores_this_process():
    """Narrowing pins every thread of the calling process and sets torch's thread count: undo it after."""
    import torch

    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    pin_process(tuple(affinity))
    torch.set_num_threads(threads)


def test_a_narrowed_drain_frees_the_old_workers_other_cores_for_the_new_set_at_once(
    swap_in_progress, restores_this_process
):
    import torch

    store, workers = swap_in_progress
    cores = sorted(os.sched_getaffinity(0))[:2]
    new_on_kept = workers["t1b1"]
    new_on_freed = PackratWorkerMixin()
    new_on_freed.packrat_claim = claim_slot(store, new_on_kept.packrat_claim.plan)  # the version's second slot
    assert new_on_freed.packrat_claim.slot.cores == (cores[1],)
    store.set_draining("m", "t2b1", True, narrow=True)
    assert json.loads(store.draining_path("m", "t2b1").read_text())["cores"] == cores[:1]
    assert not finishes_within(new_on_freed.wait_for_drains, 1.0).is_alive()  # serves at once
    assert finishes_within(new_on_kept.wait_for_drains, 0.3).is_alive()  # the old worker keeps this core

    old = workers["t2b1"]
    old.wait_for_drains()  # the old worker's next batch starts narrowed
    assert torch.get_num_threads() == 1 and os.sched_getaffinity(0) == {cores[0]}
    assert old.packrat_claim.narrowed
    store.set_draining("m", "t2b1", False)
    old.wait_for_drains()  # and its first batch after the drain is back on its slot
    assert torch.get_num_threads() == 2 and os.sched_getaffinity(0) == set(cores)
    assert not old.packrat_claim.narrowed


def test_a_grouped_plans_drain_keeps_all_its_cores(tmp_path):
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    store = PlanStore(tmp_path)
    store.write(VersionPlan("m", "mix", 2, 1, (Slot(cores, 2, 1),), grouped=True))
    store.set_draining("m", "mix", True, narrow=True)
    assert draining_cores(store.drain_markers("m"), "other") == frozenset(cores)
    assert store.drain_markers("m")["mix"].narrow is False


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
