"""Requests a handler has received but not yet handed to an engine: late binding's input.

On a CPU the handler decodes requests on the same lanes that run batches
(``decode.py``), first in, first out.  A batch handed to a lane while
decodes are queued there runs only after them, yet its requests were picked
before them: the requests being decoded miss it and wait a whole batch
more.  A burst of six requests on the lane ran as three batches (4, 1 and
1; tests/test_ebird_handler.py without the hold) where two (4 and 2) do.
TorchServe's own batching forms a batch when the worker is free, from
everything that has arrived; an engine does the same by looking here
before it dispatches and holding the batch while requests that arrived
before it decided are still arriving (``horizon`` / ``pending_through``).
Requests that arrive later do not extend the hold, so it lasts at most
the decodes the batch would have queued behind anyway.

A request is arriving from ``enter`` (when the handler receives it) until
``leave`` (admitted by an engine, or refused).  ``leave`` wakes the
listeners, so a request that fails to decode still releases a held batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Arrivals:
    """Thread-safe, ordered register of the requests between receipt and admission."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._pending: set[int] = set()
        self._listeners: list[Callable[[], None]] = []

    def enter(self) -> int:
        """Register a received request; its token orders it among the others."""
        return self.enter_many(1)[0]

    def enter_many(self, count: int) -> range:
        """Register ``count`` requests received together, in order: their tokens."""
        with self._lock:
            first = self._next
            self._next += count
            tokens = range(first, self._next)
            self._pending.update(tokens)
            return tokens

    def leave(self, token: int) -> None:
        """The request has reached an engine or was refused.  Idempotent."""
        with self._lock:
            if token not in self._pending:
                return
            self._pending.discard(token)
        for listener in self._listeners:
            listener()

    @property
    def horizon(self) -> int:
        """The token of the latest request received so far (-1 before any)."""
        with self._lock:
            return self._next - 1

    def pending_through(self, horizon: int) -> int:
        """How many requests received up to ``horizon`` are still arriving."""
        with self._lock:
            return sum(1 for token in self._pending if token <= horizon)

    def on_leave(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (from the thread that calls ``leave``) whenever a request leaves."""
        self._listeners.append(listener)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
