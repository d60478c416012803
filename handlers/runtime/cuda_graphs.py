"""Ahead-of-time execution on CUDA: one captured CUDA graph per batch-size bucket.

Nimble's second idea: a model's GPU work is the same for every request of a
given shape, so schedule it once, ahead of time, and replay the schedule
with no framework on the critical path.  A CUDA graph is that schedule:
every kernel launch, stream switch and event of one forward, recorded once
and launched again with one call.  It fixes shapes and addresses, so:

- each bucket (a batch size) gets its own graph, with a static input buffer
  the request batch is copied into and a static output the answer is read
  from;
- a batch of n runs on the smallest bucket ≥ n, its rows padded with
  whatever the buffer last held: every row of these models is independent
  (batch norm in eval mode), so padding rows cost time, never correctness;
- all buckets share one memory pool: they never run at once (one worker,
  one replay at a time, on one stream), so one bucket's intermediate
  activations may reuse another's; only the static buffers, which we keep
  referenced, must survive between replays;
- a graph holds raw addresses, not tensors: the program's weights must
  outlive it.  ``GraphBuckets`` keeps the program itself, because Nimble's
  frozen graph owns its folded weights and nothing else refers to them: once
  the graph module was collected, replays read freed memory, right only as
  long as nothing reused it (``tests/test_cuda_graphs.py`` reuses it; on the
  lent H200 a replay beside ``torch.compile`` faulted at once without this
  reference, and only at a later batch size with it).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from handlers.runtime.segments import batch_rows

Program = Callable[..., Any]  # tensors in; a tensor out (a model), or a state dict (a DVABatch stage)


@dataclass
class CapturedBucket:
    batch: int
    graph: Any  # torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]
    output: Any  # what the program returned while captured: its static output buffers

    def replay(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The program's answer for ``inputs`` (n ≤ batch rows), as a view of the static output."""
        rows = inputs[0].shape[0]
        for static, value in zip(self.inputs, inputs, strict=True):
            static[:rows].copy_(value, non_blocking=True)
        self.graph.replay()
        return self.output[:rows]


def capture(
    program: Program, example: Sequence[torch.Tensor], batch: int, pool: Any = None, warmup: int = 3
) -> CapturedBucket:
    """Capture ``program`` at ``batch`` rows shaped like ``example`` (on its CUDA device).

    Warm-up runs on a side stream first, as CUDA graphs need: lazy
    initialisation (cuDNN autotuning, workspace allocation) must not happen
    inside the capture.
    """
    device = example[0].device
    if device.type != "cuda":
        raise ValueError(f"CUDA graphs need CUDA tensors, got {device}")
    static = batch_rows(example, batch)  # fresh tensors: the graph's own input buffers
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(side):
        for _ in range(warmup):
            program(*static)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        output = program(*static)
    return CapturedBucket(batch, graph, static, output)


class GraphBuckets:
    """Captured graphs of one program for a set of batch sizes, sharing one memory pool."""

    def __init__(self, program: Program, example: Sequence[torch.Tensor], buckets: Sequence[int]) -> None:
        self.program = program  # its parameters are what every replay reads (see the module doc)
        self.sizes = sorted(set(buckets))
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the pool grows to the largest bucket's needs once and
        # the smaller captures fit in what it already holds.
        captured = {b: capture(program, example, b, pool) for b in reversed(self.sizes)}
        self.buckets = [captured[b] for b in self.sizes]

    def bucket_for(self, rows: int) -> CapturedBucket | None:
        """The smallest bucket that holds ``rows``, or None above the largest."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.buckets[i] if i < len(self.sizes) else None

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        bucket = self.bucket_for(inputs[0].shape[0])
        if bucket is None:
            raise ValueError(f"batch {inputs[0].shape[0]} exceeds the largest bucket {self.sizes[-1]}")
        return bucket.replay(inputs)
