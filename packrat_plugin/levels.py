"""Packrat's levels and what each is predicted to cost at an arrival rate: the policy's queueing model.

A *level* is a power-of-two ``B`` with its uniform plan from the optimizer:
``i`` instances of ⟨t, b⟩ (``i·b = B``).  TorchServe does not wait for full
batches: a worker takes what is queued, up to its ``batch_size`` ``b``, so
the batch adapts to the load.  All ``i`` workers of a version take from one
queue, so a level is a multi-server queue: rounds of ``k`` requests arrive
at ``λ/k`` and ``i`` servers serve them in ``L[t][k]`` each (deterministic).
A level's mean latency at arrival rate λ is predicted as the best over the
profiled batch sizes ``k ≤ b`` of an M/D/i queue, by the Allen–Cunneen
approximation (half the M/M/i wait, Erlang C for the chance to wait)::

    ρ_k = λ · L[t][k] / (i · k),   W(λ) = min_k L[t][k] · (1 + C(i, i·ρ_k) / (2 · i · (1 − ρ_k)))

(∞ for ρ ≥ 1; for one instance this is the exact M/D/1 mean, and it gives
one shared queue of ``i`` workers its due: on the 2-core VM two 1-thread
ResNet-50 workers beat one 2-thread worker from about 9-10 requests/s, where
treating each worker as its own M/D/1 queue put the crossover at 12, see
docs/benchmarks/README.md.)  So a larger cap ``b`` is never predicted worse
than a smaller one of the same ⟨i, t⟩: the decisions that matter are the
split into instances and threads, and enough batch capacity for the load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from packrat_plugin.calibration import Calibration, profiled_round_ms
from packrat_plugin.optimizer import InfeasibleError, KnapsackOptimizer
from packrat_plugin.plan_types import Plan
from packrat_plugin.profile import Profile


@dataclass(frozen=True)
class Level:
    """One power-of-two B, the uniform plan that serves it, and the profiled
    round times ``L[t][k]`` (ms) of the batch sizes ``k ≤ b`` its workers may form."""

    batch: int
    plan: Plan
    rounds_ms: tuple[tuple[int, float], ...]  # (k, L[t][k]) for profiled k ≤ b
    calibration: Calibration = Calibration()  # what serving costs beyond the profile (calibration.py)

    @property
    def instances(self) -> int:
        return self.plan.instances[0].count

    @property
    def round_s(self) -> float:
        """The time of a full round of B, calibrated.  From the profiled round
        (``plan.latency_ms`` already holds the optimizer's own costs); a mixed
        plan's level has none and keeps the optimizer's prediction."""
        b = self.plan.instances[0].batch
        profiled = dict(self.rounds_ms).get(b)
        if profiled is None:
            return self.plan.latency_ms / 1000.0
        return self.calibration.round_ms(b, profiled) / 1000.0

    def _rounds_s(self) -> list[tuple[int, float]]:
        return [(k, self.calibration.round_ms(k, ms) / 1000.0) for k, ms in self.rounds_ms]

    @property
    def capacity(self) -> float:
        """Requests per second this level sustains (its best batch size, back to back)."""
        return max(self.instances * k / round_s for k, round_s in self._rounds_s())

    def predicted_latency_s(self, rate: float) -> float:
        """Mean latency at ``rate`` requests/s; inf when no batch size keeps up."""
        best = math.inf
        i = self.instances
        for k, round_s in self._rounds_s():
            rho = rate * round_s / (i * k)
            if rho < 1.0:
                wait = erlang_c(i, i * rho) / (2.0 * i * (1.0 - rho))
                best = min(best, round_s * (1.0 + wait))
        return best

    def closed_loop_latency_s(self, in_flight: float) -> float:
        """Mean latency with ``in_flight`` requests always in the system (a closed loop), calibrated.

        TorchServe hands a worker that asks for work every queued request up
        to its ``batch_size`` (the frontend's ``pollBatch``), and a closed
        loop's requests come back together, as their batch answers.  So a
        worker takes ``k = min(b, N)`` and only ``⌈N/k⌉`` of the ``i``
        workers are busy: with fewer requests than the level's ``B``, the
        first worker to ask takes them all and the others idle.  A round
        takes ``L[t][k]``; with more requests than the busy workers hold, a
        request waits ``N/(busy·k)`` rounds on average (Little's law at the
        level's throughput ``busy·k/L[t][k]``).  At ``N = B`` this is the
        paper's view of the load (B requests in the system) and the
        optimizer's objective for B: the plan it returns for B minimises
        exactly this there.

        Why not ``N/i`` each: that spread credited a level larger than the
        load with all its workers.  On the 2-vCPU EPYC at 8 in flight it put
        2×⟨1,8⟩ at a round of four, 407 ms, better than the fat worker's 500,
        and the controller moved there; TorchServe served it at 810 ms
        (``L[1][8]`` = 794: one worker took all eight) against the fat
        worker's 578, measured side by side by ``make demo``.
        """
        n = max(1.0, in_flight)
        b = self.plan.instances[0].batch
        if not self.rounds_ms:  # a mixed plan's level: the optimizer's own prediction for its B
            return self.round_s * max(1.0, n / (self.instances * b))
        k = min(float(b), n)
        busy = min(self.instances, math.ceil(n / k))
        round_s = self.calibration.round_ms(k, profiled_round_ms(self.rounds_ms, k)) / 1000.0
        return round_s * max(1.0, n / (busy * k))

    def latency_within_s(self, rate: float, horizon_s: float) -> float:
        """Mean latency at ``rate`` over ``horizon_s`` seconds: the steady state,
        but no worse than the backlog that ``horizon_s`` can build.

        Past capacity the steady state is infinite; over a finite stay at a
        load the queue grows at ``rate − capacity`` (half of that on average
        over the stay) plus the ``√(rate·horizon)`` that Poisson arrivals
        wander near capacity.  Finite, so levels can be compared in
        expectation over a rate that is only known within its noise.
        """
        mu = self.capacity
        backlog = max(0.0, rate - mu) * horizon_s / 2.0 + math.sqrt(max(rate, 0.0) * horizon_s)
        return min(self.predicted_latency_s(rate), self.round_s + backlog / mu)

    def expected_latency_s(self, rate: float, span_s: float, horizon_s: float) -> float:
        """:meth:`latency_within_s` averaged over what a rate measured as
        ``rate·span_s`` arrivals may really be (normal approximation of the
        Poisson count, five-point Gauss–Hermite quadrature)."""
        sd = math.sqrt(max(rate * span_s, 1.0)) / span_s if span_s > 0 else 0.0
        return sum(w * self.latency_within_s(max(0.0, rate + z * sd), horizon_s) for z, w in _NORMAL_NODES)


# Five-point Gauss–Hermite rule for a standard normal: E[f(Z)] ≈ Σ w·f(z).
_NORMAL_NODES = (
    (0.0, 0.533333333),
    (-1.355626180, 0.222075922), (1.355626180, 0.222075922),
    (-2.856970014, 0.011257411), (2.856970014, 0.011257411),
)  # fmt: skip


def worker_class(level: Level) -> tuple[int, int]:
    item = level.plan.instances[0]
    return item.count, item.threads


def erlang_c(servers: int, offered: float) -> float:
    """The chance that an arrival waits in an M/M/c queue with ``offered`` = λ·S erlangs.

    Summed with the Erlang B recursion (stable for any ``servers``);
    ``offered < servers`` is the caller's to ensure.
    """
    if offered <= 0.0:
        return 0.0
    blocking = 1.0  # Erlang B with 0 servers
    for c in range(1, servers + 1):
        blocking = offered * blocking / (c + offered * blocking)
    rho = offered / servers
    return blocking / (1.0 - rho + rho * blocking)


def levels_for(optimizer: KnapsackOptimizer, threads: int, max_batch: int) -> list[Level]:
    """Levels B = 1, 2, 4, … ≤ ``max_batch`` that have a uniform plan on ``threads`` cores."""
    profile = optimizer.profile
    levels = []
    b = 1
    while b <= max_batch:
        try:
            plan = optimizer.plan(threads, b, uniform=True)
        except InfeasibleError:
            b *= 2
            continue
        levels.append(level_of(profile, b, plan))
        b *= 2
    return levels


def level_of(profile: Profile, batch: int, plan: Plan) -> Level:
    """A level serving ``batch`` with ``plan``; the round times are those of a uniform plan's class
    (a mixed plan's are left empty: the queueing model above is for one class)."""
    if not plan.uniform:
        return Level(batch, plan, ())
    item = plan.instances[0]
    points = sorted(profile.points)
    rounds = tuple((p.batch, p.latency_ms) for p in points if p.threads == item.threads and p.batch <= item.batch)
    return Level(batch, plan, rounds)
