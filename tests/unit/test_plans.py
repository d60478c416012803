"""Plan and slot files: what the controller reads of its workers."""

import subprocess

from handlers.pinning.slots import _COUNTERS, PlanStore, ServiceTotals, Slot, SlotCounters, VersionPlan


def test_plans_round_trip_and_in_service_ignores_dead_workers(tmp_path):
    store = PlanStore(tmp_path)
    plan = VersionPlan("m", "a", 1, 2, (Slot((0,), 1, 2), Slot((1,), 1, 2)))
    store.write(plan)
    assert store.read("m", "a") == plan
    assert store.read("m", "b") is None
    assert store.in_service("m", "a") == 0

    live = SlotCounters(store.counters_path("m", "a", 0))  # this process, alive
    live.set_in_service(3)
    live.add_batch(3, handler_ns=300_000_000, model_ns=240_000_000, model_cpu_ns=420_000_000)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    store.counters_path("m", "a", 1).write_bytes(_COUNTERS.pack(1, dead.pid, 5, 9, 9, 9, 9, 9, 1))
    assert store.in_service("m", "a") == 3  # the dead worker's last record is not load
    assert store.service_totals("m", "a") == ServiceTotals(1, 3, 0.3, 0.24, 0.42)  # CPU of the forward passes too
    live.set_in_service(0)
    assert store.in_service("m", "a") == 0
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "m").iterdir())


def test_a_record_torn_by_a_concurrent_write_is_not_read(tmp_path):
    store = PlanStore(tmp_path)
    store.write(VersionPlan("m", "a", 1, 1, (Slot((0,), 1, 1),)))
    import os

    torn = _COUNTERS.pack(7, os.getpid(), 2, 1, 1, 1, 1, 1, 6)  # the two sequence numbers differ
    store.counters_path("m", "a", 0).write_bytes(torn)
    assert store.in_service("m", "a") == 0
    assert store.service_totals("m", "a") == ServiceTotals()


def test_grouped_plans_round_trip_and_older_plan_files_read_as_ungrouped(tmp_path):
    from packrat_plugin.plan_types import Plan, PlanItem
    from packrat_plugin.swapper import cores_tag, mixed_version_name
    from serving_harness.topology import CpuTopology

    store = PlanStore(tmp_path)
    grouped = VersionPlan("m", "mix-1x1t2b-1x1t1b", 2, 3, (Slot((0,), 1, 2), Slot((1,), 1, 1)), grouped=True)
    store.write(grouped)
    assert store.read("m", "mix-1x1t2b-1x1t1b") == grouped
    old = grouped.to_dict()
    del old["grouped"]  # a plan file written before mixed plans
    assert VersionPlan.from_dict(old).grouped is False
    plan = Plan(2, 3, 190.0, (PlanItem(1, 1, 2), PlanItem(1, 1, 1)))
    assert mixed_version_name(plan) == "mix-1x1t2b-1x1t1b"
    assert mixed_version_name(plan, cores_tag(CpuTopology({0: (2, 3)}))) == "mix-1x1t2b-1x1t1b-c2-3"
