"""Handler metrics, through TorchServe's metrics cache and in-process.

TorchServe's backend metrics are log lines (``[METRICS]…``) that the
frontend parses and serves on its Prometheus endpoint; custom names appear
there because ``config.properties`` sets ``model_metrics_auto_detect``.
The same numbers are kept in-process (``snapshot()``) so a handler driven
directly, without a frontend, can be observed too.

Names (Prometheus, per ModelName):

- ``HandlerQueueSeconds`` (histogram): arrival → start of the request's batch.
- ``HandlerBatches`` (counter, ``BatchSize`` label): batches run, by size;
  the batch-size histogram with exact buckets.
- ``HandlerBatchSeconds`` (histogram): one batch's execution, start to output on the host.
- ``HandlerInflight`` (gauge): requests admitted and not yet answered.
- ``HandlerPeakConcurrentBatches`` (gauge): most batches in flight at once.
- ``HandlerAdmissionWaits`` (counter): requests that found the engine full
  and waited for room (backpressure), rather than being dropped.
- ``HandlerStageSeconds`` and ``HandlerStageCount`` (counters, ``Stage``
  label): where a request's time inside the worker goes, summed per stage
  (mean = seconds / count).  The async runtime's stages, in order: decode,
  admission (waiting for room), queue (admitted → its batch starts), batch,
  release (output on the host → future answered), wakeup (→ the event loop
  resumes the request), encode.  The sync CPU handler's: decode, model,
  encode of the batch the request was in (it waits for all of them).
  Counters rather than a histogram so that the mean of each stage reads
  straight off the endpoint, with no bucket guesswork.
- ``HandlerOperations`` (counter, ``Operation`` label): a scheduler's own
  operations, by name (DVABatch: new, join, stretch, split, merge), so a
  benchmark can say how often each policy acted.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

RECENT_SAMPLES = 10_000


class HandlerMetrics:
    def __init__(self, cache: Any | None, model_name: str) -> None:
        self._cache = cache
        self._model = model_name
        self._lock = threading.Lock()
        self.batches: collections.Counter[int] = collections.Counter()
        # The most recent samples only: a worker serves for weeks.
        self.queue_seconds: collections.deque[float] = collections.deque(maxlen=RECENT_SAMPLES)
        self.batch_seconds: collections.deque[float] = collections.deque(maxlen=RECENT_SAMPLES)
        self.inflight = 0
        self.peak_concurrent_batches = 0
        self._concurrent_batches = 0
        self.admission_waits = 0
        self.stage_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.stage_counts: collections.Counter[str] = collections.Counter()
        self.operations: collections.Counter[str] = collections.Counter()

    # -- events ------------------------------------------------------------

    # Gauges are emitted while the lock is held: TorchServe keeps the last
    # value it reads, so two threads' values must reach it in the order they
    # were set (a peak of 2 overwritten by a late 1 was seen in a test run).

    def request_admitted(self) -> None:
        with self._lock:
            self.inflight += 1
            self._emit("HandlerInflight", self.inflight, "count", "GAUGE")

    def request_answered(self) -> None:
        with self._lock:
            self.inflight -= 1
            self._emit("HandlerInflight", self.inflight, "count", "GAUGE")

    def admission_waited(self) -> None:
        with self._lock:
            self.admission_waits += 1
        self._emit("HandlerAdmissionWaits", 1, "count", "COUNTER")

    def batch_started(self, size: int, queue_seconds: list[float]) -> None:
        with self._lock:
            self.batches[size] += 1
            self.queue_seconds.extend(queue_seconds)
            self._concurrent_batches += 1
            if self._concurrent_batches > self.peak_concurrent_batches:
                self.peak_concurrent_batches = self._concurrent_batches
                self._emit("HandlerPeakConcurrentBatches", self.peak_concurrent_batches, "count", "GAUGE")
        self._emit("HandlerBatches", 1, "count", "COUNTER", BatchSize=str(size))
        for seconds in queue_seconds:
            self._emit("HandlerQueueSeconds", seconds, "s", "HISTOGRAM")

    def batch_finished(self, seconds: float) -> None:
        with self._lock:
            self._concurrent_batches -= 1
            self.batch_seconds.append(seconds)
        self._emit("HandlerBatchSeconds", seconds, "s", "HISTOGRAM")

    def stages(self, seconds: dict[str, float], requests: int = 1) -> None:
        """Time in each named stage, as ``requests`` requests each spent it
        (a sync handler's batch: every request in it waits for all of it)."""
        with self._lock:
            for stage, value in seconds.items():
                self.stage_seconds[stage] += value * requests
                self.stage_counts[stage] += requests
        for stage, value in seconds.items():
            self._emit("HandlerStageSeconds", value * requests, "s", "COUNTER", Stage=stage)
            self._emit("HandlerStageCount", requests, "count", "COUNTER", Stage=stage)

    def operation(self, name: str) -> None:
        """A scheduler did ``name`` once (see ``HandlerOperations``)."""
        with self._lock:
            self.operations[name] += 1
        self._emit("HandlerOperations", 1, "count", "COUNTER", Operation=name)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "batches": dict(self.batches),
                "requests_batched": sum(size * n for size, n in self.batches.items()),
                "inflight": self.inflight,
                "peak_concurrent_batches": self.peak_concurrent_batches,
                "admission_waits": self.admission_waits,
                "queue_seconds": list(self.queue_seconds),
                "batch_seconds": list(self.batch_seconds),
                "stage_mean_ms": {k: self.stage_seconds[k] * 1e3 / n for k, n in self.stage_counts.items()},
                "operations": dict(self.operations),
            }

    # -- TorchServe ----------------------------------------------------------

    def _emit(self, name: str, value: float, unit: str, kind: str, **labels: str) -> None:
        if self._cache is None:
            return
        from ts.metrics.dimension import Dimension
        from ts.metrics.metric_type_enum import MetricTypes

        # Explicit ModelName and Level: without a request index TorchServe's
        # cache would label the metric Level=Error, and its default argument
        # for dimensions is a shared mutable list.
        dims = [Dimension("ModelName", self._model), Dimension("Level", "Model")]
        dims += [Dimension(k, v) for k, v in labels.items()]
        try:
            self._cache.add_metric(name, value, unit, None, dims, MetricTypes[kind])
        except Exception:  # a metrics fault must never fail a request
            logger.warning("could not emit metric %s", name, exc_info=True)
