"""REEF's settings (``handler.reef`` in model-config.yaml) and a request's priority.

Which priority a request gets: its ``X-Priority`` header (``realtime`` or
``best-effort``) when it has one, else its model's default in the archive
(``realtime: [names]``; every other model is best-effort).  The header wins
because the client knows the deadline of the request in hand: one
best-effort model may serve a latency-bound caller too, and a real-time
model's batch jobs need not preempt anything.  An archive that must not let
clients choose sets ``priority_header: false``; a value the handler does not
know is a 400, never a silent best-effort.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from handlers.errors import bad_request
from handlers.settings import known_settings

# How real-time and best-effort work share the worker.  "reef" is the
# handler; the other two are the paper's baselines, kept in the same engine
# so that a benchmark compares scheduling alone: "seq" runs one batch at a
# time, real-time first, never interrupting one (SEQ); "concurrent" runs
# every queue at once with no priority (plain concurrent execution).
POLICIES = ("reef", "seq", "concurrent")
REALTIME = "realtime"
BEST_EFFORT = "best-effort"
PRIORITIES = (REALTIME, BEST_EFFORT)
PRIORITY_HEADER = "x-priority"
MODEL_HEADER = "x-model"


class ReefConfigError(ValueError):
    pass


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReefConfigError(f"{name} must be an integer ≥ 1, got {value!r}")


@dataclass(frozen=True)
class ReefConfig:
    realtime: tuple[str, ...] = ()  # models whose requests are real-time unless the request says otherwise
    # Launch units a best-effort batch is cut into: an RT request waits for the
    # ones in flight, so more units, shorter waits (docs/benchmarks: 8 on
    # workload A, RT 1.09× RT-only; 16 on workload C, 1.09×, against 1.13× with 8).
    segments: int = 8
    c: int = 4  # CUDA: units a best-effort stream keeps queued on the device (REEF-N); CPU runs one at a time
    rt_max_batch: int = 4  # real-time requests of one model run together when they queue
    be_max_batch: int = 4
    max_inflight: int = 64  # requests admitted at once (then the runtime waits for room)
    priority_header: bool = True  # whether X-Priority may override a model's default
    policy: str = "reef"  # or a baseline: "seq", "concurrent" (POLICIES)
    # CUDA, policy reef: dynamic kernel padding in the form PyTorch allows.  In
    # real-time mode a BE executor does not stop at the gate: it launches one
    # unit at a time on its low-priority stream and waits for it before the
    # next, so BE fills what the RT stream leaves of the GPU, and at most one
    # BE unit per executor is ever queued beside RT work.  False: BE stops in
    # real-time mode (plain priority streams).  The CPU ignores it (a BE unit
    # there takes cores from the RT batch).
    padding: bool = False
    # CUDA, policy reef: RT isolation in space as well as time.  An integer
    # reserves that many SMs for real-time work on a CUDA green context and
    # runs best-effort work on a second one over the rest (the driver rounds
    # a count up to the sizes it can split); "auto" sizes RT's share at
    # start-up, the fewest SMs on which the RT models' batch runs within 5 %
    # of its time on the whole GPU (``handlers/runtime/sm_partition.py``).
    # None (the default): both on the whole GPU, priority streams alone.
    # Needs CUDA driver 12.8+ and cuda-bindings; the CPU ignores it.
    rt_sms: int | str | None = None
    # CUDA: each best-effort launch unit replays a CUDA graph captured per batch
    # bucket (1, 2, 4, … ``be_max_batch``; ``runtime/stage_programs.py``), so a
    # unit is one copy in and one launch, and a preemption point one graph
    # boundary.  Off until measured on a GPU; the CPU ignores it.
    be_graphs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.realtime, str) or not all(isinstance(n, str) for n in self.realtime):
            raise ReefConfigError(f"realtime must be a list of model names, got {self.realtime!r}")
        for name in ("segments", "c", "rt_max_batch", "be_max_batch", "max_inflight"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.be_graphs, bool):
            raise ReefConfigError(f"be_graphs must be true or false, got {self.be_graphs!r}")
        if not isinstance(self.padding, bool):
            raise ReefConfigError(f"padding must be true or false, got {self.padding!r}")
        if not isinstance(self.priority_header, bool):
            raise ReefConfigError(f"priority_header must be true or false, got {self.priority_header!r}")
        if self.rt_sms is not None and self.rt_sms != "auto":
            value = self.rt_sms
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ReefConfigError(f'rt_sms must be "auto" or a number of SMs ≥ 1, got {value!r}')
        if self.rt_sms is not None and self.policy != "reef":
            raise ReefConfigError(f"rt_sms splits the GPU for policy reef only, not {self.policy!r}")
        if self.policy not in POLICIES:
            raise ReefConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.max_inflight < max(self.rt_max_batch, self.be_max_batch):
            raise ReefConfigError(f"max_inflight ({self.max_inflight}) must hold one full batch")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ReefConfig:
        raw = known_settings(cls, raw, "reef", ReefConfigError)
        if "realtime" in raw:
            value = raw["realtime"]
            raw["realtime"] = tuple(value) if isinstance(value, list | tuple) else value
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["realtime"] = list(self.realtime)
        return out

    def check_members(self, names: list[str]) -> None:
        """The real-time defaults must name models the archive serves."""
        stray = sorted(set(self.realtime) - set(names))
        if stray:
            raise ReefConfigError(f"realtime names {stray}, which this archive does not serve ({', '.join(names)})")

    def priority(self, model: str, header: str | None) -> str:
        """A request's priority: its header's, else its model's default (module docstring)."""
        if header is not None and self.priority_header:
            value = header.strip().lower()
            if value not in PRIORITIES:
                raise bad_request(f"unknown X-Priority {header!r}; use one of: {', '.join(PRIORITIES)}")
            return value
        return REALTIME if model in self.realtime else BEST_EFFORT
