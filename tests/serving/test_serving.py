"""A real TorchServe serves the CI models from archives, in every execution mode."""

from __future__ import annotations

import json
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from model_store.catalog import ModelSpec, get_spec
from model_store.factory import outputs_close
from serving_harness.clients import TorchServeAPIError
from serving_harness.log_config import log4j2_xml
from serving_harness.torchserve import TorchServeError, TorchServeProcess
from tests.frontend_heap import frontend_pid
from tests.metrics_endpoint import handler_metric, requests_batched
from tests.payloads import image_tensor_json, jpeg_bytes, png_bytes, reference_logits, token_ids_json

pytestmark = pytest.mark.torchserve

MODES = ("eager", "script", "compile")
# compile mode may reorder floating-point reductions; eager and script match
# to the last bits.
TOLERANCE = {"eager": 1e-4, "script": 1e-4, "compile": 1e-3}


def assert_mask_matches(body: dict, expected: torch.Tensor, tol: float) -> None:
    """A segmentation answer: each pixel's class is the reference's, except where its top two logits tie (``tol``)."""
    mask = torch.tensor(body["mask"])
    assert body["classes"] == expected.shape[0] and mask.shape == expected.shape[1:]
    top2 = expected.topk(2, dim=0).values
    margin = top2[0] - top2[1]
    differ = mask != expected.argmax(dim=0)
    assert (margin[differ] <= tol * max(1.0, float(expected.abs().max()))).all(), int(differ.sum())


def assert_matches_reference(spec: ModelSpec, rows: list[dict], bodies: list[dict]) -> None:
    expected = reference_logits(spec, rows)
    for row_expected, body in zip(expected, bodies, strict=True):
        if "mask" in body:
            assert_mask_matches(body, row_expected, TOLERANCE[spec.mode])
            continue
        served = torch.tensor(body["logits"])
        assert outputs_close(served, row_expected, TOLERANCE[spec.mode]), (served - row_expected).abs().max()
        assert body["top5"][0]["index"] == int(row_expected.argmax())


def test_unpacked_archives_stay_inside_the_servers_workdir(served, torchserve):
    served("resnet50", "eager")
    unpacked = torchserve.workdir / "tmp" / "models"
    assert unpacked.is_dir() and any(unpacked.iterdir())  # removed with the workdir, not left in /tmp


def log4j_flags(server: TorchServeProcess) -> list[str]:
    """The log4j configuration flags on the frontend's (the JVM's) command line."""
    args = Path(f"/proc/{frontend_pid(server)}/cmdline").read_bytes().decode().split("\0")
    return [arg for arg in args if arg.startswith("-Dlog4j.configurationFile=")]


def test_the_frontend_logs_with_the_harness_config_into_the_servers_own_files(served, torchserve):
    """The JVM was given the workdir's log4j2.xml (size-only rolling: no midnight roll under a reader) and
    the worker's start-up reached ``model_log.log`` through it, its thread named after the model."""
    model = served("resnet50", "eager")
    assert log4j_flags(torchserve) == [f"-Dlog4j.configurationFile=file://{torchserve.workdir / 'log4j2.xml'}"]
    assert torchserve.model_log_lines(f"-{model}_", timeout_s=5)


def test_a_log_config_of_the_callers_own_replaces_the_harness_one(model_store_dir, tmp_path):
    missing = TorchServeProcess(tmp_path / "missing", model_store_dir, log_config=tmp_path / "nowhere.xml")
    with pytest.raises(TorchServeError, match="nowhere.xml does not exist"):
        missing.start()
    own = tmp_path / "own.xml"
    own.write_text(log4j2_xml(roll_mb=1, keep=1))
    with TorchServeProcess(tmp_path / "own", model_store_dir, log_config=own) as server:
        assert log4j_flags(server) == [f"-Dlog4j.configurationFile=file://{own}"]
        assert not (server.workdir / "log4j2.xml").exists()


def test_archive_carries_the_spec_and_the_handler(archive):
    path = archive("resnet50", "script")
    with zipfile.ZipFile(path) as mar:
        names = set(mar.namelist())
        config = yaml.safe_load(mar.read("model-config.yaml"))
        manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
    assert {"model.pt", "plain_handler.py", "model-config.yaml"} <= names
    assert ModelSpec.from_dict(config["handler"]["spec"]) == get_spec("resnet50", "script")
    assert manifest["model"]["handler"] == "plain_handler.py"


