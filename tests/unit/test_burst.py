"""``serve_burst``: several messages at once, answered through callbacks (``handlers/runtime/burst.py``).

The async handlers (Ebird, DVABatch) on the one-layer BERT, driven in-process
as the lean message pump drives them: every burst's answer must be the one
``handle`` gives the same message, each request's failure its own status,
and every request answered exactly once, also when its deadline passes
before its batch ends.

Ebird with one input layout takes its bursts undecoded (``row_intake.py``);
``ebird-layouts`` is Ebird with several token lengths, one engine each, and
``ebird-inline`` Ebird decoding on its event loop: their requests are decoded
and then admitted, as DVABatch's are.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest
import torch

from archiver.options import ServingOptions
from bench.direct import (
    BurstCaller,
    as_client_sees,
    call,
    group_load_context,
    load_context,
    model_dir_for,
    request_context,
)
from bench.dvabatch import bench_payloads, dvabatch_token_lengths
from handlers.dvabatch.handler import DvaBatchHandler
from handlers.dvabatch.overhead import RunOverhead
from handlers.ebird.handler import EbirdHandler
from handlers.reef.handler import ENGINE_KEY, ReefHandler
from handlers.runtime.burst import BurstServer
from handlers.runtime.row_line import RowLine
from handlers.runtime.segment_profile import SegmentProfile
from model_store.catalog import get_spec
from model_store.samples import request_body, token_ids_json

SPEC = get_spec("bert-tiny1", "eager")
HANDLERS = ("ebird", "ebird-layouts", "dvabatch", "dvabatch-inline")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return model_dir_for(SPEC, tmp_path_factory.mktemp("bert-tiny1-burst"))


@pytest.fixture
def make_handler(model_dir, keep_handlers):
    def make(kind: str, **settings):
        if kind == "ebird":
            options = ServingOptions(handler="ebird", handler_settings=tuple(sorted(settings.items())))
            handler = EbirdHandler()
        elif kind == "ebird-inline":
            options = ServingOptions(
                handler="ebird", decode_threads=0, handler_settings=tuple(sorted(settings.items()))
            )
            handler = EbirdHandler()
        elif kind == "ebird-layouts":
            options = ServingOptions(
                handler="ebird",
                token_lengths=dvabatch_token_lengths(SPEC, "auto"),
                handler_settings=tuple(sorted(settings.items())),
            )
            handler = EbirdHandler()
        else:  # "dvabatch": rows taken undecoded through its ``RowLine``; "dvabatch-inline": admission
            options = ServingOptions(
                handler="dvabatch",
                token_lengths=dvabatch_token_lengths(SPEC, "auto"),
                decode_threads=0 if kind == "dvabatch-inline" else None,
                handler_settings=tuple(sorted(settings.items())),
            )
            handler = DvaBatchHandler()
        ctx = load_context(SPEC, model_dir, options)
        keep_handlers(handler).initialize(ctx)
        return handler, ctx

    return make


def rows(count: int) -> list[dict]:
    payloads, _ = bench_payloads(SPEC, count=count)
    return [{"body": request_body(p)} for p in payloads]


def burst(handler, load, messages: list[list[dict]], headers=None, then=None) -> list[list[tuple[int, object]]]:
    """``messages`` through one ``serve_burst`` call: each message's (status, answer) per request.

    ``then`` runs once every message is answered; the loop then runs a while
    longer, and the test fails if any message was answered more than once.
    """

    async def main():
        loop = asyncio.get_running_loop()
        per_message = headers if isinstance(headers, list) else [headers] * len(messages)
        calls = [(data, request_context(load, len(data), h)) for data, h in zip(messages, per_message, strict=True)]
        answered = [loop.create_future() for _ in calls]
        times = [0] * len(calls)

        def done(index, answers):
            times[index] += 1
            if times[index] == 1:
                context = calls[index][1]
                answered[index].set_result(
                    [(context.get_response_status(i)[0], as_client_sees(a)) for i, a in enumerate(answers)]
                )

        handler.serve_burst(calls, done)
        out = await asyncio.wait_for(asyncio.gather(*answered), 60)
        if then is not None:
            then()
        await asyncio.sleep(0.3)  # a late second answer would come now
        assert times == [1] * len(calls)
        return out

    return asyncio.run(main())


def assert_same(got: list[tuple[int, object]], expected: list[tuple[int, object]]) -> None:
    """Same statuses, and logits equal to 1e-4: a row's float sums depend on the batch it ran in (its
    padding, the reduction order); DVABatch's rows differed from their lone runs by 1.2e-5 on CI."""
    assert [status for status, _ in got] == [status for status, _ in expected]
    for (_, answer), (_, want) in zip(got, expected, strict=True):
        if isinstance(want, str):  # an error's body: the same reason
            assert json.loads(answer)["message"] == json.loads(want)["message"]
            continue
        if "logits" not in want:  # GPT-2's 50k next-token logits: only its top-5 travels
            assert [t["index"] for t in answer["top5"]] == [t["index"] for t in want["top5"]]
            answer, want = (
                {"logits": [t["logit"] for t in answer["top5"]]},
                {"logits": [t["logit"] for t in want["top5"]]},
            )
        assert torch.allclose(torch.tensor(answer["logits"]), torch.tensor(want["logits"]), atol=1e-4)


