"""The Packrat controller: measure load, decide, swap.

One ``ModelController`` per served model runs a short loop, in the shape of
an engine step (measure → policy → mechanism)::

    monitor.record(now, arrivals, depth)   # TorchServe's arrival counter + queue depth
    decision = policy.observe(monitor.observation(now), level, warm_levels)
    if decision: swapper.apply(decision.target.plan, standby_items(...)); swapper.keep_warm(...)

The policy (``policy.py``) chooses among *levels*: power-of-two batch sizes B
with their uniform plans from the optimizer (one TorchServe version holds one
batch size).  The swapper (``swapper.py``) is the mechanism: warm or cold
bring-up, set-default, drain, retire.  ``PackratController`` owns the
TorchServe process, the plan directory its workers read, one thread per
model, and a small JSON status endpoint that ``packrat status`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from handlers.pinning.slots import PLAN_DIR_ENV, PlanStore
from packrat_plugin.calibration import Calibration, CalibrationConfig, ServiceCalibrator
from packrat_plugin.division import OVERLOAD_S, DivisionConfig, DivisionPolicy, ModelDemand, split_topology
from packrat_plugin.levels import Level, level_of, levels_for
from packrat_plugin.load_monitor import LoadMonitor, MonitorConfig
from packrat_plugin.optimizer import InfeasibleError, KnapsackOptimizer, serving_costs
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.policy import Decision, PolicyConfig, ReconfigurationPolicy, standby_items
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
from serving_harness.torchserve import Ports, TorchServeProcess

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
        self.optimizer = KnapsackOptimizer(target.profile, prior)
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
        self.lock = threading.Lock()

    def _largest_feasible_batch(self, threads: int | None = None) -> int:
        threads = self.threads if threads is None else threads
        best = 0
        b = 1
        while b <= threads * max(self.target.profile.batches):
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
        return level_of(self.target.profile, batch, self.optimizer.plan(self.threads, batch))

    def start(self) -> SwapReport:
        level = self.fixed_level() if self.config.fixed_batch else self.level_for(1)
        report = self._apply(level)
        # The first bring-up is the first measurement of what a cold start costs.
        self.policy.costs.cold_s = report.seconds
        waits = self.config.reconfigure and not self.config.fixed_batch and self.config.standby_wait_s > 0
        if waits and not self.swapper.wait_warm(self.config.standby_wait_s):
            logger.warning("%s: standby workers not all READY after %.0f s", self.target.name,
                           self.config.standby_wait_s)  # fmt: skip
        return report

    def _keep_warm(self, items: list[PlanItem]) -> None:
        try:
            self.swapper.keep_warm(items)
        except (TorchServeAPIError, OSError) as exc:
            logger.warning("%s: could not update the standby set: %s", self.target.name, exc)

    def _apply(self, level: Level, decision: Decision | None = None) -> SwapReport:
        """Serve ``level``, then keep the classes around it warm (when the controller reconfigures)."""
        standby = None
        if self.config.reconfigure and not self.config.fixed_batch:
            standby = standby_items(self.levels, level.batch, self.config.standby_workers)
        try:
            report = self.swapper.apply(level.plan, standby)
        except (SwapError, TorchServeAPIError) as exc:
            logger.error("%s: reconfiguration failed: %s", self.target.name, exc)
            with self.lock:
                self.last_error = str(exc)
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

    def warm_levels(self) -> set[int]:
        return {lv.batch for lv in self.levels if self.swapper.is_warm(lv.plan.instances[0], self.ready)}

    def step(self, now: float) -> SwapReport | None:
        self.sample(now)
        if self.config.fixed_batch or not self.config.reconfigure or self.level is None or not self.monitor.ready:
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
                "arrival_rate": round(self.monitor.rate(short), 3),
                "arrival_rate_long": round(self.monitor.rate(long_), 3),
                "pending_requests": self.last_pending,
                "in_service": self.last_in_service,
                "standby": sorted(self.swapper.standby),
                "ready_workers": dict(self.ready),
                "swap_costs": {
                    "warm_s": round(costs.warm_s, 3),
                    "cold_s": round(costs.cold_s, 3),
                    "horizon_s": round(costs.horizon_s, 1),
                },  # fmt: skip
                "calibration": self.calibrator.current.to_dict(),
                "swaps": len(self.swaps),
                "last_swap": last.to_dict() if last else None,
                "last_decision": self.decisions[-1] if self.decisions else None,
                "last_error": self.last_error,
            }


class _StatusHandler(BaseHTTPRequestHandler):
    controller: PackratController

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") not in ("/status", ""):
            self.send_error(404, "try /status")
            return
        body = json.dumps(self.controller.status(), indent=2).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:  # keep the console for the controller's own log
        pass


class PackratController:
    """TorchServe + one ModelController per model + the status endpoint."""

    def __init__(
        self,
        workdir: Path,
        targets: list[ModelTarget],
        config: ControllerConfig | None = None,
        ports: Ports | None = None,
        status_port: int | None = 0,
        topology: CpuTopology | None = None,
        base_config: Path | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.targets = targets
        self.config = config or ControllerConfig()
        self.topology = topology or CpuTopology.from_system()
        self.model_store = self.workdir / "model_store"
        self.store = PlanStore(self.workdir / "plans")
        kwargs = {"base_config": base_config} if base_config else {}
        self.server = TorchServeProcess(
            self.workdir / "torchserve", self.model_store, ports=ports,
            env={PLAN_DIR_ENV: str(self.store.root)}, **kwargs,
        )  # fmt: skip
        self.models: dict[str, ModelController] = {}
        self.division: DivisionPolicy | None = None
        self.division_moves: list[dict[str, Any]] = []
        self.division_error: str | None = None
        self.status_port = status_port
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._http: ThreadingHTTPServer | None = None

    @property
    def status_url(self) -> str | None:
        return f"http://127.0.0.1:{self._http.server_address[1]}/status" if self._http else None

    def start(self) -> PackratController:
        self.model_store.mkdir(parents=True, exist_ok=True)
        self.store.root.mkdir(parents=True, exist_ok=True)
        self.server.start()
        try:
            management, metrics = self.server.management(), self.server.metrics()
            for target in self.targets:
                self.models[target.name] = ModelController(
                    target, management, metrics, self.store, self.model_store, self.topology, self.config
                )
            if self.sharing:
                self._divide_initially()
            for mc in self.models.values():
                mc.start()
            loops = [(mc.run, f"packrat-{name}") for name, mc in self.models.items()]
            if self.sharing and self.config.reconfigure and not self.config.fixed_batch:
                loops.append((self._division_loop, "packrat-division"))
            for loop, name in loops:
                thread = threading.Thread(target=loop, args=(self._stop,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
            if self.status_port is not None:
                handler = type("StatusHandler", (_StatusHandler,), {"controller": self})
                self._http = ThreadingHTTPServer(("127.0.0.1", self.status_port), handler)
                threading.Thread(target=self._http.serve_forever, daemon=True, name="packrat-status").start()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def sharing(self) -> bool:
        """Whether the models divide the cores (several models, ``share_cores``)."""
        return self.config.share_cores and len(self.targets) > 1

    def demands(self) -> list[ModelDemand]:
        """Each model's predicted latency on 1..T cores at its arrival rate now (long window)."""
        total = len(self.topology.cores)
        window = self.config.monitor.long_window_s
        out = []
        for name, mc in self.models.items():
            rate = mc.monitor.rate(window) if mc.monitor.ready else 0.0
            out.append(ModelDemand(name, rate, tuple(mc.predicted_latency_s(c, rate) for c in range(1, total + 1))))
        return out

    def _divide_initially(self) -> None:
        self.division = DivisionPolicy(len(self.topology.cores), self.config.division)
        first = self.division.initial(self.demands())
        parts = split_topology(first.cores, self.topology)
        for name, mc in self.models.items():
            mc.place(parts[name])
        self.division_moves.append({"at": time.time(), "reason": "start", **first.to_dict()})
        logger.info("cores divided: %s", {n: list(p.cores) for n, p in parts.items()})

    def _division_loop(self, stop: threading.Event) -> None:
        period = max(1.0, self.config.monitor.period_s)
        while not stop.wait(period):
            try:
                self.redivide(time.monotonic())
            except (TorchServeAPIError, SwapError, OSError) as exc:
                logger.error("re-division failed: %s", exc)
                self.division_error = str(exc)

    def redivide(self, now: float) -> bool:
        """Move to a better division if the division policy wants one now."""
        assert self.division is not None
        demands = self.demands()
        move = self.division.observe(now, demands)
        if move is None:
            return False
        rates = {d.name: d.rate for d in demands}
        before = dict(self.division.current or {})
        parts = split_topology(move.cores, self.topology)
        moved: dict[str, int] = dict(before)
        try:
            # Models that give cores up move first, so the others grow onto freed cores.
            for name in sorted(move.cores, key=lambda n: move.cores[n] - before.get(n, 0)):
                mc = self.models[name]
                if list(parts[name].cores) != mc.topology.cores:
                    mc.reassign(parts[name], rates[name])
                moved[name] = move.cores[name]
        finally:
            self.division.record_move(time.monotonic(), moved)
            self.division_moves.append({"at": time.time(), "reason": "load", "before": before, **move.to_dict()})
        self.division_error = None
        logger.info("cores re-divided: %s", {n: list(p.cores) for n, p in parts.items()})
        return True

    def status(self) -> dict[str, Any]:
        division = None
        if self.division is not None:
            division = {
                "objective": self.config.division.objective,
                "min_cores": self.config.division.min_cores,
                "cores": self.division.current,
                "moves": len(self.division_moves) - 1,
                "last_move": self.division_moves[-1],
                "last_error": self.division_error,
            }
        return {
            "inference_url": self.server.inference_url,
            "management_url": self.server.management_url,
            "threads": len(self.topology.cores),
            "division": division,
            "models": {name: mc.status() for name, mc in self.models.items()},
        }

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.server.stop()

    def __enter__(self) -> PackratController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
