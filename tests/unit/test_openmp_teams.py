"""``bench.openmp_teams``: each setting read against ``alone`` within its round, and bad arguments refused."""

from __future__ import annotations

import threading

import pytest

from bench.openmp_teams import Neighbour, main, render


def test_each_setting_is_read_against_the_batch_alone_in_the_same_round() -> None:
    data = {
        "args": {"model": "bert-tiny1", "batch": 32, "runs": 200, "rounds": 2},
        "cores": 2,
        "runs": {"alone": [1.0, 2.0], "idle-team": [2.5, 4.0], "idle-one-thread": [1.1, 2.0]},
        "provenance": {"command": "python -m bench.openmp_teams", "commit": "abc", "date": "d", "machine": {}},
    }
    table = render(data)
    assert "| idle-team | 3.25 (2.50-4.00) | 2.25× (2.00-2.50) |" in table
    assert "| idle-one-thread | 1.55 (1.10-2.00) | 1.05× (1.00-1.10) |" in table
    assert "team of 2 intra-op threads" in table


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--runs", "0"], ["--batch", "0"]])
def test_a_run_with_nothing_to_time_is_refused(argv, capsys) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert "must be ≥ 1" in capsys.readouterr().err


def test_a_neighbour_thread_ends_when_stopped() -> None:
    before = threading.active_count()
    neighbour = Neighbour(1)
    assert threading.active_count() == before + 1
    neighbour.stop()
    assert threading.active_count() == before
