"""REEF served by a real TorchServe: two models in one worker, routed and prioritised by request headers."""

from __future__ import annotations

import asyncio
import json
import time
import zipfile

import aiohttp
import pytest
import yaml

from archiver.build import build_group_archive
from archiver.options import ServingOptions
from model_store.catalog import get_spec
from model_store.samples import image_tensor_json, jpeg_bytes, png_bytes
from tests.metrics_endpoint import handler_metric
from tests.serving.test_serving import assert_matches_reference

pytestmark = pytest.mark.torchserve

# ResNet-50 real-time by default, the UNet best-effort; small batches for 2 cores.
REEF_TEST_SETTINGS = {"realtime": ["resnet50"], "segments": 3, "rt_max_batch": 2, "be_max_batch": 4}
MODEL = "reef-group"


def options(**settings) -> ServingOptions:
    return ServingOptions(handler="reef", handler_settings=tuple({**REEF_TEST_SETTINGS, **settings}.items()))


@pytest.fixture(scope="module")
def reef(torchserve, model_store_dir):
    path = build_group_archive([get_spec("resnet50"), get_spec("unet")], model_store_dir, options())
    torchserve.management().register(path.name, model_name=MODEL, initial_workers=1)
    yield path
    torchserve.management().unregister(MODEL)


def post(url: str, sends: list[tuple[float, object, dict[str, str]]]) -> list[tuple[int, str]]:
    """Each (delay s, payload, headers) POSTed ``delay`` after the start, all concurrently; (status, body) in order."""

    async def send() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:

            async def one(delay: float, payload: object, headers: dict[str, str]) -> tuple[int, str]:
                await asyncio.sleep(delay)
                data = json.dumps(payload).encode() if isinstance(payload, dict) else payload
                async with session.post(url, data=data, headers=headers) as resp:
                    return resp.status, await resp.text()

            return list(await asyncio.gather(*(one(*s) for s in sends)))

    return asyncio.run(send())


def test_a_reef_archive_carries_every_model_and_refuses_what_it_cannot_serve(reef, tmp_path):
    with zipfile.ZipFile(reef) as mar:
        names = set(mar.namelist())
        config = yaml.safe_load(mar.read("model-config.yaml"))
    assert {"weights-resnet50.pt", "weights-unet.pt", "reef_handler.py"} <= names
    assert config["asyncCommunication"] is True and config["handler"]["reef"] == REEF_TEST_SETTINGS
    assert [m["spec"]["name"] for m in config["handler"]["members"]] == ["resnet50", "unet"]
    with pytest.raises(ValueError, match="eager"):
        build_group_archive([get_spec("resnet50", "script")], tmp_path, options())
    with pytest.raises(ValueError, match="does not serve"):
        build_group_archive([get_spec("unet")], tmp_path, options())  # realtime names resnet50
    with pytest.raises(ValueError, match="distinct"):
        build_group_archive([get_spec("unet")] * 2, tmp_path, options(realtime=[]))
    with pytest.raises(ValueError, match="no CPU lanes"):
        ServingOptions(handler="reef", decode_threads="lane")


def test_bad_routing_gets_its_own_4xx_while_the_rest_is_served(reef, torchserve):
    url = f"{torchserve.inference_url}/predictions/{MODEL}"
    resnet, unet = get_spec("resnet50"), get_spec("unet")
    good = [
        ({"body": image_tensor_json(resnet, seed=1)}, {"X-Model": "resnet50"}),
        ({"body": png_bytes(seed=2)}, {"X-Model": "unet", "X-Priority": "realtime"}),
        ({"body": jpeg_bytes(seed=3)}, {"x-model": "resnet50", "x-priority": "best-effort"}),
    ]
    bad = [
        (jpeg_bytes(seed=4), {"X-Model": "resnet50", "X-Priority": "urgent"}, 400),
        (jpeg_bytes(seed=5), {"X-Model": "vgg19"}, 404),
        (jpeg_bytes(seed=6), {}, 400),  # two models: the request must name one
        (b"{not json", {"X-Model": "unet"}, 400),
        (image_tensor_json(resnet, seed=7), {"X-Model": "unet"}, 400),  # ResNet's shape sent to the UNet
    ]
    sends = [(0.0, row["body"], h) for row, h in good[:2]] + [(0.0, p, h) for p, h, _ in bad]
    sends += [(0.0, good[2][0]["body"], good[2][1])]
    answers = post(url, sends)
    statuses = [status for status, _ in answers]
    assert statuses == [200, 200] + [code for _, _, code in bad] + [200], answers
    assert "unknown X-Priority 'urgent'" in answers[2][1] and "unknown model 'vgg19'" in answers[3][1]
    assert_matches_reference(resnet, [good[0][0], good[2][0]], [json.loads(answers[0][1]), json.loads(answers[-1][1])])
    assert_matches_reference(unet, [good[1][0]], [json.loads(answers[1][1])])


def test_a_real_time_burst_during_best_effort_load_preempts_it_and_nothing_is_lost(reef, torchserve):
    url = f"{torchserve.inference_url}/predictions/{MODEL}"
    resnet, unet = get_spec("resnet50"), get_spec("unet")
    be_rows = [{"body": png_bytes(seed=100 + i)} for i in range(24)]  # best-effort by the archive's default
    rt_rows = [{"body": jpeg_bytes(seed=200 + i)} for i in range(4)]  # real-time by the archive's default
    sends = [(0.0, r["body"], {"X-Model": "unet"}) for r in be_rows]
    sends += [(0.4 * (i + 1), r["body"], {"X-Model": "resnet50"}) for i, r in enumerate(rt_rows)]
    answers = post(url, sends)
    assert [status for status, _ in answers] == [200] * len(sends), answers
    bodies = [json.loads(body) for _, body in answers]
    assert_matches_reference(unet, be_rows, bodies[: len(be_rows)])  # every BE result right after preemptions
    assert_matches_reference(resnet, rt_rows, bodies[len(be_rows) :])

    def counted() -> tuple[dict[str, float], list[float]]:
        operations = {labels["Operation"]: n for labels, n in handler_metric(torchserve, "HandlerOperations", MODEL)}
        waits = [n for _, n in handler_metric(torchserve, "HandlerPreemptionSeconds_count", MODEL)]
        return operations, waits

    deadline = time.monotonic() + 10.0  # the handler's metrics reach TorchServe once a second
    operations, waits = counted()
    while (waits != [operations.get("preempt")] or "resume" not in operations) and time.monotonic() < deadline:
        time.sleep(0.2)
        operations, waits = counted()
    assert operations.get("preempt", 0) >= 1 and operations.get("resume", 0) >= 1, operations
    assert waits == [operations["preempt"]]  # one preemption latency observed per preemption
