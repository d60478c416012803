"""A controller killed with ``kill -9`` and started again with the same command takes over the TorchServe it
left serving: the plan it finds is its current one, no request fails across the kill and the restart, and a
later load change swaps as usual.  Real processes throughout: ``packrat serve`` as a user runs it, the
frontend and workers it started, HTTP load from a fixed number of clients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from model_store.catalog import get_spec
from model_store.samples import client_payload
from serving_harness.loadgen import LoadResult, closed_loop, run
from serving_harness.torchserve import Ports
from tests.serving.test_packrat_online import two_core_profile, wait_for

pytestmark = [
    pytest.mark.torchserve,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="Packrat slots need two usable cores"),
]

SPEC = get_spec("resnet50", "script")


def write_profile(path: Path) -> Path:
    profile = two_core_profile()
    points = [{"threads": p.threads, "batch": p.batch, "latency_ms": p.latency_ms} for p in profile.points]
    path.write_text(json.dumps({"model": "resnet50", "points": points}))
    return path


def status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as resp:
            return json.load(resp)
    except OSError:
        return None


def test_a_killed_controller_restarted_takes_over_its_torchserve_without_a_failed_request(archive, tmp_path):
    status_port = Ports.free().inference
    command = [
        sys.executable, "-m", "packrat_plugin.cli", "serve",
        "--models", f"resnet50={archive('resnet50', 'script')}",
        "--profile", f"resnet50={write_profile(tmp_path / 'resnet50.json')}", "--force-profile",
        "--free-ports", "--status-port", str(status_port), "--workdir", str(tmp_path / "w"),
        "--standby-workers", "0", "--tune", "monitor.period_s=0.1",
    ]  # fmt: skip

    def serve() -> subprocess.Popen:
        log = open(tmp_path / "serve.log", "ab")  # noqa: SIM115 (the process writes it)
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    first = serve()
    second = None
    across_the_restart, swapped = threading.Event(), threading.Event()  # the two loads' ends
    try:
        started = wait_for(lambda: status(status_port), 240, "the first controller's /status")
        url = f"{started['inference_url']}/predictions/resnet50"
        plan = started["models"]["resnet50"]["plan"]
        assert plan["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
        payloads = [client_payload(SPEC, seed=i) for i in range(8)]
        results: list[LoadResult] = []

        def load(clients: int, until: threading.Event) -> None:  # a minute at most, ended by ``until``
            results.append(run(closed_loop(url, lambda n: payloads[n % 8], clients, 60.0, until=until)))

        one_client = threading.Thread(target=load, args=(1, across_the_restart))
        one_client.start()
        time.sleep(4.0)
        os.kill(first.pid, signal.SIGKILL)  # the controller alone: TorchServe runs in a session of its own
        first.wait()
        assert status(status_port) is None
        time.sleep(3.0)
        second = serve()
        restarted = time.monotonic()
        adopted = wait_for(lambda: status(status_port), 60, "the restarted controller's /status")
        attached_s = time.monotonic() - restarted
        model = adopted["models"]["resnet50"]
        assert model["adopted"] is not None and model["adopted"]["version"] == "t2b1", model["adopted"]
        assert model["plan"]["instances"] == plan["instances"] and model["swaps"] == 0
        assert adopted["inference_url"] == started["inference_url"]  # the same server, not a new one
        print(f"the restarted controller answered /status {attached_s:.1f} s after its start")
        time.sleep(2.0)  # the one client served on under the restarted controller
        across_the_restart.set()
        one_client.join()

        # A later load change: the restarted controller moves as usual (a cold swap here).  Eight clients
        # until the split serves, then two seconds more of them on it.
        def moved() -> dict | None:
            now = (status(status_port) or {}).get("models", {}).get("resnet50")
            return now if now and now["swaps"] >= 1 and now["plan"]["instances"][0]["threads"] == 1 else None

        eight_clients = threading.Thread(target=load, args=(8, swapped))
        eight_clients.start()
        try:
            wait_for(moved, 50, "the restarted controller's swap to the split under eight clients")
            time.sleep(2.0)
        finally:
            swapped.set()
            eight_clients.join()
        time.sleep(1.0)
        assert moved() is not None, status(status_port)  # still on the split once the clients have stopped
        assert sum(r.failed for r in results) == 0, [r.failed for r in results]
        assert sum(len(r.samples) for r in results) > 20
        record = json.loads((tmp_path / "w" / "torchserve" / "torchserve.pid.json").read_text())
    finally:
        across_the_restart.set()  # a load still running after a failure ends now, not at its minute
        swapped.set()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    # SIGTERM to `packrat serve` stops TorchServe and its workers, the taken-over ones included.
    assert second.returncode == 0
    with pytest.raises(ProcessLookupError):
        os.kill(record["pid"], 0)
    assert not (tmp_path / "w" / "torchserve" / "torchserve.pid.json").exists()


def test_serve_refuses_in_one_line_a_torchserve_it_cannot_adopt_and_leaves_it_serving(archive, tmp_path):
    """A TorchServe running from the workdir that serves a version Packrat did not make (a user's own
    registration of the archive): ``packrat serve`` says why in one line, exits 2, and touches nothing."""
    import shutil

    from serving_harness.torchserve import TorchServeProcess

    workdir = tmp_path / "w"
    mar = archive("resnet50", "script")
    store = workdir / "model_store"
    store.mkdir(parents=True)
    shutil.copy(mar, store / mar.name)
    with TorchServeProcess(workdir / "torchserve", store) as server:
        management = server.management()
        management.register(mar.name, model_name="resnet50", initial_workers=1)
        before = management.describe("resnet50", "all")
        command = [
            sys.executable, "-m", "packrat_plugin.cli", "serve",
            "--models", f"resnet50={mar}",
            "--profile", f"resnet50={write_profile(tmp_path / 'resnet50.json')}", "--force-profile",
            "--free-ports", "--status-port", str(Ports.free().inference), "--workdir", str(workdir),
        ]  # fmt: skip
        refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        lines = [line for line in refused.stderr.splitlines() if line.startswith("packrat serve: error:")]
        assert len(lines) == 1 and "will not manage" in lines[0] and "packrat stop" in lines[0], refused.stderr
        print(lines[0])
        after = management.describe("resnet50", "all")
        assert [v["modelVersion"] for v in after] == [v["modelVersion"] for v in before]
        assert [w["pid"] for v in after for w in v["workers"]] == [w["pid"] for v in before for w in v["workers"]]
        answer = server.inference().predict("resnet50", client_payload(SPEC, seed=1))
        assert answer.status == 200
        # `packrat stop` (a process that never imports torch) stops the workdir's TorchServe, workers and all.
        # The frontend is this test's child: a thread reaps it as it exits, as init would for `packrat serve`'s.
        reaper = threading.Thread(target=server.proc.wait, daemon=True)
        reaper.start()
        stop = [sys.executable, "-m", "packrat_plugin.cli", "stop", "--workdir", str(workdir)]
        stopped = subprocess.run(stop, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        said = f"packrat stop: stopped the TorchServe at {server.inference_url} started from {workdir}, and its workers"
        assert stopped.stdout.strip() == said
        reaper.join(timeout=30)
        assert server.proc.returncode is not None and not server.pid_file.exists()
