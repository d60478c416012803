"""CUDA-only tests of tests.unit.test_reef_engine (its CPU tests stay there); skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from handlers.codecs import ModelInput
from handlers.reef.config import BEST_EFFORT, REALTIME, ReefConfig
from handlers.reef.engine import Member, ReefEngine
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.segments import slice_model
from model_store.factory import outputs_close
from tests.unit.test_reef_engine import WAIT_S, Held, Small, request  # noqa: F401 (fixtures are used by name)


def cuda_member(name: str, model: torch.nn.Module, shape: tuple[int, ...], device: ExecutionDevice) -> Member:
    """``model`` on the GPU, cut into three segments, as the engine's tests serve it."""
    torch.manual_seed(0)
    model = model.eval().to(device.device)
    example = (torch.randn(2, *shape, device=device.device),)
    sliced = slice_model(model, example, 3, repeats=1, check=lambda g, e: outputs_close(g, e, 1e-5))
    return Member(name, model, sliced, ModelInput((torch.zeros(shape),)))


def assert_every_answer_is_the_models(eng: ReefEngine, seed: int) -> None:
    """Sixteen requests over both models, every fourth real-time, each answered with its model's own output."""
    sent = []
    for i in range(16):
        model = "held" if i % 3 else "small"
        sent.append((model, *request(eng, model, REALTIME if i % 4 == 0 else BEST_EFFORT, seed=seed + i)))
    for model, x, future in sent:
        with torch.inference_mode():
            want = eng.members[model].model(x.unsqueeze(0).to(eng.device.device))[0].float().cpu()
        assert outputs_close(future.result(WAIT_S), want, 1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("be_graphs", [False, True])
def test_on_cuda_rt_gets_the_higher_priority_stream_and_every_answer_is_the_models(padding, be_graphs):
    device = ExecutionDevice("cuda:0")
    members = [cuda_member(name, model, shape, device) for name, model, shape in
               (("held", Held(), (3, 8, 8)), ("small", Small(), (6,)))]  # fmt: skip
    config = ReefConfig(segments=3, c=2, be_max_batch=2, padding=padding, be_graphs=be_graphs)
    eng = ReefEngine(members, device, config, HandlerMetrics(None, "test"))
    eng.warm_up()
    try:
        assert eng._rt_stream.priority < eng._be_streams["held"].priority
        assert eng._padding is padding  # padded BE units (in real-time mode) must answer as the model, too
        # be_graphs: every member's three units captured at BE batches 1 and 2 (a failed capture would run eagerly)
        assert {name: len(p.graphs) for name, p in eng.be_programs.items()} == ({"held": 6, "small": 6} if be_graphs
                                                                              else {})  # fmt: skip
        assert_every_answer_is_the_models(eng, seed=300)
    finally:
        eng.close(5.0)
