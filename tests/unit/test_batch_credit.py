"""The batch-credit rule: a larger batch is planned for only when its gain exceeds its passes' spread."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from packrat_plugin.batch_credit import credit_batches, pass_range
from packrat_plugin.levels import levels_for
from packrat_plugin.optimizer import KnapsackOptimizer, serving_costs
from packrat_plugin.profile import Profile, ProfilePoint

# The brief 3-pass ResNet-50 profile of a 2-vCPU EPYC (logs/profiles/resnet50.json): each pass's median round, ms.
EPYC_PASSES = {
    (1, 1): [193.85, 189.35, 154.82],
    (1, 2): [322.98, 332.50, 349.67],
    (1, 4): [673.49, 780.23, 689.38],
    (1, 8): [1240.87, 1388.81, 1377.13],
    (2, 1): [98.04, 106.21, 125.19],
    (2, 2): [193.74, 201.85, 207.26],
    (2, 4): [350.24, 351.01, 404.31],
    (2, 8): [916.25, 760.52, 792.35],
}


def profile_of(passes: dict[tuple[int, int], list[float]], handler_ms: float = 0.0) -> Profile:
    points = tuple(
        ProfilePoint(t, b, sorted(ms)[len(ms) // 2], {"pass_ms": ms} if len(ms) > 1 else {})
        for (t, b), ms in passes.items()
    )
    meta = {"handler": {"per_request_ms": {"1": handler_ms, "2": handler_ms}}} if handler_ms else {}
    return Profile("resnet50", points, meta=meta)


def test_on_the_epyc_profile_no_batch_beats_batch_one_beyond_the_spread_so_the_levels_are_the_two_static_settings():
    raw = profile_of(EPYC_PASSES, handler_ms=4.3)
    credited, dropped = credit_batches(raw)
    assert sorted((p.threads, p.batch) for p in credited.points) == [(1, 1), (2, 1)]
    assert {(u.threads, u.batch, u.against_batch) for u in dropped} == {(t, b, 1) for t in (1, 2) for b in (2, 4, 8)}
    assert "⟨1,2⟩ not credited" in next(u for u in dropped if (u.threads, u.batch) == (1, 2)).describe()

    def plans(profile):
        optimizer = KnapsackOptimizer(profile, serving_costs(profile))
        return [lv.plan.describe() for lv in levels_for(optimizer, 2, 16)]

    # By the medians, the rise went to two ⟨1 thread, batch 2⟩ workers; credited, to one ⟨1, 1⟩ per core.
    assert any("2×⟨1t, 2b⟩" in d or "⟨1,2⟩" in d for d in plans(raw)) or len(plans(raw)) > 2
    assert len(plans(credited)) == 2


def test_a_gain_beyond_the_spread_is_credited_and_a_larger_batch_is_judged_against_the_last_one_kept():
    passes = {
        (1, 1): [100.0, 104.0, 110.0],
        (1, 2): [196.0, 200.0, 216.0],  # 98-108 per request against 100-110: within the spread
        (1, 4): [300.0, 310.0, 320.0],  # 75-80 per request: beats batch 1's fastest, 100
        (1, 8): [590.0, 600.0, 610.0],  # 73.8-76.3: within batch 4's 75-80
    }
    credited, dropped = credit_batches(profile_of(passes))
    assert sorted(p.batch for p in credited.points) == [1, 4]
    assert [(u.batch, u.against_batch) for u in dropped] == [(2, 1), (8, 4)]


def test_a_point_measured_once_carries_no_spread_and_is_kept():
    passes = {(1, 1): [100.0], (1, 2): [199.0], (2, 1): [60.0, 70.0], (2, 2): [118.0]}
    credited, dropped = credit_batches(profile_of(passes))
    assert len(credited.points) == 4 and dropped == []


@given(
    st.dictionaries(
        st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8])),
        st.lists(st.floats(min_value=1.0, max_value=1000.0), min_size=1, max_size=4),
        min_size=1,
    )
)
def test_every_thread_count_keeps_its_smallest_batch_and_each_kept_batch_beats_the_one_below_beyond_both_spreads(
    passes,
):
    raw = profile_of(passes)
    credited, dropped = credit_batches(raw)
    assert len(credited.points) + len(dropped) == len(raw.points)
    for threads in raw.threads:
        row = sorted((p for p in credited.points if p.threads == threads), key=lambda p: p.batch)
        assert row[0].batch == min(p.batch for p in raw.points if p.threads == threads)
        for lower, upper in zip(row, row[1:], strict=False):
            a, b = pass_range(lower), pass_range(upper)
            assert a is None or b is None or b[1] < a[0]