@pytest.mark.parametrize("kind", HANDLERS)
def test_a_burst_answers_each_message_as_handle_does_and_a_bad_request_alone_fails(make_handler, kind):
    handler, load = make_handler(kind)
    good = rows(12)
    expected = [asyncio.run(call(handler, load, row)) for row in good]
    messages = [[row] for row in good]
    messages.insert(5, [{"body": b"{not json"}])
    messages.insert(9, [{"body": json.dumps({"input_ids": [1, 2, 3] * 400}).encode()}])  # too long
    answers = burst(handler, load, messages)
    assert type(handler._burst) is BurstServer  # the callback path, not a task per message
    assert all(len(answer) == 1 for answer in answers)
    assert_same([a[0] for i, a in enumerate(answers) if i not in (5, 9)], expected)
    assert answers[5][0][0] == 400 and answers[9][0][0] == 400
    assert handler.unanswered == 0
    assert handler.metrics.inflight == 0


@pytest.mark.parametrize("kind", HANDLERS)
def test_a_bursts_answers_lower_the_unanswered_count_once_per_turn_not_once_per_request(make_handler, kind):
    handler, load = make_handler(kind, max_batch=16) if kind.startswith("dvabatch") else make_handler(kind)
    published: list[int] = []
    handler.unanswered_changed = published.append
    answers = burst(handler, load, [[row] for row in rows(16)] + [[{"body": b"{not json"}]])
    assert all(a[0][0] == 200 for a in answers[:16]) and answers[16][0][0] == 400
    assert published[0] == 17 and published[-1] == 0  # the burst counted once as it was read
    assert all(b < a for a, b in zip(published, published[1:], strict=False))  # never back up
    assert len(published) < 1 + 17  # answers that reached the loop together counted down together
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


SMALL_ENGINES = [
    ("ebird-layouts", {"pool_slots": 4, "worker_batches": [1, 2, 4]}),
    ("dvabatch-inline", {"max_inflight": 2, "max_batch": 2}),
]


@pytest.mark.parametrize(("kind", "room"), SMALL_ENGINES)
def test_a_burst_larger_than_the_engine_waits_for_room_and_loses_nothing(make_handler, kind, room):
    handler, load = make_handler(kind, **room)
    good = rows(24)
    expected = [asyncio.run(call(handler, load, row)) for row in good]
    answers = burst(handler, load, [[row] for row in good])
    assert all(len(answer) == 1 for answer in answers)
    assert_same([answer[0] for answer in answers], expected)
    assert handler.metrics.admission_waits > 0  # the callback path did wait in line
    assert handler.unanswered == 0


