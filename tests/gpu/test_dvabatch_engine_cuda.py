"""CUDA-only tests of tests.unit.test_dvabatch_engine (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.codecs import ModelInput
from tests.unit.test_dvabatch_engine import make_engine, model  # noqa: F401 (fixtures are used by name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stages_on_cuda_streams_give_the_models_rows(model):
    engine, _ = make_engine(model, device="cuda", max_batch=4)
    inputs = [torch.randn(64) for _ in range(12)]
    futures = [engine.try_submit(ModelInput((x,))) for x in inputs]
    with torch.no_grad():
        expected = model(torch.stack(inputs))
    for i, future in enumerate(futures):
        assert torch.allclose(future.result(timeout=30), expected[i], atol=1e-4)  # answers come back on the host
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stages_replayed_as_cuda_graphs_per_bucket_give_the_models_rows(model):
    engine, _ = make_engine(model, device="cuda", max_batch=8, split=False)
    engine.warm_up()  # captures a graph per (stage, bucket)
    assert engine.programs is not None and len(engine.programs.graphs) == 3 * 4
    for count in (1, 3, 8, 5):
        inputs = [torch.randn(64) for _ in range(count)]
        with engine._cond:  # one batch: they arrive together
            futures = [engine.try_submit(ModelInput((x,))) for x in inputs]
        with torch.no_grad():
            expected = model(torch.stack(inputs))
        for i, future in enumerate(futures):
            assert torch.allclose(future.result(timeout=30), expected[i], atol=1e-4), (count, i)
    calls = engine.programs.calls
    assert calls[(0, 1)] == 1 and calls[(0, 4)] == 1 and calls[(0, 8)] == 2  # 1 → 1, 3 → 4, 8 and 5 → 8
    assert calls[(2, 4)] == 1 and sum(calls.values()) == 3 * 4  # every stage once per batch, in its bucket
    engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_without_cuda_graphs_the_stages_run_eagerly(model):
    engine, _ = make_engine(model, device="cuda", max_batch=8, cuda_graphs=False)
    engine.warm_up()
    assert engine.programs is None
    engine.close()
