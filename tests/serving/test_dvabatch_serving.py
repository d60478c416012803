"""DVABatch served by a real TorchServe in async mode, on CPU (``DVABATCH_TEST_SETTINGS`` in conftest)."""

from __future__ import annotations

import json
import re
import shutil
import zipfile

import pytest
import yaml

from archiver.build import build_archive
from archiver.options import ServingOptions
from model_store.catalog import get_spec
from model_store.samples import image_tensor_json, jpeg_bytes, png_bytes, token_ids_json
from tests.conftest import DVABATCH_TEST_SETTINGS
from tests.metrics_endpoint import handler_metric, requests_batched
from tests.serving.test_ebird_serving import burst, post_all
from tests.serving.test_serving import assert_matches_reference

pytestmark = pytest.mark.torchserve


def test_dvabatch_archive_asks_for_async_mode_and_only_eager_models_are_sliced(archive, tmp_path):
    with zipfile.ZipFile(archive("resnet50", "eager", "dvabatch")) as mar:
        config = yaml.safe_load(mar.read("model-config.yaml"))
        manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
    assert config["asyncCommunication"] is True and (config["batchSize"], config["maxBatchDelay"]) == (1, 0)
    assert config["handler"]["dvabatch"] == DVABATCH_TEST_SETTINGS
    assert manifest["model"]["handler"] == "dvabatch_handler.py"
    options = ServingOptions(handler="dvabatch", handler_settings=(("segments", 2),))
    with pytest.raises(ValueError, match="eager"):
        build_archive(get_spec("resnet50", "script"), tmp_path, options)
    with pytest.raises(ValueError, match="segments"):
        ServingOptions(handler="dvabatch", handler_settings=(("segments", 0),))


def test_a_burst_through_the_stages_equals_the_models_output(served, torchserve):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager", "dvabatch")
    rows = [{"body": jpeg_bytes(seed=i) if i % 2 else image_tensor_json(spec, seed=i)} for i in range(10)]
    answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [row["body"] for row in rows])
    assert [status for status, _ in answers] == [200] * len(rows), answers
    assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers])

    samples = handler_metric(torchserve, "HandlerBatches", model, until=lambda s: requests_batched(s) >= len(rows))
    batches = {int(labels["BatchSize"]): n for labels, n in samples}
    assert max(batches) > 1, batches  # requests shared batches, none waited for a window
    samples = handler_metric(torchserve, "HandlerOperations", model, until=lambda s: sum(n for _, n in s) >= 2)
    operations = {labels["Operation"]: n for labels, n in samples}
    assert operations.get("new", 0) >= 1 and sum(operations.values()) >= 2, operations


def test_bad_input_gets_its_4xx_alone_while_its_batch_mates_succeed(served, torchserve):
    spec = get_spec("resnet50", "eager")
    model = served("resnet50", "eager", "dvabatch")
    good = [{"body": jpeg_bytes(seed=200 + i)} for i in range(4)]
    bad = [(b"{not json", 400), (json.dumps({"data": [[[0.0] * 5] * 5] * 3}).encode(), 400), (b"", 400)]
    payloads = [row["body"] for row in good[:2]] + [p for p, _ in bad] + [row["body"] for row in good[2:]]
    result = burst(torchserve, model, payloads, rate=40.0)
    statuses = [s.status for s in sorted(result.samples, key=lambda s: s.sent)]
    assert statuses == [200] * 2 + [code for _, code in bad] + [200] * 2
    answer = torchserve.inference().predict(model, good[0]["body"])
    assert answer.status == 200
    assert_matches_reference(spec, good[:1], [answer.body])


def test_bert_with_mixed_lengths_and_bad_inputs_in_one_burst(served, torchserve):
    """BERT (sliced through torch.export) in stages: every length right, every bad input its own 400."""
    spec = get_spec("bert-mini", "eager")
    model = served("bert-mini", "eager", "dvabatch")
    rows = [{"body": token_ids_json(spec, n, seed=n)} for n in (3, 17, 64, 128, 40, 9)]
    bad = [
        {"input_ids": [1.5, 2.0, 3.0]},  # wrong dtype
        {"input_ids": list(range(spec.seq_len + 1))},  # longer than the model takes
        b"",  # empty body
    ]
    answers = post_all(
        f"{torchserve.inference_url}/predictions/{model}",
        [r["body"] for r in rows[:3]] + bad + [r["body"] for r in rows[3:]],
    )
    statuses = [status for status, _ in answers]
    assert statuses == [200] * 3 + [400] * 3 + [200] * 3, answers
    bodies = [json.loads(body) for status, body in answers if status == 200]
    assert_matches_reference(spec, rows, bodies)