def test_a_burst_taken_undecoded_runs_in_batches_no_larger_than_the_largest_worker_and_loses_nothing(
    make_handler,
):
    handler, load = make_handler("ebird", pool_slots=4, worker_batches=[1, 2, 4])
    good = rows(24)
    expected = [asyncio.run(call(handler, load, row)) for row in good]
    before = dict(handler.metrics.batches)
    answers = burst(handler, load, [[row] for row in good])
    assert handler._burst.row_engine is not None  # taken undecoded: no pool slot, so no wait for one
    assert_same([answer[0] for answer in answers], expected)
    ran = {size: count - before.get(size, 0) for size, count in handler.metrics.batches.items()}
    assert sum(size * count for size, count in ran.items()) == 24
    assert max(size for size, count in ran.items() if count) <= 4
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_requests_taken_undecoded_and_unanswered_when_their_engine_closes_get_a_503_each_once(make_handler):
    """Closing waits for the taken requests until its timeout, then answers those still in line and those
    in a batch that has not ended with 503; the batch's late answers are dropped (``burst`` fails on a
    second answer)."""
    handler, load = make_handler("ebird")
    engine = next(iter(handler.engines.values()))
    release = block_every_lane(handler)
    closing = threading.Timer(0.2, engine.close, kwargs={"timeout_s": 0.2})
    closing.start()
    try:
        answers = burst(handler, load, [[row] for row in rows(40)], then=release.set)
    finally:
        release.set()
        closing.join()
    assert handler._burst.row_engine is engine
    messages = [json.loads(body)["message"] for [(status, body)] in answers if status == 503]
    assert len(messages) == 40 and all("shut down" in m for m in messages), answers
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_dvabatch_takes_a_burst_through_its_row_line_each_length_to_its_engine_and_a_bad_request_alone_fails(
    make_handler,
):
    """Several engines (one per token length): the burst is decoded on a lane and handed to each engine
    in one call (``row_line.py``), nothing is admitted one by one, and every answer is ``handle``'s."""
    handler, load = make_handler("dvabatch", max_batch=8, merge_lengths=False)
    assert len(handler.engines) > 1
    good = rows(24)
    too_long = {"body": request_body(token_ids_json(SPEC, SPEC.seq_len + 8, seed=3))}
    sent = [*good[:10], {"body": b"{not json"}, too_long, *good[10:]]
    expected = [asyncio.run(call(handler, load, row)) for row in sent]
    assert [status for status, _ in expected].count(200) == 24 and expected[10][0] == 400
    handed: dict[int, int] = {}
    admitted: list[object] = []
    for key, engine in handler.engines.items():

        def take_decoded(taken, items, batches, times, take=engine.take_decoded, key=key):
            handed[key] = handed.get(key, 0) + len(items)
            take(taken, items, batches, times)

        def try_submit(item, submit=engine.try_submit):
            admitted.append(item)
            return submit(item)

        engine.take_decoded, engine.try_submit = take_decoded, try_submit
    answers = burst(handler, load, [[row] for row in sent])
    assert isinstance(handler._burst.row_engine, RowLine)
    assert_same([answer[0] for answer in answers], expected)
    assert admitted == [] and sum(handed.values()) == 24 and len(handed) > 1, handed
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def profile_costing(batch_ms) -> SegmentProfile:
    """A one-stage segment profile whose batch of ``rows`` takes ``batch_ms(rows)``: the merge's cost model."""
    sizes = (1, 4, 8)
    return SegmentProfile("bert-tiny1", 1, sizes, (tuple(batch_ms(n) for n in sizes),))


