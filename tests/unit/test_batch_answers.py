"""Per-batch host work: answers encoded once per batch, hand-offs to the loop once per batch,
token inputs made into tensors once per batch, response timeouts with one timer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from handlers.codecs import InputCodec, ModelInput, answer_bytes, collate, encode_output, encode_outputs
from handlers.errors import ServiceUnavailable
from handlers.runtime.deadlines import Deadlines
from handlers.runtime.engine import RowsEncoder, Ticket, settle_batch
from handlers.runtime.loop_mailbox import LoopMailbox, one_wakeup
from model_store.catalog import get_spec


def reference_answer(row: torch.Tensor) -> dict:
    """The answer format, computed row by row with torch's own top-k."""
    values, indices = torch.topk(row, min(5, row.numel()))
    answer = {"top5": [{"index": i, "logit": v} for v, i in zip(values.tolist(), indices.tolist(), strict=True)]}
    if row.numel() <= 1000:
        answer["logits"] = row.tolist()
    return answer


@pytest.mark.parametrize("classes", [2, 5, 1000, 1001])
def test_a_batch_encoded_at_once_answers_each_row_as_it_would_alone(classes: int) -> None:
    outputs = torch.randn(7, classes, generator=torch.Generator().manual_seed(classes))
    batch = encode_outputs(outputs)
    assert batch == [reference_answer(row) for row in outputs]
    assert [encode_output(row) for row in outputs] == batch
    assert ("logits" in batch[0]) == (classes <= 1000)


def test_non_finite_logits_become_null_and_a_mask_model_answers_its_class_map() -> None:
    row = torch.tensor([[1.0, float("nan"), float("inf")]])
    [answer] = encode_outputs(row)
    assert answer["logits"][1:] == [None, None]
    masks = encode_outputs(torch.randn(2, 3, 4, 4))
    assert all(m["classes"] == 3 and len(m["mask"]) == 4 for m in masks)
    with pytest.raises(ValueError, match="shape"):
        encode_outputs(torch.randn(2, 3, 4))


def test_settle_batch_calls_a_shared_encoder_once_and_keeps_every_other_answer_its_own() -> None:
    calls: list[int] = []

    def encode_rows(rows: torch.Tensor) -> list[bytes]:
        calls.append(len(rows))
        return [answer_bytes(a) for a in encode_outputs(rows)]

    shared = RowsEncoder(encode_rows)
    tickets = [Ticket() for _ in range(5)]
    for t in tickets[:3]:
        t.future.encode = shared
    tickets[3].future.encode = lambda row: f"own {row.shape[0]}"  # a per-row encoder (another wire format)
    outputs = torch.randn(5, 4)
    settle_batch(tickets, outputs)
    assert calls == [3]  # one call for the three that share it
    for i in range(3):
        assert tickets[i].future.result() == answer_bytes(encode_output(outputs[i])) and tickets[i].future.encoded
    assert tickets[3].future.result() == "own 4"
    assert torch.equal(tickets[4].future.result(), outputs[4]) and not tickets[4].future.encoded


def test_a_failing_batch_encoder_fails_its_requests_with_503_and_a_failed_batch_fails_all() -> None:
    def broken(rows: torch.Tensor) -> list[bytes]:
        raise RuntimeError("boom")

    tickets = [Ticket() for _ in range(2)]
    for t in tickets:
        t.future.encode = RowsEncoder(broken)
    settle_batch(tickets, torch.randn(2, 3))
    for t in tickets:
        with pytest.raises(ServiceUnavailable, match="could not encode"):
            t.future.result()
    failed = [Ticket() for _ in range(3)]
    settle_batch(failed, None, ServiceUnavailable("inference failed: X"))
    assert all(isinstance(t.future.exception(), ServiceUnavailable) for t in failed)


def test_a_batch_settled_on_another_thread_wakes_the_loop_once() -> None:
    async def main() -> tuple[list[int], int]:
        box = LoopMailbox(asyncio.get_running_loop())
        tickets = [Ticket() for _ in range(16)]
        waiters = [box.wrap(t.future) for t in tickets]
        worker = threading.Thread(target=lambda: settle_batch(tickets, list(range(16))))
        worker.start()
        results = await asyncio.gather(*waiters)
        worker.join()
        return results, box.wakeups

    results, wakeups = asyncio.run(main())
    assert results == list(range(16))
    assert wakeups == 1


