"""bench/proc_cpu.py reads real threads of a real process: this one."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from bench.proc_cpu import CpuMeter, thread_cpu_seconds, thread_wait_seconds

BLOCK = os.urandom(1 << 20)  # hashlib lets go of the GIL on large inputs: the threads below really run at once


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        hashlib.sha256(BLOCK).digest()


class Burners:
    """``count`` threads on one core, each burning ``seconds`` of CPU, kept alive until ``release``
    so that /proc still lists them."""

    def __init__(self, count: int, seconds: float) -> None:
        self.ids: list[int] = []
        self._done = threading.Barrier(count + 1)
        self._release = threading.Event()
        core = min(os.sched_getaffinity(0))
        self._threads = [threading.Thread(target=self._body, args=(core, seconds)) for _ in range(count)]

    def _body(self, core: int, seconds: float) -> None:
        os.sched_setaffinity(0, {core})  # this thread only
        self.ids.append(threading.get_native_id())
        burn(seconds)
        self._done.wait()
        self._release.wait()

    def __enter__(self) -> Burners:
        for thread in self._threads:
            thread.start()
        self._done.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        for thread in self._threads:
            thread.join()


def test_cpu_meter_splits_main_thread_from_the_others() -> None:
    meter = CpuMeter(None, os.getpid())
    meter.start()
    burn(0.3)  # this (main) thread
    with Burners(1, 0.3):
        spent = meter.stop()
    assert spent.cpu.frontend == 0.0
    assert spent.cpu.worker_main >= 0.25
    assert spent.cpu.worker_others >= 0.25


def test_threads_sharing_one_core_wait_on_its_run_queue() -> None:
    if not thread_wait_seconds(os.getpid()):
        pytest.skip("this kernel keeps no schedstat")
    with Burners(1, 0.3) as alone:
        wait_alone = thread_wait_seconds(os.getpid())[alone.ids[0]]
    with Burners(3, 0.3) as burners:
        waits = thread_wait_seconds(os.getpid())
        cpu = thread_cpu_seconds(os.getpid())
    # Three threads burning 0.3 s each on one core: while one runs, the other two wait (~1.8 s in all).
    assert all(cpu[tid] >= 0.25 for tid in burners.ids)
    shared = sum(waits[tid] for tid in burners.ids)
    assert shared >= 0.9
    # One alone on its core waits only for whatever else the machine runs there (other test workers, under
    # xdist). If those take a share L of the core, one thread waits 0.3·L/(1-L) and three wait
    # 0.9·(3/(1-L) - 1) between them: at least nine times as long for any L. A quarter leaves room for L to
    # change between the two readings without letting a reader that ignores the run queue pass.
    assert wait_alone < shared / 4


def test_stop_before_start_is_refused() -> None:
    with pytest.raises(RuntimeError):
        CpuMeter(None, os.getpid()).stop()
