"""Ebird's knobs, as the archive's model-config.yaml carries them.

```yaml
handler:
  ebird:
    worker_batches: [1, 1, 2, 4, 8, 16]   # one engine worker per entry
    max_inflight: 32                      # MaxInf: inputs in flight at once
    pool_slots: 64                        # input pool ring size
    cpu_lanes: 1                          # CPU only: batches that run at once
    cpu_rule: lane                        # CPU only: "lane" (one batch per free lane) or "plan" (the paper's)
    cpu_batch_cap: auto                   # CPU lane rule: largest batch; "auto": from measured costs
    cpu_quiet_batches: true               # CPU only: read no requests while every lane runs a batch
    cuda_graphs: true                     # CUDA only: each worker replays a captured graph of its batch size
```

``cpu_lanes`` is how the CPU path splits intra-op threads: workers hand
their batches to ``cpu_lanes`` lane threads (``handlers/runtime/lanes.py``),
so at most that many batches run at once, each with ``threads // cpu_lanes``
intra-op threads (threads: the worker's Packrat slot, or torch's default of
one per core).  Requests are decoded on the same lanes, between batches
(``handlers/runtime/decode.py``).  The default, 1, gives every
batch all cores (on a CPU a lone request is fastest that way); raise it on
many-core machines where one batch cannot use all cores well.  On CUDA the
lanes are the workers' streams and all of them may run at once.

``cpu_rule`` is how a CPU worker forms batches (``scheduler.py``).
``lane``, the default, gives each free lane one batch, at most
``cpu_batch_cap`` inputs; ``auto`` caps at the smallest worker size within
5 % of the cheapest per input, from costs timed at warm-up and then taken
from served batches (``handlers/ebird/batch_costs.py``).  ``plan``
runs the paper's plan over every idle worker, its batches one after
another on the lanes.  Neither applies on CUDA, where the paper's plan is
the rule.

``cpu_quiet_batches`` submits every CPU batch as a quiet lane job: while
every lane runs one, the worker's message reader waits
(``handlers/runtime/lanes.py``, ``worker_pump.py``).  A request read then
could only be decoded after the batch, since decodes queue on the lane;
reading and starting it during the batch costs the batch's OpenMP team a
core and its thread the GIL.  ``false`` reads requests as they arrive.
It applies to requests admitted decoded; a batch of requests taken
undecoded (``handlers/runtime/row_intake.py``, the default path on CPU
lanes with one input layout) is never quiet: a request read while it runs
is only queued, so it is in line when the batch ends and the next batch
starts at once (``docs/benchmarks/host_path.md``, "Requests taken
undecoded").

``cuda_graphs`` (CUDA only) captures one CUDA graph per engine worker at
start-up, at the worker's batch size, with its own input buffer and memory
pool (workers run at once on their streams, so none may share
intermediates).  A batch is then one copy into that buffer and one graph
launch.  Without it each batch launches the model's kernels one by one from
its worker thread, and on the lent H200 several such threads contending for
the GIL made the batch stage 30 ms around an 8.5 ms model
(``docs/benchmarks/ebird_direct_resnet50_cuda.md``).  ``false`` runs the
model eagerly; the CPU ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from handlers.ebird.scheduler import default_worker_batches
from handlers.settings import known_settings

CPU_RULES = ("lane", "plan")


class EbirdConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EbirdConfig:
    worker_batches: tuple[int, ...] = tuple(default_worker_batches(32))
    max_inflight: int = 32
    pool_slots: int = 64
    cpu_lanes: int = 1
    cpu_rule: str = "lane"
    cpu_batch_cap: int | str = "auto"
    cpu_quiet_batches: bool = True
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        batches = self.worker_batches
        if not batches or any(not isinstance(b, int) or b < 1 or b & (b - 1) for b in batches):
            raise EbirdConfigError(f"worker_batches must be powers of two ≥ 1, got {list(batches)}")
        if 1 not in batches:
            raise EbirdConfigError("worker_batches needs a worker of batch 1, or a lone request could wait forever")
        for name in ("max_inflight", "pool_slots", "cpu_lanes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EbirdConfigError(f"{name} must be an integer ≥ 1, got {value!r}")
        if self.cpu_rule not in CPU_RULES:
            raise EbirdConfigError(f"cpu_rule must be one of {', '.join(CPU_RULES)}, got {self.cpu_rule!r}")
        cap = self.cpu_batch_cap
        if cap != "auto" and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise EbirdConfigError(f"cpu_batch_cap must be 'auto' or an integer ≥ 1, got {cap!r}")
        if not isinstance(self.cpu_quiet_batches, bool):
            raise EbirdConfigError(f"cpu_quiet_batches must be true or false, got {self.cpu_quiet_batches!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise EbirdConfigError(f"cuda_graphs must be true or false, got {self.cuda_graphs!r}")
        if self.pool_slots < max(batches):
            raise EbirdConfigError(
                f"pool_slots ({self.pool_slots}) must hold the largest worker batch ({max(batches)})"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> EbirdConfig:
        raw = known_settings(cls, raw, "ebird", EbirdConfigError)
        if "worker_batches" in raw:
            if not isinstance(raw["worker_batches"], (list, tuple)):
                raise EbirdConfigError(f"worker_batches must be a list, got {raw['worker_batches']!r}")
            raw["worker_batches"] = tuple(raw["worker_batches"])
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_batches": list(self.worker_batches),
            "max_inflight": self.max_inflight,
            "pool_slots": self.pool_slots,
            "cpu_lanes": self.cpu_lanes,
            "cpu_rule": self.cpu_rule,
            "cpu_batch_cap": self.cpu_batch_cap,
            "cpu_quiet_batches": self.cpu_quiet_batches,
            "cuda_graphs": self.cuda_graphs,
        }
