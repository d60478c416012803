"""Packrat online, against a real TorchServe: pinned slots, respawn, live swap.

The profiles here are written by hand so that the optimizer's choice is known
in advance on any machine (a committed profile carries another machine's
hardware fingerprint); everything else is real: archives, TorchServe, worker
processes, core pinning, HTTP load.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import threading
import time
from pathlib import Path

import pytest
import requests

from model_store.catalog import get_spec
from model_store.samples import client_payload, image_tensor_json
from packrat_plugin.calibration import Calibration
from packrat_plugin.compare import ComparisonConfig, compare_fat_and_plan, format_rows
from packrat_plugin.controller import PackratController
from packrat_plugin.load_monitor import MonitorConfig
from packrat_plugin.measure import InstanceJob, InstanceProcess
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.pin_check import affinity_of_tasks
from packrat_plugin.policy import PolicyConfig
from packrat_plugin.profile import Profile, ProfilePoint
from packrat_plugin.profiler import prepare_model
from packrat_plugin.swapper import SwapperConfig
from serving_harness.loadgen import closed_loop, open_loop, run
from serving_harness.topology import CpuTopology

pytestmark = [
    pytest.mark.torchserve,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="Packrat slots need two usable cores"),
]

SPEC = get_spec("resnet50", "script")


def resnet50_profile(latency_ms: dict[tuple[int, int], float]) -> Profile:
    """A ResNet-50 profile of ``{(threads, batch): ms}``."""
    return Profile("resnet50", tuple(ProfilePoint(t, b, ms) for (t, b), ms in latency_ms.items()))


def two_core_profile() -> Profile:
    """B=1 → one 2-thread instance; B≥2 → one 1-thread instance per core (b = B/2).

    For the tests that need the optimizer's choice known in advance and time
    no load (pinning, respawn, roll-back, the wire protocols, the fat-vs-plan
    comparison).  The tests that play a load against the controller take
    ``measured_profile`` instead, so that their rates sit where they mean to
    on a machine of any speed.  Batching gains little, as for ResNet-50 on a
    CPU (the AMD VM: 101, 203, 425 ms at batch 1, 2, 4): the controller's
    calibration scales every batch size alike, so a profile that promised
    much from batching would keep promising it after serving had shown
    otherwise, and move again.
    """
    return resnet50_profile({(1, 1): 100.0, (2, 1): 90.0, (1, 2): 190.0, (2, 2): 170.0, (1, 4): 380.0, (2, 4): 400.0})


def this_machines_profile(fat_ms: float, one_ms: float) -> Profile:
    """A profile of the two batch-1 points measured on this machine, with batching's small gain written in.

    The optimizer's choices are those of ``two_core_profile`` while one
    1-thread instance takes under twice the time of one 2-thread one: B=1 →
    the fat instance, B≥2 → one 1-thread instance per core.  Batches gain
    5 % on one thread and nothing on two, so B=4 (⟨1,2⟩ per core) carries
    the most and B=8 (⟨1,4⟩) a little less: a load past every capacity
    moves once, to ⟨1,2⟩, not on through the batch sizes.
    """
    return resnet50_profile({(1, 1): one_ms, (2, 1): fat_ms, (1, 2): 1.9 * one_ms, (2, 2): 2.0 * fat_ms,
                             (1, 4): 3.9 * one_ms, (2, 4): 4.0 * fat_ms})  # fmt: skip


@pytest.fixture(scope="module")
def measured_profile(archive, tmp_path_factory) -> Profile:
    """ResNet-50 timed on this machine: one 2-thread instance on both cores against one 1-thread instance on one.

    The load tests below set their rates from it.  Fixed rates on the hand-
    written profile failed on a VM that ran the model twice as slowly as the
    one they were tuned on (CI, 2026-11): the calibrated model then put 3
    requests/s past the crossover and 10/s past the split's capacity, and
    the controller, rightly, moved twice.  Real pinned processes of the
    served artefact (``packrat_plugin.measure``, as the profiler uses),
    timed in alternating 1-second windows, three each; each point is the
    median of its windows' medians (~20 s with the processes' start).
    """
    prepared = prepare_model(str(archive("resnet50", "script")), "script", tmp_path_factory.mktemp("speed"))
    cores = tuple(sorted(os.sched_getaffinity(0)))[:2]
    spec = prepared.spec.to_dict()
    windows: dict[int, list[float]] = {1: [], 2: []}
    with InstanceProcess(InstanceJob(spec, str(prepared.artefact), 2, 1, cores)) as fat:
        fat.wait_ready()
        with InstanceProcess(InstanceJob(spec, str(prepared.artefact), 1, 1, cores[:1])) as one:
            one.wait_ready()
            for threads in (2, 1, 1, 2, 2, 1):  # each point first, middle and last once
                instance = fat if threads == 2 else one
                instance.request(time.time(), duration_s=1.0, min_iters=3)
                windows[threads].append(statistics.median(instance.result(timeout_s=120).latencies_ms))
    fat_ms, one_ms = statistics.median(windows[2]), statistics.median(windows[1])
    # Alone, two threads ran 1.4-2.05× one thread's speed on the 2-core VM
    # from one run to the next; under serving the 2-thread worker slows more
    # than the 1-thread ones (the frontend and the clients share its cores),
    # so the split pays there even when it does not alone.  Capped at 1.8×,
    # the profile keeps the split as the plan for B ≥ 2 on every such run.
    one_ms = min(one_ms, 1.8 * fat_ms)
    return this_machines_profile(fat_ms, one_ms)


def fat_capacity_per_s(profile: Profile, calibration: dict[str, float] | None = None) -> float:
    """Requests per second the fat 2-thread worker carries at batch 1: on the profile, or as calibrated by serving."""
    fat_ms = profile.latency(2, 1)
    if calibration is None:
        return 1000.0 / fat_ms
    return 1000.0 / Calibration(**calibration).round_ms(1, fat_ms)


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

    def make(profile: Profile | None = None, **config_kwargs) -> PackratController:
        config_kwargs.setdefault("standby_workers", 0)
        config = ControllerConfig(
            monitor=MonitorConfig(period_s=0.1), swapper=SwapperConfig(max_batch_delay_ms=20), **config_kwargs
        )
        target = ModelTarget("resnet50", archive("resnet50", "script"), profile or two_core_profile())
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

    pids = [w["pid"] for w in workers(controller, "t1b2")]
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
            w["pid"] for w in workers(controller, "t1b2")
            if w["status"] == "READY" and w["pid"] not in (victim, survivor)
        ],
        timeout_s=180,
        what="a respawned worker",
    )  # fmt: skip
    assert affinity_of_tasks(new_pids[0]) == {freed}
    assert affinity_of_tasks(survivor) != {freed}
    assert client.predict("resnet50", row).status == 200


def swaps_after(controller: PackratController, wall: float) -> list:
    return [r for r in controller.models["resnet50"].swaps if r.kind != "initial" and r.started >= wall]


def test_one_step_of_open_loop_load_swaps_warm_within_seconds_with_zero_failures(controller_factory, measured_profile):
    # The step's arrivals end after 10 s, and the fall that follows is a move of its own: with the default 3-s
    # confirmation it landed inside this test's window once (a full suite on a slow run drained the step's
    # backlog for ~8 s, then "load fell" swapped back).  A fall here waits a minute; the rise is what is read.
    controller = controller_factory(measured_profile, standby_workers=8, policy=PolicyConfig(down_confirm_s=60.0))
    first = controller.status()["models"]["resnet50"]
    assert first["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
    assert first["active_version"] == "t2b1"
    assert set(first["standby"]) == {"t1b1", "t1b2", "t1b4"}  # every other class, warm
    rise = first["prepared"]["rise"]  # the set a rise would move to: chosen first for the standby set, and READY
    assert rise["version"] in first["standby"] and rise["warm"] and rise["batch"] > 1, first["prepared"]
    ready = controller.models["resnet50"].swapper.ready_workers()
    assert all(ready[v] == 2 for v in first["standby"]), ready
    fat_pids = [w["pid"] for w in workers(controller, "t2b1")]
    url = f"{controller.server.inference_url}/predictions/resnet50"
    payload = client_payload(SPEC, seed=5)  # a JPEG, as clients send; JSON tensors cost more to decode
    # A scraper of the status port's /metrics during the load sees the plan change.
    metrics_url = controller.status_url.replace("/status", "/metrics")
    scraped: list[str] = []
    scraping = threading.Event()

    def scrape() -> None:
        while not scraping.is_set():
            scraped.append(requests.get(metrics_url, timeout=5).text)
            scraping.wait(0.5)

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    # The low phase: a quarter of the fat worker's capacity on this machine's
    # profile (serving runs slower still, up to 2×: under half of it), where
    # the fat worker is the better plan by far, with enough requests (≥ 20)
    # for the controller to calibrate the profile against real serving.
    low = run(open_loop(url, lambda i: payload, [(14, 0.25 * fat_capacity_per_s(measured_profile))], seed=7))
    calibration = controller.status()["models"]["resnet50"]["calibration"]
    assert calibration["updates"] >= 1, calibration
    # The step: 1.4× what the fat worker carries as calibrated, past it for
    # certain, and near or past what the split carries (on 2 cores, 1.1-1.4×
    # the fat worker): the best plan is the split's largest batch, one move.
    high_rate = 1.4 * fat_capacity_per_s(measured_profile, calibration)
    step_wall = time.time()
    high = run(open_loop(url, lambda i: payload, [(10, high_rate)], seed=8))
    time.sleep(3.0)  # a swap still in progress would finish, and count, before the state is read
    scraping.set()
    scraper.join(timeout=10)
    status = controller.status()["models"]["resnet50"]
    swaps = swaps_after(controller, 0)
    failed = [s.status for r in (low, high) for s in r.samples if s.status != 200]
    assert failed == [], failed[:5]
    # One step, one swap.  (A second one used to follow when the old fat
    # worker drained its backlog with two OpenMP threads on the new workers'
    # cores; now the new workers hold their batches until the drain ends.)
    decisions = controller.models["resnet50"].decisions
    moves = [(s.before, s.after, s.started - step_wall) for s in swaps]
    assert len(swaps) == 1, (moves, decisions, status["calibration"], high_rate)
    swap = swaps[0]
    assert swap.kind == "swap" and swap.warm and swap.before == [{"count": 1, "threads": 2, "batch": 1}]
    assert swap.after[0]["threads"] == 1 and swap.after[0]["count"] == 2
    assert 0 < swap.started - step_wall < 10  # acted on the step, not before it
    assert swap.serving_after_s < 3.0  # warm: no worker had to start
    assert status["active_version"] == f"t1b{swaps[-1].after[0]['batch']}", (status, swap.to_dict())
    # The step itself is an open-loop rise in arrivals: the rate (or backlog) rule acts on it.
    assert controller.models["resnet50"].decisions[0]["reason"] in ("load rose", "backlog growing")
    # The old set went back to standby, still warm (the same process, not a
    # restarted one); the new one serves.
    assert "t2b1" in status["standby"]
    assert [w["pid"] for w in workers(controller, "t2b1") if w["status"] == "READY"] == fat_pids
    # The workers' counters calibrated the profile: JPEG decoding costs time outside the model.
    assert status["calibration"]["updates"] >= 1 and status["calibration"]["overhead_ms"] > 0, status["calibration"]
    assert controller.server.inference().predict("resnet50", payload).status == 200
    # What the scrapes saw: the fat plan, then the new one, with the swap counted and its duration.
    versions = [re.findall(r'packrat_plan_info\{model="resnet50",version="(\w+)"', text) for text in scraped]
    seen = [v[0] for v in versions if v]
    assert seen[0] == "t2b1" and seen[-1] == status["active_version"], seen
    last = scraped[-1]
    assert 'packrat_swaps_total{model="resnet50",kind="swap"} 1.0' in last
    serving_after = re.search(r'packrat_last_swap_serving_after_seconds\{model="resnet50"\} (\S+)', last)
    assert serving_after and float(serving_after.group(1)) == pytest.approx(swap.serving_after_s, abs=1e-6)


def test_a_closed_loop_step_ends_on_the_plan_that_served_its_requests_in_flight_better(
    controller_factory, measured_profile, archive, tmp_path
):
    """The README's demo as a test: 1 then 8 clients, each waiting for its answer.  Whatever the controller
    does, the plan it started on and the one it ended on (or, had it stayed, the one its model calls best at 8
    in flight) are then measured side by side at 8 in flight with an A/A twin, and it must have ended on the
    better one, or the two must be level within the twin's band: a check that holds on any CPU."""
    from packrat_plugin.demo import measure_the_move

    controller = controller_factory(measured_profile)
    model = controller.models["resnet50"]
    start = model.level
    payloads = [client_payload(SPEC, seed=i) for i in range(8)]
    url = f"{controller.server.inference_url}/predictions/resnet50"
    results = [run(closed_loop(url, lambda n: payloads[n % 8], k, seconds)) for k, seconds in ((1, 4.0), (8, 16.0))]
    assert model.wait_for_swap()  # a swap under way finishes before the state is read
    assert sum(r.failed for r in results) == 0
    end = model.level
    moved = end.plan.instances != start.plan.instances
    swaps = [s for s in model.swaps if s.kind != "initial"]
    assert len(swaps) == (1 if moved else 0), [(s.kind, s.before, s.after) for s in swaps]
    other = end if moved else model.policy.best_closed_loop(8)
    controller.stop()  # the measurement has the cores to itself
    # Shorter windows than the demo's (3 s after 1 s of warm-up, against 5 after 2): a noisier pair only widens
    # the A/A band that "level" is read against; `make demo` measures with the full windows.
    verdict = measure_the_move(archive("resnet50", "script"), start.plan, other.plan, lambda n: payloads[n % 8], 8,
                               moved, tmp_path / "measure", seconds=3.0, warmup_seconds=1.0)  # fmt: skip
    assert verdict.ok, verdict.describe(8)


