"""The handlers' one start-up timer (``handlers/runtime/timing.py``), on a clock the calls advance."""

from __future__ import annotations

import pytest

from handlers.runtime import timing
from handlers.runtime.timing import median_seconds


class Clock:
    """``perf_counter`` for the timer: each call of ``run`` advances it by its next duration."""

    def __init__(self, durations: list[float]) -> None:
        self.now = 0.0
        self.durations = list(durations)
        self.calls = 0
        self.events: list[str] = []

    def perf_counter(self) -> float:
        return self.now

    def run(self) -> None:
        self.calls += 1
        self.events.append("run")
        self.now += self.durations.pop(0) if self.durations else 1.0


@pytest.fixture
def clock(monkeypatch):
    def make(durations: list[float]) -> Clock:
        c = Clock(durations)
        monkeypatch.setattr(timing.time, "perf_counter", c.perf_counter)
        return c

    return make


def test_the_warm_calls_are_not_timed_and_the_median_ignores_one_slow_call(clock) -> None:
    c = clock([100.0, 3.0, 1.0, 50.0])  # the warm call is the slow first one; 50 is a hiccup
    assert median_seconds(c.run, warm=1, repeats=3) == 3.0
    assert c.calls == 4


def test_a_fast_call_is_timed_until_the_budget_is_spent_and_at_most_max_runs_times(clock) -> None:
    c = clock([0.001] * 1000)
    median_seconds(c.run, warm=0, repeats=3, budget_s=0.02)
    assert 20 <= c.calls <= 21  # 3 calls would do; the budget asks for 0.02 s of them
    c = clock([0.001] * 1000)
    median_seconds(c.run, warm=0, repeats=3, budget_s=10.0, max_runs=50)
    assert c.calls == 50
    c = clock([0.001] * 1000)
    median_seconds(c.run, warm=0, repeats=3, budget_s=0.5, max_runs=None)
    assert c.calls >= 500


def test_a_slow_call_is_timed_only_the_repeats_asked(clock) -> None:
    c = clock([2.0] * 10)
    assert median_seconds(c.run, warm=0, repeats=3, budget_s=0.02) == 2.0
    assert c.calls == 3


def test_sync_drains_the_device_before_each_call_and_inside_its_time(clock) -> None:
    c = clock([1.0] * 10)

    def sync() -> None:
        c.events.append("sync")
        c.now += 0.5  # a device queue still running: counted after the call, never before it

    assert median_seconds(c.run, warm=1, repeats=2, sync=sync) == 1.5
    assert c.events == ["run", "sync", "run", "sync", "sync", "run", "sync"]


def test_no_timed_call_is_refused() -> None:
    with pytest.raises(ValueError, match="repeats"):
        median_seconds(lambda: None, repeats=0)
