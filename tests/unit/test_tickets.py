"""A ticket's answer, encoded where the engine settles it (``handlers/runtime/engine.py``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from handlers.codecs import ModelInput
from handlers.errors import ServiceUnavailable
from handlers.runtime.async_handler import stage_breakdown
from handlers.runtime.engine import RowLayout, StageTimes, Ticket, layout_of


def test_an_encoder_set_before_settling_turns_the_row_into_the_answer_once():
    ticket = Ticket()
    ticket.future.encode = lambda row: f"answer {row}".encode()
    assert ticket.settle(result=7)
    assert ticket.future.result() == b"answer 7" and ticket.future.encoded
    assert ticket.times.encode_seconds >= 0 and ticket.times.settled is not None
    ticket.future.encode = lambda row: pytest.fail("a second settle must not encode")
    assert not ticket.settle(result=8)
    assert ticket.future.result() == b"answer 7"


def test_an_encoder_set_after_settling_is_not_called_and_the_row_stays():
    ticket = Ticket()
    ticket.settle(result=7)
    ticket.future.encode = lambda row: pytest.fail("settled before the encoder was set")
    assert ticket.future.result() == 7 and not ticket.future.encoded


def test_an_error_is_not_encoded_and_a_failing_encoder_is_a_503():
    failed = Ticket()
    failed.future.encode = lambda row: pytest.fail("an error has no row to encode")
    failed.settle(error=ServiceUnavailable("batch failed"))
    with pytest.raises(ServiceUnavailable, match="batch failed"):
        failed.future.result()

    def broken(row):
        raise TypeError("not JSON")

    ticket = Ticket()
    ticket.future.encode = broken
    ticket.settle(result=7)
    with pytest.raises(ServiceUnavailable, match="could not encode the answer: TypeError: not JSON"):
        ticket.future.result()
    assert not ticket.future.encoded


def test_encoding_done_by_the_engine_counts_as_the_encode_stage_not_the_release():
    times = StageTimes(arrived=1.0, started=2.0, finished=3.0, settled=3.5, encode_seconds=0.4)
    stages = stage_breakdown(0.5, 0.75, 1.0, times, woken=4.0, answered=4.25)
    assert stages == pytest.approx(
        {"decode": 0.25, "admission": 0.25, "queue": 1.0, "batch": 1.0, "release": 0.1, "wakeup": 0.5, "encode": 0.65}
    )
    untimed = stage_breakdown(0.5, 0.75, 1.0, None, woken=4.0, answered=4.25)
    assert untimed == pytest.approx({"decode": 0.25, "admission": 0.25, "engine": 3.0, "encode": 0.25})


def test_a_ticket_is_answered_once_and_every_listener_hears_it_once_before_or_after() -> None:
    ticket = Ticket()
    heard: list[tuple[str, object]] = []
    ticket.future.add_done_callback(lambda f: heard.append(("before", f.result())))
    ticket.future.add_done_callback(lambda f: 1 / 0)  # a broken listener: logged, the others still hear
    ticket.future.add_done_callback(lambda f: heard.append(("also before", f.result())))
    assert not ticket.future.done() and not ticket.future.cancelled()
    assert ticket.settle(result=7)
    assert not ticket.settle(result=8) and not ticket.settle(error=ServiceUnavailable("late"))
    ticket.future.add_done_callback(lambda f: heard.append(("after", f.result())))
    assert heard == [("before", 7), ("also before", 7), ("after", 7)]
    assert ticket.future.exception() is None


def test_a_thread_blocked_on_a_ticket_wakes_with_its_answer_and_a_timeout_is_a_timeout() -> None:
    ticket = Ticket()
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(ticket.future.result, 30)
        time.sleep(0.05)  # blocked before the answer: the event path, not the done fast path
        assert not waiting.done()
        ticket.settle(error=ServiceUnavailable("batch failed"))
        with pytest.raises(ServiceUnavailable, match="batch failed"):
            waiting.result(30)
    assert isinstance(ticket.future.exception(0), ServiceUnavailable)
    with pytest.raises(TimeoutError):
        Ticket().future.result(timeout=0.01)


def test_many_threads_settling_and_listening_at_once_lose_no_answer() -> None:
    tickets = [Ticket() for _ in range(2000)]
    heard: list[int] = []
    lock = threading.Lock()

    def listen(i: int) -> None:
        def record(f) -> None:
            with lock:
                heard.append(f.result())

        tickets[i].future.add_done_callback(record)

    with ThreadPoolExecutor(4) as pool:
        for i in range(len(tickets)):
            pool.submit(listen, i)
            pool.submit(tickets[i].settle, i)
    assert sorted(heard) == list(range(len(tickets)))


def test_a_row_layout_fits_only_inputs_with_its_shapes_and_dtypes() -> None:
    tokens = ModelInput(rows=([1, 2, 3, 0], [1, 1, 1, 0]))
    layout = RowLayout(layout_of(tokens))
    assert layout.fits(ModelInput(rows=([4, 5, 0, 0], [1, 1, 0, 0])))
    assert layout.fits(ModelInput((torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long))))
    assert not layout.fits(ModelInput(rows=([4, 5, 0], [1, 1, 0])))  # another length
    assert not layout.fits(ModelInput(rows=([4, 5, 0, 0],)))  # a tensor missing
    assert not layout.fits(ModelInput((torch.zeros(4), torch.ones(4, dtype=torch.long))))  # another dtype
    for item in (tokens, ModelInput(rows=([9],)), ModelInput((torch.zeros(3, 8, 8),))):
        assert RowLayout(layout_of(item)).fits(item) and (layout.fits(item) == (layout_of(item) == layout_of(tokens)))
