"""A segmented model's pieces as static-shape programs, one per batch bucket.

Two handlers run a model piece by piece: DVABatch's stages and REEF's
best-effort launch units (its preemption points), both ``SegmentedModel``
segments.  On a fast GPU each piece run eagerly is one Python call per
operator, and a preemption point then sits between two long runs of
launches; captured, a piece is one copy in and one graph replay.

DVABatch moves batches between stages and reshapes them on the way (a
newcomer joins, a catch-up batch merges, a batch splits in halves), so a
stage sees a different row count almost every time it runs.  Run eagerly,
each run is one Python call per operator of the stage, and on a fast GPU
that launch work, not the kernels, is what a stage costs: on the lent
H200, DVABatch's BERT-base sustained 136 requests/s where stock batching
sustained 1,235 (``docs/benchmarks/dvabatch_direct_bert-base_cuda.md``).

A CUDA graph per (stage, bucket) makes a stage one copy in and one replay:

- buckets are the powers of two up to the largest batch (and that batch);
  a batch of n rows runs in the smallest bucket of at least n rows, its
  state copied into the graph's static input buffers.  The padding rows
  hold whatever the buffers last held: every row of a stage is computed on
  its own (the state is batch-first throughout, ``segments.py``), so they
  cost time, never another row's answer;
- the graphs of one stage share a memory pool (one batch runs a stage at a
  time), each stage has its own (stages run at once, as a pipeline);
- a replay's outputs live in the graph's static buffers, which the stage's
  next replay overwrites while this batch may still wait before the next
  stage: so the first n rows are copied out (one device copy per state
  tensor).

``StagePrograms`` without graphs runs the same padded shapes eagerly (row 0
repeated into the padding): what the tests check the buckets' answers with
on a CPU, where the engine itself runs each stage at the batch's own rows
(padding a CPU stage would only add compute).  A batch larger than every
bucket runs eagerly at its own rows.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.runtime.cuda_graphs import capture
from handlers.runtime.segments import SegmentedModel, State, batch_rows, state_rows


def bucket_sizes(max_batch: int) -> list[int]:
    """The batch sizes a stage is programmed for: 1, 2, 4, … up to ``max_batch`` (always included)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be ≥ 1, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return [*sizes, max_batch]


def padded(state: State, rows: int) -> State:
    """``state`` grown to ``rows`` rows by repeating its first row (a row every stage can compute)."""
    have = state_rows(state)
    if have == rows:
        return state
    if have > rows:
        raise ValueError(f"cannot pad {have} rows down to {rows}")
    return {k: torch.cat([v, v[:1].expand(rows - have, *v.shape[1:])]) for k, v in state.items()}


def trimmed(state: State, rows: int) -> State:
    return {k: v[:rows] for k, v in state.items()}


@dataclass
class StageGraph:
    """One stage captured at one bucket: static input and output state buffers around a CUDA graph."""

    bucket: int
    graph: Any  # torch.cuda.CUDAGraph
    inputs: State
    outputs: State

    def replay(self, state: State) -> State:
        rows = state_rows(state)
        for name, static in self.inputs.items():
            static[:rows].copy_(state[name], non_blocking=True)
        self.graph.replay()
        # Copied out: this stage's next replay overwrites its static outputs (see the module doc).
        return {name: value[:rows].clone() for name, value in self.outputs.items()}


class StagePrograms:
    """Run stage ``s`` on a state as one program of the smallest bucket that holds its rows.

    ``graphs``: capture one CUDA graph per (stage, bucket) now (the model and
    ``example`` on a CUDA device); else run the padded shapes eagerly.
    ``calls`` counts the programs run, by (stage, bucket): one per batch
    that runs a stage, however many requests it holds.
    """

    def __init__(
        self, sliced: SegmentedModel, example: Sequence[torch.Tensor], buckets: Sequence[int], graphs: bool = False
    ) -> None:
        self.sliced = sliced
        self.buckets = sorted(set(buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"need bucket sizes ≥ 1, got {list(buckets)}")
        self.graphs: dict[tuple[int, int], StageGraph] = {}
        self.calls: collections.Counter[tuple[int, int | None]] = collections.Counter()
        if graphs:
            self._capture_all(example)

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows``, or None above the largest."""
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def run(self, stage: int, state: State) -> State:
        rows = state_rows(state)
        bucket = self.bucket_for(rows)
        self.calls[(stage, bucket)] += 1
        if bucket is None:  # larger than any bucket: the stage at the batch's own rows
            return self.sliced[stage](state)
        graph = self.graphs.get((stage, bucket))
        if graph is not None:
            return graph.replay(state)
        return trimmed(self.sliced[stage](padded(state, bucket)), rows)

    def _capture_all(self, example: Sequence[torch.Tensor]) -> None:
        device = example[0].device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA tensors, got {device}")
        pools = [torch.cuda.graph_pool_handle() for _ in range(len(self.sliced))]
        # Largest bucket first: each stage's pool grows once, to what its largest bucket needs.
        for bucket in reversed(self.buckets):
            state = self.sliced.start(*batch_rows(example, bucket))
            for stage in range(len(self.sliced)):
                captured = self._capture(stage, state, bucket, pools[stage])
                self.graphs[(stage, bucket)] = captured
                state = {k: v.clone() for k, v in captured.outputs.items()}
        torch.cuda.synchronize(device)

    def _capture(self, stage: int, state: State, bucket: int, pool: Any) -> StageGraph:
        """Stage ``stage`` captured on states shaped like ``state`` (``bucket`` rows), by the runtime's
        ``cuda_graphs.capture`` (side-stream warm-up, then capture), the state passed as positional tensors."""
        names = tuple(state)
        segment = self.sliced[stage]

        def program(*tensors: torch.Tensor) -> State:
            return segment(dict(zip(names, tensors, strict=True)))

        captured = capture(program, tuple(state[name] for name in names), bucket, pool)
        return StageGraph(bucket, captured.graph, dict(zip(names, captured.inputs, strict=True)), captured.output)
