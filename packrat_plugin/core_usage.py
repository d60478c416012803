"""How busy the model's cores are, from the kernel's per-CPU counters: the calibrator's contention input.

``psutil.cpu_times(percpu=True)`` reads ``/proc/stat``: per CPU, the seconds
spent in each state since boot.  Busy is everything but idle and iowait
(steal counts as busy: the hypervisor took the core, which slows a worker as
much as another process would).  The calibrator subtracts the workers' own
CPU time and reads the rest as the contention of the load
(``calibration.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import psutil

from packrat_plugin.calibration import CoreUsage


def read_core_usage(cores: Sequence[int]) -> CoreUsage | None:
    """Wall time now and the busy seconds of ``cores`` since boot; None where the kernel does not say
    (no per-CPU counters, or a core this machine does not list)."""
    try:
        per_cpu = psutil.cpu_times(percpu=True)
    except (OSError, NotImplementedError):
        return None
    busy = 0.0
    for core in cores:
        if not 0 <= core < len(per_cpu):
            return None
        times = per_cpu[core]
        idle = times.idle + getattr(times, "iowait", 0.0)
        busy += sum(times) - idle - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
    return CoreUsage(time.monotonic(), busy)
