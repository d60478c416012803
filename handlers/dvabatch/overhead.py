"""What a DVABatch stage run costs its lane besides the stage, learnt from the runs it serves.

The segment profile times each stage alone, at worker start.  A run in
service costs its lane more, after the stage: the table's work where it
ends, the next runs' planning and launch, and after the last stage the
answers' encoding and hand-back.  On a millisecond model that is as much as
the stage, and most of it is paid once per run, whatever the rows: exactly
what merging length classes saves (``merge.py``).  So each engine times,
on the lane, the stretch from a stage's end to its run's last step, and
fits it against the run's rows as a line, older runs weighing less; the
intercept is the cost per run that no profile sees.  The stage itself is
left out, slowed as it may be by the other lane: a slowdown that grows with
the stage is not a cost per run, and on BERT-base a tenth of a 1.4-s stage
would read as a large one.
"""

from __future__ import annotations

import threading

# Each run's weight halves after this many more runs: the fit follows a change of load within a second or two
# at thousands of runs per second, and holds a few hundred runs' worth of samples.
HALF_LIFE_RUNS = 256


class RunOverhead:
    """A line ``host_ms ≈ per_run + per_row · rows`` fitted by least squares with exponential forgetting."""

    def __init__(self, half_life_runs: int = HALF_LIFE_RUNS) -> None:
        self._keep = 0.5 ** (1.0 / half_life_runs)
        self._lock = threading.Lock()  # runs end on either lane
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def observe(self, rows: int, extra_ms: float) -> None:
        """A run of ``rows`` cost its lane ``extra_ms`` besides its stage."""
        with self._lock:
            k = self._keep
            self._w = self._w * k + 1.0
            self._x = self._x * k + rows
            self._xx = self._xx * k + rows * rows
            self._y = self._y * k + extra_ms
            self._xy = self._xy * k + rows * extra_ms

    @property
    def weight(self) -> float:
        """How many runs the fit holds, older ones counted by their weight (0: none yet)."""
        return self._w

    def per_run_ms(self) -> float:
        """The fitted cost of a run whatever its rows (≥ 0; 0 before any run).

        Runs all of one size cannot tell a run's cost from a row's; their
        mean is then taken as the run's, which overstates it by the rows'
        share (the encoding of a batch's answers: tens of microseconds).
        """
        with self._lock:
            w, x, xx, y, xy = self._w, self._x, self._xx, self._y, self._xy
        if w <= 0.0:
            return 0.0
        spread = w * xx - x * x
        if spread <= 1e-9 * w * w:
            return max(0.0, y / w)
        return max(0.0, (y * xx - x * xy) / spread)
