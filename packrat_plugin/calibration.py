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
``L[t][k] · slowdown + k · overhead_ms``.  Both are measured on the active
worker class and applied to every class: the overhead is per request and
single-threaded whatever ``t`` is; the slowdown is the share of the machine
that serving does not get, roughly the same for any split of the cores.

Roughly: on the 2-core VM a 2-thread ResNet-50 worker ran at 1.2-1.5× its
profile and two 1-thread workers at ~1.2× (docs/benchmarks/
packrat_crossover_resnet50.md), so one pair measured on the split flatters
the fat worker.  Keeping a pair per worker class was tried and is worse: a
class's numbers are measured at the load it last served, and the slowdown
grows with the load (the frontend and the clients take more of the cores),
so at a constant 16 req/s the split's fresh 1.3× against the fat worker's
1.2× from a lighter load made the fat worker look the larger and moved
there and back (issue 45's constant-load bench).  A slowdown that is a
function of the load, per class, looked like what would fix both.

Measured since (``docs/benchmarks/packrat_crossover_resnet50_cpu_share.md``
and ``..._interleaved_profile.md``): the workers' threads run 0.95-0.98 of
their forward passes' time in both classes at every load, so the rest of the
machine does not stall the fat worker's team; and the classes' different
slowdowns (0.98-1.25× against 1.22-1.36×) came from the profile, whose
one-pass sweep measured all of t = 1 and then all of t = 2 a minute apart
on a VM that drifts. Profiled in interleaved passes (``profiler.py``), both
classes run at 1.01-1.15× their profile, so one slowdown serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.pinning.slots import ServiceTotals


@dataclass(frozen=True)
class Calibration:
    slowdown: float = 1.0
    overhead_ms: float = 0.0
    updates: int = 0  # windows measured so far (0: the bare profile)

    def round_ms(self, k: float, profiled_ms: float) -> float:
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


def window_calibration(window: ServiceTotals, rounds_ms: tuple[tuple[int, float], ...]) -> Calibration:
    """What one window of a class's counters measured, unclamped: the model's time over the profiled time of
    the rounds it served (at their mean batch), and the handler's time outside the model per request."""
    mean_batch = window.requests / window.batches
    profiled_s = profiled_round_ms(rounds_ms, mean_batch) * window.batches / 1000.0
    return Calibration(window.model_s / profiled_s, (window.handler_s - window.model_s) * 1000.0 / window.requests, 1)


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
        measured = window_calibration(window, rounds_ms)
        cfg = self.config
        slowdown = min(cfg.max_slowdown, max(cfg.min_slowdown, measured.slowdown))
        overhead_ms = max(0.0, measured.overhead_ms)
        old = self.current
        rate = 1.0 if old.updates == 0 else cfg.learning_rate
        self.current = Calibration(
            old.slowdown + rate * (slowdown - old.slowdown),
            old.overhead_ms + rate * (overhead_ms - old.overhead_ms),
            old.updates + 1,
        )
        return True
