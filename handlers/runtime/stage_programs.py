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

On a CPU the same host cost shows on a small model: a stage run from its fx
graph is one Python call per ATen operator (``torch.export``'s graphs call
each ``OpOverload`` through Python), and every call hands the GIL over,
which the event loop and the other stage's lane are waiting for.  Timed on
the one-layer BERT at 16 rows (2-vCPU Xeon, one thread), its two stages
took 80 and 360 µs from the graph against 14 and 95 µs as TorchScript
traces, and beside a thread running Python the second stage gave the GIL
away some twenty times per run against three.  ``traced=True`` traces each
(stage, bucket) with ``torch.jit.trace`` (one C++ call per batch, the
stage's own parameters, no copy of the weights) and keeps a bucket's trace
only where it measured no slower than the stage run eagerly at the
fewest rows that bucket serves, so padding a batch never costs more than
the Python it saves (a compute-bound stage keeps its own rows).  A stage
that cannot be traced, or whose trace does not reproduce it, runs eagerly.

``StagePrograms`` without graphs or traces runs the same padded shapes
eagerly (row 0 repeated into the padding): what the tests check the
buckets' answers with.  With traces, a bucket without one runs eagerly at
the batch's own rows.  A batch larger than every bucket runs eagerly at
its own rows.
"""

from __future__ import annotations

import bisect
import collections
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from handlers.runtime.cuda_graphs import capture
from handlers.runtime.segments import Segment, SegmentedModel, State, batch_rows, state_rows
from handlers.runtime.timing import median_seconds

logger = logging.getLogger(__name__)

# A trace against the eager stage is timed over at least this long: a stage of microseconds over many calls.
STAGE_TIMING_BUDGET_S = 0.02


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


class _Positional(nn.Module):
    """A segment's graph module called with its state as positional tensors, returning a tuple (what
    ``torch.jit.trace`` takes); the graph module is a submodule, so its parameters stay parameters."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.graph_module = module

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.graph_module(*tensors))


@dataclass
class TracedStage:
    """One stage traced at one bucket: a batch's rows copied into static inputs of ``bucket`` rows,
    one TorchScript call, the outputs trimmed back to the batch's rows.

    The static inputs' other rows hold whatever an earlier batch left there (at first, the example's
    rows): every row of a stage is computed on its own, so they cost time, never another row's
    answer, and a batch costs one copy per input tensor rather than a padded copy built anew.  An
    output that is a view of a static input (a value passed on, a slice of the token ids) is
    taken from the batch's own state or copied out, since the next run overwrites the static
    inputs.  One run at a time: a stage runs one batch at a time.
    """

    bucket: int
    module: Any  # torch.jit.ScriptModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    static: tuple[torch.Tensor, ...]  # ``bucket`` rows per input
    aliased: frozenset[int]  # indices of outputs that are views of ``static``

    def run(self, state: State) -> State:
        rows = state_rows(state)
        if rows == self.bucket:
            values = self.module(*(state[name] for name in self.inputs))
            return dict(zip(self.outputs, values, strict=True))
        for buffer, name in zip(self.static, self.inputs, strict=True):
            buffer[:rows].copy_(state[name])
        values = self.module(*self.static)
        out = {}
        for i, (name, value) in enumerate(zip(self.outputs, values, strict=True)):
            if i not in self.aliased:
                out[name] = value[:rows]
            elif name in state:  # passed on unchanged: the batch's own tensor
                out[name] = state[name]
            else:
                out[name] = value[:rows].clone()
        return out


