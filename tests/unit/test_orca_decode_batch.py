"""Orca's decode iteration: one attention call per layer for every request, the same answers as one by one."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from handlers.orca.gpt2 import SelectiveGPT2, Step
from handlers.orca.kv_cache import KVCache
from model_store.catalog import get_spec
from model_store.factory import build_model


class CountOps(TorchDispatchMode):
    """Counts the aten operators dispatched inside it that compute (views only relabel memory, and
    ``index_put`` of a single row adds one where it broadcasts its value)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny():
    hf = build_model(get_spec("gpt2-tiny1")).model
    return SelectiveGPT2(hf)


def prompts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(count)
    return [torch.randint(0, 1000, (3 + i % 5,), generator=generator).tolist() for i in range(count)]


def cache(model: SelectiveGPT2) -> KVCache:
    """Small blocks (4 positions), so requests span several and their tables interleave."""
    return KVCache(model.kv_shape(blocks=128, block_size=4))


def prefill(model: SelectiveGPT2, kv: KVCache, asks: list[list[int]]) -> list[Step]:
    """Each prompt through an initiation of its own; the decode steps that follow, one token each."""
    steps = []
    for ask in asks:
        table = kv.table_for(len(ask) + 1)
        logits = model.iterate([Step(ask, 0, table)], kv)
        steps.append(Step([int(logits[0].argmax())], len(ask), table))
    return steps


def alone(model: SelectiveGPT2, ask: list[int], kind: str) -> torch.Tensor:
    """``ask``'s logits computed with nothing beside it: as a ``"prompt"`` (its initiation) or as its first
    ``"decode"`` step after one."""
    kv = cache(model)
    if kind == "prompt":
        return model.iterate([Step(ask, 0, kv.table_for(len(ask)))], kv)[0]
    return model.iterate(prefill(model, kv, [ask]), kv)[0]


def test_a_decode_iteration_dispatches_the_same_operators_for_1_4_and_16_requests(tiny):
    counts = {}
    for n in (1, 4, 16):
        kv = cache(tiny)
        steps = prefill(tiny, kv, prompts(n))
        with CountOps() as ops:
            tiny.iterate(steps, kv)
        counts[n] = ops.count
    assert counts[1] == counts[4] == counts[16], counts


def test_decoding_together_gives_each_request_the_logits_it_gets_alone(tiny):
    asks = prompts(6)
    together_kv = cache(tiny)
    together = tiny.iterate(prefill(tiny, together_kv, asks), together_kv)
    for i, ask in enumerate(asks):
        alone_kv = cache(tiny)
        alone = tiny.iterate(prefill(tiny, alone_kv, [ask]), alone_kv)
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)


def test_an_iteration_mixing_prompts_and_increments_matches_each_alone(tiny):
    """Increments attend in one call, the prompt in another, and the rows go back in the iteration's order."""
    asks = prompts(3)
    kv = cache(tiny)
    decoding = prefill(tiny, kv, asks[:2])
    newcomer = Step(asks[2], 0, kv.table_for(len(asks[2])))
    mixed = tiny.iterate([decoding[0], newcomer, decoding[1]], kv)
    for row, ask, kind in ((0, asks[0], "decode"), (1, asks[2], "prompt"), (2, asks[1], "decode")):
        torch.testing.assert_close(mixed[row], alone(tiny, ask, kind), atol=1e-5, rtol=1e-5)


def test_an_iteration_of_new_prompts_dispatches_the_same_operators_for_1_4_and_16_of_them(tiny):
    """Initiations attend together too: a burst of new requests costs one call per layer, not one per prompt."""
    counts = {}
    for n in (1, 4, 16):
        kv = cache(tiny)
        steps = [Step(ask, 0, kv.table_for(len(ask))) for ask in prompts(n)]
        with CountOps() as ops:
            tiny.iterate(steps, kv)
        counts[n] = ops.count
    assert counts[1] == counts[4] == counts[16], counts


def test_prompts_of_different_lengths_and_a_chunk_resumed_mid_prompt_match_each_alone(tiny):
    """One padded causal call over prompts of 3-7 tokens, one of them the second chunk of a longer prompt
    (its first positions cached by an earlier iteration), beside an increment: every row as computed alone."""
    asks = prompts(5)
    long = asks[0] + asks[1]  # 7-14 tokens, computed in two chunks
    kv = cache(tiny)
    [decoding] = prefill(tiny, kv, [asks[2]])
    long_table = kv.table_for(len(long))
    tiny.iterate([Step(long[:4], 0, long_table)], kv)  # the first chunk, an iteration earlier
    fresh = [Step(ask, 0, kv.table_for(len(ask))) for ask in asks[3:]]
    mixed = tiny.iterate([fresh[0], Step(long[4:], 4, long_table), decoding, fresh[1]], kv)
    for row, ask, kind in ((0, asks[3], "prompt"), (1, long, "prompt"), (2, asks[2], "decode"), (3, asks[4], "prompt")):
        torch.testing.assert_close(mixed[row], alone(tiny, ask, kind), atol=1e-5, rtol=1e-5)
