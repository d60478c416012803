"""Orca's iteration-level scheduler (Algorithm 2) on plain data: FCFS, KV reservations, no deadlock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.orca.kv_cache import KVCache, KVShape
from handlers.orca.scheduler import GenerationRequest, IterationScheduler


def scheduler(max_batch: int, slots: int) -> tuple[IterationScheduler, KVCache]:
    kv = KVCache(KVShape(layers=1, heads=1, head_dim=1, slots=slots, max_tokens=8))
    return IterationScheduler(max_batch, kv.allocate, kv.release, lambda: kv.free), kv


def request(new_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest(prompt=(1, 2), max_new_tokens=new_tokens)


def test_the_oldest_requests_run_and_newcomers_join_at_the_next_iteration():
    s, _ = scheduler(max_batch=2, slots=4)
    a, b, c = request(), request(), request()
    s.add(a)
    assert s.select() == [a]
    s.add(b)
    s.add(c)
    assert s.select() == [a, b]  # max_batch 2: c waits, though a slot is free
    s.finish(a)
    assert s.select() == [b, c]


def test_a_request_waits_for_a_kv_slot_and_nobody_overtakes_it():
    s, kv = scheduler(max_batch=4, slots=1)
    a, b, c = request(), request(), request()
    for r in (a, b, c):
        s.add(r)
    assert s.select() == [a] and kv.free == 0
    assert s.select() == [a]  # b cannot reserve; c, behind it, does not start first
    s.finish(a)
    assert kv.free == 1 and s.select() == [b] and not c.started


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int]]:
    return draw(st.lists(st.tuples(st.sampled_from(["add", "step", "finish"]), st.integers(0, 9)), max_size=60))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), operations())
def test_selection_is_always_a_prefix_of_the_pool_in_arrival_order(max_batch, slots, ops):
    s, kv = scheduler(max_batch, slots)
    started_order: list[int] = []
    for op, k in ops:
        if op == "add":
            s.add(request())
        elif op == "finish" and s.pool:
            running = [r for r in s.pool if r.started]
            if running:
                s.finish(running[k % len(running)])
        else:
            before = {id(r) for r in s.pool if r.started}
            batch = s.select()
            assert batch == s.pool[: len(batch)]  # FCFS over the whole pool
            assert len(batch) <= max_batch
            assert all(r.started for r in batch)
            assert sum(r.started for r in s.pool) <= slots  # reservations never exceed the KV slots
            started_order += [r.arrival for r in batch if id(r) not in before]
            # Running requests always make progress: each is in the batch unless max_batch is full.
            assert all(r in batch for r in s.pool if id(r) in before) or len(batch) == max_batch
    assert started_order == sorted(started_order)  # nobody started before an older request


def test_requests_beyond_the_kv_slots_all_finish_without_deadlock():
    s, kv = scheduler(max_batch=3, slots=2)
    requests = [request(new_tokens=n) for n in (4, 1, 3, 2, 5, 1)]
    for r in requests:
        s.add(r)
    iterations = 0
    while s.pool:
        iterations += 1
        assert iterations < 100, "no progress"
        for r in s.select():
            r.generated.append(0)
            r.cached += 1
            if r.finished:
                s.finish(r)
    assert all(r.finished for r in requests) and kv.free == 2


def test_request_level_batching_lets_nobody_join_a_batch_in_progress():
    kv = KVCache(KVShape(layers=1, heads=1, head_dim=1, slots=4, max_tokens=8))
    s = IterationScheduler(2, kv.allocate, kv.release, lambda: kv.free, iteration_level=False)
    a, b, c = request(), request(), request()
    s.add(a)
    assert s.select() == [a]
    s.add(b)
    s.add(c)
    assert s.select() == [a]  # b waits for a's batch to end, though there is room
    s.finish(a)
    assert s.select() == [b, c]
