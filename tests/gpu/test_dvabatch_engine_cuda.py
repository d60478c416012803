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
