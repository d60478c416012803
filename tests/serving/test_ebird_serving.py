"""Ebird served by a real TorchServe in async mode, on CPU.

The session's Ebird archive (``EBIRD_TEST_SETTINGS`` in conftest) has
workers of batch 1, 1, 2, 4, 8, two CPU lanes that take a batch of at most
8 each, and a 16-slot input pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import time
import zipfile

import aiohttp
import pytest
import torch
import yaml

from archiver.build import build_archive
from archiver.options import ServingOptions
from model_store.catalog import get_spec
from model_store.factory import outputs_close
from model_store.samples import image_tensor_json, jpeg_bytes, png_bytes
from serving_harness.loadgen import open_loop, run
from tests.conftest import EBIRD_TEST_SETTINGS
from tests.metrics_endpoint import handler_metric, requests_batched, settled_metric
from tests.payloads import reference_logits
from tests.serving.test_serving import TOLERANCE, assert_matches_reference

pytestmark = pytest.mark.torchserve

LARGEST_WORKER = max(EBIRD_TEST_SETTINGS["worker_batches"])


def burst(torchserve, model: str, payloads: list, rate: float):
    """Send ``payloads`` open-loop at ``rate`` per second; returns the load result (every request accounted for)."""
    url = f"{torchserve.inference_url}/predictions/{model}"
    return run(open_loop(url, lambda i: payloads[i], [((len(payloads) + 0.5) / rate, rate)], poisson=False))


def post_all(url: str, payloads: list) -> list[tuple[int, str]]:
    """POST every payload at once; (status, body) per payload, in order."""

    async def send() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:

            async def one(payload) -> tuple[int, str]:
                data = json.dumps(payload).encode() if isinstance(payload, dict) else payload
                async with session.post(url, data=data) as resp:
                    return resp.status, await resp.text()

            return list(await asyncio.gather(*(one(p) for p in payloads)))

    return asyncio.run(send())


def test_ebird_archive_asks_torchserve_for_async_mode(archive):
    with zipfile.ZipFile(archive("resnet50", "eager", "ebird")) as mar:
        config = yaml.safe_load(mar.read("model-config.yaml"))
        manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
    assert config["asyncCommunication"] is True
    assert (config["batchSize"], config["maxBatchDelay"]) == (1, 0)  # Ebird batches, not the frontend
    assert config["handler"]["ebird"] == EBIRD_TEST_SETTINGS
    assert manifest["model"]["handler"] == "ebird_handler.py"


def test_burst_is_split_across_workers_and_every_result_equals_direct_output(served, torchserve):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager", "ebird")
    n = LARGEST_WORKER + 5
    rows = [{"body": jpeg_bytes(seed=i) if i % 2 else image_tensor_json(spec, seed=i)} for i in range(n)]
    client = torchserve.inference()
    answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [row["body"] for row in rows])
    assert [status for status, _ in answers] == [200] * len(rows), answers
    bodies = {i: json.loads(body) for i, (_, body) in enumerate(answers)}
    assert_matches_reference(spec, rows, [bodies[i] for i in range(len(rows))])
    assert client.predict(model, rows[0]["body"]).status == 200  # still serving

    answered = len(rows) + 1
    samples = handler_metric(torchserve, "HandlerBatches", model, until=lambda s: requests_batched(s) >= answered)
    batches = {int(labels["BatchSize"]): value for labels, value in samples}
    assert requests_batched(samples) >= answered
    assert len(batches) >= 2, batches  # the burst was not run as one batch, nor one request at a time
    [(_, peak)] = handler_metric(torchserve, "HandlerPeakConcurrentBatches", model, until=bool)
    assert peak >= 2  # two workers' batches ran at the same time
    [(_, inflight)] = handler_metric(torchserve, "HandlerInflight", model, until=lambda s: s and s[0][1] == 0)
    assert inflight == 0

    # The per-stage breakdown reaches the metrics endpoint: every answered request in every stage.
    def every_stage(samples) -> bool:
        return len(samples) == 7 and min(v for _, v in samples) >= answered

    counts = {labels["Stage"]: v for labels, v in handler_metric(torchserve, "HandlerStageCount", model, every_stage)}
    seconds = {labels["Stage"]: v for labels, v in handler_metric(torchserve, "HandlerStageSeconds", model, bool)}
    assert set(counts) == set(seconds) == {"decode", "admission", "queue", "batch", "release", "wakeup", "encode"}
    assert min(counts.values()) >= answered and seconds["batch"] > 0


def test_small_batch_answered_before_an_earlier_large_one(served, torchserve):
    model = served("resnet50", "eager", "ebird")
    payloads = [jpeg_bytes(seed=i) for i in range(16)]
    result = burst(torchserve, model, payloads, rate=40.0)
    assert [s.status for s in result.samples] == [200] * len(payloads)
    by_sent = sorted(result.samples, key=lambda s: s.sent)
    overtaken = [
        (a, b)
        for i, a in enumerate(by_sent)
        for b in by_sent[i + 1 :]
        if b.sent - a.sent >= 0.04 and b.sent + b.latency_s < a.sent + a.latency_s
    ]
    assert overtaken, "every answer came back in arrival order"


def test_no_request_lost_in_a_burst_three_times_what_ebird_holds_in_flight(served, torchserve):
    """The burst waits in Ebird's line (on CPU lanes, taken undecoded: ``row_intake.py``), runs in batches
    no larger than the lane rule's cap, and every request is answered, each in exactly one batch."""
    model = served("resnet50", "eager", "ebird")

    def rows_run(samples) -> int:
        return sum(int(labels["BatchSize"]) * value for labels, value in samples)

    before = rows_run(settled_metric(torchserve, "HandlerBatches", model))  # earlier tests' batches all counted
    n = 3 * EBIRD_TEST_SETTINGS["max_inflight"]
    result = burst(torchserve, model, [jpeg_bytes(seed=i) for i in range(n)], rate=500.0)
    assert len(result.samples) == n
    assert [s.status for s in result.samples] == [200] * n
    batches = handler_metric(torchserve, "HandlerBatches", model, until=lambda s: rows_run(s) >= before + n)
    assert rows_run(batches) == before + n
    assert max(int(labels["BatchSize"]) for labels, _ in batches) <= EBIRD_TEST_SETTINGS["cpu_batch_cap"]