@pytest.mark.parametrize("costs", ["per batch", "per token"])
def test_dvabatch_runs_length_classes_padded_together_where_their_profile_says_one_batch_costs_less(
    make_handler, costs
):
    """Each engine's cost model is set here (plain data, not a timing): costs mostly per batch, every
    class's rows go padded to the longest class in the burst, in one call to its engine; mostly per token,
    each class to its own engine.  Either way every answer is the one ``handle`` gives each request alone."""
    handler, load = make_handler("dvabatch", max_batch=8, split=False)
    merger = handler.regroup_rows()
    assert merger is not None and len(merger.lengths) == len(handler.engines) > 1
    for length, engine, _ in handler._classes:
        if costs == "per batch":
            engine.policy.profile = profile_costing(lambda n: 1.0 + 0.001 * n)
        else:
            engine.policy.profile = profile_costing(lambda n, length=length: 0.1 * length * n)
    good = rows(24)
    expected = [asyncio.run(call(handler, load, row)) for row in good]
    handed: dict[int, int] = {}
    for length, engine, _ in handler._classes:
        # The runs above fitted each engine's cost per run from their timings (``overhead.py``), which the
        # merge adds to the profile: on a slow machine that alone tipped the per-token case into merging.
        engine.overhead = RunOverhead()

        def take_decoded(taken, items, batches, times, take=engine.take_decoded, length=length):
            assert all(item.shapes[0] == (length,) for item in items)
            handed[length] = handed.get(length, 0) + len(items)
            take(taken, items, batches, times)

        engine.take_decoded = take_decoded
    before = handler.metrics.operations["pad_up"]
    answers = burst(handler, load, [[row] for row in good])  # one burst: one hand-over
    assert_same([answer[0] for answer in answers], expected)
    lengths_sent = {len(json.loads(row["body"])["input_ids"]) for row in good}
    classes_sent = {min(n for n in merger.lengths if n >= sent) for sent in lengths_sent}
    if costs == "per batch":
        assert handed == {max(classes_sent): 24}, handed
        assert handler.metrics.operations["pad_up"] - before == len(classes_sent) - 1
    else:
        assert set(handed) == classes_sent and sum(handed.values()) == 24, handed
        assert handler.metrics.operations["pad_up"] == before
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_dvabatch_never_merges_length_classes_of_a_model_that_answers_by_length(make_handler):
    handler, _ = make_handler("dvabatch", max_batch=8)
    assert handler.regroup_rows() is not None
    classes = handler._classes
    handler._classes = [(length, engine, (length, 2)) for length, engine, _ in classes]  # per-token rows
    assert handler.regroup_rows() is None
    handler._classes = classes
    handler.config = dataclasses.replace(handler.config, merge_lengths=False)  # the archive's setting off
    assert handler.regroup_rows() is None


def test_dvabatch_rows_past_its_in_flight_bound_wait_for_room_and_lose_nothing(make_handler):
    """A burst taken undecoded enters each engine whole; its batch table still holds at most
    ``max_inflight`` requests, the rest waiting in order for room."""
    handler, load = make_handler("dvabatch", max_inflight=2, max_batch=2)
    good = rows(24)
    expected = [asyncio.run(call(handler, load, row)) for row in good]
    held: list[int] = []
    for engine in handler.engines.values():

        def place(table, pending, now, place=engine.policy.place):
            placement = place(table, pending, now)
            held.append(sum(entry.size for entry in table) + placement.count)
            return placement

        engine.policy.place = place
    answers = burst(handler, load, [[row] for row in good])
    assert isinstance(handler._burst.row_engine, RowLine)
    assert_same([answer[0] for answer in answers], expected)
    assert held and max(held) <= 2, held
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_dvabatch_rows_still_in_its_row_line_when_the_handler_closes_get_a_503_each_once(make_handler):
    handler, load = make_handler("dvabatch")
    release = block_every_lane(handler)  # the line's hand-over job cannot start
    closing = threading.Timer(0.2, handler.close, kwargs={"timeout_s": 0.2})
    closing.start()
    try:
        answers = burst(handler, load, [[row] for row in rows(12)], then=release.set)
    finally:
        release.set()
        closing.join()
    assert isinstance(handler._burst.row_engine, RowLine)
    messages = [json.loads(body)["message"] for [(status, body)] in answers if status == 503]
    assert len(messages) == 12 and all("shut down" in m for m in messages), answers
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_messages_the_callbacks_do_not_take_go_through_handle(make_handler):
    handler, load = make_handler("ebird")
    two = rows(2)
    expected = [asyncio.run(call(handler, load, row)) for row in two]
    answers = burst(handler, load, [two, [two[0]]])  # a message of two requests, then a plain one
    assert_same(answers[0], expected)
    assert_same(answers[1], expected[:1])
    [[(status, signature)]] = burst(handler, load, [[{"body": b""}]], headers={"describe": "True"})
    assert status == 200 and signature["name"] == SPEC.name


