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
import logging
import random
import re
import shutil
import socket
import threading
import time
import zipfile
from pathlib import Path

import aiohttp
import pytest

from archiver.build import build_archive
from archiver.options import ServingOptions, model_config
from bench.ts_frames import Request, inference_frame, read_answer_frame, read_answers, torchserve_service
from handlers.runtime.worker_pump import LEAN, TORCHSERVE, WorkerPump, parse_worker_pump
from model_store.catalog import get_spec
from model_store.samples import image_tensor_json, jpeg_bytes
from tests.conftest import EBIRD_TEST_SETTINGS
from tests.frontend_heap import requests_held
from tests.serving.test_ebird_serving import archive_config, post_all, registered_apart, serve_good_and_bad, worker_log

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


async def echo_or_refuse(data, context):
    """Answers each row with its request id, after a random pause (so messages interleave); b"bad": 400."""
    await asyncio.sleep(random.uniform(0, 0.02))
    answers = []
    for index, row in enumerate(data):
        if row["body"] == b"bad":
            context.set_response_status(400, "refused", index)
        if row["body"] == b"boom":
            raise ValueError("the handler broke")
        if row["body"] == b"began":  # as a handler that has sent this request's stream a part already
            context.set_response_header(index, "ts_stream_next", "true")
        answers.append(json.dumps({"id": context.get_request_id(index)}))
    return answers


class PumpUnderTest:
    """A ``WorkerPump`` on its own thread, serving one end of a socket pair; the test is the frontend."""

    def __init__(self, read_gate=None) -> None:
        self.frontend, worker = socket.socketpair()
        self.frontend.settimeout(30)
        self.pump = WorkerPump(torchserve_service(echo_or_refuse, worker, "/nonexistent"), read_gate)
        self.result: list[str | None] = []
        self.thread = threading.Thread(target=lambda: self.result.append(self.pump.run()), daemon=True)
        self.thread.start()

    def send(self, *requests: Request) -> None:
        self.frontend.sendall(inference_frame(list(requests)))

    def answers(self, requests: int) -> dict[str, tuple]:
        """The next ``requests`` answers as clients get them, by request id: (frame code, status, phrase, body)."""
        out = {}
        for code, answer in read_answers(self.frontend, requests):
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


def test_an_answer_goes_as_a_one_part_stream_and_an_error_answer_whole_then_its_end():
    """TorchServe's frontend forgets a request only at a stream's end, and closes the connection after an
    error's status line (so an error streamed would lose its body): the frames as the frontend reads them.
    An error goes whole, then an empty end lets the frontend forget it; a stream its handler began is
    ended with the answer."""
    pump = PumpUnderTest()
    pump.send(Request("ok", b"fine"), Request("bad", b"bad"), Request("began", b"began"))
    frames = [read_answer_frame(pump.frontend) for _ in range(4)]
    got = [(a.request_id, a.status, a.headers.get("ts_stream_next"), a.body) for *_, part in frames for a in part]
    assert got == [
        ("bad", 400, None, b'{"id": "bad"}'),
        ("began", 200, "false", b'{"id": "began"}'),  # the end of the stream its handler began
        ("bad", 400, "false", b""),  # the error's end, after it
        ("ok", 200, "true", b'{"id": "ok"}'),
        ("ok", 200, "false", b""),
    ]
    pump.frontend.close()


def test_a_failing_handler_answers_503_for_each_request_of_its_message_and_the_pump_serves_on():
    """The failure is each request's own status in a frame whose code is 200: TorchServe's async
    frontend fails every request it holds for the worker on a frame coded otherwise."""
    pump = PumpUnderTest()
    pump.send(Request("broken", b"boom"), Request("beside", b"fine"))
    answers = pump.answers(2)
    for request_id in ("broken", "beside"):  # the message's requests, both
        code, status, phrase, body = answers[request_id]
        assert (code, status, phrase) == (200, 503, "Prediction failed")
        assert json.loads(body)["message"] == "Prediction failed"
    pump.send(Request("after", b"fine"))
    assert pump.answers(1)["after"][:2] == (200, 200)
    pump.frontend.close()


