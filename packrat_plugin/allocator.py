"""The core allocator: a plan becomes pinned slots.

A slot is ``{cores, threads, batch}``: one worker instance, pinned to
``cores`` and running ``threads`` intra-op threads on batches of ``batch``.
Slots are disjoint (no two instances share a core), never run more threads
than they have cores, and stay on one socket whenever the instance fits in
one, because an instance split over sockets pays remote-memory latency on
every layer.  The usable cores come from ``serving_harness.topology``.
"""

from __future__ import annotations

from handlers.pinning.slots import AllocationError, Slot
from packrat_plugin.plan_types import Plan
from serving_harness.topology import CpuTopology


def allocate(plan: Plan, topology: CpuTopology) -> list[Slot]:
    """Pin each instance of ``plan`` to its own cores.

    First-fit decreasing: largest instances first, each onto the socket with
    the most free cores that can hold it whole (which spreads instances round
    robin over sockets), taking that socket's lowest free cores.  An instance
    larger than any socket takes whole sockets, then the rest.
    """
    wanted = plan.threads_used
    available = len(topology.cores)
    if wanted > available:
        raise AllocationError(f"plan needs {wanted} cores but only {available} are usable: {plan.describe()}")
    free = {s: list(cores) for s, cores in topology.sockets.items()}
    largest_socket = max(len(c) for c in topology.sockets.values())
    slots: list[Slot] = []
    instances = sorted(((item.threads, item.batch) for item in plan.instances for _ in range(item.count)), reverse=True)
    for threads, batch in instances:
        if threads <= largest_socket:
            fitting = [s for s, cores in free.items() if len(cores) >= threads]
            if not fitting:
                raise AllocationError(
                    f"no socket has {threads} free cores for an instance (free per socket: "
                    f"{ {s: len(c) for s, c in free.items()} }); plan: {plan.describe()}"
                )
            socket = max(fitting, key=lambda s: (len(free[s]), -s))
            cores, free[socket] = free[socket][:threads], free[socket][threads:]
        else:
            cores = []
            for socket in sorted(free, key=lambda s: -len(free[s])):
                take = min(threads - len(cores), len(free[socket]))
                cores += free[socket][:take]
                free[socket] = free[socket][take:]
        slots.append(Slot(tuple(sorted(cores)), threads, batch))
    return slots
