"""Packrat under a container's CPU quota: it plans and pins for the cores the quota pays for.

The cgroup is a fake tree (this machine has no quota, and setting one needs
root on the host); the cores, the TorchServe, the workers and their pinning
are real.  On this 2-core machine a ``cpu.max`` of one core's time must give a
plan for one core, workers confined to it (read from /proc), and every
request answered.
"""

from __future__ import annotations

import pytest

from model_store.samples import image_tensor_json
from packrat_plugin.controller import PackratController
from packrat_plugin.load_monitor import MonitorConfig
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.serve_admin import format_status
from packrat_plugin.swapper import SwapperConfig
from serving_harness.loadgen import closed_loop, run
from serving_harness.topology import CpuTopology
from tests.serving.test_packrat_online import SPEC, affinity_of_tasks, two_core_profile, workers
from tests.unit.test_topology import fake_cgroup_v2

pytestmark = pytest.mark.torchserve


def test_under_a_one_core_quota_packrat_plans_pins_and_serves_on_one_core(tmp_path, archive):
    cgroup_root, self_cgroup = fake_cgroup_v2(tmp_path, {"/pod": "100000 100000"})
    topology = CpuTopology.from_system(cgroup_root=cgroup_root, proc_cgroup=self_cgroup)
    (core,) = topology.cores
    assert "limited to 1 by cgroup v2" in topology.source
    config = ControllerConfig(
        monitor=MonitorConfig(period_s=0.1), swapper=SwapperConfig(max_batch_delay_ms=20), standby_workers=0
    )
    target = ModelTarget("resnet50", archive("resnet50", "script"), two_core_profile())
    with PackratController(tmp_path / "packrat", [target], config, topology=topology) as controller:
        status = controller.status()
        assert status["threads"] == 1 and "cgroup v2" in status["cores_source"]
        assert format_status(status).startswith("1 cores: ")
        model = status["models"]["resnet50"]
        assert [(s["cores"], s["threads"]) for s in model["slots"]] == [([core], 1)]
        pids = [w["pid"] for w in workers(controller, model["active_version"])]
        assert pids and all(affinity_of_tasks(pid) == {(core,)} for pid in pids)
        url = f"{controller.server.inference_url}/predictions/resnet50"
        payload = image_tensor_json(SPEC, seed=5)
        result = run(closed_loop(url, lambda i: payload, 3, 6.0))
        assert result.failed == 0 and len(result.samples) >= 5
        after = controller.status()["models"]["resnet50"]
        assert all(s["cores"] == [core] for s in after["slots"])  # whatever it swapped to stays on the quota's core
