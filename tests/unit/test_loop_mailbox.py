"""The event loop's mailbox and the decoder's lane jobs: per-burst hand-offs, nothing lost."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from handlers.errors import ResponseError, bad_request
from handlers.runtime.decode import RequestDecoder
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.loop_mailbox import LoopMailbox, mailbox_for


def test_a_burst_posted_from_a_thread_wakes_the_loop_once_and_keeps_its_order():
    async def main() -> tuple[list[int], int]:
        box = LoopMailbox(asyncio.get_running_loop())
        seen: list[int] = []
        poster = threading.Thread(target=lambda: [box.post(lambda i=i: seen.append(i)) for i in range(50)])
        poster.start()
        poster.join()  # the loop has not run since: the whole burst waits for one wake-up
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return seen, box.wakeups

    seen, wakeups = asyncio.run(main())
    assert seen == list(range(50))
    assert wakeups == 1


def test_wrapped_futures_carry_results_errors_and_cancellation():
    async def main() -> None:
        box = mailbox_for(asyncio.get_running_loop())
        assert mailbox_for(asyncio.get_running_loop()) is box
        ok, failed, cancelled = (concurrent.futures.Future() for _ in range(3))
        waiters = [box.wrap(f) for f in (ok, failed, cancelled)]
        threading.Thread(target=lambda: (ok.set_result(7), failed.set_exception(ValueError("x")))).start()
        cancelled.cancel()
        assert await waiters[0] == 7
        with pytest.raises(ValueError, match="x"):
            await waiters[1]
        with pytest.raises(asyncio.CancelledError):
            await waiters[2]

    asyncio.run(main())


def decode_row(row: dict) -> int:
    if row["value"] < 0:
        raise bad_request("negative")
    return row["value"] * 2


def test_requests_waiting_for_the_lane_share_one_decode_job_and_keep_their_own_outcomes():
    lanes = CpuLanes(1, 1)
    jobs: list[int] = []
    blocker = threading.Event()

    def submit(fn, *args):
        jobs.append(1)
        return lanes.submit(fn, *args)

    decoder = RequestDecoder(decode_row, submit=submit)
    assert decoder.on_lanes

    async def main() -> list:
        held = lanes.submit(blocker.wait)  # the lane is busy with a batch while the requests arrive
        tasks = [asyncio.ensure_future(decoder({"value": v})) for v in (1, 2, -1, 3)]
        await asyncio.sleep(0.05)
        blocker.set()
        held.result()
        return await asyncio.gather(*tasks, return_exceptions=True)

    try:
        outcomes = asyncio.run(main())
    finally:
        lanes.close(5)
    assert outcomes[:2] == [2, 4] and outcomes[3] == 6
    assert isinstance(outcomes[2], ResponseError) and outcomes[2].status == 400
    assert len(jobs) == 1  # four requests, one lane job


def test_a_decoder_on_closed_lanes_fails_every_waiting_request_at_once():
    lanes = CpuLanes(1, 1)
    lanes.close(5)
    decoder = RequestDecoder(decode_row, submit=lanes.submit)

    async def main() -> list:
        return await asyncio.gather(*(decoder({"value": v}) for v in range(3)), return_exceptions=True)

    outcomes = asyncio.run(asyncio.wait_for(main(), 5))
    assert all(isinstance(o, RuntimeError) and "closed" in str(o) for o in outcomes)
