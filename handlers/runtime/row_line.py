"""Requests taken undecoded by a handler with several engines: decoded on a lane, handed over per layout.

``row_intake.py`` lets an engine take a burst undecoded when the engine is
known before the decode (one input layout).  A handler with several engines
(DVABatch on a token model: one engine per declared length) only knows a
request's engine from its decoded shape, so until now it took the admission
path: a decode job whose outcomes came back to the event loop, then per
request an admission into its engine, a ticket, a future and its callback.

The line here does that between the two on the lane instead.  The loop
hands each burst over in one call (``take_rows``); one lane job decodes
every row waiting when it starts (``RowBatches.decode_rows``), groups the
inputs by engine and hands each group to its engine in one call
(``Engine.take_decoded``).  The engine answers a finished batch's rows on
its own thread, encoded together, in one callback to the loop
(``row_intake.answer_taken``).  A row that fails its decode, or fits no
engine, gets its own 4xx in one callback per job.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from handlers.codecs import ModelInput
from handlers.errors import ServiceUnavailable, shut_down
from handlers.runtime.engine import Engine
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.row_intake import RowBatches, TakenRow

logger = logging.getLogger(__name__)


class RowLine:
    """Taken rows of a handler whose engines ``take_decoded``, decoded on its lanes and handed to each engine."""

    takes_rows = True

    def __init__(self, engine_for: Callable[[ModelInput], Engine | None], lanes: CpuLanes) -> None:
        self._engine_for = engine_for  # the engine an input goes to, or None (a layout the archive lacks)
        self._lanes = lanes
        self._cond = threading.Condition()
        self._waiting: list[TakenRow] = []
        self._batches: RowBatches | None = None
        self._queued = False  # a hand-over job is queued on the lanes and takes whatever waits when it starts
        self._running = False
        self._closing = False

    def takes_routed(self, bind: object) -> bool:
        """A handler that routes each request takes the admission path (``Engine.takes_routed``)."""
        return False

    def fits(self, item: ModelInput) -> bool:
        """Whether some engine takes ``item`` (``RowBatches.decode_rows`` answers the others 400)."""
        return self._engine_for(item) is not None

    def take_rows(self, rows: Sequence[TakenRow], batches: RowBatches) -> None:
        """Queue ``rows`` for the next hand-over job, queueing one if none is (on the loop)."""
        with self._cond:
            if self._closing:
                raise ServiceUnavailable("worker is shutting down")
            self._batches = batches
            self._waiting.extend(rows)
            if self._queued:
                return
            self._queued = True
        try:
            self._lanes.submit(self._hand_over, batches)
        except Exception:  # the lanes are closed: what waits gets its 503
            with self._cond:
                waiting, self._waiting, self._queued = self._waiting, [], False
            batches.fail(waiting, shut_down())

    def _hand_over(self, batches: RowBatches) -> None:
        """A lane job: decode what waits, and give each engine its inputs in one call."""
        with self._cond:
            rows, self._waiting = self._waiting, []
            self._queued, self._running = False, True
        try:
            decoded = batches.decode_rows(rows)
            groups: dict[int, tuple[Engine, list[int]]] = {}
            for position, item in enumerate(decoded.items):
                engine = self._engine_for(item)
                groups.setdefault(id(engine), (engine, []))[1].append(position)
            for engine, positions in groups.values():
                taken = [rows[decoded.kept[p]] for p in positions]
                try:
                    engine.take_decoded(taken, [decoded.items[p] for p in positions], batches, decoded.times)
                except Exception as exc:  # closing (503), or an engine's bug: these rows fail, the line goes on
                    if not isinstance(exc, ServiceUnavailable):
                        logger.exception("handing %d decoded requests to their engine failed", len(taken))
                        exc = ServiceUnavailable(f"could not admit the request: {type(exc).__name__}: {exc}")
                    decoded.errors.update((decoded.kept[p], exc) for p in positions)
            if decoded.errors:
                failed = sorted(decoded.errors)
                errors = {i: decoded.errors[index] for i, index in enumerate(failed)}
                batches.post([rows[index] for index in failed], [None] * len(failed), errors, decoded.times)
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def close(self, timeout_s: float) -> None:
        """Stop taking rows; wait up to ``timeout_s`` for what waits to reach its engines, then 503 the rest.

        Called before the engines close, so that every row handed over is
        theirs to finish or fail.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closing = True
            while (self._waiting or self._queued or self._running) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
            leftover, self._waiting = self._waiting, []
        if leftover and self._batches is not None:
            self._batches.fail(leftover, shut_down())
