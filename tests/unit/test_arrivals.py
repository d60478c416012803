"""The register of requests between receipt and admission (late binding's input), without threads."""

from __future__ import annotations

from handlers.runtime.arrivals import Arrivals


def test_a_horizon_counts_only_the_requests_received_up_to_it():
    arrivals = Arrivals()
    assert arrivals.horizon == -1 and arrivals.pending_through(arrivals.horizon) == 0
    first, second = arrivals.enter(), arrivals.enter()
    horizon = arrivals.horizon
    third = arrivals.enter()
    assert horizon == second and arrivals.pending_through(horizon) == 2
    arrivals.leave(first)
    assert arrivals.pending_through(horizon) == 1 and len(arrivals) == 2
    arrivals.leave(second)
    assert arrivals.pending_through(horizon) == 0  # the later one does not extend the wait
    assert arrivals.pending_through(third) == 1


def test_every_leave_wakes_the_listeners_once_and_a_second_leave_is_ignored():
    arrivals = Arrivals()
    woken = []
    arrivals.on_leave(lambda: woken.append(len(arrivals)))
    token = arrivals.enter()
    arrivals.enter()
    arrivals.leave(token)
    arrivals.leave(token)
    assert woken == [1]


def test_a_burst_entered_together_takes_consecutive_tokens_each_left_on_its_own():
    arrivals = Arrivals()
    before = arrivals.enter()
    burst = arrivals.enter_many(3)
    after = arrivals.enter()
    assert list(burst) == [before + 1, before + 2, before + 3] and after == before + 4
    assert len(arrivals) == 5 and arrivals.pending_through(burst[-1]) == 4
    arrivals.leave(burst[1])
    assert arrivals.pending_through(burst[-1]) == 3 and len(arrivals.enter_many(0)) == 0