def test_a_request_past_its_deadline_is_answered_503_once_and_its_late_result_is_dropped(make_handler):
    handler, load = make_handler("ebird-inline")
    engine = next(iter(handler.engines.values()))
    release = threading.Event()
    submit = engine.try_submit

    def try_submit_behind_a_busy_lane(item):  # the batch this request joins cannot start until released
        handler.lanes.submit(release.wait)
        return submit(item)

    engine.try_submit = try_submit_behind_a_busy_lane
    handler.response_timeout_s = 0.2
    try:
        [[(status, body)]] = burst(handler, load, [rows(1)], then=release.set)  # the batch ends after the 503
    finally:
        release.set()
    assert status == 503 and "response timeout" in json.loads(body)["message"]
    engine.try_submit = submit
    handler.response_timeout_s = 120
    [[(status, _)]] = burst(handler, load, [rows(1)])  # and it serves on
    assert status == 200
    assert handler.unanswered == 0


def reef_pair(tmp_path, keep_handlers, **handler_config):
    """A REEF handler serving the one-layer BERT (real-time) and GPT-2 (best-effort), ``handler_config``
    added to its archive's ``handler:`` section; (handler, load context, three request rows per member)."""
    specs = [SPEC, get_spec("gpt2-tiny1", "eager")]
    options = ServingOptions(handler="reef", handler_settings=(("realtime", ["bert-tiny1"]),))
    load = group_load_context(specs, tmp_path / "weights", options)
    load.model_yaml_config["handler"].update(handler_config)
    handler = keep_handlers(ReefHandler())
    handler.initialize(load)
    bodies = {spec.name: [{"body": request_body(p)} for p in bench_payloads(spec, count=3)[0]] for spec in specs}
    return handler, load, bodies


def both_priorities(bodies) -> tuple[list[list[dict]], list[dict[str, str]]]:
    """Three one-request messages per member, each at its member's default priority, interleaved."""
    messages, headers = [], []
    for i in range(3):
        for name, priority in (("bert-tiny1", "realtime"), ("gpt2-tiny1", "best-effort")):
            messages.append([bodies[name][i]])
            headers.append({"X-Model": name, "X-Priority": priority})
    return messages, headers


def test_reef_routes_each_request_of_a_burst_by_its_own_headers(tmp_path, keep_handlers):
    """REEF picks the member from each request's headers (``route_request``): in one burst, requests for
    both members at both priorities are answered as ``handle`` answers them, and a request naming no
    member it serves gets its own 404 while the rest are served."""
    handler, load, bodies = reef_pair(tmp_path, keep_handlers)
    messages, headers = both_priorities(bodies)
    messages.append([bodies["bert-tiny1"][0]])
    headers.append({"X-Model": "resnet50"})
    expected = [asyncio.run(call(handler, load, m[0], h)) for m, h in zip(messages[:-1], headers[:-1], strict=True)]
    answers = burst(handler, load, messages, headers)
    assert type(handler._burst) is BurstServer  # the callback path, not a task per message
    assert all(len(answer) == 1 for answer in answers)
    assert_same([a[0] for a in answers[:-1]], expected)
    status, body = answers[-1][0]
    assert status == 404 and "resnet50" in json.loads(body)["message"]
    assert handler.unanswered == 0


