"""Packrat's mixed plans in one TorchServe worker: one pinned lane per instance.

The swapper serves a mixed plan (several ⟨threads, batch⟩ classes) as one
version with one worker in async mode (``packrat_plugin/archives.py`` writes
that archive copy).  The worker claims every slot of the plan
(``worker.claim_group``), pins the process to their cores, and runs one CPU
lane per slot, pinned to the slot's cores with its thread count.  Requests
are decoded as they arrive and queued once; each idle instance takes up to
its own batch size of the oldest (``instances.py``).  Each instance
records its batches in its own slot's counters, so the controller sees what
every instance served.

Without a Packrat plan (plain TorchServe) the handler is one instance with
every thread and a batch of ``max_batch`` (model-config.yaml ``handler:
plan: {max_batch: N, max_batch_delay_ms: D}``, defaults 1 and 5 ms: how long
an instance waits for a fuller batch, as TorchServe's ``maxBatchDelay``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from handlers.codecs import ModelInput
from handlers.mixed_plan.instances import Instance, InstanceEngine, InstancePool
from handlers.runtime.async_handler import AsyncModelHandler
from handlers.runtime.engine import Engine
from handlers.runtime.lanes import CpuLanes, LanePlacement

logger = logging.getLogger(__name__)

WAITING_PER_BATCH = 8  # requests the pool holds before admission waits, per request of a full round


class PackratPlanHandler(AsyncModelHandler):
    def __init__(self) -> None:
        super().__init__()
        self.pool: InstancePool | None = None
        self.max_batch = 1
        self.max_delay_s = 0.005

    def configure(self, handler_config: dict[str, Any]) -> None:
        settings = handler_config.get("plan") or {}
        max_batch = settings.get("max_batch", 1)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"handler.plan.max_batch must be a positive integer, got {max_batch!r}")
        self.max_batch = max_batch
        delay = settings.get("max_batch_delay_ms", 5)
        if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
            raise ValueError(f"handler.plan.max_batch_delay_ms must be a number ≥ 0, got {delay!r}")
        self.max_delay_s = delay / 1000.0

    def instances(self) -> list[Instance]:
        claim = self.packrat_claim
        if claim is not None and claim.instances:
            return [Instance(i, slot.threads, slot.batch) for i, slot in enumerate(claim.instances)]
        return [Instance(0, self.cpu_threads, self.max_batch)]

    def create_lanes(self) -> CpuLanes:
        claim = self.packrat_claim
        if claim is not None and claim.instances:
            return CpuLanes.placed([LanePlacement(slot.cores, slot.threads) for slot in claim.instances])
        return CpuLanes(1, self.cpu_threads)

    def _start_batch(self, instance: Instance, requests: int) -> None:
        claim = self.packrat_claim
        lane_cores = claim.instances[instance.lane].cores if claim is not None and claim.instances else None
        self.wait_for_drains(cores=lane_cores)  # a lane on cores the old set keeps waits for its drain
        self.metrics.batch_started(requests, [])

    def _run(self, instance: Instance, stacked: tuple[torch.Tensor, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(*stacked).float()

    def _record(self, instance: Instance, requests: int, seconds: float) -> None:
        self.metrics.batch_finished(seconds)
        self.record_instance_batch(instance.lane, requests, int(seconds * 1e9))

    def unanswered_changed(self, count: int) -> None:
        """The slot's in-service count is every request read and not yet answered (not only those
        admitted), so the swapper never retires this set while a request is still decoding."""
        claim = self.packrat_claim
        if claim is not None:
            claim.counters.set_in_service(count)

    def create_engine(self, layout_example: ModelInput) -> Engine:
        if self.device.is_cuda:
            raise RuntimeError("Packrat's plan handler runs on CPU cores; serve GPU models with another handler")
        if self.pool is None:
            instances = self.instances()
            round_size = sum(i.batch for i in instances)
            self.pool = InstancePool(
                self.lanes, instances, self._run, max_waiting=WAITING_PER_BATCH * round_size,
                on_batch=self._record, on_start=self._start_batch,
                max_delay_s=self.max_delay_s,
            )  # fmt: skip
            logger.info("Packrat plan: %s", ", ".join(f"⟨{i.threads},{i.batch}⟩ on lane {i.lane}" for i in instances))
        self.pool.warm_up(layout_example)
        return InstanceEngine(self.pool)
