"""Response timeouts for many waiting requests with one timer, not one per request.

``asyncio.wait_for`` arms a timer per call (a ``TimerHandle`` pushed on the
loop's heap, cancelled again when the answer comes first) and wraps the
awaited future in another task-like layer.  Per request that is a few
microseconds of the event loop's time, and on a tiny model (the host-bound
regime of a fast GPU) the loop's time per request is what limits the
handler (``docs/benchmarks/host_path.md``).  Every request of a handler
has the same timeout, so their deadlines come in the order they were
set: a queue in that order and one timer for its head do the same job.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence
from typing import Any


class Deadlines:
    """Fail each watched asyncio future that is not done by its deadline (``loop.time()`` seconds).

    Deadlines must be watched in non-decreasing order (one timeout for all);
    a later one that comes earlier is still honoured, only late by the
    deadlines queued ahead of it.  Futures answered in time leave the
    queue as the head passes them, so it holds about the requests in flight.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, error: Callable[[], BaseException]) -> None:
        self.loop = loop
        self.error = error
        self._queue: collections.deque[tuple[float, asyncio.Future]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self.expired = 0  # futures failed for their deadline (tests, counters)

    def watch(self, future: asyncio.Future, deadline: float) -> None:
        """Fail ``future`` with ``error()`` if it is still pending at ``deadline``."""
        self._forget_answered()
        self._queue.append((deadline, future))
        if self._timer is None:
            self._arm()

    def watch_many(self, futures: Sequence[Any], deadline: float) -> None:
        """``watch`` each of ``futures`` with the one ``deadline`` (a burst received together)."""
        self._forget_answered()
        self._queue.extend((deadline, future) for future in futures)
        if self._timer is None:
            self._arm()

    def _forget_answered(self) -> None:
        """Drop the head's futures answered in time: nothing left to watch there."""
        queue = self._queue
        while queue and queue[0][1].done():
            queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def _arm(self) -> None:
        self._timer = self.loop.call_at(self._queue[0][0], self._fire) if self._queue else None

    def _fire(self) -> None:
        now = self.loop.time()
        queue = self._queue
        while queue and (queue[0][1].done() or queue[0][0] <= now):
            _, future = queue.popleft()
            if not future.done():
                future.set_exception(self.error())
                self.expired += 1
        self._arm()
