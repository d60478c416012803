"""A leaner message pump for TorchServe's async worker (``asyncCommunication: true``).

In async mode TorchServe 0.12's worker (``ts/async_service.py``) moves every
message from the frontend through three threads and its event loop, and on
the way it does work that a handler which schedules requests itself pays for
on the cores its batches run on:

- the reader thread builds ``f"Putting msg in queue: {msg}"`` for a
  ``logging.debug`` call, whether or not debug logging is on: the ``repr`` of
  the whole message, body included.  For a 72 KB JPEG that is ~0.5 ms of
  CPU per request, holding the GIL, so the thread that runs the batch stops
  at its next Python step for as long;
- ``predict`` prints ``self._entry_point=…`` to stdout once per message (one
  more log line for the frontend to read and write per request), and
  deep-copies the worker's whole context per message: its manifest, the
  archive's model-config and the metrics cache's configuration;
- a second thread forwards each message to the loop (its batch size is fixed
  at 1), and a third asks the loop for each answer in turn
  (``run_coroutine_threadsafe(out_queue.get())``): four thread hand-offs
  per request where two do.

In-process, with a 72 KB JPEG per message and no model, that pump costs
the worker 1.08 ms of CPU per message and this one 0.21
(``bench/worker_pump.py``, ``docs/benchmarks/worker_pump.md``).

``WorkerPump`` speaks the same protocol with one reader thread that hands
the loop every message already waiting on the socket in one wake-up, and
one writer thread fed by a plain queue.  A handler with ``serve_burst``
(the async handlers, ``burst.py``) takes such a burst in one call and
answers each message through a callback, without a task per message; any
other entry point gets a ``predict`` task per message.  Per message it keeps TorchServe's contract: a context of its own
(``message_context``: concurrent requests must not share request ids or
response statuses and headers), the entry point awaited once, ``PredictionTime``
recorded (once per turn of the loop for the messages answered in it, as the
sync worker records it once per batch: ``_note_prediction_time``), the
answer framed by TorchServe's own ``create_predict_response``, 507 for
``MemoryError``, the status of a ``PredictionException``, 503 for any other
failure.  A failure is each of the message's requests' own status
(``failed_message``), never the message's: TorchServe's async frontend
answers a message-level error code by failing every request it holds for
the worker, so one broken message would fail its neighbours.  When the
frontend disconnects, ``run`` returns, as TorchServe's pump does (its
reader calls ``sys.exit`` then); a reader or writer that fails otherwise
ends ``run`` with the traceback, which TorchServe's worker raises.

``install`` swaps it in for ``AsyncService.run``; the async handlers call it
from ``initialize``, which TorchServe runs before it builds its
``AsyncService``.  It does so only for the TorchServe versions whose pump it
was checked against (``CHECKED_TORCHSERVE``); on any other it leaves
TorchServe's pump and says so.  ``worker_pump: torchserve`` in the archive's
``handler:`` section keeps TorchServe's own (the benchmarks' "before").
A handler may also hand ``install`` a read gate: before reading a message
that has arrived, the reader waits there.  On a CPU the handler's lanes
close it while every lane runs a batch that a newly read request could not
join (``lanes.CpuLanes.wait_for_a_loud_lane``): the request would only be
queued on the lane, and reading and starting it would take CPU and the GIL
from the batch, as TorchServe's sync worker never does.
Streaming handlers (Orca) keep TorchServe's pump: they write intermediate
answers to the socket themselves (``send_intermediate_predict_response``),
and this pump has not been checked beside that.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.metadata
import logging
import queue
import select
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from handlers.errors import ResponseError, ServiceUnavailable

logger = logging.getLogger(__name__)

LEAN = "lean"
TORCHSERVE = "torchserve"
PUMPS = (LEAN, TORCHSERVE)
CHECKED_TORCHSERVE = ("0.12.0",)
PREDICTION_FAILED = "Prediction failed"  # a failure's reason, as TorchServe words it
# At most this many waiting messages are read before the loop gets them: a burst's decode and
# admission run in one turn of the loop, and a much longer turn would delay the answers it delivers.
MAX_BURST = 64


def parse_worker_pump(value: Any) -> str:
    """The archive's ``worker_pump`` setting: ``lean`` (the default) or ``torchserve``."""
    if value is None:
        return LEAN
    if value not in PUMPS:
        raise ValueError(f"worker_pump must be one of {', '.join(PUMPS)}, got {value!r}")
    return value


