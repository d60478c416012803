"""Online estimate of the batch size B a model sees, from queue-depth samples.

Packrat's pipeline: EWMA(α) of observed queue depth → round down to a power of
two → mode of the last ``n`` estimates → a new B, subject to a
reconfiguration timeout.  Defaults follow the reference implementation:
a sample every 5 ms, α = 0.1, n = 10, timeout 1 s.

How the timeout is applied: a candidate B (a mode different from the current
B) is proposed only after it has stayed the mode for the whole timeout, and
never sooner than one timeout after the previous change.  Read as a plain
rate limit instead, a step from 2 to 16 requests would reconfigure twice (to 8
while the EWMA climbs, then to 16 a second later), and each reconfiguration
costs a worker swap.  As a debounce, the step yields exactly one change, and
noise that flips the mode back within the timeout yields none.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorConfig:
    alpha: float = 0.1
    window: int = 10
    sample_period_s: float = 0.005
    timeout_s: float = 1.0
    min_batch: int = 1
    max_batch: int = 1024

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.window < 1:
            raise ValueError(f"window must be ≥ 1, got {self.window}")
        if self.sample_period_s <= 0 or self.timeout_s < 0:
            raise ValueError("sample period must be positive and timeout non-negative")
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(f"need 1 ≤ min_batch ≤ max_batch, got {self.min_batch}, {self.max_batch}")


def floor_power_of_two(x: float) -> int:
    """Largest power of two ≤ x (1 for x < 2)."""
    if x < 2:
        return 1
    return 1 << (int(x).bit_length() - 1)


class BatchSizeEstimator:
    """Feed it ``observe(depth, now)``; it returns a new B when one is due."""

    def __init__(self, config: EstimatorConfig = EstimatorConfig(), initial_batch: int = 1) -> None:
        self.config = config
        self.current = self._clamp(initial_batch)
        self.ewma: float | None = None
        self.estimates: collections.deque[int] = collections.deque(maxlen=config.window)
        self.last_change: float | None = None
        self._candidate: int | None = None
        self._candidate_since = 0.0

    def _clamp(self, batch: int) -> int:
        lo = floor_power_of_two(self.config.min_batch)
        hi = floor_power_of_two(self.config.max_batch)
        return min(max(floor_power_of_two(batch), lo), hi)

    @property
    def mode(self) -> int:
        """Most frequent recent estimate; a tie keeps the current B (no flip-flop)."""
        if not self.estimates:
            return self.current
        counts = collections.Counter(self.estimates)
        top = max(counts.values())
        tied = [b for b, c in counts.items() if c == top]
        if self.current in tied:
            return self.current
        return max(tied, key=lambda b: max(i for i, e in enumerate(self.estimates) if e == b))

    def observe(self, depth: float, now: float) -> int | None:
        """Record one queue-depth sample taken at ``now`` (seconds, monotonic)."""
        if depth < 0:
            raise ValueError(f"queue depth cannot be negative: {depth}")
        alpha = self.config.alpha
        self.ewma = depth if self.ewma is None else alpha * depth + (1 - alpha) * self.ewma
        self.estimates.append(self._clamp(max(self.ewma, 1.0)))
        if self.last_change is None:
            self.last_change = now
        mode = self.mode
        if mode == self.current:
            self._candidate = None
            return None
        if mode != self._candidate:
            self._candidate, self._candidate_since = mode, now
        timeout = self.config.timeout_s
        if now - self._candidate_since >= timeout and now - self.last_change >= timeout:
            self.current, self.last_change, self._candidate = mode, now, None
            return mode
        return None
