"""The Ebird handler object driven directly, as TorchServe's worker drives it.

Runs on CPU everywhere and on CUDA where a GPU is present (the GPU machine
has no Java, so this is how the device path is tested: pool on the device,
copy stream and per-slot events, a stream per worker, results equal to the
model's direct output).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import pytest
import torch

from archiver.options import ServingOptions, model_config
from bench.direct import call, load_context, model_dir_for
from handlers.ebird.config import EbirdConfig, EbirdConfigError
from handlers.ebird.handler import EbirdHandler
from handlers.ebird.scheduler import lane_batch_cap
from handlers.runtime.decode import default_decode_placement
from model_store.catalog import get_spec
from model_store.factory import outputs_close
from model_store.samples import image_tensor_json, jpeg_bytes
from tests.payloads import reference_logits

SPEC = get_spec("resnet50", "eager")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return model_dir_for(SPEC, tmp_path_factory.mktemp("resnet50-direct"))


@pytest.fixture
def make_handler(model_dir, keep_handlers):
    def make(
        device: str = "cpu",
        response_timeout_s: int = 120,
        input_shapes=None,
        decode_threads=None,
        encode_answers=None,
        **settings,
    ):
        options = ServingOptions(handler="ebird", handler_settings=tuple(sorted(settings.items())))
        ctx = load_context(SPEC, model_dir, options, gpu=0 if device == "cuda" else None)
        if decode_threads is not None:  # written raw, so the handler's own validation is what is tested
            ctx.model_yaml_config["handler"]["decode_threads"] = decode_threads
        if encode_answers is not None:
            ctx.model_yaml_config["handler"]["encode_answers"] = encode_answers
        ctx.model_yaml_config["responseTimeout"] = response_timeout_s
        if input_shapes:
            ctx.model_yaml_config["handler"]["input_shapes"] = input_shapes
        handler = keep_handlers(EbirdHandler())
        handler.initialize(ctx)
        return handler, ctx

    return make


def serve_all(handler, ctx, rows):
    async def main():
        return await asyncio.gather(*(call(handler, ctx, row) for row in rows))

    return asyncio.run(main())


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_every_answer_equals_the_models_direct_output(make_handler, device):
    # The CPU cap is fixed: ``auto`` times each size at warm-up, and on a loaded machine (CI runs four
    # test processes on two cores) batches of 2 and 4 can time no cheaper per input than 1, so the
    # lane rule rightly caps at 1 and no batch forms.  Measured caps are
    # test_on_cpu_the_lane_rule_caps_batches_by_their_measured_cost's subject.
    handler, ctx = make_handler(device, worker_batches=[1, 1, 2, 4], max_inflight=8, pool_slots=8, cpu_batch_cap=4)
    assert handler.device.device.type == device
    assert handler.engines[((3, 224, 224),)].pool.storage[0].device.type == device
    rows = [{"body": jpeg_bytes(seed=i) if i % 2 else image_tensor_json(SPEC, seed=i)} for i in range(11)]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * len(rows), answers
    expected = reference_logits(SPEC, rows)
    tol = 1e-4 if device == "cpu" else 1e-2  # cuDNN/TF32 kernels differ from the CPU reference
    for (_, body), row in zip(answers, expected, strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, tol)
    snap = handler.metrics.snapshot()
    assert snap["requests_batched"] == len(rows) and snap["inflight"] == 0
    # Every answered request is broken down into the runtime's stages (issue 9's breakdown).
    stages = snap["stage_mean_ms"]
    assert list(stages) == ["decode", "admission", "queue", "batch", "release", "wakeup", "encode"]
    assert all(handler.metrics.stage_counts[stage] == len(rows) for stage in stages)
    assert stages["batch"] > 0 and stages["decode"] > 0 and min(stages.values()) >= 0
    # Where a batch outlasts a decode (CPU) a queue forms behind it and must be batched; where it
    # does not (an H100 runs one image in less time than the next one takes to decode) no queue
    # forms, and Ebird, which never waits for a fuller batch, rightly runs each request as it comes.
    if stages["batch"] > stages["decode"]:
        assert max(snap["batches"]) > 1, (stages, snap["batches"])


def test_bad_requests_fail_alone_with_their_4xx(make_handler):
    handler, ctx = make_handler(worker_batches=[1, 1, 2], pool_slots=4)
    rows = [
        {"body": jpeg_bytes(seed=1)},
        {"body": b"{not json"},
        {"body": {"data": [[[0.0] * 8] * 8] * 3}},
        {"body": jpeg_bytes(seed=2)},
    ]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200, 400, 400, 200]
    assert "malformed JSON" in json.loads(answers[1][1])["message"]
    assert "wrong tensor shape [3, 8, 8]" in json.loads(answers[2][1])["message"]


@pytest.mark.slow
def test_decoding_on_a_pool_answers_as_inline_and_keeps_each_4xx(make_handler):
    handler, ctx = make_handler(decode_threads=2, worker_batches=[1, 1, 2, 4], pool_slots=8)
    assert handler.decoder.threads == 2
    decoded_on = []
    decode = handler.decoder._decode

    def recording_decode(row):
        decoded_on.append(threading.current_thread().name)
        return decode(row)

    handler.decoder._decode = recording_decode
    good = [{"body": jpeg_bytes(seed=i)} for i in range(6)]
    rows = [*good[:3], {"body": b"{not json"}, {"body": {"data": [[[0.0] * 8] * 8] * 3}}, *good[3:]]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200, 200, 200, 400, 400, 200, 200, 200]
    assert "malformed JSON" in json.loads(answers[3][1])["message"]
    for (_, body), row in zip([a for a in answers if a[0] == 200], reference_logits(SPEC, good), strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-4)
    assert len(decoded_on) == len(rows) and all(name.startswith("decode") for name in decoded_on)


class Intervals:
    """Wraps a callable and records on which thread and when each call ran."""

    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __call__(self, *args):
        started = time.monotonic()
        try:
            return self.fn(*args)
        finally:
            self.log.append((threading.current_thread().name, started, time.monotonic()))


def serve_recording(handler, ctx, good: int):
    """Serve ``good`` JPEGs and one malformed row with the engine's model wrapped in ``Intervals``.

    Checks every answer (the logits, the 400); returns the batches' intervals.
    """
    batches = []
    engine = handler.engines[((3, 224, 224),)]
    engine.model = Intervals(engine.model, batches)
    rows = [{"body": jpeg_bytes(seed=i)} for i in range(good)] + [{"body": b"{not json"}]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * good + [400]
    for (_, body), row in zip(answers, reference_logits(SPEC, rows[:good]), strict=False):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-4)
    assert batches
    return batches


def assert_none_overlaps(calls, batches, what: str) -> None:
    for _, c0, c1 in calls:
        assert all(c1 <= b0 or b1 <= c0 for _, b0, b1 in batches), f"{what} overlapped a batch"


@pytest.mark.slow
def test_on_cpu_requests_are_decoded_on_the_lane_between_batches(make_handler):
    """The CPU default: a decode never overlaps a batch on the same cores (it would stall the batch's team)."""
    handler, ctx = make_handler(worker_batches=[1, 1, 2, 4], pool_slots=8)
    assert handler.lanes.count == 1 and handler.decoder.where == "on the CPU lanes"
    decodes = []
    handler.decoder._decode = Intervals(handler.decoder._decode, decodes)
    batches = serve_recording(handler, ctx, good=6)
    assert len(decodes) == 7  # the malformed row too
    assert {name for name, _, _ in decodes + batches} == {"lane_0"}
    assert_none_overlaps(decodes, batches, "a decode")


@pytest.mark.slow
def test_on_cpu_answers_are_encoded_on_the_lane_after_their_batch_before_the_next(make_handler):
    """The CPU default: a batch's answers are encoded on its lane before the lane takes its next job,
    so the JSON never runs beside a batch (as the sync worker encodes before reading more)."""
    handler, ctx = make_handler(worker_batches=[1, 1, 2, 4], pool_slots=8)
    assert handler.encode_on_engine
    encodes = []
    handler.postprocess = Intervals(handler.postprocess, encodes)
    batches = serve_recording(handler, ctx, good=7)
    assert len(encodes) == 7 and {name for name, _, _ in encodes} == {"lane_0"}
    assert_none_overlaps(encodes, batches, "an encode")
    # Each answer's encoding is counted as its encode stage, not as the engine's release.
    stages = handler.metrics.snapshot()["stage_mean_ms"]
    assert stages["encode"] >= 1000 * min(e1 - e0 for _, e0, e1 in encodes) > 0


@pytest.mark.slow
def test_encoding_answers_on_the_event_loop_is_a_choice_and_answers_the_same(make_handler):
    handler, ctx = make_handler(encode_answers="loop", worker_batches=[1, 2], pool_slots=4)
    assert not handler.encode_on_engine
    encodes = []
    handler.postprocess = Intervals(handler.postprocess, encodes)
    rows = [{"body": jpeg_bytes(seed=i)} for i in range(3)]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * 3
    for (_, body), row in zip(answers, reference_logits(SPEC, rows), strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-4)
    assert {name for name, _, _ in encodes} == {threading.current_thread().name}


@pytest.mark.slow
def test_an_answer_that_cannot_be_encoded_fails_alone_with_a_503(make_handler):
    handler, ctx = make_handler(worker_batches=[1, 1, 2], pool_slots=4)
    postprocess = handler.postprocess
    calls = []

    def fails_once(output):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise ValueError("cannot encode this one")
        return postprocess(output)

    handler.postprocess = fails_once
    answers = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=1)}])
    [(status, body)] = answers
    assert status == 503 and "could not encode the answer: ValueError" in json.loads(body)["message"]
    answers = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=i)} for i in range(3)])
    assert [status for status, _ in answers] == [200] * 3 and set(calls) == {"lane_0"}


