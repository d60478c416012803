"""DVABatch's engine driven directly: a sliced model as a pipeline, every request answered once, correctly."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import pytest
import torch
from torch import nn

from handlers.codecs import ModelInput
from handlers.dvabatch.engine import DvaBatchEngine
from handlers.dvabatch.policy import DvaBatchConfig, DvaBatchConfigError, DvaPolicy
from handlers.errors import ResponseError
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.segment_profile import SegmentProfile
from handlers.runtime.segments import slice_model


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(6)))
        self.head = nn.Linear(64, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x) + x)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Mlp().eval()


def assert_rows_of(model, inputs, futures, atol=1e-5):
    """Each future holds its own input's row of the unsliced model's output."""
    with torch.no_grad():
        expected = model(torch.stack(inputs))
    for i, future in enumerate(futures):
        assert torch.allclose(future.result(timeout=30), expected[i], atol=atol), i


def make_engine(model, segments=3, lanes=None, device="cpu", profile=None, **settings):
    sliced = slice_model(copy.deepcopy(model).to(device), (torch.randn(2, 64, device=device),), segments)
    config = DvaBatchConfig(segments=segments, **settings)
    lanes = lanes if lanes is not None or device != "cpu" else CpuLanes(segments, 1)
    engine = DvaBatchEngine(
        sliced,
        ModelInput((torch.zeros(64),)),
        ExecutionDevice(device),
        config,
        HandlerMetrics(None, "m"),
        lanes,
        profile,
    )
    return engine, lanes


def test_every_request_gets_its_own_row_whatever_it_was_batched_with(model):
    engine, lanes = make_engine(model, max_batch=4)
    engine.warm_up()
    inputs = [torch.randn(64) for _ in range(40)]
    futures = []
    for i, x in enumerate(inputs):
        futures.append(engine.try_submit(ModelInput((x,))))
        if i % 7 == 0:
            time.sleep(0.002)  # some arrive while earlier batches are in the pipeline
    assert_rows_of(model, inputs, futures)
    assert engine.counts["new"] >= 1 and sum(engine.counts[k] for k in ("new", "join", "stretch")) >= 10
    engine.close()
    lanes.close()


def test_newcomers_stretch_a_batch_in_flight_and_merge_with_it(model):
    # Stage 1 is slowed down, so a batch waits before stage 2 while newcomers catch up.
    engine, lanes = make_engine(model, segments=3, max_batch=8, t_comp_wait_ms=500.0)
    seg = engine.sliced._segments[1]
    slow = dataclasses.replace(seg, module=_Slow(seg.module, 0.05))
    engine.sliced._segments[1] = slow
    first = [engine.try_submit(ModelInput((torch.randn(64),))) for _ in range(2)]
    time.sleep(0.02)  # the first batch is in stage 1 now
    second = [engine.try_submit(ModelInput((torch.randn(64),))) for _ in range(2)]
    for f in first + second:
        f.result(timeout=30)
    assert engine.counts["stretch"] >= 1 and engine.counts["merge"] >= 1, engine.counts
    assert engine.metrics.snapshot()["operations"] == dict(engine.counts)  # what TorchServe is told
    engine.close()
    lanes.close()


class _Slow(nn.Module):
    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, *args):  # noqa: ANN002, ANN201
        time.sleep(self.seconds)
        return self.inner(*args)


def test_a_failing_stage_fails_only_its_batch(model):
    engine, lanes = make_engine(model, max_batch=2, stretch=False)
    seg = engine.sliced._segments[2]
    calls = {"n": 0}
    lock = threading.Lock()

    class FailOnce(nn.Module):
        def forward(self, *args):  # noqa: ANN002, ANN201
            with lock:
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("injected")
            return seg.module(*args)

    engine.sliced._segments[2] = dataclasses.replace(seg, module=FailOnce())
    futures = [engine.try_submit(ModelInput((torch.randn(64),))) for _ in range(8)]
    outcomes = []
    for f in futures:
        try:
            f.result(timeout=30)
            outcomes.append(200)
        except ResponseError as exc:
            outcomes.append(exc.error_code)
    assert 1 <= outcomes.count(503) <= 2 and outcomes.count(200) == 8 - outcomes.count(503)
    engine.close()
    lanes.close()


def test_bad_shapes_are_refused_and_room_is_bounded(model):
    engine, lanes = make_engine(model, max_batch=2, max_inflight=2)
    with pytest.raises(ResponseError) as info:
        engine.try_submit(ModelInput((torch.randn(65),)))
    assert info.value.error_code == 400
    engine.sliced._segments[0] = dataclasses.replace(engine.sliced[0], module=_Slow(engine.sliced[0].module, 0.2))
    held = [engine.try_submit(ModelInput((torch.randn(64),))) for _ in range(2)]
    assert engine.try_submit(ModelInput((torch.randn(64),))) is None  # full: the runtime waits for room
    for f in held:
        f.result(timeout=30)
    assert engine.try_submit(ModelInput((torch.randn(64),))) is not None
    engine.close()
    lanes.close()


def test_close_answers_everything_admitted(model):
    engine, lanes = make_engine(model, max_batch=2)
    engine.sliced._segments[0] = dataclasses.replace(engine.sliced[0], module=_Slow(engine.sliced[0].module, 0.3))
    futures = [engine.try_submit(ModelInput((torch.randn(64),))) for _ in range(6)]
    engine.close(timeout_s=0.1)
    settled = [f.done() for f in futures]
    assert all(settled)
    codes = [f.exception().error_code if f.exception() else 200 for f in futures]
    assert 503 in codes
    with pytest.raises(ResponseError):
        engine.try_submit(ModelInput((torch.randn(64),)))
    lanes.close()


def test_split_batches_keep_every_request_its_row(model):
    # A profile where time grows linearly with batch: halves never cost more, so every batch of ≥ 2 splits.
    linear = SegmentProfile("m", 1, (1, 8), tuple((1.0, 8.0) for _ in range(3)))
    engine, lanes = make_engine(model, max_batch=8, stretch=False, profile=linear)
    seg = engine.sliced._segments[0]
    engine.sliced._segments[0] = dataclasses.replace(seg, module=_Slow(seg.module, 0.05))  # a queue builds
    inputs = [torch.randn(64) for _ in range(12)]
    futures = [engine.try_submit(ModelInput((x,))) for x in inputs]
    assert_rows_of(model, inputs, futures)
    assert engine.counts["split"] >= 1, engine.counts
    engine.close()
    lanes.close()


def test_split_follows_the_profile_and_config_is_validated():
    linear = SegmentProfile("m", 1, (1, 2, 4), ((1.0, 2.0, 4.0), (1.0, 2.0, 4.0)))
    batched = SegmentProfile("m", 1, (1, 2, 4), ((1.0, 1.2, 1.5), (1.0, 1.2, 1.5)))
    from handlers.dvabatch.batch_table import BatchTable

    table = BatchTable(2)
    entry = table.new(list(range(4)), now=0.0)
    assert DvaPolicy(DvaBatchConfig(), linear).split_sizes(entry) == [2, 2]
    assert DvaPolicy(DvaBatchConfig(), batched).split_sizes(entry) is None
    assert DvaPolicy(DvaBatchConfig(split=False), linear).split_sizes(entry) is None
    assert DvaPolicy(DvaBatchConfig(), None).split_sizes(entry) is None
    for bad in ({"segments": 0}, {"max_batch": "4"}, {"t_comp_wait_ms": -1}, {"stretch": "yes"}, {"nope": 1}):
        with pytest.raises(DvaBatchConfigError):
            DvaBatchConfig.from_dict(bad)
    with pytest.raises(DvaBatchConfigError, match="one full batch"):
        DvaBatchConfig(max_batch=32, max_inflight=8)
    for lanes in (0, 3, True, "1"):
        with pytest.raises(DvaBatchConfigError, match="cpu_lanes"):
            DvaBatchConfig(segments=2, cpu_lanes=lanes)
    assert DvaBatchConfig.from_dict({"segments": 2, "cpu_lanes": None}).cpu_lanes is None


def test_stages_sharing_one_lane_still_answer_every_request_its_row(model):
    # ``cpu_lanes: 1``: all three stages queue on one lane, one at a time, in FIFO order.
    engine, lanes = make_engine(model, segments=3, lanes=CpuLanes(1, 1), max_batch=4, cpu_lanes=1)
    inputs = [torch.randn(64) for _ in range(20)]
    futures = [engine.try_submit(ModelInput((x,))) for x in inputs]
    assert_rows_of(model, inputs, futures)
    engine.close()
    lanes.close()


@pytest.mark.parametrize("requests", [2, 12])
def test_a_batch_costs_one_call_per_stage_however_many_requests_it_holds(model, requests):
    """Host work per batch, not per request: requests that wait together run as one batch, and each
    stage program is called once for it (counted), whether it holds 2 requests or 12."""
    engine, lanes = make_engine(model, max_batch=16, split=False)
    engine.warm_up()
    inputs = [torch.randn(64) for _ in range(requests)]
    with engine._cond:  # the scheduler sees them only once all are in: they arrived together
        futures = [engine.try_submit(ModelInput((x,))) for x in inputs]
    assert_rows_of(model, inputs, futures)
    assert engine.counts["new"] == 1 and engine.counts["join"] == 0
    assert dict(engine.stage_calls) == {0: 1, 1: 1, 2: 1}
    engine.close()
    lanes.close()
