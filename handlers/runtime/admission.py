"""FIFO admission into one engine, with backpressure while it is full: a queue of callbacks.

An engine has room for so many inputs (Ebird's pool slots, DVABatch's
``max_inflight``); a request that finds it full waits, in arrival order,
until a batch ends and frees room, or until its response timeout.

Waiting used to be a coroutine per request: a task, an ``asyncio.Lock`` to
keep the order, an event for the room and ``asyncio.wait_for`` around each
wait on it.  Under Poisson arrivals the engine fills at moderate loads (a
burst that lands while the lanes run batches), and then every request
took that path: on a one-layer BERT on a 2-vCPU VM Ebird's event loop
spent twice as long per request in an open loop as in a closed one, and
Ebird stopped keeping up at about 60 % of the rate it sustained with 64
clients in a closed loop (``docs/benchmarks/host_path.md``).  Here a
waiting request is an entry in a deque: when an engine thread says room
appeared, one callback on the event loop admits the waiting entries in
order until the engine is full again; each is told through its own
callbacks.  The coroutine form (``admit``) is a future on top of that.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

from handlers.codecs import ModelInput
from handlers.errors import ServiceUnavailable
from handlers.runtime.engine import Engine
from handlers.runtime.loop_mailbox import mailbox_for
from handlers.runtime.metrics import HandlerMetrics

FULL_FOR_THE_TIMEOUT = "input pool stayed full for the whole response timeout; retry later"

Admitted = Callable[[Any], None]  # called with the engine's future for the input
Failed = Callable[[BaseException], None]  # called with the reason the engine refused the input


class _Waiting:
    __slots__ = ("item", "admitted", "failed", "gone")

    def __init__(self, item: ModelInput, admitted: Admitted, failed: Failed, gone: Callable[[], bool]) -> None:
        self.item, self.admitted, self.failed, self.gone = item, admitted, failed, gone


class Admission:
    """The admission line into one engine on one event loop (every method runs on that loop)."""

    def __init__(self, engine: Engine, metrics: HandlerMetrics, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.metrics = metrics
        self._waiting: collections.deque[_Waiting] = collections.deque()
        post = mailbox_for(loop).post
        admit_waiting = self._admit_waiting
        # From engine threads, as a batch's room frees: one loop wake-up with the batch's answers.
        engine.on_space(lambda: post(admit_waiting))

    @property
    def waiting(self) -> int:
        """Requests waiting for room, including any whose request has gone since."""
        return len(self._waiting)

    def submit(self, item: ModelInput, admitted: Admitted, failed: Failed, gone: Callable[[], bool]) -> None:
        """Admit ``item``: at once if nobody waits ahead of it and the engine has room, else in turn.

        ``admitted(future)`` or ``failed(error)`` is called exactly once,
        now or later on this loop, unless ``gone()`` is true by the time the
        input's turn comes (its request was answered otherwise, at its
        deadline): then neither, and the engine never sees the input.  An
        input the engine refuses (``try_submit`` raises) goes to ``failed``.
        """
        if not self._waiting:
            try:
                future = self.engine.try_submit(item)
            except Exception as exc:
                failed(exc)
                return
            if future is not None:
                admitted(future)
                return
        self.metrics.admission_waited()
        self._waiting.append(_Waiting(item, admitted, failed, gone))

    def _admit_waiting(self) -> None:
        """Admit waiting inputs in arrival order until the engine is full again."""
        waiting = self._waiting
        while waiting:
            head = waiting[0]
            if head.gone():
                waiting.popleft()
                continue
            try:
                future = self.engine.try_submit(head.item)
            except Exception as exc:  # closing, or an input it can never take
                waiting.popleft()
                head.failed(exc)
                continue
            if future is None:
                return
            waiting.popleft()
            head.admitted(future)

    async def admit(self, item: ModelInput, deadline: float) -> Any:
        """The engine's future for ``item`` once admitted; a 503 if the engine stays full until
        ``deadline`` (the loop's time)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()

        def admitted(future: Any) -> None:
            waiter.set_result(future)

        def failed(error: BaseException) -> None:
            waiter.set_exception(error)

        self.submit(item, admitted, failed, waiter.done)
        if waiter.done():
            return waiter.result()
        try:
            return await asyncio.wait_for(waiter, max(deadline - loop.time(), 0.0))
        except TimeoutError:
            raise ServiceUnavailable(FULL_FOR_THE_TIMEOUT) from None
