"""Ebird's scheduling rule and input pool, without TorchServe, threads or a GPU."""

from __future__ import annotations

import pytest
import torch

from handlers.ebird.pool import InputPool, Run
from handlers.ebird.scheduler import (
    ElasticScheduler,
    SchedulerState,
    WorkerSpec,
    default_worker_batches,
)


def workers(*batches: int) -> list[WorkerSpec]:
    return [WorkerSpec(i, b) for i, b in enumerate(batches)]


def plan(scheduler, ready, in_flight=0, idle=None, arriving=0):
    state = SchedulerState(ready, in_flight, idle if idle is not None else scheduler.workers, arriving)
    return [(a.worker_id, a.count) for a in scheduler.next_batch(state).assignments]


def test_default_worker_set_is_the_papers():
    assert default_worker_batches(32) == [1, 1, 2, 4, 8, 16]
    assert sum(default_worker_batches(32)) == 32
    with pytest.raises(ValueError):
        default_worker_batches(24)


def test_a_lone_request_runs_at_once_on_the_smallest_fitting_worker():
    s = ElasticScheduler(workers(*default_worker_batches(32)), max_inflight=32)
    assert plan(s, ready=1) == [(0, 1)]


def test_a_burst_is_split_largest_first_across_idle_workers():
    s = ElasticScheduler(workers(1, 1, 2, 4, 8, 16), max_inflight=64)
    # 27 = 16 + 8 + 2 + 1: the 4 is skipped once only 3 remain.
    assert plan(s, ready=27) == [(5, 16), (4, 8), (2, 2), (0, 1)]
    # More than all workers hold: every worker busy, the rest waits.
    assert sum(c for _, c in plan(s, ready=100)) == 32


def test_max_inflight_bounds_what_is_dispatched():
    s = ElasticScheduler(workers(1, 1, 2, 4, 8, 16), max_inflight=20)
    assert plan(s, ready=30, in_flight=10) == [(4, 8), (2, 2)]
    assert plan(s, ready=30, in_flight=20) == []


def test_busy_workers_are_not_used_and_finished_ones_come_back():
    s = ElasticScheduler(workers(1, 1, 2, 4, 8, 16), max_inflight=64)
    idle = [w for w in s.workers if w.batch != 16]
    assert plan(s, ready=20, idle=idle) == [(4, 8), (3, 4), (2, 2), (0, 1), (1, 1)]
    assert plan(s, ready=20, idle=s.workers)[0] == (5, 16)


def test_while_inputs_arrive_a_batch_waits_only_if_it_could_still_grow():
    s = ElasticScheduler(workers(1, 1, 2, 4), max_inflight=8)
    assert plan(s, ready=1, arriving=2) == []  # a 4 is idle: wait for the arrivals
    assert plan(s, ready=3, arriving=5) == []
    assert plan(s, ready=4, arriving=5) == [(3, 4)]  # the largest idle worker is full already
    assert plan(s, ready=1, arriving=0) == [(0, 1)]
    idle = [w for w in s.workers if w.batch == 1]
    assert plan(s, ready=1, idle=idle, arriving=3) == [(0, 1)]  # only batch-1 workers are idle
    assert plan(s, ready=2, in_flight=6, arriving=3) == [(2, 2)]  # MaxInf allows no more than 2


def test_while_inputs_arrive_full_workers_go_at_once_and_only_the_remainder_waits():
    """A scheduler that looks late sees most of a burst at once: the part that fills workers must not
    wait, and the part that does not must not run as batches of 1 while the rest is still arriving."""
    s = ElasticScheduler(workers(1, 1, 2, 4), max_inflight=8)
    assert plan(s, ready=5, arriving=1) == [(3, 4)]  # not 4 + 1: the fifth waits for the sixth
    assert plan(s, ready=5, arriving=0) == [(3, 4), (0, 1)]
    assert plan(s, ready=6, arriving=1) == [(3, 4), (2, 2)]
    assert plan(s, ready=7, arriving=1) == [(3, 4), (2, 2), (0, 1)]  # every worker full: nothing to wait for
    assert plan(s, ready=5, in_flight=3, arriving=1) == [(3, 4), (0, 1)]  # MaxInf leaves room for 1 more only


