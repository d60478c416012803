"""DVABatch's merging of length classes (``handlers/dvabatch/merge.py``, ``overhead.py``), on plain data."""

from __future__ import annotations

import itertools
import random

import pytest

from handlers.dvabatch.merge import MIX_HALF_LIFE_BATCHES, LengthClassMerger, batches_ms, merge_classes
from handlers.dvabatch.overhead import RunOverhead

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


def brute_force(counts, rows_ms) -> float:
    """The least total over every assignment of each class with rows to itself or a longer class with rows."""
    k = len(counts)
    ends = [j for j in range(k) if counts[j]]
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


def test_the_cut_is_the_least_total_time_of_every_assignment_on_random_costs():
    rng = random.Random(3)
    for _ in range(300):
        k = rng.randint(1, 5)
        counts = [rng.choice([0, 0, 1, 2, 5, 17]) for _ in range(k)]
        fixed = [rng.uniform(0, 2) for _ in range(k)]
        slope = sorted(rng.uniform(0, 0.5) for _ in range(k))

        def rows_ms(j, rows, fixed=fixed, slope=slope):
            return fixed[j] + slope[j] * rows

        target = merge_classes(counts, rows_ms)
        assert all(t >= i for i, t in enumerate(target))
        assert all(target[i] == i for i in range(k) if counts[i] == 0)
        assert total(counts, target, rows_ms) == pytest.approx(brute_force(counts, rows_ms))


def test_rows_past_the_largest_batch_are_costed_as_the_batches_they_make():
    def batch_ms(rows: int) -> float:
        return 1.0 + 0.1 * rows

    assert batches_ms(batch_ms, 0, 8) == 0.0
    assert batches_ms(batch_ms, 8, 8) == pytest.approx(1.8)
    assert batches_ms(batch_ms, 19, 8) == pytest.approx(2 * 1.8 + 1.3)


class Priced:
    """An engine as the merger sees it: one batch's time by its rows (below one row, a share of one row's
    batch, as ``SegmentProfile.ms`` has it: a class expected in a tenth of the batches costs a tenth)."""

    def __init__(self, batch_ms, overhead_ms: float = 0.0) -> None:
        self.batch_ms = batch_ms
        self.overhead_ms = overhead_ms

    def run_overhead_ms(self) -> tuple[float, float]:
        return self.overhead_ms, 1.0 if self.overhead_ms else 0.0


def merger(per: str) -> LengthClassMerger:
    def cost(length):
        if per == "batch":
            return lambda rows: min(rows, 1.0) + 0.001 * length * rows
        return lambda rows: 0.1 * length * rows

    return LengthClassMerger([(n, Priced(cost(n))) for n in LENGTHS], max_batch=16, stages=2)


def test_a_burst_of_one_class_runs_where_the_recent_mix_runs_not_apart_for_want_of_partners():
    """A closed loop answers a batch's clients together, and they send again together: a burst of one
    class.  Decided on the burst alone it would keep its own batch for good; on the mix it joins the rest."""
    host_bound = merger("batch")
    assert host_bound.targets([3, 4, 2, 1]) == [3, 3, 3, 3]
    assert host_bound.targets([5, 0, 0, 0]) == [3, 3, 3, 3]  # the lone class goes where the mix goes
    compute_bound = merger("token")
    assert compute_bound.targets([3, 4, 2, 1]) == [0, 1, 2, 3]
    assert compute_bound.targets([5, 0, 0, 0]) == [0, 1, 2, 3]


def test_the_mix_forgets_lengths_no_longer_sent():
    host_bound = merger("batch")
    host_bound.targets([0, 0, 0, 16])
    assert host_bound.targets([8, 0, 0, 0]) == [3, 1, 2, 3]
    for _ in range(20 * MIX_HALF_LIFE_BATCHES):  # only the shortest class for many batches
        host_bound.targets([16, 0, 0, 0])
    assert host_bound.targets([16, 0, 0, 0]) == [0, 1, 2, 3]  # it no longer pads to a length nobody sends


def test_what_a_run_costs_beyond_its_profiled_stage_tips_classes_into_one_batch():
    """Profiled stage times alone keep the longest class apart; a run's measured cost beyond them, paid
    once per batch, makes one padded batch the cheaper."""

    def cost(length):
        return lambda rows: 0.25 * min(rows, 1.0) + 0.02 * length * rows / 32

    profiled_only = LengthClassMerger([(n, Priced(cost(n))) for n in LENGTHS], max_batch=32, stages=2)
    assert len(set(profiled_only.targets([10, 11, 8, 3]))) > 1
    served = LengthClassMerger([(n, Priced(cost(n), overhead_ms=0.3)) for n in LENGTHS], max_batch=32, stages=2)
    assert served.batch_overhead_ms() == pytest.approx(0.6)
    assert served.targets([10, 11, 8, 3]) == [3, 3, 3, 3]


def test_a_runs_overhead_is_the_intercept_of_its_extra_time_against_its_rows():
    fit = RunOverhead()
    assert fit.per_run_ms() == 0.0 and fit.weight == 0.0
    for rows in (1, 4, 16, 32, 8, 2) * 20:
        fit.observe(rows, 0.5 + 0.01 * rows)
    assert fit.per_run_ms() == pytest.approx(0.5)
    same = RunOverhead()
    for _ in range(10):
        same.observe(32, 0.9)  # all full batches: a run's cost and a row's cannot be told apart
    assert same.per_run_ms() == pytest.approx(0.9)
    negative = RunOverhead()
    for rows in (1, 32) * 5:
        negative.observe(rows, -0.1)  # runs faster than profiled: nothing to add
    assert negative.per_run_ms() == 0.0


def test_older_runs_weigh_less_so_the_fit_follows_a_change():
    fit = RunOverhead(half_life_runs=10)
    for rows in (1, 32) * 50:
        fit.observe(rows, 2.0)
    for rows in (1, 32) * 50:
        fit.observe(rows, 0.2)
    assert fit.per_run_ms() == pytest.approx(0.2, abs=0.01)
