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
still holds the old one.

That estimate is biased: the alarm fires on the stretch that looked most
unlike the old rate, so a rise is flagged with a rate above the new one (in a
trace through TorchServe, 40/s for a step to 14/s) and a test restarted from
it soon "sees" a fall back to the truth, a second, false change (on synthetic
steps it turned one move into three).  So after an alarm the detector
*learns* before it tests again: it counts the arrivals after the alarm
(not the tail that raised it) until there are ``learn_arrivals`` of them or
``learn_seconds`` have passed, and restarts from their rate, which no alarm
chose.  (Counting the tail in made too little difference: 13-15 of the 20
arrivals were still the alarm's.)  Twenty arrivals still leave the rate
±22 % uncertain, and a test against a rate that is 20 % off alarms far
sooner than its design says; so the rate is learned again from every
arrival since the alarm each time their number doubles (40, 80, 160),
keeping what the tests have gathered (a restart would drop the evidence of
a change under way).

A bank of two tests per direction: one tuned for ``ratio`` (2×: the
smallest change worth a move) and one for ``large_ratio`` (5×).  A test tuned
for 2× needs ~1.0 s to flag a 7× step from 2 req/s at one false alarm an
hour (its drift under the new rate is 14·ln 2 − 2 = 7.7 per second against
h ≈ 7.7); one tuned for 5× gains 14·ln 5 − 8 = 14.5 per second against
h ≈ 10.5 and flags it in ~0.7 s.  The false-alarm budget is split between
the two (each test's mean time to a false alarm doubled), so the bank's
rate of false alarms stays within the one asked for.

Pure logic: it reads counts the caller samples (the frontend's request
counter) and keeps no clock of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)  # by name: a positional call once set large_ratio to a false-alarm time
class DetectorConfig:
    ratio: float = 2.0  # the smallest rise (and, inverted, fall) the test is tuned for
    large_ratio: float | None = 5.0  # a second test per direction, for large steps (None: one test per direction)
    false_alarm_seconds: float = 3600.0  # the mean time between false alarms under a constant rate, per direction
    min_rate: float = 0.05  # requests/s: below this a rate is treated as this (an idle model still has a scale)
    # After an alarm: the new rate is learned from this many arrivals (or this many seconds) before testing resumes,
    # then re-learned from all arrivals since the alarm each time their number doubles, up to ``refine_arrivals``.
    learn_arrivals: int = 20
    learn_seconds: float = 3.0
    refine_arrivals: int = 160
    # A rate learned from ``n`` arrivals is tested against its bound ``uncertainty_z`` standard errors toward the
    # side each test watches (above for a rise, below for a fall), so that an estimate from few arrivals does not
    # alarm more often than designed.  0 (the default): against the estimate itself.  At one threshold, z = 1
    # flags a 7× step about a quarter second later with far fewer false alarms; the load monitor pairs it with a
    # lower threshold (``MonitorConfig.change_uncertainty_z``; measured in ``bench/detector_delays.py``).
    uncertainty_z: float = 0.0

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ValueError(f"ratio must be > 1, got {self.ratio!r}")
        if self.large_ratio is not None and not self.large_ratio > self.ratio:
            raise ValueError(f"large_ratio must be > ratio, got {self.large_ratio!r}")
        if not self.false_alarm_seconds > 0 or not self.min_rate > 0:
            raise ValueError("false_alarm_seconds and min_rate must be positive")
        if self.learn_arrivals < 0 or self.learn_seconds < 0:
            raise ValueError("learn_arrivals and learn_seconds must be ≥ 0")
        if not self.uncertainty_z >= 0:
            raise ValueError(f"uncertainty_z must be ≥ 0, got {self.uncertainty_z!r}")


@dataclass(frozen=True)
class RateChange:
    direction: str  # "up" or "down"
    old_rate: float
    new_rate: float  # arrivals/s since the estimated change point
    since_s: float  # seconds from the estimated change point to the alarm
    arrivals: int  # arrivals in that time


def reference_rate(count: int, seconds: float, z: float, direction: str) -> float:
    """The rate a test watching ``direction`` compares against, from ``count`` arrivals in ``seconds``: the
    estimate moved ``z`` standard errors toward that side, on the square-root scale where a Poisson count's
    spread is ½ whatever its mean (``(√n ± z/2)² / t``)."""
    root = math.sqrt(count) + (z / 2.0 if direction == "up" else -z / 2.0)
    return max(root, 0.0) ** 2 / max(seconds, 1e-9)


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

    def retarget(self, rate: float, false_alarm_seconds: float) -> None:
        """Test around ``rate`` from now on, keeping the statistic: a refined estimate of the same rate."""
        self.shift = (self.r - 1.0) * rate
        self.h = threshold(rate, self.r, false_alarm_seconds)
        self.rate = rate

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
        # (arrivals, seconds) counted since the last alarm (or since the start of the caller's measurement), while
        # the rate is learned (``_learning``: no test runs) or refined (up to ``refine_arrivals``); None after.
        self._counted: tuple[int, float] | None = None
        self._learning = False
        self._refine_at = 0
        self.restart(rate)

    def restart(self, rate: float) -> None:
        """Test against ``rate`` from now on (after an alarm, or when the caller knows better)."""
        self._counted, self._learning = None, False
        self.rate = max(rate, self.config.min_rate)
        cfg = self.config
        ratios = (cfg.ratio,) if cfg.large_ratio is None else (cfg.ratio, cfg.large_ratio)
        # Each test gets an equal share of the false-alarm budget: its mean time to a false alarm × the count.
        self._each_s = cfg.false_alarm_seconds * len(ratios)
        self._tests = [("up", _OneSided(self.rate, r, self._each_s)) for r in ratios]
        self._tests += [("down", _OneSided(self.rate, 1.0 / r, self._each_s)) for r in ratios]
        self._up, self._down = self._tests[0][1], self._tests[len(ratios)][1]

    @property
    def learning(self) -> tuple[int, float] | None:
        """(arrivals, seconds) since the last alarm while the new rate is being learned; None when testing."""
        return self._counted if self._learning else None

    def refine_from(self, count: int, seconds: float) -> None:
        """Test from the rate of ``count`` arrivals in ``seconds`` and refine that rate as arrivals double: after
        an alarm, and for the caller's starting rate (read from one short window, it is as uncertain)."""
        self.restart(count / max(seconds, 1e-9))
        self._aim(count, seconds)

    def _refine(self, count: int, seconds: float) -> None:
        """Test against the refined rate from now on, keeping the evidence gathered so far."""
        self.rate = max(count / max(seconds, 1e-9), self.config.min_rate)
        self._aim(count, seconds)

    def _aim(self, count: int, seconds: float) -> None:
        """Each test against the learned rate's bound on its own side; refined again once the arrivals double."""
        for direction, side in self._tests:
            bound = reference_rate(count, seconds, self.config.uncertainty_z, direction)
            side.retarget(max(bound, self.config.min_rate), self._each_s)
        self._schedule_refinement(count, seconds)

    def _schedule_refinement(self, count: int, seconds: float) -> None:
        self._refine_at = max(2 * count, self.config.learn_arrivals)
        self._counted = (count, seconds) if self._refine_at <= self.config.refine_arrivals else None

    @property
    def thresholds(self) -> tuple[float, float]:
        """(h up, h down) of the tests tuned for ``ratio``, at the current rate."""
        return self._up.h, self._down.h

    def observe(self, arrivals: int, dt: float) -> RateChange | None:
        """``arrivals`` counted over the last ``dt`` seconds; a change when one direction's test alarms."""
        if arrivals < 0 or dt < 0:
            raise ValueError(f"arrivals and dt must be ≥ 0, got {arrivals}, {dt}")
        if self._counted is not None:
            count, seconds = self._counted[0] + arrivals, self._counted[1] + dt
            self._counted = (count, seconds)
            if self._learning:
                if count >= self.config.learn_arrivals or seconds >= self.config.learn_seconds:
                    self.refine_from(count, seconds)
                return None
            if count >= self._refine_at:
                self._refine(count, seconds)
        # Every test sees every sample; the first that alarms (the small ratio's before the large one's) speaks.
        alarms = [(direction, side) for direction, side in self._tests if side.observe(arrivals, dt)]
        if not alarms:
            return None
        direction, side = alarms[0]
        count, seconds = side.change_point()
        change = RateChange(direction, self.rate, count / max(seconds, 1e-9), seconds, count)
        self.restart(change.new_rate)
        # Learn the new rate; the tail that raised the alarm is not counted: it is what biased it.
        self._counted, self._learning = (0, 0.0), True
        return change
