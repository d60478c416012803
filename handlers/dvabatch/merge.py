"""Length classes merged where, at the recent mix of lengths, one padded batch costs less than several.

The input-diversity policy gives each length class its own engine, so a
short request never pays for a long one's padding.  That pays where compute
grows with the length (BERT-base at 16 against 128 tokens).  Where a batch's
cost is mostly per batch, not per token (a one-layer BERT, or any model on a
fast GPU, where the host's work per batch and per stage is the bottleneck),
the classes only cut one batch into several: measured on the one-layer
BERT on the 2-vCPU VM, DVABatch with four classes served 0.68× NO Wait's
capacity at mean batch 16, and 1.04× with every request padded to one class
(``docs/benchmarks/host_path.md``).

So the row line (``handlers/runtime/row_line.py``) asks, at each hand-over,
which class each class's rows run in (:func:`merge_classes`): adjacent
classes are cut into runs, each run padded to its longest class, at the
least total time for one full batch of the recent mix of lengths.  A batch
of a class costs its stages' times in the profile the classes' engines
measure together at worker start, plus what a run has cost its lane beyond
that in service (``overhead.py``), which is the same for every class and
paid once per batch.  There is no threshold: on a compute-bound model the
classes stay apart, on a host-bound one they merge.

The decision reads the recent mix, not the hand-over alone.  Decided per
hand-over, a burst of one class (the clients a batch of that class just
answered, in a closed loop) has nothing to merge with and starts a batch of
its own; its answers come back together, and so does its next burst.  The
classes then stayed apart for good under 64 closed-loop clients (batches
of 19 where merged ones reached 32), depending on how the run began.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

from handlers.codecs import ModelInput, widen_tokens
from handlers.dvabatch.engine import DvaBatchEngine
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_line import RowGroup

# The mix of lengths is what the last few batches' worth of rows held: each row's weight halves after this
# many full batches of rows have come after it.
MIX_HALF_LIFE_BATCHES = 2


def merge_classes(counts: Sequence[float], rows_ms: Callable[[int, float], float]) -> list[int]:
    """The class each class's rows run in: ``target[i] ≥ i``, for classes in ascending length.

    ``counts[i]``: rows of class ``i``; ``rows_ms(j, n)``: the measured time
    to run ``n`` rows padded to class ``j``.  The classes with rows are cut
    into runs of adjacent ones (classes without rows between them do not
    separate them), each run padded to its longest class, at the least total
    time (exact, by dynamic programming over the cut points); on a tie the
    classes stay apart.  A class without rows maps to itself.
    """
    present = [i for i, n in enumerate(counts) if n > 0]
    target = list(range(len(counts)))
    # best[k]: the least time for the first k present classes; cut[k]: where its last run starts.
    best = [0.0] + [math.inf] * len(present)
    cut = [0] * (len(present) + 1)
    for end in range(1, len(present) + 1):
        longest = present[end - 1]
        rows = 0.0
        for start in range(end - 1, -1, -1):  # the shortest last run first, so a tie keeps classes apart
            rows += counts[present[start]]
            total = best[start] + rows_ms(longest, rows)
            if total < best[end]:
                best[end], cut[end] = total, start
    end = len(present)
    while end > 0:
        start = cut[end]
        for k in range(start, end):
            target[present[k]] = present[end - 1]
        end = start
    return target


def batches_ms(batch_ms: Callable[[float], float], rows: float, max_batch: int) -> float:
    """The time to run ``rows`` in batches of at most ``max_batch``, given one batch's time by its rows."""
    full, rest = divmod(rows, max_batch)
    return full * batch_ms(max_batch) + (batch_ms(rest) if rest > 0 else 0.0)


class LengthClassMerger:
    """The row line's ``regroup`` for DVABatch's length classes: keeps the recent mix of lengths, decides
    with :func:`merge_classes` on one full batch of it, and widens the rows of a merged class to the
    class they run in, handing them to its engine."""

    def __init__(
        self,
        classes: Sequence[tuple[int, DvaBatchEngine]],
        max_batch: int,
        stages: int,
        metrics: HandlerMetrics | None = None,
    ) -> None:
        """``classes``: (length, engine) per length class, in any order; a batch of a class costs its
        engine's ``batch_ms`` plus ``stages`` times the runs' fitted overhead (``run_overhead_ms``)."""
        ordered = sorted(classes, key=lambda c: c[0])
        self.lengths = [length for length, _ in ordered]
        self._engines = [engine for _, engine in ordered]
        self._index = {id(engine): i for i, engine in enumerate(self._engines)}
        self.max_batch = max_batch
        self._metrics = metrics
        self._lock = threading.Lock()  # two lanes may run hand-overs at once
        self._mix = [0.0] * len(ordered)  # recent rows per class, older ones weighing less
        self._stages = stages

    def batch_overhead_ms(self) -> float:
        """What a batch costs beyond its stages' profiled times: each engine's fitted cost per stage run
        (``overhead.py``), weighted by the runs it was fitted on, times the stages a batch runs."""
        fits = [engine.run_overhead_ms() for engine in self._engines]
        weight = sum(w for _, w in fits)
        if weight <= 0.0:
            return 0.0
        return self._stages * sum(ms * w for ms, w in fits) / weight

    def rows_ms(self, index: int, rows: float, overhead_ms: float = 0.0) -> float:
        """``rows`` of class ``index`` in batches: each its profiled time plus ``overhead_ms`` (a share of it
        for a batch of less than one row: a class expected in a tenth of the batches pays a tenth)."""
        engine = self._engines[index]
        return batches_ms(lambda n: engine.batch_ms(n) + overhead_ms * min(n, 1.0), rows, self.max_batch)

    def targets(self, counts: Sequence[int]) -> list[int]:
        """Add a hand-over's rows per class to the mix; the class each class runs in, for one batch of it."""
        with self._lock:
            keep = 0.5 ** (sum(counts) / (MIX_HALF_LIFE_BATCHES * self.max_batch))
            self._mix = [m * keep + n for m, n in zip(self._mix, counts, strict=True)]
            total = sum(self._mix)
            batch = [self.max_batch * m / total for m in self._mix]
        overhead = self.batch_overhead_ms()
        return merge_classes(batch, lambda index, rows: self.rows_ms(index, rows, overhead))

    def __call__(self, groups: list[RowGroup]) -> list[RowGroup]:
        by_class: dict[int, RowGroup] = {}
        others: list[RowGroup] = []
        for group in groups:
            index = self._index.get(id(group.engine))
            if index is None:
                others.append(group)
            else:
                by_class[index] = group
        if not by_class:
            return groups
        target = self.targets([len(by_class[i].positions) if i in by_class else 0 for i in range(len(self.lengths))])
        merged: dict[int, list[tuple[int, ModelInput]]] = {}
        for index in sorted(by_class):
            group, to = by_class[index], target[index]
            if to != index:
                length = self.lengths[to]
                items = [widen_tokens(item, length) for item in group.items]
                if self._metrics is not None:
                    self._metrics.operation("pad_up")
            else:
                items = group.items
            merged.setdefault(to, []).extend(zip(group.positions, items, strict=True))
        result = []
        for to, pairs in merged.items():
            pairs.sort(key=lambda pair: pair[0])  # arrival order within the merged batch
            result.append(RowGroup(self._engines[to], [p for p, _ in pairs], [item for _, item in pairs]))
        return result + others
