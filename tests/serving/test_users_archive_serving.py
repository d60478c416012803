"""Packrat serving an archive the user built with ``torch-model-archiver``, through a real TorchServe.

The archive's handler is TorchServe's stock ``image_classifier`` (or a handler
file of the user's); Packrat wraps it (``handlers/wrapped.py``) so every worker
claims a slot, is pinned to its cores and runs its thread count, and answers
as the handler does in a TorchServe without Packrat.  The profile is written
by hand, as in ``test_packrat_online.py``, so the plan is known on any machine.
"""

from __future__ import annotations

import json
import os
import re
import time
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from packrat_plugin.archives import is_users_archive, versioned_copy
from packrat_plugin.controller import PackratController
from packrat_plugin.load_monitor import MonitorConfig
from packrat_plugin.model_control import ControllerConfig, ModelTarget
from packrat_plugin.profile import Profile, ProfilePoint
from packrat_plugin.swapper import SwapperConfig
from serving_harness.loadgen import closed_loop, run
from serving_harness.topology import CpuTopology
from serving_harness.torchserve import TorchServeProcess
from tests.serving.test_packrat_online import affinity_of_tasks
from tests.user_archives import build_user_archives, jpeg

pytestmark = [
    pytest.mark.torchserve,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="Packrat slots need two usable cores"),
]


@pytest.fixture(scope="module")
def archives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_user_archives(tmp_path_factory.mktemp("users"))


def split_profile(model: str) -> Profile:
    """At B=4 the optimizer's plan is two one-thread instances of batch 2 (one per core)."""
    latency = {(1, 1): 100.0, (2, 1): 90.0, (1, 2): 190.0, (2, 2): 170.0, (1, 4): 380.0, (2, 4): 400.0}
    return Profile(model, tuple(ProfilePoint(t, b, lat) for (t, b), lat in latency.items()))


def test_the_swappers_copy_of_a_users_archive_wraps_its_handler_and_keeps_the_rest(archives, tmp_path):
    source = archives["tiny"]
    assert is_users_archive(source)
    copy = versioned_copy(source, tmp_path / "tiny-t1b2.mar", "t1b2")
    with zipfile.ZipFile(source) as a, zipfile.ZipFile(copy) as b:
        manifest = yaml.safe_load(b.read("MAR-INF/MANIFEST.json"))
        config = yaml.safe_load(b.read(manifest["model"]["configFile"]))
        assert manifest["model"]["handler"] == "packrat_wrapped_handler.py"
        assert manifest["model"]["modelVersion"] == "t1b2"
        assert config == {"packrat": {"handler": "image_classifier"}}
        assert b.read("tiny.pt") == a.read("tiny.pt")  # the user's model, byte for byte
    with pytest.raises(ValueError, match="mixed plans need one built with `packrat archive`"):
        versioned_copy(source, tmp_path / "grouped.mar", "g", grouped=True)


def answers_of(server: TorchServeProcess, model: str, payloads: list[bytes]) -> list:
    client = server.inference()
    out = []
    for payload in payloads:
        answer = client.predict(model, payload)
        assert answer.status == 200, answer.body
        out.append(answer.body)
    return out


