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

A handler may regroup each hand-over before it reaches the engines
(``regroup``): DVABatch runs some length classes' rows in a longer class's
engine where one padded batch costs less (``handlers/dvabatch/merge.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from handlers.codecs import ModelInput
from handlers.errors import ServiceUnavailable, shut_down
from handlers.runtime.engine import Engine
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.row_intake import RowBatches, TakenRow

logger = logging.getLogger(__name__)


@dataclass
class RowGroup:
    """Decoded rows for one engine: their positions in the hand-over and their inputs, in arrival order."""

    engine: Engine
    positions: list[int]
    items: list[ModelInput]


Regroup = Callable[[list[RowGroup]], list[RowGroup]]


class RowLine:
    """Taken rows of a handler whose engines ``take_decoded``, decoded on its lanes and handed to each engine."""

    takes_rows = True

    def __init__(
        self, engine_for: Callable[[ModelInput], Engine | None], lanes: CpuLanes, regroup: Regroup | None = None
    ) -> None:
        self._engine_for = engine_for  # the engine an input goes to, or None (a layout the archive lacks)
        self._regroup = regroup  # moves rows between the hand-over's groups before they are handed over
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
            by_engine: dict[int, RowGroup] = {}
            for position, item in enumerate(decoded.items):
                engine = self._engine_for(item)
                group = by_engine.get(id(engine))
                if group is None:
                    group = by_engine[id(engine)] = RowGroup(engine, [], [])
                group.positions.append(position)
                group.items.append(item)
            groups = list(by_engine.values())
            if self._regroup is not None:
                try:
                    groups = self._regroup(groups)
                except Exception:  # a policy's bug must not lose rows: they go to their own engines
                    logger.exception("regrouping %d decoded requests failed; each goes to its own engine", len(rows))
            for group in groups:
                taken = [rows[decoded.kept[p]] for p in group.positions]
                try:
                    group.engine.take_decoded(taken, group.items, batches, decoded.times)
                except Exception as exc:  # closing (503), or an engine's bug: these rows fail, the line goes on
                    if not isinstance(exc, ServiceUnavailable):
                        logger.exception("handing %d decoded requests to their engine failed", len(taken))
                        exc = ServiceUnavailable(f"could not admit the request: {type(exc).__name__}: {exc}")
                    decoded.errors.update((decoded.kept[p], exc) for p in group.positions)
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
