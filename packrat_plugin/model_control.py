"""One model's control loop: measure load, decide, swap.

One ``ModelController`` per served model runs a short loop, in the shape of
an engine step (measure → policy → mechanism)::

    monitor.record(now, arrivals, depth)   # TorchServe's arrival counter + queue depth
    decision = policy.observe(monitor.observation(now), level, warm_levels)
    if decision: swapper.apply(decision.target.plan, standby_items(...)); swapper.keep_warm(...)

The policy (``policy.py``) chooses among *levels*: power-of-two batch sizes B
with their uniform plans from the optimizer (one TorchServe version holds one
batch size).  The swapper (``swapper.py``) is the mechanism: warm or cold
bring-up, set-default, drain, retire.  The supervisor (``controller.py``)
starts one thread per model running ``ModelController.run``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handlers.pinning.slots import PlanStore
from packrat_plugin.batch_credit import credit_batches
from packrat_plugin.calibration import Calibration, CalibrationConfig, ServiceCalibrator
from packrat_plugin.division import OVERLOAD_S, DivisionConfig
from packrat_plugin.levels import Level, level_of, levels_for
from packrat_plugin.load_monitor import LoadMonitor, MonitorConfig
from packrat_plugin.optimizer import InfeasibleError, KnapsackOptimizer, serving_costs
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.policy import Decision, PolicyConfig, ReconfigurationPolicy, prepared_moves, standby_items
from packrat_plugin.profile import Profile
from packrat_plugin.swapper import (
    ActivePassiveSwapper,
    SwapError,
    SwapperConfig,
    SwapReport,
    cores_tag,
    ready_counts,
)
from serving_harness.clients import ManagementClient, MetricsClient, TorchServeAPIError
from serving_harness.topology import CpuTopology

logger = logging.getLogger(__name__)

ARRIVALS_METRIC = "ts_inference_requests_total"


@dataclass
class ModelTarget:
    """A model to serve under Packrat: its archive and its profile."""

    name: str
    archive: Path
    profile: Profile


@dataclass
class ControllerConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    swapper: SwapperConfig = field(default_factory=SwapperConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    calibrate: bool = True  # False: plan on the bare profile
    # Plan only on batch sizes whose gain exceeds the spread of the profile's
    # passes (batch_credit.py); False: every profiled point, as its median says.
    # A fixed B is served as asked, on every point.
    credit_batches: bool = True
    # Idle workers kept warm beside the serving set, so that a swap to their
    # class starts nothing (each costs its memory: ~0.65 GB for ResNet-50).
    standby_workers: int = 8
    standby_wait_s: float = 600.0  # start() waits this long for the standby set (0: not at all)
    fixed_batch: int | None = None  # pin B (benchmarks, static settings)
    reconfigure: bool = True  # False: keep the first plan
    # Several models: divide the cores among them (division.py) rather than
    # let each plan over all of them as if it were alone.
    share_cores: bool = True
    division: DivisionConfig = field(default_factory=DivisionConfig)
    # With fixed_batch: serve the optimizer's exact plan for that B, mixed
    # instance types included (one worker runs them all, handlers/mixed_plan/handler.py).
    mixed_plans: bool = False

    def __post_init__(self) -> None:
        if self.mixed_plans and self.fixed_batch is None:
            raise ValueError("mixed_plans serves the exact plan of a fixed B: give fixed_batch too")
        if self.standby_workers < 0:
            raise ValueError(f"standby_workers must be ≥ 0, got {self.standby_workers}")
        if self.fixed_batch is not None and self.fixed_batch < 1:
            raise ValueError(f"fixed_batch must be ≥ 1, got {self.fixed_batch}")


def floor_power_of_two(x: float) -> int:
    """Largest power of two ≤ x (1 for x < 2)."""
    if x < 2:
        return 1
    return 1 << (int(x).bit_length() - 1)


def arrival_counters(metrics: MetricsClient, model: str) -> dict[str, float]:
    """TorchServe's arrival counter of ``model``, one value per series."""
    out = {}
    for labels, value in metrics.samples(ARRIVALS_METRIC):
        if labels.get("model_name") == model:
            out[f"{labels.get('model_version', '')}@{labels.get('hostname', '')}"] = value
    return out


