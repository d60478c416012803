"""The Packrat controller: sample load, estimate B, plan, swap.

One ``ModelController`` per served model runs a short loop, in the shape of
an engine step::

    depth = sample()                      # queued (describe API) + in service (slot files)
    new_b = estimator.observe(depth, now) # EWMA → power of two → mode → timeout
    if new_b: swapper.apply(plan_for(new_b))

``plan_for`` asks the optimizer for a *uniform* plan (one TorchServe version
holds one batch size).  ``PackratController`` owns the TorchServe process,
the plan directory its workers read, one thread per model, and a small JSON
status endpoint that ``packrat status`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from packrat_plugin.archives import versioned_copy
from packrat_plugin.clients import ManagementClient, TorchServeAPIError
from packrat_plugin.estimator import BatchSizeEstimator, EstimatorConfig, floor_power_of_two
from packrat_plugin.optimizer import InfeasibleError, KnapsackOptimizer
from packrat_plugin.plan_types import Plan
from packrat_plugin.plans import PLAN_DIR_ENV, PlanStore
from packrat_plugin.profile import Profile
from packrat_plugin.swapper import VERSIONS, ActivePassiveSwapper, SwapError, SwapperConfig, SwapReport
from packrat_plugin.topology import CpuTopology
from packrat_plugin.torchserve import Ports, TorchServeProcess

logger = logging.getLogger(__name__)


@dataclass
class ModelTarget:
    """A model to serve under Packrat: its archive and its profile."""

    name: str
    archive: Path
    profile: Profile


@dataclass
class ControllerConfig:
    estimator: EstimatorConfig = field(default_factory=EstimatorConfig)
    swapper: SwapperConfig = field(default_factory=SwapperConfig)
    fixed_batch: int | None = None  # pin B (benchmarks)
    reconfigure: bool = True  # False: keep the first plan


class ModelController:
    def __init__(
        self,
        target: ModelTarget,
        management: ManagementClient,
        store: PlanStore,
        topology: CpuTopology,
        config: ControllerConfig,
    ) -> None:
        self.target = target
        self.management = management
        self.store = store
        self.topology = topology
        self.config = config
        self.threads = len(topology.cores)
        self.optimizer = KnapsackOptimizer(target.profile)
        self.max_batch = self._largest_feasible_batch()
        est_cfg = config.estimator
        if est_cfg.max_batch > self.max_batch:
            est_cfg = dataclasses.replace(est_cfg, max_batch=self.max_batch)
        initial = config.fixed_batch or 1
        self.estimator = BatchSizeEstimator(est_cfg, initial_batch=initial)
        archives = {v: f"{target.name}.packrat-{v}.mar" for v in VERSIONS}
        self.swapper = ActivePassiveSwapper(management, store, target.name, archives, topology, config.swapper)
        self.plan: Plan | None = None
        self.last_depth = 0.0
        self.last_pending = 0
        self.last_in_service = 0
        self.swaps: list[SwapReport] = []
        self.last_error: str | None = None
        self.lock = threading.Lock()

    def _largest_feasible_batch(self) -> int:
        best = 0
        b = 1
        while b <= self.threads * max(self.target.profile.batches):
            try:
                self.optimizer.plan(self.threads, b, uniform=True)
                best = b
            except InfeasibleError:
                pass
            b *= 2
        if best == 0:
            raise InfeasibleError(f"no uniform plan for {self.target.name} fits {self.threads} cores at any B")
        return best

    def plan_for(self, batch: int) -> Plan:
        """The uniform plan for ``batch``, or for the largest feasible power of two below it."""
        b = min(floor_power_of_two(batch), self.max_batch)
        while b >= 1:
            try:
                return self.optimizer.plan(self.threads, b, uniform=True)
            except InfeasibleError:
                b //= 2
        raise InfeasibleError(f"no uniform plan for {self.target.name} at B ≤ {batch}")

    def prepare_archives(self, model_store: Path) -> None:
        for version, name in self.swapper.archives.items():
            versioned_copy(self.target.archive, model_store / name, version)

    def start(self) -> SwapReport:
        return self._apply(self.plan_for(self.estimator.current))

    def _apply(self, plan: Plan) -> SwapReport:
        try:
            report = self.swapper.apply(plan)
        except (SwapError, TorchServeAPIError) as exc:
            logger.error("%s: reconfiguration failed: %s", self.target.name, exc)
            with self.lock:
                self.last_error = str(exc)
            raise
        with self.lock:
            self.plan = plan
            if report.kind != "none":
                self.swaps.append(report)
            self.last_error = None
        logger.info("%s: %s to %s in %.2f s", self.target.name, report.kind, plan.describe(), report.seconds)
        return report

    def sample(self) -> float:
        versions = self.management.describe(self.target.name, "all")
        pending = sum(v["jobQueueStatus"]["pendingRequests"] for v in versions)
        busy = sum(self.store.in_service(self.target.name, v["modelVersion"]) for v in versions)
        with self.lock:
            self.last_pending, self.last_in_service = pending, busy
            self.last_depth = float(pending + busy)
        return self.last_depth

    def step(self, now: float) -> SwapReport | None:
        new_batch = self.estimator.observe(self.sample(), now)
        if new_batch is None or self.config.fixed_batch or not self.config.reconfigure:
            return None
        plan = self.plan_for(new_batch)
        try:
            return self._apply(plan)
        except (SwapError, TorchServeAPIError):
            # Keep serving the old plan; forget the proposal so the estimator
            # proposes again only once the load says so for a full timeout.
            self.estimator.current = self.plan.batch if self.plan else 1
            return None

    def run(self, stop: threading.Event) -> None:
        period = self.config.estimator.sample_period_s
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
            return {
                "model": self.target.name,
                "active_version": self.swapper.active,
                "plan": plan.to_dict() if plan else None,
                "slots": slots,
                "estimated_batch": self.estimator.current,
                "ewma_depth": None if self.estimator.ewma is None else round(self.estimator.ewma, 3),
                "pending_requests": self.last_pending,
                "in_service": self.last_in_service,
                "swaps": len(self.swaps),
                "last_swap": last.to_dict() if last else None,
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
            management = self.server.management()
            for target in self.targets:
                mc = ModelController(target, management, self.store, self.topology, self.config)
                mc.prepare_archives(self.model_store)
                mc.start()
                self.models[target.name] = mc
            for mc in self.models.values():
                thread = threading.Thread(target=mc.run, args=(self._stop,), name=f"packrat-{mc.target.name}")
                thread.daemon = True
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

    def status(self) -> dict[str, Any]:
        return {
            "inference_url": self.server.inference_url,
            "management_url": self.server.management_url,
            "threads": len(self.topology.cores),
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
