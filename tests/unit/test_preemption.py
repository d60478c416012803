"""The preemption gate (handlers/reef/preemption.py): real-time mode stops best-effort units at their boundaries."""

from __future__ import annotations

import random
import threading

import pytest

from handlers.reef.preemption import PreemptionGate

WAIT_S = 10.0  # a bound on waits that must end, far beyond what they take; not a timing assertion


def in_thread(fn) -> threading.Thread:  # noqa: ANN001
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_unit_waits_out_real_time_mode_and_says_it_waited():
    gate = PreemptionGate()
    with gate.unit() as waited:
        assert waited is False
    gate.raise_realtime()
    entered = threading.Event()
    seen: list[bool] = []

    def best_effort() -> None:
        with gate.unit() as waited:
            seen.append(waited)
            entered.set()

    thread = in_thread(best_effort)
    assert not entered.wait(0.2)  # blocked before its unit while real-time work is pending
    gate.lower_realtime()
    thread.join(WAIT_S)
    assert seen == [True]


def test_quiesce_waits_for_the_unit_in_flight_and_reports_one_preemption_per_switch():
    ticks = iter(range(100))
    gate = PreemptionGate(clock=lambda: float(next(ticks)))
    running, release = threading.Event(), threading.Event()

    def best_effort() -> None:
        with gate.unit():
            running.set()
            release.wait(WAIT_S)

    thread = in_thread(best_effort)
    running.wait(WAIT_S)
    gate.raise_realtime(2)  # two RT requests admitted while the unit runs
    result: list = []
    rt = in_thread(lambda: result.append(gate.quiesce()))
    rt.join(0.2)
    assert rt.is_alive() and not result  # RT waits for the unit in flight ...
    release.set()
    rt.join(WAIT_S)
    thread.join(WAIT_S)
    [preemption] = result
    assert preemption.interrupted == 1 and preemption.latency_s > 0  # ... and is told it preempted one
    assert gate.quiesce() is None  # the second RT batch of the same period preempted nothing
    gate.lower_realtime(2)
    gate.raise_realtime()
    idle = gate.quiesce()
    assert idle is not None and idle.interrupted == 0  # a new period, but BE was idle
    with pytest.raises(RuntimeError, match="only 1"):
        gate.lower_realtime(2)


def test_quiesce_gives_up_after_its_timeout_and_close_releases_every_waiter():
    gate = PreemptionGate()
    running, release = threading.Event(), threading.Event()

    def best_effort() -> None:
        with gate.unit():
            running.set()
            release.wait(WAIT_S)

    thread = in_thread(best_effort)
    running.wait(WAIT_S)
    gate.raise_realtime()
    assert gate.quiesce(timeout_s=0.05) is None
    waiter = in_thread(lambda: gate.unit().__enter__())
    gate.close()
    waiter.join(WAIT_S)
    assert not waiter.is_alive()
    release.set()
    thread.join(WAIT_S)


@pytest.mark.parametrize("seed", range(5))
def test_no_best_effort_unit_runs_while_real_time_work_runs(seed):
    """Random interleavings of 3 BE executors and an RT executor: after ``quiesce`` nothing BE is in flight."""
    rng = random.Random(seed)
    gate = PreemptionGate()
    lock = threading.Lock()
    inflight = [0]
    violations: list[int] = []
    stop = threading.Event()

    def best_effort(delays: list[float]) -> None:
        for delay in delays:
            if stop.is_set():
                return
            with gate.unit():
                with lock:
                    inflight[0] += 1
                stop.wait(delay)
                with lock:
                    inflight[0] -= 1

    workers = [in_thread(lambda d=[rng.uniform(0, 0.004) for _ in range(200)]: best_effort(d)) for _ in range(3)]
    for _ in range(20):
        stop.wait(rng.uniform(0, 0.005))
        gate.raise_realtime()
        gate.quiesce()
        for _ in range(3):  # "running" the RT batch
            with lock:
                if inflight[0]:
                    violations.append(inflight[0])
            stop.wait(0.001)
        gate.lower_realtime()
    stop.set()
    for worker in workers:
        worker.join(WAIT_S)
    assert violations == []
