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
- each decoded input goes straight into its engine (``try_submit``); when
  the engine is full it waits in line with the per-message path's waiters,
  as an entry of the engine's admission queue (``admission.py``);
- the engine's future calls back through the loop's mailbox, so a batch's
  answers reach the loop in one wake-up; each answer then goes to ``done``;
- what is the same for every request of a burst or of a turn of the loop
  is done once: a burst enters the arrivals register and the deadline
  watch together, and a turn's answers hand their stage times to the
  metrics (``stage_tally.py``) and lower the unanswered count at its end.

Where the handler's engine takes rows (``row_engine``: one input layout,
decoding and encoding on the CPU lanes), the steps between receipt and
answer collapse: the burst goes to the engine whole and undecoded, and each
batch comes back decoded, run and encoded by its lane in one callback
(``row_intake.py``).  The loop then only records, watches and answers.
Engines picked by the decoded layout share a ``RowLine`` instead
(``row_line.py``), and a handler that routes each request hands over those
its engine takes (``Engine.takes_routed``: REEF's real-time ones) with
their own decode and bind, the rest taking the admission path.

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
import time
from collections.abc import Callable, Sequence
from typing import Any

from handlers.codecs import ModelInput, is_describe
from handlers.errors import ResponseError, ServiceUnavailable, inference_failed
from handlers.runtime.admission import FULL_FOR_THE_TIMEOUT
from handlers.runtime.loop_mailbox import mailbox_for
from handlers.runtime.row_intake import BatchTimes, RowBatches
from handlers.runtime.stage_tally import StageTally

logger = logging.getLogger(__name__)

Call = tuple[list[dict[str, Any]], Any]  # ``handle``'s arguments: a message's rows and its own context
Done = Callable[[int, list[Any]], None]  # called once per call, on the loop: its index and its answers
TAKEN = object()  # a ``BurstRequest.future`` for a request its engine took undecoded (``row_intake.py``)


class BurstRequest:
    """One request of a burst, from receipt to its answer.

    ``done`` and ``set_exception`` let ``Deadlines`` watch it as it watches
    an asyncio future: a request still unanswered at its deadline is
    answered 503 then, and its late result is dropped.  ``admitted``,
    ``refused`` and ``done`` are what its admission line calls back, and
    ``answered`` what its engine's future calls back: bound methods of the
    request itself, where a ``functools.partial`` and a lambda were made
    per request before.
    """

    __slots__ = ("call", "row", "context", "reply", "server", "received", "decoded", "admitted_at", "arrival",
                 "item", "bind", "decode", "future", "finished")  # fmt: skip

    def __init__(
        self, call: int, row: dict[str, Any], context: Any, reply: Done, server: BurstServer, received: float
    ) -> None:
        self.call = call  # its message's index in the burst
        self.row = row
        self.context = context
        self.reply = reply
        self.server = server
        self.received = received
        self.decoded = self.admitted_at = 0.0
        self.arrival: int | None = None
        self.item: ModelInput | None = None
        self.bind: Callable[[ModelInput], ModelInput] | None = None  # from ``route_request``
        self.decode: Callable[[dict[str, Any]], ModelInput] | None = None  # its own, when taken undecoded
        self.future: Any = None  # the engine's ``TicketFuture`` once admitted (``TAKEN``: taken undecoded)
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def set_exception(self, error: BaseException) -> None:
        """Its deadline passed: still decoding or unanswered (``error``), or decoded and never admitted
        because its engine stayed full."""
        if self.item is not None and self.future is None:
            error = ServiceUnavailable(FULL_FOR_THE_TIMEOUT)
        self.server.finish(self, error=error)

    def admitted(self, future: Any) -> None:
        """Its engine took it: ``future`` will hold its output row (or its answer, encoded there)."""
        self.server._admitted(self, future)

    def refused(self, error: BaseException) -> None:
        """Its engine refused it (closing, or an input it can never take)."""
        self.server.finish(self, error=error)

    def answered(self, _future: Any) -> None:
        """Its engine settled its future (on the engine's thread): on to the loop, with its batch."""
        self.server._mailbox.post(self.settled)

    def settled(self) -> None:
        self.server._settled(self)


class BurstServer:
    """The callback path of one ``AsyncModelHandler`` (see the module's docstring)."""

    def __init__(self, handler: Any, routes: bool = True, row_engine: Any = None) -> None:
        self.handler = handler
        # Whether requests are routed one by one (``route_request``: REEF picks a member by its headers);
        # False for a handler whose requests all take its own decoder and are bound to nothing.
        self.routes = routes
        # The engine that takes every burst undecoded (``row_intake.py``), or None: decode, then admission.
        self.row_engine = row_engine
        self._row_batches: RowBatches | None = None
        self._tasks: set[asyncio.Task] = set()  # messages served by ``handle``
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mailbox: Any = None
        self._deadlines: Any = None
        self._tally: StageTally | None = None
        self._answered = 0  # requests answered in this turn of the loop (``_note_answered``)
        self._answered_admitted = 0  # of which admitted into an engine

    def serve(self, calls: Sequence[Call], done: Done) -> None:
        """Answer each of ``calls`` through ``done(index, answers)``, on the running loop."""
        handler = self.handler
        requests: list[BurstRequest] = []
        received = time.monotonic()
        for index, (data, context) in enumerate(calls):
            if len(data) != 1 or handler.closing or is_describe(context):
                self._spawn(self._through_handle(index, data, context, done))
            else:
                requests.append(BurstRequest(index, data[0], context, done, self, received))
        if not requests:
            return
        handler.count_unanswered(len(requests))
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # the loop's mailbox and deadline watch, looked up once per loop
            self._loop, self._mailbox, self._deadlines = loop, mailbox_for(loop), handler.deadlines_on(loop)
            self._tally = StageTally(handler.metrics, loop)
            if self.row_engine is not None:
                self._row_batches = RowBatches(handler.decoder.decode, self.row_engine.fits, handler.encoder_for,
                                               handler.metrics, self._mailbox, self._rows_answered)  # fmt: skip
        # The response timeout counts from receipt, as TorchServe's does: a request whose decode or wait
        # for room outlasts it is answered 503 then, not when its decode ends.
        deadline = loop.time() + handler.response_timeout_s
        if self.routes:
            routed, decodes = [], []
            for request in requests:
                try:
                    decode, request.bind = handler.route_request(request.row, request.context, 0)
                except Exception as exc:  # refused by its headers (REEF: an unknown model): its own 4xx
                    self.finish(request, error=exc)
                    continue
                routed.append(request)
                decodes.append(decode)
            if not routed:
                return
        else:  # the handler's own decoder for every request, and nothing to bind
            routed, decodes = requests, None
        if self._row_batches is not None:
            if decodes is None:
                self._take(routed, deadline)
                return
            routed, decodes = self._take_routed(routed, decodes, deadline)
            if not routed:
                return
        if handler.arrivals is not None:
            for request, token in zip(routed, handler.arrivals.enter_many(len(routed)), strict=True):
                request.arrival = token
        self._deadlines.watch_many(routed, deadline)
        handler.decoder.decode_burst([r.row for r in routed], functools.partial(self._decoded, routed), decodes)

    # -- requests taken undecoded --------------------------------------------

    def _take(self, requests: list[BurstRequest], deadline: float) -> None:
        """Hand the burst to its engine whole: it decodes, runs and encodes each batch on a lane."""
        self._deadlines.watch_many(requests, deadline)
        for request in requests:
            request.future = TAKEN
        self.handler.metrics.requests_admitted(len(requests))
        try:
            self.row_engine.take_rows(requests, self._row_batches)
        except Exception as exc:  # closing: each request gets its 503
            for request in requests:
                self.finish(request, error=exc)

    def _take_routed(
        self, requests: list[BurstRequest], decodes: list[Any], deadline: float
    ) -> tuple[list[BurstRequest], list[Any]]:
        """Hand the engine the routed requests it takes undecoded (``Engine.takes_routed``: REEF's
        real-time ones), each with its own decode and bind; the rest, and their decodes, to admit."""
        taken, rest, rest_decodes = [], [], []
        for request, decode in zip(requests, decodes, strict=True):
            if self.row_engine.takes_routed(request.bind):
                request.decode = decode
                taken.append(request)
            else:
                rest.append(request)
                rest_decodes.append(decode)
        if taken:
            self._take(taken, deadline)
        return rest, rest_decodes

    def _rows_answered(
        self, requests: list[BurstRequest], answers: list[Any], errors: dict[int, BaseException], times: BatchTimes
    ) -> None:
        """A batch of taken requests is done (on the loop): each one's answer, or its own error."""
        woken = time.monotonic()
        for index, request in enumerate(requests):
            if request.finished:  # answered 503 at its deadline already
                continue
            error = errors.get(index)
            if error is None and answers[index] is None:  # skipped on the lane, yet unanswered: never expected
                error = ServiceUnavailable("the request was dropped from its batch")
            if error is not None:
                self.finish(request, error=error)
                continue
            self._tally.add_taken(request.received, times, woken, time.monotonic())
            self.finish(request, answer=answers[index])

    # -- the steps ------------------------------------------------------------

    def _decoded(self, requests: list[BurstRequest], first: int, outcomes: list[tuple[Any, Any]]) -> None:
        decoded = time.monotonic()
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
            self._admit(request)

    def _admit(self, request: BurstRequest) -> None:
        try:
            admission = self.handler.admission_of(self._loop, request.item)
        except ResponseError as exc:  # an input layout the archive does not declare: its own 400
            self.finish(request, error=exc)
            return
        admission.submit(request.item, request.admitted, request.refused, request.done)

    def _admitted(self, request: BurstRequest, future: Any) -> None:
        handler = self.handler
        request.admitted_at = time.monotonic()
        request.future = future
        if handler.encodes_on_engine(request.item) and hasattr(future, "encode"):  # a ``TicketFuture``
            future.encode = handler.encoder_for(request.item)
        if request.arrival is not None:
            handler.arrivals.leave(request.arrival)
            request.arrival = None
        handler.metrics.request_admitted()
        future.add_done_callback(request.answered)

    def _settled(self, request: BurstRequest) -> None:
        if request.finished:  # answered 503 at its deadline already
            return
        future = request.future
        woken = time.monotonic()
        try:
            output = future.result()
            encoded = getattr(future, "encoded", False)
            answer = output if encoded else self.handler.encoder_for(request.item)(output)
        except Exception as exc:
            self.finish(request, error=exc)
            return
        times = getattr(future, "times", None)
        self._tally.add(request.received, request.decoded, request.admitted_at, times, woken, time.monotonic())
        self.finish(request, answer=answer)

    def finish(self, request: BurstRequest, answer: Any = None, error: BaseException | None = None) -> None:
        """Answer ``request`` once: its answer, or ``error`` as its own status (never the message's)."""
        if request.finished:
            return
        request.finished = True
        handler = self.handler
        if request.arrival is not None:  # refused before admission: a held batch need not wait for it
            handler.arrivals.leave(request.arrival)
        if error is not None:
            if not isinstance(error, ResponseError):  # a bug or a device fault: this request fails
                logger.error("request failed", exc_info=error)
                error = inference_failed(error)
            request_id = (getattr(request.context, "request_ids", None) or {}).get(0)
            logger.info("request %s answered %d: %s", request_id, error.status, error.reason)
            answer = error.answer(request.context, 0)
        self._note_answered(request.future is not None)
        request.reply(request.call, [answer])

    def _note_answered(self, admitted: bool) -> None:
        """Count one more answer of this turn of the loop; the counts drop once at its end (``_end_turn``)."""
        self._answered += 1
        self._answered_admitted += admitted
        if self._answered == 1:
            self._loop.call_soon(self._end_turn)

    def _end_turn(self) -> None:
        """The unanswered count and the in-flight gauge, down by this turn's answers at once: one publication
        per turn (``unanswered_changed``: Packrat's plan handler writes it to shared memory) instead of one
        per request.  Meanwhile both read a little high, which only makes a drain wait the longer for them."""
        answered, admitted = self._answered, self._answered_admitted
        self._answered = self._answered_admitted = 0
        if admitted:
            self.handler.metrics.requests_answered(admitted)
        self.handler.count_unanswered(-answered)

    # -- messages the callbacks do not take ---------------------------------

    async def _through_handle(self, index: int, data: list[dict[str, Any]], context: Any, done: Done) -> None:
        try:
            answers = await self.handler.handle(data, context)
        except Exception as exc:  # ``handle`` answers every failure itself; this is a bug
            logger.exception("handle failed")
            failure = inference_failed(exc)
            answers = [failure.answer(context, i) for i in range(len(data))]
        done(index, answers)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
