"""A thread's own intra-op thread count, set so that it stays.

PyTorch keeps the intra-op thread count per thread (OpenMP's), but fills a
thread's count in lazily, on its first parallel op or count query, from the
last value *any* thread set.  So a thread that calls
``torch.set_num_threads(2)`` and runs its first op after another thread
called ``torch.set_num_threads(1)`` (a decode thread starting at the first
request, a best-effort executor) runs on one thread from then on.  Asking
for the count first settles that lazy fill, after which this thread's own
value stays (``tests/unit/test_intra_op.py``).
"""

from __future__ import annotations

import torch


def use_intra_op_threads(count: int) -> None:
    """From now on, the calling thread's torch ops run on ``count`` intra-op threads (its own OpenMP team)."""
    torch.get_num_threads()  # the lazy per-thread fill happens here, before this thread's own value is set
    torch.set_num_threads(count)
