"""How REEF's SM split is sized: the driver's grid, the candidates measured, the partition kept (pure logic)."""

from __future__ import annotations

import pytest
import torch

from handlers.reef.config import BEST_EFFORT, REALTIME, ReefConfig
from handlers.reef.engine import ReefEngine
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.sm_partition import SmGrid, candidates, choose_rt_sms, unavailable_reason
from tests.unit.test_reef_engine import Small, expected, member, request

H100 = SmGrid(total=132, minimum=8, step=8)  # compute capability 9.0's documented split rule


def test_a_requested_count_becomes_the_next_group_the_driver_makes_and_leaves_best_effort_its_minimum():
    assert H100.rt_counts()[0] == 8 and H100.rt_counts()[-1] == 120  # 132 - 120 = 12 ≥ 8 left for BE
    assert H100.rounded(1) == 8
    assert H100.rounded(8) == 8
    assert H100.rounded(9) == 16
    assert H100.rounded(130) == 120  # more than a split can give: the largest that leaves BE a group
    with pytest.raises(ValueError, match="at least one SM"):
        H100.rounded(0)
    with pytest.raises(ValueError, match="cannot be split"):
        SmGrid(total=12, minimum=8, step=8).rounded(8)


def test_candidates_spread_over_the_grid_smallest_first_and_include_both_ends():
    picked = candidates(H100, points=8)
    assert picked == sorted(set(picked)) and len(picked) == 8
    assert picked[0] == 8 and picked[-1] == 120
    assert all(n in H100.rt_counts() for n in picked)
    small = SmGrid(total=40, minimum=8, step=8)
    assert candidates(small) == [8, 16, 24, 32]


def test_the_fewest_sms_within_tolerance_are_kept_else_the_largest_measured():
    timings = {8: 3.0, 24: 1.3, 40: 1.04, 56: 1.01}
    assert choose_rt_sms(1.0, timings, tolerance=1.05) == 40
    assert choose_rt_sms(1.0, timings, tolerance=1.5) == 24
    assert choose_rt_sms(0.5, timings, tolerance=1.05) == 56  # none within: RT loses the least on the largest
    with pytest.raises(ValueError, match="no partition"):
        choose_rt_sms(1.0, {})


def test_green_contexts_are_refused_with_a_reason_off_cuda():
    assert "CUDA device" in unavailable_reason(torch.device("cpu"))


def test_on_cpu_rt_sms_is_ignored_and_reef_keeps_its_preemption_gate():
    members = [member("small", Small(), (6,)), member("other", Small(), (6,))]
    config = ReefConfig(segments=3, rt_max_batch=2, be_max_batch=2, rt_sms="auto")
    eng = ReefEngine(members, ExecutionDevice("cpu"), config, HandlerMetrics(None, "test"), cpu_threads=2)
    eng.warm_up()
    try:
        assert eng.partition is None and eng._gated
        for seed, priority in enumerate([REALTIME, BEST_EFFORT, REALTIME]):
            x, future = request(eng, "small", priority, seed)
            assert torch.allclose(future.result(10.0), expected(eng, "small", x), atol=1e-5)
    finally:
        eng.close(5.0)
