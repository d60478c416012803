"""DVABatch's mechanism: a model's stages run as a pipeline, batches tracked in the batch table.

The loop has the same shape as Ebird's (``handlers/ebird/engine.py``): under
one lock it looks at the state, asks the policy, and dispatches.  Here the
state is the batch table; a dispatch is one batch running one stage.

- Admission puts each newcomer into the table at once (the policy says
  where: join a batch that has not started, stretch one in flight, or a new
  batch), so no request waits for a batching window.
- Each stage runs at most one batch at a time.  Whenever a stage is free,
  the oldest batch standing before it runs there, split first if the policy
  says so, unless it waits there for catch-up batches bound for it
  (``DvaPolicy.hold``).  On CPU, stage runs go to the runtime's lanes (one per stage, each
  with its share of the cores, ``handlers/runtime/lanes.py``), so stages
  overlap as a pipeline; on CUDA each stage has a stream of its own.
- When a stage finishes, the table records it and merges a catch-up batch
  with its target if they now stand idle before the same stage; the states
  are joined in the table's row order (target rows first).  After the last
  stage each row answers its own request.

Every admitted request is answered exactly once: with its row, with a 503
if its batch's stage failed, or with a 503 when the engine closes first.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from handlers.codecs import ModelInput, collate
from handlers.dvabatch.batch_table import BatchEntry, BatchTable
from handlers.dvabatch.overhead import RunOverhead
from handlers.dvabatch.policy import DvaBatchConfig, DvaPolicy
from handlers.errors import ServiceUnavailable, bad_request, inference_failed
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.engine import (
    Engine,
    RowLayout,
    Ticket,
    TicketFuture,
    drain_then_stop,
    layout_of,
    settle_batch,
    warm_up_sizes,
)
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_intake import BatchTimes, RowBatches, TakenRow, TakenTicket, answer_taken
from handlers.runtime.segment_profile import SegmentProfile
from handlers.runtime.segments import SegmentedModel, State, merge_states, split_state, state_rows
from handlers.runtime.stage_programs import StagePrograms, bucket_sizes

logger = logging.getLogger(__name__)


class DvaBatchEngine(Engine):
    def __init__(
        self,
        sliced: SegmentedModel,
        example: ModelInput,
        device: ExecutionDevice,
        config: DvaBatchConfig,
        metrics: HandlerMetrics,
        lanes: CpuLanes | None = None,
        profile: SegmentProfile | None = None,
    ) -> None:
        super().__init__()
        self.sliced = sliced
        self.device = device
        self.config = config
        self.metrics = metrics
        self.policy = DvaPolicy(config, profile)
        self.table = BatchTable(len(sliced))
        self.layout = layout_of(example)
        self._row_layout = RowLayout(self.layout)
        if not device.is_cuda and lanes is None:
            raise ValueError("a CPU DVABatch engine runs its stages on the handler's CpuLanes; none given")
        self._lanes = None if device.is_cuda else lanes
        self._streams = [device.new_stream() for _ in range(len(sliced))]
        self._stage_threads = (
            [concurrent.futures.ThreadPoolExecutor(1, f"dvabatch-stage-{s}") for s in range(len(sliced))]
            if device.is_cuda
            else []
        )
        self._states: dict[int, State] = {}
        # Meta operations done (new, join, stretch, split, merge); also
        # reported to TorchServe as HandlerOperations.
        self.counts: Counter[str] = Counter()
        # Stage programs called, by stage: one per batch that runs the stage, however many rows it holds.
        self.stage_calls: Counter[int] = Counter()
        self._pending: deque[tuple[Ticket, ModelInput]] = deque()
        self._busy: list[bool] = [False] * len(sliced)
        self._outstanding: set[Ticket] = set()
        self._cond = threading.Condition()
        self._closing = False
        self._stopping = False
        # CUDA with ``cuda_graphs``: each stage a captured graph per batch bucket; CPU with ``cpu_traces``:
        # a TorchScript trace per bucket where measured worth it (both built in ``warm_up``).
        self.programs: StagePrograms | None = None
        # What a stage run costs its lane besides the stage, fitted as runs end (CPU lanes).
        self.overhead = RunOverhead()
        self._stage_ended: dict[tuple[int, int], float] = {}
        self._scheduler = threading.Thread(target=self._schedule_loop, name="dvabatch-scheduler", daemon=True)
        self._scheduler.start()

    # -- admission (the handler's thread) --------------------------------------------

    def try_submit(self, item: ModelInput) -> TicketFuture | None:
        if self._closing:
            raise ServiceUnavailable("worker is shutting down")
        if not self._row_layout.fits(item):
            raise bad_request(f"input shapes {[list(s) for s in item.shapes]} do not fit this model's stages")
        with self._cond:
            if len(self._outstanding) >= self.config.max_inflight:
                return None
            ticket = Ticket()
            self._outstanding.add(ticket)
            self._pending.append((ticket, item))
            if not self._busy[0]:
                # Only a free first stage can take a newcomer now; while it runs, newcomers are placed
                # where it ends (``_stage_done``), together, and waking the scheduler for each would
                # only hand it the GIL to find nothing to run.
                self._cond.notify_all()
        return ticket.future

    # -- requests taken undecoded (the handler's ``RowLine``, on a lane) -------------

    @property
    def takes_decoded_rows(self) -> bool:
        """On CPU lanes: rows come decoded in one call per burst and leave encoded in one callback per
        batch (``handlers/runtime/row_line.py``); no future or loop hop per request."""
        return self._lanes is not None

    def fits(self, item: ModelInput) -> bool:
        return self._row_layout.fits(item)

    def batch_ms(self, rows: float) -> float:
        """One batch's measured time through every stage at ``rows`` (the segment profile's, or 0 without one)."""
        profile = self.policy.profile
        return 0.0 if profile is None else profile.remaining_ms(0, rows)

    def run_overhead_ms(self) -> tuple[float, float]:
        """(what one stage run costs its lane besides the stage, how many runs that was fitted on)."""
        return self.overhead.per_run_ms(), self.overhead.weight

    def take_decoded(
        self, rows: Sequence[TakenRow], items: Sequence[ModelInput], batches: RowBatches, times: BatchTimes
    ) -> None:
        with self._cond:  # checked under the lock, as ``close`` counts what is outstanding under it
            if self._closing:
                raise ServiceUnavailable("worker is shutting down")
            for request, item in zip(rows, items, strict=True):
                ticket = TakenTicket(request, batches, batches.encoder_for(item), times)
                self._outstanding.add(ticket)
                self._pending.append((ticket, item))
            # Planned here, on the lane, as where a stage ends (``_stage_done``): waking the scheduler
            # thread would cost a thread switch per burst and engine.  A busy first stage places them
            # where it ends, as for ``try_submit``.
            runs = [] if self._busy[0] or self._stopping else self._plan()
        for run in runs:
            self._launch(*run)

    # -- the loop: place newcomers, dispatch free stages ------------------------------

    def _schedule_loop(self) -> None:
        """Runs what admission makes runnable while the first stage is free; what a stage's end makes
        runnable is planned and launched where it ended (``_stage_done``)."""
        while True:
            with self._cond:
                while not self._stopping and not self._placeable() and not self._dispatchable():
                    self._cond.wait()
                if self._stopping:
                    return
                runs = self._plan()
            for batch_id, stage, state in runs:
                self._launch(batch_id, stage, state)

    def _plan(self) -> list[tuple[int, int, State]]:
        """Place the newcomers, then take the stage runs that may start now (``_cond`` held)."""
        self._place_pending()
        return self._dispatch()

    def _placeable(self) -> bool:
        """Newcomers wait, and the table has room for one (``_place_pending``)."""
        return bool(self._pending) and len(self._outstanding) - len(self._pending) < self.config.max_inflight

    def _dispatchable(self) -> bool:
        return any(self._runnable(stage) for stage in range(len(self.sliced)))

    def _runnable(self, stage: int) -> list[BatchEntry]:
        """Batches that may run ``stage`` now, oldest first: none while it is busy, none that hold for catch-ups."""
        if self._busy[stage]:
            return []
        return [e for e in self.table.waiting_at(stage) if not self.policy.hold(e, self.table)]

    def _count(self, operation: str) -> None:
        self.counts[operation] += 1
        self.metrics.operation(operation)

    def _place_pending(self) -> None:
        """Place newcomers in the table, no more than ``max_inflight`` in it at once.

        Admitted requests never exceed the bound (``try_submit``), but rows
        taken undecoded come in whole bursts (``take_decoded``): past the
        bound they wait here, in order, as admitted requests wait in their
        admission line, and a row answered at its deadline meanwhile leaves
        without running.  An unbounded table would cost every placement and
        dispatch a scan of thousands of entries under overload.
        """
        now = time.monotonic()
        pending = self._pending
        room = self.config.max_inflight - (len(self._outstanding) - len(pending))
        while pending and room > 0:
            head = pending[0][0]
            if type(head) is TakenTicket and head.request.finished:  # answered 503 at its deadline
                pending.popleft()
                self._outstanding.discard(head)
                continue
            placement = self.policy.place(self.table, min(len(pending), room), now)
            room -= placement.count
            items = [self._pending.popleft() for _ in range(placement.count)]
            tickets = [t for t, _ in items]
            inputs = self.sliced.start(*(t.to(self.device.device) for t in collate([i for _, i in items])))
            self._count(placement.kind)
            if placement.kind == "join":
                entry = self.table.join(placement.target, tickets)
            elif placement.kind == "stretch":
                # None: the policy and the table disagree only by a race on the clock.
                t_comp_wait = self.config.t_comp_wait_ms / 1e3
                entry = self.table.stretch(tickets, placement.target, now, t_comp_wait) or self.table.new(tickets, now)
            else:
                entry = self.table.new(tickets, now)
            # Joined a batch that had not started: its rows go after the batch's, as in the table.
            previous = self._states.get(entry.id)
            self._states[entry.id] = inputs if previous is None else merge_states([previous, inputs])

    def _dispatch(self) -> list[tuple[int, int, State]]:
        runs = []
        for stage in range(len(self.sliced)):
            waiting = self._runnable(stage)
            if not waiting:
                continue
            entry = waiting[0]
            sizes = self.policy.split_sizes(entry)
            if sizes is not None:
                self._count("split")
                parts = self.table.split(entry.id, sizes)
                for part, state in zip(parts, split_state(self._states.pop(entry.id), sizes), strict=True):
                    self._states[part.id] = state
                entry = parts[0]
            self.table.start(entry.id)
            self._busy[stage] = True
            self.stage_calls[stage] += 1
            if stage == 0:
                started = time.monotonic()
                for ticket in entry.requests:
                    ticket.times.started = started
                self.metrics.batch_started(entry.size, [started - t.arrived for t in entry.requests])
            runs.append((entry.id, stage, self._states[entry.id]))
        return runs

    # -- running a stage -----------------------------------------------------------------

    def _launch(self, batch_id: int, stage: int, state: State) -> None:
        if self._lanes is not None:
            future: Future = self._lanes.submit(self._lane_run, batch_id, stage, state)
        else:
            future = self._stage_threads[stage].submit(self._run_stage, stage, state)
        future.add_done_callback(lambda f: self._stage_done(batch_id, stage, f))

    def timed_stage(self, stage: int, state: State) -> State:
        """``stage`` as a batch runs it (its bucket's trace, where one is kept), for a profile's timing
        runs: not counted as a call, on the calling thread (CPU)."""
        with torch.inference_mode():
            if self.programs is None:
                return self.sliced[stage](state)
            return self.programs.run(stage, state, count=False)

    def _lane_run(self, batch_id: int, stage: int, state: State) -> State:
        """A stage run as a lane job, the stage's end noted: what the run costs its lane besides the
        stage goes on from there to where ``_stage_done`` ends, on the same lane (``overhead.py``)."""
        out = self._run_stage(stage, state)
        self._stage_ended[batch_id, stage] = time.perf_counter()
        return out

    def _run_stage(self, stage: int, state: State) -> State:
        with torch.inference_mode(), self.device.on(self._streams[stage]):
            out = self.sliced[stage](state) if self.programs is None else self.programs.run(stage, state)
            if self.device.is_cuda:
                self.device.synchronize(self.device.record(self._streams[stage]))
        return out

    def _stage_done(self, batch_id: int, stage: int, future: Future) -> None:
        answers: list[tuple[list[Ticket], torch.Tensor | None, BaseException | None]] = []
        with self._cond:
            self._busy[stage] = False
            error = future.exception()
            if error is not None:
                logger.error("stage %d of batch %d failed: %r", stage, batch_id, error)
                failure = inference_failed(error)
                self._states.pop(batch_id, None)
                answers = [(self.table.drop(batch_id), None, failure)]
            else:
                self._states[batch_id] = future.result()
                for merge in self.table.finish_stage(batch_id):
                    self._count("merge")
                    joined = [self._states[merge.target], self._states.pop(merge.catch_up)]
                    self._states[merge.target] = merge_states(joined)
                answers = self._collect_finished()
            for tickets, _, _ in answers:
                self._outstanding.difference_update(tickets)
            # The next runs are planned here, on the thread that ran this stage, and launched before its
            # answers are encoded: a hand-off through the scheduler thread would cost a thread wake-up
            # per stage run, which on a short stage is the host's bottleneck (as in Ebird's ``_finish``).
            runs = [] if self._stopping else self._plan()
            if self._closing:  # ``close`` waits for these answers (the scheduler has nothing left to do)
                self._cond.notify_all()
        for run in runs:
            self._launch(*run)
        finished = time.monotonic()
        for tickets, output, err in answers:
            for ticket in tickets:
                ticket.times.finished = finished
            self._answer(tickets, output, err)
        if answers:
            self._notify_space()
        ended = self._stage_ended.pop((batch_id, stage), None)
        if ended is not None and future.exception() is None:
            self.overhead.observe(state_rows(future.result()), 1e3 * (time.perf_counter() - ended))

    @staticmethod
    def _answer(tickets: list[Ticket | TakenTicket], output: torch.Tensor | None, error: BaseException | None) -> None:
        """A finished (or failed) batch's answers, encoded in one call per encoder: admitted requests
        through their futures, rows taken undecoded in one callback (``answer_taken``)."""
        taken = [i for i, ticket in enumerate(tickets) if type(ticket) is TakenTicket]
        if not taken:
            settle_batch(tickets, output, error)
            return
        if len(taken) == len(tickets):
            answer_taken(tickets, output, error)
            return
        admitted = [i for i, ticket in enumerate(tickets) if type(ticket) is not TakenTicket]
        settle_batch([tickets[i] for i in admitted], None if output is None else output[admitted], error)
        answer_taken([tickets[i] for i in taken], None if output is None else output[taken], error)

    def _collect_finished(self) -> list[tuple[list[Ticket], torch.Tensor | None, BaseException | None]]:
        answers = []
        for entry in list(self.table):
            if entry.stage < len(self.sliced) or entry.running:
                continue
            output = self.sliced.finish(self._states.pop(entry.id))
            if isinstance(output, tuple):
                output = output[0]
            output = output.float().cpu()
            tickets = self.table.complete(entry.id)
            self.metrics.batch_finished(time.monotonic() - entry.created)
            answers.append((tickets, output, None))
        return answers

    # -- warm-up and shutdown --------------------------------------------------------

    def warm_up(self) -> None:
        """Run every stage at batch 1 and at the largest batch on every lane (OpenMP teams, kernels)."""
        zeros = tuple(torch.zeros((1, *shape), dtype=dtype, device=self.device.device) for shape, dtype in self.layout)

        def through_all(rows: int) -> None:
            with torch.inference_mode():
                self.sliced(*(z.expand(rows, *z.shape[1:]).contiguous() for z in zeros))

        warm_up_sizes([1, self.config.max_batch], through_all, self._lanes, self.device)
        if self.device.is_cuda and self.config.cuda_graphs:
            self._capture_stages(zeros)
        if self._lanes is not None and self.config.cpu_traces:
            # Traced and timed on a lane, at the thread count the stages will run with.
            self._lanes.submit(self._trace_stages, zeros).result()

    def _trace_stages(self, zeros: tuple[torch.Tensor, ...]) -> None:
        """One TorchScript trace per (stage, bucket), kept where measured worth it (``StagePrograms``)."""
        started = time.perf_counter()
        programs = StagePrograms(self.sliced, zeros, bucket_sizes(self.config.max_batch), traced=True)
        self.programs = programs
        logger.info(
            "DVABatch: %d of %d (stage, batch bucket) programs traced in %.1f s: %s",
            len(programs.traces), len(self.sliced) * len(programs.buckets), time.perf_counter() - started,
            sorted(programs.traces),
        )  # fmt: skip

    def _capture_stages(self, zeros: tuple[torch.Tensor, ...]) -> None:
        """One CUDA graph per (stage, bucket); a model whose stages cannot be captured runs eagerly."""
        started = time.perf_counter()
        buckets = bucket_sizes(self.config.max_batch)
        try:
            self.programs = StagePrograms(self.sliced, zeros, buckets, graphs=True)
        except Exception:  # capture is an optimisation: the eager stages serve the same answers
            logger.warning("DVABatch: could not capture the stages as CUDA graphs; running them eagerly", exc_info=True)
            return
        logger.info(
            "DVABatch: captured %d stages × %d batch buckets %s as CUDA graphs in %.1f s",
            len(self.sliced), len(buckets), buckets, time.perf_counter() - started,
        )  # fmt: skip

    def _stop(self) -> None:
        self._stopping = True

    def close(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        self._closing = True
        drain_then_stop(self._cond, self._outstanding, deadline, self._stop)
        self._scheduler.join(timeout=max(deadline - time.monotonic(), 0.1))
        for pool in self._stage_threads:
            pool.shutdown(wait=False)
        self._notify_space()