def install(setting: Any, read_gate: Callable[[], Any] | None = None) -> bool:
    """Make TorchServe's async worker in this process run ``WorkerPump``; True if it will.

    ``setting``: the archive's ``worker_pump`` (None: lean), validated here.
    ``read_gate``: called before each message is read, which waits until it returns.

    Outside a TorchServe worker (a handler driven directly) nothing builds an
    ``AsyncService``, so installing changes nothing there.
    """
    if parse_worker_pump(setting) != LEAN:
        return False
    try:
        import ts.async_service as ts_async

        version = importlib.metadata.version("torchserve")
    except (ImportError, importlib.metadata.PackageNotFoundError):
        return False
    if version not in CHECKED_TORCHSERVE:
        logger.warning(
            "TorchServe %s: keeping its own async message pump (the lean one was checked against %s)",
            version,
            ", ".join(CHECKED_TORCHSERVE),
        )
        return False

    def run(async_service: Any) -> str | None:
        """``AsyncService.run``'s stand-in: the same service, served by ``WorkerPump``."""
        return WorkerPump(async_service.service, read_gate).run()

    ts_async.AsyncService.run = run
    return True


class WorkerPump:
    """Frontend messages in, answers out, for one TorchServe ``Service`` in async mode."""

    def __init__(self, service: Any, read_gate: Callable[[], Any] | None = None) -> None:
        self.service = service
        self.read_gate = read_gate
        self._answers: queue.SimpleQueue[bytes | bytearray] = queue.SimpleQueue()
        self._tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks
        self._prediction_times: list[tuple[Any, float]] = []  # answered in this turn of the loop, not yet recorded

    def run(self) -> str | None:
        """Serve until the frontend disconnects (None) or the reader or writer fails (its traceback)."""
        return asyncio.run(self._main())

    async def _main(self) -> str | None:
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[str | None] = loop.create_future()

        def fail(text: str | None) -> None:  # from the reader or the writer thread
            def settle() -> None:
                if not failed.done():
                    failed.set_result(text)

            with contextlib.suppress(RuntimeError):  # the loop has closed: the pump has already ended
                loop.call_soon_threadsafe(settle)

        for target, name in ((self._read, "ts-pump-reader"), (self._write, "ts-pump-writer")):
            threading.Thread(target=target, args=(loop, fail), name=name, daemon=True).start()
        return await failed

    def _read(self, loop: asyncio.AbstractEventLoop, fail: Any) -> None:
        from ts.protocol.otf_message_handler import retrieve_msg

        sock = self.service.cl_socket
        try:
            while True:
                if self.read_gate is not None:
                    select.select([sock], [], [])  # a message (or the frontend's close) is waiting
                    self.read_gate()
                burst = []
                while True:  # every message already waiting: handed to the loop in one wake-up
                    command, message = retrieve_msg(sock)
                    if command == b"I":
                        burst.append(message)
                    else:
                        logger.warning("async worker: ignoring frontend command %r", command)
                    if len(burst) >= MAX_BURST or not select.select([sock], [], [], 0)[0]:
                        break
                if burst:
                    loop.call_soon_threadsafe(self._start_burst, burst)
        except SystemExit:  # TorchServe's reader exits so when the frontend disconnects: a clean end
            fail(None)
        except Exception:  # a corrupt frame: the worker must end
            fail(traceback.format_exc())

    def _write(self, loop: asyncio.AbstractEventLoop, fail: Any) -> None:
        try:
            while True:
                self.service.cl_socket.sendall(self._answers.get())
        except Exception:
            fail(traceback.format_exc())

    def _start_burst(self, messages: list[list[dict[str, Any]]]) -> None:
        """Messages read together: to the handler's ``serve_burst`` at once when it has one, else one
        ``predict`` task each (TorchServe's contract for any entry point)."""
        serve_burst = getattr(getattr(self.service._entry_point, "__self__", None), "serve_burst", None)
        if serve_burst is None:
            for message in messages:
                self._start(message)
            return
        calls, framing = [], []
        for message in messages:
            try:
                rows, context = self._message_call(message)
            except Exception:  # a frame that cannot be read: 503 for each id it names, as ``_answer`` does
                logger.exception("async worker: could not read a message")
                if (response := self._failure_response(message)) is not None:
                    self._answers.put(response)
                continue
            calls.append((rows, context))
            framing.append((context, time.time()))
        answered = [False] * len(calls)

        def done(index: int, answers: list[Any]) -> None:
            answered[index] = True
            context, started = framing[index]
            response = self._framed(answers, len(calls[index][0]), context, started)
            if response is not None:
                self._answers.put(response)

        try:
            serve_burst(calls, done)
        except Exception:  # a handler bug: what it has not answered gets 503, the worker serves on
            logger.exception("async worker: the handler failed a burst of %d message(s)", len(calls))
            for index, (_, context) in enumerate(calls):
                if not answered[index]:
                    self._answers.put(failed_message(context, ServiceUnavailable(PREDICTION_FAILED)))

    def _start(self, message: list[dict[str, Any]]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, message: list[dict[str, Any]]) -> None:
        try:
            response = await self.predict(message)
        except Exception:  # a frame ``predict`` could not read or answer: 503 for each id it names
            logger.exception("async worker: could not answer a message")
            response = self._failure_response(message)
        if response is not None:  # None: a rank other than 0 of a distributed worker, which never answers
            self._answers.put(response)

    async def predict(self, message: list[dict[str, Any]]) -> bytes | bytearray | None:
        """One message's answer, framed for the frontend (TorchServe's ``predict`` contract)."""
        from ts.service import PredictionException

        rows, context = self._message_call(message)
        started = time.time()
        try:
            answers = await self.service._entry_point(rows, context)
        except MemoryError:
            logger.exception("async worker: out of memory")
            return failed_message(context, ResponseError(507, "Out of resources"))
        except PredictionException as exc:
            logger.exception("async worker: prediction error")
            code = exc.error_code if isinstance(exc.error_code, int) and 400 <= exc.error_code < 600 else 500
            return failed_message(context, ResponseError(code, exc.message))
        except Exception:
            logger.exception("async worker: the handler failed")
            return failed_message(context, ServiceUnavailable(PREDICTION_FAILED))
        return self._framed(answers, len(rows), context, started)

    def _failure_response(self, message: list[dict[str, Any]]) -> bytes | None:
        """503 for every request of a message that could not be read or answered whose id can be read,
        so none waits for its timeout (None: no id readable)."""
        from ts.context import RequestProcessor

        request_ids = {}
        for index, row in enumerate(message):
            with contextlib.suppress(AttributeError, KeyError, TypeError, UnicodeDecodeError):
                request_ids[index] = row["requestId"].decode("utf-8")
        if not request_ids:
            return None
        context = self._context_for(request_ids, [RequestProcessor({}) for _ in range(max(request_ids) + 1)])
        return failed_message(context, ServiceUnavailable(PREDICTION_FAILED))

    def _message_call(self, message: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
        """A message's rows and its own context, as the entry point takes them."""
        from ts.service import Service

        headers, rows, request_ids = Service.retrieve_data_for_inference(message)
        return rows, self._context_for(request_ids, headers)

    def _context_for(self, request_ids: dict[int, str], processors: list[Any]) -> Any:
        """A message's own context (``message_context``) naming its requests: their ids, and one request
        processor each (headers, and the status its answer gets)."""
        context = message_context(self.service.context)
        context.request_ids = request_ids
        context.request_processor = processors
        context.cl_socket = self.service.cl_socket
        if context.metrics is not None:
            context.metrics.request_ids = request_ids
        return context

    def _framed(self, answers: Any, count: int, context: Any, started: float) -> bytes | bytearray | None:
        """A message's answers framed for the frontend, its prediction time noted (``_note_prediction_time``);
        503 for each of its requests if the handler did not answer one per request."""
        if not isinstance(answers, list) or len(answers) != count:
            logger.error("async worker: the handler answered %r for %d request(s)", type(answers), count)
            return failed_message(context, ServiceUnavailable("Invalid model predict output"))
        if context.metrics is not None:
            self._note_prediction_time(context, (time.time() - started) * 1000)
        return framed_final(answers, context)

    def _note_prediction_time(self, context: Any, ms: float) -> None:
        """Record ``PredictionTime`` once per turn of the loop: the mean of the messages answered in it.

        TorchServe's async pump records it per message, the sync worker per
        batch.  Each record is a metric line logged to the worker's stdout,
        which the frontend reads and parses; per message, that line was more
        than half of this pump's CPU per message (100 against 43 µs with a
        handler that does nothing, ``bench/worker_pump.py``), and in the
        host-bound regime the pump's threads take that time from the batches.
        The answers framed in one turn are mostly those of one batch, so this
        records about what the sync worker would.
        """
        pending = self._prediction_times
        pending.append((context, ms))
        if len(pending) == 1:
            asyncio.get_running_loop().call_soon(self._record_prediction_times)

    def _record_prediction_times(self) -> None:
        from ts.service import PREDICTION_METRIC

        pending, self._prediction_times = self._prediction_times, []
        if not pending:
            return
        try:
            pending[0][0].metrics.add_time(PREDICTION_METRIC, round(sum(ms for _, ms in pending) / len(pending), 2))
        except Exception:  # a metric must not fail the answers it describes
            logger.exception("async worker: recording PredictionTime failed")


def message_context(shared: Any) -> Any:
    """One message's own ``Context``: what a message writes is its own, the model's settings are shared.

    A message writes its request ids, its request processors (each request's
    response status and headers; ``retrieve_data_for_inference`` makes new
    ones per message) and the request ids its metrics are tagged with.  So a
    shallow copy of the context and of its metrics cache keeps concurrent
    messages apart, as TorchServe's deep copy does; the manifest, system
    properties, ``model_yaml_config`` and metric definitions stay shared and
    are only read (no handler here writes them per request).  TorchServe's
    deep copy of all of it was ~40 % of the event loop's py-spy samples in a
    live Ebird worker (ResNet-50, 8 requests/s, 2-core VM).
    """
    context = _shallow_copy(shared)
    if shared.metrics is not None:
        context.metrics = _shallow_copy(shared.metrics)
    return context


_PLAIN_TYPES: dict[type, bool] = {}  # per class: whether ``_shallow_copy`` may copy its instances' ``__dict__``


def _shallow_copy(obj: Any) -> Any:
    """``copy.copy`` for a plain object (no slots, no ``__copy__``): its attributes' references in a new
    instance, a quarter of ``copy.copy``'s time (which goes through ``__reduce_ex__``), once per message."""
    cls = type(obj)
    plain = _PLAIN_TYPES.get(cls)
    if plain is None:
        plain = _PLAIN_TYPES[cls] = (
            not hasattr(cls, "__copy__") and not hasattr(cls, "__slots__") and hasattr(obj, "__dict__")
        )
    if not plain:
        return copy.copy(obj)
    clone = object.__new__(cls)
    clone.__dict__.update(obj.__dict__)
    return clone


def framed_final(answers: list[Any], context: Any) -> bytes:
    """A message's answers framed so that TorchServe's frontend forgets each request once answered.

    In async mode TorchServe 0.12's frontend keeps every request it sent a
    worker in a map (``AsyncBatchAggregator.jobs_in_backend``) and removes
    one only when an answer to it carries ``ts_stream_next: false``: the end
    of a streamed answer.  A plain answer left its request in the map for
    good, body included: the frontend's heap held a live ``RestJob`` per
    request ever answered (counted with ``jcmd``), and the map, which the
    frontend's worker thread writes and its network thread reads without a
    lock, kept growing and rehashing until a lookup missed under load: the
    frontend then took an answer for a request it did not know
    ("Unexpected job in sendResponse()"), closed the worker's connection and
    restarted it over and over (seen under ``bench/dvabatch.py``).

    The end marker cannot ride on the answer itself: TorchServe's REST side
    sends an answer's status line only with a stream's first part, so an
    answer marked as its stream's end and first part at once never reaches
    the client.  So each answer goes as a stream of one part and an empty
    end, frames written together, as TorchServe streams: the client gets the
    same status, headers and body, chunked.  Except an error answer (status
    400 and up): TorchServe closes the connection after an error's status
    line, so a streamed one would lose its body.  It goes whole, and then an
    empty end marked ``ts_stream_next: false`` follows it: the frontend
    forgets the request on that end, and what it would write for it (an
    empty last chunk) goes to a connection it is closing, after a response
    whose length it already sent, so the client sees the error alone.
    """
    from ts.protocol.otf_message_handler import create_predict_response

    streamed, whole, errors = _split_by_status(context)
    out = bytearray()
    if whole:  # errors, and the last part of an answer already streaming (framed as its stream's end)
        out += create_predict_response(answers, whole, "Prediction success", 200, context)
    if errors:  # their requests' ends, set after the errors were framed without them
        for index in errors:
            context.set_response_header(index, "ts_stream_next", "false")
        out += create_predict_response([b""] * len(answers), errors, "Prediction success", 200, context)
    if streamed:
        # ``ts_stream_next=True`` marks each answer a stream's part; framing the empty end after it turns the
        # marker to "false" (TorchServe's ``send_intermediate_predict_response`` and final answer do the same).
        out += create_predict_response(answers, streamed, "Prediction success", 200, context, True)
        out += create_predict_response([b""] * len(answers), streamed, "Prediction success", 200, context)
    return bytes(out)


def _split_by_status(context: Any) -> tuple[dict[int, str], dict[int, str], dict[int, str]]:
    """The message's request ids (index → id) whose answers go as one-part streams (status below 400, or
    none set); those framed as they are: errors, and answers whose stream a handler began itself (their
    last part, which TorchServe's framing marks as the stream's end); and, of those, the errors."""
    streamed, whole, errors = {}, {}, {}
    for index, request_id in context.request_ids.items():
        status, _ = context.get_response_status(index)
        began = context.get_response_headers(index).get("ts_stream_next") == "true"
        failed = not began and status is not None and status >= 400
        (whole if began or failed else streamed)[index] = request_id
        if failed:
            errors[index] = request_id
    return streamed, whole, errors


def answered_as_streams(answers: list[Any], context: Any) -> list[Any]:
    """What ``handle`` returns under TorchServe's own pump for the effect of ``framed_final``.

    That pump frames ``handle``'s answers as they are, so the handler sends
    each answer below status 400 that is not already streaming as a
    stream's part itself (TorchServe's ``send_intermediate_predict_response``)
    and returns an empty end for it; TorchServe marks every returned answer
    that follows a part as its stream's end.  Error answers, and a streamed
    answer's last part, are returned as they are.
    """
    from ts.handler_utils.utils import send_intermediate_predict_response

    streamed, _, _ = _split_by_status(context)
    if not streamed:
        return answers
    send_intermediate_predict_response(answers, streamed, "Intermediate response", 200, context)
    return [b"" if i in streamed else answer for i, answer in enumerate(answers)]


def failed_message(context: Any, error: ResponseError) -> bytes:
    """Every request of a message answered ``error`` as its own status, framed as ``framed_final``
    frames an error (whole, then its end), in a frame whose own code is 200.

    TorchServe's async frontend reads a frame's code as the message's: on
    anything but 200 it fails every request it holds for this worker
    (``AsyncBatchAggregator.sendResponse``), not only the message's, so
    a handler that broke on one message would fail each request other
    clients had in flight beside it.  Framed per request, only the
    message's own requests get the error, and the frontend forgets them at
    their ends.
    """
    answers: list[Any] = [b""] * (max(context.request_ids, default=-1) + 1)
    for index in context.request_ids:
        answers[index] = error.answer(context, index)
    return framed_final(answers, context)
