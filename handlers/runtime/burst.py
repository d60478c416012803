"""Serve a burst of one-request messages with callbacks: no coroutine, task or asyncio future per request.

In async mode TorchServe's frontend sends the worker one message per
request, and the handler's ``handle`` is a coroutine per message: a task,
a chain of awaits (decode, admission, answer), an asyncio future for the
decoded input and one for the answer.  On a model whose batch takes a
millisecond (a tiny model on a CPU, any model on a fast GPU) that is what
the event loop spends its time on, about 40 µs per request on a 2-vCPU
Xeon against the sync worker's few µs per batch, and since the loop and the
lane running the batches share one GIL, it is what limits the handler
(``docs/benchmarks/host_path.md``).

The message pump (``worker_pump.py``) reads every message already waiting
on the socket at once and hands them to ``serve`` together.  Here each
request is a small record moved along by callbacks:

- the burst is decoded as one entry of the decoder's lane job (or one part
  per decode thread), delivered to the loop in one wake-up;
- its decoded inputs go into their engine in one call of its admission
  line (``Admission.submit_many``); those the engine has no room for wait
  in line with the per-message path's waiters, as entries of the engine's
  admission queue (``admission.py``);
- the burst is one entry of the response-timeout watch (``BurstGroup``), and
  enters and leaves the late-binding register (``arrivals.py``) at once;
- each ticket's done-callback puts its request in the loop's
  ``AnswerInbox``, which a batch's answers reach in one wake-up; the loop
  settles them in one call, their stage times and counts handed to the
  metrics once, and each answer goes to ``done``.

In a cProfile of Ebird serving a one-layer BERT to 64 closed-loop clients,
doing these steps per burst and per batch instead of per request took the
event loop from 184 to 139 function calls per request (the bench's own
clients included).

What a request sees is what ``handle`` gives it: the same decode errors and
4xx answers, the same admission order and backpressure, the response
timeout (one ``Deadlines`` watch), stage metrics, the unanswered count and
the ``Arrivals`` register that late-binding engines read.  A message that is
not one plain request (a batch of several, a describe request) goes
through ``handle`` in a task of its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from handlers.codecs import ModelInput, is_describe
from handlers.errors import ResponseError, ServiceUnavailable
from handlers.runtime.admission import FULL_FOR_THE_TIMEOUT
from handlers.runtime.engine import StageSums
from handlers.runtime.loop_mailbox import mailbox_for

logger = logging.getLogger(__name__)

Call = tuple[list[dict[str, Any]], Any]  # ``handle``'s arguments: a message's rows and its own context
Done = Callable[[int, list[Any]], None]  # called once per call, on the loop: its index and its answers


class BurstRequest:
    """One request of a burst, from receipt to its answer."""

    __slots__ = ("call", "row", "context", "reply", "server", "received", "decoded", "admitted", "arrival", "item",
                 "bind", "future", "finished", "group", "inbox")  # fmt: skip

    def __init__(self, call: int, row: dict[str, Any], context: Any, reply: Done, server: BurstServer) -> None:
        self.call = call  # its message's index in the burst
        self.row = row
        self.context = context
        self.reply = reply
        self.server = server
        self.received = self.decoded = self.admitted = 0.0
        self.arrival: int | None = None
        self.item: ModelInput | None = None
        self.bind: Callable[[ModelInput], ModelInput] | None = None  # from ``route_request``
        self.future: Any = None  # the engine's ``TicketFuture`` once admitted
        self.finished = False
        self.group: BurstGroup | None = None  # once routed
        self.inbox: AnswerInbox | None = None  # where its engine's answer goes, once admitted

    def done(self) -> bool:
        return self.finished

    def set_exception(self, error: BaseException) -> None:
        """Its deadline passed: still decoding or unanswered (``error``), or decoded and never admitted
        because its engine stayed full."""
        if self.item is not None and self.future is None:
            error = ServiceUnavailable(FULL_FOR_THE_TIMEOUT)
        self.server.finish(self, error=error)

    def refused(self, error: BaseException) -> None:
        """Its engine refused it (closing, or an input it can never take)."""
        self.server.finish(self, error=error)

    def answered(self, _future: Any) -> None:
        """Its engine answered (on the thread that ran its batch)."""
        self.inbox.put(self)


class BurstGroup:
    """A burst's requests under one ``Deadlines`` watch: they share the response timeout, counted
    from the same receipt, so one entry in the watch's queue stands for all of them.

    ``done`` and ``set_exception`` are what the watch calls on what it
    watches: at the deadline every request of the burst still unanswered
    is answered 503 (``BurstRequest.set_exception``), and its late result
    is dropped.
    """

    __slots__ = ("requests", "open")

    def __init__(self, requests: list[BurstRequest]) -> None:
        self.requests = requests
        self.open = len(requests)  # not yet answered

    def done(self) -> bool:
        return self.open == 0

    def set_exception(self, error: BaseException) -> None:
        for request in self.requests:
            if not request.finished:
                request.set_exception(error)


class AnswerInbox:
    """Admitted requests whose engine answered, handed to one event loop's ``settle`` together.

    An engine answers a batch's tickets one after another on its lane; each
    request's done-callback puts it here, and the first one of a batch posts
    the drain through the loop's mailbox (inside the batch's ``one_wakeup``,
    so the loop wakes once for it).  The loop then settles the batch's
    requests in one call: their stage times and counts go to the metrics
    once, not request by request.
    """

    def __init__(self, mailbox: Any, settle: Callable[[list[BurstRequest]], None]) -> None:
        self._lock = threading.Lock()
        self._answered: list[BurstRequest] = []
        self._mailbox = mailbox
        self._settle = settle

    def put(self, request: BurstRequest) -> None:
        """From any thread."""
        with self._lock:
            first = not self._answered
            self._answered.append(request)
        if first:
            self._mailbox.post(self._drain)

    def _drain(self) -> None:
        with self._lock:
            answered, self._answered = self._answered, []
        self._settle(answered)


class BurstServer:
    """The callback path of one ``AsyncModelHandler`` (see the module's docstring)."""

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self._tasks: set[asyncio.Task] = set()  # messages served by ``handle``
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: AnswerInbox | None = None
        self._deadlines: Any = None

    def serve(self, calls: Sequence[Call], done: Done) -> None:
        """Answer each of ``calls`` through ``done(index, answers)``, on the running loop."""
        handler = self.handler
        requests: list[BurstRequest] = []
        for index, (data, context) in enumerate(calls):
            if len(data) != 1 or handler.closing or is_describe(context):
                self._spawn(self._through_handle(index, data, context, done))
            else:
                requests.append(BurstRequest(index, data[0], context, done, self))
        if not requests:
            return
        handler.count_unanswered(len(requests))
        received = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the loop's inbox and deadline watch, made once per loop
            self._loop, self._deadlines = loop, handler.deadlines_on(loop)
            self._inbox = AnswerInbox(mailbox_for(loop), self._settle)
        # The response timeout counts from receipt, as TorchServe's does: a request whose decode or wait
        # for room outlasts it is answered 503 then, not when its decode ends.
        deadline = loop.time() + handler.response_timeout_s
        routed, decodes = [], []
        for request in requests:
            request.received = received
            try:
                decode, request.bind = handler.route_request(request.row, request.context, 0)
            except Exception as exc:  # refused by its headers (REEF: an unknown model): its own 4xx
                self.finish(request, error=exc)
                continue
            routed.append(request)
            decodes.append(decode)
        if not routed:
            return
        group = BurstGroup(routed)
        for request in routed:
            request.group = group
        if handler.arrivals is not None:
            for request, token in zip(routed, handler.arrivals.enter_many(len(routed)), strict=True):
                request.arrival = token
        self._deadlines.watch(group, deadline)
        handler.decoder.decode_burst([r.row for r in routed], functools.partial(self._decoded, routed), decodes)

    # -- the steps ------------------------------------------------------------

    def _decoded(self, requests: list[BurstRequest], first: int, outcomes: list[tuple[Any, Any]]) -> None:
        decoded = time.monotonic()
        ready = []
        for request, (item, error) in zip(requests[first : first + len(outcomes)], outcomes, strict=True):
            if request.finished:  # answered 503 at its deadline while it was decoding
                continue
            request.decoded = decoded
            if error is not None:
                self.finish(request, error=error)
                continue
            try:
                request.item = item if request.bind is None else request.bind(item)
            except Exception as exc:
                self.finish(request, error=exc)
                continue
            ready.append(request)
        if ready:
            self._admit(ready)

    def _admit(self, requests: list[BurstRequest]) -> None:
        """Admit decoded requests in order: what each engine takes now in one call
        (``Admission.submit_many``), the rest one by one into its line, to wait their turn there."""
        handler, loop = self.handler, self._loop
        lines: dict[int, tuple[Any, list[BurstRequest]]] = {}
        for request in requests:
            try:
                admission = handler.admission_of(loop, request.item)
            except ResponseError as exc:  # an input layout the archive does not declare: its own 400
                self.finish(request, error=exc)
                continue
            line = lines.get(id(admission))
            if line is None:
                line = lines[id(admission)] = (admission, [])
            line[1].append(request)
        for admission, waiting in lines.values():
            try:
                taken = admission.submit_many([request.item for request in waiting])
            except Exception as exc:  # a bug: these requests fail, the rest of the burst is served
                for request in waiting:
                    self.finish(request, error=exc)
                continue
            admitted = []
            for request, outcome in zip(waiting, taken, strict=False):  # ``taken``: a prefix of them
                if isinstance(outcome, Exception):
                    self.finish(request, error=outcome)
                else:
                    admitted.append((request, outcome))
            self._admitted(admitted)
            for request in waiting[len(taken) :]:
                admission.submit(request.item, functools.partial(self._admitted_one, request), request.refused,
                                 request.done)  # fmt: skip

    def _admitted_one(self, request: BurstRequest, future: Any) -> None:
        self._admitted([(request, future)])

    def _admitted(self, admitted: list[tuple[BurstRequest, Any]]) -> None:
        if not admitted:
            return
        handler = self.handler
        now = time.monotonic()
        encode_on_engine = handler.encode_on_engine
        left = []
        for request, future in admitted:
            request.admitted = now
            request.future = future
            request.inbox = self._inbox
            if encode_on_engine and hasattr(future, "encode"):  # a ``TicketFuture``
                future.encode = handler.encoder_for(request.item)
            if request.arrival is not None:
                left.append(request.arrival)
                request.arrival = None
            future.add_done_callback(request.answered)
        if left:
            handler.arrivals.leave_many(left)
        handler.metrics.request_admitted(len(admitted))

    def _settle(self, answered: list[BurstRequest]) -> None:
        """Answer the requests an engine answered (``AnswerInbox``), on the loop, in one call."""
        handler = self.handler
        sums = StageSums()
        replies = []
        woken = time.monotonic()
        for request in answered:
            if request.finished:  # answered 503 at its deadline already
                continue
            future = request.future
            try:
                output = future.result()
                encoded = getattr(future, "encoded", False)
                answer = output if encoded else handler.encoder_for(request.item)(output)
            except Exception as exc:
                self.finish(request, error=exc)
                continue
            sums.add(request.received, request.decoded, request.admitted, getattr(future, "times", None), woken,
                     woken if encoded else time.monotonic())  # fmt: skip
            request.finished = True
            request.group.open -= 1
            replies.append((request, answer))
        if not replies:
            return
        handler.metrics.add_stages(sums.seconds, sums.counts)
        handler.metrics.request_answered(len(replies))
        handler.count_unanswered(-len(replies))
        for request, answer in replies:
            request.reply(request.call, [answer])

    def finish(self, request: BurstRequest, answer: Any = None, error: BaseException | None = None) -> None:
        """Answer ``request`` once: its answer, or ``error`` as its own status (never the message's)."""
        if request.finished:
            return
        request.finished = True
        if request.group is not None:
            request.group.open -= 1
        handler = self.handler
        if request.arrival is not None:  # refused before admission: a held batch need not wait for it
            handler.arrivals.leave(request.arrival)
        if request.future is not None:
            handler.metrics.request_answered()
        if error is not None:
            if not isinstance(error, ResponseError):  # a bug or a device fault: this request fails
                logger.error("request failed", exc_info=error)
                error = ServiceUnavailable(f"inference failed: {type(error).__name__}: {error}")
            request_id = (getattr(request.context, "request_ids", None) or {}).get(0)
            logger.info("request %s answered %d: %s", request_id, error.status, error.reason)
            answer = error.answer(request.context, 0)
        handler.count_unanswered(-1)
        request.reply(request.call, [answer])

    # -- messages the callbacks do not take ---------------------------------

    async def _through_handle(self, index: int, data: list[dict[str, Any]], context: Any, done: Done) -> None:
        try:
            answers = await self.handler.handle(data, context)
        except Exception as exc:  # ``handle`` answers every failure itself; this is a bug
            logger.exception("handle failed")
            failure = ServiceUnavailable(f"inference failed: {type(exc).__name__}: {exc}")
            answers = [failure.answer(context, i) for i in range(len(data))]
        done(index, answers)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