@pytest.mark.parametrize(("setting", "realtime_on_engine"), [({}, True), ({"encode_answers": "loop"}, False)])
def test_reef_encodes_real_time_answers_on_their_executor_and_best_effort_ones_on_the_loop(
    tmp_path, keep_handlers, setting, realtime_on_engine
):
    """By default real-time requests are taken undecoded: the RT executor decodes, runs and encodes each
    batch (in one call, while best-effort units wait at the gate), and nothing of theirs is admitted;
    best-effort answers are encoded on the event loop.  The archive's ``encode_answers: loop`` puts both
    on the loop, real-time requests admitted as best-effort ones are.  The answers are the same."""
    handler, load, bodies = reef_pair(tmp_path, keep_handlers, **setting)
    messages, headers = both_priorities(bodies)
    expected = [asyncio.run(call(handler, load, m[0], h)) for m, h in zip(messages, headers, strict=True)]
    engine = handler.engines[ENGINE_KEY]
    submitted: list[tuple[str, object]] = []
    all_admitted = threading.Event()
    admitted_count = 6 if not realtime_on_engine else 3  # taken undecoded, real-time ones are never admitted

    def try_submit(item, submit=engine.try_submit):
        future = submit(item)
        submitted.append((item.priority, future))
        return future

    def request_admitted(admitted=handler.metrics.request_admitted):  # after the request's encoder was set
        admitted()
        if len(submitted) == admitted_count:
            all_admitted.set()

    def run_when_all_are_admitted(batch, forward, stream, run=engine._run):  # no batch ends before that
        all_admitted.wait(30)
        return run(batch, forward, stream)

    encoded_on: list[str] = []

    def encode_rows(outputs, encode=handler._rows_encoder.encode_rows):
        encoded_on.append(threading.current_thread().name)
        return encode(outputs)

    engine.try_submit, engine._run = try_submit, run_when_all_are_admitted
    handler.metrics.request_admitted = request_admitted
    handler._rows_encoder.encode_rows = encode_rows
    answers = burst(handler, load, messages, headers)
    assert_same([a[0] for a in answers], expected)
    encoded = {priority: [future.encoded for p, future in submitted if p == priority] for priority, _ in submitted}
    if realtime_on_engine:
        assert handler._burst.row_engine is engine
        assert encoded == {"best-effort": [False] * 3}
        assert "reef-rt" in encoded_on  # the real-time rows' answers, on their executor
    else:
        assert handler._burst.row_engine is None
        assert encoded == {"realtime": [False] * 3, "best-effort": [False] * 3}
        assert "reef-rt" not in encoded_on


def test_reef_real_time_requests_taken_undecoded_run_with_best_effort_held_at_the_gate(tmp_path, keep_handlers):
    """Taking a real-time request raises the preemption gate as admitting one does: every real-time batch of
    rows runs in real-time mode, and the gate comes down once they are answered."""
    handler, load, bodies = reef_pair(tmp_path, keep_handlers)
    messages, headers = both_priorities(bodies)
    expected = [asyncio.run(call(handler, load, m[0], h)) for m, h in zip(messages, headers, strict=True)]
    engine = handler.engines[ENGINE_KEY]
    realtime = engine.members["bert-tiny1"].model
    modes: list[bool] = []
    forward = realtime.forward

    def watched(*args, **kwargs):
        if threading.current_thread().name == "reef-rt":
            modes.append(engine.gate.realtime_mode)
        return forward(*args, **kwargs)

    realtime.forward = watched
    try:
        answers = burst(handler, load, messages, headers)
    finally:
        realtime.forward = forward
    assert handler._burst.row_engine is engine
    assert_same([a[0] for a in answers], expected)
    assert modes and all(modes)
    assert not engine.gate.realtime_mode  # every real-time request lowered what it raised
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_reef_real_time_requests_still_in_line_when_its_engine_closes_get_a_503_each_once(tmp_path, keep_handlers):
    handler, load, bodies = reef_pair(tmp_path, keep_handlers)
    engine = handler.engines[ENGINE_KEY]
    release = threading.Event()
    blocker_started = threading.Event()
    decode = handler.codecs["bert-tiny1"].decode

    def blocked_once(row):  # the RT executor's first decode waits until released
        if not blocker_started.is_set():
            blocker_started.set()
            release.wait(20)
        return decode(row)

    handler.codecs["bert-tiny1"].decode = blocked_once
    messages = [[bodies["bert-tiny1"][i % 3]] for i in range(6)]
    headers = [{"X-Model": "bert-tiny1", "X-Priority": "realtime"}] * 6
    closing = threading.Timer(0.3, engine.close, kwargs={"timeout_s": 0.2})
    closing.start()
    try:
        answers = burst(handler, load, messages, headers, then=release.set)
    finally:
        release.set()
        closing.join()
    assert blocker_started.is_set() and handler._burst.row_engine is engine
    messages = [json.loads(body)["message"] for [(status, body)] in answers if status == 503]
    assert len(messages) == 6 and all("shut down" in m for m in messages), answers
    assert handler.unanswered == 0 and handler.metrics.inflight == 0


