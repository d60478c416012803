"""Named points in a swap where a test can have the controller killed, as ``kill -9`` would.

A restarted controller must take over whatever a dead one left half done
(``ActivePassiveSwapper.adopt``), and the states a swap passes through are
only reachable by stopping the process in the middle of one: between the
swap's five steps (register the new version, start its workers, make it the
default, drain the old one, retire it).  Setting ``PACKRAT_FAILPOINT`` to one
of ``SWAP_POINTS`` makes the process send itself SIGKILL when a swap reaches
that point, so nothing after it runs: no ``finally``, no cleanup, exactly
what a crash or an OOM kill leaves.  Unset (always, outside such a test), a
failpoint is one dictionary lookup.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

ENV = "PACKRAT_FAILPOINT"

SWAP_POINTS = (
    "registered",  # the new version is registered with its first workers; not yet scaled to the plan's count
    "ready",  # the new version's workers are READY; the old version is still the default
    "switched",  # the new version is the default; the old one has no drain marker yet
    "draining",  # the old version's drain marker is written; its queue may still hold requests
    "drained",  # the old version is idle and unmarked; not yet scaled down
)


def reach(point: str) -> None:
    """Kill this process here if ``PACKRAT_FAILPOINT`` names ``point``."""
    if os.environ.get(ENV) != point:
        return
    logger.warning("failpoint %s reached: killing this process (SIGKILL)", point)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
