"""Dividing one server's cores among several models: a knapsack over models × core counts.

Every served model has a predicted mean latency for each number of cores it
could get, at the arrival rate it has now: ``W_m(c)``, from its profile and
the reconfiguration policy's queueing model (``levels.Level``; the
controller builds the table, see ``controller.PackratController``).  The
division gives model ``m`` ``c_m ≥ min_cores`` cores with ``Σ c_m = T`` and
minimises one of two documented objectives (``packrat serve --share-objective``):

- ``worst``: the largest ``W_m(c_m)``, so no model is sacrificed for the
  others (ties: the smaller load-weighted mean);
- ``mean``: the load-weighted mean ``Σ λ_m W_m(c_m) / Σ λ_m``, the mean
  latency a request sees whichever model it asks (equal weights when nothing
  arrives).

Both are exact dynamic programmes over models, ``O(M · T²)``::

    worst:  f[m][τ] = min_c  max(f[m-1][τ-c], W_m(c))
    mean:   f[m][τ] = min_c  f[m-1][τ-c] + w_m · W_m(c)

The ``worst`` tie-break is a second exact programme (the weighted mean over
the choices no worse than the optimum), as in ``optimizer.py``.  All cores are
handed out: a model's table is a minimum over plans on *at most* ``c``
threads, so another core never makes its prediction worse.

``DivisionPolicy`` decides when to move from one division to another
(persistence and hysteresis, like ``policy.ReconfigurationPolicy``), and
``split_topology`` turns core counts into disjoint core sets.  No TorchServe
here: tests drive this module with plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from serving_harness.topology import CpuTopology

Objective = Literal["worst", "mean"]
OBJECTIVES: tuple[Objective, ...] = ("worst", "mean")
# A model no plan keeps up with is predicted at OVERLOAD_S × (rate / capacity):
# worse than any latency a plan that keeps up can have, and less bad the more
# capacity it gets, so the division still knows which way helps.
OVERLOAD_S = 1.0e4


class DivisionError(ValueError):
    """The models cannot be given their minimum share of the cores."""


@dataclass(frozen=True)
class ModelDemand:
    """One model's predicted latencies: ``latency_s[c - 1]`` on ``c`` cores, c = 1..T."""

    name: str
    rate: float  # requests/s now: the model's weight in the ``mean`` objective
    latency_s: tuple[float, ...]

    def on(self, cores: int) -> float:
        return self.latency_s[cores - 1]


