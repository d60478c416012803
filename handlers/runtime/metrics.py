"""Handler metrics, through TorchServe's metrics cache and in-process.

TorchServe's backend metrics are log lines (``[METRICS]…``) that the
frontend parses and serves on its Prometheus endpoint; custom names appear
there because ``config.properties`` sets ``model_metrics_auto_detect``.
The same numbers are kept in-process (``snapshot()``) so a handler driven
directly, without a frontend, can be observed too.

Names (Prometheus, per ModelName):

- ``HandlerQueueSeconds`` (histogram): per batch, the longest any of its
  requests waited from arrival to the batch's start (each request's own
  wait is in the ``queue`` stage below, as a mean).  One observation per
  batch, not per request: every observation is a line the frontend
  parses, and a line per request cost an async handler ~12 µs of its
  GIL-bound Python per request on a one-layer BERT (7 % of its capacity,
  ``docs/benchmarks/host_path.md``).
- ``HandlerBatches`` (counter, ``BatchSize`` label): batches run, by size;
  the batch-size histogram with exact buckets.
- ``HandlerDecodeBatches`` (counter, ``BatchSize`` label): JPEG decoder calls by images decoded,
  where the archive decodes in batches (``decode_threads: batched``).
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
  operations, by name (DVABatch: new, join, stretch, split, merge; REEF:
  preempt, resume), so a benchmark can say how often each policy acted.
- ``HandlerPreemptionSeconds`` (histogram, REEF): from a real-time
  admission until no best-effort unit was in flight, for each switch that
  stopped one.

Reaching TorchServe is batched.  Each metric TorchServe's cache takes is a
log line the worker formats and writes and the frontend parses, on the
cores the model runs on; emitted per request, as this module first did,
the async runtime wrote about 17 lines per request, ~40 % of the
event-loop thread's busy samples under py-spy; batched, the event loop
spends 0.5-0.7 ms and the frontend 0.8-0.9 ms less CPU per request
(``docs/benchmarks/README.md``, the runtime breakdown).  So events only update
in-process state, and one ``metrics-flush`` thread hands TorchServe what
changed every ``flush_interval_s``: counters as their summed increments,
gauges as their latest value, histogram observations as they came.  The
endpoint therefore lags the handler by up to one interval, which
Prometheus scraping (seconds apart) never notices; readers that need the
value at once call ``flush()`` (in-process) or poll the endpoint.  An
interval of 0 (``metrics_flush_interval_s: 0`` in the archive's handler
section) emits at every event, as before: kept so the cost can be measured
side by side (``bench/runtime_breakdown.py``) and for debugging.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

RECENT_SAMPLES = 10_000
DEFAULT_FLUSH_INTERVAL_S = 1.0


def parse_flush_interval(value: Any) -> float:
    """``metrics_flush_interval_s`` from model-config.yaml: seconds ≥ 0 (0: emit at every event)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"metrics_flush_interval_s must be a number of seconds ≥ 0, got {value!r}")
    return float(value)


# (name, unit, labels) identifies one series of TorchServe's cache.
SeriesKey = tuple[str, str, tuple[tuple[str, str], ...]]


@functools.lru_cache(maxsize=4096)
def series(name: str, unit: str, **labels: str) -> SeriesKey:
    """One series' key; cached, since every request names the same few (a handler's stages, its gauges)."""
    return name, unit, tuple(sorted(labels.items()))


class _PendingEmission:
    """What has changed since TorchServe's cache last heard from this handler.

    Not locked itself: ``HandlerMetrics`` holds its lock around every call.
    """

    def __init__(self) -> None:
        self.counters: collections.defaultdict[SeriesKey, float] = collections.defaultdict(float)
        self.gauges: dict[SeriesKey, float] = {}
        self.observations: list[tuple[SeriesKey, float]] = []

    def __bool__(self) -> bool:
        return bool(self.counters or self.gauges or self.observations)

    def count(self, key: SeriesKey, increment: float) -> None:
        self.counters[key] += increment

    def set(self, key: SeriesKey, value: float) -> None:
        self.gauges[key] = value

    def observe(self, key: SeriesKey, value: float) -> None:
        self.observations.append((key, value))

    def items(self) -> list[tuple[SeriesKey, float, str]]:
        """(series, value, TorchServe metric type), gauges last so they report the state after the counts."""
        return (
            [(key, value, "COUNTER") for key, value in self.counters.items()]
            + [(key, value, "HISTOGRAM") for key, value in self.observations]
            + [(key, value, "GAUGE") for key, value in self.gauges.items()]
        )


