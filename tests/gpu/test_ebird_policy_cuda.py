"""CUDA-only tests of tests.unit.test_ebird_policy (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.ebird.pool import InputPool


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_pool_lives_on_the_gpu():
    pool = InputPool([((3, 4, 4), torch.float32)], 4, device="cuda")
    for value in (1.0, 2.0):
        pool.write(pool.reserve(), [torch.full((3, 4, 4), value)])
    run = pool.take(2)
    stream = torch.cuda.Stream()
    pool.wait_copied(run, stream)  # the engine's stream waits on the copy stream's per-slot events
    with torch.cuda.stream(stream):
        (batch,) = pool.views(run)
        total = batch.sum(dim=(1, 2, 3))
    stream.synchronize()
    assert batch.is_cuda and total.tolist() == [48.0, 96.0]