def test_posts_held_by_one_wakeup_keep_their_order_and_nested_blocks_post_at_the_outer_end() -> None:
    async def main() -> tuple[list[int], int, int]:
        box = LoopMailbox(asyncio.get_running_loop())
        seen: list[int] = []
        posted_inside: list[int] = []

        def post_all() -> None:
            with one_wakeup():
                box.post(lambda: seen.append(0))
                with one_wakeup():
                    box.post(lambda: seen.append(1))
                posted_inside.append(box.wakeups)  # nothing posted yet: the outer block holds it
                box.post(lambda: seen.append(2))

        thread = threading.Thread(target=post_all)
        thread.start()
        thread.join()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return seen, box.wakeups, posted_inside[0]

    seen, wakeups, during = asyncio.run(main())
    assert seen == [0, 1, 2] and wakeups == 1 and during == 0


def test_deadlines_fail_only_what_is_still_waiting_and_forget_what_was_answered() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(loop, lambda: ServiceUnavailable("too late"))
        answered, late = loop.create_future(), loop.create_future()
        now = loop.time()
        deadlines.watch(answered, now + 0.05)
        deadlines.watch(late, now + 0.05)
        answered.set_result("ok")
        with pytest.raises(ServiceUnavailable, match="too late"):
            await late
        assert await answered == "ok" and deadlines.expired == 1
        many = [loop.create_future() for _ in range(100)]
        for f in many:
            f.set_result(None)
            deadlines.watch(f, loop.time() + 60)
        assert len(deadlines) <= 1  # answered futures leave the queue as it passes them

    asyncio.run(main())


def test_a_burst_watched_with_one_deadline_fails_only_its_unanswered_members() -> None:
    async def main() -> tuple[list[bool], int]:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(loop, lambda: ServiceUnavailable("too late"))
        done_early = loop.create_future()
        done_early.set_result(None)
        deadlines.watch(done_early, loop.time())
        burst = [loop.create_future() for _ in range(4)]
        deadlines.watch_many(burst, loop.time() + 0.05)
        assert len(deadlines) == 4  # the answered head left as the burst came in
        burst[0].set_result("ok")
        burst[2].set_result("ok")
        await asyncio.sleep(0.1)
        return [f.exception() is not None for f in burst], deadlines.expired

    failed, expired = asyncio.run(main())
    assert failed == [False, True, False, True] and expired == 2


def test_a_deadline_out_of_order_is_still_honoured() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        deadlines = Deadlines(loop, lambda: ServiceUnavailable("late"))
        long, short = loop.create_future(), loop.create_future()
        deadlines.watch(long, loop.time() + 0.2)
        deadlines.watch(short, loop.time() + 0.01)
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            await short
        long.cancel()
        return time.monotonic() - started

    assert asyncio.run(main()) < 5.0


def test_token_requests_stay_python_lists_until_their_batch_is_made() -> None:
    spec = get_spec("bert-tiny1", "eager")
    codec = InputCodec(spec, token_lengths=(8, spec.seq_len))
    short = codec.decode({"body": {"input_ids": [5, 6, 7]}})
    other = codec.decode({"body": {"input_ids": [1, 2, 3, 4]}})
    assert short.rows == ([5, 6, 7, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0, 0])
    assert short.shapes == ((8,), (8,)) and short.dtypes == (torch.long, torch.long)
    ids, mask = collate([short, other])
    assert ids.dtype == torch.long and ids.tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0]]
    assert mask.sum().item() == 7
    stacked = collate([ModelInput(short.tensors), ModelInput(other.tensors)])  # built on demand, same batch
    assert all(torch.equal(a, b) for a, b in zip(stacked, (ids, mask), strict=True))
    with pytest.raises(ValueError, match="either tensors or token rows"):
        ModelInput((torch.zeros(2),), rows=([1],))
