"""DVABatch's stage programs per batch bucket: the model's answers at every bucket and row count, one program
call per stage per batch whatever it holds, and token requests of mixed lengths batched as one."""

from __future__ import annotations

import copy

import pytest
import torch

from handlers.codecs import InputCodec, collate
from handlers.dvabatch.engine import DvaBatchEngine
from handlers.dvabatch.policy import DvaBatchConfig
from handlers.runtime import stage_programs
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


def mixed_length_requests(spec, net, count: int):
    """``count`` token requests of 1-7 tokens in the 8-token length class, their collated batch, and a
    copy of the model sliced in two stages with its sequence dimension left dynamic."""
    codec = InputCodec(spec, token_lengths=(8, spec.seq_len))
    items = [codec.decode({"body": {"input_ids": list(range(1, 2 + k % 7))}}) for k in range(count)]
    ids, mask = collate(items)
    sliced = slice_model(copy.deepcopy(net), (ids[:2], mask[:2]), 2, dynamic_dims=(0, 1))
    return items, ids, mask, sliced


def test_a_batch_of_mixed_length_requests_costs_one_call_per_stage_however_many_it_holds(bert) -> None:
    spec, net = bert
    for count in (2, 9):
        items, ids, mask, sliced = mixed_length_requests(spec, net, count)
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


# -- traced programs (CPU) ------------------------------------------------------------


def test_traced_programs_give_the_models_rows_at_every_row_count(bert) -> None:
    spec, net = bert
    _, ids, mask, sliced = mixed_length_requests(spec, net, 20)
    programs = StagePrograms(sliced, (ids[:1], mask[:1]), bucket_sizes(16), traced=True)
    assert programs.traces, "a one-layer BERT's stages should be worth tracing on any CPU"
    for rows in (1, 2, 3, 5, 8, 11, 16, 20):  # 20: past the largest bucket, eagerly at its own rows
        with torch.no_grad():
            expected = net(ids[:rows], mask[:rows])
        with torch.inference_mode():
            got = run_all(programs, sliced, (ids[:rows], mask[:rows]))
        assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5), rows
    assert sum(n for (stage, _), n in programs.calls.items() if stage == 1) == 8


def test_a_traced_stage_s_output_survives_the_next_batch_through_that_stage(model, monkeypatch) -> None:  # noqa: F811
    """Static inputs are overwritten by the next run: what a batch carries on to the next stage must
    not be a view of them (DVABatch runs a stage's next batch while the last waits for the next stage).
    The residual MLP passes its input on to the last stage."""
    sliced = slice_model(copy.deepcopy(model), (torch.randn(2, 64),), 3)
    assert "x" in sliced[0].outputs  # passed on: a view of the static input if taken from the trace
    monkeypatch.setattr(stage_programs, "median_seconds", lambda run, **timing: 0.0)  # keep every trace
    programs = StagePrograms(sliced, (torch.zeros(1, 64),), bucket_sizes(4), traced=True)
    assert all((stage, 4) in programs.traces for stage in range(3))
    a, b = torch.randn(3, 64), torch.randn(3, 64)
    with torch.inference_mode():
        first = programs.run(0, sliced.start(a))
        programs.run(0, sliced.start(b))  # three other rows through the same bucket
        got = sliced.finish(programs.run(2, programs.run(1, first)))
    with torch.no_grad():
        assert torch.allclose(got, model(a), atol=1e-5)


def test_a_trace_measured_slower_than_its_padding_saves_is_not_kept(bert, monkeypatch) -> None:
    spec, net = bert
    ids = torch.ones(2, 8, dtype=torch.long)
    sliced = slice_model(copy.deepcopy(net), (ids, torch.ones_like(ids)), 2, dynamic_dims=(0, 1))
    timed: list[str] = []

    def traces_lose(run, **timing) -> float:  # the eager stage is timed first, then the trace
        timed.append("eager" if len(timed) % 2 == 0 else "traced")
        return 1.0 if timed[-1] == "traced" else 0.5

    monkeypatch.setattr(stage_programs, "median_seconds", traces_lose)
    programs = StagePrograms(sliced, (ids[:1], torch.ones_like(ids[:1])), bucket_sizes(16), traced=True)
    # Buckets 1 and 2 pad nothing and are kept untimed; 4 is timed, loses, and ends each stage's tries.
    assert sorted(programs.traces) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert len(timed) == 2 * len(sliced)
    padded_to: list[int] = []
    monkeypatch.setattr(stage_programs, "padded", lambda state, rows: padded_to.append(rows) or padded(state, rows))
    three = torch.ones(3, 8, dtype=torch.long)
    state = sliced.start(three, torch.ones_like(three))
    with torch.inference_mode():
        out = sliced.finish(programs.run(1, programs.run(0, state)))
    with torch.no_grad():
        assert torch.allclose(out, net(three, torch.ones_like(three)), atol=1e-5)
    assert padded_to == []  # 3 rows ran eagerly as 3, not padded to 4


def test_a_stage_that_cannot_be_traced_runs_eagerly_at_its_own_rows(model, monkeypatch) -> None:  # noqa: F811
    sliced = slice_model(copy.deepcopy(model), (torch.randn(2, 64),), 2)

    def refuse(*args, **kwargs):
        raise RuntimeError("not traceable")

    monkeypatch.setattr(torch.jit, "trace", refuse)
    programs = StagePrograms(sliced, (torch.zeros(1, 64),), bucket_sizes(8), traced=True)
    assert programs.traces == {}
    padded_to: list[int] = []
    monkeypatch.setattr(stage_programs, "padded", lambda state, rows: padded_to.append(rows) or padded(state, rows))
    x = torch.randn(3, 64)
    with torch.no_grad():
        got = run_all(programs, sliced, (x,))
        assert torch.allclose(got, model(x), atol=1e-5)
    assert padded_to == []  # 3 rows ran as 3, not padded to the bucket of 4
    assert programs.calls[(0, 4)] == programs.calls[(1, 4)] == 1


def test_cpu_engine_traces_its_stages_unless_told_not_to(bert) -> None:
    spec, net = bert
    items, ids, mask, sliced = mixed_length_requests(spec, net, 5)
    for traces in (True, False):
        lanes = CpuLanes(2, 1)
        config = DvaBatchConfig(segments=2, max_batch=8, split=False, cpu_traces=traces)
        engine = DvaBatchEngine(sliced, items[0], ExecutionDevice("cpu"), config, HandlerMetrics(None, "m"), lanes)
        engine.warm_up()
        assert (engine.programs is not None and bool(engine.programs.traces)) is traces
        futures = [engine.try_submit(item) for item in items]
        with torch.no_grad():
            expected = net(ids, mask)
        for i, future in enumerate(futures):
            assert torch.allclose(future.result(timeout=30), expected[i], atol=1e-5), (traces, i)
        engine.close()
        lanes.close()
