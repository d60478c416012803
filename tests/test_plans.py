"""Plan and slot files: what the controller reads of its workers."""

import struct
import subprocess

from packrat_plugin.plans import InflightCounter, PlanStore, VersionPlan
from packrat_plugin.topology import Slot


def test_plans_round_trip_and_in_service_ignores_dead_workers(tmp_path):
    store = PlanStore(tmp_path)
    plan = VersionPlan("m", "a", 1, 2, (Slot((0,), 1, 2), Slot((1,), 1, 2)))
    store.write(plan)
    assert store.read("m", "a") == plan
    assert store.read("m", "b") is None
    assert store.in_service("m", "a") == 0

    live = InflightCounter(store.inflight_path("m", "a", 0))  # this process, alive
    live.set(3)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    store.inflight_path("m", "a", 1).write_bytes(struct.pack("<qq", dead.pid, 5))
    assert store.in_service("m", "a") == 3  # the dead worker's last count is not load
    live.set(0)
    assert store.in_service("m", "a") == 0
    assert not any(p.name.endswith(".partial") for p in (tmp_path / "m").iterdir())