@pytest.mark.parametrize("value", ["lane", 1, True])
def test_bad_encode_answers_fail_the_load_with_a_reason(make_handler, value):
    with pytest.raises(ValueError, match="encode_answers must be 'engine', 'loop' or 'auto'"):
        make_handler(encode_answers=value, worker_batches=[1, 2], pool_slots=4)


def test_encode_answers_is_a_scheduling_async_handlers_setting():
    assert model_config(SPEC, ServingOptions(handler="ebird", encode_answers="loop"))["handler"]["encode_answers"] == (
        "loop"
    )
    assert "encode_answers" not in model_config(SPEC, ServingOptions(handler="ebird"))["handler"]
    for handler in ("packrat", "orca"):
        with pytest.raises(ValueError, match="encode_answers applies to the scheduling async handlers"):
            ServingOptions(handler=handler, encode_answers="engine")
    with pytest.raises(ValueError, match="encode_answers must be"):
        ServingOptions(handler="ebird", encode_answers="lane")


@pytest.mark.slow
@pytest.mark.parametrize("quiet", [True, False])
def test_on_cpu_the_worker_reads_no_request_while_the_lane_runs_a_batch_unless_told_to(make_handler, quiet):
    """``cpu_quiet_batches`` (default true): the message reader's gate is shut during every batch and open
    between them (a request read then would only queue on the lane behind the batch)."""
    handler, ctx = make_handler(worker_batches=[1, 1, 2], pool_slots=4, cpu_quiet_batches=quiet)
    gate_open_during_batches = []
    engine = handler.engines[((3, 224, 224),)]
    model = engine.model

    def batch(*inputs):
        gate_open_during_batches.append(handler.lanes.wait_for_a_loud_lane(timeout_s=0))
        return model(*inputs)

    engine.model = batch
    answers = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=i)} for i in range(3)])
    assert [status for status, _ in answers] == [200] * 3
    assert gate_open_during_batches and set(gate_open_during_batches) == {not quiet}
    assert handler.lanes.wait_for_a_loud_lane(timeout_s=0)  # between batches it is open