# torch.compile through TorchServe is checked on the text model (its load path is the same for every
# model, and compiling ResNet-50 cold cost CI 38-48 s against 28-30 s for bert-mini).
@pytest.mark.parametrize("mode", ("eager", "script"))
def test_resnet50_served_result_equals_direct_output(served, torchserve, mode):
    spec = get_spec("resnet50", mode)
    model = served("resnet50", mode)
    client = torchserve.inference()
    rows = [{"body": image_tensor_json(spec, seed=1)}, {"body": jpeg_bytes(seed=2)}, {"body": png_bytes(seed=3)}]
    answers = [client.predict(model, row["body"]) for row in rows]
    assert [a.status for a in answers] == [200, 200, 200], [a.body for a in answers]
    assert_matches_reference(spec, rows, [a.body for a in answers])

    def every_stage(samples) -> bool:
        return len(samples) == 3 and min(v for _, v in samples) >= len(rows)

    samples = handler_metric(torchserve, "HandlerStageCount", model, until=every_stage)
    stages = {labels["Stage"]: value for labels, value in samples}
    assert set(stages) == {"decode", "model", "encode"} and min(stages.values()) >= len(rows)
    samples = handler_metric(torchserve, "HandlerBatches", model, until=lambda s: requests_batched(s) >= len(rows))
    assert requests_batched(samples) >= len(rows)


@pytest.mark.parametrize("mode", MODES)
def test_bert_served_result_equals_direct_output(served, torchserve, mode):
    spec = get_spec("bert-mini", mode)
    model = served("bert-mini", mode)
    client = torchserve.inference()
    rows = [{"body": token_ids_json(spec, n, seed=n)} for n in (5, 64, 128)]
    answers = [client.predict(model, row["body"]) for row in rows]
    assert [a.status for a in answers] == [200, 200, 200], [a.body for a in answers]
    assert_matches_reference(spec, rows, [a.body for a in answers])


def test_bad_request_in_a_batch_fails_only_itself(served, torchserve):
    """Four requests batched together; the malformed one gets 400, the rest their logits."""
    spec = get_spec("bert-mini", "script")
    # A long batch window gathers the four concurrent requests into one batch.
    model = served("bert-mini", "script", batch_size=4, max_batch_delay_ms=2000)
    client = torchserve.inference()
    good = [token_ids_json(spec, n, seed=n) for n in (7, 20, 33)]
    payloads = [good[0], b'{"input_ids": [1, 2,', good[1], good[2]]
    with ThreadPoolExecutor(len(payloads)) as pool:
        answers = list(pool.map(lambda p: client.predict(model, p, content_type="application/json"), payloads))
    assert [a.status for a in answers] == [200, 400, 200, 200], [a.body for a in answers]
    assert "malformed JSON" in answers[1].body["message"]
    assert_matches_reference(spec, [{"body": g} for g in good], [answers[i].body for i in (0, 2, 3)])
    assert torchserve.model_log_lines("batch of 4 requests, 1 refused")


BAD_IMAGE_REQUESTS = [
    (b'{"data": [[1.0, 2.0]', "application/json", 400, "malformed JSON"),
    ({"data": [[1.0, 2.0]]}, None, 400, "wrong tensor shape [1, 2], expected [3, 224, 224]"),
    ({"data": [[["x"]]]}, None, 400, "wrong dtype"),
    (b"", "application/octet-stream", 400, "empty request body"),
    (b"\xff\xd8\xff" + bytes(9 * 1024 * 1024), "image/jpeg", 413, "exceeds the limit"),
    (b"\xff\xd8\xff\xe0 truncated", "image/jpeg", 415, "cannot decode image"),
]


@pytest.mark.parametrize("payload, content_type, status, reason", BAD_IMAGE_REQUESTS)
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(served, torchserve, payload, content_type, status, reason):
    spec = get_spec("resnet50", "script")
    model = served("resnet50", "script")
    client = torchserve.inference()
    bad = client.predict(model, payload, content_type=content_type)
    assert bad.status == status, bad.body
    assert reason in bad.body["message"]
    good_row = {"body": image_tensor_json(spec, seed=9)}
    good = client.predict(model, good_row["body"])
    assert good.status == 200
    assert_matches_reference(spec, [good_row], [good.body])


def test_bad_token_input_gets_a_4xx(served, torchserve):
    model = served("bert-mini", "script")
    client = torchserve.inference()
    too_long = client.predict(model, {"input_ids": [1] * 129})
    assert too_long.status == 400 and "sequence length 128" in too_long.body["message"]
    out_of_vocab = client.predict(model, {"input_ids": [10**6]})
    assert out_of_vocab.status == 400 and "outside the vocabulary" in out_of_vocab.body["message"]
    assert client.predict(model, {"input_ids": [101, 2023, 102]}).status == 200


def test_oversized_request_is_refused_by_the_frontend(served, torchserve):
    model = served("resnet50", "script")
    answer = torchserve.inference().predict(model, bytes(33 * 1024 * 1024), content_type="image/jpeg")
    assert answer.status == 413


def test_unknown_model_and_bad_registration_are_4xx(torchserve):
    client = torchserve.inference()
    answer = client.predict("no-such-model", {"data": [1]})
    assert answer.status == 404 and "no-such-model" in answer.body["message"]
    with pytest.raises(TorchServeAPIError) as info:
        torchserve.management().register("no-such-archive.mar")
    assert 400 <= info.value.status < 500
    assert torchserve.inference().ping()