@dataclass(frozen=True)
class Division:
    cores: Mapping[str, int]  # model → core count
    worst_s: float
    mean_s: float

    def value(self, objective: Objective) -> float:
        return self.worst_s if objective == "worst" else self.mean_s

    def to_dict(self) -> dict[str, object]:
        def finite(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None

        return {"cores": dict(self.cores), "worst_s": finite(self.worst_s), "mean_s": finite(self.mean_s)}


def weights(demands: Sequence[ModelDemand]) -> list[float]:
    """Each model's share of the arrivals (equal shares when nothing arrives)."""
    total = sum(max(0.0, d.rate) for d in demands)
    if total <= 0:
        return [1.0 / len(demands)] * len(demands)
    return [max(0.0, d.rate) / total for d in demands]


def evaluate(demands: Sequence[ModelDemand], cores: Mapping[str, int]) -> Division:
    """A given division's objectives."""
    w = weights(demands)
    lat = [d.on(cores[d.name]) for d in demands]
    mean = sum(wi * li for wi, li in zip(w, lat, strict=True) if wi > 0)
    return Division(dict(cores), max(lat), mean)


def _check(demands: Sequence[ModelDemand], total: int, min_cores: int) -> None:
    if not demands:
        raise DivisionError("no models to divide the cores among")
    if min_cores < 1:
        raise DivisionError(f"min_cores must be ≥ 1 (every model keeps a worker), got {min_cores}")
    names = [d.name for d in demands]
    if len(set(names)) != len(names):
        raise DivisionError(f"model names must be unique, got {names}")
    if len(demands) * min_cores > total:
        raise DivisionError(
            f"{len(demands)} models need at least {len(demands) * min_cores} cores ({min_cores} each, "
            f"--min-cores), but {total} are usable"
        )
    for d in demands:
        if len(d.latency_s) < total:
            raise DivisionError(f"{d.name}: latency table covers {len(d.latency_s)} cores, need {total}")


def divide(demands: Sequence[ModelDemand], total: int, min_cores: int = 1, objective: Objective = "worst") -> Division:
    """The exact optimum division of ``total`` cores (see the module docstring)."""
    if objective not in OBJECTIVES:
        raise DivisionError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    _check(demands, total, min_cores)
    w = weights(demands)
    cost = [[(w[m] * d.on(c) if w[m] > 0 else 0.0) for c in range(1, total + 1)] for m, d in enumerate(demands)]

    def weighted(acc: float, m: int, c: int) -> float:
        return acc + cost[m][c - 1]

    allowed = None
    if objective == "worst":
        best_worst, _ = _solve(demands, total, min_cores, lambda acc, m, c: max(acc, demands[m].on(c)))
        allowed = [[demands[m].on(c) <= best_worst for c in range(1, total + 1)] for m in range(len(demands))]
    _, choice = _solve(demands, total, min_cores, weighted, allowed)
    return evaluate(demands, choice)


def _solve(
    demands: Sequence[ModelDemand],
    total: int,
    min_cores: int,
    combine: Callable[[float, int, int], float],
    allowed: list[list[bool]] | None = None,
) -> tuple[float, dict[str, int]]:
    """One pass of the programme over the first m models and exactly τ cores.

    ``combine(acc, m, c)`` adds model m on c cores to the value ``acc`` of
    the models before it (max or a weighted sum: both monotone in ``acc``,
    which is what makes the programme exact).  ``allowed[m][c-1]`` false
    excludes model m on c cores.  Returns the optimum and the core counts
    that reach it; feasibility is tracked apart from the value, so an
    infinite latency is a value, not "no division".
    """
    m_count = len(demands)
    value = [[math.inf] * (total + 1) for _ in range(m_count + 1)]
    reach = [[False] * (total + 1) for _ in range(m_count + 1)]
    pick = [[0] * (total + 1) for _ in range(m_count + 1)]
    value[0][0], reach[0][0] = 0.0, True
    for m in range(m_count):
        for tau in range(total + 1):
            for c in range(min_cores, tau + 1):
                if not reach[m][tau - c] or (allowed is not None and not allowed[m][c - 1]):
                    continue
                v = combine(value[m][tau - c], m, c)
                if not reach[m + 1][tau] or v < value[m + 1][tau]:
                    value[m + 1][tau], reach[m + 1][tau], pick[m + 1][tau] = v, True, c
    if not reach[m_count][total]:
        raise DivisionError("no division satisfies the constraints")
    counts: dict[str, int] = {}
    tau = total
    for m in range(m_count, 0, -1):
        counts[demands[m - 1].name] = pick[m][tau]
        tau -= pick[m][tau]
    return value[m_count][total], {d.name: counts[d.name] for d in demands}


def split_topology(counts: Mapping[str, int], topology: CpuTopology) -> dict[str, CpuTopology]:
    """Disjoint core sets of the given sizes, each on one socket when it fits one.

    First-fit decreasing, as ``topology.allocate`` packs instances: the largest
    share first, onto the socket with the most free cores that holds it
    whole, its lowest free cores.  Equal counts get the same cores every
    time (ties go by name), so a re-division moves only the models whose
    share changed, as far as the packing allows.
    """
    if sum(counts.values()) > len(topology.cores):
        raise DivisionError(f"{sum(counts.values())} cores asked for, {len(topology.cores)} usable")
    free = {s: list(cores) for s, cores in topology.sockets.items()}
    out: dict[str, CpuTopology] = {}
    for name, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        fitting = [s for s, cores in free.items() if len(cores) >= n]
        taken: dict[int, list[int]] = {}
        if fitting:
            socket = max(fitting, key=lambda s: (len(free[s]), -s))
            taken[socket], free[socket] = free[socket][:n], free[socket][n:]
        else:
            need = n
            for socket in sorted(free, key=lambda s: (-len(free[s]), s)):
                take = min(need, len(free[socket]))
                if take:
                    taken[socket], free[socket] = free[socket][:take], free[socket][take:]
                    need -= take
        out[name] = CpuTopology({s: tuple(sorted(c)) for s, c in sorted(taken.items())})
    return out


@dataclass(frozen=True)
class DivisionConfig:
    """Knobs of re-division; every one is a ``packrat serve`` flag."""

    objective: Objective = "worst"
    min_cores: int = 1  # cores every model keeps, however idle (it never stops answering)
    min_gain: float = 0.15  # relative improvement of the objective a re-division must promise
    confirm_s: float = 3.0  # the same better division must be wanted this long
    settle_s: float = 10.0  # after a re-division, wait this long before the next

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.min_cores < 1:
            raise ValueError(f"min_cores must be ≥ 1, got {self.min_cores}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.confirm_s < 0 or self.settle_s < 0:
            raise ValueError("confirm_s and settle_s must be non-negative")


@dataclass
class DivisionPolicy:
    """When to re-divide: a better division, clearly better, wanted for a while.

    Re-dividing swaps the worker sets of every model whose share changes
    (cold starts on the new cores), so it must pay for itself: the best
    division at the measured rates must beat the current one by ``min_gain``
    on the objective, the same division must stay best for ``confirm_s``,
    and after a move the policy waits ``settle_s`` (the swaps' own backlog
    is not load).  An overloaded current division (a model predicted at
    ``OVERLOAD_S``) moves to any division that is better at all.
    """

    total: int
    config: DivisionConfig = field(default_factory=DivisionConfig)
    current: dict[str, int] | None = None
    _wanted: dict[str, int] | None = None
    _since: float = 0.0
    _quiet_until: float = -math.inf

    def initial(self, demands: Sequence[ModelDemand]) -> Division:
        division = divide(demands, self.total, self.config.min_cores, self.config.objective)
        self.current = dict(division.cores)
        return division

    def observe(self, now: float, demands: Sequence[ModelDemand]) -> Division | None:
        """The division to move to now, if any (``record_move`` once it is applied)."""
        if self.current is None:
            raise RuntimeError("call initial() first")
        best = divide(demands, self.total, self.config.min_cores, self.config.objective)
        if best.cores == self.current or now < self._quiet_until:
            self._wanted = None
            return None
        objective = self.config.objective
        now_value = evaluate(demands, self.current).value(objective)
        new_value = best.value(objective)
        overloaded = now_value >= OVERLOAD_S
        if not (new_value < now_value and (overloaded or new_value <= now_value * (1.0 - self.config.min_gain))):
            self._wanted = None
            return None
        if self._wanted != dict(best.cores):
            self._wanted, self._since = dict(best.cores), now
        if now - self._since < self.config.confirm_s:
            return None
        return best

    def record_move(self, now: float, cores: Mapping[str, int]) -> None:
        self.current = dict(cores)
        self._wanted = None
        self._quiet_until = now + self.config.settle_s
