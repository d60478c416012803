"""CPU time of TorchServe's processes, by thread, from ``/proc`` (Linux).

On a 2-core machine every thread besides the batch's OpenMP team takes
cores from it, so what the frontend and the worker's side threads spend
per request is part of a request's latency; these numbers let a benchmark
say how much.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each live thread of ``pid`` (threads that exit in between are not counted)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime, stime
    return out


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


class CpuMeter:
    """Reads the CPU of one frontend and one worker at two moments (``start`` then ``stop``)."""

    def __init__(self, frontend_pid: int | None, worker_pid: int) -> None:
        self.frontend_pid = frontend_pid
        self.worker_pid = worker_pid
        self._before: tuple[dict[int, float], dict[int, float]] | None = None

    def _read(self) -> tuple[dict[int, float], dict[int, float]]:
        frontend = thread_cpu_seconds(self.frontend_pid) if self.frontend_pid else {}
        return frontend, thread_cpu_seconds(self.worker_pid)

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> CpuSplit:
        if self._before is None:
            raise RuntimeError("CpuMeter.stop before start")
        (f0, w0), (f1, w1) = self._before, self._read()

        def spent(before: dict[int, float], after: dict[int, float], tids) -> float:
            return sum(after[t] - before.get(t, 0.0) for t in tids)

        others = [t for t in w1 if t != self.worker_pid]
        # In TorchServe's worker the main thread runs the handler (sync) or the event loop (async).
        return CpuSplit(spent(f0, f1, f1), spent(w0, w1, [self.worker_pid] if self.worker_pid in w1 else []),
                        spent(w0, w1, others))  # fmt: skip
