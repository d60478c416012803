"""The Packrat supervisor: TorchServe, one control loop per model, the core division, the status endpoint.

``PackratController`` owns the TorchServe process and the plan directory its
workers read, starts one ``ModelController`` thread per model
(``model_control.py``), re-divides the cores among models when several share
them (``division.py``), and serves its state at ``/status``
(``status_server.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from handlers.pinning.slots import PLAN_DIR_ENV, PlanStore
from packrat_plugin.division import DivisionPolicy, ModelDemand, split_topology
from packrat_plugin.model_control import ControllerConfig, ModelController, ModelTarget
from packrat_plugin.status_server import StatusServer
from packrat_plugin.swapper import SwapError, parse_version_name
from serving_harness.clients import TorchServeAPIError
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import Ports, TorchServeProcess

logger = logging.getLogger(__name__)


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
        inference_host: str = "127.0.0.1",
        status_host: str = "127.0.0.1",
        log_config: Path | None = None,
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
            env={PLAN_DIR_ENV: str(self.store.root)}, inference_host=inference_host, log_config=log_config,
            **kwargs,
        )  # fmt: skip
        self.models: dict[str, ModelController] = {}
        self.division: DivisionPolicy | None = None
        self.division_moves: list[dict[str, Any]] = []
        self.division_error: str | None = None
        self.status_port = status_port
        self.status_host = status_host
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._status_server: StatusServer | None = None

    @property
    def status_url(self) -> str | None:
        return self._status_server.url if self._status_server else None

    def start(self) -> PackratController:
        self.model_store.mkdir(parents=True, exist_ok=True)
        self.store.root.mkdir(parents=True, exist_ok=True)
        served = self._attach()
        if served is None:
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
                if served is not None and mc.target.name in served:
                    mc.adopt()
                else:
                    mc.start()
            loops = [(mc.run, f"packrat-{name}") for name, mc in self.models.items()]
            if self.sharing and self.config.reconfigure and not self.config.fixed_batch:
                loops.append((self._division_loop, "packrat-division"))
            for loop, name in loops:
                thread = threading.Thread(target=loop, args=(self._stop,), name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
            if self.status_port is not None:
                self._status_server = StatusServer(self.status, self.status_port, self.status_host)
        except BaseException:
            self.stop()
            raise
        return self

    def _attach(self) -> set[str] | None:
        """The models of a TorchServe this workdir's earlier controller left serving, now this one's to
        manage; None where there is no such server (then one is started).

        What makes a restart converge rather than fail: the frontend runs in a session of its own, so a
        controller killed with ``kill -9`` (or restarted by a supervisor) leaves it serving the last plan,
        and a new ``start`` would find its ports taken and every version already registered (409).  A
        server that serves anything Packrat did not make here (another model, a version not named by
        ``version_name``) is left alone, untouched, with a one-line reason.
        """
        if not self.server.attach():
            return None
        try:
            management = self.server.management()
            models = {m["modelName"] for m in management.list_models()}
            foreign = sorted(models - {t.name for t in self.targets})
            if foreign:
                raise SwapError(f"it serves models this command does not name: {', '.join(foreign)}")
            if models and self.sharing:
                raise SwapError("taking over several models that divide the cores is not supported")
            for model in models:
                for version in management.describe(model, "all"):
                    name = str(version["modelVersion"])
                    parsed = parse_version_name(name)
                    if parsed is None or parsed[2] != "":
                        raise SwapError(f"{model} version {name} is not one Packrat names")
        except (SwapError, TorchServeAPIError) as exc:
            url = self.server.management_url
            self.server.detach()
            raise SwapError(
                f"a TorchServe is running at {url} from {self.server.workdir} that this controller "
                f"will not manage: {exc}; stop it (`packrat stop`) or use another --workdir"
            ) from None
        logger.info("attached to the running TorchServe at %s (models: %s)", self.server.management_url,
                    ", ".join(sorted(models)) or "none")  # fmt: skip
        return models

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
            "cores_source": self.topology.source,  # the affinity mask, limited by a cgroup quota where one applies
            "division": division,
            "models": {name: mc.status() for name, mc in self.models.items()},
        }

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        if self._status_server is not None:
            self._status_server.close()
            self._status_server = None
        self.server.stop()

    def __enter__(self) -> PackratController:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
