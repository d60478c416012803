"""CUDA-only tests of tests.unit.test_orca_batch_generate (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.orca.batch_generate import BatchGenerateEngine
from model_store.catalog import get_spec
from model_store.factory import build_model
from tests.unit.test_orca_engine import greedy, prompt


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_batch_gives_each_request_the_greedy_tokens_of_the_model_on_cuda():
    hf = build_model(get_spec("gpt2")).model.to("cuda")
    engine = BatchGenerateEngine(hf, max_batch=2, max_new_tokens=8, max_tokens=32)
    prompts = [prompt(30, 6), prompt(31, 6)]
    try:
        results = [f.result(timeout=120) for f in [engine.submit(p, 5) for p in prompts]]
    finally:
        engine.close(timeout_s=30)
    assert results == [greedy(hf, p, 5) for p in prompts]
