"""The batch-size estimator on synthetic queue-depth traces."""

import random

import pytest

from packrat_plugin.estimator import BatchSizeEstimator, EstimatorConfig, floor_power_of_two

PERIOD = 0.005


def run(estimator: BatchSizeEstimator, depths, start: float = 0.0):
    changes = []
    for i, depth in enumerate(depths):
        now = start + i * PERIOD
        new = estimator.observe(depth, now)
        if new is not None:
            changes.append((now, new))
    return changes


def test_floor_power_of_two():
    assert [floor_power_of_two(x) for x in (0, 0.5, 1, 1.9, 2, 3, 4, 7.99, 8, 1000)] == [
        1, 1, 1, 1, 2, 2, 4, 4, 8, 512,
    ]  # fmt: skip


def test_step_from_low_to_high_load_changes_once_after_the_timeout():
    est = BatchSizeEstimator(EstimatorConfig(), initial_batch=2)
    low = [2] * 400  # 2 s at depth 2
    high = [20] * 800  # 4 s at depth 20
    changes = run(est, low + high)
    assert len(changes) == 1, changes
    when, batch = changes[0]
    assert batch == 16
    step_at = len(low) * PERIOD
    assert step_at + 1.0 <= when <= step_at + 1.5


def test_noisy_stationary_load_never_changes():
    rng = random.Random(7)
    est = BatchSizeEstimator(EstimatorConfig(), initial_batch=8)
    depths = [max(0, round(rng.gauss(10, 3))) for _ in range(4000)]  # 20 s around depth 10
    assert run(est, depths) == []
    assert est.current == 8


def test_alternating_bursts_shorter_than_the_timeout_cause_no_change():
    est = BatchSizeEstimator(EstimatorConfig(), initial_batch=4)
    trace = ([4] * 100 + [40] * 100) * 10  # bursts of 0.5 s
    assert run(est, trace) == []


def test_step_down_is_followed_too():
    est = BatchSizeEstimator(EstimatorConfig(), initial_batch=16)
    changes = run(est, [17] * 400 + [3] * 600)
    assert [b for _, b in changes] == [2]


def test_estimates_are_clamped_to_the_configured_range():
    est = BatchSizeEstimator(EstimatorConfig(max_batch=8, timeout_s=0.1), initial_batch=1)
    changes = run(est, [100] * 200)
    assert [b for _, b in changes] == [8]


@pytest.mark.parametrize(
    "kwargs", [{"alpha": 0}, {"alpha": 1.5}, {"window": 0}, {"sample_period_s": 0}, {"min_batch": 4, "max_batch": 2}]
)
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        EstimatorConfig(**kwargs)


def test_negative_depth_is_refused():
    with pytest.raises(ValueError, match="negative"):
        BatchSizeEstimator().observe(-1, 0.0)
