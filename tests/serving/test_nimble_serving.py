"""Nimble served by a real TorchServe: batches inside the buckets, a batch above them, bad payloads."""

from __future__ import annotations

import json
import time
import zipfile

import pytest
import yaml

from archiver.build import build_archive
from archiver.options import ServingOptions
from model_store.catalog import get_spec
from model_store.samples import image_tensor_json, jpeg_bytes
from tests.serving.test_ebird_serving import post_all
from tests.serving.test_serving import assert_matches_reference

pytestmark = pytest.mark.torchserve

# Buckets up to 2 while TorchServe batches up to 4: a full batch takes the eager fallback.
# No compiled candidate: compiling ResNet-50 in the worker would add a minute
# on 2 cores (tests/unit/test_nimble_program.py covers that candidate).
NIMBLE_TEST_SETTINGS = {"buckets": [1, 2], "timing_runs": 1, "cpu_compile": False}
MODEL = "resnet50-nimble"


def options() -> ServingOptions:
    return ServingOptions(
        handler="nimble", handler_settings=tuple(NIMBLE_TEST_SETTINGS.items()), batch_size=4, max_batch_delay_ms=1500
    )


@pytest.fixture(scope="module")
def nimble(torchserve, model_store_dir):
    path = build_archive(get_spec("resnet50"), model_store_dir, options())
    torchserve.management().register(path.name, model_name=MODEL, initial_workers=1)
    yield path
    torchserve.management().unregister(MODEL)


def model_log(torchserve) -> list[str]:
    return torchserve.model_log_lines(MODEL, timeout_s=0)


def fallback_lines(torchserve) -> list[str]:
    return [line for line in model_log(torchserve) if "Nimble fallback" in line]


def test_a_nimble_archive_carries_its_buckets_and_refuses_what_it_cannot_serve(nimble, tmp_path):
    with zipfile.ZipFile(nimble) as mar:
        config = yaml.safe_load(mar.read("model-config.yaml"))
        manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
    assert manifest["model"]["handler"] == "nimble_handler.py"
    assert config["handler"]["nimble"] == NIMBLE_TEST_SETTINGS and config["batchSize"] == 4
    assert "asyncCommunication" not in config  # TorchServe batches; Nimble runs the batches
    with pytest.raises(ValueError, match="eager"):
        build_archive(get_spec("resnet50", "script"), tmp_path, options())
    with pytest.raises(ValueError, match="image models"):
        build_archive(get_spec("bert-mini"), tmp_path, options())
    with pytest.raises(ValueError, match="increasing"):
        ServingOptions(handler="nimble", handler_settings=(("buckets", [2, 1]),))


def test_the_worker_prepares_every_bucket_and_says_what_it_chose(nimble, torchserve):
    (prepared,) = [line for line in model_log(torchserve) if "Nimble prepared resnet50" in line]
    assert "5 stream(s), 8 synchronisation(s)" in prepared  # ResNet-50: the trunk and the 4 downsample branches
    assert "batch 1: " in prepared and "batch 2: " in prepared
    assert any("batch size 4 is above Nimble's largest bucket 2" in line for line in model_log(torchserve))


def test_batches_inside_the_buckets_take_the_prepared_program(nimble, torchserve):
    url = f"{torchserve.inference_url}/predictions/{MODEL}"
    spec = get_spec("resnet50")
    before = fallback_lines(torchserve)
    for seeds in ((20,), (21, 22)):  # a batch of 1, then one of 2
        rows = [{"body": jpeg_bytes(seed=s)} for s in seeds]
        answers = post_all(url, [r["body"] for r in rows])
        assert [status for status, _ in answers] == [200] * len(rows), answers
        assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers])
    time.sleep(1.0)  # time for a fallback line, were there one, to reach the log
    assert fallback_lines(torchserve) == before


def test_a_batch_above_the_buckets_runs_eager_and_a_bad_payload_fails_alone(nimble, torchserve):
    url = f"{torchserve.inference_url}/predictions/{MODEL}"
    spec = get_spec("resnet50")
    rows = [{"body": jpeg_bytes(seed=10 + i) if i % 2 else image_tensor_json(spec, seed=10 + i)} for i in range(6)]
    bad = [b"{not json", {"data": [[0.0, 1.0]]}]  # malformed JSON; a wrong tensor shape
    before = fallback_lines(torchserve)
    # Eight at once, TorchServe batch 4: two batches of 4, one of them with at least 3 good requests (> bucket 2).
    answers = post_all(url, [r["body"] for r in rows] + bad)
    assert [status for status, _ in answers] == [200] * 6 + [400, 400], answers
    assert "wrong tensor shape" in answers[7][1]
    assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers[:6]])
    deadline = time.monotonic() + 5.0  # the frontend copies the worker's log lines as they come
    while len(fallback_lines(torchserve)) == len(before) and time.monotonic() < deadline:
        time.sleep(0.1)
    fallbacks = fallback_lines(torchserve)[len(before) :]
    assert fallbacks and all("above the largest bucket 2, ran eager" in line for line in fallbacks)