@pytest.mark.parametrize(
    "batches, max_inflight, message",
    [((), 8, "at least one"), ((2, 4), 8, "batch 1"), ((1, 3), 8, "powers of two"), ((1, 2), 0, "MaxInf")],
)
def test_bad_scheduler_config_is_refused(batches, max_inflight, message):
    with pytest.raises(ValueError, match=message):
        ElasticScheduler(workers(*batches), max_inflight)


def image_pool(capacity: int) -> InputPool:
    return InputPool([((3, 4, 4), torch.float32)], capacity)


def fill(pool: InputPool, n: int, start_value: float = 0.0) -> list[int]:
    slots = []
    for i in range(n):
        slot = pool.reserve()
        assert slot is not None
        pool.write(slot, [torch.full((3, 4, 4), start_value + i)])
        slots.append(slot)
    return slots


def test_a_batch_is_a_zero_copy_slice_of_the_pool():
    pool = image_pool(8)
    fill(pool, 3)
    assert pool.ready() == 3
    run = pool.take(3)
    (batch,) = pool.views(run)
    assert batch.shape == (3, 3, 4, 4)
    assert batch.data_ptr() == pool.storage[0].data_ptr()  # the pool's own memory
    assert [float(batch[i, 0, 0, 0]) for i in range(3)] == [0.0, 1.0, 2.0]


def test_full_pool_pushes_back_and_out_of_order_release_frees_slots():
    pool = image_pool(4)
    fill(pool, 4)
    assert pool.reserve() is None  # full: the caller must wait, nothing is overwritten
    first, second = pool.take(1), pool.take(3)
    pool.release(second)  # the larger, later batch finishes first
    assert pool.reserve() is None  # ring order: slot 0 is still in use
    pool.release(first)
    assert pool.reserve() == 0 and pool.in_use() == 1


def test_a_ready_run_can_grow_only_into_the_next_free_slot_before_the_rings_end():
    pool = image_pool(4)
    fill(pool, 2)
    assert pool.ready_run_can_grow()  # slot 2 is the next handed out
    slot = pool.reserve()
    assert pool.ready_run_can_grow()  # being written: it joins the run
    pool.write(slot, [torch.zeros(3, 4, 4)])
    fill(pool, 1)
    assert not pool.ready_run_can_grow()  # full: whoever arrives waits for a batch to finish
    pool.release(pool.take(3))
    assert not pool.ready_run_can_grow()  # slot 3 ends the ring; the next inputs wrap to 0
    pool.release(pool.take(1))
    fill(pool, 1)
    other = pool.take(1)
    fill(pool, 1)
    assert pool.ready_run_can_grow()  # slot 1 ready, slot 2 free and next
    pool.release(other)


def test_runs_never_wrap_around_the_ring():
    pool = image_pool(4)
    fill(pool, 3)
    pool.release(pool.take(3))
    fill(pool, 3, start_value=10)  # slots 3, 0, 1
    assert pool.ready() == 1  # only slot 3 before the end of the ring
    assert pool.take(1) == Run(3, 1)
    assert pool.ready() == 2  # slots 0 and 1 after the wrap
    (batch,) = pool.views(pool.take(2))
    assert [float(batch[i, 0, 0, 0]) for i in range(2)] == [11.0, 12.0]


def test_pool_refuses_misuse():
    pool = image_pool(2)
    with pytest.raises(RuntimeError, match="not reserved"):
        pool.write(0, [torch.zeros(3, 4, 4)])
    slot = pool.reserve()
    with pytest.raises(ValueError, match="does not match"):
        pool.write(slot, [torch.zeros(3, 5, 5)])
    pool.write(slot, [torch.zeros(3, 4, 4)])
    run = pool.take(1)
    pool.release(run)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(run)
    with pytest.raises(ValueError):
        pool.take(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_pool_lives_on_the_gpu():
    pool = InputPool([((3, 4, 4), torch.float32)], 4, device="cuda")
    for value in (1.0, 2.0):
        pool.write(pool.reserve(), [torch.full((3, 4, 4), value)])
    run = pool.take(2)
    stream = torch.cuda.Stream()
    pool.wait_copied(run, stream)  # the engine's stream waits on the copy stream's per-slot events
    with torch.cuda.stream(stream):
        (batch,) = pool.views(run)
        total = batch.sum(dim=(1, 2, 3))
    stream.synchronize()
    assert batch.is_cuda and total.tolist() == [48.0, 96.0]
