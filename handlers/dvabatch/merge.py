"""Length classes merged per hand-over where one padded batch costs less than several.

The input-diversity policy gives each length class its own engine, so a
short request never pays for a long one's padding.  That pays where compute
grows with the length (BERT-base at 16 against 128 tokens).  Where a batch's
cost is mostly per batch, not per token (a one-layer BERT, or any model on a
fast GPU, where the host's work per batch and per stage is the bottleneck),
the classes only split one batch into several: measured on the one-layer
BERT on the 2-vCPU VM, DVABatch with four classes served 0.68× NO Wait's
capacity at mean batch 16, and 1.04× with every request padded to one class
(``docs/benchmarks/host_path.md``).

So the row line (``handlers/runtime/row_line.py``), for each hand-over,
asks :func:`merge_classes` which classes run together: a run of adjacent
classes pads to its longest when the segment profile, measured at worker
start, says the run's batches take less time than each class's own.  The
decision reads this machine's stage times at these row counts, with no
threshold: on a compute-bound model the classes stay apart, on a host-bound
one they merge, and a handful of rows merges sooner than a full batch.

Rows an engine already holds unstarted (its first stage busy) are counted:
new rows that join them cost only what they add to that batch, so under load
the hand-overs keep filling the batch that waits, as NO Wait's queue fills
while its model runs, instead of each starting a batch of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from handlers.codecs import ModelInput, widen_tokens
from handlers.dvabatch.engine import DvaBatchEngine
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_line import RowGroup


def merge_classes(
    counts: Sequence[int], rows_ms: Callable[[int, int], float], joinable: Sequence[bool] | None = None
) -> list[int]:
    """The class each class's rows run in: ``target[i] ≥ i``, for classes in ascending length.

    ``counts[i]``: rows of class ``i`` in this hand-over; ``rows_ms(j, n)``:
    the measured time ``n`` rows add when they run padded to class ``j``;
    ``joinable[j]``: class ``j`` holds unstarted rows that rows of its own
    or shorter classes may join.  The classes are cut into runs of adjacent
    ones, each run's rows padded to its longest class, at the least total
    time (exact, by dynamic programming over the cut points).  A run ends at
    a class with rows or a joinable one; on a tie the classes stay apart.
    A class without rows maps to itself.
    """
    k = len(counts)
    ends = [counts[j] > 0 or bool(joinable and joinable[j]) for j in range(k)]
    # best[e]: the least time for classes 0..e-1; cut[e]: where the last of those runs starts.
    best = [0.0] + [float("inf")] * k
    cut = list(range(-1, k))
    for end in range(1, k + 1):
        last = end - 1
        if not ends[last]:  # no rows and nothing to join: a run of its own, empty
            best[end], cut[end] = best[last], last
            continue
        rows = 0
        for start in range(last, -1, -1):  # the shortest last run first, so a tie keeps classes apart
            rows += counts[start]
            total = best[start] + (rows_ms(last, rows) if rows else 0.0)
            if total < best[end]:
                best[end], cut[end] = total, start
    target = list(range(k))
    end = k
    while end > 0:
        start = cut[end]
        for i in range(start, end):
            if counts[i] > 0:
                target[i] = end - 1
        end = start
    return target


def batches_ms(batch_ms: Callable[[int], float], rows: int, max_batch: int) -> float:
    """The time to run ``rows`` in batches of at most ``max_batch``, given one batch's time by its rows."""
    full, rest = divmod(rows, max_batch)
    return full * batch_ms(max_batch) + (batch_ms(rest) if rest else 0.0)


class LengthClassMerger:
    """Applies :func:`merge_classes` to a hand-over's groups: rows of a merged class are widened to the
    class they run in and handed to its engine (the row line's ``regroup``)."""

    def __init__(
        self, classes: Sequence[tuple[int, DvaBatchEngine]], max_batch: int, metrics: HandlerMetrics | None = None
    ) -> None:
        """``classes``: (length, engine) per length class, in any order; each engine's ``batch_ms`` is its cost."""
        ordered = sorted(classes, key=lambda c: c[0])
        self.lengths = [length for length, _ in ordered]
        self._engines = [engine for _, engine in ordered]
        self._index = {id(engine): i for i, engine in enumerate(self._engines)}
        self.max_batch = max_batch
        self._metrics = metrics

    def rows_ms(self, index: int, rows: int, waiting: int = 0) -> float:
        """The time ``rows`` more add to class ``index``, where ``waiting`` rows will run before them anyway."""
        cost, most = self._engines[index].batch_ms, self.max_batch
        return batches_ms(cost, waiting + rows, most) - batches_ms(cost, waiting, most)

    def __call__(self, groups: list[RowGroup]) -> list[RowGroup]:
        by_class: dict[int, RowGroup] = {}
        others: list[RowGroup] = []
        for group in groups:
            index = self._index.get(id(group.engine))
            if index is None:
                others.append(group)
            else:
                by_class[index] = group
        # Rows a class's engine holds unstarted: new rows join them, paying only for the rows they add
        # (a busy first stage is where a batch grows, as NO Wait's queue grows while its model runs).
        waiting = [engine.unstarted_rows() for engine in self._engines]
        if not by_class or (len(by_class) < 2 and not any(waiting[min(by_class) + 1 :])):
            return groups
        counts = [len(by_class[i].positions) if i in by_class else 0 for i in range(len(self._engines))]
        target = merge_classes(
            counts, lambda index, rows: self.rows_ms(index, rows, waiting[index]), [w > 0 for w in waiting]
        )
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
