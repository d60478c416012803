"""REEF's engine driven directly (handlers/reef/engine.py): preemption, restore, routing, and no request lost."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from torch import fx, nn

from bench.reef import preemption_latencies
from handlers.codecs import ModelInput
from handlers.errors import RequestError, ServiceUnavailable
from handlers.reef.config import BEST_EFFORT, REALTIME, ReefConfig, ReefConfigError
from handlers.reef.engine import Member, ReefEngine, RoutedInput
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.segments import batch_nodes, classify, cut, slice_model, trace
from handlers.runtime.stage_programs import StagePrograms, bucket_sizes
from model_store.factory import outputs_close

WAIT_S = 30.0  # bounds waits that must end; not a timing assertion

# A best-effort model whose middle blocks until the test lets it go, so a
# real-time request arrives while a unit is in flight, every time.
HOLD = threading.Event()
HOLD.set()
INSIDE = threading.Event()


HELD_NOW = [0]  # BE batches inside hold_here right now
HELD_LOCK = threading.Lock()
HELD_ON: list[tuple[str, int]] = []  # (thread, its intra-op threads) of every pass through hold_here


@fx.wrap
def hold_here(x: torch.Tensor) -> torch.Tensor:
    with HELD_LOCK:
        HELD_NOW[0] += 1
        HELD_ON.append((threading.current_thread().name, torch.get_num_threads()))
    INSIDE.set()
    HOLD.wait(WAIT_S)
    with HELD_LOCK:
        HELD_NOW[0] -= 1
    return x


class Held(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, padding=1)
        # The heaviest part comes after the hold, so the time-balanced cut always
        # leaves at least one unit boundary after it (with one light conv there,
        # a noisy timing once put the hold into the last unit: nothing to stop at).
        self.c = nn.Sequential(nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                               nn.ReLU(), nn.Conv2d(32, 8, 3, padding=1))  # fmt: skip
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.a(x))
        x = hold_here(torch.relu(self.b(x)))
        x = torch.relu(self.c(x))
        return self.head(x.mean(dim=(2, 3)))


# ... and a real-time model that holds until the test has seen the BE batch stopped at the gate.
RT_HOLD = threading.Event()
RT_HOLD.set()


@fx.wrap
def rt_hold_here(x: torch.Tensor) -> torch.Tensor:
    RT_HOLD.wait(WAIT_S)
    return x


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 16), nn.ReLU())
        self.b = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(rt_hold_here(self.a(x)))


def member(name: str, model: nn.Module, shape: tuple[int, ...], segments: int = 3) -> Member:
    torch.manual_seed(0)
    model = model.eval()
    example = (torch.randn(2, *shape),)
    if isinstance(model, Held):
        # Cut right after the hold, whatever the timings say: the tests need a unit boundary after it, and a
        # time-balanced cut from one noisy timing on a busy 2-core machine once put the hold in the last unit.
        gm = trace(model, example, (0,))
        batch = classify(gm, example)
        order = [n.name for n in batch_nodes(gm, batch)]
        after = next(i for i, n in enumerate(order) if "hold_here" in n) + 1
        sliced = cut(gm, batch, list(range(after, after + segments - 1)))
        with torch.no_grad():
            assert outputs_close(sliced(*example), model(*example), 1e-5)
    else:
        sliced = slice_model(model, example, segments, repeats=1, check=lambda g, e: outputs_close(g, e, 1e-5))
    return Member(name, model, sliced, ModelInput((torch.zeros(shape),)))


@pytest.fixture(params=["units", "programs"])
def engine(request):
    """A two-model engine on CPU.  ``programs``: its best-effort units run as ``StagePrograms`` per batch bucket,
    as ``be_graphs`` makes them on CUDA (here the same padded shapes run eagerly: the engine's side of it)."""
    torch.manual_seed(0)
    members = [member("held", Held(), (3, 8, 8)), member("small", Small(), (6,))]
    eng = ReefEngine(members, ExecutionDevice("cpu"), ReefConfig(segments=3, rt_max_batch=2, be_max_batch=2),
                     HandlerMetrics(None, "test"), cpu_threads=2)  # fmt: skip
    if request.param == "programs":
        for m in members:
            eng.be_programs[m.name] = StagePrograms(m.sliced, eng._zeros(m, 1), bucket_sizes(2))
    eng.warm_up()
    yield eng
    HOLD.set()
    RT_HOLD.set()
    eng.close(5.0)


def request(eng: ReefEngine, model: str, priority: str, seed: int) -> tuple[torch.Tensor, object]:
    shape = eng.members[model].example.tensors[0].shape
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    future = eng.try_submit(RoutedInput((x,), model=model, priority=priority))
    assert future is not None
    return x, future


def expected(eng: ReefEngine, model: str, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return eng.members[model].model(x.unsqueeze(0))[0]


def test_a_real_time_request_preempts_a_best_effort_batch_which_restores_with_the_same_result(engine, caplog):
    caplog.set_level(logging.INFO, logger="handlers.reef.engine")
    HOLD.clear()
    RT_HOLD.clear()
    INSIDE.clear()
    be_x, be_future = request(engine, "held", BEST_EFFORT, seed=1)
    assert INSIDE.wait(WAIT_S)  # the BE batch is inside a unit that is not its last
    rt_x, rt_future = request(engine, "small", REALTIME, seed=2)
    assert engine.gate.realtime_mode
    assert not rt_future.done()  # RT waits for the unit in flight (CPU: it would share the cores)
    HOLD.set()
    deadline = time.monotonic() + WAIT_S
    while engine.gate.waiting != 1 and time.monotonic() < deadline:  # the BE batch stops before its next unit
        time.sleep(0.005)
    assert engine.gate.waiting == 1 and not be_future.done()
    RT_HOLD.set()
    rt_row = rt_future.result(WAIT_S)
    be_row = be_future.result(WAIT_S)
    assert outputs_close(rt_row, expected(engine, "small", rt_x), 1e-5)
    assert outputs_close(be_row, expected(engine, "held", be_x), 1e-5)  # nothing lost or run twice in between
    assert rt_future.times.settled < be_future.times.settled  # the BE batch finished after the RT one
    assert engine.counts["preempt"] == 1 and engine.counts["resume"] == 1
    assert engine.metrics.snapshot()["operations"] == {"preempt": 1, "resume": 1}  # what TorchServe is told
    [preemption] = engine.preemptions
    assert preemption.interrupted == 1 and preemption.latency_s > 0
    # The worker's log line, read back as bench/reef.py reads TorchServe's model log.
    assert preemption_latencies(caplog.text) == [pytest.approx(1e3 * preemption.latency_s, abs=0.005)]
    assert not engine.gate.realtime_mode  # normal mode once the RT queue is empty
    if engine.be_programs:  # the BE batch ran each of its three units as one program of its bucket
        assert engine.be_programs["held"].calls == {(0, 1): 1, (1, 1): 1, (2, 1): 1}


def test_a_mixed_stream_answers_every_request_once_with_its_own_result(engine):
    sent = []
    for i in range(24):
        model = "held" if i % 3 else "small"
        priority = REALTIME if i % 4 == 0 else BEST_EFFORT
        sent.append((model, *request(engine, model, priority, seed=100 + i)))
    for model, x, future in sent:
        assert outputs_close(future.result(WAIT_S), expected(engine, model, x), 1e-5)
    assert not engine._outstanding and not engine.gate.realtime_mode


def test_bad_routing_is_the_requests_own_400_and_a_full_engine_asks_to_wait(engine):
    with pytest.raises(RequestError, match="serves held, small"):
        engine.try_submit(RoutedInput((torch.zeros(6),), model="nope", priority=BEST_EFFORT))
    with pytest.raises(RequestError, match="do not fit small"):
        engine.try_submit(RoutedInput((torch.zeros(7),), model="small", priority=BEST_EFFORT))
    with pytest.raises(RequestError, match="serves held, small"):
        engine.try_submit(ModelInput((torch.zeros(6),)))  # not routed at all
    HOLD.clear()
    futures = [request(engine, "held", BEST_EFFORT, seed=i)[1] for i in range(engine.config.max_inflight)]
    assert engine.try_submit(RoutedInput((torch.zeros(6),), model="small", priority=REALTIME)) is None
    HOLD.set()
    for future in futures:
        future.result(WAIT_S)


def test_on_cpu_reef_runs_at_most_one_best_effort_batch_per_core():
    names = ("h1", "h2", "h3")
    eng = ReefEngine([member(n, Held(), (3, 8, 8)) for n in names], ExecutionDevice("cpu"), ReefConfig(),
                     HandlerMetrics(None, "test"), cpu_threads=2)  # fmt: skip
    eng.warm_up()
    HOLD.clear()
    try:
        futures = [request(eng, n, BEST_EFFORT, seed=i)[1] for i, n in enumerate(names)]
        deadline = time.monotonic() + WAIT_S
        while HELD_NOW[0] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.2)  # room for a third batch to start, were it allowed to
        assert HELD_NOW[0] == 2  # two cores: the third BE queue waits for a slot
        HOLD.set()
        for future in futures:
            future.result(WAIT_S)
    finally:
        HOLD.set()
        eng.close(5.0)


def test_on_cpu_a_lone_best_effort_batch_takes_every_core_on_a_thread_that_ends_with_it():
    # The executor itself never forms an OpenMP team, which would stay beside the RT executor's and slow it
    # (``bench/openmp_teams.py``): the batch's team is on a thread of its own, gone with the batch.
    eng = ReefEngine([member("h1", Held(), (3, 8, 8))], ExecutionDevice("cpu"), ReefConfig(),
                     HandlerMetrics(None, "test"), cpu_threads=2)  # fmt: skip
    eng.warm_up()
    HOLD.set()
    HELD_ON.clear()
    try:
        threads_before = threading.active_count()
        request(eng, "h1", BEST_EFFORT, seed=0)[1].result(WAIT_S)
        assert HELD_ON == [("reef-be-h1-batch", 2)]
        deadline = time.monotonic() + WAIT_S  # the answer is settled on that thread just before it ends
        while threading.active_count() > threads_before and time.monotonic() < deadline:
            time.sleep(0.005)
        assert threading.active_count() == threads_before
    finally:
        eng.close(5.0)


def test_close_fails_what_it_could_not_finish_with_503():
    eng = ReefEngine([member("held", Held(), (3, 8, 8))], ExecutionDevice("cpu"), ReefConfig(be_max_batch=1),
                     HandlerMetrics(None, "test"), cpu_threads=1)  # fmt: skip
    eng.warm_up()
    HOLD.clear()
    futures = [request(eng, "held", BEST_EFFORT, seed=i)[1] for i in range(3)]
    eng.close(timeout_s=0.2)
    HOLD.set()
    for future in futures:
        with pytest.raises(ServiceUnavailable):
            future.result(WAIT_S)
    with pytest.raises(ServiceUnavailable):
        eng.try_submit(RoutedInput((torch.zeros(3, 8, 8),), model="held", priority=BEST_EFFORT))


def test_config_is_validated_and_a_header_outranks_the_models_default():
    config = ReefConfig.from_dict({"realtime": ["vgg19"]})
    assert config.priority("vgg19", None) == REALTIME and config.priority("resnet152", None) == BEST_EFFORT
    assert (
        config.priority("vgg19", "Best-Effort") == BEST_EFFORT and config.priority("resnet152", "realtime") == REALTIME
    )
    with pytest.raises(RequestError, match="unknown X-Priority 'urgent'"):
        config.priority("vgg19", "urgent")
    fixed = ReefConfig.from_dict({"realtime": ["vgg19"], "priority_header": False})
    assert fixed.priority("resnet152", "realtime") == BEST_EFFORT
    with pytest.raises(ReefConfigError, match="does not serve"):
        config.check_members(["resnet152"])
    for bad, message in [
        ({"segments": 0}, "segments"),
        ({"c": True}, "c must be"),
        ({"realtime": "vgg19"}, "list of model names"),
        ({"rt_max_batch": 8, "max_inflight": 4}, "max_inflight"),
        ({"colour": 1}, "unknown reef settings"),
        ({"padding": "on"}, "padding must be true or false"),
        ({"be_graphs": 1}, "be_graphs must be true or false"),
        ({"rt_sms": 0}, 'rt_sms must be "auto" or a number of SMs'),
        ({"rt_sms": "half"}, 'rt_sms must be "auto" or a number of SMs'),
        ({"rt_sms": 16, "policy": "seq"}, "policy reef only"),
    ]:
        with pytest.raises(ReefConfigError, match=message):
            ReefConfig.from_dict(bad)
