"""The lean message pump (``handlers/runtime/worker_pump.py``).

In-process, over a socket pair: TorchServe's own ``Service``, ``Context``,
metrics cache and protocol code on the worker side, the frontend's frames
written by ``bench/ts_frames.py``.  In a real TorchServe: which pump a
worker runs shows in its log, since TorchServe's own prints
``self._entry_point=…`` once per message (``ts/async_service.py``), the lean
one does not, and the handler's start-up line names the pump it installed.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import threading
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from bench.ts_frames import Request, inference_frame, read_answer_frame
from handlers.runtime.worker_pump import LEAN, TORCHSERVE, WorkerPump, parse_worker_pump
from model_store.build import ServingOptions, build_archive, model_config
from model_store.catalog import get_spec
from model_store.samples import image_tensor_json, jpeg_bytes
from tests.conftest import EBIRD_TEST_SETTINGS
from tests.test_ebird_serving import post_all
from tests.test_serving import assert_matches_reference

EBIRD = tuple(sorted(EBIRD_TEST_SETTINGS.items()))


def test_the_setting_defaults_to_lean_and_refuses_unknown_pumps():
    assert parse_worker_pump(None) == LEAN
    assert parse_worker_pump("torchserve") == TORCHSERVE
    with pytest.raises(ValueError, match="worker_pump must be one of lean, torchserve"):
        parse_worker_pump("fast")


def test_archives_carry_the_setting_only_for_handlers_that_have_the_pump():
    spec = get_spec("resnet50", "eager")
    config = model_config(spec, ServingOptions(handler="ebird", handler_settings=EBIRD, worker_pump="torchserve"))
    assert config["handler"]["worker_pump"] == "torchserve"
    assert "worker_pump" not in model_config(spec, ServingOptions(handler="ebird", handler_settings=EBIRD))["handler"]
    for handler in ("packrat", "nimble", "orca"):  # sync handlers have no async worker; Orca streams its answers
        with pytest.raises(ValueError, match="worker_pump applies to the scheduling async handlers"):
            ServingOptions(handler=handler, worker_pump="lean")
    with pytest.raises(ValueError, match="worker_pump must be one of"):
        ServingOptions(handler="ebird", worker_pump="fast")


def torchserve_service(entry_point, cl_socket: socket.socket):
    """TorchServe's own ``Service`` around ``entry_point``, with the metrics cache its worker builds."""
    import ts
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
    from ts.service import Service

    metrics = MetricsCacheYamlImpl(config_file_path=str(Path(ts.__file__).parent / "configs" / "metrics.yaml"))
    metrics.initialize_cache()
    metrics.model_name = "pumped"
    service = Service("pumped", "/nonexistent", None, entry_point, None, 1, True, metrics)
    service.set_cl_socket(cl_socket)
    return service


async def echo_or_refuse(data, context):
    """Answers each row with its request id, after a random pause (so messages interleave); b"bad": 400."""
    await asyncio.sleep(random.uniform(0, 0.02))
    answers = []
    for index, row in enumerate(data):
        if row["body"] == b"bad":
            context.set_response_status(400, "refused", index)
        if row["body"] == b"boom":
            raise ValueError("the handler broke")
        answers.append(json.dumps({"id": context.get_request_id(index)}))
    return answers


class PumpUnderTest:
    """A ``WorkerPump`` on its own thread, serving one end of a socket pair; the test is the frontend."""

    def __init__(self) -> None:
        self.frontend, worker = socket.socketpair()
        self.frontend.settimeout(30)
        self.pump = WorkerPump(torchserve_service(echo_or_refuse, worker))
        self.result: list[str | None] = []
        self.thread = threading.Thread(target=lambda: self.result.append(self.pump.run()), daemon=True)
        self.thread.start()

    def send(self, *requests: Request) -> None:
        self.frontend.sendall(inference_frame(list(requests)))

    def answers(self, messages: int) -> dict[str, tuple]:
        """The next ``messages`` answer frames, by request id: (frame code, status, phrase, body)."""
        out = {}
        for _ in range(messages):
            code, _, answers = read_answer_frame(self.frontend)
            for answer in answers:
                assert answer.request_id not in out, f"{answer.request_id} answered twice"
                out[answer.request_id] = (code, answer.status, answer.phrase, answer.body)
        return out


