"""A change detector on the arrival process: a two-sided CUSUM on a Poisson rate.

Why: Packrat's policy reads windowed rate bounds and confirmation timers, so
after a load step it decided 6.5 s late (issue 45).  A 7× rise of a Poisson
rate is unmistakable after a handful of arrivals; a sequential test sees it
then, at a false-alarm rate chosen in advance.

The test, per direction: with ``λ0`` the current rate and ``λ1 = r·λ0`` the
shifted one (``r`` = ``ratio`` up, ``1/ratio`` down), each observation of
``n`` arrivals in ``dt`` seconds adds the log-likelihood ratio

    llr = n·ln(r) − (λ1 − λ0)·dt

to a CUSUM statistic ``S = max(0, S + llr)``; the detector alarms when ``S``
exceeds ``h``.  Under the old rate ``llr`` drifts down by
``μ0 = λ0·(r − 1 − ln r)`` per second, and the mean time to a false alarm is
about ``(e^h − h − 1) / μ0`` (Siegmund's approximation; it ignores the
overshoot, so the true mean time is longer).  ``h`` is solved from the mean
time between false alarms the caller asks for, so it follows ``λ0``.

At an alarm the change began somewhere since the statistic last stood at
zero.  Under the old rate the statistic often lingers a little above zero,
so that point alone can lie seconds early; the change point is instead the
split of those samples whose tail is least likely under the old rate (the
profile-likelihood estimate), and the new rate is the tail's arrivals over
its seconds: a rate of the new regime only, not a window's average that
still holds the old one.  The detector then restarts from that rate.

Pure logic: it reads counts the caller samples (the frontend's request
counter) and keeps no clock of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class DetectorConfig:
    ratio: float = 2.0  # the smallest rise (and, inverted, fall) the test is tuned for
    false_alarm_seconds: float = 3600.0  # the mean time between false alarms under a constant rate, per direction
    min_rate: float = 0.05  # requests/s: below this a rate is treated as this (an idle model still has a scale)

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ValueError(f"ratio must be > 1, got {self.ratio!r}")
        if not self.false_alarm_seconds > 0 or not self.min_rate > 0:
            raise ValueError("false_alarm_seconds and min_rate must be positive")


@dataclass(frozen=True)
class RateChange:
    direction: str  # "up" or "down"
    old_rate: float
    new_rate: float  # arrivals/s since the estimated change point
    since_s: float  # seconds from the estimated change point to the alarm
    arrivals: int  # arrivals in that time


def threshold(rate: float, r: float, false_alarm_seconds: float) -> float:
    """``h`` with ``(e^h − h − 1) / μ0 = false_alarm_seconds`` (bisection; the left side grows with ``h``)."""
    drift = rate * (r - 1.0 - math.log(r))  # μ0 > 0 for r ≠ 1
    target = false_alarm_seconds * drift
    lo, hi = 0.0, 1.0
    while math.expm1(hi) - hi < target:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if math.expm1(mid) - mid < target:
            lo = mid
        else:
            hi = mid
    return hi


class _OneSided:
    """The CUSUM for one direction, and what it has seen since it last stood at zero."""

    def __init__(self, rate: float, r: float, false_alarm_seconds: float) -> None:
        self.r = r
        self.log_r = math.log(r)
        self.shift = (r - 1.0) * rate  # λ1 − λ0
        self.h = threshold(rate, r, false_alarm_seconds)
        self.rate = rate
        self.s = 0.0
        self.samples: list[tuple[int, float]] = []  # (arrivals, seconds) since the statistic last stood at zero

    def observe(self, n: int, dt: float) -> bool:
        s = self.s + n * self.log_r - self.shift * dt
        if s <= 0.0:
            self.s = 0.0
            self.samples.clear()
            return False
        self.s = s
        self.samples.append((n, dt))
        return s > self.h

    def change_point(self) -> tuple[int, float]:
        """(arrivals, seconds) after the most likely change point among the samples kept."""
        best, best_llr = (0, 0.0), -math.inf
        arrivals, seconds = 0, 0.0
        for n, dt in reversed(self.samples):  # tails, shortest first
            arrivals += n
            seconds += dt
            rate = arrivals / seconds if seconds > 0 else 0.0
            llr = (arrivals * math.log(rate / self.rate) if arrivals else 0.0) - (rate - self.rate) * seconds
            if llr > best_llr:
                best, best_llr = (arrivals, seconds), llr
        return best


class RateChangeDetector:
    """Two one-sided CUSUMs (a rise by ``ratio``, a fall by ``ratio``) around the current rate."""

    def __init__(self, rate: float, config: DetectorConfig = DetectorConfig()) -> None:
        self.config = config
        self.rate = 0.0
        self.restart(rate)

    def restart(self, rate: float) -> None:
        """Test against ``rate`` from now on (after an alarm, or when the caller knows better)."""
        self.rate = max(rate, self.config.min_rate)
        cfg = self.config
        self._up = _OneSided(self.rate, cfg.ratio, cfg.false_alarm_seconds)
        self._down = _OneSided(self.rate, 1.0 / cfg.ratio, cfg.false_alarm_seconds)

    @property
    def thresholds(self) -> tuple[float, float]:
        """(h up, h down) at the current rate."""
        return self._up.h, self._down.h

    def observe(self, arrivals: int, dt: float) -> RateChange | None:
        """``arrivals`` counted over the last ``dt`` seconds; a change when one direction's test alarms."""
        if arrivals < 0 or dt < 0:
            raise ValueError(f"arrivals and dt must be ≥ 0, got {arrivals}, {dt}")
        for direction, side in (("up", self._up), ("down", self._down)):
            if side.observe(arrivals, dt):
                count, seconds = side.change_point()
                change = RateChange(direction, self.rate, count / max(seconds, 1e-9), seconds, count)
                self.restart(change.new_rate)
                return change
        return None
