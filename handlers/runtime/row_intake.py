"""Requests handed to an engine undecoded, a burst at a time; decoded, run and encoded on the lane that runs them.

On a model whose batch is short (a tiny model on a CPU, any model on a fast
GPU) an async handler's capacity is about one over its Python time per
request, because its event loop and its lanes take turns on one GIL
(``docs/benchmarks/host_path.md``).  The admission path spends that time
per request: a decode job whose outcomes come back to the loop, then, for
each request, its engine's admission, a ticket and its future, a callback
when the batch settles it and a post back to the loop.  The least an async
worker can do instead is what TorchServe's sync worker does per batch:
queue each message, and let the thread that runs the batch decode it, run
it and encode its answer, then hand the batch's answers back at once.

That is this path.  The event loop hands a burst of one-request messages
to the engine in one call (``Engine.take_rows``); the engine keeps them in
arrival order and schedules them as it schedules admitted inputs (Ebird's
elastic sizes, one batch per free lane); the lane that runs a batch calls
``RowBatches.run`` with the batch's requests, and one callback per batch
brings every answer (or each request's own error) back to the loop.

What a request sees does not change: the same decode errors and 4xx
answers, the response timeout counted from receipt (a request still in the
line at its deadline is answered 503 then, and the lane skips it), the
in-flight gauge and stage metrics.  The stages are those of an input whose
engine reports its times, with ``queue`` from receipt to its batch's start
and its decode inside the batch (``StageTally.add_taken``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from handlers.codecs import ModelInput, collate
from handlers.errors import ServiceUnavailable, bad_request, encode_failed, inference_failed
from handlers.runtime.engine import StageTimes, encode_together
from handlers.runtime.loop_mailbox import LoopMailbox
from handlers.runtime.metrics import HandlerMetrics

logger = logging.getLogger(__name__)


class TakenRow(Protocol):
    """A request as the engine and its lane see it (``burst.BurstRequest``)."""

    row: dict[str, Any]  # the message's body, undecoded
    received: float  # ``time.monotonic()`` at receipt
    finished: bool  # answered already (its deadline passed): the lane skips it
    decode: Callable[[dict[str, Any]], ModelInput] | None  # its own decode (``route_request``), or None
    bind: Callable[[ModelInput], ModelInput] | None  # what its decoded input is bound with, or None


Forward = Callable[[tuple[torch.Tensor, ...]], torch.Tensor]  # the engine's model on a batch, output on the host


class BatchTimes:
    """When a batch of taken rows passed each point on its lane (``time.monotonic``), for the stage metrics."""

    __slots__ = ("taken", "decoded", "finished", "settled", "encode_seconds")

    def __init__(self, taken: float) -> None:
        self.taken = taken  # its lane started it
        self.decoded = taken  # its rows were decoded (collating them is the batch's first step)
        self.finished = taken  # its output was on the host
        self.settled = taken  # its answers were encoded and posted to the loop
        self.encode_seconds = 0.0  # of which encoding, per request


@dataclass
class DecodedRows:
    """A batch of taken rows after its decode: the inputs of the rows kept, and the others' errors."""

    times: BatchTimes
    items: list[ModelInput] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)  # the index in the batch of each of ``items``
    errors: dict[int, BaseException] = field(default_factory=dict)  # by index in the batch


# What one batch hands back to the loop: its rows, each one's answer (None where it has an error or was
# skipped), each failed row's error by its index, and the batch's times.
Delivery = Callable[[Sequence[TakenRow], list[Any], dict[int, BaseException], BatchTimes], None]


