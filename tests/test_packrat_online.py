"""Packrat online, against a real TorchServe: pinned slots, respawn, live swap.

The profiles here are written by hand so that the optimizer's choice is known
in advance on any machine (a committed profile carries another machine's
hardware fingerprint); everything else is real: archives, TorchServe, worker
processes, core pinning, HTTP load.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from model_store.catalog import get_spec
from model_store.samples import image_tensor_json
from packrat_plugin.controller import ControllerConfig, ModelTarget, PackratController
from packrat_plugin.estimator import EstimatorConfig
from packrat_plugin.loadgen import closed_loop, run
from packrat_plugin.profile import Profile, ProfilePoint
from packrat_plugin.swapper import SwapperConfig
from packrat_plugin.topology import CpuTopology

pytestmark = [
    pytest.mark.torchserve,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="Packrat slots need two usable cores"),
]

SPEC = get_spec("resnet50", "script")


def two_core_profile() -> Profile:
    """B=1 → one 2-thread instance; B≥2 → one 1-thread instance per core (b = B/2)."""
    latency = {(1, 1): 100.0, (2, 1): 60.0, (1, 2): 180.0, (2, 2): 170.0, (1, 4): 350.0, (2, 4): 400.0}
    return Profile("resnet50", tuple(ProfilePoint(t, b, lat) for (t, b), lat in latency.items()))


def affinity_of_tasks(pid: int) -> set[tuple[int, ...]]:
    """Cpus_allowed_list of every thread of a process, as core tuples."""
    seen = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:
            continue
        line = next(x for x in text.splitlines() if x.startswith("Cpus_allowed_list"))
        seen.add(tuple(parse_cpu_list(line.split(":", 1)[1].strip())))
    return seen


def parse_cpu_list(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def workers(controller: PackratController, version: str) -> list[dict]:
    return controller.server.management().describe("resnet50", version)[0]["workers"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture
def controller_factory(tmp_path, archive):
    started: list[PackratController] = []

    def make(**config_kwargs) -> PackratController:
        config = ControllerConfig(
            estimator=EstimatorConfig(sample_period_s=0.02, timeout_s=1.0),
            swapper=SwapperConfig(max_batch_delay_ms=20),
            **config_kwargs,
        )
        target = ModelTarget("resnet50", archive("resnet50", "script"), two_core_profile())
        topology = CpuTopology({0: tuple(sorted(os.sched_getaffinity(0)))[:2]})
        controller = PackratController(tmp_path / f"packrat{len(started)}", [target], config, topology=topology)
        started.append(controller)
        return controller.start()

    yield make
    for controller in started:
        controller.stop()


def test_workers_are_confined_to_disjoint_slots_and_respawn_into_a_freed_slot(controller_factory):
    controller = controller_factory(fixed_batch=4)
    status = controller.status()["models"]["resnet50"]
    assert status["plan"]["instances"] == [{"count": 2, "threads": 1, "batch": 2}]
    slots = {tuple(s["cores"]) for s in status["slots"]}
    assert len(slots) == 2 and len(set().union(*slots)) == 2  # disjoint, one core each

    pids = [w["pid"] for w in workers(controller, "a")]
    assert len(pids) == 2
    held = [affinity_of_tasks(pid) for pid in pids]
    for tasks in held:
        assert len(tasks) == 1, f"threads of one worker on different cores: {tasks}"
    assert {next(iter(t)) for t in held} == slots  # one worker per slot

    client = controller.server.inference()
    row = image_tensor_json(SPEC, seed=4)
    assert client.predict("resnet50", row).status == 200

    # Kill one worker: TorchServe respawns it, and the new process takes the
    # slot the dead one's lock released.
    victim, survivor = pids
    freed = next(iter(affinity_of_tasks(victim)))
    os.kill(victim, signal.SIGKILL)
    new_pids = wait_for(
        lambda: [
            w["pid"] for w in workers(controller, "a")
            if w["status"] == "READY" and w["pid"] not in (victim, survivor)
        ],
        timeout_s=180,
        what="a respawned worker",
    )  # fmt: skip
    assert affinity_of_tasks(new_pids[0]) == {freed}
    assert affinity_of_tasks(survivor) != {freed}
    assert client.predict("resnet50", row).status == 200


def test_step_load_swaps_plans_with_zero_failed_requests(controller_factory):
    controller = controller_factory()
    first = controller.status()["models"]["resnet50"]
    assert first["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
    assert first["active_version"] == "a"
    url = f"{controller.server.inference_url}/predictions/resnet50"
    payload = image_tensor_json(SPEC, seed=5)

    # Low load: one client, then a step to eight clients in flight.  The high
    # load runs in the background so that the swap is observed while it runs
    # (once the load stops, the controller rightly swaps back to B=1).
    low = run(closed_loop(url, lambda i: payload, concurrency=1, duration_s=3))
    loads: dict = {}
    high_load = threading.Thread(
        target=lambda: loads.update(high=run(closed_loop(url, lambda i: payload, concurrency=8, duration_s=25)))
    )
    high_load.start()
    try:
        status = wait_for(
            lambda: (s := controller.status()["models"]["resnet50"])["plan"]["instances"][0]["threads"] == 1 and s,
            timeout_s=60,
            what="the controller to swap to one-thread instances",
        )
        old_workers = workers(controller, "a")
        new_workers = workers(controller, "b")
    finally:
        high_load.join()
    high = loads["high"]
    assert low.failed == 0 and high.failed == 0, (low.failed, high.failed)
    assert len(low.samples) > 0 and len(high.samples) > 0
    assert status["active_version"] == "b"
    assert status["last_swap"]["kind"] == "swap"
    assert status["last_swap"]["before"] == [{"count": 1, "threads": 2, "batch": 1}]
    assert status["estimated_batch"] >= 4
    assert status["plan"]["instances"][0]["count"] == 2
    # The old version ends at zero workers; the new one serves.
    assert old_workers == []
    assert len([w for w in new_workers if w["status"] == "READY"]) == 2
    assert controller.server.inference().predict("resnet50", payload).status == 200


def corrupt_artefact(archive: Path) -> None:
    """Rewrite an archive so that its workers fail in initialize()."""
    import zipfile

    broken = archive.with_name(archive.name + ".broken")
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(broken, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = b"not a TorchScript file" if info.filename == "model.pt" else src.read(info)
            dst.writestr(info, data)
    broken.replace(archive)


def test_failed_swap_rolls_back_and_the_old_version_keeps_serving(controller_factory):
    import subprocess
    import sys

    from packrat_plugin.swapper import SwapError

    controller = controller_factory(fixed_batch=1)
    controller.config.swapper.ready_timeout_s = 60
    model = controller.models["resnet50"]
    assert model.swapper.active == "a"
    corrupt_artefact(controller.model_store / model.swapper.archives["b"])
    with pytest.raises(SwapError, match="version b of resnet50 failed to start"):
        model._apply(model.plan_for(4))  # needs version b: (threads, batch) changes
    status = controller.status()["models"]["resnet50"]
    assert status["active_version"] == "a"
    assert status["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
    assert "failed to start" in status["last_error"]
    versions = {v["modelVersion"] for v in controller.server.management().describe("resnet50", "all")}
    assert versions == {"a"}  # the half-built version was unregistered
    assert [w["status"] for w in workers(controller, "a")] == ["READY"]
    assert controller.server.inference().predict("resnet50", image_tensor_json(SPEC)).status == 200

    # `packrat status` reads the controller's JSON endpoint and prints the state.
    out = subprocess.run(
        [sys.executable, "-m", "packrat_plugin.cli", "status", "--url", controller.status_url],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "resnet50" in out.stdout and "1×⟨t=2,b=1⟩" in out.stdout and "slots→cores" in out.stdout
    assert "last error: version b of resnet50 failed to start" in out.stdout
