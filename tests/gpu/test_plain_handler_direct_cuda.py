"""CUDA-only tests of tests.unit.test_plain_handler_direct (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from archiver.options import ServingOptions
from bench.direct import call_batch, load_context, model_dir_for
from handlers.plain_handler import PlainModelHandler
from handlers.runtime.cuda_graphs import GraphBuckets
from model_store.factory import outputs_close
from tests.payloads import image_tensor_json, jpeg_bytes, reference_logits
from tests.unit.test_plain_handler_direct import SPEC  # noqa: F401 (fixtures are used by name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_plain_handler_replays_captured_graphs_and_answers_as_the_model(tmp_path):
    model_dir = model_dir_for(SPEC, tmp_path / "model")
    ctx = load_context(SPEC, model_dir, ServingOptions(batch_size=4, cuda_graphs=True), gpu=0)
    handler = PlainModelHandler()
    handler.initialize(ctx)
    assert isinstance(handler.model, GraphBuckets) and handler.model.sizes == [1, 2, 4]
    good = [{"body": jpeg_bytes(seed=1)}, {"body": image_tensor_json(SPEC, seed=2)}, {"body": jpeg_bytes(seed=3)}]
    for batch in (good, good[:1], [good[0], {"body": b"{not json"}, *good[1:]]):  # buckets 4, 1; a bad row
        answers = [(status, body) for status, body in call_batch(handler, ctx, batch) if status == 200]
        assert len(answers) == 3 if len(batch) > 1 else 1
        for (_, body), row in zip(answers, reference_logits(SPEC, good), strict=False):
            assert outputs_close(torch.tensor(body["logits"]), row, 1e-2)  # TF32 on CUDA
