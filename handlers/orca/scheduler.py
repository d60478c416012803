"""Orca's iteration-level scheduler (the paper's Algorithm 2), as pure policy.

The scheduler is asked for a batch before every iteration, not before every
request: a request that finishes leaves at the end of the iteration that
produced its last token, and one that arrives joins at the next iteration.
Selection is first come, first served over the whole pool, running requests
and waiting ones alike, up to ``max_batch``.  A waiting request is started
only if a KV slot can be reserved for its whole life (prompt plus
``max_new_tokens``); if none is free the selection stops there, so no later
request overtakes it (strict FCFS, no starvation), and it starts as soon as
a running request finishes.  Running requests hold their slots, so they
always progress: running out of KV memory makes requests wait, never fail.
With one engine worker on CPU there is no pipelining, so the paper's
``n_workers`` exclusion of requests still in flight does not arise.

``iteration_level=False`` is the paper's baseline, request-level batching
(FasterTransformer behind a serving system's batch window): a batch starts
only when the previous one has finished entirely, and nobody joins it
midway.  The engine also holds that batch's answers until its longest
request is done.  It is kept here, in the same engine, so that a benchmark
compares scheduling alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from handlers.orca.sampling import TokenChooser


@dataclass(eq=False)
class GenerationRequest:
    """One request's state in the pool."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    arrival: int = -1  # set by the scheduler: its place in FCFS order
    slot: int | None = None  # KV slot, once started
    generated: list[int] = field(default_factory=list)
    cached: int = 0  # positions already in the KV cache
    chooser: TokenChooser = field(default_factory=TokenChooser)  # greedy unless the request samples
    stop_ids: frozenset[int] = frozenset()  # a token that ends the request (kept as its last)
    cancelled: bool = False  # its client has what it needs (a stop string seen): end it at the next iteration

    @property
    def started(self) -> bool:
        return self.slot is not None

    @property
    def finished(self) -> bool:
        return len(self.generated) >= self.max_new_tokens or self.stopped or self.cancelled

    @property
    def stopped(self) -> bool:
        """It made one of its stop tokens (rather than running out of ``max_new_tokens``)."""
        return bool(self.generated) and self.generated[-1] in self.stop_ids

    def next_tokens(self) -> tuple[int, ...]:
        """What the next iteration feeds it: the prompt at initiation, else its last token."""
        return self.prompt if self.cached == 0 else (self.generated[-1],)


class IterationScheduler:
    """The request pool and Algorithm 2's selection; ``allocate`` / ``release`` manage KV slots."""

    def __init__(self, max_batch: int, allocate: Callable[[], int], release: Callable[[int], None],
                 free_slots: Callable[[], int], iteration_level: bool = True) -> None:  # fmt: skip
        if max_batch < 1:
            raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
        self.max_batch = max_batch
        self._allocate = allocate
        self._release = release
        self._free_slots = free_slots
        self.iteration_level = iteration_level
        self.pool: list[GenerationRequest] = []  # in arrival order
        self._arrivals = 0

    def add(self, request: GenerationRequest) -> None:
        request.arrival = self._arrivals
        self._arrivals += 1
        self.pool.append(request)

    def select(self) -> list[GenerationRequest]:
        """The next iteration's batch: the pool's first requests in arrival order (see the module doc)."""
        batch: list[GenerationRequest] = []
        if not self.iteration_level:
            running = [r for r in self.pool if r.started]
            if running:  # request-level: the batch in progress runs to its end, alone
                return running
        for request in self.pool:
            if len(batch) == self.max_batch:
                break
            if not request.started:
                if self._free_slots() == 0:
                    break  # strict FCFS: nobody behind it starts first
                request.slot = self._allocate()
            batch.append(request)
        return batch

    def finish(self, request: GenerationRequest) -> None:
        """Take a finished (or failed) request out of the pool and free its slot."""
        self.pool.remove(request)
        if request.slot is not None:
            self._release(request.slot)
            request.slot = None
