"""Orca's engine on the catalog GPT-2: every request's tokens equal greedy decoding of the plain model."""

from __future__ import annotations

import threading

import pytest
import torch

from handlers.orca.engine import GenerationError, OrcaEngine
from handlers.orca.gpt2 import SelectiveGPT2
from model_store.catalog import get_spec
from model_store.factory import build_model


@pytest.fixture(scope="module")
def gpt2():
    hf = build_model(get_spec("gpt2")).model  # the catalog's GPT2LMHeadModel, seeded weights
    return hf, SelectiveGPT2(hf)


def greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """The plain model, no cache: the whole sequence through it for every token (on the model's device)."""
    ids = list(prompt)
    device = hf.lm_head.weight.device
    with torch.inference_mode():
        for _ in range(new_tokens):
            ids.append(int(hf(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
def test_requests_batched_together_generate_what_each_would_alone(gpt2):
    hf, model = gpt2
    engine = OrcaEngine(model, slots=4, max_tokens=48, max_batch=4, max_new_tokens=16)
    try:
        first_tokens = threading.Event()
        a_prompt = prompt(1, 5)
        a = engine.submit(a_prompt, 8, on_token=lambda t, i, last: i == 2 and first_tokens.set())
        assert first_tokens.wait(60)
        # Joiners while A is mid-generation: a longer prompt and a one-token prompt.
        b_prompt, c_prompt = prompt(2, 12), prompt(3, 1)
        b = engine.submit(b_prompt, 4)
        c = engine.submit(c_prompt, 6)
        results = [f.result(timeout=120) for f in (a, b, c)]
    finally:
        engine.close(timeout_s=30)
    assert results == [greedy(hf, a_prompt, 8), greedy(hf, b_prompt, 4), greedy(hf, c_prompt, 6)]
    assert max(engine.batch_sizes) >= 2  # they did share iterations


def test_a_late_short_request_is_answered_before_an_earlier_long_one(gpt2):
    _, model = gpt2
    engine = OrcaEngine(model, slots=2, max_tokens=64, max_batch=2, max_new_tokens=32)
    try:
        started = threading.Event()
        long = engine.submit(prompt(4, 4), 30, on_token=lambda t, i, last: started.set())
        assert started.wait(60)
        short = engine.submit(prompt(5, 4), 2)
        short.result(timeout=60)
        assert not long.done()  # the short one left as soon as its last token was made
        assert len(long.result(timeout=120)) == 30
    finally:
        engine.close(timeout_s=30)


@pytest.mark.slow
def test_more_requests_than_kv_slots_wait_and_all_finish(gpt2):
    hf, model = gpt2
    engine = OrcaEngine(model, slots=2, max_tokens=16, max_batch=4, max_new_tokens=4)
    try:
        prompts = [prompt(10 + i, 3 + i) for i in range(5)]
        futures = [engine.submit(p, 3) for p in prompts]
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.close(timeout_s=30)
    assert max(engine.batch_sizes) <= 2  # two slots: never more than two requests in an iteration
    assert results == [greedy(hf, p, 3) for p in prompts]
    assert engine.kv.blocks.free == 2


def test_streamed_tokens_are_the_answer_in_order(gpt2):
    _, model = gpt2
    engine = OrcaEngine(model, slots=1, max_tokens=16, max_batch=1, max_new_tokens=8)
    seen: list[tuple[int, int, bool]] = []
    try:
        result = engine.submit(prompt(6, 3), 5, on_token=lambda t, i, last: seen.append((t, i, last))).result(60)
    finally:
        engine.close(timeout_s=30)
    assert [t for t, _, _ in seen] == result and [i for _, i, _ in seen] == list(range(5))
    assert [last for _, _, last in seen] == [False] * 4 + [True]


def test_requests_it_cannot_serve_are_refused_with_the_reason(gpt2):
    _, model = gpt2
    engine = OrcaEngine(model, slots=1, max_tokens=16, max_batch=1, max_new_tokens=8)
    try:
        for args, message in [
            (([], 2), "empty"),
            (([1, 50257], 2), "outside the vocabulary"),
            (([1, -1], 2), "outside the vocabulary"),
            (([1, 2], 0), "1..8"),
            (([1, 2], 9), "1..8"),
            (([1, 2], "3"), "integer"),
            (([1] * 12, 8), "exceeds the 16 tokens"),
        ]:
            with pytest.raises(GenerationError, match=message):
                engine.submit(*args)
        assert engine.submit([1, 2], 1).result(60)  # and it still serves
    finally:
        engine.close(timeout_s=30)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1, 2], 1)


@pytest.mark.slow
def test_request_level_batching_answers_a_batch_together_and_the_same_tokens(gpt2):
    hf, model = gpt2
    engine = OrcaEngine(model, slots=4, max_tokens=32, max_batch=4, max_new_tokens=16, iteration_level=False)
    try:
        started = threading.Event()
        gate = engine.submit(prompt(7, 3), 6, on_token=lambda t, i, last: started.set())
        assert started.wait(60)
        joiner = engine.submit(prompt(8, 3), 1)  # arrives during the first batch: runs after it
        long, short = engine.submit(prompt(9, 3), 8), engine.submit(prompt(10, 3), 2)
        answered_at: list[int] = []
        short.add_done_callback(lambda f: answered_at.append(engine.iterations))
        results = [f.result(timeout=120) for f in (gate, joiner, long, short)]
    finally:
        engine.close(timeout_s=30)
    assert list(engine.batch_sizes)[:6] == [1] * 6  # the first batch ran alone to its end
    # The short request (2 tokens) was answered only after the last iteration, the long one's (8 tokens).
    assert answered_at == [engine.iterations] and engine.iterations >= 6 + 8
    assert results == [greedy(hf, prompt(s, 3), n) for s, n in ((7, 6), (8, 1), (9, 8), (10, 2))]


@pytest.fixture(scope="module")
def tiny():
    hf = build_model(get_spec("gpt2-tiny1")).model
    return hf, SelectiveGPT2(hf)


def test_with_blocks_for_fewer_tokens_than_the_requests_need_every_request_recomputes_and_finishes(tiny):
    """Six requests needing 6 × 5 blocks of 4 positions share 12: the newest running ones are preempted, compute
    their tokens again, and every answer is still greedy decoding's."""
    hf, model = tiny
    engine = OrcaEngine(model, slots=1, max_tokens=24, max_batch=6, max_new_tokens=12, block_size=4, kv_blocks=12)
    try:
        prompts = [prompt(20 + i, 5 + i) for i in range(6)]
        futures = [engine.submit(p, 12) for p in prompts]
        results = [f.result(timeout=120) for f in futures]
    finally:
        engine.close(timeout_s=30)
    assert results == [greedy(hf, p, 12) for p in prompts]
    assert engine.scheduler.preemptions > 0 and engine.peak_blocks <= 12
    assert max(engine.batch_sizes) >= 2 and engine.kv.blocks.free == 12


def test_requests_with_a_common_prompt_prefix_share_its_blocks(tiny):
    """A 20-token system prompt is computed once (blocks of 4: five blocks, the last left to compute) and
    read by the requests that repeat it, now and later; the answers do not change."""
    hf, model = tiny
    system = prompt(30, 20)
    asks = [system + prompt(31 + i, 3) for i in range(4)]

    def run(share: bool) -> tuple[list[list[int]], int, int]:
        engine = OrcaEngine(model, slots=8, max_tokens=40, max_batch=4, max_new_tokens=8, block_size=4)
        if not share:
            engine.kv.blocks.register = lambda *args: None  # nothing offered, nothing shared
        try:
            first = engine.submit(asks[0], 6).result(timeout=60)  # computes the prefix
            rest = [f.result(timeout=60) for f in [engine.submit(a, 6) for a in asks[1:]]]
        finally:
            engine.close(timeout_s=30)
        return [first, *rest], engine.kv.blocks.shared, engine.peak_blocks

    shared_answers, shared_blocks, shared_peak = run(share=True)
    plain_answers, plain_shared, plain_peak = run(share=False)
    assert shared_answers == plain_answers == [greedy(hf, a, 6) for a in asks]
    assert shared_blocks == 3 * 5 and plain_shared == 0  # each later request took the five prefix blocks
    assert shared_peak < plain_peak, (shared_peak, plain_peak)


def test_a_long_prompt_in_chunks_shares_its_iterations_with_running_requests_and_answers_the_same(tiny):
    """Chunks of 4: a 19-token prompt takes five iterations to compute, during which the running request makes
    a token every iteration; both answers equal greedy decoding, and a seeded sampled request is unaffected."""
    hf, model = tiny
    engine = OrcaEngine(model, slots=4, max_tokens=48, max_batch=4, max_new_tokens=24, block_size=4, prefill_chunk=4)
    try:
        made: list[int] = []
        started = threading.Event()
        running_prompt, long_prompt = prompt(40, 3), prompt(41, 19)
        running = engine.submit(running_prompt, 20, on_token=lambda t, i, last: (made.append(i), started.set()))
        assert started.wait(60)
        first_long_token_at: list[int] = []
        at_submit = len(made)
        long = engine.submit(
            long_prompt, 4, on_token=lambda t, i, last: i == 0 and first_long_token_at.append(len(made))
        )
        results = running.result(timeout=60), long.result(timeout=60)
    finally:
        engine.close(timeout_s=30)
    assert results == (greedy(hf, running_prompt, 20), greedy(hf, long_prompt, 4))
    # Five chunk iterations, the running request in each: whole, the prompt would have taken one.
    assert first_long_token_at and first_long_token_at[0] - at_submit >= 5