class RowBatches:
    """The runtime's half of an engine that takes rows: a batch's decode, collate, encode and hand-back.

    ``decode`` turns a row into its input (the handler's codec); ``fits``
    says whether an input has the engine's layout; ``encoder_for`` gives
    what turns an input's output row into its answer; ``deliver`` runs on
    the loop, through ``mailbox``, once per batch.
    """

    def __init__(
        self,
        decode: Callable[[dict[str, Any]], ModelInput],
        fits: Callable[[ModelInput], bool],
        encoder_for: Callable[[ModelInput], Any],
        metrics: HandlerMetrics,
        mailbox: LoopMailbox,
        deliver: Delivery,
    ) -> None:
        self.decode = decode
        self.fits = fits
        self.encoder_for = encoder_for
        self.metrics = metrics
        self.mailbox = mailbox
        self.deliver = deliver

    def run(self, rows: Sequence[TakenRow], forward: Forward) -> tuple[int, BatchTimes]:
        """Decode, run and encode one batch of ``rows`` on this (lane) thread, and post its answers to the loop.

        Returns how many rows the model ran (those not answered already and
        decoded without error) and the batch's times: ``finished - decoded``
        is its collate and model call, the cost an engine's batch-size policy
        reads.  Never raises: a failure is the answer of the rows it
        concerns, and every row gets one.
        """
        decoded = self.decode_rows(rows)
        items, kept, errors, times = decoded.items, decoded.kept, decoded.errors, decoded.times
        answers: list[Any] = [None] * len(rows)
        try:
            if items:
                self._run_model(rows, items, kept, answers, errors, times, forward)
        except Exception as exc:  # not the model's (those are answered in ``_run_model``): still answer every row
            logger.exception("a batch of %d rows failed", len(items))
            failure = inference_failed(exc)
            for index in kept:
                answers[index] = None
                errors[index] = failure
        self.post(rows, answers, errors, times)
        return len(items), times

    def decode_rows(self, rows: Sequence[TakenRow]) -> DecodedRows:
        """Decode ``rows`` on this (lane) thread: the inputs of those not answered already and of this
        engine's layout, in order; each other row's own error (its 4xx, or a 503 for a codec bug)."""
        decoded = DecodedRows(BatchTimes(time.monotonic()))
        for index, request in enumerate(rows):
            if request.finished:  # answered 503 at its deadline while it waited in the line
                continue
            try:
                item = (request.decode or self.decode)(request.row)
                if request.bind is not None:
                    item = request.bind(item)
                if not self.fits(item):
                    shapes = [list(shape) for shape in item.shapes]
                    raise bad_request(f"input shape {shapes} is not one this archive declares")
            except Exception as exc:  # its own 4xx, answered on the loop
                decoded.errors[index] = exc
                continue
            decoded.items.append(item)
            decoded.kept.append(index)
        decoded.times.decoded = time.monotonic()
        return decoded

    def answer(
        self, rows: Sequence[TakenRow], encoders: Sequence[Any], outputs: torch.Tensor, times: BatchTimes
    ) -> None:
        """Encode the answers of ``rows`` (row i's output is ``outputs[i]``, its encoder ``encoders[i]``)
        on this thread and post them to the loop: an engine that ran them in its own batches."""
        answers: list[Any] = [None] * len(rows)
        errors: dict[int, BaseException] = {}
        self._encode(encoders, list(range(len(rows))), outputs, answers, errors)
        times.encode_seconds = (time.monotonic() - times.finished) / max(len(rows), 1)
        self.post(rows, answers, errors, times)

    def post(
        self, rows: Sequence[TakenRow], answers: list[Any], errors: dict[int, BaseException], times: BatchTimes
    ) -> None:
        """Hand ``rows``' answers (or their errors, by index) to the loop in one callback."""
        times.settled = time.monotonic()
        self.mailbox.post(lambda: self.deliver(rows, answers, errors, times))

    def fail(self, rows: Sequence[TakenRow], error: BaseException) -> None:
        """Answer ``rows`` with ``error`` (a closing engine's leftovers), on the loop."""
        times = BatchTimes(time.monotonic())
        errors = dict.fromkeys(range(len(rows)), error)
        self.mailbox.post(lambda: self.deliver(rows, [None] * len(rows), errors, times))

    def _run_model(
        self,
        rows: Sequence[TakenRow],
        items: list[ModelInput],
        kept: list[int],
        answers: list[Any],
        errors: dict[int, BaseException],
        times: BatchTimes,
        forward: Forward,
    ) -> None:
        self.metrics.batch_started(len(items), [times.taken - rows[i].received for i in kept])
        try:
            outputs = forward(collate(items))
        except Exception as exc:  # this batch's requests fail, the engine serves on
            logger.exception("a batch of %d failed", len(items))
            failure = inference_failed(exc)
            for index in kept:
                errors[index] = failure
            return
        finally:
            times.finished = time.monotonic()
            self.metrics.batch_finished(times.finished - times.decoded)
        self._encode([self.encoder_for(item) for item in items], kept, outputs, answers, errors)
        times.encode_seconds = (time.monotonic() - times.finished) / len(items)

    def _encode(
        self,
        encoders: list[Any],
        kept: list[int],
        outputs: torch.Tensor,
        answers: list[Any],
        errors: dict[int, BaseException],
    ) -> None:
        """Each kept row's answer: the rows in the handler's own JSON in one call (``RowsEncoder``), any
        other row (an Open Inference Protocol request, a subclass's ``postprocess``) by its own encoder."""
        alone, groups = encode_together(encoders, outputs)
        for position in alone:
            try:
                answers[kept[position]] = encoders[position](outputs[position])
            except Exception as exc:
                logger.error("encoding an answer failed", exc_info=exc)
                errors[kept[position]] = encode_failed(exc)
        for group in groups:
            if group.error is not None:
                errors.update((kept[position], group.error) for position in group.positions)
                continue
            for position, answer in zip(group.positions, group.answers, strict=True):
                answers[kept[position]] = answer


