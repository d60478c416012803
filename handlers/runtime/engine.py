"""What a scheduling handler's engine promises the runtime.

An engine owns the policy and the mechanism (memory, workers, streams) of
one paper.  The runtime only admits inputs and awaits answers: every input
the engine accepts gets its future settled exactly once, with the model's
output row or an exception, even when the engine is closed.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from handlers.codecs import ModelInput
from handlers.errors import ServiceUnavailable, encode_failed, shut_down
from handlers.runtime.loop_mailbox import one_wakeup

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StageTimes:
    """When one request passed each point inside the engine (``time.monotonic``).

    The runtime turns these into its per-request time breakdown
    (``HandlerMetrics.stage``): queue = started - arrived, batch = finished -
    started, release = settled - finished; None where a point was not reached.
    """

    arrived: float = field(default_factory=time.monotonic)
    started: float | None = None  # its batch began
    finished: float | None = None  # its batch's output was on the host
    settled: float | None = None  # its future was answered
    encode_seconds: float = 0.0  # spent encoding its answer before settling (``TicketFuture.encode``)


def stage_breakdown(
    received: float, decoded: float, admitted: float, times: StageTimes | None, woken: float, answered: float
) -> dict[str, float]:
    """One request's seconds per stage, from its timestamps (see ``HandlerMetrics``).

    An engine that does not report its inner times gets them as one
    ``engine`` stage (admitted → woken).
    An answer encoded where its batch finished (``TicketFuture.encode``)
    counts that time as ``encode``, not ``release``.
    """
    stages = {"decode": decoded - received, "admission": admitted - decoded}
    encoded = times.encode_seconds if times is not None else 0.0
    if times is None or None in (times.started, times.finished, times.settled):
        stages["engine"] = woken - admitted - encoded
    else:
        stages.update(
            queue=times.started - times.arrived,
            batch=times.finished - times.started,
            release=times.settled - times.finished - encoded,
            wakeup=woken - times.settled,
        )
    stages["encode"] = answered - woken + encoded
    return {k: max(0.0, v) for k, v in stages.items()}


class RowsEncoder:
    """Turns several output rows into their answers in one call: a batch's torch work once.

    The handler sets one as a ticket's ``encode`` for requests that share a
    wire format; ``settle_batch`` then encodes every such ticket of a batch
    together (``codecs.encode_outputs``).  Called with one row, it encodes
    that row alone.
    """

    def __init__(self, encode_rows: Callable[[torch.Tensor], list[Any]]) -> None:
        self.encode_rows = encode_rows

    def __call__(self, row: torch.Tensor) -> Any:
        return self.encode_rows(row.unsqueeze(0))[0]


@dataclass
class EncodedGroup:
    """The answers of a batch's rows that share one ``RowsEncoder``, encoded in one call."""

    positions: list[int]  # the rows' positions in the batch, in order
    answers: list[Any] | None  # one per position; None where ``error`` is set
    error: ServiceUnavailable | None
    seconds_per_row: float


def encode_together(encoders: Sequence[Any], outputs: torch.Tensor) -> tuple[list[int], list[EncodedGroup]]:
    """Encode a batch's output rows, one call per ``RowsEncoder``, the batch's torch work once.

    ``encoders[i]`` is row i's; a row whose encoder is not a ``RowsEncoder``
    (an Open Inference Protocol request, a subclass's ``postprocess``, or
    None) is left to its caller: its position comes back in the first list,
    to encode on its own.  A group whose call raises fails as a whole with
    a 503, logged once; the batch's other rows are unaffected.
    """
    alone: list[int] = []
    shared: dict[int, tuple[RowsEncoder, list[int]]] = {}
    for position, encode in enumerate(encoders):
        if isinstance(encode, RowsEncoder):
            shared.setdefault(id(encode), (encode, []))[1].append(position)
        else:
            alone.append(position)
    groups = []
    for encoder, positions in shared.values():
        started = time.monotonic()
        try:
            rows = outputs if len(positions) == len(encoders) else outputs[positions]
            answers, error = encoder.encode_rows(rows), None
        except Exception as exc:  # these requests fail, the engine serves on
            logger.exception("encoding %d answers of a batch failed", len(positions))
            answers, error = None, encode_failed(exc)
        groups.append(EncodedGroup(positions, answers, error, (time.monotonic() - started) / len(positions)))
    return alone, groups


