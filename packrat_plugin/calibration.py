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

That one slowdown is not the same for every class, and it grows with the
load. On the 2-core VM (``docs/benchmarks/packrat_crossover_resnet50.md``)
the 2-thread worker's model ran at 1.18-1.33× its profile at 4-8 req/s and
1.40-1.52× at 10-13, two 1-thread workers at 1.22-1.26× up to 12. The rest
of the machine (TorchServe's frontend, the clients, the controller) takes
CPU time on the model's cores in proportion to the load, and a team of t
threads stalls whenever any of its t cores is taken, a one-thread worker
only when its own is. So, with ``β(r)`` the share of the model's cores the
rest of the machine takes at rate ``r`` (``contention · r``)::

    slowdown(t, r) = slowdown / (1 − t · β(r))

``slowdown`` is then the model's own slowdown with the machine to itself,
and ``contention`` is measured from the cores' busy time (the kernel's per-CPU
counters) less the workers' own: a window's β is that difference over its
wall time and the model's cores, divided by the window's request rate.
Where no busy time is given (tests, the queue model) ``contention`` stays 0
and every class keeps the one slowdown, as before.  Why it matters: with one
slowdown measured on the fat worker at a light load the policy put the
crossover to the split at 12-14 req/s against the 10 measured, and so moved
late on a step that ended near 14 and not at all on the diurnal's slow rise
(``docs/benchmarks/reading/packrat.md``).  Keeping a pair per worker class,
each measured at the load it last served, was tried before and is worse: at
a constant 16 req/s the split's fresh 1.3× against the fat worker's 1.2×
from a lighter load moved there and back.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.pinning.slots import ServiceTotals

# t·β is capped here (a team at most 10× slower than uncontended): the formula is a first-order model, and a
# load the machine cannot carry is the queueing model's to refuse.
MAX_CONTENDED_SHARE = 0.9


@dataclass(frozen=True)
class Calibration:
    slowdown: float = 1.0
    overhead_ms: float = 0.0
    updates: int = 0  # windows measured so far (0: the bare profile)
    # Share of the model's cores the rest of the machine takes per request/s of load (the module doc says why).
    contention: float = 0.0

    def slowdown_at(self, threads: int = 1, rate: float = 0.0) -> float:
        """The model's slowdown for a team of ``threads`` at ``rate`` requests/s."""
        share = min(MAX_CONTENDED_SHARE, threads * self.contention * max(rate, 0.0))
        return self.slowdown / (1.0 - share)

    def round_ms(self, k: int, profiled_ms: float, threads: int = 1, rate: float = 0.0) -> float:
        """Predicted time of one round of ``k`` requests profiled at ``profiled_ms``, by a team of
        ``threads`` while the load is ``rate`` requests/s."""
        return profiled_ms * self.slowdown_at(threads, rate) + k * self.overhead_ms

    def to_dict(self) -> dict[str, float]:
        return {"slowdown": round(self.slowdown, 3), "overhead_ms": round(self.overhead_ms, 2),
                "contention": round(self.contention, 5), "updates": self.updates}  # fmt: skip


@dataclass(frozen=True)
class CoreUsage:
    """Cumulative wall time and busy CPU time of the model's cores (the kernel's per-CPU counters)."""

    wall_s: float
    busy_s: float

    def __sub__(self, other: CoreUsage) -> CoreUsage:
        return CoreUsage(self.wall_s - other.wall_s, self.busy_s - other.busy_s)


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
        self._usage: CoreUsage | None = None

    def restart(self, totals: ServiceTotals, usage: CoreUsage | None = None) -> None:
        """A new active set: measure from its counters as they are now."""
        self._base, self._usage = totals, usage

    def update(
        self,
        totals: ServiceTotals,
        rounds_ms: tuple[tuple[int, float], ...],
        threads: int = 1,
        usage: CoreUsage | None = None,
        cores: int = 1,
    ) -> bool:
        """Fold in the window since the last update, if it is long enough; True if it was.

        ``threads``: the active class's team size; ``usage``: its ``cores`` cores' usage now (None: contention
        is not measured, and the slowdown is read as every class's, as before)."""
        base = self._base
        if base is None or totals.requests < base.requests or totals.batches < base.batches:
            # First reading, or a worker restarted and took its counters with it.
            self._base, self._usage = totals, usage
            return False
        window = totals - base
        if window.requests < self.config.min_requests or window.batches <= 0 or window.model_s <= 0:
            return False
        mean_batch = window.requests / window.batches
        profiled_s = profiled_round_ms(rounds_ms, mean_batch) * window.batches / 1000.0
        cfg = self.config
        measured = window.model_s / profiled_s
        old = self.current
        contention = old.contention
        if usage is not None and self._usage is not None and (used := usage - self._usage).wall_s > 0:
            # The workers' own CPU: each forward pass keeps its whole team busy; decode and encode one thread.
            own_s = window.model_s * threads + (window.handler_s - window.model_s)
            share = min(MAX_CONTENDED_SHARE, max(0.0, used.busy_s - own_s) / (used.wall_s * max(cores, 1)))
            rate = window.requests / used.wall_s
            contention = share / rate
            measured *= 1.0 - min(MAX_CONTENDED_SHARE, threads * share)  # the uncontended slowdown
        self._base, self._usage = totals, usage
        slowdown = min(cfg.max_slowdown, max(cfg.min_slowdown, measured))
        overhead_ms = max(0.0, (window.handler_s - window.model_s) * 1000.0 / window.requests)
        weight = 1.0 if old.updates == 0 else cfg.learning_rate
        self.current = Calibration(
            old.slowdown + weight * (slowdown - old.slowdown),
            old.overhead_ms + weight * (overhead_ms - old.overhead_ms),
            old.updates + 1,
            old.contention + weight * (contention - old.contention),
        )
        return True
