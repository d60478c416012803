"""What a batch of each size costs per input where it actually runs: on a lane, while serving.

A scheduler that picks batch sizes by cost (Ebird's CPU lane rule) needs
each size's cost per input.  Timed alone at warm-up, back to back, a batch
is cheaper than the same batch inside TorchServe: there the frontend, the
worker's socket threads and the event loop share the cores with the
batch's OpenMP team and stall it.  On a 2-core AMD EPYC VM, ResNet-50's
batch of 1 took ~63 ms back to back and ~77 ms while serving, and NO
Wait's batches in the same run (101.5 ms at a mean of 1.41 inputs) fit the
same stall of ~15 ms per batch (docs/benchmarks/README.md, the lane rule's
scratch breakdowns): it weighs most on small batches.  So the warm-up
times are only the first guess; each size's cost becomes the median of its
last ``window`` served batches once it has ``min_served`` of them.  A size
that has not run keeps its warm-up guess; where that guess makes it the
size to take, the scheduler tries it and so learns its real cost.

Served costs go stale.  A size that stops being taken because a few of its
batches were slow (stalled by a burst of Python on the event loop, say)
is never served again, so its slow median would stand for good: on a
one-layer BERT, Ebird locked in batches of 16 in about half of its runs,
after a few batches of 32 at 4.3 ms (served ones take ~1.5 ms), and then
served ~20 % fewer requests (``docs/benchmarks/host_path.md``).  So a
size's served costs are forgotten once ``stale_after`` batches of other
sizes have run since its last one: it falls back to its warm-up guess and,
where that makes it the size to take, is served and measured again, a few
batches per ``stale_after``.

Not thread-safe: the owner records and reads under its own lock.
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable

DEFAULT_WINDOW = 32
DEFAULT_MIN_SERVED = 3  # one slow batch must not move a size's cost on its own
DEFAULT_STALE_AFTER = 256  # batches: a re-measurement of min_served batches costs ~1 % of them at most


class BatchCosts:
    def __init__(
        self,
        sizes: Iterable[int],
        window: int = DEFAULT_WINDOW,
        min_served: int = DEFAULT_MIN_SERVED,
        stale_after: int = DEFAULT_STALE_AFTER,
    ) -> None:
        self.sizes = tuple(sorted(set(sizes)))
        if not self.sizes or self.sizes[0] < 1:
            raise ValueError(f"need batch sizes ≥ 1, got {list(sizes)}")
        if window < 1 or not 1 <= min_served <= window:
            raise ValueError(f"need 1 ≤ min_served ≤ window, got {min_served} and {window}")
        if stale_after < 1:
            raise ValueError(f"need stale_after ≥ 1, got {stale_after}")
        self.min_served = min_served
        self.stale_after = stale_after
        self._recorded = 0  # batches recorded so far, of any size
        self._last: dict[int, int] = {}  # per size, ``_recorded`` at its latest batch
        self._guess: dict[int, float] = {}
        self._served: dict[int, collections.deque[float]] = {b: collections.deque(maxlen=window) for b in self.sizes}

    def guess(self, size: int, seconds: float) -> None:
        """A warm-up time for ``size``: used until it has been served ``min_served`` times."""
        self._check(size, seconds)
        self._guess[size] = seconds

    def record(self, size: int, seconds: float) -> None:
        """A served batch of ``size`` took ``seconds`` from start to output."""
        self._check(size, seconds)
        self._served[size].append(seconds)
        self._recorded += 1
        self._last[size] = self._recorded
        for other, last in list(self._last.items()):
            if self._recorded - last > self.stale_after:  # not served for a while: measure it afresh
                self._served[other].clear()
                del self._last[other]

    def served(self, size: int) -> int:
        return len(self._served[size])

    def per_input_ms(self) -> dict[int, float]:
        """Cost per input, by size, for every size that has a guess or enough served batches."""
        out = {}
        for size in self.sizes:
            served = self._served[size]
            if len(served) >= self.min_served:
                out[size] = 1e3 * statistics.median(served) / size
            elif size in self._guess:
                out[size] = 1e3 * self._guess[size] / size
        return out

    def _check(self, size: int, seconds: float) -> None:
        if size not in self._served:
            raise ValueError(f"batch size {size} is not one of {list(self.sizes)}")
        if not seconds > 0:
            raise ValueError(f"a batch takes a positive time, got {seconds!r}")
