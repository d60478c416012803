"""The machine's fingerprint: what a latency measured here depends on.

Profiles and benchmark tables carry it, so a number is never read on another CPU.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import psutil

from serving_harness.topology import CpuTopology


def _read_cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_fingerprint() -> dict[str, Any]:
    """What makes latencies comparable: CPU model, core counts, sockets, torch."""
    import torch  # here, not at the top: the load generator and clients import this package without torch

    topo = CpuTopology.from_system()
    return {
        "cpu_model": _read_cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(topo.cores),
        "sockets": len(topo.sockets),
        "torch": torch.__version__,
    }


# What must match for a latency measured on one machine to be read on another.
FINGERPRINT_KEYS = ("cpu_model", "logical_cores", "torch")


def fingerprint_differences(recorded: dict[str, Any], current: dict[str, Any] | None = None) -> list[str]:
    """The fingerprint keys on which ``recorded`` differs from this machine, each as one readable line."""
    current = current if current is not None else hardware_fingerprint()
    return [
        f"{key}: recorded {recorded.get(key)!r} vs this machine {current.get(key)!r}"
        for key in FINGERPRINT_KEYS
        if recorded.get(key) != current.get(key)
    ]
