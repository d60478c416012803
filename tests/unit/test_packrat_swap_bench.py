"""bench.packrat_swap's reading of a run: load changes, and how fast Packrat acted on each (pure logic)."""

from __future__ import annotations

import pytest

from bench.packrat_swap import load_changes, reactions


def test_load_changes_are_the_boundaries_where_the_rate_moves():
    spike = [(7.5, 2.0), (10.0, 14.0), (10.0, 2.0)]
    assert load_changes(spike) == [(7.5, "up"), (17.5, "down")]
    assert load_changes([(5.0, 3.0), (5.0, 3.0), (5.0, 1.0)]) == [(10.0, "down")]  # no change, no entry
    assert load_changes([(30.0, 4.0)]) == []
    # A diurnal sine's pieces: its whole rise is one change, and its whole fall another.
    assert load_changes([(5.0, 2.0), (5.0, 4.0), (5.0, 8.0), (5.0, 6.0), (5.0, 2.0)]) == [(5.0, "up"), (15.0, "down")]


def test_each_change_is_answered_by_the_first_decision_after_it_and_before_the_next():
    start = 1000.0
    spike = [(7.5, 2.0), (10.0, 14.0), (10.0, 2.0)]
    decisions = [{"at": start + 8.4, "reason": "load rose"}, {"at": start + 19.6, "reason": "load fell"}]
    swaps = [{"started": start + 8.4, "serving_after_s": 0.01}, {"started": start + 19.6, "serving_after_s": 0.0}]
    rise, fall = reactions(spike, decisions, swaps, start)
    assert rise["reaction_s"] == pytest.approx(0.9) and rise["serving_s"] == pytest.approx(0.91)
    assert fall["reaction_s"] == pytest.approx(2.1) and fall["reason"] == "load fell"
    # A change nobody acted on before the next one began is reported as such, not credited to a later move;
    # nor is a move the other way (a growing rule firing after the fall).
    late = reactions(spike, [{"at": start + 18.0, "reason": "load rose"}], [], start)
    assert late[0]["reaction_s"] is None and late[1]["reaction_s"] is None


def test_the_false_alarm_bound_is_the_poisson_upper_confidence_limit():
    from bench.packrat_constant import poisson_upper

    assert poisson_upper(0) == pytest.approx(2.996, abs=1e-3)  # -ln(0.05): no alarm in T bounds the rate by 3/T
    assert poisson_upper(1) == pytest.approx(4.744, abs=1e-3)
    assert poisson_upper(5) > 5 and poisson_upper(5, confidence=0.5) < poisson_upper(5)
