"""Calibration: what serving costs beyond the profile, from the workers' counters."""

import math

import pytest

from handlers.pinning.slots import ServiceTotals
from packrat_plugin.calibration import Calibration, CalibrationConfig, ServiceCalibrator, profiled_round_ms
from packrat_plugin.levels import Level
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.policy import ReconfigurationPolicy

ROUNDS = ((1, 100.0), (2, 180.0), (4, 340.0))


def test_profiled_round_is_linear_between_batch_sizes_and_beyond_them():
    assert profiled_round_ms(ROUNDS, 1) == 100.0
    assert profiled_round_ms(ROUNDS, 1.5) == pytest.approx(140.0)
    assert profiled_round_ms(ROUNDS, 3) == pytest.approx(260.0)
    assert profiled_round_ms(ROUNDS, 8) == pytest.approx(660.0)  # along the last segment
    assert profiled_round_ms(((4, 200.0),), 2) == pytest.approx(100.0)


def test_calibrator_learns_slowdown_and_per_request_overhead():
    cal = ServiceCalibrator(CalibrationConfig(min_requests=20, learning_rate=0.5))
    cal.update(ServiceTotals(), ROUNDS)  # the first reading is the baseline
    # 10 batches of 2: the model took 1.2× its profile, the handler 10 ms per request more.
    model_s = 10 * 0.180 * 1.2
    window = ServiceTotals(10, 20, model_s + 20 * 0.010, model_s)
    assert cal.update(window, ROUNDS)
    assert cal.current.slowdown == pytest.approx(1.2)
    assert cal.current.overhead_ms == pytest.approx(10.0)
    # The next window moves the estimate halfway (learning rate 0.5).
    model_s2 = 10 * 0.180 * 1.0
    second = window + ServiceTotals(10, 20, model_s2 + 20 * 0.030, model_s2)
    assert cal.update(second, ROUNDS)
    assert cal.current.slowdown == pytest.approx(1.1)
    assert cal.current.overhead_ms == pytest.approx(20.0)
    assert cal.current.updates == 2


def test_short_windows_wait_and_a_restarted_worker_rebaselines():
    cal = ServiceCalibrator(CalibrationConfig(min_requests=20))
    base = ServiceTotals(50, 100, 12.0, 10.0)
    cal.restart(base)
    assert not cal.update(base + ServiceTotals(5, 5, 0.6, 0.5), ROUNDS)  # 5 requests: too few
    # A worker died and took its counters: totals went down. No update, new baseline.
    fresh = ServiceTotals(3, 3, 0.4, 0.3)
    assert not cal.update(fresh, ROUNDS)
    assert cal.current == Calibration()
    assert cal.update(fresh + ServiceTotals(20, 20, 2.2, 2.0), ROUNDS)
    assert cal.current.slowdown == pytest.approx(1.0)


def test_slowdown_is_clamped():
    cal = ServiceCalibrator(CalibrationConfig(min_requests=1, max_slowdown=4.0))
    cal.restart(ServiceTotals())
    cal.update(ServiceTotals(1, 1, 50.0, 50.0), ROUNDS)  # 500× the profile: a stall, not a speed
    assert cal.current.slowdown == 4.0


@pytest.mark.parametrize("kwargs", [{"min_requests": 0}, {"learning_rate": 0.0}, {"min_slowdown": 1.5}])
def test_bad_calibration_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        CalibrationConfig(**kwargs)


def level(batch: int, count: int, threads: int, b: int, rounds) -> Level:
    latency = dict(rounds)[b]
    return Level(batch, Plan(2, batch, latency, (PlanItem(count, threads, b),)), tuple(rounds))


def test_handler_overhead_moves_the_choice_from_the_fat_worker_to_one_per_core():
    # On the profile alone one 2-thread worker (57 ms) beats two 1-thread ones
    # (101 ms) at 11 req/s (105 against 124 ms); with 10 ms of decoding per
    # request and a 10 % slowdown the fat worker is close to saturation and
    # the split wins (218 against 169 ms).
    fat = level(1, 1, 2, 1, ((1, 57.0),))
    split = level(2, 2, 1, 1, ((1, 101.0),))
    policy = ReconfigurationPolicy([fat, split])
    assert policy.best(11.0).batch == 1
    policy.calibrate(Calibration(slowdown=1.1, overhead_ms=10.0, updates=1))
    assert policy.best(11.0).batch == 2
    assert policy.level(1).capacity == pytest.approx(1000 / (57 * 1.1 + 10))
    assert math.isfinite(policy.level(2).predicted_latency_s(13.8))