def test_a_message_that_cannot_be_read_gets_a_503_for_each_request_id_it_names_in_a_frame_coded_200():
    """A row whose request id can be read is answered 503 alone, whatever its place in the message;
    a row without one cannot be answered (the frontend times it out), and does not stop the others."""
    pump = PumpUnderTest()
    response = pump.pump._failure_response([{"requestId": b"first"}, {"no id": b""}, {"requestId": b"third"}])
    reader, writer = socket.socketpair()
    writer.sendall(response)
    reader.settimeout(5)
    answers = {answer.request_id: (code, answer.status, answer.phrase) for code, answer in read_answers(reader, 2)}
    assert answers == {"first": (200, 503, "Prediction failed"), "third": (200, 503, "Prediction failed")}
    assert pump.pump._failure_response([{"no id": b""}]) is None
    pump.frontend.close()


def test_the_pump_ends_cleanly_when_the_frontend_disconnects():
    pump = PumpUnderTest()
    pump.send(Request("only", b"fine"))
    assert "only" in pump.answers(1)
    pump.frontend.close()
    pump.thread.join(timeout=10)
    assert not pump.thread.is_alive()
    assert pump.result == [None]  # as TorchServe's pump: no error, the worker's server loop decides what next


def test_with_a_read_gate_a_waiting_message_is_read_only_once_the_gate_opens():
    open_ = threading.Event()
    gate_calls = []

    def gate():
        gate_calls.append(time.monotonic())
        open_.wait()

    pump = PumpUnderTest(read_gate=gate)
    pump.send(Request("held", b"fine"))
    pump.frontend.settimeout(0.3)
    with pytest.raises(TimeoutError):
        pump.answers(1)  # read only through the gate, which is shut
    assert len(gate_calls) == 1  # the reader waited for the message first, then at the gate
    pump.frontend.settimeout(30)
    open_.set()
    assert pump.answers(1)["held"][:2] == (200, 200)
    pump.send(Request("next", b"fine"), Request("bad", b"bad"))
    answers = pump.answers(2)
    assert answers["next"][:2] == (200, 200) and answers["bad"][1] == 400
    assert len(gate_calls) == 2
    pump.frontend.close()
    pump.thread.join(timeout=10)
    assert pump.result == [None]


class BurstEcho:
    """An entry point with ``serve_burst``, as the async handlers have: it records each burst's size."""

    def __init__(self) -> None:
        self.bursts: list[int] = []

    async def handle(self, data, context):
        return await echo_or_refuse(data, context)

    def serve_burst(self, calls, done):
        self.bursts.append(len(calls))
        if any(data[0]["body"] == b"crash" for data, _ in calls):
            done(0, [json.dumps({"id": calls[0][1].get_request_id(0)})])
            raise RuntimeError("the handler broke mid-burst")
        for index, (data, context) in enumerate(reversed(calls)):  # answered in any order
            done(len(calls) - 1 - index, [json.dumps({"id": context.get_request_id(0)}) for _ in data])


def test_messages_waiting_together_reach_serve_burst_in_one_call_each_answered(caplog):
    caplog.set_level(logging.INFO, logger="ts.metrics.caching_metric")
    open_ = threading.Event()
    entry = BurstEcho()
    frontend, worker = socket.socketpair()
    frontend.settimeout(30)
    pump = WorkerPump(torchserve_service(entry.handle, worker, "/nonexistent"), open_.wait)
    threading.Thread(target=pump.run, daemon=True).start()
    under_test = PumpUnderTest.__new__(PumpUnderTest)
    under_test.frontend = frontend
    ids = [f"req-{i}" for i in range(10)]
    for request_id in ids:  # all waiting in the socket before the gate opens
        under_test.send(Request(request_id, b"x" * 100))
    time.sleep(0.2)
    open_.set()
    answers = under_test.answers(len(ids))
    assert sorted(answers) == sorted(ids)
    assert all(json.loads(answer[3]) == {"id": request_id} for request_id, answer in answers.items())
    assert entry.bursts == [10]

    # Answered in one turn of the loop: one PredictionTime line, as the sync worker logs one per batch.
    def prediction_times() -> int:
        return sum("[METRICS]PredictionTime" in record.getMessage() for record in caplog.records)

    deadline = time.monotonic() + 5
    while not prediction_times():
        assert time.monotonic() < deadline, "no PredictionTime recorded"
        time.sleep(0.05)
    time.sleep(0.2)
    assert prediction_times() == 1
    # A handler that fails mid-burst: what it answered stands, the rest get 503, and the pump serves on.
    open_.clear()
    for request in (Request("first", b"crash"), Request("second", b"x"), Request("third", b"x")):
        under_test.send(request)
    time.sleep(0.2)
    open_.set()
    answers = under_test.answers(3)
    assert entry.bursts[-1] == 3
    assert answers["first"][:2] == (200, 200)
    assert answers["second"][:2] == (200, 503) and answers["third"][:2] == (200, 503)  # their own 503s
    under_test.send(Request("after", b"x"))
    assert under_test.answers(1)["after"][:2] == (200, 200)
    frontend.close()


