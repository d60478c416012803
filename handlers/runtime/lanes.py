"""CPU execution lanes: the few threads that do a CPU handler's heavy work, by priority.

On a CPU the model's batch runs on intra-op threads (an OpenMP team) that
take every core the worker has.  Two things follow, both measured on
2-core VMs with ResNet-50:

- GNU OpenMP keeps one thread team per calling thread.  A batch run from a
  new thread while another team exists ran ~1.5× slower (83 → 125 ms), so
  batches always run on the same few threads: the lanes.
- Any other CPU work that overlaps a batch stalls the whole team, not one
  core: a parallel region waits at its barrier for the thread that was
  preempted.  Inside TorchServe at 85 % load, with requests decoded on the
  event loop while batches ran, a batch took a median ~1.8× as long per
  request as NO Wait's; decoded on the lane, ~1.2× (six paired repeats,
  docs/benchmarks/README.md).  Decoding *on the lane*, between batches,
  gives each batch its cores alone, as TorchServe's sync worker does by
  decoding its batch before running it.

So the lanes are ``count`` threads, each running torch with
``threads_each`` intra-op threads, taking work from one queue ordered by
priority (lower first), then arrival.  Engines submit batches; the decoder
may submit decodes (``decode_threads: lane``).  Both use ``DEFAULT``, i.e.
plain FIFO.  Batches first was tried and measured worse: each decode's
request then became a batch of its own that jumped the other queued decodes,
so batching collapsed (mean batch 1.03, 2.16× NO Wait's mean latency at
85 % load, against 1.23 and 0.97× FIFO, on the same 2-core VM).  Priorities
are there for schedulers that need them (real-time before best-effort).
The runtime owns the lanes, one set per handler, so several engines (input
layouts) share one set of teams instead of starting one each.

A job may also be submitted ``quiet``: while every lane runs a quiet job,
``wait_for_a_loud_lane`` blocks, and the worker's message reader waits there
(``worker_pump.py``) instead of reading requests beside the batch.  An engine
marks its batches quiet when a request read during one would only be queued
on the lane until the batch ends (Ebird's, which decodes on the lane), as
TorchServe's sync worker reads nothing while its batch runs.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from handlers.runtime.intra_op import use_intra_op_threads

T = TypeVar("T")
# A queued job: (priority, submission order, future, fn, args, quiet); the first two order the heap.
Job = tuple[int, int, Future, Callable[..., Any], tuple[Any, ...], bool]

DEFAULT = 0


@dataclass(frozen=True)
class LanePlacement:
    """Where one lane runs: its own cores (None: the process's) and intra-op threads."""

    cores: tuple[int, ...] | None
    threads: int


class CpuLanes:
    def __init__(self, count: int, threads_each: int, placements: list[LanePlacement] | None = None) -> None:
        if count < 1 or threads_each < 1:
            raise ValueError(f"need ≥ 1 lane of ≥ 1 thread, got {count} × {threads_each}")
        self.count = count
        self.threads_each = threads_each
        self.placements = placements or [LanePlacement(None, threads_each)] * count
        if len(self.placements) != count or any(p.threads < 1 for p in self.placements):
            raise ValueError(f"need one placement of ≥ 1 thread per lane, got {self.placements}")
        self._queue: list[Job] = []
        # Work for one lane only (an instance's batch must run on its own cores).
        self._own: list[list[Job]] = [[] for _ in range(count)]
        self._quiet_running = 0  # lanes running a quiet job (under ``_quiet``)
        self._quiet = threading.Condition()
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"lane_{i}", daemon=True) for i in range(count)
        ]  # fmt: skip
        for thread in self._threads:
            thread.start()

    @classmethod
    def splitting(cls, cores: int, count: int) -> CpuLanes:
        """``count`` lanes sharing ``cores`` intra-op threads evenly (at least one each)."""
        return cls(count, max(1, cores // count))

    @classmethod
    def placed(cls, placements: list[LanePlacement]) -> CpuLanes:
        """One lane per placement, each pinned to its cores with its own thread count.

        Each lane pins its own thread before its OpenMP team exists, and GNU
        OpenMP starts a team's threads from the thread that calls it, with that
        thread's affinity: so each team stays on its lane's cores.
        """
        if not placements:
            raise ValueError("need at least one lane placement")
        return cls(len(placements), max(p.threads for p in placements), list(placements))

    def submit(
        self, fn: Callable[..., T], *args: Any, priority: int = DEFAULT, lane: int | None = None, quiet: bool = False
    ) -> Future[T]:
        """Queue ``fn(*args)``; lower ``priority`` runs first, equal ones in submission order.

        ``lane``: run it on that lane only (else on whichever is free first).
        ``quiet``: while every lane runs a quiet job, ``wait_for_a_loud_lane``
        blocks (an engine's batch that a newly read request could not join).
        """
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("CPU lanes are closed")
            queue = self._queue if lane is None else self._own[lane]
            heapq.heappush(queue, (priority, next(self._order), future, fn, args, quiet))
            if lane is None:
                self._cond.notify()
            else:  # only that lane may take it: wake them all, it is among them
                self._cond.notify_all()
        return future

    def _run(self, index: int) -> None:
        placement = self.placements[index]
        if placement.cores is not None:
            os.sched_setaffinity(0, placement.cores)  # this thread only; its OpenMP team inherits it
        use_intra_op_threads(placement.threads)
        own = self._own[index]
        while True:
            with self._cond:
                while not self._queue and not own and not self._closed:
                    self._cond.wait()
                if not self._queue and not own:
                    return
                queue = own if own and (not self._queue or own[0][:2] < self._queue[0][:2]) else self._queue
                _, _, future, fn, args, quiet = heapq.heappop(queue)
            if not future.set_running_or_notify_cancel():
                continue
            if quiet:
                self._set_quiet(+1)
            try:
                result = fn(*args)
            except BaseException as exc:  # the submitter gets it, the lane serves on
                error: BaseException | None = exc
            else:
                error = None
            finally:
                if quiet:
                    self._set_quiet(-1)
            # Settled after the quiet job ended: what its future's callbacks
            # start (answers, the next batch) runs with reading allowed again.
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

    def _set_quiet(self, change: int) -> None:
        with self._quiet:
            self._quiet_running += change
            if self._quiet_running < self.count:
                self._quiet.notify_all()

    def all_quiet(self) -> bool:
        """Whether every lane runs a quiet job now (a read without the lock: a hint, not a promise)."""
        return self._quiet_running >= self.count

    def wait_for_a_loud_lane(self, timeout_s: float | None = None) -> bool:
        """Block while every lane runs a quiet job (False: ``timeout_s`` passed first).

        Returns at once once the lanes are closed, so a reader waiting here
        can see the frontend go away.
        """
        with self._quiet:
            return self._quiet.wait_for(lambda: self._quiet_running < self.count or self._closed, timeout_s)

    def run_on_each(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` once on every lane thread, so each thread's OpenMP team exists before the first request."""
        for done in [self.submit(fn, lane=i) for i in range(self.count)]:
            done.result()

    def close(self, timeout_s: float | None = None) -> None:
        """Run what was queued (engines have already settled their batches; a queued decode
        still reaches its request, which the closed engine then answers 503), then stop.

        Waits at most ``timeout_s`` for that: a stuck batch must not hold up
        the worker's shutdown (the threads are daemons).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        with self._quiet:
            self._quiet.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))

    def __repr__(self) -> str:
        if any(p.cores is not None for p in self.placements):
            lanes = ", ".join(f"{p.threads} on {list(p.cores or ())}" for p in self.placements)
            return f"CpuLanes({lanes})"
        return f"CpuLanes({self.count} × {self.threads_each} threads)"
