"""DVABatch's merging of length classes per hand-over (``handlers/dvabatch/merge.py``): the pure decision."""

from __future__ import annotations

import itertools
import random

import pytest

from handlers.dvabatch.merge import batches_ms, merge_classes

LENGTHS = (4, 8, 16, 32)


def per_batch(j: int, rows: int) -> float:
    """A host-bound batch: its cost mostly per batch, a little per padded token."""
    return 1.0 + 0.001 * LENGTHS[j] * rows


def per_token(j: int, rows: int) -> float:
    """A compute-bound batch: its cost mostly per padded token."""
    return 0.01 + 0.1 * LENGTHS[j] * rows


def total(counts, target, rows_ms) -> float:
    runs: dict[int, int] = {}
    for i, n in enumerate(counts):
        if n:
            runs[target[i]] = runs.get(target[i], 0) + n
    return sum(rows_ms(j, n) for j, n in runs.items())


def brute_force(counts, rows_ms, joinable) -> float:
    """The least total over every assignment of each class with rows to itself or a longer class that may
    end a run (the DP's cut into adjacent runs must reach it)."""
    k = len(counts)
    ends = [j for j in range(k) if counts[j] or joinable[j]]
    choices = [[j for j in ends if j >= i] if counts[i] else [i] for i in range(k)]
    return min(total(counts, target, rows_ms) for target in itertools.product(*choices))


def test_where_a_batch_costs_mostly_per_batch_every_class_runs_padded_to_the_longest():
    assert merge_classes([10, 11, 8, 3], per_batch) == [3, 3, 3, 3]
    assert merge_classes([1, 0, 1, 0], per_batch) == [2, 1, 2, 3]  # the run ends at its longest class with rows


def test_where_a_batch_costs_mostly_per_token_each_class_keeps_its_own_batch():
    assert merge_classes([10, 11, 8, 3], per_token) == [0, 1, 2, 3]


def test_a_tie_keeps_the_classes_apart():
    assert merge_classes([2, 2], lambda j, rows: 1.0) == [1, 1]  # one batch is cheaper than two
    assert merge_classes([2, 2], lambda j, rows: 0.5 * rows) == [0, 1]  # the same either way: apart


def test_rows_join_a_longer_classs_unstarted_batch_where_that_adds_less_than_a_batch_of_their_own():
    def added(j: int, rows: int) -> float:  # class 3 holds unstarted rows: new rows add only their own cost
        return 0.001 * LENGTHS[j] * rows if j == 3 else per_batch(j, rows)

    assert merge_classes([1, 0, 0, 0], added, [False, False, False, True]) == [3, 1, 2, 3]
    assert merge_classes([1, 0, 0, 0], added) == [0, 1, 2, 3]  # not joinable: nothing to join
    assert merge_classes([0, 0, 0, 0], added, [True] * 4) == [0, 1, 2, 3]


def test_the_cut_is_the_least_total_time_of_every_assignment_on_random_costs():
    rng = random.Random(3)
    for _ in range(300):
        k = rng.randint(1, 5)
        counts = [rng.choice([0, 0, 1, 2, 5, 17]) for _ in range(k)]
        joinable = [rng.random() < 0.3 for _ in range(k)]
        fixed = [rng.uniform(0, 2) for _ in range(k)]
        slope = sorted(rng.uniform(0, 0.5) for _ in range(k))

        def rows_ms(j, rows, fixed=fixed, slope=slope):
            return fixed[j] + slope[j] * rows

        target = merge_classes(counts, rows_ms, joinable)
        assert all(t >= i for i, t in enumerate(target))
        assert all(target[i] == i for i in range(k) if counts[i] == 0)
        assert total(counts, target, rows_ms) == pytest.approx(brute_force(counts, rows_ms, joinable))


def test_rows_past_the_largest_batch_are_costed_as_the_batches_they_make():
    def batch_ms(rows: int) -> float:
        return 1.0 + 0.1 * rows

    assert batches_ms(batch_ms, 0, 8) == 0.0
    assert batches_ms(batch_ms, 8, 8) == pytest.approx(1.8)
    assert batches_ms(batch_ms, 19, 8) == pytest.approx(2 * 1.8 + 1.3)
