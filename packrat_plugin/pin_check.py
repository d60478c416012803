"""Where a model's TorchServe workers actually run, read from /proc, against the slots Packrat gave them.

Used by the serving tests and the soak bench alike: "every worker on its own
slot's cores" is a claim about the kernel's view of each thread, so it is read
there (``/proc/<pid>/task/<tid>/status``), not from what the workers logged.
"""

from __future__ import annotations

import os
from pathlib import Path

from handlers.pinning.slots import PlanStore
from serving_harness.clients import ManagementClient
from serving_harness.topology import parse_cpu_list


def affinity_of_tasks(pid: int) -> set[tuple[int, ...]]:
    """Cpus_allowed_list of every thread of a process, as core tuples; FileNotFoundError if it is gone."""
    seen = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        line = next(x for x in text.splitlines() if x.startswith("Cpus_allowed_list"))
        seen.add(tuple(parse_cpu_list(line.split(":", 1)[1].strip())))
    return seen


def pinning_faults(management: ManagementClient, store: PlanStore, model: str) -> list[str]:
    """Every way a READY worker's threads stray from the slots of its own version's plan, and every slot two
    workers of one version share (empty: none).  A worker that exits while it is read is skipped."""
    faults = []
    for version in management.describe(model, "all"):
        name = str(version["modelVersion"])
        plan = store.read(model, name)
        slots = {tuple(slot.cores) for slot in plan.slots} if plan else set()
        seen: list[tuple[int, ...]] = []
        for worker in version.get("workers", []):
            if worker.get("status") != "READY":
                continue
            try:
                tasks = affinity_of_tasks(int(worker["pid"]))
            except FileNotFoundError:  # exited since the describe call
                continue
            if len(tasks) != 1 or next(iter(tasks)) not in slots:
                faults.append(f"{name} worker {worker['pid']}: threads on {sorted(tasks)}, slots {sorted(slots)}")
            seen.extend(tasks)
        if len(seen) != len(set(seen)):
            faults.append(f"{name}: two workers on one slot: {seen}")
    return faults