def test_all_stages_on_one_lane_inside_torchserve(torchserve, model_store_dir, tmp_path):
    """``cpu_lanes: 1`` (every stage on one thread, in turn) under TorchServe's real async worker."""
    spec = get_spec("resnet50", "eager")
    settings = {**DVABATCH_TEST_SETTINGS, "cpu_lanes": 1}
    built = build_archive(spec, tmp_path, ServingOptions(handler="dvabatch", handler_settings=tuple(settings.items())))
    target = model_store_dir / "resnet50_eager-dvabatch-one-lane.mar"  # apart from the session's DVABatch archive
    shutil.copy(built, target)
    with zipfile.ZipFile(target) as mar:
        assert yaml.safe_load(mar.read("model-config.yaml"))["handler"]["dvabatch"]["cpu_lanes"] == 1
    model = "dvabatch-one-lane"
    torchserve.management().register(target.name, model_name=model, initial_workers=1)
    try:
        rows = [
            {"body": jpeg_bytes(seed=300 + i) if i % 2 else image_tensor_json(spec, seed=300 + i)} for i in range(8)
        ]
        answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [r["body"] for r in rows] + [b"{bad"])
        assert [status for status, _ in answers] == [200] * len(rows) + [400], answers
        assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers[: len(rows)]])
        samples = handler_metric(torchserve, "HandlerBatches", model, until=lambda s: requests_batched(s) >= len(rows))
        assert requests_batched(samples) >= len(rows)
        log = torchserve.model_log_text()
        assert any(model in line and "CpuLanes(1 ×" in line for line in log.splitlines()), "not on one lane"
    finally:
        torchserve.management().unregister(model)


def test_bert_in_length_classes_answers_every_length_as_the_model_does(torchserve, model_store_dir, tmp_path):
    """``token_lengths`` (the input-diversity policy): requests padded to their length class, one engine per class,
    each running its stages as the TorchScript traces it took at start-up (``cpu_traces``, the default)."""
    spec = get_spec("bert-mini", "eager")
    settings = {**DVABATCH_TEST_SETTINGS, "cpu_traces": True}
    options = ServingOptions(handler="dvabatch", handler_settings=tuple(settings.items()), token_lengths=(16, 64))
    built = build_archive(spec, tmp_path, options)
    target = model_store_dir / "bert-mini_eager-dvabatch-lengths.mar"  # apart from the session's DVABatch archive
    shutil.copy(built, target)
    model = "dvabatch-lengths"
    torchserve.management().register(target.name, model_name=model, initial_workers=1)
    try:
        rows = [{"body": token_ids_json(spec, n, seed=n)} for n in (3, 17, 64, spec.seq_len, 40, 9, 65, 16)]
        answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [r["body"] for r in rows] + [b""])
        assert [status for status, _ in answers] == [200] * len(rows) + [400], answers
        assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers[: len(rows)]])
        lines = torchserve.model_log_lines(model, timeout_s=0)
        assert any("3 input layout(s)" in line for line in lines), "not 3 length classes"
        # Each class's engine traced its stages on the lane at start-up: at least buckets 1 and 2 of both
        # stages, which pad nothing and are kept untimed.
        traced = [int(m[1]) for line in lines if (m := re.search(r"DVABatch: (\d+) of \d+ \(stage, batch", line))]
        assert len(traced) == 3 and min(traced) >= 4, traced
    finally:
        torchserve.management().unregister(model)


def test_unet_masks_through_the_stages_inside_torchserve(torchserve, model_store_dir, tmp_path):
    """The catalog's UNet: a cut that hands the decoder's skips across, answers that are per-pixel masks."""
    spec = get_spec("unet", "eager")
    options = ServingOptions(handler="dvabatch", handler_settings=tuple(DVABATCH_TEST_SETTINGS.items()))
    target = model_store_dir / "unet_eager-dvabatch.mar"
    if not target.exists():
        shutil.copy(build_archive(spec, tmp_path, options), target)
    model = "dvabatch-unet"
    torchserve.management().register(target.name, model_name=model, initial_workers=1)
    try:
        rows = [{"body": png_bytes(seed=400 + i) if i % 2 else image_tensor_json(spec, seed=400 + i)} for i in range(6)]
        wrong_shape = image_tensor_json(get_spec("resnet50"), seed=1)  # [3, 224, 224] where UNet takes 128 × 128
        answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [r["body"] for r in rows] + [wrong_shape])
        assert [status for status, _ in answers] == [200] * len(rows) + [400], answers
        bodies = [json.loads(body) for _, body in answers[: len(rows)]]
        assert all(len(b["mask"]) == spec.image_shape[1] for b in bodies)
        assert_matches_reference(spec, rows, bodies)
    finally:
        torchserve.management().unregister(model)
