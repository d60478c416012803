"""Pinned CPU lanes and the instance pool behind Packrat's mixed plans (no TorchServe: plain threads and tensors)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from handlers.codecs import ModelInput
from handlers.errors import ServiceUnavailable
from handlers.mixed_plan.instances import Instance, InstanceEngine, InstancePool
from handlers.runtime.lanes import CpuLanes, LanePlacement

CORES = sorted(os.sched_getaffinity(0))


def item(value: float) -> ModelInput:
    return ModelInput((torch.full((3,), value),))


def test_placed_lanes_run_on_their_own_cores_with_their_own_thread_counts() -> None:
    placements = [LanePlacement((CORES[0],), 1), LanePlacement(tuple(CORES[:2]), min(2, len(CORES)))]
    lanes = CpuLanes.placed(placements)
    try:
        for i, placement in enumerate(placements):
            seen = lanes.submit(
                lambda: (threading.current_thread().name, os.sched_getaffinity(0), torch.get_num_threads()), lane=i
            ).result(timeout=10)
            assert seen == (f"lane_{i}", set(placement.cores), placement.threads)
        # Untargeted work still runs on any lane; the caller's own thread keeps its affinity.
        assert lanes.submit(lambda: 7).result(timeout=10) == 7
        assert os.sched_getaffinity(0) == set(CORES)
    finally:
        lanes.close(5)


class Runner:
    """Doubles its input; blocks until released, so a test sees how requests were split."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.batches: list[tuple[int, int]] = []  # (instance lane, batch size)
        self.fail_next = False

    def __call__(self, instance: Instance, stacked: tuple[torch.Tensor, ...]) -> torch.Tensor:
        assert threading.current_thread().name == f"lane_{instance.lane}"  # on the instance's own lane
        self.release.wait(10)
        self.batches.append((instance.lane, int(stacked[0].shape[0])))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        return stacked[0] * 2


def make_pool(runner: Runner, batches: list[int], max_waiting: int = 64, max_delay_s: float = 0.0) -> InstancePool:
    lanes = CpuLanes(len(batches), 1)
    instances = [Instance(i, 1, b) for i, b in enumerate(batches)]
    return InstancePool(lanes, instances, runner, max_waiting, max_delay_s=max_delay_s)


def test_each_idle_instance_takes_up_to_its_own_batch_and_every_request_is_answered_once() -> None:
    runner = Runner()
    recorded: list[tuple[int, int]] = []
    lanes = CpuLanes(2, 1)
    pool = InstancePool(
        lanes, [Instance(0, 1, 1), Instance(1, 1, 2)], runner, 64,
        on_batch=lambda inst, n, s: recorded.append((inst.lane, n)),
    )  # fmt: skip
    engine = InstanceEngine(pool)
    futures = [engine.try_submit(item(v)) for v in range(7)]
    runner.release.set()
    rows = [f.result(timeout=10) for f in futures]
    assert [r[0].item() for r in rows] == [2.0 * v for v in range(7)]
    assert max(n for lane, n in runner.batches if lane == 0) == 1
    assert max(n for lane, n in runner.batches if lane == 1) <= 2
    assert sum(n for _, n in runner.batches) == 7 and sorted(recorded) == sorted(runner.batches)
    engine.close(5)
    lanes.close(5)


def test_a_lone_request_goes_to_the_preferred_instance() -> None:
    runner = Runner()
    runner.release.set()
    pool = make_pool(runner, [1, 2])  # equal threads: the larger batch is preferred
    pool.try_submit(item(1)).result(timeout=10)
    assert runner.batches == [(1, 1)]
    pool.close(5)
    pool.lanes.close(5)


def test_a_round_arriving_together_is_split_into_the_plans_sub_batches() -> None:
    runner = Runner()
    pool = make_pool(runner, [2, 1], max_delay_s=2.0)
    # The b=2 instance holds off for a second request; the b=1 one takes the first at once.
    futures = [pool.try_submit(item(v)) for v in range(3)]
    runner.release.set()
    assert [f.result(timeout=10)[0].item() for f in futures] == [0.0, 2.0, 4.0]
    assert sorted(runner.batches) == [(0, 2), (1, 1)]
    pool.close(5)
    pool.lanes.close(5)


def test_an_instance_holds_off_at_most_the_batching_delay() -> None:
    runner = Runner()
    runner.release.set()
    pool = make_pool(runner, [4], max_delay_s=0.05)
    started = time.monotonic()
    pool.try_submit(item(1)).result(timeout=10)
    assert time.monotonic() - started >= 0.05  # held for a fuller batch ...
    assert runner.batches == [(0, 1)]  # ... then ran what it had
    pool.close(5)
    pool.lanes.close(5)


def test_a_failed_batch_fails_only_its_requests_and_the_instance_serves_on() -> None:
    runner = Runner()
    runner.fail_next = True
    pool = make_pool(runner, [1])
    runner.release.set()
    first = pool.try_submit(item(1))
    with pytest.raises(ServiceUnavailable, match="boom"):
        first.result(timeout=10)
    assert pool.try_submit(item(3)).result(timeout=10)[0].item() == 6.0
    pool.close(5)
    pool.lanes.close(5)


def test_admission_stops_at_max_waiting_and_close_answers_what_is_left_with_503() -> None:
    runner = Runner()
    pool = make_pool(runner, [1], max_waiting=2)
    running = pool.try_submit(item(0))  # taken by the instance, blocked in the runner
    deadline = time.monotonic() + 10
    while pool.waiting and time.monotonic() < deadline:  # the dispatcher takes it on its own thread
        time.sleep(0.001)
    waiting = [pool.try_submit(item(v)) for v in (1, 2)]
    assert all(f is not None for f in waiting)
    assert pool.try_submit(item(3)) is None  # full: the runtime waits for space
    pool.close(timeout_s=0.2)  # the runner is still blocked: nothing finishes in time
    for f in (running, *waiting):
        with pytest.raises(ServiceUnavailable):
            f.result(timeout=10)
    with pytest.raises(ServiceUnavailable):
        pool.try_submit(item(4))
    runner.release.set()
    pool.lanes.close(5)


def test_pool_refuses_instances_that_do_not_match_its_lanes() -> None:
    lanes = CpuLanes(2, 1)
    try:
        with pytest.raises(ValueError, match="one instance per lane"):
            InstancePool(lanes, [Instance(0, 1, 1)], Runner(), 8)
    finally:
        lanes.close(5)
