"""Admission into a full engine (``handlers/runtime/admission.py``): order, requests gone, refusals, timeout.

The engine here is plain data with the two methods admission uses (room
counted by hand); the handlers' own tests drive the same queue through
real engines (``test_ebird_handler.py``, ``test_burst.py``).
"""

from __future__ import annotations

import asyncio

import pytest

from handlers.errors import ServiceUnavailable
from handlers.runtime.admission import FULL_FOR_THE_TIMEOUT, Admission
from handlers.runtime.metrics import HandlerMetrics


class CountedRoom:
    """An engine with ``room`` free places: ``try_submit`` takes one (returning the input as its
    'future') or returns None; ``free(n)`` makes room as an engine thread would and says so."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.taken: list[str] = []
        self.refuse: set[str] = set()
        self._listeners = []

    def on_space(self, listener) -> None:
        self._listeners.append(listener)

    def try_submit(self, item: str):
        if item in self.refuse:
            raise ServiceUnavailable(f"{item} refused")
        if self.room == 0:
            return None
        self.room -= 1
        self.taken.append(item)
        return f"future-{item}"

    def free(self, n: int) -> None:
        self.room += n
        for listener in self._listeners:
            listener()


async def settle() -> None:
    """Let the mailbox's callbacks run (they are posted to the loop)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_waiting_inputs_enter_in_arrival_order_and_a_newcomer_waits_behind_them() -> None:
    async def main():
        engine = CountedRoom(room=1)
        metrics = HandlerMetrics(None, "")
        admission = Admission(engine, metrics, asyncio.get_running_loop())
        told: list[tuple[str, str]] = []

        def submit(item: str) -> None:
            admission.submit(item, lambda f, i=item: told.append((i, f)), lambda e: told.append(("failed", str(e))),
                             lambda: False)  # fmt: skip

        for item in ("a", "b", "c", "d"):
            submit(item)
        assert told == [("a", "future-a")] and admission.waiting == 3
        engine.free(2)
        await settle()
        assert [i for i, _ in told] == ["a", "b", "c"] and admission.waiting == 1
        engine.room += 1  # room appeared but nobody said so yet: a newcomer must not overtake "d"
        submit("e")
        assert [i for i, _ in told] == ["a", "b", "c"] and engine.taken == ["a", "b", "c"]
        engine.free(0)
        await settle()
        assert engine.taken == ["a", "b", "c", "d"] and admission.waiting == 1
        engine.free(1)
        await settle()
        assert engine.taken == ["a", "b", "c", "d", "e"] and admission.waiting == 0
        return metrics.admission_waits

    assert asyncio.run(main()) == 4  # b, c, d and e each waited once


def test_a_request_gone_while_waiting_never_reaches_the_engine_and_a_refusal_fails_only_its_own() -> None:
    async def main():
        engine = CountedRoom(room=0)
        admission = Admission(engine, HandlerMetrics(None, ""), asyncio.get_running_loop())
        gone = {"b"}
        engine.refuse.add("c")
        told: list[tuple[str, str]] = []
        for item in ("a", "b", "c", "d"):
            admission.submit(item, lambda f, i=item: told.append((i, "admitted")),
                             lambda e, i=item: told.append((i, f"failed: {e}")), lambda i=item: i in gone)  # fmt: skip
        engine.free(2)
        await settle()
        return told, engine.taken

    told, taken = asyncio.run(main())
    assert taken == ["a", "d"]
    assert told == [("a", "admitted"), ("c", "failed: c refused : 503"), ("d", "admitted")]


def test_the_coroutine_form_waits_for_room_and_answers_503_when_it_never_comes() -> None:
    async def main():
        loop = asyncio.get_running_loop()
        engine = CountedRoom(room=0)
        admission = Admission(engine, HandlerMetrics(None, ""), loop)
        waiting = asyncio.ensure_future(admission.admit("a", loop.time() + 10))
        await settle()
        engine.free(1)
        admitted = await waiting
        with pytest.raises(ServiceUnavailable, match=FULL_FOR_THE_TIMEOUT):
            await admission.admit("b", loop.time() + 0.05)
        engine.free(1)  # room after "b" gave up: it is skipped, not admitted
        await settle()
        return admitted, engine.taken, admission.waiting

    assert asyncio.run(main()) == ("future-a", ["a"], 0)
