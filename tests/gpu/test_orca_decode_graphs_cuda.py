"""Orca with its decode iterations captured as CUDA graphs (``cuda_graphs``); needs CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.orca.engine import OrcaEngine
from handlers.orca.gpt2 import SelectiveGPT2
from model_store.catalog import get_spec
from model_store.factory import build_model
from tests.unit.test_orca_engine import greedy, prompt


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_with_decode_graphs_every_request_gets_the_greedy_tokens_of_the_model():
    hf = build_model(get_spec("gpt2-tiny1")).model.to("cuda")
    engine = OrcaEngine(SelectiveGPT2(hf), slots=4, max_tokens=48, max_batch=4, max_new_tokens=16, device="cuda",
                        cuda_graphs=True)  # fmt: skip
    try:
        # batches 1, 2, 4 × contexts of 1, 2, 3 blocks of 16 positions
        assert engine.decode is not None and engine.decode.describe()["graphs"] == 3 * 3
        prompts = [prompt(40 + i, 3 + 4 * i) for i in range(6)]  # more requests than max_batch: batches vary
        results = [f.result(timeout=120) for f in [engine.submit(p, 12) for p in prompts]]
        assert engine.decode.replays > 0
    finally:
        engine.close(timeout_s=30)
    assert results == [greedy(hf, p, 12) for p in prompts]
