"""The burst path's stage tally keeps the totals ``stage_breakdown`` gives, handed over once per loop turn."""

from __future__ import annotations

import asyncio
import random

import pytest

from handlers.runtime.engine import StageTimes, stage_breakdown
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_intake import BatchTimes
from handlers.runtime.stage_tally import StageTally


class CountingMetrics(HandlerMetrics):
    def __init__(self) -> None:
        super().__init__(None, "m")
        self.handed_over = 0

    def stage_sums(self, seconds: dict[str, float], requests: int) -> None:
        self.handed_over += 1
        super().stage_sums(seconds, requests)


def requests(count: int, seed: int) -> list[tuple]:
    """Timestamps of requests in any order, some engines reporting no inner times, some stages negative
    (an encode time larger than what it is subtracted from), so every clamp is exercised."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        received = rng.uniform(0, 1)
        decoded, admitted = received + rng.uniform(-0.01, 0.1), received + rng.uniform(0, 0.2)
        times = None
        if rng.random() < 0.7:
            times = StageTimes(rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0, 1),
                               rng.uniform(0, 0.3))  # fmt: skip
            if rng.random() < 0.1:
                times.started = None  # a batch that never started: untimed
        woken = admitted + rng.uniform(-0.05, 1)
        out.append((received, decoded, admitted, times, woken, woken + rng.uniform(-0.01, 0.05)))
    return out


def test_the_tally_keeps_the_totals_and_counts_of_one_breakdown_per_request() -> None:
    async def main() -> tuple[HandlerMetrics, CountingMetrics]:
        each, tallied = HandlerMetrics(None, "m"), CountingMetrics()
        tally = StageTally(tallied, asyncio.get_running_loop())
        for request in requests(500, seed=3):
            each.stages(stage_breakdown(*request))
            tally.add(*request)
        await asyncio.sleep(0)  # the turn ends: the tally's flush runs
        return each, tallied

    each, tallied = asyncio.run(main())
    assert tallied.stage_counts == each.stage_counts
    assert set(each.stage_counts) == {"decode", "admission", "queue", "batch", "release", "wakeup", "encode", "engine"}
    assert dict(tallied.stage_seconds) == pytest.approx(dict(each.stage_seconds), rel=1e-9)
    assert tallied.handed_over == 2  # one turn: the timed requests' sums and the untimed ones', once each


def test_a_turns_sums_reach_the_metrics_before_a_coroutine_woken_by_its_answers() -> None:
    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        metrics = CountingMetrics()
        tally = StageTally(metrics, loop)
        seen: list[int] = []
        for turn in range(3):
            answer = loop.create_future()

            async def client(answer: asyncio.Future = answer) -> None:
                await answer
                seen.append(metrics.stage_counts["decode"])

            waiting = asyncio.ensure_future(client())
            await asyncio.sleep(0)  # the client waits for its answer
            for request in requests(4, seed=turn):  # a batch's answers, delivered in one turn
                tally.add(*request)
            answer.set_result(None)
            await waiting
        assert metrics.handed_over <= 6
        return seen

    assert asyncio.run(main()) == [4, 8, 12]


def test_flushing_with_nothing_added_hands_nothing_over() -> None:
    metrics = CountingMetrics()
    loop = asyncio.new_event_loop()
    try:
        StageTally(metrics, loop).flush()
    finally:
        loop.close()
    assert metrics.handed_over == 0 and not metrics.stage_counts


def test_a_request_taken_undecoded_counts_its_wait_as_queue_and_its_batch_decode_as_decode() -> None:
    """``add_taken``: queue from receipt to the batch's start, decode inside the batch, no admission, and
    the batch, release, wakeup and encode stages as ``stage_breakdown`` counts them for an engine's times."""
    times = BatchTimes(taken=1.0)
    times.decoded, times.finished, times.settled, times.encode_seconds = 1.25, 2.0, 2.5, 0.125
    expected = {"decode": 0.25, "admission": 0.0, "queue": 0.5, "batch": 0.75, "release": 0.375, "wakeup": 0.5,
                "encode": 0.375}  # fmt: skip

    async def main() -> HandlerMetrics:
        metrics = HandlerMetrics(None, "m")
        tally = StageTally(metrics, asyncio.get_running_loop())
        tally.add_taken(0.5, times, woken=3.0, answered=3.25)
        tally.add_taken(0.5, times, woken=3.0, answered=3.25)
        await asyncio.sleep(0)
        return metrics

    metrics = asyncio.run(main())
    assert dict(metrics.stage_seconds) == pytest.approx({stage: 2 * s for stage, s in expected.items()})
    assert set(metrics.stage_counts.values()) == {2}
