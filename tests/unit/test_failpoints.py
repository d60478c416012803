"""Failpoints kill the process that reaches the named one, as ``kill -9`` would, and are inert otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from packrat_plugin import failpoints


def reach_in_child(point: str, env_value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
    if env_value is not None:
        env[failpoints.ENV] = env_value
    code = f"from packrat_plugin import failpoints; failpoints.reach({point!r}); print('went on')"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_the_named_failpoint_kills_the_process_with_sigkill_before_anything_after_it_runs():
    done = reach_in_child("switched", "switched")
    assert done.returncode == -signal.SIGKILL and "went on" not in done.stdout


def test_another_failpoint_or_none_set_lets_the_process_go_on():
    assert reach_in_child("switched", "drained").stdout.strip() == "went on"
    assert reach_in_child("switched", None).stdout.strip() == "went on"


def test_every_swap_point_is_reached_by_the_swapper():
    source = (Path(failpoints.__file__).parent / "swapper.py").read_text()
    for point in failpoints.SWAP_POINTS:
        assert f'failpoints.reach("{point}")' in source, point
