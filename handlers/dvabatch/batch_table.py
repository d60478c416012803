"""DVABatch's batch table: the batches in flight over a model's stages, and the three meta operations.

A model runs as ``stages`` segments (``handlers/runtime/segments.py``), one
executor each, with a queue between adjacent stages.  The table records, for
every batch in flight, which requests its rows belong to, when it was
created, the next stage it stands before and whether it is running there, and
how many rows have completed each stage.  Schedulers (the policies) change
batches that are already on their way only through three operations:

- **new**: a batch of newcomers enters before stage 0;
- **stretch**: newcomers join an ongoing batch.  They enter as a *catch-up*
  batch linked to it, run the stages the target has done, and merge with it
  the moment both stand, idle, before the same stage.  Refused once the
  target has been in flight longer than ``t_comp_wait`` (the paper's bound on
  how long a batch may keep growing), or when it has finished;
- **split**: a batch is cut into parts that go on on their own.  Each part
  keeps its rows' requests, the parent's creation time and stage, and its
  share of the completed counts.

Pure bookkeeping: no tensors, no threads, no clock.  The engine moves states
(``split_state`` / ``merge_states``) in the same row order the table does, so
row ``i`` of a batch's state is always the table's ``requests[i]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field


class BatchTableError(RuntimeError):
    """An operation the table's state does not allow (a mechanism bug, not bad input)."""


