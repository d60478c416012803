"""Hand results from engine and lane threads to the event loop, one wake-up per burst.

A future settled on another thread reaches asyncio through
``loop.call_soon_threadsafe``, which writes a byte to the loop's self-pipe
every time.  ``asyncio.wrap_future`` does that once per future, so a batch of
sixteen answers costs sixteen pipe writes from the lane that ran it, and
each write releases the GIL and hands it to the event loop mid-batch.  On
a model whose batch takes a few milliseconds (a tiny model on a CPU, any
model on a fast GPU) that hand-off is the host's bottleneck: sampled in
Ebird on a one-layer BERT, the lane spent about as long in those pipe
writes as in the model (``docs/benchmarks/host_path.md``).

``LoopMailbox`` queues callbacks from any thread and wakes the loop only
when the queue was empty: whatever is posted before the loop gets to run
is delivered in the same wake-up, in the order it was posted.  The plain
handler pays one hand-off per batch; with the mailbox an async handler's
answers do too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class LoopMailbox:
    """Callbacks posted from any thread, run on one event loop in posting order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._posted: list[Callable[[], Any]] = []
        self.wakeups = 0  # how many times the loop was woken (for tests and counters)
        self.delivered = 0  # how many callbacks it ran

    def post(self, callback: Callable[[], Any]) -> None:
        """Run ``callback`` on the loop soon; wakes the loop only if nothing is waiting for it yet."""
        with self._lock:
            self._posted.append(callback)
            if len(self._posted) > 1:
                return  # the loop is already due to drain the mailbox
            self.wakeups += 1
        # RuntimeError: the loop has closed, so nobody awaits what was posted.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            posted, self._posted = self._posted, []
        self.delivered += len(posted)
        for callback in posted:
            callback()

    def wrap(self, future: concurrent.futures.Future[T]) -> asyncio.Future[T]:
        """An asyncio future on this loop with ``future``'s outcome, delivered through the mailbox."""
        waiter: asyncio.Future[T] = self.loop.create_future()

        def copy() -> None:
            if waiter.cancelled():
                return
            if future.cancelled():
                waiter.cancel()
            elif (error := future.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(future.result())

        future.add_done_callback(lambda _: self.post(copy))
        return waiter


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()
_MAILBOXES_LOCK = threading.Lock()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The mailbox of ``loop`` (one per loop: TorchServe runs one for the worker's life)."""
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = LoopMailbox(loop)
        return box


async def wait_for_future(future: concurrent.futures.Future[T]) -> T:
    """Await a thread's future on the running loop, through that loop's mailbox."""
    return await mailbox_for(asyncio.get_running_loop()).wrap(future)