class TicketFuture:
    """A request's future, carrying its ``StageTimes`` to whoever awaits it.

    Set once, by the engine thread that ran the request's batch; read on the
    event loop through ``add_done_callback``, or by a thread blocking in
    ``result``.  It keeps ``concurrent.futures.Future``'s methods that
    callers use (``done``, ``result``, ``exception``, ``add_done_callback``,
    ``set_result``, ``set_exception``, ``cancelled``) without its
    ``threading.Condition`` per instance: that condition (a Python object
    around an ``RLock``) was the largest single cost of admitting a request
    on the event loop in a cProfile of Ebird on a one-layer BERT.  Here a
    plain lock guards the hand-over, and an event is made only for a thread
    that blocks before the answer.  An admitted request is never cancelled:
    it runs to its answer or its engine's error.

    ``encode``, when the runtime sets it, turns the output row into the
    request's answer on the thread that settles the ticket: the CPU lane that
    ran the batch, before it takes its next job, as TorchServe's sync worker
    encodes its batch's answers before reading the next one.  ``encoded``
    says whether that happened; set after the ticket was settled, ``encode``
    is not called and the result stays the output row.
    """

    __slots__ = ("times", "encode", "encoded", "_lock", "_done", "_result", "_error", "_callbacks", "_event")

    def __init__(self, times: StageTimes) -> None:
        self.times = times
        self.encode: Callable[[Any], Any] | RowsEncoder | None = None
        self.encoded = False
        self._lock = threading.Lock()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[TicketFuture], Any]] = []
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with self._lock:
            if self._done:
                raise concurrent.futures.InvalidStateError("this ticket is answered already")
            self._result, self._error, self._done = result, error, True
            callbacks, self._callbacks = self._callbacks, []
            event = self._event
        if event is not None:
            event.set()
        for callback in callbacks:
            self._call(callback)

    def add_done_callback(self, callback: Callable[[TicketFuture], Any]) -> None:
        """Call ``callback(self)`` once answered: on the answering thread, or now if answered already."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        self._call(callback)

    def _call(self, callback: Callable[[TicketFuture], Any]) -> None:
        try:
            callback(self)
        except Exception:  # as concurrent.futures does: one listener's bug must not lose the others
            logger.exception("a ticket's done-callback failed")

    def result(self, timeout: float | None = None) -> Any:
        """The answer; raises the engine's error for this request, or ``TimeoutError`` after ``timeout``."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout)
        return self._error

    def _wait(self, timeout: float | None) -> None:
        if self._done:
            return
        with self._lock:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = None if self._done else self._event
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"no answer within {timeout} s")


class Ticket:
    """One admitted request: the future its answer goes to, and when it passed each stage.

    A plain class with slots: one is made per request on the event loop, where
    a dataclass's generated ``__init__`` and ``__post_init__`` cost more.
    """

    __slots__ = ("future", "times")

    def __init__(self) -> None:
        self.times = StageTimes(time.monotonic())
        self.future = TicketFuture(self.times)

    @property
    def arrived(self) -> float:
        return self.times.arrived

    def settle(self, result: Any = None, error: BaseException | None = None) -> bool:
        """Answer once; a second answer (a late worker after close) is ignored."""
        encode = self.future.encode
        if error is None and encode is not None and not self.future.done():
            started = time.monotonic()
            try:
                result = encode(result)
                self.future.encoded = True
            except Exception as exc:  # this request fails, the engine serves on
                logger.exception("encoding an answer failed")
                error = encode_failed(exc)
            self.times.encode_seconds = time.monotonic() - started
        return self._answer(result, error)

    def settle_encoded(self, answer: Any, encode_seconds: float) -> bool:
        """Answer with what ``settle_batch`` encoded for it (``encode_seconds``: its share of that)."""
        self.future.encoded = True
        self.times.encode_seconds = encode_seconds
        return self._answer(answer, None)

    def _answer(self, result: Any, error: BaseException | None) -> bool:
        self.times.settled = time.monotonic()
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)
            return True
        except concurrent.futures.InvalidStateError:
            return False


def settle_batch(tickets: Sequence[Ticket], outputs: Any, error: BaseException | None = None) -> None:
    """Answer a batch's tickets from its output rows (``outputs[i]`` is ticket i's), or all with ``error``.

    Tickets whose ``encode`` is a ``RowsEncoder`` are encoded together, one
    call per encoder for the whole batch; the others one by one, as
    ``Ticket.settle`` does.
    """
    with one_wakeup():  # the batch's hand-offs to the event loop wake it once
        _settle_batch(tickets, outputs, error)


def _settle_batch(tickets: Sequence[Ticket], outputs: Any, error: BaseException | None) -> None:
    if error is not None or outputs is None:
        failure = error or ServiceUnavailable("inference produced no output")
        for ticket in tickets:
            ticket.settle(error=failure)
        return
    encoders = [None if ticket.future.done() else ticket.future.encode for ticket in tickets]
    alone, groups = encode_together(encoders, outputs)
    for i in alone:
        tickets[i].settle(result=outputs[i])
    for group in groups:
        if group.error is not None:
            for i in group.positions:
                tickets[i].settle(error=group.error)
            continue
        for i, answer in zip(group.positions, group.answers, strict=True):
            tickets[i].settle_encoded(answer, group.seconds_per_row)


