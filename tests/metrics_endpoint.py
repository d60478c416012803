"""Reading the handlers' metrics back from a running TorchServe's Prometheus endpoint."""

from __future__ import annotations

import time
from collections.abc import Callable


def requests_batched(samples: list[tuple[dict[str, str], float]]) -> float:
    """Requests run in batches, from ``HandlerBatches`` samples (batch size × batches)."""
    return sum(int(labels["BatchSize"]) * n for labels, n in samples)


def handler_metric(
    torchserve, name: str, model: str, until: Callable[[list], bool] | None = None, timeout_s: float = 10.0
) -> list[tuple[dict[str, str], float]]:
    """The model's samples of ``name`` on the metrics endpoint.

    Handlers hand TorchServe their metrics once per flush interval
    (``handlers/runtime/metrics.py``), so with ``until`` this reads again
    until ``until(samples)`` holds, and returns the last read if it never
    does within ``timeout_s`` (the caller's assertion then shows what was there).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        samples = [(labels, v) for labels, v in torchserve.metrics().samples(name) if labels.get("ModelName") == model]
        if until is None or until(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def settled_metric(
    torchserve, name: str, model: str, interval_s: float = 1.5, timeout_s: float = 15.0
) -> list[tuple[dict[str, str], float]]:
    """The model's samples of ``name`` once they stop changing: two reads ``interval_s`` apart (longer
    than a handler's flush interval, 1 s by default) that agree.  What a count is *before* a test's own
    requests, where an earlier test's last batches may still be on their way to the endpoint."""
    deadline = time.monotonic() + timeout_s
    last = handler_metric(torchserve, name, model)
    while True:
        time.sleep(interval_s)
        now = handler_metric(torchserve, name, model)
        if sorted(map(repr, now)) == sorted(map(repr, last)) or time.monotonic() > deadline:
            return now
        last = now
