"""Packrat's 2-D knapsack: split T cores and a batch of B over instances.

Items are the profiled points ``(t, b)`` with value ``L[t][b]``; a plan is a
multiset of items (repeats allowed), one item per worker instance, feasible
when ``Σ t ≤ T`` and ``Σ b = B``.  Instances run concurrently, so a plan's
latency is the *maximum* latency of its items, and the optimizer minimises
that.  Among plans of equal latency it prefers fewer threads (cores left for
other models), then fewer instances.

Dynamic programme over profiled items only, ``O(T · B · |items|)``::

    f[τ][0] = 0
    f[τ][β] = min( f[τ-1][β],  min_{items, t ≤ τ, b ≤ β} max(L[t][b], f[τ-t][β-b]) )

Every item has ``t ≥ 1``, so row ``τ`` reads only rows ``< τ``; that lets one
numpy operation update a whole row per item.  The tie-break is a second exact
DP over the items no slower than the optimum: ``g[β] = min Σ(t·K + 1)`` with
``K > B`` so that threads dominate and the instance count breaks ties.
"""

from __future__ import annotations

import math

import numpy as np

from packrat_plugin.calibration import Calibration
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.profile import Profile


class InfeasibleError(ValueError):
    """No multiset of profiled items meets the (T, B) constraints."""


def expected_speedup(optimizer: KnapsackOptimizer, plan: Plan) -> float | None:
    """The prediction of a plan's gain over the fat instance ⟨1, T, B⟩ under the
    optimizer's costs: its round time of ⟨T, B⟩ over the plan's slowest
    instance's; None when a point was not profiled."""
    try:
        return optimizer.latency(plan.threads, plan.batch) / optimizer.plan_latency(plan)
    except KeyError:
        return None


def serving_costs(profile: Profile) -> Calibration:
    """What a TorchServe worker pays per request besides the model, as the
    profile measured it (``handler_cost.py``); nothing when it did not.

    One number for every thread count: the handler runs on the worker's main
    thread, so its cost barely depends on ``t`` (the profile keeps each ``t``'s
    measurement; this takes their mean).
    """
    handler = profile.handler
    if handler is None or not handler.per_request_ms:
        return Calibration()
    values = list(handler.per_request_ms.values())
    return Calibration(overhead_ms=sum(values) / len(values))


def _group(items: list[tuple[int, int]]) -> tuple[PlanItem, ...]:
    counts: dict[tuple[int, int], int] = {}
    for t, b in items:
        counts[(t, b)] = counts.get((t, b), 0) + 1
    # Largest instances first: the order the allocator packs them in.
    return tuple(sorted((PlanItem(c, t, b) for (t, b), c in counts.items()), key=lambda i: (-i.threads, -i.batch)))