@pytest.mark.torchserve
def test_the_lean_pump_serves_the_default_archive_without_torchserve_per_message_print(served, torchserve):
    model = served("resnet50", "eager", "ebird")
    serve_good_and_bad(torchserve, model, good=7)
    log = worker_log(torchserve, model)
    assert any("the lean message pump" in line for line in log), log[-20:]
    assert not [line for line in log if "_entry_point=" in line]


def post_good(torchserve, model: str, count: int) -> None:
    spec = get_spec("resnet50", "eager")
    bodies = [jpeg_bytes(seed=i) if i % 2 else image_tensor_json(spec, seed=i) for i in range(count)]
    answers = post_all(f"{torchserve.inference_url}/predictions/{model}", bodies)
    assert [status for status, _ in answers] == [200] * count


@pytest.fixture(scope="module")
def ts_pumped(torchserve, model_store_dir, tmp_path_factory):
    """The Ebird archive on TorchServe's own pump (``worker_pump: torchserve``), registered once for the
    tests that read it: (model name, archive path)."""
    options = ServingOptions(handler="ebird", handler_settings=EBIRD, worker_pump="torchserve")
    built_in = tmp_path_factory.mktemp("ts-pump")
    with registered_apart(torchserve, model_store_dir, built_in, options, "ebird-tspump") as archive:
        yield "ebird-tspump", archive


@pytest.mark.torchserve
def test_the_frontend_forgets_each_answered_request_with_either_pump(served, torchserve, ts_pumped):
    """TorchServe 0.12's async frontend drops a request from its map only at a stream's end; answers sent
    as one-part streams (``worker_pump.framed_final``, ``answered_as_streams``) leave it holding none of
    the requests answered.  Sent plainly, every one of them stayed in its heap for good."""
    lean = served("resnet50", "eager", "ebird")
    for model in (lean, ts_pumped[0]):
        post_good(torchserve, model, 4)  # the worker warm
        before = requests_held(torchserve)
        post_good(torchserve, model, 60)
        assert requests_held(torchserve) - before <= 2, model  # 60 before the fix


@pytest.mark.torchserve
def test_torchserve_pump_when_the_archive_asks_for_it(torchserve, ts_pumped):
    model, archive = ts_pumped
    assert archive_config(archive)["handler"]["worker_pump"] == "torchserve"

    def printed() -> int:
        return sum("_entry_point=" in line for line in worker_log(torchserve, model))

    before = printed()  # the other test may have served this worker already
    sent = serve_good_and_bad(torchserve, model, good=7)
    # TorchServe's pump prints once per message; the lean test above counts none with the same check.
    # The frontend logs a worker's stdout from a thread of its own: give it a moment.
    deadline = time.monotonic() + 10
    while (prints := printed() - before) < sent:
        assert time.monotonic() < deadline, f"{prints} of {sent} messages printed"
        time.sleep(0.2)
    assert any("TorchServe's message pump" in line for line in worker_log(torchserve, model))


@pytest.mark.torchserve
def test_the_frontend_forgets_requests_answered_with_an_error_and_their_clients_get_it_whole(served, torchserve):
    """An error answer goes whole (a streamed one would lose its body: TorchServe closes the connection after
    an error's status line), then an empty end marks its request done, so the frontend holds none of them:
    a client flooding a worker with bad requests must not grow the frontend's heap."""
    model = served("resnet50", "eager", "ebird")
    url = f"{torchserve.inference_url}/predictions/{model}"
    post_good(torchserve, model, 4)  # the worker warm
    before = requests_held(torchserve)
    answers = post_all(url, [b"{not json"] * 30 + [b"\xff\xd8 not a jpeg"] * 30)
    assert [status for status, _ in answers] == [400] * 30 + [415] * 30
    assert all("message" in json.loads(body) for _, body in answers)  # each error's body reached its client
    assert requests_held(torchserve) - before <= 2  # 60 before
    post_good(torchserve, model, 4)  # and it serves on
    # One client on one connection at a time, errors and answers in turn: nothing written for an error's end
    # reaches the next answer's client (TorchServe closes the connection after an error; aiohttp reconnects).
    good = jpeg_bytes(seed=3)
    assert post_in_turn(url, [b"{not json", good, b"{not json", good, good]) == [400, 200, 400, 200, 200]
    assert requests_held(torchserve) - before <= 2