class _NoEmission(_PendingEmission):
    """Without a TorchServe cache (a handler driven directly) nothing is kept for it."""

    def count(self, key: SeriesKey, increment: float) -> None:
        pass

    def set(self, key: SeriesKey, value: float) -> None:
        pass

    def observe(self, key: SeriesKey, value: float) -> None:
        pass


class HandlerMetrics:
    def __init__(self, cache: Any | None, model_name: str, flush_interval_s: float = DEFAULT_FLUSH_INTERVAL_S) -> None:
        self._flush_interval_s = parse_flush_interval(flush_interval_s)
        self._cache = cache
        self._model = model_name
        self._lock = threading.Lock()  # the state below
        self._emit_lock = threading.Lock()  # one flush at a time, in order (``flush``)
        self._pending = _PendingEmission() if cache is not None else _NoEmission()
        self._closed = threading.Event()
        self._flusher: threading.Thread | None = None
        if cache is not None and self._flush_interval_s > 0:
            self._flusher = threading.Thread(target=self._flush_periodically, name="metrics-flush", daemon=True)
            self._flusher.start()
        self.batches: collections.Counter[int] = collections.Counter()
        self.decode_batches: collections.Counter[int] = collections.Counter()
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
        self._inflight_changed = False  # moved since the last flush
        self._stages_changed = False
        self._flushed_seconds: dict[str, float] = {}  # stage totals TorchServe has been handed
        self._flushed_counts: dict[str, int] = {}

    @classmethod
    def for_worker(cls, context: Any, handler_config: dict[str, Any]) -> HandlerMetrics:
        """A worker's metrics: TorchServe's cache, and the archive's ``metrics_flush_interval_s``."""
        return cls(
            getattr(context, "metrics", None),
            context.model_name,
            handler_config.get("metrics_flush_interval_s", DEFAULT_FLUSH_INTERVAL_S),
        )

    # -- events ------------------------------------------------------------

    # Per-request events only update in-process state; what TorchServe gets from them (the in-flight
    # gauge, the stage counters' increments) is worked out once per flush (``_fold_requests``).

    # The in-flight count has one writer, the event loop (``request_admitted`` and ``request_answered``),
    # so it takes no lock there.  The count is written before the flag: a flush that clears the flag and
    # then reads the count reports this change or the next flush does.

    def request_admitted(self) -> None:
        self.requests_admitted(1)

    def requests_admitted(self, count: int) -> None:
        self.inflight += count
        self._inflight_changed = True
        self._emit_now_if_unbatched()

    def request_answered(self) -> None:
        self.requests_answered(1)

    def requests_answered(self, count: int) -> None:
        self.inflight -= count
        self._inflight_changed = True
        self._emit_now_if_unbatched()

    def admission_waited(self) -> None:
        with self._lock:
            self.admission_waits += 1
            self._pending.count(series("HandlerAdmissionWaits", "count"), 1)
        self._emit_now_if_unbatched()

    def batch_started(self, size: int, queue_seconds: list[float]) -> None:
        with self._lock:
            self.batches[size] += 1
            self.queue_seconds.extend(queue_seconds)
            self._concurrent_batches += 1
            if self._concurrent_batches > self.peak_concurrent_batches:
                self.peak_concurrent_batches = self._concurrent_batches
                self._pending.set(series("HandlerPeakConcurrentBatches", "count"), self.peak_concurrent_batches)
            self._pending.count(series("HandlerBatches", "count", BatchSize=str(size)), 1)
            if queue_seconds:
                self._pending.observe(series("HandlerQueueSeconds", "s"), max(queue_seconds))
        self._emit_now_if_unbatched()

    def decode_batch(self, size: int) -> None:
        """One call of the batched JPEG decoder decoded ``size`` images (``HandlerDecodeBatches``)."""
        with self._lock:
            self.decode_batches[size] += 1
            self._pending.count(series("HandlerDecodeBatches", "count", BatchSize=str(size)), 1)
        self._emit_now_if_unbatched()

    def batch_finished(self, seconds: float) -> None:
        with self._lock:
            self._concurrent_batches -= 1
            self.batch_seconds.append(seconds)
            self._pending.observe(series("HandlerBatchSeconds", "s"), seconds)
        self._emit_now_if_unbatched()

    def stages(self, seconds: dict[str, float], requests: int = 1) -> None:
        """Time in each named stage, as ``requests`` requests each spent it
        (a sync handler's batch: every request in it waits for all of it)."""
        self.stage_sums({stage: value * requests for stage, value in seconds.items()}, requests)

    def stage_sums(self, seconds: dict[str, float], requests: int) -> None:
        """Seconds in each named stage summed over ``requests`` requests (``stage_tally.StageTally``)."""
        with self._lock:
            for stage, total in seconds.items():
                self.stage_seconds[stage] += total
                self.stage_counts[stage] += requests
            self._stages_changed = True
        self._emit_now_if_unbatched()

    def _fold_requests(self) -> None:
        """Put the per-request state's changes since the last flush into the pending emission (lock held)."""
        if self._inflight_changed:
            self._inflight_changed = False
            self._pending.set(series("HandlerInflight", "count"), self.inflight)
        if not self._stages_changed:
            return
        self._stages_changed = False
        for stage, total in self.stage_seconds.items():
            seconds = total - self._flushed_seconds.get(stage, 0.0)
            count = self.stage_counts[stage] - self._flushed_counts.get(stage, 0)
            if count:
                self._pending.count(series("HandlerStageSeconds", "s", Stage=stage), seconds)
                self._pending.count(series("HandlerStageCount", "count", Stage=stage), count)
        self._flushed_seconds = dict(self.stage_seconds)
        self._flushed_counts = dict(self.stage_counts)

    def operation(self, name: str) -> None:
        """A scheduler did ``name`` once (see ``HandlerOperations``)."""
        with self._lock:
            self.operations[name] += 1
            self._pending.count(series("HandlerOperations", "count", Operation=name), 1)
        self._emit_now_if_unbatched()

    def preempted(self, seconds: float) -> None:
        """Real-time work stopped best-effort work in flight; it waited ``seconds`` for it (REEF)."""
        with self._lock:
            self.operations["preempt"] += 1
            self._pending.count(series("HandlerOperations", "count", Operation="preempt"), 1)
            self._pending.observe(series("HandlerPreemptionSeconds", "s"), seconds)
        self._emit_now_if_unbatched()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "batches": dict(self.batches),
                "decode_batches": dict(self.decode_batches),
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

    def _emit_now_if_unbatched(self) -> None:
        if self._flush_interval_s == 0:
            self.flush()

    def flush(self) -> None:
        """Hand TorchServe's cache everything recorded since the last flush.

        Two flushes (the periodic one and a caller's) reach the cache in
        order, so a gauge's latest value is the one TorchServe keeps: the
        emit lock is held from taking the pending changes to emitting them.
        The state lock is held only to take them: emitting a second's
        observations takes tens of milliseconds on a busy worker (a line per
        observation), and the threads that record events (a lane ending a
        batch) must not wait for it.
        """
        if self._cache is None:
            return
        with self._emit_lock:
            with self._lock:
                self._fold_requests()
                if not self._pending:
                    return
                pending, self._pending = self._pending, _PendingEmission()
            for (name, unit, labels), value, kind in pending.items():
                self._emit(name, value, unit, kind, labels)

    def close(self) -> None:
        """Flush what is pending and stop the flush thread."""
        self._closed.set()
        if self._flusher is not None:
            self._flusher.join(timeout=5.0)
        self.flush()

    def _flush_periodically(self) -> None:
        while not self._closed.wait(self._flush_interval_s):
            self.flush()

    def _emit(self, name: str, value: float, unit: str, kind: str, labels: tuple[tuple[str, str], ...]) -> None:
        from ts.metrics.dimension import Dimension
        from ts.metrics.metric_type_enum import MetricTypes

        # Explicit ModelName and Level: without a request index TorchServe's
        # cache would label the metric Level=Error, and its default argument
        # for dimensions is a shared mutable list.
        dims = [Dimension("ModelName", self._model), Dimension("Level", "Model")]
        dims += [Dimension(k, v) for k, v in labels]
        try:
            self._cache.add_metric(name, value, unit, None, dims, MetricTypes[kind])
        except Exception:  # a metrics fault must never fail a request
            logger.warning("could not emit metric %s", name, exc_info=True)
