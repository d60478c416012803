"""``RowBatches``: a batch of requests taken undecoded is decoded, run and encoded on its lane, and every
request gets one answer or its own error (``handlers/runtime/row_intake.py``).

Pure logic over plain rows: a two-number codec, a linear model, a real event
loop and its mailbox; the handlers that use it are served in ``test_burst.py``
and through TorchServe in the serving tests.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest
import torch

from handlers.codecs import ModelInput
from handlers.errors import ResponseError, ServiceUnavailable, bad_request
from handlers.runtime.engine import RowsEncoder
from handlers.runtime.loop_mailbox import mailbox_for
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_intake import RowBatches

MODEL = torch.nn.Linear(2, 3)
torch.nn.init.constant_(MODEL.weight, 0.5)
torch.nn.init.zeros_(MODEL.bias)


class Row:
    def __init__(self, body: Any, finished: bool = False) -> None:
        self.row = {"body": body}
        self.received = 0.0
        self.finished = finished
        self.decode = None  # the batch's own decode
        self.bind = None


def decode(row: dict[str, Any]) -> ModelInput:
    values = json.loads(row["body"])  # ValueError for a body that is not JSON: a codec's bug, not a 4xx
    if not isinstance(values, list):
        raise bad_request("expected a list")
    return ModelInput((torch.tensor(values, dtype=torch.float32),))


def fits(item: ModelInput) -> bool:
    return item.shapes == ((2,),)


ROWS_ENCODER = RowsEncoder(lambda outputs: [("batch", row) for row in outputs.tolist()])


def forward(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return MODEL(*tensors)


def run_batch(rows: list[Row], model=forward, encoder_for=lambda item: ROWS_ENCODER) -> tuple[int, dict[str, Any]]:
    """``rows`` as one batch on a thread of their own (a lane), delivered to a running loop: how many the
    model ran, and what ``deliver`` got."""
    delivered: dict[str, Any] = {}

    async def main() -> int:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def deliver(taken, answers, errors, times) -> None:
            delivered.update(rows=taken, answers=answers, errors=errors, times=times,
                             on_loop=threading.current_thread() is threading.main_thread())  # fmt: skip
            done.set_result(None)

        batches = RowBatches(decode, fits, encoder_for, HandlerMetrics(None, "m"), mailbox_for(loop), deliver)
        ran, times = await asyncio.to_thread(batches.run, rows, model)
        await asyncio.wait_for(done, 5)
        assert times is delivered["times"]
        return ran

    ran = asyncio.run(main())
    return ran, delivered


def test_each_row_gets_its_answer_or_its_own_error_and_a_row_answered_already_is_skipped() -> None:
    rows = [Row("[1, 2]"), Row('"one"'), Row("[5, 6]", finished=True), Row("[1, 2, 3]"), Row("[3, 4]")]
    ran, got = run_batch(rows)
    assert ran == 2 and got["on_loop"] and got["rows"] is rows
    assert got["answers"][0] == ("batch", pytest.approx([1.5] * 3))
    assert got["answers"][4] == ("batch", pytest.approx([3.5] * 3))
    assert got["answers"][1] is None and got["answers"][2] is None and got["answers"][3] is None
    assert set(got["errors"]) == {1, 3}  # the skipped row has neither: it was answered at its deadline
    assert got["errors"][1].status == 400
    assert got["errors"][3].status == 400 and "[3]" in got["errors"][3].reason  # a layout the engine lacks
    times = got["times"]
    assert times.taken <= times.decoded <= times.finished <= times.settled


def test_a_failing_model_fails_the_rows_it_ran_and_leaves_the_decode_errors_their_own() -> None:
    def broken(tensors):
        raise RuntimeError("device fault")

    ran, got = run_batch([Row("[1, 2]"), Row('"one"'), Row("[3, 4]")], model=broken)
    assert ran == 2
    assert got["answers"] == [None, None, None]
    assert isinstance(got["errors"][0], ServiceUnavailable) and "device fault" in got["errors"][0].reason
    assert got["errors"][2] is got["errors"][0]
    assert isinstance(got["errors"][1], ResponseError) and got["errors"][1].status == 400


def test_a_codec_bug_is_that_rows_error_and_the_batch_runs_on() -> None:
    ran, got = run_batch([Row("{not json"), Row("[1, 2]")])
    assert ran == 1
    assert isinstance(got["errors"][0], ValueError)  # ``BurstServer.finish`` answers it 503 and logs it
    assert got["answers"][1] == ("batch", pytest.approx([1.5] * 3))


def test_rows_with_an_encoder_of_their_own_are_encoded_alone_and_the_rest_together() -> None:
    calls: list[int] = []
    together = RowsEncoder(lambda outputs: calls.append(len(outputs)) or [("batch", r) for r in outputs.tolist()])

    def encoder_for(item: ModelInput) -> Any:
        if float(item.tensors[0][0]) < 0:  # say, an Open Inference Protocol request: answered row by row
            return lambda row: ("alone", row.tolist())
        return together

    _, got = run_batch([Row("[1, 2]"), Row("[-1, 0]"), Row("[3, 4]")], encoder_for=encoder_for)
    assert calls == [2]  # the two rows in the handler's own JSON, in one call
    assert got["answers"][1] == ("alone", pytest.approx([-0.5] * 3))
    assert got["answers"][0][0] == got["answers"][2][0] == "batch"
    assert got["errors"] == {}


def test_a_failing_encoder_fails_only_the_rows_it_encodes() -> None:
    def encoder_for(item: ModelInput) -> Any:
        if float(item.tensors[0][0]) < 0:
            return lambda row: 1 / 0
        return ROWS_ENCODER

    _, got = run_batch([Row("[-1, 0]"), Row("[3, 4]")], encoder_for=encoder_for)
    assert isinstance(got["errors"][0], ServiceUnavailable) and "encode" in got["errors"][0].reason
    assert got["answers"][1] == ("batch", pytest.approx([3.5] * 3)) and 1 not in got["errors"]


def test_fail_answers_every_row_with_the_error_on_the_loop() -> None:
    delivered: list[Any] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        batches = RowBatches(decode, fits, lambda item: ROWS_ENCODER, HandlerMetrics(None, "m"), mailbox_for(loop),
                             lambda *args: delivered.append(args))  # fmt: skip
        rows = [Row("[1, 2]"), Row("[3, 4]")]
        await asyncio.to_thread(batches.fail, rows, ServiceUnavailable("worker shut down"))
        await asyncio.sleep(0.05)

    asyncio.run(main())
    [(rows, answers, errors, _)] = delivered
    assert answers == [None, None] and set(errors) == {0, 1} and len(rows) == 2