def test_bad_input_gets_its_4xx_and_requests_in_flight_are_unaffected(served, torchserve):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager", "ebird")
    good = [{"body": jpeg_bytes(seed=100 + i)} for i in range(6)]
    bad = [
        (b"{not json", 400),
        (json.dumps({"data": [[[0.0] * 5] * 5] * 3}).encode(), 400),  # wrong shape: not declared
        (b"GIF89a" + b"\xfe\xff" * 32, 415),
        (b"\xff\xd8\xff" + bytes(9 * 1024 * 1024), 413),
    ]
    payloads = [row["body"] for row in good[:3]] + [p for p, _ in bad] + [row["body"] for row in good[3:]]
    result = burst(torchserve, model, payloads, rate=50.0)
    by_sent = sorted(result.samples, key=lambda s: s.sent)
    statuses = [s.status for s in by_sent]
    assert statuses == [200] * 3 + [code for _, code in bad] + [200] * 3
    client = torchserve.inference()
    answers = [client.predict(model, row["body"]) for row in good[:2]]
    assert [a.status for a in answers] == [200, 200]
    assert_matches_reference(spec, good[:2], [a.body for a in answers])


@contextlib.contextmanager
def registered_apart(torchserve, model_store_dir, tmp_path, options: ServingOptions, model: str):
    """Register resnet50 built with ``options`` as ``model`` (its archive apart from the session's,
    which shares its file name) for the ``with`` block; yields the archive's path."""
    built = build_archive(get_spec("resnet50", "eager"), tmp_path, options)
    target = model_store_dir / f"resnet50_eager-{model}.mar"
    shutil.copy(built, target)
    torchserve.management().register(target.name, model_name=model, initial_workers=1)
    try:
        yield target
    finally:
        torchserve.management().unregister(model)


