"""bench/orca.py's reading of its runs: Orca's throughput at each baseline's median latency (plain data)."""

from __future__ import annotations

import pytest

from bench.orca import summary


def row(policy: str, fraction: float, throughput: float, median_s: float, max_batch: int = 8) -> dict:
    return {"policy": policy, "max_batch": max_batch, "fraction": fraction, "throughput": throughput,
            "median_s": median_s, "failed": 0}  # fmt: skip


def test_each_baseline_point_is_matched_by_the_most_orca_served_at_that_median_or_better():
    data = {
        "max_batches": [8],
        "baselines": ["request", "generate"],
        "rows": [
            row("orca", 0.3, 1.0, 1.2), row("orca", 0.6, 2.0, 2.0), row("orca", 0.9, 2.6, 3.5),
            row("request", 0.3, 1.0, 2.5), row("request", 0.6, 1.8, 6.0),
            row("generate", 0.3, 0.9, 1.0), row("generate", 0.6, 1.2, 9.0),
        ],
    }  # fmt: skip
    got = {(s["baseline"], s["fraction"]): s["ratio"] for s in summary(data)}
    assert got[("request", 0.3)] == 2.0 / 1.0  # Orca's 0.9 load (3.5 s) is slower than 2.5 s: not counted
    assert got[("request", 0.6)] == 2.6 / 1.8
    assert got[("generate", 0.3)] is None  # Orca's median was above 1.0 s at every load
    assert got[("generate", 0.6)] == 2.6 / 1.2


def test_a_run_from_before_the_second_baseline_reads_as_request_level_only():
    data = {"max_batches": [8], "rows": [row("orca", 0.3, 1.0, 1.0), row("request", 0.3, 0.8, 1.5)]}
    (only,) = summary(data)
    assert only["baseline"] == "request" and only["ratio"] == 1.0 / 0.8


def test_asking_for_cuda_where_there_is_none_is_a_usage_error_not_a_traceback(monkeypatch, capsys):
    import torch

    from bench.orca import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        main(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err