class KnapsackOptimizer:
    """Plans for one profile; answers are cached per (T, B, uniform).

    ``costs`` turns a profiled point into the time a worker really takes for
    a round of ``b`` (``Calibration.round_ms``: the model slowed by
    contention, plus the handler's per-request cost); the default is the
    model alone, what ``bench/packrat_micro.py`` runs.  ``serving_costs``
    gives the profile's own measurement, for plans served by TorchServe.
    """

    def __init__(self, profile: Profile, costs: Calibration = Calibration()) -> None:
        self.profile = profile
        self.costs = costs
        pts = sorted(profile.points)
        self._t = np.array([p.threads for p in pts], dtype=np.int64)
        self._b = np.array([p.batch for p in pts], dtype=np.int64)
        self._lat = np.array([costs.round_ms(p.batch, p.latency_ms) for p in pts], dtype=np.float64)
        self._cache: dict[tuple[int, int, bool], Plan] = {}

    def latency(self, threads: int, batch: int) -> float:
        """One instance ⟨t, b⟩'s predicted round time (ms) under ``costs``; KeyError if not profiled."""
        return self.costs.round_ms(batch, self.profile.latency(threads, batch))

    def plan_latency(self, plan: Plan) -> float:
        """Any plan's predicted latency under ``costs``: its slowest instance's round."""
        return max(self.latency(i.threads, i.batch) for i in plan.instances)

    def plan(self, threads: int, batch: int, uniform: bool = False) -> Plan:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InfeasibleError(f"threads must be a positive integer, got {threads!r}")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise InfeasibleError(f"batch must be a positive integer, got {batch!r}")
        key = (threads, batch, uniform)
        if key not in self._cache:
            self._cache[key] = self._uniform(threads, batch) if uniform else self._general(threads, batch)
        return self._cache[key]

    # -- uniform: one (t, b) class, what one TorchServe version can express --

    def _uniform(self, T: int, B: int) -> Plan:
        best: tuple[float, int, int, int, int] | None = None
        for t, b, lat in zip(self._t.tolist(), self._b.tolist(), self._lat.tolist(), strict=True):
            if B % b:
                continue
            count = B // b
            if count * t > T:
                continue
            key = (lat, count * t, count, t, b)
            if best is None or key < best:
                best = key
        if best is None:
            raise InfeasibleError(self._why_infeasible(T, B, uniform=True))
        lat, _, count, t, b = best
        return Plan(T, B, lat, (PlanItem(count, t, b),))

    # -- general: any multiset -------------------------------------------------

    def _general(self, T: int, B: int) -> Plan:
        latency = self._min_max_latency(T, B)
        if not math.isfinite(latency):
            raise InfeasibleError(self._why_infeasible(T, B, uniform=False))
        items = self._fewest_threads(B, self._lat <= latency)
        plan = Plan(T, B, latency, _group(items))
        assert plan.threads_used <= T and sum(i.count * i.batch for i in plan.instances) == B
        return plan

    def _min_max_latency(self, T: int, B: int) -> float:
        f = np.full((T + 1, B + 1), np.inf)
        f[:, 0] = 0.0
        for tau in range(1, T + 1):
            row = f[tau]
            np.minimum(row, f[tau - 1], out=row)
            for t, b, lat in zip(self._t.tolist(), self._b.tolist(), self._lat.tolist(), strict=True):
                if t > tau or b > B:
                    continue
                # Candidates for β ∈ [b, B]: max(L, f[τ-t][β-b]).
                np.minimum(row[b:], np.maximum(lat, f[tau - t, : B + 1 - b]), out=row[b:])
        return float(f[T, B])

    def _fewest_threads(self, B: int, allowed: np.ndarray) -> list[tuple[int, int]]:
        """Exact min-threads (then min-instances) multiset summing to B over allowed items."""
        ts, bs = self._t[allowed], self._b[allowed]
        weight = ts * (B + 1) + 1  # lexicographic (threads, instances): count ≤ B < B + 1
        g = np.full(B + 1, np.iinfo(np.int64).max // 4, dtype=np.int64)
        choice = np.full(B + 1, -1, dtype=np.int64)
        g[0] = 0
        for beta in range(1, B + 1):
            fits = bs <= beta
            if not fits.any():
                continue
            idx = np.nonzero(fits)[0]
            costs = weight[idx] + g[beta - bs[idx]]
            k = int(np.argmin(costs))
            if costs[k] < g[beta]:
                g[beta] = costs[k]
                choice[beta] = idx[k]
        items: list[tuple[int, int]] = []
        beta = B
        while beta > 0:
            k = int(choice[beta])
            assert k >= 0, "reconstruction reached an unreachable batch"
            items.append((int(ts[k]), int(bs[k])))
            beta -= int(bs[k])
        return items

    def _why_infeasible(self, T: int, B: int, uniform: bool) -> str:
        batches = sorted(set(self._b.tolist()))
        if uniform:
            divisors = [b for b in batches if B % b == 0]
            if not divisors:
                return f"B={B} is not a multiple of any profiled batch size {batches}"
            need = min(int(self._t[self._b == b].min()) * (B // b) for b in divisors)
            return f"a uniform plan for B={B} needs at least {need} threads, but T={T}"
        reachable = np.zeros(B + 1, dtype=bool)
        reachable[0] = True
        for beta in range(1, B + 1):
            reachable[beta] = any(b <= beta and reachable[beta - b] for b in batches)
        if not reachable[B]:
            return f"B={B} is not a sum of profiled batch sizes {batches}"
        items = self._fewest_threads(B, np.ones_like(self._b, dtype=bool))
        need = sum(t for t, _ in items)
        return f"B={B} needs at least {need} threads with the profiled points, but T={T}"
