"""The one-lane queue model of bench/lane_batching_sim.py, on plain cost data."""

from __future__ import annotations

import pytest

from bench.lane_batching_sim import at_most, batch_ms_at, ebird_rule, paid_for, parse_costs, simulate

COSTS = {1: 50.0, 2: 86.0, 4: 172.0, 8: 376.0}  # per sample 50, 43, 43, 47 ms


def test_batch_time_is_measured_or_interpolated_per_sample():
    assert batch_ms_at(COSTS, 2) == 86.0
    assert batch_ms_at(COSTS, 3) == pytest.approx(3 * 43.0)
    assert batch_ms_at(COSTS, 6) == pytest.approx(6 * 45.0)
    assert batch_ms_at(COSTS, 16) == pytest.approx(16 * 47.0)  # beyond the largest: its per-sample cost


def test_the_ebird_rule_is_the_real_schedulers_split_run_back_to_back():
    rule = ebird_rule([1, 1, 2, 4, 8, 16])
    assert rule(1) == [1]
    assert rule(7) == [4, 2, 1]
    assert rule(11) == [8, 2, 1]
    assert at_most(2)(7) == [2]


def test_only_sizes_cheaper_per_sample_than_every_smaller_one_are_paid_for():
    assert paid_for([1, 1, 2, 4, 8, 16], COSTS) == [1, 1, 2]  # 4 ties 2 per sample; 8 and 16 cost more
    assert paid_for([1, 1, 2, 4, 8, 16], {1: 10.0, 16: 40.0}) == [1, 1, 2, 4, 8, 16]  # a GPU-like curve


def test_a_lone_request_costs_one_batch_and_overload_grows_the_queue():
    mean, p99 = simulate(at_most(2), COSTS, rate=0.5, requests=200, seed=1)
    assert mean == pytest.approx(50.0, rel=0.05) and p99 < 100  # 0.5 req/s: nobody waits
    light, _ = simulate(at_most(2), COSTS, rate=20.0, requests=4000, seed=1)  # 86 % of 2 per 86 ms
    heavy, _ = simulate(at_most(2), COSTS, rate=20.0, requests=4000, seed=1, slowdown=1.3)  # 112 %: overload
    assert light < 500 and heavy > 5 * light


def test_bad_costs_are_refused():
    assert parse_costs("1:50,2:86") == {1: 50.0, 2: 86.0}
    for text in ("1:50,2", "0:5", "1:-3", ""):
        with pytest.raises(Exception, match="size:ms|sizes must"):
            parse_costs(text)