def post_in_turn(url: str, payloads: list[bytes]) -> list[int]:
    """Each payload after the last one's answer, over one client connection at most: the statuses."""

    async def send() -> list[int]:
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as session:
            statuses = []
            for payload in payloads:
                async with session.post(url, data=payload) as resp:
                    await resp.read()
                    statuses.append(resp.status)
            return statuses

    return asyncio.run(send())


CRASHING_ENTRY = '''"""Ebird, except that a message "crash" breaks the handler past its own error answers."""

import logging

from handlers.ebird.handler import EbirdHandler


class CrashingEbird(EbirdHandler):
    def serve_burst(self, calls, done):
        if any(bytes(rows[0].get("body") or b"") == b"crash" for rows, _ in calls):
            logging.getLogger(__name__).warning("crashing with %d request(s) in flight", self.unanswered)
            raise RuntimeError("a handler bug")
        super().serve_burst(calls, done)
'''


def with_entry_module(archive: Path, source: str) -> None:
    """Replace ``archive``'s handler module (the one its manifest names) with ``source``."""
    with zipfile.ZipFile(archive) as mar:
        handler = json.loads(mar.read("MAR-INF/MANIFEST.json"))["model"]["handler"]
        entries = [(info, mar.read(info)) for info in mar.infolist() if info.filename != handler]
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as mar:
        for info, data in entries:
            mar.writestr(info, data)
        mar.writestr(handler, source)


@pytest.mark.torchserve
def test_a_message_the_handler_breaks_on_fails_alone_not_the_requests_in_flight_beside_it(
    torchserve, model_store_dir, tmp_path
):
    """A handler that fails on one message (here: raises from ``serve_burst``) gets its requests answered
    503 each, in a frame whose code is 200: TorchServe's async frontend answers a frame coded 503 by
    failing every request it holds for the worker, so the requests other clients had in flight would
    have failed with it."""
    built = build_archive(
        get_spec("resnet50", "eager"), tmp_path, ServingOptions(handler="ebird", handler_settings=EBIRD)
    )
    with_entry_module(built, CRASHING_ENTRY)
    target = model_store_dir / "resnet50_eager-ebird-crashing.mar"
    shutil.copy(built, target)
    torchserve.management().register(target.name, model_name="ebird-crashing", initial_workers=1)
    try:
        url = f"{torchserve.inference_url}/predictions/ebird-crashing"
        post_good(torchserve, "ebird-crashing", 2)  # the worker warm

        async def neighbours_then_crash() -> tuple[list[tuple[int, str]], tuple[int, str]]:
            async with aiohttp.ClientSession() as session:

                async def post(body: bytes) -> tuple[int, str]:
                    async with session.post(url, data=body) as resp:
                        return resp.status, await resp.text()

                beside = [asyncio.create_task(post(jpeg_bytes(seed=i))) for i in range(16)]
                await asyncio.sleep(0.3)  # admitted and running: 16 ResNet-50 images take seconds on a CPU
                crashed = await post(b"crash")
                return list(await asyncio.gather(*beside)), crashed

        beside, (status, body) = asyncio.run(neighbours_then_crash())
        assert status == 503 and json.loads(body)["message"] == "Prediction failed"
        assert [code for code, _ in beside] == [200] * 16, beside  # each 503 too, framed with code 503
        in_flight = [int(n) for n in re.findall(r"crashing with (\d+) request", "\n".join(
            worker_log(torchserve, "ebird-crashing")))]  # fmt: skip
        assert in_flight and in_flight[-1] >= 1, in_flight  # they were in flight when it broke
        post_good(torchserve, "ebird-crashing", 2)  # and it serves on
    finally:
        torchserve.management().unregister("ebird-crashing")
