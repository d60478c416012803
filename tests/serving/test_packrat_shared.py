"""Several models on one TorchServe: the controller divides the cores, each model's workers stay on its share.

Real archives, a real TorchServe, real worker processes read from /proc; the
profiles are hand-written (as in test_packrat_online.py) so the plans are known
on any machine.  On two cores with two models the division is one core each;
moving a model to other cores (the mechanism a re-division uses) is exercised
by swapping the two shares under load.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.controller import PackratController
from packrat_plugin.division import DivisionConfig
from packrat_plugin.load_monitor import MonitorConfig
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.serve_admin import format_status
from packrat_plugin.swapper import SwapperConfig
from serving_harness.loadgen import open_loop, run
from serving_harness.topology import CpuTopology
from tests.serving.test_packrat_online import affinity_of_tasks, two_core_profile

pytestmark = [
    pytest.mark.torchserve,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="sharing cores needs two usable cores"),
]

SPEC = get_spec("resnet50", "script")
MODELS = ("alpha", "beta")


@pytest.fixture
def shared(tmp_path, archive):
    config = ControllerConfig(
        monitor=MonitorConfig(period_s=0.1),
        swapper=SwapperConfig(max_batch_delay_ms=20),
        standby_workers=0,
        division=DivisionConfig(objective="worst"),
    )
    path = archive("resnet50", "script")
    targets = [ModelTarget(name, path, two_core_profile()) for name in MODELS]
    topology = CpuTopology({0: tuple(sorted(os.sched_getaffinity(0)))[:2]})
    controller = PackratController(tmp_path / "packrat", targets, config, topology=topology)
    controller.start()
    yield controller
    controller.stop()


def worker_pids(controller: PackratController, model: str) -> list[int]:
    version = controller.models[model].swapper.active
    described = controller.server.management().describe(model, version)[0]["workers"]
    return [w["pid"] for w in described if w["status"] == "READY"]


def cores_of(controller: PackratController, model: str) -> set[int]:
    """Every core any thread of the model's serving workers may run on."""
    return {core for pid in worker_pids(controller, model) for cores in affinity_of_tasks(pid) for core in cores}


def test_two_models_get_one_core_each_and_move_to_new_cores_under_load_without_failures(shared):
    status = shared.status()
    assert status["division"]["cores"] == {"alpha": 1, "beta": 1}
    shares = {m: status["models"][m]["cores"] for m in MODELS}
    assert len(shares["alpha"]) == 1 and set(shares["alpha"]).isdisjoint(shares["beta"])
    for model in MODELS:
        # One core: the plan for B=1 there is one 1-thread worker, pinned to it.
        assert status["models"][model]["plan"]["instances"] == [{"count": 1, "threads": 1, "batch": 1}]
        assert status["models"][model]["active_version"] == f"t1b1-c{shares[model][0]}"
        assert cores_of(shared, model) == set(shares[model])
    assert "cores divided (worst latency, ≥1 each): alpha: 1, beta: 1" in format_status(status)

    # Swap the two shares while both models take requests: each model's new
    # worker comes up on the other core, the old one drains, nothing fails.
    payload = client_payload(SPEC, seed=3)
    results = {}

    def load(model: str) -> None:
        url = f"{shared.server.inference_url}/predictions/{model}"
        results[model] = run(open_loop(url, lambda i: payload, [(3, 12.0)], seed=len(model)))

    threads = [threading.Thread(target=load, args=(m,)) for m in MODELS]
    for t in threads:
        t.start()
    time.sleep(2.0)
    topology = shared.topology
    for model in MODELS:
        other = shares["beta" if model == "alpha" else "alpha"]
        report = shared.models[model].reassign(CpuTopology({0: tuple(other)}), rate=3.0)
        assert report.kind == "swap"
    for t in threads:
        t.join()
    assert topology is shared.topology  # the server's cores did not change, only the shares
    for model in MODELS:
        assert results[model].failed == 0, [s.status for s in results[model].samples if s.status != 200][:5]
        assert len(results[model].samples) >= 20
        other = shares["beta" if model == "alpha" else "alpha"]
        assert shared.status()["models"][model]["cores"] == other
        assert cores_of(shared, model) == set(other)
        assert shared.server.inference().predict(model, payload).status == 200
