"""Per-request stage times summed on the event loop, handed to the metrics once per turn of the loop.

The runtime reports where each request's time went (``HandlerMetrics``'
stage counters: decode, admission, queue, batch, release, wakeup, encode).
Done per request as ``metrics.stages(stage_breakdown(...))``, that is a
dict of seven stages built, a dict comprehension clamping them, and a lock
taken to add each into the metrics' totals: 4.9 µs per request on a 2-vCPU
AMD EPYC VM (timed in isolation), on the event loop whose Python time per
request is what limits an async handler on a model whose batch is short
(``docs/benchmarks/host_path.md``).  The answers of one batch reach the
loop in one wake-up (``loop_mailbox.py``), so a tally that sums them in
plain attributes and hands the sums over once, at the end of that turn,
keeps the same totals for a fraction of the cost.

The sums reach the metrics before any coroutine woken by those answers
runs: the flush is queued (``call_soon``) before the first answer of the
turn is handed back, and the loop runs its callbacks in order.
"""

from __future__ import annotations

import asyncio

from handlers.runtime.engine import StageTimes
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_intake import BatchTimes

# What a request whose engine reports its inner times spent, in ``stage_breakdown``'s order.
TIMED = ("decode", "admission", "queue", "batch", "release", "wakeup", "encode")
# One whose engine does not: its time inside the engine is one ``engine`` stage.
UNTIMED = ("decode", "admission", "engine", "encode")


class StageTally:
    """``stage_breakdown``'s seconds per stage, summed over the requests answered in one turn of ``loop``."""

    __slots__ = ("metrics", "loop", "_timed", "_untimed", "_timed_count", "_untimed_count", "_due")

    def __init__(self, metrics: HandlerMetrics, loop: asyncio.AbstractEventLoop) -> None:
        self.metrics = metrics
        self.loop = loop
        self._timed = [0.0] * len(TIMED)
        self._untimed = [0.0] * len(UNTIMED)
        self._timed_count = 0
        self._untimed_count = 0
        self._due = False  # a flush is queued on the loop

    def add(
        self, received: float, decoded: float, admitted: float, times: StageTimes | None, woken: float, answered: float
    ) -> None:
        """One request's timestamps, as ``stage_breakdown`` takes them (each stage clamped at 0 as there)."""
        encoded = times.encode_seconds if times is not None else 0.0
        encode = answered - woken + encoded
        if times is None or times.started is None or times.finished is None or times.settled is None:
            sums = self._untimed
            engine = woken - admitted - encoded
            sums[2] += engine if engine > 0.0 else 0.0
            sums[3] += encode if encode > 0.0 else 0.0
            self._untimed_count += 1
        else:
            sums = self._timed
            queue = times.started - times.arrived
            batch = times.finished - times.started
            release = times.settled - times.finished - encoded
            wakeup = woken - times.settled
            sums[2] += queue if queue > 0.0 else 0.0
            sums[3] += batch if batch > 0.0 else 0.0
            sums[4] += release if release > 0.0 else 0.0
            sums[5] += wakeup if wakeup > 0.0 else 0.0
            sums[6] += encode if encode > 0.0 else 0.0
            self._timed_count += 1
        decode = decoded - received
        admission = admitted - decoded
        sums[0] += decode if decode > 0.0 else 0.0
        sums[1] += admission if admission > 0.0 else 0.0
        self._flush_soon()

    def add_taken(self, received: float, times: BatchTimes, woken: float, answered: float) -> None:
        """One request taken undecoded (``row_intake.py``): ``queue`` from receipt to its batch's start,
        ``decode`` its batch's decode, no ``admission``, ``batch`` its collate and model call, then as ``add``."""
        sums = self._timed
        queue = times.taken - received
        encode = answered - woken + times.encode_seconds
        release = times.settled - times.finished - times.encode_seconds
        wakeup = woken - times.settled
        sums[0] += times.decoded - times.taken
        sums[2] += queue if queue > 0.0 else 0.0
        sums[3] += times.finished - times.decoded
        sums[4] += release if release > 0.0 else 0.0
        sums[5] += wakeup if wakeup > 0.0 else 0.0
        sums[6] += encode if encode > 0.0 else 0.0
        self._timed_count += 1
        self._flush_soon()

    def _flush_soon(self) -> None:
        """Queue one flush on the loop for everything added before it runs."""
        if not self._due:
            self._due = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Hand the sums to the metrics (on the loop; also safe to call when nothing was added)."""
        self._due = False
        handed = ((TIMED, self._timed, self._timed_count), (UNTIMED, self._untimed, self._untimed_count))
        for names, sums, count in handed:
            if count:
                self.metrics.stage_sums(dict(zip(names, sums, strict=True)), count)
        self._timed = [0.0] * len(TIMED)
        self._untimed = [0.0] * len(UNTIMED)
        self._timed_count = self._untimed_count = 0
