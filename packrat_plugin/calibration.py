"""What serving really costs, against what the profile says; learned online.

A profile times the model's forward pass alone, on an otherwise idle
machine.  A worker under TorchServe also decodes every request (JPEG → tensor,
text → ids) and encodes every answer, on its own cores and one request after
another; and the frontend, the clients and the controller take CPU time from
the same machine.  Planning on the bare profile overestimates capacity: on a
2-core VM, two 1-thread ResNet-50 workers the profile credits with
20 requests/s fell behind at 13 (docs/benchmarks/packrat_swap_resnet50.md).

Each Packrat worker adds every batch it serves to its slot's counters
(``plans.SlotCounters``: requests, time in ``handle()``, time in the model).
From the active set's counters over a window the calibrator learns two
numbers, both measured rather than guessed:

- ``slowdown``: the model's measured time over the profiled time of the
  batch sizes actually served (contention from everything else on the box);
- ``overhead_ms``: handler time outside the model, per request (decode,
  collate, encode).

A round of ``k`` requests is then predicted to take
``L[t][k] · slowdown + k · overhead_ms``.

Each worker class (threads per worker) keeps its own numbers
(``CalibrationBook``), learned while it serves; a class that has not served
yet borrows the one measured last.  Why not one pair for every class: the
slowdown is not the same for every split of the cores.  On the 2-core VM a
2-thread ResNet-50 worker ran at 1.2-1.5× its profile under load and two
1-thread workers at ~1.2× (docs/benchmarks/packrat_crossover_resnet50.md): an
intra-op GEMM split over two cores waits for the slower of them, so
everything else on the box (the frontend, the clients, decoding) slows it
more.  With one pair, measured on the split and applied to the fat worker,
Packrat credited the fat worker with ~15 req/s where it served ~12, and at a
constant 10 req/s moved back to it on a dip
(docs/benchmarks/packrat_constant_resnet50.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.pinning.slots import ServiceTotals


@dataclass(frozen=True)
class Calibration:
    slowdown: float = 1.0
    overhead_ms: float = 0.0
    updates: int = 0  # windows measured so far (0: the bare profile)

    def round_ms(self, k: int, profiled_ms: float) -> float:
        """Predicted time of one round of ``k`` requests profiled at ``profiled_ms``."""
        return profiled_ms * self.slowdown + k * self.overhead_ms

    def to_dict(self) -> dict[str, float]:
        return {"slowdown": round(self.slowdown, 3), "overhead_ms": round(self.overhead_ms, 2), "updates": self.updates}


@dataclass(frozen=True)
class CalibrationConfig:
    min_requests: int = 20  # a window must hold this many requests to count
    learning_rate: float = 0.3  # EWMA weight of a new window (the first one counts fully)
    min_slowdown: float = 0.5
    max_slowdown: float = 4.0

    def __post_init__(self) -> None:
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be ≥ 1, got {self.min_requests}")
        if not 0.0 < self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1], got {self.learning_rate}")
        if not 0.0 < self.min_slowdown <= 1.0 <= self.max_slowdown:
            raise ValueError("need 0 < min_slowdown ≤ 1 ≤ max_slowdown")


def profiled_round_ms(rounds_ms: tuple[tuple[int, float], ...], k: float) -> float:
    """The profiled time of a round of ``k`` (a mean batch size, so fractional):
    linear between profiled batch sizes, and along the last segment beyond them
    (a model's time is close to affine in the batch size)."""
    points = sorted(rounds_ms)
    if not points:
        raise ValueError("no profiled batch sizes")
    if len(points) == 1:
        b, ms = points[0]
        return ms * k / b
    for (k0, ms0), (k1, ms1) in zip(points, points[1:], strict=False):
        if k <= k1 or (k1, ms1) == points[-1]:
            return max(0.0, ms0 + (ms1 - ms0) * (k - k0) / (k1 - k0))
    raise AssertionError("unreachable")


class ServiceCalibrator:
    """Turns the active set's cumulative counters into a ``Calibration``."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig(), prior: Calibration = Calibration()) -> None:
        """``prior``: what to predict with until a window is measured (the
        profile's own handler cost, ``optimizer.serving_costs``); the first
        measured window replaces it."""
        self.config = config
        self.current = prior
        self._base: ServiceTotals | None = None

    def restart(self, totals: ServiceTotals) -> None:
        """A new active set: measure from its counters as they are now."""
        self._base = totals

    def update(self, totals: ServiceTotals, rounds_ms: tuple[tuple[int, float], ...]) -> bool:
        """Fold in the window since the last update, if it is long enough; True if it was."""
        base = self._base
        if base is None or totals.requests < base.requests or totals.batches < base.batches:
            # First reading, or a worker restarted and took its counters with it.
            self._base = totals
            return False
        window = totals - base
        if window.requests < self.config.min_requests or window.batches <= 0 or window.model_s <= 0:
            return False
        self._base = totals
        mean_batch = window.requests / window.batches
        profiled_s = profiled_round_ms(rounds_ms, mean_batch) * window.batches / 1000.0
        cfg = self.config
        slowdown = min(cfg.max_slowdown, max(cfg.min_slowdown, window.model_s / profiled_s))
        overhead_ms = max(0.0, (window.handler_s - window.model_s) * 1000.0 / window.requests)
        old = self.current
        rate = 1.0 if old.updates == 0 else cfg.learning_rate
        self.current = Calibration(
            old.slowdown + rate * (slowdown - old.slowdown),
            old.overhead_ms + rate * (overhead_ms - old.overhead_ms),
            old.updates + 1,
        )
        return True


class CalibrationBook:
    """One ``ServiceCalibrator`` per worker class (threads per worker); the module doc says why."""

    def __init__(self, config: CalibrationConfig = CalibrationConfig(), prior: Calibration = Calibration()) -> None:
        self.config = config
        self.prior = prior
        self._by_class: dict[int, ServiceCalibrator] = {}
        self._latest: Calibration = prior  # the last calibration measured, of any class

    def restart(self, threads: int, totals: ServiceTotals) -> None:
        """Workers of ``threads`` threads now serve: measure them from their counters as they are now."""
        self._calibrator(threads).restart(totals)

    def update(self, threads: int, totals: ServiceTotals, rounds_ms: tuple[tuple[int, float], ...]) -> bool:
        """Fold the serving class's window in (``ServiceCalibrator.update``); True if it was."""
        calibrator = self._calibrator(threads)
        if not calibrator.update(totals, rounds_ms):
            return False
        self._latest = calibrator.current
        return True

    def for_class(self, threads: int) -> Calibration:
        """What workers of ``threads`` threads cost: their own measurement, or the latest of any class."""
        calibrator = self._by_class.get(threads)
        if calibrator is not None and calibrator.current.updates > 0:
            return calibrator.current
        return self._latest

    def measured(self) -> dict[int, Calibration]:
        return {t: c.current for t, c in sorted(self._by_class.items()) if c.current.updates > 0}

    def _calibrator(self, threads: int) -> ServiceCalibrator:
        if threads not in self._by_class:
            self._by_class[threads] = ServiceCalibrator(self.config, self.prior)
        return self._by_class[threads]
