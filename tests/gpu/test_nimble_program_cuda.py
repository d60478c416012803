"""CUDA-only tests of tests.unit.test_nimble_program (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.nimble.config import COMPILED, MULTI, SINGLE, NimbleConfig
from handlers.nimble.program import FALLBACK, prepare, reproduces
from model_store.catalog import get_spec
from model_store.factory import build_model, example_inputs
from tests.unit.test_nimble_program import inception  # noqa: F401 (fixtures are used by name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_bucket_is_a_captured_graph_that_reproduces_eager(inception):
    spec, model = inception
    model = model.cuda()
    try:
        config = NimbleConfig(buckets=(1, 2, 4), cuda_compile=False)  # the compiled candidate: its own test
        program = prepare(model, tuple(x.cuda() for x in example_inputs(spec, 1)), config)
        # No candidate refused: both captured graphs reproduced eager in every bucket.
        assert [(c.batch, c.refused) for c in program.choices] == [(1, ()), (2, ()), (4, ())]
        assert all({SINGLE, MULTI} <= set(c.ms) for c in program.choices)
        with torch.inference_mode():
            for rows in (1, 2, 3, 4, 5):
                x = tuple(t.cuda() for t in example_inputs(spec, rows, seed=rows))
                got, used = program(*x)
                assert reproduces(got, model(*x)), (rows, used)
                assert (used == FALLBACK) == (rows > 4)
    finally:
        model.cpu()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_compiled_candidate_is_captured_and_reproduces_eager():
    spec = get_spec("resnet50")
    model = build_model(spec).cuda()
    example = tuple(x.cuda() for x in example_inputs(spec, 1))
    program = prepare(model, example, NimbleConfig(buckets=(1, 2), streams="auto"))
    try:
        # Inductor's kernels replayed from Nimble's graphs: timed and accepted in every bucket.
        assert [(c.batch, c.refused) for c in program.choices] == [(1, ()), (2, ())]
        assert all(COMPILED in c.ms for c in program.choices)
        with torch.inference_mode():
            for rows in (1, 2):
                x = tuple(t.cuda() for t in example_inputs(spec, rows, seed=rows))
                got, used = program(*x)
                assert reproduces(got, model(*x)), (rows, used)
    finally:
        program.close()