def _views_of(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> frozenset[int]:
    """Indices of ``outputs`` that share memory with any of ``inputs``."""
    pointers = {x.untyped_storage().data_ptr() for x in inputs}
    return frozenset(i for i, y in enumerate(outputs) if y.untyped_storage().data_ptr() in pointers)


def _same_values(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    return torch.allclose(got, expected, atol=1e-5) if expected.is_floating_point() else torch.equal(got, expected)


class StagePrograms:
    """Run stage ``s`` on a state as one program of the smallest bucket that holds its rows.

    ``graphs``: capture one CUDA graph per (stage, bucket) now (the model and
    ``example`` on a CUDA device).  ``traced``: trace one TorchScript program
    per (stage, bucket) now and keep those measured worth their padding (see
    the module doc).  Neither: run the padded shapes eagerly.
    ``calls`` counts the programs run, by (stage, bucket): one per batch
    that runs a stage, however many requests it holds.
    """

    def __init__(
        self,
        sliced: SegmentedModel,
        example: Sequence[torch.Tensor],
        buckets: Sequence[int],
        graphs: bool = False,
        traced: bool = False,
    ) -> None:
        self.sliced = sliced
        self.buckets = sorted(set(buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"need bucket sizes ≥ 1, got {list(buckets)}")
        if graphs and traced:
            raise ValueError("a stage runs as a CUDA graph or as a trace, not both")
        self.graphs: dict[tuple[int, int], StageGraph] = {}
        self.traces: dict[tuple[int, int], TracedStage] = {}
        self.pad_eager = not traced  # with traces, a bucket without one runs at the batch's own rows
        self.calls: collections.Counter[tuple[int, int | None]] = collections.Counter()
        if graphs:
            self._capture_all(example)
        if traced:
            self._trace_all(example)

    def bucket_for(self, rows: int) -> int | None:
        """The smallest bucket holding ``rows``, or None above the largest."""
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def run(self, stage: int, state: State, count: bool = True) -> State:
        """``stage`` on ``state`` by its bucket's program; ``count``: one more call of it in ``calls``
        (not for a profile's timing runs)."""
        rows = state_rows(state)
        bucket = self.bucket_for(rows)
        if count:
            self.calls[(stage, bucket)] += 1
        if bucket is None:  # larger than any bucket: the stage at the batch's own rows
            return self.sliced[stage](state)
        graph = self.graphs.get((stage, bucket))
        if graph is not None:
            return graph.replay(state)
        traced = self.traces.get((stage, bucket))
        if traced is not None:
            return traced.run(state)
        if not self.pad_eager:
            return self.sliced[stage](state)
        return trimmed(self.sliced[stage](padded(state, bucket)), rows)

    def _trace_all(self, example: Sequence[torch.Tensor]) -> None:
        """A trace per (stage, bucket), kept where it is no slower than the stage eagerly at the
        bucket's fewest rows (measured here, at this thread's torch thread count).  A bucket that
        pads nothing (1, 2) runs the same operators minus the Python, so it is kept untimed.

        Buckets are tried smallest first, and a stage's first losing bucket ends its tries: the
        Python a trace saves is about the same at every size while the padding grows with the
        bucket, so a compute-bound stage (a large model on a CPU) costs start-up the time of its
        small buckets only.
        """
        fewest = dict(zip(self.buckets, [1, *(b + 1 for b in self.buckets[:-1])], strict=True))
        with torch.no_grad():  # traced on normal tensors: inference tensors cannot be traced
            state = self.sliced.start(*batch_rows(example, 1))  # one row; more are that row repeated
            for stage, segment in enumerate(self.sliced):
                for bucket in self.buckets:
                    traced = self._trace(segment, padded(state, bucket), bucket)
                    if traced is None:
                        break
                    if fewest[bucket] < bucket:  # padded: worth it only if it saves more than the padding costs
                        small = padded(state, fewest[bucket])
                        with torch.inference_mode():
                            eager_s = median_seconds(
                                lambda s=small, g=segment: g(s), warm=1, budget_s=STAGE_TIMING_BUDGET_S
                            )
                            traced_s = median_seconds(
                                lambda s=small, t=traced: t.run(s), warm=2, budget_s=STAGE_TIMING_BUDGET_S
                            )
                        logger.debug("stage %d, bucket %d: traced %.0f µs, eager at %d rows %.0f µs", stage, bucket,
                                     traced_s * 1e6, fewest[bucket], eager_s * 1e6)  # fmt: skip
                        if traced_s > eager_s:
                            break
                    self.traces[(stage, bucket)] = traced
                state = segment(state)  # the next stage's input

    @staticmethod
    def _trace(segment: Segment, state: State, bucket: int) -> TracedStage | None:
        """``segment`` traced on ``state`` (``bucket`` rows), or None where it cannot be traced or its trace
        does not give the stage's outputs (a model is served either way: eagerly)."""
        tensors = tuple(state[name] for name in segment.inputs)
        try:
            with warnings.catch_warnings():  # shape-specialising warnings: one trace per bucket is the point
                warnings.simplefilter("ignore")
                module = torch.jit.trace(_Positional(segment.module), tensors, check_trace=False)
            expected, got = segment(state), module(*tensors)
            same = len(got) == len(expected) and all(map(_same_values, got, expected.values()))
        except Exception:  # tracing is an optimisation: the eager stage serves the same answers
            logger.info("stage %d cannot be traced at %d rows; it runs eagerly", segment.index, bucket, exc_info=True)
            return None
        if not same:
            logger.warning("stage %d traced at %d rows differs from its graph; it runs eagerly", segment.index, bucket)
            return None
        static = tuple(x.clone() for x in tensors)
        aliased = _views_of(module(*static), static)
        return TracedStage(bucket, module, segment.inputs, segment.outputs, static, aliased)

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
