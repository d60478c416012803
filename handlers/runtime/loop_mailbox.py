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
from collections.abc import Callable, Iterator
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
        """Run ``callback`` on the loop soon; wakes the loop only if nothing is waiting for it yet.

        Inside ``one_wakeup()`` on this thread the callback is held and
        posted when that block ends, with the others posted in it.
        """
        held = getattr(_HOLDING, "posts", None)
        if held is not None:
            held.setdefault(self, []).append(callback)
            return
        self._post_all([callback])

    def _post_all(self, callbacks: list[Callable[[], Any]]) -> None:
        with self._lock:
            first = not self._posted
            self._posted.extend(callbacks)
            if not first:
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
            if waiter.done():  # cancelled, or failed for its deadline (``deadlines.py``)
                return
            if future.cancelled():
                waiter.cancel()
            elif (error := future.exception()) is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(future.result())

        future.add_done_callback(lambda _: self.post(copy))
        return waiter


_HOLDING = threading.local()


@contextlib.contextmanager
def one_wakeup() -> Iterator[None]:
    """Hold what this thread posts to any mailbox until the block ends, then post it in one go.

    A batch's answers settle one future after another, and each posts its
    hand-off as it settles; the loop drains the mailbox between two of them
    and the next post wakes it again (about six wake-ups per batch of
    sixteen, sampled in Ebird on a one-layer BERT).  Settled inside this
    block, a batch costs each loop one wake-up.  Nested blocks post when
    the outermost ends.
    """
    if getattr(_HOLDING, "posts", None) is not None:
        yield
        return
    _HOLDING.posts = held = {}
    try:
        yield
    finally:
        _HOLDING.posts = None
        for mailbox, callbacks in held.items():
            mailbox._post_all(callbacks)


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
