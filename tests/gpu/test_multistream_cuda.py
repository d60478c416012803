"""CUDA-only tests of tests.unit.test_multistream (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from handlers.nimble.multistream import rewrite_for_streams
from tests.unit.test_multistream import Branchy, branchy  # noqa: F401 (fixtures are used by name)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_the_rewritten_graph_on_cuda_streams_gives_the_models_answer(branchy):
    gm, x, _ = branchy
    gm = gm.cuda()
    x = x.cuda()
    with torch.no_grad():
        expected = gm(x)
        rewrite_for_streams(gm, device="cuda")
        for _ in range(3):
            torch.testing.assert_close(gm(x), expected)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the join restored the caller's stream


@cuda
def test_a_captured_multi_stream_graph_replays_the_models_answer(branchy):
    from handlers.runtime.cuda_graphs import GraphBuckets

    gm, x, _ = branchy
    gm = gm.cuda()
    x = x.cuda()
    with torch.no_grad():
        expected = gm(x)
        streamed = rewrite_for_streams(fx.symbolic_trace(Branchy().eval()).cuda(), device="cuda")  # same seed
        buckets = GraphBuckets(streamed, (x,), [1, 2, 4])
        torch.testing.assert_close(buckets(x), expected)
        torch.testing.assert_close(buckets(x[:1]), expected[:1])
        three = torch.cat([x, x[:1]])
        torch.testing.assert_close(buckets(three), torch.cat([expected, expected[:1]]))  # padded to 4
    assert buckets.bucket_for(5) is None