def test_requests_still_waiting_for_room_at_their_deadline_get_a_503_saying_so_and_never_reach_the_engine(
    make_handler,
):
    handler, load = make_handler("ebird-inline", pool_slots=4, worker_batches=[1, 2, 4])
    engine = next(iter(handler.engines.values()))
    release = threading.Event()
    submit = engine.try_submit
    entered: list[object] = []

    def try_submit_behind_a_busy_lane(item):  # no batch can run, so no room comes back, until released
        if not entered:
            handler.lanes.submit(release.wait)
        future = submit(item)
        if future is not None:
            entered.append(item)
        return future

    engine.try_submit = try_submit_behind_a_busy_lane
    handler.response_timeout_s = 0.3
    try:
        answers = burst(handler, load, [[row] for row in rows(8)], then=release.set)
    finally:
        release.set()
    messages = [json.loads(body)["message"] for [(status, body)] in answers if status == 503]
    assert len(messages) == 8, answers
    full = [m for m in messages if "input pool stayed full" in m]  # waited in line the whole timeout
    assert len(full) == 4, messages
    assert all("response timeout" in m for m in messages if m not in full)  # admitted; their batch never ran
    assert len(entered) == 4  # those that gave up waiting were skipped once room came back
    engine.try_submit = submit
    handler.response_timeout_s = 120
    assert [status for [(status, _)] in burst(handler, load, [[row] for row in rows(6)])] == [200] * 6
    assert handler.unanswered == 0


def block_every_lane(handler) -> threading.Event:
    """Every CPU lane waits on the returned event, so no decode job (and no batch) runs until it is set."""
    release = threading.Event()
    for lane in range(handler.lanes.count):
        handler.lanes.submit(release.wait, lane=lane)
    return release


def count_submissions(handler) -> list[object]:
    """Every input that reaches an engine from now on, in the returned list: admitted decoded, or, taken
    undecoded, decoded on the lane that runs its batch."""
    reached: list[object] = []
    for engine in handler.engines.values():

        def try_submit(item, submit=engine.try_submit):
            reached.append(item)
            return submit(item)

        engine.try_submit = try_submit
        if engine.takes_rows:

            def take_rows(taken, batches, take=engine.take_rows):
                if not getattr(batches, "counted", False):
                    decode = batches.decode

                    def decode_on_the_lane(row):
                        reached.append(row)
                        return decode(row)

                    batches.decode, batches.counted = decode_on_the_lane, True
                take(taken, batches)

            engine.take_rows = take_rows
        if engine.takes_decoded_rows:

            def take_decoded(taken, items, batches, times, take=engine.take_decoded):
                reached.extend(items)
                take(taken, items, batches, times)

            engine.take_decoded = take_decoded
    return reached


@pytest.mark.parametrize("kind", ["ebird", "ebird-layouts", "dvabatch"])  # those decoding on the lanes
def test_the_response_timeout_counts_from_receipt_and_answers_a_request_still_decoding(make_handler, kind):
    """A request whose decode outlasts the response timeout (here: every lane busy, so its decode job
    waits) is answered 503 at its deadline, by the burst path and by ``handle`` alike, not once its
    decode ends; the late decode, delivered to the same loop, never reaches an engine, and the
    handler serves on."""
    handler, load = make_handler(kind)
    assert handler.decoder.on_lanes
    reached = count_submissions(handler)
    handler.response_timeout_s = 0.3

    async def main():
        caller = BurstCaller(handler, load)
        release = block_every_lane(handler)
        watchdog = asyncio.get_running_loop().call_later(20, release.set)  # a failing build must not hang
        started = time.monotonic()
        try:
            late = await asyncio.gather(caller.request(rows(1)[0]), call(handler, load, rows(1)[0]))
            seconds = time.monotonic() - started
            assert not release.is_set()  # both were answered while their decodes still waited
        finally:
            release.set()
            watchdog.cancel()
        await asyncio.sleep(0.5)  # the late decodes reach this loop now; their requests are gone
        assert reached == []
        handler.response_timeout_s = 120
        served = await asyncio.gather(*(caller.request(row) for row in rows(3)), call(handler, load, rows(1)[0]))
        return late, seconds, served

    late, seconds, served = asyncio.run(main())
    for status, answer in late:
        message = json.loads(answer)["message"] if isinstance(answer, str) else answer["message"]
        assert status == 503 and "response timeout" in message, answer
    assert seconds < 10
    assert [status for status, _ in served] == [200] * 4
    assert len(reached) == 4
    assert handler.unanswered == 0
