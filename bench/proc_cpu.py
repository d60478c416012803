"""CPU time of TorchServe's processes, by thread, from ``/proc`` (Linux).

On a 2-core machine every thread besides the batch's OpenMP team takes
cores from it, so what the frontend and the worker's side threads spend
per request is part of a request's latency; these numbers let a benchmark
say how much.  The worker's *run-queue wait* (``/proc/…/schedstat``: time
its threads were runnable but had no core) says what that cost the worker:
an OpenMP team waits at its barrier for a member that was preempted, so
every millisecond a team member waits stretches the batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def per_thread(pid: int, name: str, parse: Callable[[str], float]) -> dict[int, float]:
    """``parse`` of ``/proc/<pid>/task/<tid>/<name>`` for each live thread; a thread that exits meanwhile, or
    a file the kernel does not keep, is left out."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                out[int(tid)] = parse(f.read())
        except (OSError, IndexError, ValueError):
            continue
    return out


def _stat_cpu(text: str) -> float:
    fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each live thread of ``pid`` (threads that exit in between are not counted)."""
    return per_thread(pid, "stat", _stat_cpu)


def thread_wait_seconds(pid: int) -> dict[int, float]:
    """Seconds each live thread of ``pid`` spent runnable but waiting for a core; {} where the kernel keeps no
    schedstat (it needs CONFIG_SCHED_INFO)."""
    return per_thread(pid, "schedstat", lambda text: int(text.split()[1]) / 1e9)  # run ns, wait ns, timeslices


def java_in_group(group: int) -> int | None:
    """The Java process in process group ``group`` (TorchServe's frontend), if any."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != group:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0]
        except OSError:
            continue
        if os.path.basename(argv0) == b"java":
            return int(entry)
    return None


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds over an interval: the frontend, the worker's main thread, the worker's other threads."""

    frontend: float
    worker_main: float
    worker_others: float


@dataclass(frozen=True)
class Interval:
    """What one worker and its frontend spent over an interval: CPU, and the worker's threads' run-queue wait
    (None where the kernel keeps no schedstat)."""

    cpu: CpuSplit
    worker_waiting: float | None


class CpuMeter:
    """Reads the CPU of one frontend and one worker at two moments (``start`` then ``stop``)."""

    def __init__(self, frontend_pid: int | None, worker_pid: int) -> None:
        self.frontend_pid = frontend_pid
        self.worker_pid = worker_pid
        self._before: tuple[dict[int, float], dict[int, float], dict[int, float]] | None = None

    def _read(self) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        frontend = thread_cpu_seconds(self.frontend_pid) if self.frontend_pid else {}
        return frontend, thread_cpu_seconds(self.worker_pid), thread_wait_seconds(self.worker_pid)

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> Interval:
        if self._before is None:
            raise RuntimeError("CpuMeter.stop before start")
        (f0, w0, q0), (f1, w1, q1) = self._before, self._read()

        def spent(before: dict[int, float], after: dict[int, float], tids) -> float:
            return sum(after[t] - before.get(t, 0.0) for t in tids)

        others = [t for t in w1 if t != self.worker_pid]
        # In TorchServe's worker the main thread runs the handler (sync) or the event loop (async).
        cpu = CpuSplit(spent(f0, f1, f1), spent(w0, w1, [self.worker_pid] if self.worker_pid in w1 else []),
                       spent(w0, w1, others))  # fmt: skip
        return Interval(cpu, spent(q0, q1, q1) if q1 else None)
