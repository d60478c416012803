"""Keep the cyclic garbage collector off what a worker loaded at start-up.

A worker's start-up leaves millions of objects that live as long as it does:
the imported modules (``transformers`` alone brings hundreds of thousands of
functions and classes), the model's modules and parameters, TorchServe's
context.  CPython's collector walks every tracked object at each full
collection, and serving makes full collections often: every request
allocates coroutines, futures, dicts and closures, so the youngest
generation fills every few dozen requests, and every hundredth of those
collections walks the whole heap.  The collector then runs on the thread
that allocated last, holding the GIL, which is the thread a host-bound
handler cannot spare.

Measured on the 2-vCPU Xeon VM with the one-layer BERT at capacity
(``bench.ebird_direct``'s closed loop, in-process): Ebird's event loop spent
~51 µs of CPU per request with the collector as it is, ~42 with the
start-up heap frozen and ~37 with collection off altogether; the plain
handler under batching went from 69 to 66 µs.  ``docs/benchmarks/host_path.md``
has the bench run.

With BERT-base loaded a worker tracks ~420,000 objects; walking them once
(the collection before the freeze, below) took 0.18 s on that VM, which
every full collection paid again while serving and which is now paid once,
at start-up.

``gc.freeze`` moves every object tracked now into a permanent generation
that no later collection visits.  A collection first clears what start-up
left as garbage (loading a checkpoint makes some), so nothing that is
already dead is kept.  Objects made while serving are collected as before;
only a cycle among start-up objects that is broken later would stay
allocated, which for a worker that serves one model until it exits is
nothing that matters.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect start-up garbage, then exempt every surviving object from future collections.

    Called at the end of a handler's ``initialize``: what the worker loaded
    is then never walked again.  Only the first call in a process freezes
    (a TorchServe worker serves one handler).  Returns how many objects are
    frozen (the start-up log says it).
    """
    if frozen := gc.get_freeze_count():
        # Frozen already: a process that initialises several handlers (tests, in-process benchmarks) freezes
        # once, so what later handlers leave as cyclic garbage is still collected.
        return frozen
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("garbage collector: %d start-up objects frozen, never walked again (%.2f s)", frozen,
                time.perf_counter() - started)  # fmt: skip
    return frozen
