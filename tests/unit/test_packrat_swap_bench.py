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


class _Level:
    def __init__(self, batch: int) -> None:
        self.batch = batch


class _Policy:
    """The best level by rate: B=1 (fat) below 5 req/s, B=2 (split) above."""

    def best(self, rate: float) -> _Level:
        return _Level(2 if rate > 5 else 1)


class _Model:
    """What ``move_on_schedule`` reads and calls on a ModelController, recording each move and when."""

    def __init__(self) -> None:
        self.policy, self.level, self.moves = _Policy(), _Level(1), []

    def move_to(self, level, rate, reason) -> None:
        import time

        self.moves.append((time.monotonic(), level.batch, rate, reason))
        self.level = level


def test_scheduled_moves_come_the_delay_after_each_change_and_only_where_the_level_changes():
    import time

    from bench.packrat_swap import move_on_schedule

    model, started = _Model(), time.monotonic()
    # 0.2 s low, 0.2 s high, 0.1 s still high (no move), 0.2 s low: two moves, each 0.1 s after its change.
    move_on_schedule(model, [(0.2, 1.0), (0.2, 8.0), (0.1, 9.0), (0.2, 1.0)], 0.1, started)
    assert [(batch, rate, reason) for _, batch, rate, reason in model.moves] == [
        (2, 8.0, "load rose (scheduled)"),
        (1, 1.0, "load fell"),
    ]
    at = [t - started for t, *_ in model.moves]
    assert at[0] == pytest.approx(0.3, abs=0.05) and at[1] == pytest.approx(0.6, abs=0.05)


def test_scheduled_systems_are_named_by_their_delay_and_parsed_back():
    import argparse

    from bench.packrat_swap import controlled, parse_delays, scheduled_delay, scheduled_system

    assert parse_delays("0,1.5") == (0.0, 1.5)
    assert [scheduled_delay(scheduled_system(d)) for d in (0.0, 1.5)] == [0.0, 1.5]
    assert controlled(scheduled_system(0.0)) and controlled("packrat") and not controlled("static")
    assert scheduled_delay("static") is None
    for bad in ("", "x", "-1", "1,1", "90"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_delays(bad)


def _controlled_run(mean_ms: float, drains: list[float], serving: list[float]) -> dict:
    return {
        "mean_ms": mean_ms,
        "p99_ms": 3 * mean_ms,
        "failed": 0,
        "swaps": [{"phases": {"drain": d}} for d in drains],
        "swaps_per_run": [len(drains)],
        "reactions": [{"serving_s": s} for s in serving],
        "vs_packrat": {"median": 0.9, "min": 0.8, "max": 1.1},
        "over_better_static": {"median": 1.05, "min": 0.95, "max": 1.2},
    }


def test_the_scheduled_and_narrowed_tables_show_each_systems_numbers_and_are_left_out_when_not_run():
    from bench.packrat_swap import NARROW, narrow_ab_text, scheduled_system, scheduled_text

    data = {"loads": {"step": [(15.0, 1.2), (30.0, 8.4)]}, "packrat": {"step": _controlled_run(500, [1.7], [0.9])}}
    assert scheduled_text(data) == "" and narrow_ab_text(data) == ""
    data[scheduled_system(1.0)] = {"step": _controlled_run(555, [1.83], [1.01])}
    data[scheduled_system(0.0)] = {"step": _controlled_run(525, [0.12], [0.01])}
    data[NARROW] = {"step": _controlled_run(610, [0.7], [0.95])}
    text = scheduled_text(data)
    zero, one = text.index("| 0 s | step | 525 / 1575 |"), text.index("| 1 s | step | 555 / 1665 |")
    assert zero < one  # by delay, not by insertion
    assert "1.05× (0.95-1.20)" in text and "| 0.01 | 0.12 | 1 / 0 |" in text
    narrow = narrow_ab_text(data)
    assert "| step | 500 / 610 |" in narrow and "1.70 / 0.70" in narrow