class TakenTicket:
    """A taken row, decoded, in an engine that tracks each request as a ticket (DVABatch's batch table).

    It stands where the engine's ``Ticket`` would: ``times`` for the
    engine's stage points, ``arrived`` for its queue metrics.  Its answer is
    not a future's: ``answer_taken`` encodes a finished batch's taken rows on
    the engine's thread and posts them to the loop in one callback, as
    ``RowBatches.run`` does for an engine that runs a batch in one call.
    """

    __slots__ = ("request", "batches", "encode", "decode_times", "times")

    def __init__(self, request: TakenRow, batches: RowBatches, encode: Any, decode_times: BatchTimes) -> None:
        self.request = request
        self.batches = batches
        self.encode = encode
        self.decode_times = decode_times  # its decode job's (shared with the rows decoded with it)
        self.times = StageTimes(request.received)

    @property
    def arrived(self) -> float:
        return self.times.arrived

    def settle(self, result: Any = None, error: BaseException | None = None) -> bool:
        """A closing engine's 503 (``fail_unanswered``); answers go through ``answer_taken``."""
        self.batches.fail([self.request], error or ServiceUnavailable("the request was dropped from its batch"))
        return True


def answer_taken(tickets: Sequence[TakenTicket], outputs: torch.Tensor | None, error: BaseException | None) -> None:
    """Answer the taken rows of one finished batch (``outputs[i]`` is ``tickets[i]``'s), or fail them all
    with ``error``: encoded on this thread, one call per encoder, and posted to the loop in one callback
    per decode job the batch's rows came from (each with that job's times: one batch may merge several)."""
    groups: dict[int, list[int]] = {}
    for position, ticket in enumerate(tickets):
        groups.setdefault(id(ticket.decode_times), []).append(position)
    for positions in groups.values():
        first = tickets[positions[0]]
        rows = [tickets[p].request for p in positions]
        if error is not None or outputs is None:
            first.batches.fail(rows, error or ServiceUnavailable("inference produced no output"))
            continue
        times = BatchTimes(first.decode_times.taken)
        times.decoded = first.decode_times.decoded
        times.finished = first.times.finished or time.monotonic()
        ran = outputs if len(positions) == len(tickets) else outputs[positions]
        first.batches.answer(rows, [tickets[p].encode for p in positions], ran, times)
