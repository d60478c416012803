"""Orca's iteration-level scheduler (Algorithm 2) over KV blocks, on plain data: FCFS, growth, preemption."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.orca.kv_blocks import BlockAllocator
from handlers.orca.scheduler import GenerationRequest, IterationScheduler


def scheduler(max_batch: int, blocks: int, block_size: int = 2, iteration_level: bool = True) -> IterationScheduler:
    return IterationScheduler(max_batch, BlockAllocator(blocks, block_size), iteration_level=iteration_level)


def request(new_tokens: int = 3, prompt: tuple[int, ...] = (1, 2)) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=new_tokens)


def iterate(s: IterationScheduler) -> list[GenerationRequest]:
    """One iteration as the engine runs it: each chosen request's new tokens cached, one token made."""
    batch = s.select()
    for r in batch:
        r.cached += len(r.next_tokens())
        r.generated.append(0)
        if r.finished:
            s.finish(r)
    return batch


def test_the_oldest_requests_run_and_newcomers_join_at_the_next_iteration():
    s = scheduler(max_batch=2, blocks=8)
    a, b, c = request(), request(), request()
    s.add(a)
    assert s.select() == [a]
    s.add(b)
    s.add(c)
    assert s.select() == [a, b]  # max_batch 2: c waits, though blocks are free
    s.finish(a)
    assert s.select() == [b, c]


def test_a_request_gets_blocks_as_it_grows_not_for_its_whole_life():
    s = scheduler(max_batch=1, blocks=8, block_size=2)
    a = request(new_tokens=5)
    s.add(a)
    held = []
    while s.pool:
        iterate(s)
        held.append(s.blocks.in_use)
    # Positions 0-1 (the prompt), then 2, 3, 4 (each fed the token before): blocks of two, taken as they fill;
    # the fifth token is made and the request ends, its blocks back.
    assert held == [1, 2, 2, 3, 0]


def test_a_request_waits_for_blocks_and_nobody_overtakes_it():
    s = scheduler(max_batch=4, blocks=3, block_size=2)
    a, b, c = request(2, (1, 2, 3)), request(2, (1, 2, 3)), request(2, (1,))
    for r in (a, b, c):
        s.add(r)
    assert s.select() == [a] and s.blocks.free == 1  # b needs two blocks; c, behind it, does not start first
    s.finish(a)
    assert s.select() == [b] and not c.started  # c would leave no block of headroom for b to grow into


def test_the_newest_running_request_gives_its_blocks_back_when_an_older_one_needs_one():
    s = scheduler(max_batch=2, blocks=4, block_size=2)
    a, b = request(new_tokens=6), request(new_tokens=6)
    s.add(a)
    s.add(b)
    assert [iterate(s) for _ in range(3)] == [[a, b]] * 3  # two blocks each by the third: memory full
    assert iterate(s) == [a]  # a grows into a third block; b, the newest, gives its two back and waits
    assert not b.started and b.preemptions == 1 and b.cached == 0 and b.generated == [0, 0, 0]
    assert b.next_tokens() == (1, 2, 0, 0, 0)  # it computes its prompt and the tokens it made again
    while a in s.pool:
        iterate(s)
    assert iterate(s) == [b] and b.started and s.preemptions == 1


def test_a_request_that_could_never_fit_is_refused_when_added():
    s = scheduler(max_batch=2, blocks=3, block_size=2)
    try:
        s.add(request(new_tokens=6))  # up to 7 positions: four blocks of two
    except ValueError as err:
        assert "4 blocks" in str(err)
    else:
        raise AssertionError("a request larger than the KV memory was taken")


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, int]]:
    return draw(st.lists(st.tuples(st.sampled_from(["add", "step", "finish"]), st.integers(0, 9)), max_size=60))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(4, 12), operations())
def test_selection_is_always_a_prefix_of_the_pool_in_arrival_order(max_batch, blocks, ops):
    s = scheduler(max_batch, blocks, block_size=2)
    first_starts: list[int] = []
    for op, k in ops:
        if op == "add":
            s.add(request(new_tokens=1 + k % 5, prompt=tuple(range(1 + k % 3))))
        elif op == "finish" and s.pool:
            running = [r for r in s.pool if r.started]
            if running:
                s.finish(running[k % len(running)])
        else:
            before = {id(r) for r in s.pool if r.started}
            batch = s.select()
            assert batch == s.pool[: len(batch)]  # FCFS over the whole pool
            assert len(batch) <= max_batch and all(r.started for r in batch)
            assert all(len(r.blocks) * 2 >= r.length for r in batch)  # blocks for every position it will hold
            assert sum(len(r.blocks) for r in s.pool) == s.blocks.in_use <= blocks
            first_starts += [r.arrival for r in batch if id(r) not in before and not r.preemptions]
            for r in batch:
                r.cached += len(r.next_tokens())
                r.generated.append(0)
                if r.finished:
                    s.finish(r)
    assert first_starts == sorted(first_starts)  # nobody started before an older request


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(0, 3))
def test_requests_beyond_the_kv_blocks_all_finish_without_deadlock(max_batch, lengths, spare):
    size, longest = 2, 2 + 6
    s = scheduler(max_batch, blocks=longest // size + spare, block_size=size)  # one request's worth, and a few
    requests = [request(new_tokens=n) for n in lengths]
    for r in requests:
        s.add(r)
    iterations = 0
    while s.pool:
        iterations += 1
        assert iterations < 500, "no progress"
        iterate(s)
    assert all(r.finished for r in requests) and s.blocks.free == s.blocks.blocks


def test_request_level_batching_lets_nobody_join_a_batch_in_progress():
    s = scheduler(max_batch=2, blocks=8, iteration_level=False)
    a, b, c = request(), request(), request()
    s.add(a)
    assert s.select() == [a]
    s.add(b)
    s.add(c)
    assert s.select() == [a]  # b waits for a's batch to end, though there is room
    s.finish(a)
    assert s.select() == [b, c]