def archive_config(path) -> dict:
    with zipfile.ZipFile(path) as mar:
        return yaml.safe_load(mar.read("model-config.yaml"))


def serve_good_and_bad(torchserve, model: str, good: int) -> int:
    """``good`` requests (JPEG and tensor JSON) with malformed JSON and a wrong shape, all at once:
    each gets its own answer, the good ones the model's. Returns how many were sent."""
    spec = get_spec("resnet50", "eager")
    rows = [{"body": jpeg_bytes(seed=i) if i % 2 else image_tensor_json(spec, seed=i)} for i in range(good)]
    bad = [b"{not json", {"data": [[[0.0] * 8] * 8] * 3}]
    answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [r["body"] for r in rows] + bad)
    assert [status for status, _ in answers] == [200] * len(rows) + [400, 400], answers
    assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers[: len(rows)]])
    assert "malformed JSON" in json.loads(answers[-2][1])["message"]
    assert "wrong tensor shape [3, 8, 8]" in json.loads(answers[-1][1])["message"]
    return len(answers)


def worker_log(torchserve, model: str) -> list[str]:
    """The model log's lines from ``model``'s workers (TorchServe names each line's thread after the model)."""
    return torchserve.model_log_lines(f"-{model}_", timeout_s=0)


def test_the_default_cpu_lane_rule_caps_batches_by_measured_cost_inside_torchserve(
    torchserve, model_store_dir, tmp_path
):
    """``cpu_batch_cap: auto`` (the default) under TorchServe's real async worker, on one lane: the worker log
    names the costs and the cap, every request gets its answer, and no batch exceeds a cap the log named."""
    settings = {k: v for k, v in EBIRD_TEST_SETTINGS.items() if k != "cpu_batch_cap"} | {"cpu_lanes": 1}
    options = ServingOptions(handler="ebird", handler_settings=tuple(sorted(settings.items())))
    with registered_apart(torchserve, model_store_dir, tmp_path, options, "ebird-auto") as archive:
        assert "cpu_batch_cap" not in archive_config(archive)["handler"]["ebird"]
        serve_good_and_bad(torchserve, "ebird-auto", good=13)
        samples = handler_metric(torchserve, "HandlerBatches", "ebird-auto", until=lambda s: requests_batched(s) >= 13)
        sizes = {int(labels["BatchSize"]) for labels, _ in samples}
        deadline = time.monotonic() + 10  # the frontend logs a worker's stdout from a thread of its own
        while not (
            caps := [int(c) for c in re.findall(r"of at most (\d+)", "\n".join(worker_log(torchserve, "ebird-auto")))]
        ):
            assert time.monotonic() < deadline, "the worker never logged its lane cap"
            time.sleep(0.2)
        assert max(sizes) <= max(caps), (sizes, caps)


def test_decoding_on_a_pool_inside_torchserve_answers_and_refuses_as_inline(torchserve, model_store_dir, tmp_path):
    """The decode pool (the CUDA default) under TorchServe's real async worker, on CPU."""
    options = ServingOptions(
        handler="ebird", handler_settings=tuple(sorted(EBIRD_TEST_SETTINGS.items())), decode_threads=2
    )
    with registered_apart(torchserve, model_store_dir, tmp_path, options, "ebird-decode2") as archive:
        assert archive_config(archive)["handler"]["decode_threads"] == 2
        serve_good_and_bad(torchserve, "ebird-decode2", good=9)


def startup_line(torchserve, model: str) -> str:
    """The handler's start-up line in ``model``'s worker log (the frontend copies it from a thread of its own)."""
    deadline = time.monotonic() + 10
    while not (lines := [line for line in worker_log(torchserve, model) if "encoding answers" in line]):
        assert time.monotonic() < deadline, "the worker never logged its start-up line"
        time.sleep(0.2)
    return lines[-1]


def test_the_default_archive_encodes_answers_where_each_batch_ends(served, torchserve):
    model = served("resnet50", "eager", "ebird")
    serve_good_and_bad(torchserve, model, good=5)
    assert "encoding answers where each batch ends" in startup_line(torchserve, model)


