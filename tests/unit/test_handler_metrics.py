"""What the handlers tell TorchServe's metrics cache, and when (``handlers/runtime/metrics.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from archiver.options import ServingOptions, model_config
from handlers.runtime.metrics import HandlerMetrics
from model_store.catalog import get_spec


class RecordingCache:
    """Stands in for TorchServe's metrics cache: keeps every ``add_metric`` call as plain data."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, str, dict[str, str]]] = []

    def add_metric(self, name, value, unit, idx, dimensions, metric_type) -> None:
        labels = {d.name: d.value for d in dimensions}
        self.calls.append((name, value, metric_type.name, labels))

    def values(self, name: str, **labels: str) -> list[float]:
        return [v for n, v, _, ls in self.calls if n == name and all(ls.get(k) == x for k, x in labels.items())]


def serve_five_requests(metrics: HandlerMetrics) -> None:
    """Five requests in two batches (3 + 2), as an engine and the async template report them."""
    for _ in range(5):
        metrics.request_admitted()
    metrics.batch_started(3, [0.01, 0.02, 0.03])
    metrics.batch_started(2, [0.04, 0.05])  # both batches run at once
    metrics.batch_finished(0.1)
    metrics.batch_finished(0.2)
    for _ in range(5):
        metrics.stages({"decode": 0.002, "batch": 0.1})
        metrics.request_answered()
    metrics.operation("new")
    metrics.operation("new")
    metrics.admission_waited()


def test_events_reach_torchserve_coalesced_at_a_flush():
    cache = RecordingCache()
    metrics = HandlerMetrics(cache, "m", flush_interval_s=3600)  # no periodic flush within the test
    serve_five_requests(metrics)
    assert cache.calls == []  # nothing on the request path
    metrics.flush()
    assert cache.values("HandlerStageCount", Stage="decode") == [5]  # one line for five requests
    assert cache.values("HandlerStageSeconds", Stage="batch") == [pytest.approx(0.5)]
    assert cache.values("HandlerBatches", BatchSize="3") == [1] and cache.values("HandlerBatches", BatchSize="2") == [1]
    assert cache.values("HandlerOperations", Operation="new") == [2]
    assert cache.values("HandlerAdmissionWaits") == [1]
    assert sorted(cache.values("HandlerQueueSeconds")) == [0.03, 0.05]  # each batch's longest wait
    assert sorted(cache.values("HandlerBatchSeconds")) == [0.1, 0.2]
    assert cache.values("HandlerInflight") == [0]  # the latest value only
    assert cache.values("HandlerPeakConcurrentBatches") == [2]
    assert all(labels["ModelName"] == "m" and labels["Level"] == "Model" for *_, labels in cache.calls)
    kinds = [kind for _, _, kind, _ in cache.calls]
    assert kinds.index("GAUGE") > max(i for i, k in enumerate(kinds) if k != "GAUGE")  # gauges after the counts
    # The in-process view is whole at any time.
    assert metrics.snapshot()["stage_mean_ms"]["decode"] == pytest.approx(2.0)

    calls = len(cache.calls)
    metrics.flush()
    assert len(cache.calls) == calls  # nothing new, nothing re-sent
    metrics.stages({"decode": 0.004})
    metrics.close()  # flushes what is left
    assert cache.values("HandlerStageCount", Stage="decode") == [5, 1]  # increments: TorchServe adds them up


def test_the_flush_thread_hands_over_without_being_asked():
    cache = RecordingCache()
    metrics = HandlerMetrics(cache, "m", flush_interval_s=0.05)
    try:
        metrics.stages({"decode": 0.001})
        deadline = time.monotonic() + 10.0
        while not cache.values("HandlerStageCount") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cache.values("HandlerStageCount", Stage="decode") == [1]
    finally:
        metrics.close()


def test_without_a_cache_nothing_is_emitted_and_no_thread_starts():
    flushers = sum(t.name == "metrics-flush" for t in threading.enumerate())
    metrics = HandlerMetrics(None, "m")
    assert sum(t.name == "metrics-flush" for t in threading.enumerate()) == flushers
    serve_five_requests(metrics)
    assert not metrics._pending  # nothing piles up for a cache that is not there (a handler driven directly)
    metrics.flush()
    metrics.close()
    assert metrics.snapshot()["batches"] == {3: 1, 2: 1}


def test_an_interval_of_zero_emits_at_every_event_as_before():
    cache = RecordingCache()
    flushers = sum(t.name == "metrics-flush" for t in threading.enumerate())
    metrics = HandlerMetrics(cache, "m", flush_interval_s=0)
    assert sum(t.name == "metrics-flush" for t in threading.enumerate()) == flushers  # nothing to wait for
    metrics.stages({"decode": 0.001})
    assert cache.values("HandlerStageCount", Stage="decode") == [1]  # no flush asked for, none waited for
    metrics.request_admitted()
    assert cache.values("HandlerInflight") == [1]


@pytest.mark.parametrize("bad", [-1, "1", True, float("nan")])
def test_a_bad_flush_interval_is_refused_at_build_and_in_the_worker(bad):
    with pytest.raises(ValueError, match="metrics_flush_interval_s"):
        HandlerMetrics(None, "m", flush_interval_s=bad)  # the worker, reading model-config.yaml
    with pytest.raises(ValueError, match="metrics_flush_interval_s"):
        ServingOptions(handler="ebird", metrics_flush_interval_s=bad)  # `packrat archive`


def test_the_archive_carries_the_interval():
    spec = get_spec("resnet50", "eager")
    config = model_config(spec, ServingOptions(handler="ebird", metrics_flush_interval_s=0.25))
    assert config["handler"]["metrics_flush_interval_s"] == 0.25
    assert "metrics_flush_interval_s" not in model_config(spec, ServingOptions(handler="ebird"))["handler"]
