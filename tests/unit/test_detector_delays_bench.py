"""bench.detector_delays' pieces (pure logic on seeded streams)."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.detector_delays import (
    TUNINGS,
    delay_s,
    evidence_per_second,
    false_alarms,
    parse_rates,
    parse_steps,
    per_hour,
)


def test_a_fall_brings_less_evidence_per_second_than_the_same_rise():
    rise, fall = evidence_per_second(1.2, 8.4), evidence_per_second(8.4, 1.2)
    assert rise == pytest.approx(8.4 * math.log(7) - 7.2)
    assert fall == pytest.approx(1.2 * math.log(1 / 7) + 7.2)
    assert fall < rise / 1.5


def test_a_7x_step_is_flagged_in_its_own_direction_within_seconds_and_the_default_tuning_is_the_monitors():
    from packrat_plugin.load_monitor import MonitorConfig

    default, monitor = next(iter(TUNINGS.values())), MonitorConfig()
    assert (default.ratio, default.large_ratio, default.false_alarm_seconds, default.uncertainty_z) == (
        monitor.change_ratio,
        monitor.change_large_ratio,
        monitor.change_false_alarm_s,
        monitor.change_uncertainty_z,
    )
    for old, new in ((1.2, 8.4), (8.4, 1.2)):
        delays = [delay_s(old, new, default, 0.25, seed) for seed in range(12)]
        flagged = [d for d in delays if d is not None and not math.isnan(d)]
        assert len(flagged) >= 10 and all(0 < d < 10 for d in flagged), delays


def test_steps_are_parsed_as_old_new_pairs():
    assert parse_steps("1.2:8.4,8:4") == [(1.2, 8.4), (8.0, 4.0)]
    for bad in ("1.2", "1:1", "0:3", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_steps(bad)


def test_constant_streams_count_early_and_late_alarms_and_rates_parse():
    """An 80-arrival-a-second stream with a 2× test tuned to alarm every half second: alarms in both parts;
    per_hour scales by the streams' seconds."""
    from packrat_plugin.change_detector import DetectorConfig

    jumpy = DetectorConfig(large_ratio=None, false_alarm_seconds=0.5)
    early, late = false_alarms(80.0, jumpy, 0.25, seed=0, seconds=120.0)
    assert early >= 1 and late >= 2, (early, late)
    assert false_alarms(80.0, TUNINGS[next(iter(TUNINGS))], 0.25, seed=1, seconds=60.0) == (0, 0)
    assert per_hour(3, 10, 36.0) == pytest.approx(30.0)
    assert parse_rates("1.2,4") == [1.2, 4.0]
    for bad in ("", "0,2", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_rates(bad)
