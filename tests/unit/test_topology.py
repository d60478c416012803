"""The core allocator on real and synthetic topologies."""

import os
import subprocess
import sys

import pytest

from handlers.pinning.slots import AllocationError, Slot
from packrat_plugin.allocator import allocate
from packrat_plugin.plan_types import Plan, PlanItem
from serving_harness.topology import CpuTopology, read_cpu_quota


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
    allowed = sorted(os.sched_getaffinity(0))
    # Every allowed CPU, unless this machine's cgroup has a CPU quota (a CI container may).
    assert topo.cores == allowed or (set(topo.cores) < set(allowed) and "limited to" in topo.source)


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


# -- what limits the usable cores: affinity, a cgroup quota, SMT siblings ------------------------


def fake_sysfs(root, sockets: int, cores_per_socket: int, threads_per_core: int):
    """A /sys/devices/system/cpu tree numbered as Linux numbers SMT machines: every core's first thread
    (socket by socket) first, then every core's second thread."""
    physical = sockets * cores_per_socket
    for cpu in range(physical * threads_per_core):
        core = cpu % physical
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        topo.joinpath("physical_package_id").write_text(f"{core // cores_per_socket}\n")
        siblings = [core + k * physical for k in range(threads_per_core)]
        topo.joinpath("thread_siblings_list").write_text(",".join(map(str, siblings)) + "\n")
    return root


def fake_cgroup_v2(root, quotas: dict[str, str]):
    """``quotas``: cgroup path → cpu.max text; the process sits in the deepest one."""
    for path, text in quotas.items():
        folder = root / "cg" / path.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        folder.joinpath("cpu.max").write_text(text + "\n")
    leaf = max(quotas, key=len)
    (root / "self_cgroup").write_text(f"0::{leaf}\n")
    return root / "cg", root / "self_cgroup"


def test_reads_the_usable_cores_of_this_process_under_taskset():
    script = "from serving_harness.topology import CpuTopology; print(CpuTopology.from_system().cores)"
    first = min(os.sched_getaffinity(0))
    out = subprocess.run(["taskset", "-c", str(first), sys.executable, "-c", script], capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == f"[{first}]"


def test_a_cgroup_v2_quota_limits_the_cores_to_whole_cores_and_says_so(tmp_path):
    cgroup_root, self_cgroup = fake_cgroup_v2(tmp_path, {"/kubepods": "max 100000", "/kubepods/pod": "150000 100000"})
    quota = read_cpu_quota(cgroup_root, self_cgroup)
    assert quota.cores == 1 and "pod/cpu.max: 1.5 CPUs" in quota.source  # rounded down: 1.5 cores' time
    topo = CpuTopology.from_system(cgroup_root=cgroup_root, proc_cgroup=self_cgroup, affinity={0, 1, 2, 3})
    assert topo.cores == [0] and "limited to 1 by cgroup v2" in topo.source
    with pytest.raises(AllocationError):
        allocate(plan((2, 1, 1)), topo)  # the planner may not use what the quota does not pay for


def test_the_tightest_quota_on_the_way_up_wins_and_a_tiny_one_still_leaves_one_core(tmp_path):
    cgroup_root, self_cgroup = fake_cgroup_v2(tmp_path, {"/a": "200000 100000", "/a/b": "800000 100000"})
    assert read_cpu_quota(cgroup_root, self_cgroup).cores == 2
    cgroup_root, self_cgroup = fake_cgroup_v2(tmp_path / "tiny", {"/a": "20000 100000"})
    assert read_cpu_quota(cgroup_root, self_cgroup).cores == 1
    cgroup_root, self_cgroup = fake_cgroup_v2(tmp_path / "none", {"/a": "max 100000"})
    quota = read_cpu_quota(cgroup_root, self_cgroup)
    assert quota.cores is None
    topo = CpuTopology.from_system(cgroup_root=cgroup_root, proc_cgroup=self_cgroup, affinity={0, 1})
    assert topo.cores == [0, 1] and topo.source == "2 CPUs in the affinity mask"


def test_a_cgroup_v1_cfs_quota_is_read_too(tmp_path):
    folder = tmp_path / "cg" / "cpu,cpuacct" / "docker" / "abc"
    folder.mkdir(parents=True)
    folder.joinpath("cpu.cfs_quota_us").write_text("250000\n")
    folder.joinpath("cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "self").write_text("4:cpu,cpuacct:/docker/abc\n2:memory:/docker/abc\n")
    quota = read_cpu_quota(tmp_path / "cg", tmp_path / "self")
    assert quota.cores == 2 and "cgroup v1" in quota.source
    folder.joinpath("cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert read_cpu_quota(tmp_path / "cg", tmp_path / "self").cores is None


def test_on_a_two_socket_smt_machine_instances_take_whole_physical_cores_first(tmp_path):
    sysfs = fake_sysfs(tmp_path / "cpu", sockets=2, cores_per_socket=2, threads_per_core=2)  # 8 CPUs, 4 cores
    topo = CpuTopology.from_system(sys_root=sysfs, cgroup_root=tmp_path / "none", affinity=set(range(8)))
    # Socket 0 holds cores 0 and 1 (threads 0,4 and 1,5); every core's first thread comes first.
    assert topo.sockets == {0: (0, 1, 4, 5), 1: (2, 3, 6, 7)}
    two_wide = allocate(plan((2, 2, 1)), topo)
    assert sorted(s.cores for s in two_wide) == [(0, 1), (2, 3)]  # two physical cores each, no sibling pair
    four_single = allocate(plan((4, 1, 1)), topo)
    assert sorted(c for s in four_single for c in s.cores) == [0, 1, 2, 3]  # one thread per physical core
    everything = allocate(plan((2, 4, 1)), topo)
    assert sorted(s.cores for s in everything) == [(0, 1, 4, 5), (2, 3, 6, 7)]  # siblings only once cores run out


def test_a_quota_on_an_smt_machine_keeps_whole_physical_cores_on_one_socket(tmp_path):
    sysfs = fake_sysfs(tmp_path / "cpu", sockets=2, cores_per_socket=2, threads_per_core=2)
    cgroup_root, self_cgroup = fake_cgroup_v2(tmp_path, {"/pod": "200000 100000"})
    topo = CpuTopology.from_system(sys_root=sysfs, cgroup_root=cgroup_root, proc_cgroup=self_cgroup,
                                   affinity=set(range(8)))  # fmt: skip
    assert topo.sockets == {0: (0, 1)}
