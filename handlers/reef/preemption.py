"""Real-time work stops best-effort work at launch-unit boundaries.

REEF's mechanism, apart from its policy.  A worker runs best-effort (BE)
batches as sequences of *launch units* (model segments, ``segments.py``) and
real-time (RT) requests as they come.  From the moment an RT request is
admitted until the RT queue is empty again the worker is in *real-time
mode*:

- a BE executor asks the gate before each unit (``unit()``); in real-time
  mode it blocks there, holding the state its batch had reached, and resumes
  from that unit when normal mode returns.  Units are idempotent functions of
  that state, so nothing runs twice and nothing is lost;
- the RT executor, before it runs, waits until no BE unit is in flight
  (``quiesce()``).  The time from the mode switch to that point is the
  *preemption latency*, bounded by the longest unit a BE executor had
  started.  On CPU a unit in flight shares the cores with the RT batch,
  which is why RT waits for it; on CUDA the RT batch goes to a
  high-priority stream at once and only the launching is gated (REEF-N:
  the at most ``c`` units already queued on the device drain beside it).

The gate knows nothing of models or queues; ``handlers/reef/`` decides what
is real-time and runs the executors.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Preemption:
    """One switch to real-time mode, seen by the first RT batch that ran in it."""

    latency_s: float  # from the switch until no BE unit was in flight
    interrupted: int  # BE units in flight at the switch (0: BE was idle, nothing was preempted)


class PreemptionGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._realtime = 0  # RT requests admitted and not yet finished
        self._inflight = 0  # BE units running (CPU) or being launched (CUDA)
        self._switched_at: float | None = None  # when real-time mode began
        self._interrupted = 0  # BE units in flight when it began
        self._waiting = 0  # BE units stopped at the gate, waiting to restore
        self._closed = False

    # -- real-time side --------------------------------------------------------

    def raise_realtime(self, requests: int = 1) -> None:
        """``requests`` RT requests were admitted: real-time mode from now on."""
        with self._cond:
            if self._realtime == 0:
                self._switched_at = self._clock()
                self._interrupted = self._inflight
            self._realtime += requests

    def lower_realtime(self, requests: int = 1) -> None:
        """``requests`` RT requests finished; normal mode returns when none is left."""
        with self._cond:
            if requests > self._realtime:
                raise RuntimeError(f"{requests} real-time requests finished but only {self._realtime} were admitted")
            self._realtime -= requests
            if self._realtime == 0:
                self._switched_at = None
                self._cond.notify_all()

    def quiesce(self, timeout_s: float | None = None) -> Preemption | None:
        """Wait until no BE unit is in flight; the switch this wait completed.

        None when this wait was not the first in its real-time period (BE
        was already stopped) or ``timeout_s`` ran out.
        """
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while self._inflight and not self._closed:
                remaining = None if deadline is None else deadline - self._clock()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            switched, self._switched_at = self._switched_at, None
            return None if switched is None else Preemption(self._clock() - switched, self._interrupted)

    @property
    def realtime_mode(self) -> bool:
        return self._realtime > 0

    @property
    def waiting(self) -> int:
        """BE units stopped at the gate right now."""
        return self._waiting

    # -- best-effort side ------------------------------------------------------

    @contextlib.contextmanager
    def unit(self) -> Iterator[bool]:
        """Run one BE unit: wait out real-time mode first, then count the unit as in flight.

        Yields whether it had to wait (the unit is where a preempted batch restores).
        """
        waited = False
        with self._cond:
            if self._realtime and not self._closed:
                waited = True
                self._waiting += 1
                while self._realtime and not self._closed:
                    self._cond.wait()
                self._waiting -= 1
            self._inflight += 1
        try:
            yield waited
        finally:
            with self._cond:
                self._inflight -= 1
                if self._inflight == 0:
                    self._cond.notify_all()

    def close(self) -> None:
        """Release every waiter (the worker is stopping: BE finishes what it holds, RT stops waiting)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
