"""Instances of one worker that pull their own batch sizes from one queue: Packrat's mixed plans.

A mixed plan (``i₁×⟨t₁,b₁⟩ + i₂×⟨t₂,b₂⟩ …``, the optimizer's exact answer) runs
every instance in one TorchServe worker, each on its own pinned CPU lane
(``lanes.LanePlacement``: its cores, its threads).  TorchServe cannot do
this with one process per instance: a version has one ``batch_size``, and
only the default version takes requests; and TorchServe's async mode hands
requests to a version's workers in turn with no regard for how busy each is,
so separate processes could not get shares in proportion to their ``b``
without passing requests between them.  Inside one process the split the
plan wants comes from pulling: whenever an instance is idle it takes up to
its own ``b`` of the oldest waiting requests (waiting up to ``max_delay_s``
for a full batch, as TorchServe's ``max_batch_delay`` does), so a round of
``B = Σ i·b`` requests is cut into the plan's sub-batches, and a lighter load
goes to the instance that serves it fastest (more threads first).  One
dispatcher thread forms every batch; each runs on its instance's lane.

``InstancePool`` is the mechanism shared by the engines of one handler (one
engine per input layout, one set of instances); ``InstanceEngine`` is the
runtime's ``Engine`` for one layout.  Every admitted request is answered
exactly once: by its batch, or with 503 when the pool closes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from handlers.codecs import ModelInput, collate
from handlers.errors import ServiceUnavailable, inference_failed
from handlers.runtime.engine import (
    Engine,
    Ticket,
    TicketFuture,
    drain_then_stop,
    fail_unanswered,
    input_key,
    settle_batch,
)
from handlers.runtime.lanes import CpuLanes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Instance:
    """One instance of a plan: the lane it runs on, its threads and its batch size."""

    lane: int
    threads: int
    batch: int


# The runner: (instance, stacked inputs) → output rows; the recorder: (instance, requests, seconds).
Runner = Callable[[Instance, tuple[torch.Tensor, ...]], torch.Tensor]
Recorder = Callable[[Instance, int, float], None]


class InstancePool:
    def __init__(
        self,
        lanes: CpuLanes,
        instances: list[Instance],
        run: Runner,
        max_waiting: int,
        on_batch: Recorder | None = None,
        on_start: Callable[[Instance, int], None] | None = None,
        max_delay_s: float = 0.0,
    ) -> None:
        if not instances:
            raise ValueError("an instance pool needs at least one instance")
        if {i.lane for i in instances} != set(range(lanes.count)) or len(instances) != lanes.count:
            raise ValueError(f"one instance per lane: {lanes.count} lanes, instances {instances}")
        self.lanes = lanes
        # Preference among idle instances: more threads (faster on a few requests), then larger batches.
        self.instances = sorted(instances, key=lambda i: (-i.threads, -i.batch, i.lane))
        self._run = run
        self._on_batch = on_batch
        self._on_start = on_start  # on the lane, before a batch runs (may hold it)
        self.max_waiting = max_waiting
        # An idle instance that could take fewer than its batch waits this long
        # (from the oldest request's arrival) for more, as TorchServe's
        # max_batch_delay does; an instance whose batch is full starts at once.
        self.max_delay_s = max_delay_s
        self._cond = threading.Condition()
        self._waiting: dict[Any, deque[tuple[ModelInput, Ticket]]] = {}
        self._idle = set(range(len(self.instances)))
        self._outstanding: set[Ticket] = set()
        self._closing = False
        self._stopped = False
        self._listeners: list[Callable[[], None]] = []
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="instance-dispatch", daemon=True)
        self._dispatcher.start()

    @property
    def waiting(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._waiting.values())

    def on_space(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def try_submit(self, item: ModelInput) -> TicketFuture | None:
        """Queue one request (None when ``max_waiting`` are already waiting)."""
        with self._cond:
            if self._closing:
                raise ServiceUnavailable("worker is shutting down")
            if sum(len(q) for q in self._waiting.values()) >= self.max_waiting:
                return None
            ticket = Ticket()
            self._waiting.setdefault(input_key(item), deque()).append((item, ticket))
            self._outstanding.add(ticket)
            self._cond.notify_all()
        return ticket.future

    def _dispatch_loop(self) -> None:
        """The one place batches are formed: on every arrival, finished batch or batching deadline."""
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    now = time.monotonic()
                    dispatch, deadline = self._dispatch_locked(now)
                    if dispatch:
                        break
                    self._cond.wait(None if deadline is None else max(deadline - now, 0.0))
            self._start(dispatch)

    def _dispatch_locked(self, now: float) -> tuple[list[tuple[int, list[tuple[ModelInput, Ticket]]]], float | None]:
        """Idle instances, most preferred first, each take up to their batch of the oldest layout's head.

        Returns the batches to start and, when an instance holds off for a
        fuller batch, when it stops holding off.
        """
        out = []
        deadline = None
        for index in sorted(self._idle):
            queues = [q for q in self._waiting.values() if q]
            if not queues:
                break
            oldest = min(queues, key=lambda q: q[0][1].arrived)
            batch = self.instances[index].batch
            ready_at = oldest[0][1].arrived + self.max_delay_s
            if len(oldest) < batch and now < ready_at and not self._closing:
                deadline = ready_at if deadline is None else min(deadline, ready_at)
                continue  # a less preferred instance may take them now; else wait for more
            take = [oldest.popleft() for _ in range(min(batch, len(oldest)))]
            self._idle.discard(index)
            out.append((index, take))
        return out, deadline

    def _start(self, dispatch: list[tuple[int, list[tuple[ModelInput, Ticket]]]]) -> None:
        for index, taken in dispatch:
            instance = self.instances[index]
            self.lanes.submit(self._serve, index, taken, lane=instance.lane)
        if dispatch:
            for listener in self._listeners:
                listener()

    def _serve(self, index: int, taken: list[tuple[ModelInput, Ticket]]) -> None:
        """On the instance's own lane: run its batch, answer each request, take the next batch."""
        instance = self.instances[index]
        tickets = [t for _, t in taken]
        if self._on_start is not None:
            try:
                self._on_start(instance, len(tickets))
            except Exception:
                logger.exception("the start hook of instance %d failed", index)
        started = time.monotonic()
        for ticket in tickets:
            ticket.times.started = started
        try:
            stacked = collate([item for item, _ in taken])
            outputs = self._run(instance, stacked)
            error = None
        except Exception as exc:  # this batch fails, the instance serves on
            logger.exception("batch of %d on instance %d failed", len(taken), index)
            outputs, error = None, inference_failed(exc)
        finished = time.monotonic()
        # Recorded before any answer leaves (one 72-byte write): a client that has every answer
        # then reads counters that hold every batch, as the controller's calibration assumes.
        if self._on_batch is not None:
            try:
                self._on_batch(instance, len(tickets), finished - started)
            except Exception:  # bookkeeping must not cost the instance its place
                logger.exception("recording a batch of instance %d failed", index)
        for ticket in tickets:
            ticket.times.finished = finished
        settle_batch(tickets, outputs, error)
        with self._cond:
            self._outstanding.difference_update(tickets)
            self._idle.add(index)
            self._cond.notify_all()

    def warm_up(self, example: ModelInput) -> None:
        """Every instance runs its own batch size once, on its own lane (its OpenMP team, its kernels)."""
        for instance in self.instances:
            stacked = tuple(torch.stack([t] * instance.batch) for t in example.tensors)
            self.lanes.submit(self._run, instance, stacked, lane=instance.lane).result()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop admitting; the waiting requests still run until ``timeout_s``; what is left gets 503."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        drain_then_stop(self._cond, self._outstanding, time.monotonic() + timeout_s, self._stop)

    def _stop(self) -> None:
        """With the lock held: stop dispatching; what still waits gets 503."""
        self._stopped = True
        leftover = [t for q in self._waiting.values() for _, t in q]
        self._waiting.clear()
        fail_unanswered(leftover)


class InstanceEngine(Engine):
    """The runtime's engine for one input layout, backed by the handler's shared ``InstancePool``."""

    def __init__(self, pool: InstancePool) -> None:
        super().__init__()
        self.pool = pool
        pool.on_space(self._notify_space)

    def try_submit(self, item: ModelInput) -> TicketFuture | None:
        return self.pool.try_submit(item)

    def close(self, timeout_s: float = 30.0) -> None:
        self.pool.close(timeout_s)
