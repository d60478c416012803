"""A controller killed in the middle of a swap, at each point between the swap's five steps, and started again
with the same command: it takes over what the dead one left half done.  After the restart the model has one
default version and it is the plan ``/status`` reports, no other version keeps workers (``--standby-workers
0``), every worker's threads sit on one slot of its own version's plan (read from /proc), and no request fails
over the whole run.  The kill is the process sending itself SIGKILL at a named failpoint
(``packrat_plugin.failpoints``): nothing of the swap after that point runs, as after a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from handlers.pinning.slots import PlanStore
from model_store.samples import client_payload
from packrat_plugin import failpoints
from packrat_plugin.pin_check import pinning_faults
from serving_harness.clients import ManagementClient
from serving_harness.loadgen import LoadResult, closed_loop, run
from serving_harness.torchserve import Ports
from tests.serving.test_packrat_online import wait_for
from tests.serving.test_packrat_restart import SPEC, status, write_profile

pytestmark = [
    pytest.mark.torchserve,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="Packrat slots need two usable cores"),
]


@pytest.mark.parametrize("point", failpoints.SWAP_POINTS)
def test_a_controller_killed_between_a_swaps_steps_restarts_onto_one_pinned_plan_without_a_failed_request(
    point, archive, tmp_path
):
    status_port = Ports.free().inference
    workdir = tmp_path / "w"
    command = [
        sys.executable, "-m", "packrat_plugin.cli", "serve",
        "--models", f"resnet50={archive('resnet50', 'script')}",
        "--profile", f"resnet50={write_profile(tmp_path / 'resnet50.json')}", "--force-profile",
        "--free-ports", "--status-port", str(status_port), "--workdir", str(workdir),
        "--standby-workers", "0", "--tune", "monitor.period_s=0.1",
    ]  # fmt: skip

    def serve(failpoint: str | None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != failpoints.ENV}
        if failpoint is not None:
            env[failpoints.ENV] = failpoint
        log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115 (the process writes it)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    first, second = serve(point), None
    results: list[LoadResult] = []
    stop_load = threading.Event()
    loader = None
    try:
        started = wait_for(lambda: status(status_port), 240, "the first controller's /status")
        assert started["models"]["resnet50"]["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
        url = f"{started['inference_url']}/predictions/resnet50"
        payloads = [client_payload(SPEC, seed=i) for i in range(8)]

        def load() -> None:  # eight clients until told to stop: the rise that makes the controller swap
            while not stop_load.is_set():
                results.append(run(closed_loop(url, lambda n: payloads[n % 8], 8, 1.0)))  # short: stops soon

        loader = threading.Thread(target=load)
        loader.start()
        first.wait(timeout=120)
        assert first.returncode == -signal.SIGKILL, f"the controller was to die at {point!r}: {first.returncode}"
        second = serve(None)
        adopted = wait_for(lambda: status(status_port), 60, "the restarted controller's /status")
        assert adopted["inference_url"] == started["inference_url"]
        assert adopted["models"]["resnet50"]["adopted"] is not None
        management = ManagementClient(started["management_url"])
        store = PlanStore(workdir / "plans")

        def settled() -> dict | None:
            """The restarted controller's plan, once the default version is it and alone has workers."""
            now = status(status_port)
            versions = management.describe("resnet50", "all")
            default = management.describe("resnet50")[0]
            with_workers = [v["modelVersion"] for v in versions if v.get("workers")]
            plan = now["models"]["resnet50"]["plan"]["instances"] if now else None
            item = plan[0] if plan and len(plan) == 1 else None
            ready = sum(w.get("status") == "READY" for w in default.get("workers", []))
            if item is None or with_workers != [default["modelVersion"]] or ready != item["count"]:
                return None
            if default["modelVersion"] != f"t{item['threads']}b{item['batch']}":
                return None
            return now

        wait_for(settled, 90, "one default version, the reported plan, alone with workers")
        time.sleep(1.0)  # serving on from it
        stop_load.set()
        loader.join()
        loader = None
        final = wait_for(settled, 60, "the settled plan after the load")
        assert pinning_faults(management, store, "resnet50") == []
        assert sum(r.failed for r in results) == 0, [r.failed for r in results]
        assert sum(len(r.samples) for r in results) > 10
        print(f"{point}: adopted {adopted['models']['resnet50']['adopted']['version']}, "
              f"settled on {final['models']['resnet50']['plan']['instances']}")  # fmt: skip
    finally:
        stop_load.set()
        if loader is not None:
            loader.join()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
        # Whatever became of the controllers, the TorchServe the first one started does not outlive the test.
        subprocess.run([sys.executable, "-m", "packrat_plugin.cli", "stop", "--workdir", str(workdir)],
                       capture_output=True, timeout=120)  # fmt: skip
    assert second.returncode == 0