def test_interleaved_messages_each_get_their_own_answer_and_status():
    pump = PumpUnderTest()
    ids = [f"req-{i}" for i in range(40)]
    for i, request_id in enumerate(ids):  # the frontend's async mode: one request per message
        pump.send(Request(request_id, b"bad" if i % 5 == 0 else b"x" * 1000, headers=(("X-Seq", str(i)),)))
    answers = pump.answers(len(ids))
    assert sorted(answers) == sorted(ids)
    for i, request_id in enumerate(ids):
        code, status, phrase, body = answers[request_id]
        assert code == 200
        # A status set for one message's request must not leak into another's (a shared context would).
        assert (status, phrase) == ((400, "refused") if i % 5 == 0 else (200, ""))
        assert json.loads(body) == {"id": request_id}
    pump.frontend.close()


def test_a_failing_handler_answers_503_for_its_message_and_the_pump_serves_on():
    pump = PumpUnderTest()
    pump.send(Request("broken", b"boom"))
    assert pump.answers(1) == {"broken": (503, 503, "", b"error")}
    pump.send(Request("after", b"fine"))
    assert pump.answers(1)["after"][:2] == (200, 200)
    pump.frontend.close()


def test_the_pump_ends_cleanly_when_the_frontend_disconnects():
    pump = PumpUnderTest()
    pump.send(Request("only", b"fine"))
    assert "only" in pump.answers(1)
    pump.frontend.close()
    pump.thread.join(timeout=10)
    assert not pump.thread.is_alive()
    assert pump.result == [None]  # as TorchServe's pump: no error, the worker's server loop decides what next


def worker_log(torchserve, model: str) -> list[str]:
    """The model log's lines from ``model``'s workers (TorchServe names each line's thread after the model)."""
    lines = (torchserve.log_dir / "model_log.log").read_text(errors="replace").splitlines()
    return [line for line in lines if f"-{model}_" in line]


def serve_and_check(torchserve, model: str) -> int:
    """Good and bad requests at once through ``model``: each gets its own answer. Returns how many were sent."""
    spec = get_spec("resnet50", "eager")
    rows = [{"body": jpeg_bytes(seed=i) if i % 2 else image_tensor_json(spec, seed=i)} for i in range(7)]
    bad = [b"{not json", {"data": [[[0.0] * 8] * 8] * 3}]
    answers = post_all(f"{torchserve.inference_url}/predictions/{model}", [r["body"] for r in rows] + bad)
    assert [status for status, _ in answers] == [200] * len(rows) + [400, 400], answers
    assert_matches_reference(spec, rows, [json.loads(body) for _, body in answers[: len(rows)]])
    assert "malformed JSON" in json.loads(answers[-2][1])["message"]
    return len(answers)


@pytest.mark.torchserve
def test_the_lean_pump_serves_the_default_archive_without_torchserve_per_message_print(served, torchserve):
    model = served("resnet50", "eager", "ebird")
    serve_and_check(torchserve, model)
    log = worker_log(torchserve, model)
    assert any("the lean message pump" in line for line in log), log[-20:]
    assert not [line for line in log if "_entry_point=" in line]


@pytest.mark.torchserve
def test_torchserve_pump_when_the_archive_asks_for_it(torchserve, model_store_dir, tmp_path):
    spec = get_spec("resnet50", "eager")
    built = build_archive(
        spec, tmp_path, ServingOptions(handler="ebird", handler_settings=EBIRD, worker_pump="torchserve")
    )
    target = model_store_dir / "resnet50_eager-ebird-tspump.mar"  # same archive name as the session's Ebird
    shutil.copy(built, target)
    with zipfile.ZipFile(target) as mar:
        assert yaml.safe_load(mar.read("model-config.yaml"))["handler"]["worker_pump"] == "torchserve"
    model = "ebird-tspump"
    torchserve.management().register(target.name, model_name=model, initial_workers=1)
    try:
        sent = serve_and_check(torchserve, model)
        # TorchServe's pump prints once per message; the lean test above counts none with the same check.
        # The frontend logs a worker's stdout from a thread of its own: give it a moment.
        deadline = time.monotonic() + 10
        while len(prints := [line for line in worker_log(torchserve, model) if "_entry_point=" in line]) < sent:
            assert time.monotonic() < deadline, f"{len(prints)} of {sent} messages printed"
            time.sleep(0.2)
        assert any("TorchServe's message pump" in line for line in worker_log(torchserve, model))
    finally:
        torchserve.management().unregister(model)
