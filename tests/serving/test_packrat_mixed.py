"""Packrat's mixed plans: the optimizer's exact plan served in one TorchServe worker, an instance per pinned lane.

The archive copy is checked as a file; the rest runs in a real TorchServe: the
worker's threads read from /proc, each instance's batches from the counters
the handler writes into its slot, and a swap from a uniform plan to the mixed
one (and back) under load with no failed request.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zipfile

import pytest
import yaml

from archiver.entry import entry_module_text
from handlers.mixed_plan.handler import PackratPlanHandler
from handlers.pinning.slots import read_counters
from model_store.catalog import get_spec
from model_store.samples import client_payload
from packrat_plugin.archives import MANIFEST, MODEL_CONFIG, PLAN_ENTRY, versioned_copy
from packrat_plugin.controller import PackratController
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.optimizer import KnapsackOptimizer
from packrat_plugin.plan_types import Plan, PlanItem
from packrat_plugin.swapper import SwapperConfig
from serving_harness.loadgen import closed_loop, open_loop, run
from serving_harness.topology import CpuTopology
from tests.serving.test_packrat_online import affinity_of_tasks, two_core_profile

SPEC = get_spec("resnet50", "script")


def test_a_grouped_copy_runs_the_plan_handler_in_async_mode(tmp_path, archive):
    source = archive("resnet50", "script")
    copy = versioned_copy(source, tmp_path / "m.mar", "mix-1x1t2b-1x1t1b", grouped=True)
    with zipfile.ZipFile(copy) as mar, zipfile.ZipFile(source) as original:
        manifest = json.loads(mar.read(MANIFEST))
        config = yaml.safe_load(mar.read(MODEL_CONFIG))
        assert manifest["model"]["modelVersion"] == "mix-1x1t2b-1x1t1b"
        assert manifest["model"]["handler"] == PLAN_ENTRY
        assert mar.read(PLAN_ENTRY).decode() == entry_module_text(PackratPlanHandler)
        assert config["asyncCommunication"] is True and config["batchSize"] == 1
        handler = yaml.safe_load(original.read(MODEL_CONFIG))["handler"]
        assert config["handler"] == {**handler, "plan": {"max_batch_delay_ms": 5}}  # spec kept
        assert set(original.namelist()) | {PLAN_ENTRY} == set(mar.namelist())
    plain = versioned_copy(source, tmp_path / "u.mar", "t1b2")
    with zipfile.ZipFile(plain) as mar:
        assert json.loads(mar.read(MANIFEST))["model"]["handler"] != PLAN_ENTRY
        assert "asyncCommunication" not in yaml.safe_load(mar.read(MODEL_CONFIG))


def test_mixed_plans_need_a_fixed_batch() -> None:
    with pytest.raises(ValueError, match="fixed_batch"):
        ControllerConfig(mixed_plans=True)


@pytest.mark.torchserve
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a mixed plan on one core is one instance")
def test_mixed_plan_instances_run_their_own_batches_on_their_own_cores_and_swap_without_failures(tmp_path, archive):
    profile = two_core_profile()
    # B=3 on two cores: ⟨1,2⟩ + ⟨1,1⟩ (190 ms); no uniform plan of profiled points sums to 3.
    mixed = KnapsackOptimizer(profile).plan(2, 3)
    assert not mixed.uniform and {(i.threads, i.batch) for i in mixed.instances} == {(1, 2), (1, 1)}
    config = ControllerConfig(
        swapper=SwapperConfig(max_batch_delay_ms=20), standby_workers=0, fixed_batch=3, mixed_plans=True
    )
    topology = CpuTopology({0: tuple(sorted(os.sched_getaffinity(0)))[:2]})
    target = ModelTarget("resnet50", archive("resnet50", "script"), profile)
    controller = PackratController(tmp_path / "packrat", [target], config, topology=topology)
    with controller:
        mc = controller.models["resnet50"]
        status = controller.status()["models"]["resnet50"]
        assert status["mode"] == "mixed" and status["active_version"] == "mix-1x1t2b-1x1t1b"
        slots = status["slots"]
        assert sorted((s["threads"], s["batch"]) for s in slots) == [(1, 1), (1, 2)]
        assert set(slots[0]["cores"]).isdisjoint(slots[1]["cores"])  # disjoint, Σ t ≤ T
        described = controller.server.management().describe("resnet50", mc.swapper.active)[0]["workers"]
        assert len(described) == 1  # one worker runs both instances
        threads = affinity_of_tasks(described[0]["pid"])
        lanes = {tuple(s["cores"]) for s in slots}
        assert lanes <= threads, threads  # each instance's lane (and its team) on its own core
        assert threads <= lanes | {tuple(sorted(topology.cores))}, threads

        url = f"{controller.server.inference_url}/predictions/resnet50"
        payload = client_payload(SPEC, seed=2)
        result = run(closed_loop(url, lambda i: payload, 3, 12.0))
        assert result.failed == 0 and len(result.samples) >= 20
        store = controller.store
        served = {}
        for index, slot in enumerate(slots):
            record = read_counters(store.counters_path("resnet50", mc.swapper.active, index))
            assert record is not None and record.batches > 0, (index, record)
            served[slot["batch"]] = (record.requests, record.batches)
        # Each instance took at most its own batch size: the b=1 instance one request a batch,
        # the b=2 one mostly pairs (three in flight keep it full).
        assert served[1][0] == served[1][1]
        assert 1.3 < served[2][0] / served[2][1] <= 2.0, served
        assert sum(r for r, _ in served.values()) == len(result.samples)

        # Swap to the uniform 2×⟨1,1⟩ and back to the mixed plan while requests arrive (5 a second, from
        # 3 s before the first swap to 3 s after the second).
        uniform = Plan(2, 2, 100.0, (PlanItem(2, 1, 1),))
        outcome = {}
        swapped_back = threading.Event()
        load = threading.Thread(
            target=lambda: outcome.setdefault(
                "r", run(open_loop(url, lambda i: payload, [(120, 5.0)], seed=9, until=swapped_back))
            )
        )
        load.start()
        try:
            time.sleep(3.0)
            assert mc.swapper.apply(uniform).kind == "swap"
            time.sleep(3.0)
            assert mc.swapper.apply(mixed).kind == "swap"
            time.sleep(3.0)
        finally:
            swapped_back.set()
            load.join()
        result = outcome["r"]
        assert result.failed == 0, [s.status for s in result.samples if s.status != 200][:5]
        assert len(result.samples) >= 2.5 * result.wall_s  # half the rate at least: the load ran throughout
        assert mc.swapper.active == "mix-1x1t2b-1x1t1b"
