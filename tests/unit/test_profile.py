"""Profile files: validation with clear errors, hardware fingerprint check."""

import json

import pytest

from packrat_plugin.profile import ProfileError, load_profile
from serving_harness.machine import hardware_fingerprint


def write(tmp_path, data) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def points(grid):
    return [{"threads": t, "batch": b, "latency_ms": 1.0 + t + b} for t, b in grid]


GOOD = {"model": "m", "hardware": {}, "points": points([(1, 1), (1, 2), (2, 1), (2, 2)])}


@pytest.mark.parametrize(
    "data, message",
    [
        ("{not json", "malformed JSON"),
        ([], "must be a JSON object"),
        ({"points": []}, "lacks a 'model'"),
        ({"model": "m"}, "lacks a 'points' list"),
        ({"model": "m", "points": []}, "no points"),
        ({"model": "m", "points": points([(1, 1), (1, 2), (2, 1)])}, r"missing 1 point\(s\): \(threads=2, batch=2\)"),
        ({"model": "m", "points": [{"threads": 1, "batch": 1, "latency_ms": 0}]}, "non-positive latency"),
        ({"model": "m", "points": [{"threads": 1, "batch": 1, "latency_ms": -3}]}, "non-positive latency"),
        ({"model": "m", "points": [{"threads": 0, "batch": 1, "latency_ms": 1}]}, "threads must be a positive"),
        ({"model": "m", "points": [{"threads": 1, "latency_ms": 1}]}, "lacks 'batch'"),
        ({"model": "m", "points": points([(1, 1), (1, 1)])}, "duplicate point threads=1, batch=1"),
        (
            {"model": "m", "grid": {"threads": [1, 2], "batches": [1]}, "points": points([(1, 1)])},
            r"missing 1 point\(s\): \(threads=2, batch=1\)",
        ),
        (dict(GOOD, handler={"per_request_ms": {"1": -1.0}}), "bad per-request cost '1': -1.0"),
        (dict(GOOD, handler={"per_request_ms": {"one": 2.0}}), "bad per-request cost 'one'"),
        (dict(GOOD, handler={"per_request_ms": [2.0]}), "'handler' needs a 'per_request_ms' object"),
    ],
)
def test_bad_profiles_are_refused_with_a_reason(tmp_path, data, message):
    with pytest.raises(ProfileError, match=message):
        load_profile(write(tmp_path, data), check_machine=False)


def test_profile_round_trips(tmp_path):
    profile = load_profile(write(tmp_path, GOOD), check_machine=False)
    assert profile.threads == [1, 2] and profile.batches == [1, 2]
    assert profile.latency(2, 2) == 5.0
    out = tmp_path / "out.json"
    profile.save(out)
    assert load_profile(out, check_machine=False) == profile


def test_the_handlers_cost_round_trips(tmp_path):
    assert load_profile(write(tmp_path, GOOD), check_machine=False).handler is None  # the model alone
    data = dict(GOOD, handler={"per_request_ms": {"1": 6.5, "4": 5.0}, "requests": 32})
    profile = load_profile(write(tmp_path, data), check_machine=False)
    handler = profile.handler
    assert handler.per_request_ms == {1: 6.5, 4: 5.0} and handler.requests == 32
    out = tmp_path / "out.json"
    profile.save(out)
    assert load_profile(out, check_machine=False).handler == handler


def test_profile_from_other_hardware_is_refused_unless_forced(tmp_path):
    here = hardware_fingerprint()
    other = dict(GOOD, hardware=dict(here, cpu_model="Some Other CPU"))
    path = write(tmp_path, other)
    with pytest.raises(ProfileError, match="measured on other hardware.*cpu_model"):
        load_profile(path)
    assert load_profile(path, force=True).model == "m"
    same = write(tmp_path, dict(GOOD, hardware=here))
    assert load_profile(same).model == "m"