class ModelController:
    def __init__(
        self,
        target: ModelTarget,
        management: ManagementClient,
        metrics: MetricsClient,
        store: PlanStore,
        model_store: Path,
        topology: CpuTopology,
        config: ControllerConfig,
        core_tag: str = "",
    ) -> None:
        self.target = target
        self.management = management
        self.metrics = metrics
        self.store = store
        self.topology = topology
        self.config = config
        # Plans account for what the handler costs per request, as the profile
        # measured it; online calibration then corrects the predictions.
        prior = serving_costs(target.profile) if config.calibrate else Calibration()
        credit = config.credit_batches and config.fixed_batch is None
        self.profile, self.uncredited = credit_batches(target.profile) if credit else (target.profile, [])
        for point in self.uncredited:
            logger.info("%s: %s", target.name, point.describe())
        self.optimizer = KnapsackOptimizer(self.profile, prior)
        self._levels_by_cores: dict[int, list[Level]] = {}
        self.threads = len(topology.cores)
        self.max_batch = self._largest_feasible_batch()
        self.levels: list[Level] = self.levels_on(self.threads)
        self.policy = ReconfigurationPolicy(self.levels, config.policy)
        self.monitor = LoadMonitor(config.monitor)
        self.calibrator = ServiceCalibrator(config.calibration, prior)
        self.policy.calibrate(prior)
        self.swapper = ActivePassiveSwapper(
            management, store, target.name, target.archive, model_store, topology, config.swapper,
            core_tag=core_tag,
        )  # fmt: skip
        # Held while the worker set changes: the model's own loop and a
        # re-division (PackratController) never swap at the same time.
        self.swap_lock = threading.Lock()
        self.level: Level | None = None
        self.plan: Plan | None = None
        self.last_pending = 0
        self.last_in_service = 0
        self.ready: dict[str, int] = {}
        self.swaps: list[SwapReport] = []
        self.decisions: list[dict[str, Any]] = []
        self.last_error: str | None = None
        self.swap_errors = 0  # reconfigurations that failed (the old set kept serving)
        self.adopted: dict[str, Any] | None = None  # set when this controller took over a running worker set
        self.lock = threading.Lock()
        # False: the loop samples but the policy does not move (moves come from ``move_to``: an operator's
        # hold, or a benchmark's moves at known load changes, which measure the swap apart from the detector).
        self.deciding = True

    def _largest_feasible_batch(self, threads: int | None = None) -> int:
        threads = self.threads if threads is None else threads
        best = 0
        b = 1
        while b <= threads * max(self.profile.batches):
            try:
                self.optimizer.plan(threads, b, uniform=True)
                best = b
            except InfeasibleError:
                pass
            b *= 2
        if best == 0:
            raise InfeasibleError(f"no uniform plan for {self.target.name} fits {threads} cores at any B")
        return best

    def levels_on(self, threads: int) -> list[Level]:
        """The levels this model would choose among on ``threads`` cores (cached)."""
        if threads not in self._levels_by_cores:
            self._levels_by_cores[threads] = levels_for(self.optimizer, threads, self._largest_feasible_batch(threads))
        return self._levels_by_cores[threads]

    def predicted_latency_s(self, threads: int, rate: float) -> float:
        """Mean latency of the best level on ``threads`` cores at ``rate``, calibrated.

        Past every level's capacity: ``division.OVERLOAD_S`` scaled by how far
        past, so that dividing cores still sees which share helps most.
        """
        calibration = self.calibrator.current
        try:
            levels = [dataclasses.replace(lv, calibration=calibration) for lv in self.levels_on(threads)]
        except InfeasibleError:  # the profile has no point that fits this few cores
            return math.inf
        best = min(lv.predicted_latency_s(rate) for lv in levels)
        if math.isfinite(best):
            return best
        capacity = max(lv.capacity for lv in levels)
        return OVERLOAD_S * max(1.0, rate / capacity)

    def place(self, topology: CpuTopology) -> None:
        """Plan on these cores from now on (the next swap moves the workers there)."""
        self.topology = topology
        self.threads = len(topology.cores)
        self.max_batch = self._largest_feasible_batch()
        self.levels = self.levels_on(self.threads)
        costs = self.policy.costs
        self.policy = ReconfigurationPolicy(self.levels, self.config.policy)
        self.policy.costs = costs
        self.policy.calibrate(self.calibrator.current)
        self.swapper.retarget(topology, cores_tag(topology))

    def reassign(self, topology: CpuTopology, rate: float) -> SwapReport:
        """Serve on other cores (a re-division): plan for them, swap to the best level at ``rate``.

        If the swap fails the old set keeps serving on the old cores, and the
        controller plans for those again.
        """
        with self.swap_lock:
            old = self.topology
            self.place(topology)
            level = self.fixed_level() if self.config.fixed_batch else self.policy.best(rate)
            try:
                report = self._apply(level)
            except (SwapError, TorchServeAPIError):
                self.place(old)
                raise
            self.policy.record_swap(time.monotonic(), report.serving_after_s, report.warm)
            return report

    def level_for(self, batch: int) -> Level:
        """The level for ``batch``, or for the largest one below it."""
        b = min(floor_power_of_two(batch), self.max_batch)
        candidates = [lv for lv in self.levels if lv.batch <= b]
        if not candidates:
            raise InfeasibleError(f"no uniform plan for {self.target.name} at B ≤ {batch}")
        return max(candidates, key=lambda lv: lv.batch)

    def plan_for(self, batch: int) -> Plan:
        """The uniform plan for ``batch``, or for the largest feasible power of two below it."""
        return self.level_for(batch).plan

    def fixed_level(self) -> Level:
        """The level a fixed B is served at: the uniform plan for the power of two at or below it, or
        with ``mixed_plans`` the optimizer's exact plan for B itself (one worker, an instance per lane)."""
        batch = self.config.fixed_batch or 1
        if not self.config.mixed_plans:
            return self.level_for(batch)
        return level_of(self.profile, batch, self.optimizer.plan(self.threads, batch))

    def start(self) -> SwapReport:
        level = self.fixed_level() if self.config.fixed_batch else self.level_for(1)
        report = self._apply(level)
        # The first bring-up is the first measurement of what a cold start costs.
        self.policy.costs.cold_s = report.seconds
        waits = self.config.reconfigure and not self.config.fixed_batch and self.config.standby_wait_s > 0
        if waits and not self.swapper.wait_warm(self.config.standby_wait_s):
            logger.warning("%s: standby workers not all READY after %.0f s", self.target.name,
                           self.config.standby_wait_s)  # fmt: skip
        ready = self.swapper.ready_workers()  # status reads it before the first tick samples it
        with self.lock:
            self.ready = ready
        return report

    def adopt(self) -> None:
        """Serve on from the worker sets an earlier controller left in TorchServe (``PackratController`` found
        the server still running): the default version is the current plan, with no swap and no request
        failed; the standby set is then brought back to what the current level wants."""
        default = str(self.management.describe(self.target.name)[0]["modelVersion"])
        plan = self.swapper.adopt(self.management.describe(self.target.name, "all"), default)
        level = next((lv for lv in self.levels if lv.plan.instances == plan.instances), None)
        if level is None:  # a plan this controller would not choose (other settings): served until it moves
            level = level_of(self.profile, plan.batch, plan)
        self.calibrator.restart(self.store.service_totals(self.target.name, default))
        ready = self.swapper.ready_workers()
        with self.lock:
            self.level, self.plan, self.ready = level, plan, ready
            self.adopted = {"at": time.time(), "version": default, "standby": sorted(self.swapper.standby)}
        logger.info("%s: adopted version %s serving %s", self.target.name, default, plan.describe())
        if self.config.reconfigure and not self.config.fixed_batch and level in self.levels:
            prepared = self.prepared(level.batch)
            self._keep_warm(standby_items(self.levels, level.batch, self.config.standby_workers,
                                          list(prepared.values())))  # fmt: skip

    def _keep_warm(self, items: list[PlanItem]) -> None:
        try:
            self.swapper.keep_warm(items)
        except (TorchServeAPIError, OSError) as exc:
            logger.warning("%s: could not update the standby set: %s", self.target.name, exc)

    def _apply(self, level: Level, decision: Decision | None = None) -> SwapReport:
        """Serve ``level``, then keep the classes around it warm (when the controller reconfigures)."""
        standby = None
        if self.config.reconfigure and not self.config.fixed_batch:
            prepared = self.prepared(level.batch)
            standby = standby_items(self.levels, level.batch, self.config.standby_workers, list(prepared.values()))
        try:
            report = self.swapper.apply(level.plan, standby)
        except (SwapError, TorchServeAPIError) as exc:
            logger.error("%s: reconfiguration failed: %s", self.target.name, exc)
            with self.lock:
                self.last_error = str(exc)
                self.swap_errors += 1
            raise
        if report.kind != "none":
            # The new set's counters start where they are now; the drain is over,
            # so its first window is not slowed by the old set.
            self.calibrator.restart(self.store.service_totals(self.target.name, self.swapper.active))
        with self.lock:
            self.level, self.plan = level, level.plan
            if report.kind != "none":
                self.swaps.append(report)
            if decision is not None:
                self.decisions.append({"at": report.started, **decision.to_dict(), "kind": report.kind})
            self.last_error = None
        logger.info("%s: %s to %s in %.2f s%s", self.target.name, report.kind, level.plan.describe(),
                    report.seconds, " (warm)" if report.warm else "")  # fmt: skip
        if standby is not None:
            self._keep_warm(standby)
        return report

    def sample(self, now: float) -> None:
        versions = self.management.describe(self.target.name, "all")
        pending = sum(v["jobQueueStatus"]["pendingRequests"] for v in versions)
        served = {
            str(v["modelVersion"]): self.store.counters(self.target.name, str(v["modelVersion"])) for v in versions
        }
        busy = sum(c.in_service for c in served.values())
        ready = ready_counts(versions)
        counters = arrival_counters(self.metrics, self.target.name)
        with self.lock:
            self.last_pending, self.last_in_service, self.ready = pending, busy, ready
            self.monitor.record(now, counters, pending + busy)
        active = served.get(self.swapper.active or "")
        # self.level's profiled rounds; the policy's copy of each level carries the calibration.
        calibrating = self.config.calibrate and self.level is not None and active is not None and self.level.rounds_ms
        if calibrating and self.calibrator.update(active.totals, self.level.rounds_ms):
            with self.lock:
                self.policy.calibrate(self.calibrator.current)

    def prepared(self, current: int) -> dict[str, Level]:
        """The moves a detected rise or fall from the current rate would make (kept warm first)."""
        rate = self.monitor.rate(self.config.monitor.long_window_s)
        return prepared_moves(self.policy, current, rate, self.config.monitor.change_ratio)

    def warm_levels(self) -> set[int]:
        return {lv.batch for lv in self.levels if self.swapper.is_warm(lv.plan.instances[0], self.ready)}

    def step(self, now: float) -> SwapReport | None:
        self.sample(now)
        cfg = self.config
        if cfg.fixed_batch or not cfg.reconfigure or not self.deciding or self.level is None or not self.monitor.ready:
            return None
        with self.swap_lock:
            return self._decide(now)

    def _decide(self, now: float) -> SwapReport | None:
        observation = self.monitor.observation(now, self.level.plan.instances[0].batch, self.config.policy.noise_z)
        decision = self.policy.observe(observation, self.level.batch, self.warm_levels())
        if decision is None:
            return None
        try:
            report = self._apply(decision.target, decision)
        except (SwapError, TorchServeAPIError):
            # Keep serving the old plan; the policy proposes again only if the load still says so.
            self.policy.record_swap(time.monotonic(), self.policy.costs.cold_s, warm=False)
            return None
        self.policy.record_swap(time.monotonic(), report.serving_after_s, report.warm)
        return report

    def move_to(self, level: Level, rate: float, reason: str) -> SwapReport:
        """Serve ``level`` now, chosen outside the policy, and record it as a decision (``reason``, at ``rate``)
        so that what reads decisions (``/status``, a benchmark's reaction times) sees it as any other move."""
        with self.swap_lock:
            current = self.level
            decision = Decision(level, rate, reason, math.nan, math.nan, level.batch in self.warm_levels())
            report = self._apply(level, decision)
            if current is None or current.batch != level.batch:
                self.policy.record_swap(time.monotonic(), report.serving_after_s, report.warm)
            return report

    def wait_for_swap(self, timeout_s: float = 300.0) -> bool:
        """Block until no swap is under way (False: one still was after ``timeout_s``).

        A reader of ``level``, ``swaps`` and ``decisions`` right after a load
        may otherwise find a swap half done: its new version already
        TorchServe's default, ``level`` still the old one until ``_apply``
        returns.  ``make demo`` read that once and measured a move it was
        making as a stay.
        """
        if not self.swap_lock.acquire(timeout=timeout_s):
            return False
        self.swap_lock.release()
        return True

    def run(self, stop: threading.Event) -> None:
        period = self.config.monitor.period_s
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.step(started)
            except (TorchServeAPIError, OSError) as exc:
                with self.lock:
                    self.last_error = f"sampling failed: {exc}"
            stop.wait(max(0.0, period - (time.monotonic() - started)))

    def _prepared_status(self) -> dict[str, Any]:
        if self.level is None or not self.config.reconfigure or self.config.fixed_batch:
            return {}
        out = {}
        for change, level in self.prepared(self.level.batch).items():
            item = level.plan.instances[0]
            out[change] = {"batch": level.batch, "version": self.swapper.version_for(item),
                           "warm": self.swapper.is_warm(item, self.ready)}  # fmt: skip
        return out

    def status(self) -> dict[str, Any]:
        with self.lock:
            plan = self.plan
            last = self.swaps[-1] if self.swaps else None
            slots = None
            if plan is not None and self.swapper.active:
                vplan = self.store.read(self.target.name, self.swapper.active)
                slots = [s.to_dict() for s in vplan.slots] if vplan else None
            short, long_ = self.config.monitor.short_window_s, self.config.monitor.long_window_s
            costs = self.policy.costs
            return {
                "model": self.target.name,
                "active_version": self.swapper.active,
                "cores": list(self.topology.cores),
                # uniform: a worker per instance; mixed: one worker, an instance per pinned lane
                "mode": None if plan is None else ("uniform" if plan.uniform else "mixed"),
                "plan": plan.to_dict() if plan else None,
                "slots": slots,
                "estimated_batch": self.level.batch if self.level else None,
                # Profiled points left out of planning: their batch gain was within their passes' spread.
                "uncredited_points": [u.to_dict() for u in self.uncredited],
                "arrival_rate": round(self.monitor.rate(short), 3),
                "arrival_rate_long": round(self.monitor.rate(long_), 3),
                "pending_requests": self.last_pending,
                "in_service": self.last_in_service,
                "standby": sorted(self.swapper.standby),
                # The passive sets chosen for the next change: the level a rise (or fall) by the detector's
                # ratio from the current rate would move to, its version, and whether its workers are READY.
                "prepared": self._prepared_status(),
                "ready_workers": dict(self.ready),
                "swap_costs": {
                    "warm_s": round(costs.warm_s, 3),
                    "cold_s": round(costs.cold_s, 3),
                    "horizon_s": round(costs.horizon_s, 1),
                },  # fmt: skip
                "calibration": self.calibrator.current.to_dict(),
                "swaps": len(self.swaps),
                "swaps_by_kind": dict(Counter(report.kind for report in self.swaps)),
                "swap_errors": self.swap_errors,
                "last_swap": last.to_dict() if last else None,
                "last_decision": self.decisions[-1] if self.decisions else None,
                "last_error": self.last_error,
                # Where this controller took over an earlier one's TorchServe: when, and the version it found.
                "adopted": self.adopted,
            }
