"""Captured CUDA graphs per bucket (``handlers/runtime/cuda_graphs.py``); skips without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _buckets_over_a_private_copy(model: nn.Module, x: torch.Tensor):
    """Graphs of a copy of ``model`` that only the returned buckets can refer to (as Nimble's frozen graph)."""
    import copy

    from handlers.runtime.cuda_graphs import GraphBuckets

    return GraphBuckets(copy.deepcopy(model), (x,), [1, 2, 4])


def test_buckets_keep_their_programs_weights_alive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 14 * 14, 10)).cuda().eval()
    x = torch.randn(1, 3, 16, 16, device="cuda")
    with torch.inference_mode():
        buckets = _buckets_over_a_private_copy(model, x)
        gc.collect()
        torch.cuda.empty_cache()
        # Whatever the allocator freed is handed out again, and scribbled on:
        # a graph that read freed weights would answer NaN here (or fault).
        junk = [torch.full((n,), float("nan"), device="cuda") for n in (16 * 3 * 3 * 3, 16, 10 * 16 * 14 * 14, 10)]
        three = torch.randn(3, 3, 16, 16, device="cuda")
        got = buckets(three)
        torch.cuda.synchronize()
        expected = model(three)
        torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
    del junk
