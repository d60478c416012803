"""How the next token is chosen from a request's logits: greedy, or sampled with temperature, top-k and top-p.

Each request carries its own ``Sampling``; a seeded request owns a
``torch.Generator`` so its tokens are reproducible whatever else shares its
iterations (a request's draw never consumes another's random numbers).  The
filters compose in the usual order: divide by the temperature, keep the
``top_k`` largest, then the smallest set of those whose probability reaches
``top_p`` (the most likely token always stays), renormalise, draw.
Temperature 0 is greedy decoding, the engine's answer when a request says
nothing, so greedy answers stay bit-for-bit what they were.

One iteration picks every request's token in one call: the greedy rows by
one ``argmax`` over them together, the sampled rows filtered together
(one sort for the batch), and one draw per sampled row from its own
generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


class SamplingError(ValueError):
    """Sampling settings a request cannot have (answered with a 400)."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int | None = None  # None: drawn from the process's entropy

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise SamplingError(f"temperature must be a number, got {self.temperature!r}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise SamplingError(f"temperature must be in [0, 100], got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer ≥ 0 (0: no limit), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise SamplingError(f"top_p must be a number, got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):  # fmt: skip
            raise SamplingError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


@dataclass
class TokenChooser:
    """A request's sampling settings and, when it samples, its own random stream."""

    sampling: Sampling = GREEDY
    generator: torch.Generator | None = field(default=None, repr=False)

    @classmethod
    def for_request(cls, sampling: Sampling, device: str | torch.device = "cpu") -> TokenChooser:
        if sampling.greedy:
            return cls(sampling)
        generator = torch.Generator(device=device)
        if sampling.seed is None:
            generator.seed()
        else:
            generator.manual_seed(sampling.seed)
        return cls(sampling, generator)


def filtered_probabilities(logits: torch.Tensor, samplings: list[Sampling]) -> torch.Tensor:
    """Each row's distribution after temperature, top-k and top-p (rows of ``logits``: ``[n, vocab]``)."""
    temperature = torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=logits.device)
    scaled = logits.float() / temperature.unsqueeze(1)
    vocab = scaled.shape[1]
    top_k = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in samplings], device=logits.device)
    top_p = torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=logits.device)
    ordered, order = scaled.sort(dim=1, descending=True)
    rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
    keep = rank < top_k.unsqueeze(1)
    probs = torch.softmax(ordered.masked_fill(~keep, -math.inf), dim=1)
    before = probs.cumsum(dim=1) - probs  # probability of the tokens ranked above each
    keep &= before < top_p.unsqueeze(1)  # the first token always stays (nothing above it)
    kept = torch.softmax(ordered.masked_fill(~keep, -math.inf), dim=1)
    return torch.zeros_like(kept).scatter(1, order, kept)


def choose_tokens(logits: torch.Tensor, choosers: list[TokenChooser]) -> list[int]:
    """The next token of every row of ``logits`` (``[n, vocab]``), by its request's chooser."""
    tokens = [0] * len(choosers)
    greedy = [i for i, c in enumerate(choosers) if c.sampling.greedy]
    sampled = [i for i, c in enumerate(choosers) if not c.sampling.greedy]
    if greedy:
        rows = logits if len(greedy) == len(choosers) else logits[greedy]
        for i, token in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
            tokens[i] = token
    if sampled:
        probs = filtered_probabilities(logits[sampled], [choosers[i].sampling for i in sampled])
        for row, i in enumerate(sampled):
            tokens[i] = int(torch.multinomial(probs[row], 1, generator=choosers[i].generator))
    return tokens
