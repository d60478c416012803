"""``use_intra_op_threads``: a thread's own count survives another thread's ``torch.set_num_threads``."""

from __future__ import annotations

import threading

import torch

from handlers.runtime.intra_op import use_intra_op_threads


def _count_after_another_thread_sets_one(set_count) -> int:  # noqa: ANN001 - a setter
    ready, go, seen = threading.Event(), threading.Event(), []

    def executor() -> None:
        set_count(2)
        ready.set()
        go.wait()
        seen.append(torch.get_num_threads())  # this thread's first count query: torch's lazy fill

    before = torch.get_num_threads()
    thread = threading.Thread(target=executor)
    thread.start()
    ready.wait()
    torch.set_num_threads(1)  # what a decode thread's start or a best-effort executor does
    go.set()
    thread.join()
    torch.set_num_threads(before)
    return seen[0]


def test_a_count_set_with_torch_alone_is_overwritten_by_another_thread_s_later_one() -> None:
    # The hazard itself, so that the test below means something on this torch.
    assert _count_after_another_thread_sets_one(torch.set_num_threads) == 1


def test_a_count_set_with_use_intra_op_threads_stays_the_thread_s_own() -> None:
    assert _count_after_another_thread_sets_one(use_intra_op_threads) == 2