class Engine(abc.ABC):
    """Admits model inputs and answers each through its own future."""

    def __init__(self) -> None:
        self._space_listeners: list[Callable[[], None]] = []

    @abc.abstractmethod
    def try_submit(self, item: ModelInput) -> TicketFuture | None:
        """Admit ``item`` now, or return None when there is no room (the caller waits for space).

        Raises ``ResponseError`` for an input the engine can never take, and
        ``ServiceUnavailable`` once closing.  Called from one thread only.
        """

    @abc.abstractmethod
    def close(self, timeout_s: float = 30.0) -> None:
        """Stop admitting, finish what was admitted within ``timeout_s``, fail the rest with 503."""

    def warm_up(self) -> None:  # noqa: B027 - optional hook
        """Run every shape the engine will run once, before TorchServe marks the worker READY."""

    @property
    def takes_rows(self) -> bool:
        """Whether ``take_rows`` works: requests handed over undecoded, run by ``RowBatches`` on a lane."""
        return False

    def fits(self, item: ModelInput) -> bool:
        """Whether ``item`` has this engine's input layout: a row taken undecoded is checked on its lane
        (``RowBatches``), where an admitted input is checked by ``try_submit``."""
        raise NotImplementedError(f"{type(self).__name__} takes decoded inputs only")

    def take_rows(self, rows: Sequence[Any], batches: Any) -> None:
        """Queue ``rows`` (``row_intake.TakenRow``, in arrival order) to run in batches on the lanes, each
        batch through ``batches.run(rows, forward)`` (a ``row_intake.RowBatches``), which answers every row.

        Raises ``ServiceUnavailable`` once closing.  Called on the event loop.
        """
        raise NotImplementedError(f"{type(self).__name__} takes decoded inputs only")

    def takes_routed(self, bind: Any) -> bool:
        """Whether ``take_rows`` takes a request that ``route_request`` bound with ``bind`` (a handler
        that routes each request: REEF takes its real-time ones).  Called on the event loop."""
        return False

    @property
    def takes_decoded_rows(self) -> bool:
        """Whether ``take_decoded`` works: taken rows decoded on a lane by the handler's ``RowLine``
        (``row_line.py``, for a handler with several engines), handed over in one call per layout."""
        return False

    def take_decoded(self, rows: Sequence[Any], items: Sequence[ModelInput], batches: Any, times: Any) -> None:
        """Admit ``items`` (the decoded inputs of ``rows``, ``row_intake.TakenRow``, that ``fits`` this
        engine) in one call, past the in-flight bound as taken rows are, and answer each through
        ``row_intake.answer_taken`` (``batches``: their ``RowBatches``; ``times``: their decode's).

        Raises ``ServiceUnavailable`` once closing.  Called on a lane.
        """
        raise NotImplementedError(f"{type(self).__name__} takes decoded inputs through admission only")

    def on_space(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (from any thread) whenever room for new inputs may have appeared."""
        self._space_listeners.append(listener)

    def _notify_space(self) -> None:
        for listener in self._space_listeners:
            listener()


def wait_for_answers(cond: threading.Condition, outstanding: set[Ticket], deadline: float) -> list[Ticket]:
    """With ``cond`` held, wait until every admitted ticket is answered or ``deadline`` passes.

    Returns the tickets still unanswered; the engine stops its threads and
    then calls :func:`fail_unanswered` on them outside the lock.  Engines
    notify ``cond`` whenever they answer, so this waits no longer than it must.
    """
    while outstanding and time.monotonic() < deadline:
        cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
    return list(outstanding)


def fail_unanswered(tickets: list[Ticket]) -> None:
    """Answer what a closing engine could not finish: 503, so the client may retry elsewhere."""
    for ticket in tickets:
        ticket.settle(error=shut_down())


def drain_then_stop(
    cond: threading.Condition, outstanding: set[Ticket], deadline: float, stop: Callable[[], None]
) -> None:
    """An engine's close: wait for its admitted tickets until ``deadline``, then, with ``cond``
    held, ``stop()`` its loops and wake them; what is still unanswered gets 503."""
    with cond:
        leftover = wait_for_answers(cond, outstanding, deadline)
        stop()
        outstanding.clear()
        cond.notify_all()
    fail_unanswered(leftover)


def warm_up_sizes(sizes: list[int], run: Callable[[int], Any], lanes: Any | None, device: Any) -> None:
    """``run(size)`` for every batch size: on every CPU lane (each lane's OpenMP team, each shape's
    kernels), or once on CUDA, before TorchServe marks the worker READY."""
    for size in sorted(set(sizes)):
        if lanes is None:
            run(size)
        else:
            lanes.run_on_each(lambda size=size: run(size))
    if device.is_cuda:
        torch.cuda.synchronize(device.device)


def input_key(item: ModelInput) -> tuple[tuple[int, ...], ...]:
    """Shapes of one input's tensors: which preallocated memory it fits."""
    return item.shapes


def layout_of(item: ModelInput) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple(zip(item.shapes, item.dtypes, strict=True))


class RowLayout:
    """One request's input layout (``layout_of``'s pairs) as two tuples, shapes and dtypes: admission
    compares every request's with it on the event loop, and two tuple comparisons cost half of building
    ``layout_of(item)``'s pairs and comparing those (0.8 against 1.8 µs on a 2-vCPU VM)."""

    __slots__ = ("shapes", "dtypes")

    def __init__(self, layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> None:
        self.shapes = tuple(tuple(shape) for shape, _ in layout)
        self.dtypes = tuple(dtype for _, dtype in layout)

    def fits(self, item: ModelInput) -> bool:
        return item.shapes == self.shapes and item.dtypes == self.dtypes
