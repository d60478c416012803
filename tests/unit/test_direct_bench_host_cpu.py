"""The direct benches' host-CPU reading: threads sorted into the roles a table reports, CPU time per role."""

from __future__ import annotations

import threading
import time

from bench.direct_systems import cpu_seconds_by_role, thread_role


def test_threads_are_named_into_roles() -> None:
    assert thread_role("MainThread") == "event loop"
    assert thread_role("worker_0") == "worker"
    assert thread_role("lane_1") == "lanes"
    assert thread_role(None) == "OpenMP"  # not a Python thread: an intra-op team's
    assert thread_role("ebird-scheduler") == "other"
    assert thread_role("decode_0") == "decode"
    assert thread_role("reef-rt") == thread_role("reef-be-bert-tiny1") == "executors"


def test_a_busy_lane_thread_shows_its_cpu_under_lanes() -> None:
    before = cpu_seconds_by_role()
    seen: list[dict[str, float]] = []

    def spin() -> None:
        ends = time.thread_time() + 0.3  # this thread's own CPU time, whatever else the process runs
        while time.thread_time() < ends:
            pass
        seen.append(cpu_seconds_by_role())  # read by the thread itself, while it is still in /proc

    lane = threading.Thread(target=spin, name="lane_0")
    lane.start()
    lane.join()
    [during] = seen
    assert during.get("lanes", 0.0) - before.get("lanes", 0.0) > 0.2
    assert during["event loop"] >= before["event loop"]
