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
inputs in flight.

**On CPU lanes** (``lane_cap`` set) that plan is the wrong shape.  Workers
do not overlap there: a plan's assignments queue on the few lanes and run
one after another, so an input in the plan's last batch waits for every
batch before it, and inputs that arrive meanwhile wait for the whole plan.
The lane rule hands each *free lane* one batch instead, from the largest
idle worker that fits ``min(R, lane_cap)``, and decides again when a lane
frees, with whatever has arrived by then.  ``lane_cap`` comes from the
batch sizes' measured costs per input (``lane_batch_cap``): the smallest
size about as cheap per input as the cheapest.  Late binding holds a free
lane's batch the same way, while it could still grow towards that cap.

No threads, no tensors, no clock here: the handler's mechanism executes the
``BatchPlan`` this returns and measures the costs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Batch sizes whose cost per input is this close to the cheapest count as
# cheapest: per-sample costs measured a few times apart on one 2-core VM
# differ by ~2 %.
COST_TOLERANCE = 0.05


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
    free_lanes: int | None = None  # CPU lanes with no batch queued or running (None: workers overlap freely)


def lane_batch_cap(per_input_ms: Mapping[int, float], tolerance: float = COST_TOLERANCE) -> int:
    """The smallest batch size whose cost per input is within ``tolerance`` of the cheapest size's.

    Under the lane rule the cap sets how fast a queue drains, and what it
    costs the queue's first inputs: all of a batch's inputs finish when it
    does.  A larger size is worth that only where it is clearly cheaper per
    input; one that costs more per input (ResNet-50's batch of 16 on a
    2-core VM: +25 %) would also drain the queue more slowly.  The costs
    are the served ones (``handlers/ebird/batch_costs.py``), which carry
    a per-batch stall that back-to-back timings miss.
    """
    if not per_input_ms or any(b < 1 or ms <= 0 for b, ms in per_input_ms.items()):
        raise ValueError(f"need a positive per-input cost for each batch size ≥ 1, got {dict(per_input_ms)}")
    cheapest = min(per_input_ms.values())
    return min(b for b, ms in per_input_ms.items() if ms <= cheapest * (1 + tolerance))


class ElasticScheduler:
    """The paper's plan over all idle workers; with ``lane_cap``, one batch per free CPU lane."""

    def __init__(self, workers: Sequence[WorkerSpec], max_inflight: int, lane_cap: int | None = None) -> None:
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
        self.lane_cap: int | None = None
        if lane_cap is not None:
            self.set_lane_cap(lane_cap)

    def set_lane_cap(self, cap: int) -> None:
        """Cap the lane rule's batches (its costs were measured again)."""
        if cap < 1:
            raise ValueError(f"the lane cap must be ≥ 1, got {cap}")
        self.lane_cap = cap

    def next_batch(self, state: SchedulerState) -> BatchPlan:
        headroom = self.max_inflight - state.in_flight
        budget = min(state.ready, headroom)
        # Largest first; among equal sizes the lower id, so plans are reproducible.
        idle = sorted(state.idle, key=lambda w: (-w.batch, w.worker_id))
        if self.lane_cap is not None:
            return self._one_batch_per_free_lane(state, idle, budget, headroom)
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

    def _one_batch_per_free_lane(
        self, state: SchedulerState, idle: list[WorkerSpec], budget: int, headroom: int
    ) -> BatchPlan:
        usable = [w for w in idle if w.batch <= self.lane_cap]
        lanes = len(usable) if state.free_lanes is None else state.free_lanes
        assignments = []
        for _ in range(lanes):
            if budget <= 0 or not usable:
                break
            if state.arriving > 0 and budget < min(usable[0].batch, headroom):
                break  # late binding: the lane's batch can still grow towards the cap at no cost
            worker = next((w for w in usable if w.batch <= budget), None)
            if worker is None:
                break
            assignments.append(Assignment(worker.worker_id, worker.batch))
            usable.remove(worker)
            budget -= worker.batch
            headroom -= worker.batch
        return BatchPlan(tuple(assignments))
