"""CUDA-only tests of tests.unit.test_ebird_handler (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.runtime.decode import default_decode_placement
from model_store.samples import jpeg_bytes
from tests.unit.test_ebird_handler import make_handler, model_dir, serve_all  # noqa: F401 (fixtures are used by name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lane_decoding_on_cuda_falls_back_to_decode_threads(make_handler):
    handler, _ = make_handler("cuda", decode_threads="lane", worker_batches=[1, 2], pool_slots=4)
    assert handler.lanes is None and handler.decoder.threads == default_decode_placement(is_cuda=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_answers_are_encoded_on_the_event_loop_even_when_asked_for_the_engine(make_handler):
    handler, ctx = make_handler("cuda", encode_answers="engine", worker_batches=[1, 2], pool_slots=4)
    assert not handler.encode_on_engine
    [(status, _)] = serve_all(handler, ctx, [{"body": jpeg_bytes(seed=3)}])
    assert status == 200
