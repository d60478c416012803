"""Orca's token choice: greedy by default; sampled draws follow the filtered softmax (chi-square) and a seed
makes a request's tokens reproducible, alone or batched with others."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from scipy.stats import chisquare

from handlers.orca.engine import OrcaEngine
from handlers.orca.gpt2 import SelectiveGPT2
from handlers.orca.sampling import GREEDY, Sampling, SamplingError, TokenChooser, choose_tokens, filtered_probabilities

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.4, 0.0, -0.5, -1.0, -3.0])


def reference(logits: torch.Tensor, s: Sampling) -> list[float]:
    """The filtered softmax written out by hand, token by token, in plain Python."""
    scaled = [x / s.temperature for x in logits.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    k = s.top_k if s.top_k else len(scaled)
    kept = order[:k]
    z = sum(math.exp(scaled[i]) for i in kept)
    out, mass = [], 0.0
    for i in kept:
        if mass >= s.top_p:
            break
        out.append(i)
        mass += math.exp(scaled[i]) / z
    z = sum(math.exp(scaled[i]) for i in out)
    return [math.exp(scaled[i]) / z if i in out else 0.0 for i in range(len(scaled))]


@pytest.mark.parametrize(
    "sampling",
    [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=4), Sampling(temperature=1.3, top_p=0.8),
     Sampling(temperature=0.9, top_k=5, top_p=0.9)],
    ids=["t1", "t0.7-k4", "t1.3-p0.8", "t0.9-k5-p0.9"],
)  # fmt: skip
def test_draws_follow_the_filtered_softmax(sampling):
    expected = reference(LOGITS, sampling)
    assert filtered_probabilities(LOGITS[None], [sampling])[0].tolist() == pytest.approx(expected, abs=1e-6)
    chooser = TokenChooser.for_request(Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed=5))
    draws = 6000
    counts = [0] * len(expected)
    rows = LOGITS.expand(draws, -1).contiguous()
    for token in choose_tokens(rows, [chooser] * draws):
        counts[token] += 1
    kept = [i for i, p in enumerate(expected) if p > 0]
    assert all(counts[i] == 0 for i in range(len(expected)) if i not in kept)  # filtered tokens never drawn
    result = chisquare([counts[i] for i in kept], [expected[i] * draws for i in kept])
    assert result.pvalue > 1e-3, (counts, expected)


def test_greedy_is_the_argmax_and_mixes_with_sampled_rows_in_one_call():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    choosers = [TokenChooser(), TokenChooser.for_request(Sampling(temperature=1.0, seed=1)), TokenChooser(),
                TokenChooser.for_request(Sampling(temperature=0.5, top_k=3, seed=2)), TokenChooser(GREEDY)]  # fmt: skip
    tokens = choose_tokens(logits, choosers)
    for i in (0, 2, 4):
        assert tokens[i] == int(logits[i].argmax())
    assert int(logits[3].argsort(descending=True)[:3].eq(tokens[3]).sum()) == 1  # within its top 3


def test_a_seed_gives_the_same_draws_and_another_seed_others():
    def draws(seed: int) -> list[int]:
        chooser = TokenChooser.for_request(Sampling(temperature=1.0, seed=seed))
        return [choose_tokens(LOGITS[None], [chooser])[0] for _ in range(40)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)


@pytest.mark.parametrize(
    "settings, message",
    [({"temperature": -1}, "temperature must be in"), ({"temperature": "hot"}, "temperature must be a number"),
     ({"top_k": 1.5}, "top_k must be an integer"), ({"top_p": 0}, "top_p must be in"),
     ({"top_p": 1.5}, "top_p must be in"), ({"seed": -3}, "seed must be an integer"),
     ({"temperature": float("nan")}, "temperature must be in")],
)  # fmt: skip
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(SamplingError, match=message):
        Sampling(**settings)


def test_a_seeded_request_generates_the_same_tokens_alone_and_batched_with_others():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=64, vocab_size=61)
    model = SelectiveGPT2(transformers.GPT2LMHeadModel(config).eval())
    engine = OrcaEngine(model, slots=4, max_tokens=48, max_batch=4, max_new_tokens=16)
    sampled = Sampling(temperature=1.0, top_p=0.95, seed=11)
    try:
        alone = engine.submit([1, 2, 3], 12, sampling=sampled).result(60)
        again = engine.submit([1, 2, 3], 12, sampling=sampled).result(60)
        others = [engine.submit([5, 6, 7][: 1 + i], 10, sampling=Sampling(temperature=1.0, seed=i)) for i in range(3)]
        batched = engine.submit([1, 2, 3], 12, sampling=sampled)
        assert batched.result(60) == alone == again
        assert all(len(f.result(60)) == 10 for f in others)
        unseeded = [engine.submit([1, 2, 3], 12, sampling=Sampling(temperature=1.0)).result(60) for _ in range(3)]
        assert len({tuple(u) for u in unseeded}) > 1  # no seed: draws differ from request to request
    finally:
        engine.close(30)


def test_a_stop_token_ends_a_request_with_it_as_its_last_and_bad_stop_ids_are_refused():
    from handlers.orca.engine import GenerationError

    torch.manual_seed(1)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=61)
    engine = OrcaEngine(SelectiveGPT2(transformers.GPT2LMHeadModel(config).eval()), 2, 48, 2, 16)
    try:
        full = engine.submit([4, 5, 6], 12).result(60)
        stop = full[5]
        cut = full[: full.index(stop) + 1]
        assert engine.submit([4, 5, 6], 12, stop_token_ids=[stop]).result(60) == cut
        unmade = next(t for t in range(61) if t not in full)
        assert engine.submit([4, 5, 6], 12, stop_token_ids=[unmade]).result(60) == full
        for bad, message in (([61], "outside the vocabulary"), ("7", "must be a list"), ([1] * 17, "at most 16")):
            with pytest.raises(GenerationError, match=message):
                engine.submit([4, 5, 6], 4, stop_token_ids=bad)
    finally:
        engine.close(30)