def record_batch_sizes(engine, log, sizes):
    model = engine.model

    def sized(*tensors):
        sizes.append(tensors[0].shape[0])
        return model(*tensors)

    engine.model = Intervals(sized, log)


@pytest.mark.parametrize(
    "rule, expected",
    [
        ({"cpu_batch_cap": 4}, [4, 2]),
        ({"cpu_batch_cap": 2}, [2, 2, 2]),  # one batch per free lane, each at most the cap
        ({"cpu_rule": "plan"}, [4, 2]),
    ],
)
@pytest.mark.slow
def test_on_cpu_a_burst_is_batched_after_its_decodes_not_one_by_one(make_handler, rule, expected):
    """Late binding: a batch handed to the lane while the burst's decodes are queued there would run after
    them anyway, so the engine waits for them and the burst shares its batches (else: a batch of 1 first)."""
    handler, ctx = make_handler(worker_batches=[1, 1, 2, 4], pool_slots=8, **rule)
    decodes, batches, sizes = [], [], []
    handler.decoder._decode = Intervals(handler.decoder._decode, decodes)
    record_batch_sizes(handler.engines[((3, 224, 224),)], batches, sizes)
    rows = [{"body": jpeg_bytes(seed=i)} for i in range(6)]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * 6
    for (_, body), row in zip(answers, reference_logits(SPEC, rows), strict=True):
        assert outputs_close(torch.tensor(body["logits"]), row, 1e-4)
    assert sizes == expected  # in the order they ran: the lane takes the larger batch first
    assert min(b0 for _, b0, _ in batches) >= max(d1 for _, _, d1 in decodes)


