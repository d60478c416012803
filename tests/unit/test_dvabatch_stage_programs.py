"""DVABatch's stage programs per batch bucket: the model's answers at every bucket and row count, one program
call per stage per batch whatever it holds, and token requests of mixed lengths batched as one."""

from __future__ import annotations

import copy

import pytest
import torch

from handlers.codecs import InputCodec, collate
from handlers.dvabatch.engine import DvaBatchEngine
from handlers.dvabatch.policy import DvaBatchConfig
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.segments import slice_model
from handlers.runtime.stage_programs import StagePrograms, bucket_sizes, padded
from model_store.catalog import get_spec
from model_store.factory import build_model
from tests.unit.test_dvabatch_engine import model  # noqa: F401 (a fixture, used by name)


def test_buckets_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_padding_repeats_the_first_row_and_never_shrinks() -> None:
    state = {"x": torch.arange(6.0).reshape(2, 3)}
    grown = padded(state, 4)["x"]
    assert grown.tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [0, 1, 2]]
    assert padded(state, 2) is state
    with pytest.raises(ValueError):
        padded(state, 1)


def run_all(programs: StagePrograms, sliced, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    state = sliced.start(*inputs)
    for stage in range(len(sliced)):
        state = programs.run(stage, state)
    return sliced.finish(state)


def test_each_bucket_gives_the_models_rows_at_every_row_count(model) -> None:  # noqa: F811
    sliced = slice_model(copy.deepcopy(model), (torch.randn(2, 64),), 3)
    programs = StagePrograms(sliced, (torch.zeros(1, 64),), bucket_sizes(8))
    for rows in range(1, 11):  # 9 and 10: past the largest bucket, at their own rows
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        with torch.no_grad():
            expected = model(x)
            got = run_all(programs, sliced, (x,))
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5), rows
    # One program per stage per batch: 1, 2 rows in their own buckets, 3-4 in 4, 5-8 in 8, 9-10 in none.
    assert programs.calls[(0, 1)] == programs.calls[(0, 2)] == 1
    assert programs.calls[(0, 4)] == 2 and programs.calls[(0, 8)] == 4 and programs.calls[(0, None)] == 2
    assert sum(n for (stage, _), n in programs.calls.items() if stage == 2) == 10


@pytest.fixture(scope="module")
def bert():
    spec = get_spec("bert-tiny1", "eager")
    torch.manual_seed(0)
    return spec, build_model(spec).eval()


def test_token_stages_answer_requests_of_mixed_lengths_padded_to_their_class_at_every_bucket(bert) -> None:
    spec, net = bert
    codec = InputCodec(spec, token_lengths=(8, spec.seq_len))
    items = [codec.decode({"body": {"input_ids": list(range(1, n + 1))}}) for n in (3, 5, 7, 8, 2, 6, 4, 1, 5)]
    ids, mask = collate(items)
    sliced = slice_model(copy.deepcopy(net), (ids[:2], mask[:2]), 2, dynamic_dims=(0, 1))
    programs = StagePrograms(sliced, (ids[:1], mask[:1]), bucket_sizes(8))
    for rows in (1, 3, 4, 6, 8):
        with torch.no_grad():
            expected = net(ids[:rows], mask[:rows])
            got = run_all(programs, sliced, (ids[:rows], mask[:rows]))
        assert torch.allclose(got, expected, atol=1e-5), rows


def test_a_batch_of_mixed_length_requests_costs_one_call_per_stage_however_many_it_holds(bert) -> None:
    spec, net = bert
    codec = InputCodec(spec, token_lengths=(8, spec.seq_len))
    for count in (2, 9):
        items = [codec.decode({"body": {"input_ids": list(range(1, 2 + k % 7))}}) for k in range(count)]
        ids, mask = collate(items)
        sliced = slice_model(copy.deepcopy(net), (ids[:2], mask[:2]), 2, dynamic_dims=(0, 1))
        lanes = CpuLanes(2, 1)
        config = DvaBatchConfig(segments=2, max_batch=16, split=False)
        engine = DvaBatchEngine(sliced, items[0], ExecutionDevice("cpu"), config, HandlerMetrics(None, "m"), lanes)
        engine.warm_up()
        with engine._cond:  # the scheduler sees them only once all are in: they arrived together
            futures = [engine.try_submit(item) for item in items]
        with torch.no_grad():
            expected = net(ids, mask)
        for i, future in enumerate(futures):
            assert torch.allclose(future.result(timeout=30), expected[i], atol=1e-5), (count, i)
        assert dict(engine.stage_calls) == {0: 1, 1: 1}, count
        engine.close()
        lanes.close()
