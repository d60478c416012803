"""DVABatch's policies over the batch table: where newcomers go, and when a batch is split.

Pure decisions on plain state; the engine (``engine.py``) carries them out.

- **Load diversity (stretch).**  Newcomers never wait for a batching window.
  They join a batch that has not started yet, if one stands before stage 0
  with room; else they stretch the latest batch in flight, if it was created
  less than ``t_comp_wait`` ago and has room (they catch up and merge where
  it waits, which it does for them); else they form a new batch.
- **Operator diversity (split).**  Before a batch of ``bs`` runs stage ``s``,
  it is split in halves when ``T_remain(bs) ≥ 2 · T_remain(bs/2)`` by the
  segment profile: the two halves one after the other finish no later than
  the whole, and the first half's requests finish earlier.  Without a
  profile nothing is split.

Input diversity (clustering token inputs by length) is not a decision over
the batch table: the codec pads each request to its length class
(``handler.token_lengths``) and the runtime gives each class its own engine
and table (``DvaBatchHandler``), so requests of one class batch together.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from handlers.dvabatch.batch_table import BatchEntry, BatchTable
from handlers.runtime.segment_profile import SegmentProfile
from handlers.settings import known_settings


class DvaBatchConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DvaBatchConfig:
    """The archive's ``handler.dvabatch`` settings."""

    segments: int = 2  # stages the model is cut into
    max_batch: int = 16  # rows a batch may grow to
    t_comp_wait_ms: float = 20.0  # a batch may be stretched until it is this old
    max_inflight: int = 64  # requests admitted at once (then the runtime waits for room)
    stretch: bool = True
    split: bool = True
    # Token models with length classes: run a hand-over's classes together, padded to the longest, where the
    # segment profile says one batch costs less than several (``merge.py``).
    merge_lengths: bool = True
    # CPU lanes the stages run on (null: one per stage, a pipeline with the
    # cores split among the stages; 1: every stage on all the cores, one at
    # a time).  See ``DvaBatchHandler.cpu_lane_count``.
    cpu_lanes: int | None = None
    # CUDA only: each stage replays a captured graph per batch bucket (``runtime/stage_programs.py``).
    cuda_graphs: bool = True
    # CPU only: each stage runs a TorchScript trace per batch bucket where that measured no slower than the
    # stage at the bucket's fewest rows (``runtime/stage_programs.py``); off: every stage from its fx graph.
    cpu_traces: bool = True

    def __post_init__(self) -> None:
        for name in ("segments", "max_batch", "max_inflight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DvaBatchConfigError(f"{name} must be an integer ≥ 1, got {value!r}")
        if isinstance(self.t_comp_wait_ms, bool) or not isinstance(self.t_comp_wait_ms, (int, float)):
            raise DvaBatchConfigError(f"t_comp_wait_ms must be a number, got {self.t_comp_wait_ms!r}")
        if self.t_comp_wait_ms < 0:
            raise DvaBatchConfigError(f"t_comp_wait_ms must be ≥ 0, got {self.t_comp_wait_ms}")
        for name in ("stretch", "split", "merge_lengths", "cuda_graphs", "cpu_traces"):
            if not isinstance(getattr(self, name), bool):
                raise DvaBatchConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.cpu_lanes is not None:
            lanes = self.cpu_lanes
            if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= self.segments:
                raise DvaBatchConfigError(
                    f"cpu_lanes must be null or an integer from 1 to segments ({self.segments}), got {lanes!r}"
                )
        if self.max_inflight < self.max_batch:
            raise DvaBatchConfigError(f"max_inflight ({self.max_inflight}) must hold one full batch ({self.max_batch})")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DvaBatchConfig:
        raw = known_settings(cls, raw, "dvabatch", DvaBatchConfigError)
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Placement:
    """Where ``count`` newcomers go: ``join`` a batch before stage 0, ``stretch`` one in flight, or ``new``."""

    kind: str
    count: int
    target: int | None = None


class DvaPolicy:
    def __init__(self, config: DvaBatchConfig, profile: SegmentProfile | None = None) -> None:
        self.config = config
        self.profile = profile

    def place(self, table: BatchTable, pending: int, now: float) -> Placement:
        """Where the next of ``pending`` newcomers (≥ 1) go."""
        room = self.config.max_batch
        waiting = [e for e in table.waiting_at(0) if e.joins is None and e.size < room]
        if waiting:
            target = waiting[-1]  # the newest not-started batch: the one most likely to have room
            return Placement("join", min(pending, room - target.size), target.id)
        latest = table.latest()
        if (
            self.config.stretch
            and latest is not None
            and latest.stage > 0
            and latest.size < room
            and now - latest.created <= self.config.t_comp_wait_ms / 1e3
        ):
            pending_for_it = sum(e.size for e in table if e.joins == latest.id)
            if latest.size + pending_for_it < room:
                return Placement("stretch", min(pending, room - latest.size - pending_for_it), latest.id)
        return Placement("new", min(pending, room))

    @staticmethod
    def hold(entry: BatchEntry, table: BatchTable) -> bool:
        """Whether a batch waits before its next stage for catch-up batches bound for it.

        Without the wait a stretched batch would merge only by luck: in a
        pipeline whose next stage is free it moves on before its newcomers
        arrive.  The wait is bounded: catch-ups stand at earlier stages,
        which the held batch does not occupy, and stretching stops once the
        batch is ``t_comp_wait`` old.
        """
        return any(e.joins == entry.id and e.stage < entry.stage for e in table)

    def split_sizes(self, entry: BatchEntry) -> list[int] | None:
        """Halves for a batch about to run its stage, where the profile says they cost no more than the whole."""
        if not self.config.split or self.profile is None or entry.size < 2:
            return None
        half = entry.size // 2
        whole = self.profile.remaining_ms(entry.stage, entry.size)
        parts = self.profile.remaining_ms(entry.stage, half) + self.profile.remaining_ms(entry.stage, entry.size - half)
        if whole >= parts:
            return [half, entry.size - half]
        return None
