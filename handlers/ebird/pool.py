"""Ebird's input memory pool: a ring of preallocated input slots.

On CUDA each request's input is copied into the next slot the moment it
arrives, on a copy stream with an event the engine waits on (an input
already decoded on the device is copied there directly), so by the time the
scheduler forms a batch the data is already where the model reads it: a
batch is a contiguous run of slots, and batching is a slice of the pool's
storage.  On CPU the same ring is host memory, and a slot keeps its request's
tensors until the batch starts, which stacks its run's rows into the storage
in one call per input tensor, on the lane that runs it.

Slots are handed out in ring order and batches are taken in the same order,
so the ready inputs always form a run starting at ``tail``.  A run never
crosses the end of the ring (that would need a copy); the part after the
wrap becomes ready for the next batch.  Batches may finish out of order; a
slot is reused only when it is free again, so a full pool pushes back on new
requests (the caller waits) instead of overwriting or dropping anything.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from handlers.codecs import ModelInput, collate
from handlers.runtime.engine import RowLayout


class SlotState(enum.Enum):
    FREE = 0
    WRITING = 1
    READY = 2
    TAKEN = 3


@dataclass(frozen=True)
class Run:
    """A contiguous run of slots ``[start, start + count)``."""

    start: int
    count: int


class InputPool:
    def __init__(
        self,
        layout: Sequence[tuple[tuple[int, ...], torch.dtype]],
        capacity: int,
        device: str | torch.device = "cpu",
    ) -> None:
        if capacity < 1:
            raise ValueError(f"pool capacity must be ≥ 1, got {capacity}")
        self.capacity = capacity
        self.layout = tuple((tuple(shape), dtype) for shape, dtype in layout)
        self._row_layout = RowLayout(self.layout)
        self.device = torch.device(device)
        self.storage = tuple(
            torch.empty((capacity, *shape), dtype=dtype, device=self.device) for shape, dtype in self.layout
        )
        # On CUDA a request's bytes go host → pinned staging slot → device
        # slot on a copy stream of the pool's own, and the slot's event marks
        # the copy done; the engine's stream waits on those events, so the
        # copy overlaps whatever the engine is running.  A staging slot is
        # rewritten only after its slot was released, i.e. after the batch
        # that read it finished, so no copy can still be reading it.
        self._copy_stream = None
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(self.device)
            self._staging = tuple(
                torch.empty((capacity, *shape), dtype=dtype, pin_memory=True) for shape, dtype in self.layout
            )
            self._copied = [torch.cuda.Event() for _ in range(capacity)]
        self._state = [SlotState.FREE] * capacity
        # CPU: each ready slot's input, until its batch gathers it into ``storage``.
        self._rows: list[ModelInput | None] = [None] * capacity
        self._head = 0  # next slot to hand out
        self._tail = 0  # oldest slot not yet taken into a batch
        self._lock = threading.Lock()

    def reserve(self) -> int | None:
        """The next slot in ring order, or None when it is still in use (backpressure)."""
        with self._lock:
            slot = self._head
            if self._state[slot] is not SlotState.FREE:
                return None
            self._state[slot] = SlotState.WRITING
            self._head = (slot + 1) % self.capacity
            return slot

    def write(self, slot: int, item: ModelInput | Sequence[torch.Tensor]) -> None:
        """Copy one request's input into ``slot`` and mark it ready."""
        if self._state[slot] is not SlotState.WRITING:
            raise RuntimeError(f"slot {slot} was not reserved")
        item = as_input(item)
        shapes = item.shapes
        if shapes != self._row_layout.shapes:  # Python tuples: no torch attribute read per request on the event loop
            if len(shapes) != len(self._row_layout.shapes):
                raise ValueError(f"expected {len(self._row_layout.shapes)} tensors, got {len(shapes)}")
            wrong = next(i for i, shape in enumerate(shapes) if shape != self._row_layout.shapes[i])
            raise ValueError(f"input shape {list(shapes[wrong])} does not match the pool's "
                             f"{list(self._row_layout.shapes[wrong])}")  # fmt: skip
        if self._copy_stream is None:
            # Kept by reference and copied in with its batch (``wait_copied``), on the lane that
            # runs it: torch calls once per input tensor per batch, not per request on the event
            # loop, each of which waited for the GIL while the lane ran the model.
            self._rows[slot] = item
        else:
            tensors = item.tensors
            with torch.cuda.stream(self._copy_stream):
                for buf, staging, tensor in zip(self.storage, self._staging, tensors, strict=True):
                    if tensor.device == self.device:
                        # Decoded on the device already (batched_decode.py, complete when handed over):
                        # one device copy, and the allocator keeps its memory until the copy stream is done.
                        buf[slot].copy_(tensor, non_blocking=True)
                        tensor.record_stream(self._copy_stream)
                    else:
                        staging[slot].copy_(tensor)
                        buf[slot].copy_(staging[slot], non_blocking=True)
                self._copied[slot].record(self._copy_stream)
        with self._lock:
            self._state[slot] = SlotState.READY

    def ready(self) -> int:
        """Ready inputs in a contiguous run from ``tail`` that does not wrap."""
        with self._lock:
            return self._ready_end() - self._tail

    def ready_run_can_grow(self) -> bool:
        """Whether inputs admitted next would lengthen the run ``ready`` counts.

        Not when the run reaches the ring's end (later inputs wrap to its
        start), nor when the slot after it is in use or the ring is full
        elsewhere: a batch that waits for arrivals then waits for nothing,
        and with the ring full, for ever.
        """
        with self._lock:
            end = self._ready_end()
            if end >= self.capacity:
                return False
            state = self._state[end]
            return state is SlotState.WRITING or (state is SlotState.FREE and self._head == end)

    def _ready_end(self) -> int:
        """One past the ready run from ``tail`` (caller holds the lock)."""
        end = self._tail
        while end < self.capacity and self._state[end] is SlotState.READY:
            end += 1
        return end

    def take(self, count: int) -> Run:
        """Take the next ``count`` ready inputs as one batch."""
        with self._lock:
            start = self._tail
            if count < 1 or start + count > self.capacity:
                raise ValueError(f"cannot take {count} slots from {start} in a ring of {self.capacity}")
            for slot in range(start, start + count):
                if self._state[slot] is not SlotState.READY:
                    raise RuntimeError(f"slot {slot} is not ready")
                self._state[slot] = SlotState.TAKEN
            self._tail = (start + count) % self.capacity
            return Run(start, count)

    def fits(self, item: ModelInput | Sequence[torch.Tensor]) -> bool:
        """Whether one request's input matches the pool's layout (checked before reserving,
        because a reserved slot that is never written would block the ring)."""
        item = as_input(item)
        return self._row_layout.fits(item)

    def wait_copied(self, run: Run, stream: torch.cuda.Stream | None) -> None:
        """Have the run's inputs in ``storage`` before its batch reads them.

        CUDA: make ``stream`` wait until their copies have landed on the
        device.  CPU: gather the inputs ``write`` kept into the run's slice of
        the storage, as batch tensors made once per input (``codecs.collate``,
        on the lane, right before the batch).
        """
        if self._copy_stream is None:
            rows = [self._rows[slot] for slot in range(run.start, run.start + run.count)]
            if any(row is None for row in rows):
                raise RuntimeError(f"slots {run} hold no written input")
            for buf, batch in zip(self.storage, collate(rows), strict=True):
                buf[run.start : run.start + run.count].copy_(batch)
            for slot in range(run.start, run.start + run.count):
                self._rows[slot] = None
            return
        if stream is None:
            return
        for slot in range(run.start, run.start + run.count):
            stream.wait_event(self._copied[slot])

    def views(self, run: Run) -> tuple[torch.Tensor, ...]:
        """The batch tensors of ``run``: slices of the pool's storage, no copy."""
        return tuple(buf[run.start : run.start + run.count] for buf in self.storage)

    def release(self, run: Run) -> None:
        """Free a finished batch's slots (batches may finish in any order)."""
        with self._lock:
            for slot in range(run.start, run.start + run.count):
                if self._state[slot] is not SlotState.TAKEN:
                    raise RuntimeError(f"slot {slot} released twice or never taken")
                self._state[slot] = SlotState.FREE
                self._rows[slot] = None  # a batch that failed before gathering its rows

    def in_use(self) -> int:
        with self._lock:
            return sum(s is not SlotState.FREE for s in self._state)


def as_input(item: ModelInput | Sequence[torch.Tensor]) -> ModelInput:
    """A request's input as a ``ModelInput`` (tests and callers may hand bare tensors)."""
    return item if isinstance(item, ModelInput) else ModelInput(tuple(item))
