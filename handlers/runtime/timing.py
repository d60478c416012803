"""How long a call takes: the one timer behind every start-up measurement the handlers make.

Several handlers choose how to run by timing the choices at start-up:
Ebird times each worker's batch size for its lane rule, DVABatch keeps a
padded stage trace only where it beats the eager stage, Nimble picks each
bucket's fastest program, and the benchmarks time the costs their tables
explain themselves with.  They all want the same thing: the median of a few
warm calls, a call that takes microseconds timed over many, one that takes
seconds over few, and on a GPU the device's queue drained around each call
so that what is timed is the work and not its launch.  The median, because
a shared machine's hiccups only ever make a call slower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

MAX_BUDGET_RUNS = 200  # a budget keeps calling a fast program at most this often


def median_seconds(
    run: Callable[[], Any],
    *,
    warm: int = 1,
    repeats: int = 3,
    budget_s: float = 0.0,
    max_runs: int | None = MAX_BUDGET_RUNS,
    sync: Callable[[], Any] | None = None,
) -> float:
    """The median seconds of a call of ``run``.

    ``warm`` untimed calls first (a first call pays lazy initialisation;
    TorchScript's executor profiles a program's first two calls and
    optimises after them).  Then at least ``repeats`` timed calls, and more
    while the timed calls add up to less than ``budget_s`` (at most
    ``max_runs`` calls; None: no limit).  ``sync``, when given, is called
    before each timed call and inside its time after it: a CUDA device's
    ``synchronize``, so that the time is the kernels' and not only their
    launch.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for _ in range(warm):
        run()
    times: list[float] = []
    total = 0.0
    while len(times) < repeats or (total < budget_s and (max_runs is None or len(times) < max_runs)):
        if sync is not None:
            sync()
        started = time.perf_counter()
        run()
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - started
        times.append(elapsed)
        total += elapsed
    return statistics.median(times)
