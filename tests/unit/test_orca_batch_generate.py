"""The batched-``generate`` baseline: padded batches, answers held to the batch's end, the plain model's tokens."""

from __future__ import annotations

import threading

import pytest

from handlers.orca.batch_generate import BatchGenerateEngine, padded_batch
from handlers.orca.engine import GenerationError
from model_store.catalog import get_spec
from model_store.factory import build_model
from tests.unit.test_orca_engine import greedy, prompt


@pytest.fixture(scope="module")
def hf():
    return build_model(get_spec("gpt2")).model


def test_prompts_are_padded_on_the_left_and_masked():
    ids, mask = padded_batch([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.slow
def test_waiting_requests_share_one_padded_batch_and_each_gets_its_own_greedy_tokens(hf):
    engine = BatchGenerateEngine(hf, max_batch=4, max_new_tokens=8, max_tokens=32)
    gate = threading.Event()
    release = threading.Event()
    generate = engine._generate

    def held(batch):  # the first batch waits until the others have queued behind it
        gate.set()
        assert release.wait(60)
        return generate(batch)

    engine._generate = held
    try:
        first = engine.submit(prompt(20, 4), 2)
        assert gate.wait(60)
        prompts, lengths = [prompt(21, 9), prompt(22, 2), prompt(23, 5)], [6, 1, 8]
        answered_after: list[int] = []
        futures = [engine.submit(p, n) for p, n in zip(prompts, lengths, strict=True)]
        for f in futures:
            f.add_done_callback(lambda _f: answered_after.append(engine.batches))
        release.set()
        results = [f.result(timeout=120) for f in futures]
        assert first.result(timeout=60) == greedy(hf, prompt(20, 4), 2)
    finally:
        engine.close(timeout_s=30)
    assert list(engine.batch_sizes) == [1, 3]  # the three that waited ran as one batch
    assert answered_after == [2, 2, 2]  # the 1-token request was answered with the 8-token one
    assert results == [greedy(hf, p, n) for p, n in zip(prompts, lengths, strict=True)]


def test_requests_it_cannot_serve_are_refused_and_it_still_serves(hf):
    engine = BatchGenerateEngine(hf, max_batch=2, max_new_tokens=8, max_tokens=16)
    try:
        for args, message in [(([], 2), "empty"), (([1, 50257], 2), "outside the vocabulary"),
                              (([1, 2], 9), "1..8"), (([1] * 12, 8), "exceeds the 16 tokens")]:  # fmt: skip
            with pytest.raises(GenerationError, match=message):
                engine.submit(*args)
        with pytest.raises(ValueError, match="cannot stream"):
            engine.submit([1, 2], 2, on_token=lambda t, i, last: None)
        assert len(engine.submit([1, 2], 3).result(60)) == 3
    finally:
        engine.close(timeout_s=30)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1, 2], 1)


def test_a_failed_batch_fails_its_requests_and_the_next_batch_is_served(hf):
    engine = BatchGenerateEngine(hf, max_batch=2, max_new_tokens=4, max_tokens=16)
    generate = engine._generate
    calls = []

    def first_fails(batch):
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("out of memory, say")
        return generate(batch)

    engine._generate = first_fails
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.submit([3, 4], 2).result(60)
        assert engine.submit([3, 4], 2).result(60) == greedy(hf, [3, 4], 2)
    finally:
        engine.close(timeout_s=30)
    assert calls == [1, 1]
