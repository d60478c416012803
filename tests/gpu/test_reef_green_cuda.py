"""REEF with the GPU's SMs split between real-time and best-effort work (CUDA green contexts); needs CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.reef.config import ReefConfig
from handlers.reef.engine import ReefEngine
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.sm_partition import GreenPartition, sm_grid, unavailable_reason
from tests.gpu.test_reef_engine_cuda import assert_every_answer_is_the_models, cuda_member
from tests.unit.test_reef_engine import Held, Small


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_split_gives_disjoint_parts_whose_streams_compute_like_the_default_stream():
    assert unavailable_reason(torch.device("cuda", 0)) is None
    grid = sm_grid(0)
    partition = GreenPartition(0, grid.rounded(grid.total // 4))
    try:
        assert partition.rt_sms >= grid.total // 4 and partition.rt_sms + partition.be_sms <= grid.total
        a = torch.randn(512, 512, device="cuda")
        want = a @ a
        for side in ("rt", "be"):
            stream = partition.stream(side, priority=-1 if side == "rt" else 0)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                got = a @ a
            stream.synchronize()
            assert torch.allclose(got, want, atol=1e-3)
    finally:
        torch.cuda.synchronize()
        partition.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rt_sms", "be_graphs"), [("auto", False), (16, True)])
def test_reef_on_split_sms_answers_every_request_with_the_models_output_and_drops_the_gate(rt_sms, be_graphs):
    device = ExecutionDevice("cuda:0")
    members = [cuda_member(name, model, shape, device) for name, model, shape in
               (("held", Held(), (3, 8, 8)), ("small", Small(), (6,)))]  # fmt: skip
    config = ReefConfig(segments=3, c=2, be_max_batch=2, rt_sms=rt_sms, realtime=("small",), be_graphs=be_graphs)
    eng = ReefEngine(members, device, config, HandlerMetrics(None, "test"))
    eng.warm_up()
    try:
        assert eng.partition is not None and not eng._gated
        assert eng.partition.rt_sms >= 8 and eng.partition.be_sms >= 1
        assert bool(eng.be_programs) is be_graphs  # graphs captured for, and replayed on, the BE green context
        if rt_sms == "auto":
            assert eng.sizing is not None and eng.sizing.rt_sms == eng.partition.rt_sms
        assert_every_answer_is_the_models(eng, seed=500)
    finally:
        eng.close(5.0)
    assert not eng.partition._contexts  # closed with the engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_more_sms_than_a_split_can_give_is_refused_at_start_naming_the_limit():
    device = ExecutionDevice("cuda:0")
    members = [cuda_member("small", Small(), (6,), device)]
    with pytest.raises(RuntimeError, match="leaves best-effort work too few"):
        ReefEngine(members, device, ReefConfig(rt_sms=100_000), HandlerMetrics(None, "test"))