@pytest.mark.slow
def test_on_cpu_the_lane_rule_caps_batches_by_their_measured_cost(make_handler, caplog):
    """``cpu_batch_cap: auto``: every worker size is timed on the lane at warm-up, served batches then
    refine their size's cost, and the cap is always the policy's pick from the costs as they stand."""
    with caplog.at_level(logging.INFO, logger="handlers.ebird.engine"):
        handler, ctx = make_handler(worker_batches=[1, 1, 2, 4], pool_slots=8)
    engine = handler.engines[((3, 224, 224),)]
    guessed = engine.costs.per_input_ms()
    assert set(guessed) == {1, 2, 4} and min(guessed.values()) > 0
    assert engine.policy.lane_cap == lane_batch_cap(guessed)
    assert f"of at most {engine.policy.lane_cap}" in caplog.text  # the worker log says what it chose
    batches, sizes = [], []
    record_batch_sizes(engine, batches, sizes)
    for burst in range(3):
        answers = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=10 * burst + i)} for i in range(6)])
        assert [status for status, _ in answers] == [200] * 6
    deadline = time.monotonic() + 10  # a batch's cost is recorded just after its answers
    while sum(engine.costs.served(b) for b in (1, 2, 4)) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.05)
    with engine._cond:
        assert [engine.costs.served(b) for b in (1, 2, 4)] == [sizes.count(b) for b in (1, 2, 4)]
        assert engine.policy.lane_cap == lane_batch_cap(engine.costs.per_input_ms())
    assert sum(sizes) == 18


def test_a_request_refused_while_arriving_releases_the_batch_waiting_for_it(make_handler):
    handler, ctx = make_handler(response_timeout_s=20, worker_batches=[1, 1, 2, 4], pool_slots=8, cpu_batch_cap=4)
    batches, sizes = [], []
    record_batch_sizes(handler.engines[((3, 224, 224),)], batches, sizes)
    rows = [{"body": jpeg_bytes(seed=1)}, {"body": jpeg_bytes(seed=2)}, {"body": b"{not json"}]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200, 200, 400]  # a 503 after 20 s if the hold outlived it
    assert sizes == [2]
    assert len(handler.arrivals) == 0


@pytest.mark.slow
def test_decoding_defaults_to_a_pool_on_cuda_and_inline_is_a_choice(make_handler):
    assert default_decode_placement(is_cuda=True) == min(4, os.cpu_count() or 1)
    assert default_decode_placement(is_cuda=False) == "lane"
    handler, ctx = make_handler(decode_threads=0, worker_batches=[1, 2], pool_slots=4)
    assert handler.decoder.where == "on the event loop"
    [(status, _)] = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=3)}])
    assert status == 200


@pytest.mark.parametrize("value", [-1, "two", True, 1.5])
def test_bad_decode_threads_fail_the_load_with_a_reason(make_handler, value):
    with pytest.raises(ValueError, match="decode_threads must be an integer"):
        make_handler(decode_threads=value, worker_batches=[1, 2], pool_slots=4)


def test_decode_threads_are_an_async_handlers_setting():
    config = model_config(SPEC, ServingOptions(handler="ebird", decode_threads=3))
    assert config["handler"]["decode_threads"] == 3
    assert (
        model_config(SPEC, ServingOptions(handler="ebird", decode_threads="lane"))["handler"]["decode_threads"]
        == "lane"
    )
    assert "decode_threads" not in model_config(SPEC, ServingOptions(handler="ebird"))["handler"]
    with pytest.raises(ValueError, match="applies to async handlers"):
        ServingOptions(decode_threads=2)
    with pytest.raises(ValueError, match="decode_threads must be an integer"):
        ServingOptions(handler="ebird", decode_threads=-2)


@pytest.mark.slow
def test_declared_extra_shape_gets_its_own_pool(make_handler):
    handler, ctx = make_handler(worker_batches=[1, 1, 2], pool_slots=4, input_shapes=[[3, 160, 160]])
    assert set(handler.engines) == {((3, 224, 224),), ((3, 160, 160),)}
    small = {"body": {"data": torch.rand(3, 160, 160).tolist()}}
    [(status, body)] = serve_all(handler, ctx, [small])
    assert status == 200
    with torch.inference_mode():
        expected = handler.model(torch.tensor(small["body"]["data"]).unsqueeze(0))[0]
    assert outputs_close(torch.tensor(body["logits"]), expected, 1e-4)


