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
