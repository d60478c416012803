"""Which batch sizes a profile's measurements show to be worth planning for.

A profile times every ``(threads, batch)`` point in a few passes
(``pass_ms``: each pass's median round).  The optimizer trusts the medians,
so a larger batch that serves a request 12 % faster than a smaller one by
the medians gets planned for, even when the passes of the two points
overlap and the "gain" is the noise of a loaded machine.  That is not
harmless: the controller's calibration is one slowdown for every batch size
(``calibration.py``), so serving cannot correct one batch size's
prediction alone, and a plan built on a phantom gain keeps being chosen.
Measured on a 2-vCPU EPYC: a brief profile credited batch 2 on one thread
with 12 %; timed alone, both took 153 ms per request, and Packrat's split of
two ⟨1 thread, batch 2⟩ workers was overloaded at a rate the static split of
⟨1, 1⟩ workers held (docs/reading/packrat.md).

The rule: per thread count, the smallest batch is kept, and a larger one is
kept only if its slowest pass, per request, beats the fastest pass per
request of the last batch kept below it: the gain must exceed the spread of
both measurements.  A point measured in one pass (a hand-written or
single-pass profile) carries no spread and is kept as its median says.
Dropping a point never makes a plan worse than the model can do: a batch
that gains nothing is served as well by more rounds of the smaller one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from packrat_plugin.profile import Profile, ProfilePoint


@dataclass(frozen=True)
class Uncredited:
    """A point left out of planning, and the measurements that left it out."""

    threads: int
    batch: int
    against_batch: int
    per_request_ms: tuple[float, float]  # its fastest and slowest pass, per request
    against_ms: tuple[float, float]  # the same for the batch it did not beat

    def describe(self) -> str:
        lo, hi = self.per_request_ms
        a_lo, a_hi = self.against_ms
        return (
            f"⟨{self.threads},{self.batch}⟩ not credited: {lo:.1f}-{hi:.1f} ms per request over its passes "
            f"against {a_lo:.1f}-{a_hi:.1f} at batch {self.against_batch}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "threads": self.threads,
            "batch": self.batch,
            "against_batch": self.against_batch,
            "per_request_ms": [round(v, 2) for v in self.per_request_ms],
            "against_ms": [round(v, 2) for v in self.against_ms],
        }


def pass_range(point: ProfilePoint) -> tuple[float, float] | None:
    """The fastest and slowest pass of ``point``, per request; None with fewer than two passes."""
    passes = point.passes_ms
    if len(passes) < 2:
        return None
    return min(passes) / point.batch, max(passes) / point.batch


def credit_batches(profile: Profile) -> tuple[Profile, list[Uncredited]]:
    """``profile`` less the points whose batch gain is within their passes' spread, and why each went."""
    kept: list[ProfilePoint] = []
    dropped: list[Uncredited] = []
    for threads in profile.threads:
        row = sorted((p for p in profile.points if p.threads == threads), key=lambda p: p.batch)
        last = row[0]
        kept.append(last)
        for point in row[1:]:
            mine, theirs = pass_range(point), pass_range(last)
            if mine is None or theirs is None or mine[1] < theirs[0]:
                kept.append(point)
                last = point
            else:
                dropped.append(Uncredited(threads, point.batch, last.batch, mine, theirs))
    return dataclasses.replace(profile, points=tuple(kept)), dropped
