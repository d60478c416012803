"""``bench.ebird_direct --capacity-repeats N``: capacity read in rounds, each system's ratio to NO Wait per round."""

from __future__ import annotations

import pytest

from bench.direct_systems import python_us
from bench.ebird_direct import capacity_spread, main, median_by_role, python_cores, spread_text


def test_each_capacity_is_the_median_of_its_rounds_and_its_ratio_is_taken_within_each_round() -> None:
    # The machine slows in round 2: every system reads lower, the ratio within the round does not move.
    runs = {"ebird": [800.0, 400.0, 900.0], "nowait-twin": [1000.0, 520.0, 1000.0], "nowait": [1000.0, 500.0, 1000.0]}
    spread = capacity_spread(runs)
    assert spread["ebird"] == pytest.approx(
        {"median": 800.0, "min": 400.0, "max": 900.0, "ratio": 0.8, "ratio_min": 0.8, "ratio_max": 0.9}
    )
    assert spread["nowait"]["ratio"] == spread["nowait"]["ratio_min"] == 1.0
    assert spread["nowait-twin"]["ratio_max"] == pytest.approx(1.04)


def test_host_time_per_role_is_the_median_of_the_rounds_and_a_role_a_round_lacks_counts_zero() -> None:
    rounds = [{"event loop": 30.0, "lanes": 70.0}, {"event loop": 50.0, "lanes": 90.0, "other": 3.0},
              {"event loop": 40.0, "lanes": 80.0}]  # fmt: skip
    assert median_by_role(rounds) == {"event loop": 40.0, "lanes": 80.0, "other": 0.0}


def test_fewer_than_one_capacity_round_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--capacity-repeats", "0", "--device", "cpu"])
    assert "--capacity-repeats must be at least 1" in capsys.readouterr().err


def test_python_cores_are_the_python_threads_cpu_per_request_times_the_rate_leaving_the_openmp_team_out() -> None:
    # Ebird on the one-layer BERT (2026-11-30, AMD EPYC): 7,656 req/s at 38 + 85 + 4 µs of Python a request.
    host = {"event loop": 38.0, "OpenMP": 122.0, "lanes": 85.0, "other": 4.0}
    assert python_us(host) == 127.0
    assert python_cores(7656.0, host) == pytest.approx(0.972, abs=1e-3)
    assert python_cores(0.0, host) == 0.0


def test_a_capacity_rounds_mean_batch_is_read_as_the_median_of_the_rounds_with_their_range() -> None:
    assert spread_text([31.9, 12.0, 30.5]) == "30.5 (12.0–31.9)"
