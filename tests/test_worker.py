"""The worker side of Packrat: slot claims, counters, and running narrow while draining."""

from __future__ import annotations

import os

import pytest
import torch

from packrat_plugin.plans import PlanStore, ServiceTotals, VersionPlan
from packrat_plugin.topology import Slot
from packrat_plugin.worker import PackratWorkerMixin, claim_slot

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a 2-thread slot needs two usable cores")


def test_a_draining_worker_runs_on_one_thread_and_one_core_and_is_restored(tmp_path):
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    store = PlanStore(tmp_path)
    plan = VersionPlan("m", "t2b1", 2, 1, (Slot(cores, 2, 1),))
    store.write(plan)
    worker = PackratWorkerMixin()
    worker.packrat_claim = claim_slot(store, plan)
    threads, affinity = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(2)
        store.set_draining("m", "t2b1", True)
        with worker.in_service(1):
            assert torch.get_num_threads() == 1
            assert os.sched_getaffinity(0) == {cores[0]}
        worker.record_batch(1, handler_ns=2_000_000, model_ns=1_000_000)
        store.set_draining("m", "t2b1", False)
        with worker.in_service(1):
            assert torch.get_num_threads() == 2
            assert os.sched_getaffinity(0) == set(cores)
        assert store.service_totals("m", "t2b1") == ServiceTotals(1, 1, 0.002, 0.001)
        assert not store.draining_path("m", "t2b1").exists()
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)