class _FailsOnce(torch.nn.Module):
    """The model, except that its first batch raises (a device fault, say)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.failed = False

    def forward(self, *inputs):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected fault")
        return self.model(*inputs)


@pytest.mark.slow
def test_a_failed_batch_answers_its_requests_503_and_the_engine_serves_on(make_handler):
    handler, ctx = make_handler(worker_batches=[1, 1, 2], pool_slots=4)
    engine = handler.engines[((3, 224, 224),)]
    engine.model = _FailsOnce(engine.model)
    [(status, body)] = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=1)}])
    assert status == 503 and "injected fault" in json.loads(body)["message"]
    answers = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=i)} for i in range(5)])
    assert [status for status, _ in answers] == [200] * 5
    assert handler.metrics.snapshot()["inflight"] == 0
    # On a CPU a batch runs on the lane and is answered there: no thread per engine worker.
    assert not [t for t in threading.enumerate() if t.name.startswith("ebird-worker")]


@pytest.mark.slow
def test_full_pool_makes_requests_wait_not_disappear(make_handler):
    handler, ctx = make_handler(worker_batches=[1, 2], max_inflight=3, pool_slots=2)
    rows = [{"body": jpeg_bytes(seed=i)} for i in range(9)]
    answers = serve_all(handler, ctx, rows)
    assert [status for status, _ in answers] == [200] * len(rows)
    snap = handler.metrics.snapshot()
    assert snap["admission_waits"] > 0 and snap["requests_batched"] == len(rows)


def test_pool_full_past_the_response_timeout_is_a_503_not_a_hang(make_handler):
    handler, ctx = make_handler(response_timeout_s=0, worker_batches=[1], max_inflight=1, pool_slots=1)
    answers = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=i)} for i in range(4)])
    assert {status for status, _ in answers} == {503}
    assert all("response timeout" in json.loads(body)["message"] for _, body in answers)


def test_close_finishes_admitted_requests_then_refuses_new_ones(make_handler):
    handler, ctx = make_handler(worker_batches=[1, 1, 2], pool_slots=4)
    engine = handler.engines[((3, 224, 224),)]
    codec = handler.codec
    futures = [engine.try_submit(codec.decode({"body": jpeg_bytes(seed=i)})) for i in range(3)]
    handler.close(timeout_s=60)
    assert all(f.done() and f.exception() is None for f in futures)
    [(status, body)] = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=9)}])
    assert status == 503 and "shutting down" in body


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"worker_batches": [2, 4]}, "batch 1"),
        ({"worker_batches": [1, 3]}, "powers of two"),
        ({"worker_batches": [1, 32], "pool_slots": 16}, "largest worker batch"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"lanes": 2}, "unknown ebird settings"),
        ({"cpu_rule": "greedy"}, "cpu_rule"),
        ({"cpu_batch_cap": 0}, "cpu_batch_cap"),
        ({"cpu_batch_cap": "big"}, "cpu_batch_cap"),
        ({"cpu_quiet_batches": "yes"}, "cpu_quiet_batches must be true or false"),
        ({"cuda_graphs": 1}, "cuda_graphs must be true or false"),
    ],
)
def test_bad_ebird_config_is_refused_at_build_time(settings, message):
    with pytest.raises(EbirdConfigError, match=message):
        ServingOptions(handler="ebird", handler_settings=tuple(settings.items()))
    with pytest.raises(EbirdConfigError, match=message):
        EbirdConfig.from_dict(settings)


@pytest.mark.slow
def test_a_request_is_unanswered_from_the_moment_it_is_read_not_only_once_admitted(make_handler):
    """Packrat's drain reads this count: a request still decoding is in the worker, though no engine holds it."""
    handler, ctx = make_handler(worker_batches=[1, 2], pool_slots=4)  # small workers: a quick start-up timing
    published: list[int] = []
    handler.unanswered_changed = published.append
    decode = handler.decode_request

    async def main():
        gate = asyncio.Event()
        decoding = asyncio.Event()

        async def held_decode(row, context, index):
            decoding.set()
            await gate.wait()
            return await decode(row, context, index)

        handler.decode_request = held_decode
        task = asyncio.create_task(call(handler, ctx, {"body": jpeg_bytes(seed=1)}))
        await decoding.wait()
        during = handler.unanswered, handler.metrics.snapshot()["inflight"]
        gate.set()
        status, _ = await task
        return during, status

    (unanswered, admitted), status = asyncio.run(main())
    assert (unanswered, admitted) == (1, 0) and status == 200
    assert handler.unanswered == 0 and published == [1, 0]
