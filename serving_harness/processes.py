"""Whether a process still runs, for the files that name one (slot leases, TorchServe's pid record)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (another user's process counts: it exists), False for none or pid ≤ 0."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