def test_batch_sizes_within_their_passes_spread_are_left_out_of_planning_warming_and_status(controller_factory):
    """A profile of three passes per point where batching's gain is smaller than the passes' spread.

    The controller plans only on batch sizes that earn it (``batch_credit.py``): here none does, so its
    levels are the fat worker and one 1-thread worker per core, the only set it keeps warm is the latter,
    and ``/status`` lists every left-out point with the passes that left it out.
    """
    passes = {(1, 1): [95.0, 100.0, 130.0], (1, 2): [185.0, 190.0, 250.0], (1, 4): [370.0, 380.0, 480.0],
              (2, 1): [88.0, 90.0, 110.0], (2, 2): [168.0, 170.0, 200.0], (2, 4): [340.0, 345.0, 420.0]}  # fmt: skip
    profile = Profile("resnet50", tuple(ProfilePoint(t, b, statistics.median(ms), {"pass_ms": ms})
                                        for (t, b), ms in passes.items()))  # fmt: skip
    controller = controller_factory(profile, standby_workers=8)
    status = controller.status()["models"]["resnet50"]
    left = {(u["threads"], u["batch"]): u for u in status["uncredited_points"]}
    assert set(left) == {(1, 2), (1, 4), (2, 2), (2, 4)}, status["uncredited_points"]
    assert left[(1, 2)]["against_batch"] == 1 and left[(1, 2)]["per_request_ms"] == [92.5, 125.0]
    assert status["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
    assert status["standby"] == ["t1b1"]  # no worker set is started for a batch size that earned nothing
    assert status["prepared"]["rise"]["version"] == "t1b1", status["prepared"]
    payload = client_payload(SPEC, seed=4)
    assert controller.server.inference().predict("resnet50", payload).status == 200

    # A move made outside the policy (a benchmark's scheduled move, an operator's): with the policy paused,
    # move_to serves the level asked for on the warm standby set and is recorded as any decision.
    model = controller.models["resnet50"]
    model.deciding = False
    split = model.policy.best(4 * fat_capacity_per_s(profile))
    assert split.plan.instances[0].threads == 1
    report = model.move_to(split, 20.0, "load rose (scheduled)")
    assert report.warm and report.kind != "none" and model.swapper.active == "t1b1"
    assert model.decisions[-1]["reason"] == "load rose (scheduled)" and model.decisions[-1]["target_batch"] == 2
    assert controller.status()["models"]["resnet50"]["plan"]["instances"] == [{"count": 2, "threads": 1, "batch": 1}]
    assert controller.server.inference().predict("resnet50", payload).status == 200


def test_constant_poisson_load_gives_no_swap_after_the_start(controller_factory, measured_profile):
    """A fifth of the fat worker's capacity on this machine's profile, where it is the best plan by far.

    20 s after the first 15: a controller that moves on noise (a mis-set threshold, a calibration that
    swings) does so within seconds at this rate; the false-alarm rate itself, about one an hour, is
    measured by ``bench.detector_delays`` and ``bench.packrat_constant``, not here."""
    # No standby workers: whether a swap would be warm does not matter to a test that wants none, and seven
    # workers starting cost it ~20 s.
    controller = controller_factory(measured_profile, standby_workers=0)
    url = f"{controller.server.inference_url}/predictions/resnet50"
    payload = client_payload(SPEC, seed=6)
    settle_until = time.time() + 15  # the first seconds may move once, before serving has calibrated the profile
    rate = 0.2 * fat_capacity_per_s(measured_profile)
    result = run(open_loop(url, lambda i: payload, [(35, rate)], seed=11))
    assert result.failed == 0
    late = swaps_after(controller, settle_until)
    status = controller.status()["models"]["resnet50"]
    why = (rate, status["calibration"], controller.models["resnet50"].decisions)
    assert late == [], ([(s.before, s.after, s.started - settle_until) for s in late], why)
    assert len(swaps_after(controller, 0)) <= 1, why
    assert status["calibration"]["updates"] >= 1  # served long enough to measure


def test_the_open_inference_protocol_reaches_packrats_pinned_workers_over_http_and_grpc(controller_factory):
    """Under the controller (versions of pinned workers behind one model name), tritonclient's v2 requests
    over HTTP and through the gRPC front answer what the model computes; a bad tensor is refused by name."""
    httpclient = pytest.importorskip("tritonclient.http")
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import numpy as np
    import torch
    from tritonclient.utils import InferenceServerException

    from serving_harness.oip_grpc import OipGrpcFront
    from tests.payloads import reference_logits

    controller = controller_factory()
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5)).numpy()
    expected = reference_logits(SPEC, [{"body": {"data": x[0].tolist()}}]).numpy()
    server = controller.server
    with OipGrpcFront(server.inference_url, server.management_url) as front:
        for module, client in ((httpclient, httpclient.InferenceServerClient(server.inference_url[7:])),
                               (grpcclient, grpcclient.InferenceServerClient(f"127.0.0.1:{front.port}"))):  # fmt: skip
            image = module.InferInput("image", list(x.shape), "FP32")
            image.set_data_from_numpy(x)
            logits = client.infer("resnet50", [image]).as_numpy("logits")
            np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=1e-4)
            wrong = module.InferInput("image", [1, 3, 224, 224], "FP64")
            wrong.set_data_from_numpy(np.full((1, 3, 224, 224), np.nan))
            with pytest.raises(InferenceServerException, match="input 'image' contains NaN"):
                client.infer("resnet50", [wrong])
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{front.port}").is_model_ready("resnet50")


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
    assert model.swapper.active == "t2b1"
    # The archive copy for the target class is made on first use: make it, then break it.
    from packrat_plugin.archives import versioned_copy

    target = controller.model_store / model.swapper.archive_name("t1b2")
    versioned_copy(model.target.archive, target, "t1b2")
    corrupt_artefact(target)
    with pytest.raises(SwapError, match="version t1b2 of resnet50 failed to start"):
        model._apply(model.level_for(4))  # a new (threads, batch) class: a cold bring-up
    status = controller.status()["models"]["resnet50"]
    assert status["active_version"] == "t2b1"
    assert status["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
    assert "failed to start" in status["last_error"]
    versions = {v["modelVersion"] for v in controller.server.management().describe("resnet50", "all")}
    assert versions == {"t2b1"}  # the half-built version was unregistered
    assert [w["status"] for w in workers(controller, "t2b1")] == ["READY"]
    assert controller.server.inference().predict("resnet50", image_tensor_json(SPEC)).status == 200

    # `packrat status` reads the controller's JSON endpoint and prints the state.
    out = subprocess.run(
        [sys.executable, "-m", "packrat_plugin.cli", "status", "--url", controller.status_url],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "resnet50" in out.stdout and "1×⟨t=2,b=1⟩" in out.stdout and "slots→cores" in out.stdout
    assert "last error: version t1b2 of resnet50 failed to start" in out.stdout


def test_fat_against_plan_comparison_serves_both_through_one_torchserve(tmp_path, archive):
    """``packrat bench``'s measurement: both systems deployed, loaded in turn, every request answered."""
    spec_payload = client_payload(SPEC, seed=3)
    topology = CpuTopology({0: tuple(sorted(os.sched_getaffinity(0)))[:2]})
    config = ComparisonConfig(batches=(2,), seconds=2.0, warmup_seconds=1.0, repeats=2)
    data = compare_fat_and_plan(archive("resnet50", "script"), two_core_profile(), lambda n: spec_payload,
                                tmp_path, config, topology=topology)  # fmt: skip
    (row,) = data["rows"]
    assert data["threads"] == 2 and row["batch"] == 2
    assert row["plan"] == [{"count": 2, "threads": 1, "batch": 1}]  # the profile's uniform optimum for B=2
    assert row["expected_speedup"] == pytest.approx(170.0 / 100.0)
    assert row["failed"] == 0 and row["requests"] >= 8
    assert row["fat_latency_ms"] > 0 and row["packrat_latency_ms"] > 0
    assert row["latency_speedup_min"] <= row["latency_speedup"] <= row["latency_speedup_max"]
    assert "2×⟨1,1⟩" in format_rows(data)
