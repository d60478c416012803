"""The core allocator on real and synthetic topologies."""

import os

import pytest

from handlers.pinning.slots import AllocationError, Slot
from packrat_plugin.allocator import allocate
from packrat_plugin.plan_types import Plan, PlanItem
from serving_harness.topology import CpuTopology


def plan(*items: tuple[int, int, int], T: int = 64) -> Plan:
    instances = tuple(PlanItem(c, t, b) for c, t, b in items)
    return Plan(T, sum(c * b for c, _, b in items), 1.0, instances)


def assert_disjoint(slots):
    cores = [c for s in slots for c in s.cores]
    assert len(cores) == len(set(cores))
    for s in slots:
        assert len(s.cores) == s.threads


def test_reads_the_usable_cores_of_this_process():
    topo = CpuTopology.from_system()
    assert topo.cores == sorted(os.sched_getaffinity(0))


def test_slots_are_disjoint_and_match_the_plan():
    topo = CpuTopology.uniform(1, 8)
    slots = allocate(plan((2, 2, 4), (4, 1, 1)), topo)
    assert_disjoint(slots)
    assert sorted((s.threads, s.batch) for s in slots) == [(1, 1)] * 4 + [(2, 4)] * 2


def test_instances_stay_on_one_socket_and_spread_round_robin():
    topo = CpuTopology.uniform(2, 4)  # sockets: 0-3, 4-7
    slots = allocate(plan((4, 2, 1)), topo)
    assert_disjoint(slots)
    sockets = [{c // 4 for c in s.cores} for s in slots]
    assert all(len(s) == 1 for s in sockets), sockets
    assert [next(iter(s)) for s in sockets].count(0) == 2  # two instances per socket


def test_mixed_sizes_pack_without_splitting_sockets():
    topo = CpuTopology.uniform(2, 4)
    slots = allocate(plan((1, 3, 2), (1, 3, 2), (2, 1, 1)), topo)
    assert_disjoint(slots)
    for s in slots:
        assert len({c // 4 for c in s.cores}) == 1


def test_instance_larger_than_a_socket_spans_whole_sockets():
    topo = CpuTopology.uniform(2, 4)
    (slot,) = allocate(plan((1, 8, 16)), topo)
    assert slot.cores == tuple(range(8))


def test_oversubscribed_plan_is_refused():
    topo = CpuTopology.uniform(2, 2)
    with pytest.raises(AllocationError, match="needs 5 cores but only 4"):
        allocate(plan((5, 1, 1)), topo)


def test_fragmented_plan_that_cannot_stay_socket_local_is_refused():
    topo = CpuTopology.uniform(2, 3)  # 3 + 3 cores; two 2-core instances leave 1 + 1
    with pytest.raises(AllocationError, match="no socket has 2 free cores"):
        allocate(plan((3, 2, 1)), topo)


def test_slot_never_runs_more_threads_than_cores():
    with pytest.raises(AllocationError):
        Slot((0,), 2, 1)
    assert Slot.from_dict(Slot((1, 2), 2, 4).to_dict()) == Slot((1, 2), 2, 4)