def close(a, b, tol: float = 1e-4) -> bool:
    """The stock handler answers {label: probability}; the user's handler a nested list of logits."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= tol for k in a)
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=tol)


def sample_payloads(model: str, root: Path) -> list[bytes]:
    if model == "tiny":  # the stock image_classifier eats JPEGs
        return [jpeg(root / f"img{i}.jpg", seed=10 + i).read_bytes() for i in range(4)]
    return [json.dumps([0.1 * i - 0.3 * k for k in range(3 * 8 * 8)]).encode() for i in range(4)]


@pytest.mark.parametrize("model", ["tiny", "tinycustom"])
def test_packrat_serves_a_users_archive_pinned_per_slot_with_the_handlers_own_answers(archives, tmp_path, model):
    payloads = sample_payloads(model, tmp_path)
    store = tmp_path / "plain-store"
    store.mkdir()
    (store / f"{model}.mar").write_bytes(archives[model].read_bytes())
    with TorchServeProcess(tmp_path / "plain", store) as plain:  # TorchServe without Packrat
        plain.management().register(f"{model}.mar", model_name=model, initial_workers=1)
        expected = answers_of(plain, model, payloads)

    config = ControllerConfig(
        monitor=MonitorConfig(period_s=0.1), swapper=SwapperConfig(max_batch_delay_ms=20), standby_workers=0,
        fixed_batch=4,
    )  # fmt: skip
    target = ModelTarget(model, archives[model], split_profile(model))
    topology = CpuTopology({0: tuple(sorted(os.sched_getaffinity(0)))[:2]})
    controller = PackratController(tmp_path / "packrat", [target], config, topology=topology).start()
    try:
        status = controller.status()["models"][model]
        assert status["plan"]["instances"] == [{"count": 2, "threads": 1, "batch": 2}]
        slots = {tuple(s["cores"]) for s in status["slots"]}
        assert len(slots) == 2 and len(set().union(*slots)) == 2  # disjoint, one core each
        workers = controller.server.management().describe(model, status["active_version"])[0]["workers"]
        held = [affinity_of_tasks(w["pid"]) for w in workers]
        assert len(held) == 2 and all(len(tasks) == 1 for tasks in held), held  # every thread on the slot's core
        assert {next(iter(tasks)) for tasks in held} == slots  # one worker per slot
        got = answers_of(controller.server, model, payloads)
        assert all(close(g, e) for g, e in zip(got, expected, strict=True)), (got, expected)
    finally:
        controller.stop()


def reported_threads(controller: PackratController, model: str, version: str, worker_id: str) -> tuple[list, int]:
    """The cores and intra-op threads the worker's own torch reported once the user's handler had initialised."""
    log = controller.server.model_log_text()
    found = re.findall(rf"W-{worker_id}-{model}_{version}-stdout .* in Packrat's slot: cores \[([\d, ]+)\], (\d+) "
                       "intra-op threads", log)  # fmt: skip
    assert found, f"no start-up line from worker {worker_id} of {model} v{version}"
    cores, threads = found[-1]
    return [int(c) for c in cores.split(",")], int(threads)


def pinned_to_their_slots(controller: PackratController, model: str) -> list[tuple[int, ...]]:
    """Every worker the management API lists for the active version: each thread of each worker, read from /proc,
    on exactly its slot's cores, one worker per slot, each running the slot's thread count.  Returns the slots'
    cores."""
    status = controller.status()["models"][model]
    version = status["active_version"]
    slots = {tuple(s["cores"]): s["threads"] for s in status["slots"]}
    listed = controller.server.management().describe(model, version)[0]["workers"]
    held = []
    for worker in listed:
        tasks = affinity_of_tasks(worker["pid"])
        assert len(tasks) == 1, (worker["pid"], tasks)  # all its threads on one set of cores
        cores = next(iter(tasks))
        held.append(cores)
        assert cores in slots, (cores, slots)
        assert reported_threads(controller, model, version, worker["id"]) == (list(cores), slots[cores])
    assert sorted(held) == sorted(slots), (held, slots)  # one worker per slot
    return sorted(slots)


def test_a_closed_loop_rise_on_a_users_archive_swaps_to_a_plan_pinned_per_slot_without_failures(archives, tmp_path):
    # The stock handler's archive: a swap moves between versioned copies of the archive whatever its handler,
    # and the user's own handler is served pinned per slot above (a second load run here cost CI 36 s).
    # The load is the one users make most: a fixed number of clients, 1 then 8 in flight.
    model = "tiny"
    # On the bare profile (no calibration: the user's model is far faster than the profile says, and
    # calibrated it would never need a second core): 8 in flight take 8 rounds of 90 ms on the fat worker,
    # one round of 380 ms on two 1-thread workers of batch 4.
    config = ControllerConfig(
        monitor=MonitorConfig(period_s=0.1), swapper=SwapperConfig(max_batch_delay_ms=20), standby_workers=8,
        calibrate=False,
    )  # fmt: skip
    target = ModelTarget(model, archives[model], split_profile(model))
    topology = CpuTopology({0: tuple(sorted(os.sched_getaffinity(0)))[:2]})
    controller = PackratController(tmp_path / "packrat", [target], config, topology=topology).start()
    try:
        first = controller.status()["models"][model]
        assert first["plan"]["instances"] == [{"count": 1, "threads": 2, "batch": 1}]
        assert pinned_to_their_slots(controller, model) == [tuple(sorted(os.sched_getaffinity(0)))[:2]]
        payload = jpeg(tmp_path / "load.jpg", seed=21).read_bytes()  # the stock image_classifier eats JPEGs
        url = f"{controller.server.inference_url}/predictions/{model}"
        results = [run(closed_loop(url, lambda i: payload, n, seconds)) for n, seconds in ((1, 4.0), (8, 14.0))]
        time.sleep(2.0)  # a swap still in progress finishes before the state is read
        for result in results:
            assert result.failed == 0, [s.status for s in result.samples if s.status != 200][:5]
        swaps = [r for r in controller.models[model].swaps if r.kind != "initial"]
        assert len(swaps) == 1 and swaps[0].warm, [(s.kind, s.before, s.after) for s in swaps]
        after = controller.status()["models"][model]
        assert [(i["count"], i["threads"]) for i in after["plan"]["instances"]] == [(2, 1)], after["plan"]
        slots = pinned_to_their_slots(controller, model)
        assert len(slots) == 2 and len(set().union(*slots)) == 2  # two disjoint one-core slots
        assert (
            controller.server.inference().predict(model, payload, content_type="application/octet-stream").status == 200
        )
        # Every worker that served (the fat one, then the split set) froze its start-up heap once the user's
        # handler had initialised (handlers/runtime/heap.py), as the wrapper does for any archive.
        assert len(controller.server.model_log_lines("start-up objects frozen")) >= 3
    finally:
        controller.stop()


def test_serving_a_users_archive_without_a_profile_says_how_to_make_one(archives, tmp_path, capsys, monkeypatch):
    from packrat_plugin.cli import main

    monkeypatch.chdir(tmp_path)  # no profiles/ here
    argv = ["serve", "--models", f"tiny={archives['tiny']}", "--free-ports", "--workdir", str(tmp_path / "w")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "packrat profile" in err[0] and "--sample FILE" in err[0], err


def test_packrat_bench_measures_a_users_archive_against_the_fat_worker_on_the_users_sample(archives, tmp_path, capsys):
    from packrat_plugin.cli import main as packrat_main

    sample = jpeg(tmp_path / "sample.jpg", seed=3)
    profile = tmp_path / "tiny.json"
    split_profile("tiny").save(profile)
    result = tmp_path / "bench.json"
    code = packrat_main(["bench", "--archive", str(archives["tiny"]), "--sample", str(sample), "--profile",
                         str(profile), "--force", "--batches", "4", "--seconds", "2", "--warmup-seconds", "1",
                         "--repeats", "1", "--json", str(result)])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    data = yaml.safe_load(result.read_text())
    [row] = data["rows"]
    assert data["model"] == "tiny" and row["failed"] == 0
    # The plan the profile calls for at B=4 (two one-thread workers of batch 2) against one fat worker,
    # with the profile's prediction beside the measured ratio.
    assert row["batch"] == 4 and row["plan"] == [{"count": 2, "threads": 1, "batch": 2}]
    assert row["latency_speedup"] > 0 and row["expected_speedup"] == pytest.approx(400.0 / 190.0)
    # Without a sample, a user's handler cannot be driven: one line says what to pass.
    assert packrat_main(["bench", "--archive", str(archives["tiny"]), "--profile", str(profile)]) == 2
    assert "pass --sample FILE" in capsys.readouterr().err
