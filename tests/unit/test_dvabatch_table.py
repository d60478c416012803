"""DVABatch's batch table: new, stretch, split and the bookkeeping between stages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.dvabatch.batch_table import BatchTable, BatchTableError, Merge


def run_stage(table, batch_id):
    table.start(batch_id)
    return table.finish_stage(batch_id)


def test_a_new_batch_stands_before_stage_zero():
    table = BatchTable(3)
    a = table.new(["r0", "r1"], now=1.0)
    assert (a.stage, a.running, a.completed, a.size) == (0, False, [0, 0, 0], 2)
    assert table.waiting_at(0) == [a] and table.latest() is a
    with pytest.raises(BatchTableError):
        table.new([], now=1.0)


def test_stretch_catches_up_and_merges_where_the_target_waits():
    table = BatchTable(3)
    a = table.new(["a0", "a1"], now=0.0)
    run_stage(table, a.id)  # a waits before stage 1
    b = table.stretch(["b0"], a.id, now=0.05, t_comp_wait=0.1)
    assert b is not a and b.joins == a.id and b.stage == 0
    merge = run_stage(table, b.id)  # b catches up: both idle before stage 1
    assert merge == [Merge(target=a.id, catch_up=b.id, stage=1)]
    assert a.requests == ["a0", "a1", "b0"] and a.completed == [3, 0, 0]
    assert b.id not in {e.id for e in table}


def test_a_catch_up_does_not_merge_while_its_target_runs_and_meets_it_later():
    table = BatchTable(3)
    a = table.new(["a0"], now=0.0)
    run_stage(table, a.id)
    b = table.stretch(["b0"], a.id, now=0.01, t_comp_wait=1.0)
    table.start(a.id)  # a runs stage 1
    assert run_stage(table, b.id) == []  # b is before stage 1 too, but a is busy there
    merge = table.finish_stage(a.id)  # a is now before stage 2; b still before 1
    assert merge == []
    merge = run_stage(table, b.id)  # b reaches stage 2 where a waits
    assert merge == [Merge(a.id, b.id, 2)] and a.requests == ["a0", "b0"]


def test_stretch_before_the_target_started_joins_it_outright():
    table = BatchTable(2)
    a = table.new(["a0"], now=0.0)
    assert table.stretch(["b0"], a.id, now=0.01, t_comp_wait=1.0) is a
    assert a.requests == ["a0", "b0"] and len(table) == 1


def test_stretch_is_refused_after_t_comp_wait_and_for_finished_batches():
    table = BatchTable(2)
    a = table.new(["a0"], now=0.0)
    run_stage(table, a.id)
    assert table.stretch(["late"], a.id, now=0.2, t_comp_wait=0.1) is None
    assert len(table) == 1  # nothing entered
    run_stage(table, a.id)
    assert table.stretch(["x"], a.id, now=0.0, t_comp_wait=1.0) is None  # a finished
    assert table.complete(a.id) == ["a0"]
    assert table.stretch(["x"], a.id, now=0.0, t_comp_wait=1.0) is None  # a gone


def test_split_parts_inherit_rows_creation_stage_and_completed_counts():
    table = BatchTable(4)
    a = table.new(["r0", "r1", "r2", "r3"], now=2.5)
    run_stage(table, a.id)
    run_stage(table, a.id)
    left, right = table.split(a.id, [2, 2])
    assert left.requests == ["r0", "r1"] and right.requests == ["r2", "r3"]
    for part in (left, right):
        assert part.created == 2.5 and part.stage == 2 and part.parent == a.id
        assert part.completed == [2, 2, 0, 0]
    with pytest.raises(BatchTableError):
        table[a.id]
    table.start(left.id)
    with pytest.raises(BatchTableError, match="running"):
        table.split(left.id, [1, 1])
    with pytest.raises(BatchTableError, match="cannot split"):
        table.split(right.id, [1, 2])


def test_a_catch_up_follows_the_first_part_of_a_split_target_and_goes_alone_if_it_finishes():
    table = BatchTable(2)
    a = table.new(["a0", "a1"], now=0.0)
    run_stage(table, a.id)
    b = table.stretch(["b0"], a.id, now=0.0, t_comp_wait=1.0)
    first, second = table.split(a.id, [1, 1])
    assert b.joins == first.id
    run_stage(table, first.id)
    table.complete(first.id)
    assert b.joins is None  # too late: it finishes on its own
    run_stage(table, b.id)
    run_stage(table, b.id)
    assert table.complete(b.id) == ["b0"]


def test_complete_refuses_an_unfinished_batch():
    table = BatchTable(2)
    a = table.new(["a0"], now=0.0)
    run_stage(table, a.id)
    with pytest.raises(BatchTableError, match="not finished"):
        table.complete(a.id)
    with pytest.raises(BatchTableError, match="not running"):
        table.finish_stage(a.id)


OPS = st.lists(
    st.tuples(st.sampled_from(["new", "stretch", "split", "run"]), st.integers(0, 50), st.floats(0.0, 0.3)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_every_request_is_in_exactly_one_place_whatever_the_operations(ops):
    stages = 3
    table = BatchTable(stages)
    sent, done, now, counter = [], [], 0.0, 0
    for op, pick, dt in ops:
        now += dt
        entries = list(table)
        if op == "new" or (op == "stretch" and not entries):
            reqs = [counter, counter + 1]
            counter += 2
            table.new(reqs, now)
            sent += reqs
        elif op == "stretch":
            target = entries[pick % len(entries)]
            reqs = [counter]
            counter += 1
            if table.stretch(reqs, target.id, now, t_comp_wait=0.5) is not None:
                sent += reqs
        elif op == "split" and entries:
            entry = entries[pick % len(entries)]
            if entry.size >= 2 and not entry.running:
                cut = 1 + pick % (entry.size - 1)
                table.split(entry.id, [cut, entry.size - cut])
        elif op == "run" and entries:
            entry = entries[pick % len(entries)]
            if entry.stage < stages:
                run_stage(table, entry.id)
            else:
                done += table.complete(entry.id)
        for entry in table:
            assert entry.completed == [entry.size if s < entry.stage else 0 for s in range(stages)]
            if entry.joins is not None:
                assert entry.joins in {e.id for e in table}
    in_flight = [r for e in table for r in e.requests]
    assert sorted(in_flight + done) == sorted(sent)
    assert len(set(in_flight + done)) == len(sent)
