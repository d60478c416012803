"""Nimble's prepared programs on real catalog models (CPU here; the CUDA test skips without a GPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from handlers.nimble.config import COMPILED, EAGER, MULTI, SINGLE, NimbleConfig, NimbleConfigError
from handlers.nimble.program import FALLBACK, TF32_TOLERANCE, TOLERANCE, fastest, prepare, reproduces, tolerance_for
from model_store.catalog import get_spec
from model_store.factory import build_model, example_inputs


def test_settings_are_validated_with_a_clear_message():
    assert NimbleConfig.from_dict({"buckets": [1, 4, 16]}).buckets == (1, 4, 16)
    for raw, message in [
        ({"buckets": []}, "non-empty"),
        ({"buckets": [4, 2]}, "increasing"),
        ({"buckets": [0]}, "1..1024"),
        ({"buckets": "1,2"}, "list"),
        ({"streams": "many"}, "streams"),
        ({"timing_runs": 0}, "timing_runs"),
        ({"min_gain": 1.0}, "min_gain"),
        ({"bucket": [1]}, "unknown nimble settings"),
    ]:
        with pytest.raises(NimbleConfigError, match=message):
            NimbleConfig.from_dict(raw)


def test_a_prepared_program_replaces_eager_only_when_clearly_faster():
    assert fastest({EAGER: 100.0, SINGLE: 98.0}, min_gain=0.03) == EAGER  # within timing noise
    assert fastest({EAGER: 100.0, SINGLE: 90.0, MULTI: 95.0}, min_gain=0.03) == SINGLE
    assert fastest({EAGER: 80.0, SINGLE: 90.0}, min_gain=0.0) == EAGER
    assert fastest({SINGLE: 90.0, MULTI: 85.0}, min_gain=0.03) == MULTI  # streams forced: no eager to keep


def test_reproduces_is_relative_to_the_outputs_own_scale():
    tiny = torch.tensor([[1e-14, -2e-14]])
    assert reproduces(tiny * (1 + 1e-5), tiny)
    assert not reproduces(tiny * 2, tiny)  # an absolute floor would have passed this
    assert not reproduces(torch.tensor([[float("nan"), 0.0]]), tiny)
    assert not reproduces(tiny[:, :1], tiny)


def test_the_tolerance_is_looser_only_where_cuda_computes_through_tf32():
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False
        assert tolerance_for(torch.device("cpu")) == TOLERANCE
        assert tolerance_for(torch.device("cuda", 0)) == TF32_TOLERANCE
        torch.backends.cudnn.allow_tf32 = False
        assert tolerance_for(torch.device("cuda", 0)) == TOLERANCE
        torch.backends.cuda.matmul.allow_tf32 = True
        assert tolerance_for(torch.device("cuda", 0)) == TF32_TOLERANCE
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul
    assert not reproduces(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.02]]), tol=TF32_TOLERANCE)


@pytest.fixture(scope="module")
def inception():
    spec = get_spec("inception_v3")
    return spec, build_model(spec)


@pytest.mark.slow
def test_a_branchy_model_runs_multi_stream_within_its_buckets_and_eager_above(inception):
    spec, model = inception
    program = prepare(model, example_inputs(spec, 1), NimbleConfig(buckets=(1, 2), streams="multi", timing_runs=1))
    try:
        assert program.assignment.streams > 10  # Inception's blocks: branches on their own streams
        assert len(program.assignment.syncs) == program.assignment.reduced_edges - program.assignment.matching_size
        assert [c.chosen for c in program.choices] == [MULTI, MULTI]
        with torch.inference_mode():
            for rows, path in [(1, MULTI), (2, MULTI), (3, FALLBACK)]:
                x = example_inputs(spec, rows, seed=rows)
                got, used = program(*x)
                assert used == path
                assert reproduces(got, model(*x))
    finally:
        program.close()


def test_auto_keeps_the_fastest_candidate_it_measured_eager_included(inception):
    spec, model = inception
    config = NimbleConfig(buckets=(1,), timing_runs=1, cpu_compile=False)  # compiling Inception: a minute
    program = prepare(model, example_inputs(spec, 1), config)
    try:
        (choice,) = program.choices
        assert set(choice.ms) == {EAGER, SINGLE, MULTI} and choice.refused == ()
        assert choice.chosen == fastest(choice.ms, NimbleConfig().min_gain)
        assert "batch 1:" in program.describe() and "synchronisation" in program.describe()
    finally:
        program.close()


def test_a_model_that_is_one_chain_has_no_multi_stream_candidate():
    spec = get_spec("efficientnet_b0")  # squeeze-excitation and residuals only: every branch rejoins at once
    model = build_model(spec)
    program = prepare(model, example_inputs(spec, 1), NimbleConfig(buckets=(1,), streams="multi", timing_runs=1))
    assert program.assignment.streams == 1
    assert [c.chosen for c in program.choices] == [SINGLE]
    with torch.inference_mode():
        x = example_inputs(spec, 1, seed=3)
        assert reproduces(program(*x)[0], model(*x))


class SmallBranchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.left = nn.Conv2d(8, 8, 3, padding=1)
        self.right = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        return self.head((self.left(x) + self.right(x)).mean(dim=(2, 3)))


@pytest.mark.slow
def test_on_cpu_the_compiled_frozen_graph_is_a_candidate_too():
    model = SmallBranchy().eval()
    example = (torch.randn(1, 3, 16, 16),)
    # One bucket: each bucket is one more inductor compile (~10 s on two cores), and the candidate is the same.
    program = prepare(model, example, NimbleConfig(buckets=(1,), timing_runs=1))
    try:
        assert len(program.choices) == 1
        for choice in program.choices:
            assert set(choice.ms) == {EAGER, SINGLE, MULTI, COMPILED} and choice.refused == ()
        with torch.inference_mode():
            x = torch.randn(1, 3, 16, 16)
            assert reproduces(program(x)[0], model(x))
    finally:
        program.close()
