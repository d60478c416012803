"""The runtime's CPU lanes: priority order, one team per thread, errors to the submitter, clean close."""

from __future__ import annotations

import threading

import pytest
import torch

from handlers.runtime.lanes import CpuLanes

URGENT, LATER = 0, 1


@pytest.fixture
def lanes():
    made = []

    def make(count=1, threads_each=1):
        made.append(CpuLanes(count, threads_each))
        return made[-1]

    yield make
    for lane_set in made:
        lane_set.close()


def test_lower_priority_numbers_run_first_and_equal_ones_in_order(lanes):
    lane = lanes()
    gate, ran = threading.Event(), []
    blocker = lane.submit(gate.wait)  # holds the only lane while the queue fills
    done = [
        lane.submit(ran.append, "later-1", priority=LATER),
        lane.submit(ran.append, "urgent-1", priority=URGENT),
        lane.submit(ran.append, "later-2", priority=LATER),
        lane.submit(ran.append, "urgent-2", priority=URGENT),
    ]
    gate.set()
    for future in [blocker, *done]:
        future.result(timeout=10)
    assert ran == ["urgent-1", "urgent-2", "later-1", "later-2"]


def test_work_runs_on_lane_threads_with_their_share_of_intra_op_threads(lanes):
    lane = CpuLanes.splitting(cores=4, count=2)
    try:
        seen = set()
        lane.run_on_each(lambda: seen.add((threading.current_thread().name, torch.get_num_threads())))
        assert seen == {("lane_0", 2), ("lane_1", 2)}
    finally:
        lane.close()


def test_an_error_reaches_the_submitter_and_the_lane_serves_on(lanes):
    lane = lanes()
    with pytest.raises(ZeroDivisionError):
        lane.submit(lambda: 1 / 0).result(timeout=10)
    assert lane.submit(lambda: 42).result(timeout=10) == 42


def test_close_runs_what_was_queued_then_refuses_new_work(lanes):
    lane = lanes()
    gate = threading.Event()
    lane.submit(gate.wait)
    queued = [lane.submit(lambda i=i: i, priority=LATER) for i in range(3)]
    closer = threading.Thread(target=lane.close)
    closer.start()
    gate.set()
    closer.join(timeout=10)
    assert [f.result(timeout=0) for f in queued] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        lane.submit(lambda: None)


def test_close_gives_up_on_a_stuck_job_after_its_timeout(lanes):
    lane = lanes()
    gate = threading.Event()
    lane.submit(gate.wait)
    closer = threading.Thread(target=lane.close, kwargs={"timeout_s": 0.2})
    closer.start()
    closer.join(timeout=30)  # without the timeout, close would wait for the gate forever
    try:
        assert not closer.is_alive()
    finally:
        gate.set()


@pytest.mark.parametrize("count, threads_each", [(0, 1), (1, 0)])
def test_bad_sizes_are_refused(count, threads_each):
    with pytest.raises(ValueError, match="lane"):
        CpuLanes(count, threads_each)


def test_a_reader_waits_while_every_lane_runs_a_quiet_job_and_not_otherwise():
    lanes = CpuLanes(2, 1)
    release = [threading.Event() for _ in range(3)]
    started = [threading.Event() for _ in range(3)]

    def job(i):
        started[i].set()
        release[i].wait()

    try:
        assert lanes.wait_for_a_loud_lane(timeout_s=0)  # idle lanes: read at once
        first = lanes.submit(job, 0, quiet=True, lane=0)
        loud = lanes.submit(job, 1, lane=1)  # a decode, say: reading goes on
        assert started[0].wait(10) and started[1].wait(10)
        assert lanes.wait_for_a_loud_lane(timeout_s=0.2)
        release[1].set()
        loud.result(timeout=10)
        second = lanes.submit(job, 2, quiet=True, lane=1)
        assert started[2].wait(10)
        assert not lanes.wait_for_a_loud_lane(timeout_s=0.2)  # both lanes in a quiet job
        waiter_done = threading.Event()
        threading.Thread(target=lambda: lanes.wait_for_a_loud_lane() and waiter_done.set(), daemon=True).start()
        assert not waiter_done.wait(0.2)
        release[0].set()  # one quiet job ends: the waiting reader goes on
        assert waiter_done.wait(10)
        first.result(timeout=10)
        release[2].set()
        second.result(timeout=10)
    finally:
        for event in release:
            event.set()
        lanes.close(timeout_s=10)


def test_a_quiet_job_that_fails_still_lets_the_reader_go_and_close_releases_a_waiting_reader():
    lanes = CpuLanes(1, 1)

    def fails():
        raise RuntimeError("batch broke")

    with pytest.raises(RuntimeError, match="batch broke"):
        lanes.submit(fails, quiet=True).result(timeout=10)
    assert lanes.wait_for_a_loud_lane(timeout_s=0)
    stuck, running = threading.Event(), threading.Event()
    lanes.submit(lambda: running.set() or stuck.wait(), quiet=True)
    assert running.wait(10)
    assert not lanes.wait_for_a_loud_lane(timeout_s=0.2)
    lanes.close(timeout_s=0.1)  # the stuck job keeps its lane; a reader must still see the close
    assert lanes.wait_for_a_loud_lane(timeout_s=1)
    stuck.set()
