"""Ebird's elastic batch scheduler: the rule, as a pure function of state.

Ebird keeps several engine workers alive, each with a fixed batch size
(powers of two, so any count of ready inputs is expressible as a sum).  Idle
workers are kept sorted by batch size, largest first.  Whenever inputs are
ready:

    R = min(N ready inputs, MaxInf − CurInf)
    repeat: give the next b inputs to the first idle worker with b ≤ R; R −= b
    until R = 0 or no idle worker fits

Late binding (CPU): when requests that arrived before this decision are
still being decoded on the lane the batch would run on
(``handlers/runtime/arrivals.py``), a batch handed over now would start
only after those decodes anyway, without them.  So while such requests are
``arriving`` the rule stops before a worker that the remaining R cannot
fill, as long as R is also below the MaxInf headroom left: waiting can only
grow that batch, not delay it.  Full workers are still handed their
batches at once, so a scheduler that looks late (five of a six-request
burst ready together) runs 4 now and holds the fifth for the sixth, rather
than running 4, 1 and 1.  The mechanism reports arrivals only while they
can still join the ready run (``InputPool.ready_run_can_grow``); otherwise
the hold would wait for nothing, or, with the pool full, for ever.

A finished worker returns to the idle set.  At low load this runs each input
at once on a small worker (no batching window); at high load large workers
take large batches while small ones mop up the remainder.  MaxInf bounds the
inputs in flight.  No threads, no tensors, no clock here: the handler's
mechanism executes the ``BatchPlan`` this returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def default_worker_batches(max_batch: int = 32) -> list[int]:
    """The paper's default set: 1, 1, 2, 4, …, max_batch/2 (1,1,2,4,8,16 for 32).

    Two workers of size 1 keep single requests flowing while another is busy;
    the sizes sum to ``max_batch``, so all workers together can hold a full batch.
    """
    if max_batch < 2 or max_batch & (max_batch - 1):
        raise ValueError(f"max batch must be a power of two ≥ 2, got {max_batch}")
    sizes = [1]
    b = 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: int
    batch: int


@dataclass(frozen=True)
class Assignment:
    worker_id: int
    count: int  # inputs given to the worker: exactly its batch size


@dataclass(frozen=True)
class BatchPlan:
    assignments: tuple[Assignment, ...] = ()

    @property
    def inputs(self) -> int:
        return sum(a.count for a in self.assignments)


@dataclass
class SchedulerState:
    """What the policy looks at: ready inputs, inputs in flight, idle workers, inputs still arriving."""

    ready: int
    in_flight: int
    idle: Sequence[WorkerSpec] = field(default_factory=tuple)
    arriving: int = 0  # received before this decision, not yet ready, and ahead of the batch on its lane


class ElasticScheduler:
    def __init__(self, workers: Sequence[WorkerSpec], max_inflight: int) -> None:
        if not workers:
            raise ValueError("Ebird needs at least one engine worker")
        batches = [w.batch for w in workers]
        if any(b < 1 or b & (b - 1) for b in batches):
            raise ValueError(f"worker batch sizes must be powers of two, got {batches}")
        if 1 not in batches:
            raise ValueError("one worker must take batch 1, or a lone request could wait forever")
        if max_inflight < 1:
            raise ValueError(f"MaxInf must be ≥ 1, got {max_inflight}")
        self.workers = tuple(workers)
        self.max_inflight = max_inflight

    def next_batch(self, state: SchedulerState) -> BatchPlan:
        headroom = self.max_inflight - state.in_flight
        budget = min(state.ready, headroom)
        # Largest first; among equal sizes the lower id, so plans are reproducible.
        idle = sorted(state.idle, key=lambda w: (-w.batch, w.worker_id))
        assignments = []
        for worker in idle:
            if budget <= 0:
                break
            if state.arriving > 0 and budget < min(worker.batch, headroom):
                break  # late binding: what is left can still grow at no cost
            if worker.batch <= budget:
                assignments.append(Assignment(worker.worker_id, worker.batch))
                budget -= worker.batch
                headroom -= worker.batch
        return BatchPlan(tuple(assignments))