@dataclass
class BatchEntry:
    id: int
    requests: list[Hashable]  # row i belongs to requests[i]
    created: float
    stage: int = 0  # the next stage to run; == stages when finished
    running: bool = False
    completed: list[int] = field(default_factory=list)  # rows that completed each stage
    parent: int | None = None  # the batch it was split from
    joins: int | None = None  # a catch-up batch: the batch it merges into

    @property
    def size(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class Merge:
    """A catch-up batch merged into its target: the engine joins their states, target rows first."""

    target: int
    catch_up: int
    stage: int


class BatchTable:
    def __init__(self, stages: int) -> None:
        if stages < 1:
            raise ValueError(f"a model has at least one stage, got {stages}")
        self.stages = stages
        self._entries: dict[int, BatchEntry] = {}
        self._ids = itertools.count()

    # -- reading --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BatchEntry]:
        return iter(list(self._entries.values()))

    def __getitem__(self, batch_id: int) -> BatchEntry:
        try:
            return self._entries[batch_id]
        except KeyError:
            raise BatchTableError(f"no batch {batch_id} in the table") from None

    def waiting_at(self, stage: int) -> list[BatchEntry]:
        """Batches standing idle before ``stage``, oldest first."""
        return sorted(
            (e for e in self._entries.values() if e.stage == stage and not e.running), key=lambda e: (e.created, e.id)
        )

    def latest(self) -> BatchEntry | None:
        """The most recently created batch that is not a catch-up batch: where stretch aims."""
        owners = [e for e in self._entries.values() if e.joins is None and e.stage < self.stages]
        return max(owners, key=lambda e: (e.created, e.id), default=None)

    # -- meta operations ----------------------------------------------------------------

    def new(self, requests: Sequence[Hashable], now: float) -> BatchEntry:
        if not requests:
            raise BatchTableError("a batch needs at least one request")
        entry = BatchEntry(next(self._ids), list(requests), now, completed=[0] * self.stages)
        self._entries[entry.id] = entry
        return entry

    def join(self, batch_id: int, requests: Sequence[Hashable]) -> BatchEntry:
        """Add newcomers to a batch that has not started: nothing to catch up."""
        entry = self[batch_id]
        if entry.stage != 0 or entry.running or entry.joins is not None:
            raise BatchTableError(f"batch {batch_id} has started; newcomers must stretch it instead")
        entry.requests.extend(requests)
        return entry

    def drop(self, batch_id: int) -> list[Hashable]:
        """Remove a batch whose stage failed; its requests, to be answered with the error."""
        return self._remove(batch_id)

    def _remove(self, batch_id: int) -> list[Hashable]:
        """Take a batch out; catch-ups bound for it can no longer merge and go on alone."""
        entry = self[batch_id]
        del self._entries[batch_id]
        for other in self._entries.values():
            if other.joins == batch_id:
                other.joins = None
        return entry.requests

    def stretch(
        self, requests: Sequence[Hashable], target_id: int, now: float, t_comp_wait: float
    ) -> BatchEntry | None:
        """A catch-up batch of ``requests`` bound for ``target_id``, or None when the target may no longer grow."""
        target = self._entries.get(target_id)
        if target is None or target.stage >= self.stages or target.joins is not None:
            return None
        if now - target.created > t_comp_wait:
            return None
        if target.stage == 0 and not target.running:
            return self.join(target_id, requests)  # it has not started: nothing to catch up
        entry = self.new(requests, now)
        entry.joins = target_id
        return entry

    def split(self, batch_id: int, sizes: Sequence[int]) -> list[BatchEntry]:
        """Cut an idle batch into consecutive parts of ``sizes`` rows."""
        entry = self[batch_id]
        if entry.running:
            raise BatchTableError(f"batch {batch_id} is running; split it between stages")
        if sum(sizes) != entry.size or any(s <= 0 for s in sizes) or len(sizes) < 2:
            raise BatchTableError(f"cannot split a batch of {entry.size} into {list(sizes)}")
        del self._entries[batch_id]
        parts, start = [], 0
        for size in sizes:
            rows = entry.requests[start : start + size]
            start += size
            part = BatchEntry(
                next(self._ids),
                rows,
                entry.created,
                stage=entry.stage,
                completed=[size if s < entry.stage else 0 for s in range(self.stages)],
                parent=batch_id,
                joins=entry.joins,
            )
            self._entries[part.id] = part
            parts.append(part)
        # Catch-up batches bound for the split batch now follow its first part.
        for other in self._entries.values():
            if other.joins == batch_id:
                other.joins = parts[0].id
        return parts

    # -- execution bookkeeping -----------------------------------------------------------

    def start(self, batch_id: int) -> BatchEntry:
        entry = self[batch_id]
        if entry.running or entry.stage >= self.stages:
            raise BatchTableError(f"batch {batch_id} cannot start (running={entry.running}, stage={entry.stage})")
        entry.running = True
        return entry

    def finish_stage(self, batch_id: int) -> list[Merge]:
        """Record that the batch ran its stage; merge it with its target or catch-ups that now stand idle with it."""
        entry = self[batch_id]
        if not entry.running:
            raise BatchTableError(f"batch {batch_id} is not running")
        entry.completed[entry.stage] += entry.size
        entry.stage += 1
        entry.running = False
        return self.try_merge(batch_id)

    def try_merge(self, batch_id: int) -> list[Merge]:
        """Merge catch-up batches into their targets where both stand idle before the same stage.

        ``batch_id`` is either a catch-up batch (it may merge into its target)
        or a target (its waiting catch-ups may merge into it, oldest first).
        """
        entry = self[batch_id]
        if entry.joins is not None:
            pairs = [(self._entries.get(entry.joins), entry)]
        else:
            catch_ups = sorted((e for e in self._entries.values() if e.joins == entry.id), key=lambda e: e.id)
            pairs = [(entry, e) for e in catch_ups]
        merges = []
        for target, catch_up in pairs:
            if target is None:  # the target finished first: the catch-up goes on alone
                catch_up.joins = None
                continue
            meet = target.stage == catch_up.stage < self.stages
            if meet and not target.running and not catch_up.running:
                target.requests.extend(catch_up.requests)
                for s in range(self.stages):
                    target.completed[s] += catch_up.completed[s]
                del self._entries[catch_up.id]
                merges.append(Merge(target.id, catch_up.id, target.stage))
        return merges

    def complete(self, batch_id: int) -> list[Hashable]:
        """Remove a batch that ran every stage; its requests, in row order."""
        entry = self[batch_id]
        if entry.stage < self.stages or entry.running:
            raise BatchTableError(f"batch {batch_id} has not finished (stage {entry.stage} of {self.stages})")
        return self._remove(batch_id)
