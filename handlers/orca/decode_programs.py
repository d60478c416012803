"""Orca's decode iterations as static-shape programs, one per (batch, context) bucket: CUDA graphs on a GPU.

Why: a decode iteration (every request brings one token) is the same
operators whatever the requests (``attention.py``), and on a fast GPU the
host's launching of them, a few hundred per iteration for GPT-2 small, is
what an iteration costs.  A CUDA graph replays them with one launch.  A
graph fixes shapes and addresses, so:

- an iteration of ``b`` requests whose longest context is ``c`` positions
  runs in the smallest bucket of ``B ≥ b`` rows and ``L ≥ c`` positions:
  batch buckets 1, 2, 4, … ``max_batch``; context buckets of whole KV
  blocks, doubling up to the engine's ``max_tokens``;
- its inputs are three small integer tensors, the token ids ``[B]``, each
  row's position ``[B]`` and block tables ``[B, L / block_size]``; the
  program computes the cache rows, the gather and the mask from them on the
  device, so what crosses from the host per iteration is a few hundred
  integers, not the layout;
- the ``B - b`` padding rows must not touch any request's keys: they read
  and write one KV block that no request ever holds (``scratch``), at
  position 0, and their logits are dropped;
- the KV tensors are allocated once by the engine, so the addresses a
  graph captured stay valid; every graph shares one memory pool (one
  iteration runs at a time).

On a CPU the same padded program runs eagerly (the tests check it against
``iterate``); the engine uses it only where graphs are captured, since on a
CPU padding only adds compute.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from handlers.orca.attention import IterationLayout, IterationModel, Step
from handlers.orca.kv_cache import KVCache, blocks_for
from handlers.runtime.cuda_graphs import CapturedBucket, capture
from handlers.runtime.stage_programs import bucket_sizes


def context_buckets(max_tokens: int, block_size: int) -> list[int]:
    """Context sizes in blocks a decode program is made for: 1, 2, 4, … and the blocks ``max_tokens`` needs."""
    return bucket_sizes(blocks_for(max_tokens, block_size))


def decode_layout(positions: torch.Tensor, tables: torch.Tensor, block_size: int) -> IterationLayout:
    """A decode iteration's layout from each row's position ``[B]`` and block table ``[B, W]``, in tensor
    operations only (so a graph can capture it): row ``i`` writes position ``positions[i]`` and attends to
    positions ``0 .. positions[i]`` of its table's ``W · block_size``."""
    rows, width = tables.shape
    position = torch.arange(width * block_size, device=tables.device)
    gather = tables[:, position // block_size] * block_size + position % block_size  # [B, L]
    write = tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1) * block_size + positions % block_size
    mask = (position.unsqueeze(0) <= positions.unsqueeze(1)).view(rows, 1, 1, width * block_size)
    return IterationLayout(write, None, gather, mask)


class DecodePrograms:
    """Decode iterations through static-shape programs (``graphs``: captured as CUDA graphs now).

    ``scratch``: a KV block no request holds (the engine takes it from the
    allocator and never gives it back), for the padding rows.
    """

    def __init__(
        self, model: IterationModel, kv: KVCache, max_batch: int, max_tokens: int, scratch: int, graphs: bool = False
    ) -> None:
        self.model = model
        self.kv = kv
        self.scratch = scratch
        self.block_size = kv.block_size
        self.batches = bucket_sizes(max_batch)
        self.widths = context_buckets(max_tokens, kv.block_size)
        self.graphs: dict[tuple[int, int], CapturedBucket] = {}
        self.replays = 0  # iterations run through a program (for tests and benchmarks)
        if graphs:
            self._capture_all()

    def bucket(self, steps: Sequence[Step]) -> tuple[int, int] | None:
        """The (rows, blocks) bucket of a decode iteration, or None: not all increments, or larger than any."""
        if not steps or any(len(step.tokens) != 1 for step in steps):
            return None
        b = bisect.bisect_left(self.batches, len(steps))
        w = bisect.bisect_left(self.widths, blocks_for(max(step.start for step in steps) + 1, self.block_size))
        if b == len(self.batches) or w == len(self.widths):
            return None
        return self.batches[b], self.widths[w]

    def inputs(self, steps: Sequence[Step], rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids, positions and block tables of ``steps``, padded to ``rows`` × ``width`` (see the module doc)."""
        ids = [step.tokens[0] for step in steps] + [0] * (rows - len(steps))
        positions = [step.start for step in steps] + [0] * (rows - len(steps))
        tables = [list(step.blocks[:width]) + [self.scratch] * (width - len(step.blocks)) for step in steps]
        tables += [[self.scratch] * width] * (rows - len(steps))
        device = self.kv.keys[0].device
        return (
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(tables, dtype=torch.long, device=device),
        )

    def program(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """One padded decode iteration: every row's next-token logits ``[B, vocab]``."""
        layout = decode_layout(positions, tables, self.block_size)
        return self.model.run_layout(ids, positions, layout, self.kv, None)

    @torch.inference_mode()
    def iterate(self, steps: Sequence[Step]) -> torch.Tensor | None:
        """``steps``' logits through their bucket's program, or None when they fit none (``bucket``)."""
        bucket = self.bucket(steps)
        if bucket is None:
            return None
        inputs = self.inputs(steps, *bucket)
        graph = self.graphs.get(bucket)
        self.replays += 1
        if graph is None:
            return self.program(*inputs)[: len(steps)]
        # A copy: the next replay overwrites the graph's output buffer, and the caller samples from these.
        return graph.replay(inputs)[: len(steps)].clone()

    def _capture_all(self) -> None:
        device = self.kv.keys[0].device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA tensors, got {device}")
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the shared pool grows once, to what the largest bucket needs.
        for rows in reversed(self.batches):
            for width in reversed(self.widths):
                example = self.inputs([], 1, width)  # one padding row: reads and writes the scratch block only
                self.graphs[(rows, width)] = capture(self.program, example, rows, pool)
        torch.cuda.synchronize(device)

    def describe(self) -> dict[str, Any]:
        return {"batches": self.batches, "context_blocks": self.widths, "graphs": len(self.graphs)}