def test_answers_on_the_event_loop_and_loud_batches_inside_torchserve(torchserve, model_store_dir, tmp_path):
    """The two settings that undo this runtime's CPU cuts (the benchmarks' "before") still serve everything."""
    settings = EBIRD_TEST_SETTINGS | {"cpu_quiet_batches": False}
    options = ServingOptions(handler="ebird", handler_settings=tuple(sorted(settings.items())), encode_answers="loop")
    with registered_apart(torchserve, model_store_dir, tmp_path, options, "ebird-loop-loud") as archive:
        config = archive_config(archive)["handler"]
        assert (config["encode_answers"], config["ebird"]["cpu_quiet_batches"]) == ("loop", False)
        serve_good_and_bad(torchserve, "ebird-loop-loud", good=9)
        assert "encoding answers on the event loop" in startup_line(torchserve, "ebird-loop-loud")


@pytest.mark.parametrize("handler", ["ebird", "plain"])
def test_batched_jpeg_decoding_inside_torchserve_answers_every_payload_and_refuses_a_corrupt_jpeg(
    torchserve, model_store_dir, tmp_path, handler
):
    """``decode_threads: batched`` (nvJPEG batches on CUDA; torchvision's decoder on CPU) under TorchServe's real
    workers: Ebird's async worker, and the plain handler, which decodes the JPEGs of each batch the frontend
    hands it in one call.  JPEGs that arrive together are decoded in one call (``HandlerDecodeBatches``) and
    answer the model; a PNG and tensor JSON go to the codec; a truncated JPEG (which fails its batch's call), one
    that is not a JPEG past its magic, malformed JSON and a wrong shape get their own 4xx while the rest of their
    burst is answered; the worker keeps serving."""
    spec = get_spec("resnet50", "eager")
    if handler == "ebird":
        options = ServingOptions(
            handler="ebird", handler_settings=tuple(sorted(EBIRD_TEST_SETTINGS.items())), decode_threads="batched"
        )
    else:  # the frontend gathers the burst into batches of up to 8
        options = ServingOptions(handler="plain", batch_size=8, max_batch_delay_ms=200, decode_threads="batched")
    model = f"{handler}-batched"
    with registered_apart(torchserve, model_store_dir, tmp_path, options, model) as archive:
        assert archive_config(archive)["handler"]["decode_threads"] == "batched"
        rows = [{"body": jpeg_bytes(seed=i)} for i in range(10)]
        rows += [{"body": png_bytes(seed=10)}, {"body": image_tensor_json(spec, seed=11)}]
        bad = [
            (jpeg_bytes(seed=12)[:3000], 415),
            (b"\xff\xd8\xff\xe0 not a jpeg after its magic", 415),
            (b"{not json", 400),
            ({"data": [[[0.0] * 8] * 8] * 3}, 400),
        ]
        answers = post_all(f"{torchserve.inference_url}/predictions/{model}",
                           [r["body"] for r in rows] + [p for p, _ in bad])  # fmt: skip
        assert [s for s, _ in answers] == [200] * len(rows) + [code for _, code in bad], answers
        expected = reference_logits(spec, rows, batched_jpeg=True)
        for (_, body), row in zip(answers[: len(rows)], expected, strict=True):
            served = torch.tensor(json.loads(body)["logits"])
            assert outputs_close(served, row, TOLERANCE[spec.mode]), (served - row).abs().max()
        assert "wrong tensor shape [3, 8, 8]" in json.loads(answers[-1][1])["message"]
        again = torchserve.inference().predict(model, rows[0]["body"])
        assert again.status == 200 and outputs_close(torch.tensor(again.body["logits"]), expected[0], 1e-4)
        if handler == "ebird":
            assert "in batches" in startup_line(torchserve, model)
        decoded = handler_metric(torchserve, "HandlerDecodeBatches", model,
                                 until=lambda s: requests_batched(s) >= 11)  # fmt: skip
        sizes = {int(labels["BatchSize"]): n for labels, n in decoded}
        assert requests_batched(decoded) == 11 and max(sizes) > 1, sizes  # 10 JPEGs, then one more alone
