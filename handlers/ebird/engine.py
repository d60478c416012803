"""Ebird's mechanism: input pool, engine workers, and the loop that runs the policy.

The loop has vLLM's shape: look at the state, ask the policy
(``ElasticScheduler.next_batch``) for a ``BatchPlan``, hand each assignment
to its worker; a worker runs its batch and, when done, answers its requests,
frees its pool slots and goes back to the idle set, which wakes the loop.

Threads: requests are admitted from one thread (the handler's event loop)
and one scheduler thread runs the loop.  On CUDA each engine worker has a
thread and a stream of its own, so workers overlap on the GPU, and (with
``cuda_graphs``, the default) a captured graph of its batch size, so a
batch is one copy and one launch from that thread, not one Python call per
layer contending with the other workers for the GIL.  On CPU a
worker is only a batch size: its batch goes straight to the runtime's lanes
(``handlers/runtime/lanes.py``) and is answered from the lane thread when it
finishes, as DVABatch's stages are, so a batch costs no hand-offs through a
worker thread on the way in or out.  There the policy gets one batch per
free lane (``ElasticScheduler``'s lane rule), capped by each size's cost per
input: timed at warm-up, then taken from the batches served
(``handlers/ebird/batch_costs.py``).  On CPU lanes the handler's bursts also
come in undecoded (``take_rows``, ``handlers/runtime/row_intake.py``): a
line of rows that the policy batches by the same rules, each batch decoded,
run and answered on its lane, with no pool slot or ticket per request.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from handlers.codecs import ModelInput
from handlers.ebird.batch_costs import BatchCosts
from handlers.ebird.config import EbirdConfig
from handlers.ebird.pool import InputPool, Run
from handlers.ebird.scheduler import ElasticScheduler, SchedulerState, WorkerSpec, lane_batch_cap
from handlers.errors import ServiceUnavailable, bad_request, inference_failed, shut_down
from handlers.runtime.arrivals import Arrivals
from handlers.runtime.cuda_graphs import CapturedBucket, capture
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.engine import (
    Engine,
    Ticket,
    TicketFuture,
    drain_then_stop,
    layout_of,
    settle_batch,
    warm_up_sizes,
)
from handlers.runtime.lanes import CpuLanes
from handlers.runtime.loop_mailbox import one_wakeup
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_intake import RowBatches, TakenRow
from handlers.runtime.timing import median_seconds

logger = logging.getLogger(__name__)

COST_RUNS = 3  # warm-up runs timed per worker size for the lane rule's cap: the median resists one slow run


@dataclass(eq=False)
class Job:
    """One batch: admitted inputs (a ``run`` of the pool and its ``tickets``), or ``rows`` taken undecoded."""

    run: Run | None
    tickets: list[Ticket]
    rows: list[TakenRow] = field(default_factory=list)
    seconds: float = 0.0  # the batch's gather (pool) or collate (rows) and model call, to output on the host
    ran: int = 0  # of ``rows``, how many the model ran (the others were answered already, or failed to decode)


class EngineWorker:
    """One Ebird engine worker: a fixed batch size; on CUDA also a thread and a stream of its own."""

    def __init__(self, spec: WorkerSpec, stream: torch.cuda.Stream | None) -> None:
        self.spec = spec
        self.stream = stream
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        # CUDA with ``cuda_graphs``: the model captured at this worker's batch
        # size, with its own input buffer and memory pool (captured at warm-up).
        self.graph: CapturedBucket | None = None


class EbirdEngine(Engine):
    def __init__(
        self,
        model: torch.nn.Module,
        example: ModelInput,
        device: ExecutionDevice,
        config: EbirdConfig,
        metrics: HandlerMetrics,
        lanes: CpuLanes | None = None,
        arrivals: Arrivals | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.device = device
        self.config = config
        self.metrics = metrics
        self.pool = InputPool(layout_of(example), config.pool_slots, device.device)
        specs = [WorkerSpec(i, b) for i, b in enumerate(config.worker_batches)]
        # The CPU lane rule (``scheduler.py``) starts capped at the largest
        # worker; with ``cpu_batch_cap: auto``, ``warm_up`` times each size
        # and every served batch refines its size's cost, and so the cap.
        lane_rule = not device.is_cuda and config.cpu_rule == "lane"
        cap = config.cpu_batch_cap if config.cpu_batch_cap != "auto" else max(config.worker_batches)
        self.policy = ElasticScheduler(specs, config.max_inflight, lane_cap=cap if lane_rule else None)
        auto = lane_rule and config.cpu_batch_cap == "auto"
        self.costs = BatchCosts(config.worker_batches) if auto else None
        self.workers = [EngineWorker(s, device.new_stream()) for s in specs]
        self._output_stream = device.new_stream()
        # On CPU every worker's batch runs on the runtime's lanes
        # (``handlers/runtime/lanes.py``): always the same few threads, each
        # with its share of the cores, so at most ``lanes.count`` batches run.
        if not device.is_cuda and lanes is None:
            raise ValueError("a CPU Ebird engine runs its batches on the handler's CpuLanes; none given")
        self._lanes = None if device.is_cuda else lanes
        # Late binding (``arrivals.py``): the handler passes its arrivals
        # when requests are decoded on these lanes, ahead of any batch.
        self._arrivals = arrivals
        if arrivals is not None:
            arrivals.on_leave(self._wake)
        self._max_running = len(self.workers) if device.is_cuda else lanes.count
        self._tickets: list[Ticket | None] = [None] * config.pool_slots
        self._outstanding: set[Ticket] = set()
        # Requests taken undecoded (``take_rows``, CPU lanes only), in arrival order, and the batches of
        # them handed to the lanes and not yet finished: each is decoded, run and answered on its lane.
        self._rows: collections.deque[TakenRow] = collections.deque()
        self._row_jobs: list[Job] = []
        self._rows_went_last = False  # the latest batch was of rows (``_plan`` alternates the two lines)
        self._row_batches: RowBatches | None = None
        self._cond = threading.Condition()
        self._idle = {w.spec.worker_id: w for w in self.workers}
        self._closing = False
        self._stopping = False
        if self._lanes is None:
            for worker in self.workers:
                name = f"ebird-worker-{worker.spec.worker_id}-b{worker.spec.batch}"
                worker.thread = threading.Thread(target=self._work, args=(worker,), name=name, daemon=True)
                worker.thread.start()
        self._scheduler = threading.Thread(target=self._schedule_loop, name="ebird-scheduler", daemon=True)
        self._scheduler.start()

    # -- admission (handler's thread) ----------------------------------------

    def try_submit(self, item: ModelInput) -> TicketFuture | None:
        if self._closing:
            raise ServiceUnavailable("worker is shutting down")
        if not self.pool.fits(item):
            raise bad_request(f"input shapes {[list(shape) for shape in item.shapes]} do not fit this input pool")
        slot = self.pool.reserve()
        if slot is None:
            return None
        ticket = Ticket()
        with self._cond:  # the ticket is in place before ``write`` makes its slot ready for a batch
            self._tickets[slot] = ticket
            self._outstanding.add(ticket)
            if self._lanes is not None:  # on a CPU ``write`` keeps a reference: no copy held under the lock
                self.pool.write(slot, item)
                self._wake_scheduler_if_it_may_act()
                return ticket.future
        self.pool.write(slot, item)
        with self._cond:
            self._wake_scheduler_if_it_may_act()
        return ticket.future

    @property
    def takes_rows(self) -> bool:
        """On CPU lanes: a batch's rows are decoded where it runs (``row_intake.py``), and no pool slot,
        ticket or future is made per request.  On CUDA the pool copies each input to the device as it is
        admitted, so requests go through admission."""
        return self._lanes is not None

    def fits(self, item: ModelInput) -> bool:
        """Whether ``item`` has this engine's input layout (a row taken undecoded is checked on its lane)."""
        return self.pool.fits(item)

    def take_rows(self, rows: Sequence[TakenRow], batches: RowBatches) -> None:
        if not self.takes_rows:
            raise RuntimeError("Ebird takes rows on CPU lanes only")
        with self._cond:  # checked under the lock: ``close`` takes what is left in the line under it too
            if self._closing:
                raise ServiceUnavailable("worker is shutting down")
            self._row_batches = batches
            self._rows.extend(rows)
            self._wake_scheduler_if_it_may_act()

    # -- the loop: state → policy → dispatch -----------------------------------

    def _wake(self) -> None:
        with self._cond:
            self._wake_scheduler_if_it_may_act()

    def _wake_scheduler_if_it_may_act(self) -> None:
        """Wake the scheduler thread (``_cond`` held) unless every lane or worker is busy.

        While they are, the next batch is planned where the running one ends
        (``_finish``), so waking the scheduler for each admitted request would
        only hand it the GIL to find nothing to do: a thread switch per
        request, which on a short batch cost more than the batch's own work.
        """
        if self._a_worker_may_start():
            self._cond.notify_all()

    def _a_worker_may_start(self) -> bool:
        """Whether a batch could start now: a worker idle and a lane (or, on CUDA, a stream) free."""
        return bool(self._idle) and len(self.workers) - len(self._idle) < self._max_running

    def _schedule_loop(self) -> None:
        while True:
            with self._cond:
                horizon: list[int] = []  # the latest arrival this batch may wait for, once read
                while not self._stopping:
                    dispatch = self._plan(horizon)
                    if dispatch:
                        break
                    self._cond.wait()
                if self._stopping:
                    return
            self._start(dispatch)

    def _plan(self, horizon: list[int]) -> list[tuple[EngineWorker, Job]]:
        """The batches to start now, taken from the rows taken undecoded or from the pool, in turns when
        both have inputs waiting (with ``_cond`` held); [] if none.

        ``horizon`` holds the latest arrival a held batch waits for, read the
        first time a batch could grow, so later arrivals do not extend the hold.
        Rows need no hold: they are in the line from their receipt on.
        """
        if not self._a_worker_may_start():
            return []
        busy = [w for w in self.workers if w.spec.worker_id not in self._idle]
        # Rows and admitted inputs (a message of several requests, TorchServe's own pump) take turns when
        # both wait, so neither line can hold the other back for good.
        pool_ready = self.pool.ready()
        from_rows = bool(self._rows) and not (pool_ready and self._rows_went_last)
        ready = len(self._rows) if from_rows else pool_ready
        if not ready:
            return []
        arriving = 0
        if not from_rows and self._arrivals is not None and self.pool.ready_run_can_grow():
            if not horizon:
                horizon.append(self._arrivals.horizon)
            arriving = self._arrivals.pending_through(horizon[0])
        state = SchedulerState(
            ready=ready,
            # CurInf: a busy worker holds exactly its batch size of inputs.
            in_flight=sum(w.spec.batch for w in busy),
            idle=[w.spec for w in self._idle.values()],
            arriving=arriving,
            free_lanes=self._max_running - len(busy),
        )
        dispatch = []
        assignments = self.policy.next_batch(state).assignments
        if assignments:
            self._rows_went_last = from_rows
        for assignment in assignments:
            if from_rows:
                job = Job(None, [], [self._rows.popleft() for _ in range(assignment.count)])
                self._row_jobs.append(job)
                dispatch.append((self._idle.pop(assignment.worker_id), job))
                continue
            run = self.pool.take(assignment.count)
            slots = range(run.start, run.start + run.count)
            tickets = [self._tickets[s] for s in slots]
            for s in slots:
                self._tickets[s] = None
            worker = self._idle.pop(assignment.worker_id)
            dispatch.append((worker, Job(run, tickets)))
        return dispatch

    def _start(self, dispatch: list[tuple[EngineWorker, Job]]) -> None:
        for worker, job in dispatch:
            if self._lanes is None:
                worker.jobs.put(job)
            else:
                # A batch of rows is never quiet: a request read while it runs is only queued (its decode
                # waits for its own batch), and is in line when this batch ends, so the next one starts at once.
                run, quiet = (
                    (self._run_rows, False) if job.run is None else (self._timed_execute, self.config.cpu_quiet_batches)
                )
                done = self._lanes.submit(run, worker, job, quiet=quiet)
                done.add_done_callback(lambda f, w=worker, j=job: self._lane_done(w, j, f))

    # -- a worker ------------------------------------------------------------

    def _work(self, worker: EngineWorker) -> None:
        """A CUDA worker's thread: run its batches on its stream, one at a time."""
        while (job := worker.jobs.get()) is not None:
            self._finish(worker, job, *self._timed_execute(worker, job))

    def _lane_done(self, worker: EngineWorker, job: Job, done: concurrent.futures.Future) -> None:
        """A CPU batch's end, on its lane thread (``_timed_execute`` turns model errors into answers)."""
        error = done.exception()
        if error is not None:  # not an Exception (``_timed_execute`` answers those): still answer every ticket
            failure = inference_failed(error)
            if job.rows:
                self._row_batches.fail(job.rows, failure)
            self._finish(worker, job, None, failure)
        else:
            self._finish(worker, job, *done.result())

    def _finish(self, worker: EngineWorker, job: Job, outputs: torch.Tensor | None, error: Exception | None) -> None:
        """Answer a finished batch, free its slots and give the worker back (on the thread that ran it);
        its answers and the room it frees reach the event loop in one wake-up."""
        with one_wakeup():
            self._answer_and_plan(worker, job, outputs, error)

    def _answer_and_plan(
        self, worker: EngineWorker, job: Job, outputs: torch.Tensor | None, error: Exception | None
    ) -> None:
        if job.run is not None:
            self.pool.release(job.run)
            settle_batch(job.tickets, outputs, error)  # the batch's answers encoded in one call
        size = job.run.count if job.run is not None else job.ran
        with self._cond:
            self._outstanding.difference_update(job.tickets)
            if job.run is None:
                self._row_jobs.remove(job)
            self._idle[worker.spec.worker_id] = worker
            # A batch of rows some of which were skipped ran at a size no worker has: not a cost of one.
            if self.costs is not None and error is None and job.seconds > 0 and size == worker.spec.batch:
                self.costs.record(size, job.seconds)
                self._recap()
            # The next batch is planned here, on the thread that ran this one, when its inputs are
            # ready and no arrival holds it: a hand-off through the scheduler thread costs a thread
            # wake-up per batch, the host's bottleneck when batches are short.  Otherwise the
            # scheduler thread decides, as before.
            dispatch = [] if self._stopping else self._plan([])
            self._cond.notify_all()
        self._notify_space()
        self._start(dispatch)

    def _timed_execute(self, worker: EngineWorker, job: Job) -> tuple[torch.Tensor | None, Exception | None]:
        started = time.monotonic()
        for ticket in job.tickets:
            ticket.times.started = started
        self.metrics.batch_started(job.run.count, [started - t.arrived for t in job.tickets])
        try:
            return self._execute(worker, job.run), None
        except Exception as exc:
            logger.exception("batch of %d on worker %d failed", job.run.count, worker.spec.worker_id)
            return None, inference_failed(exc)
        finally:
            finished = time.monotonic()
            for ticket in job.tickets:
                ticket.times.finished = finished
            job.seconds = finished - started
            self.metrics.batch_finished(job.seconds)

    def _run_rows(self, worker: EngineWorker, job: Job) -> tuple[None, None]:
        """A batch of rows, on its lane: ``RowBatches.run`` decodes, runs and answers them.  Its collate
        and model call are the cost per input the lane rule reads (``batch_costs.py``), as a batch's
        gather into the pool and model call are on the admission path."""

        def forward(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
            with torch.inference_mode():
                return self.model(*tensors).float()

        job.ran, times = self._row_batches.run(job.rows, forward)
        job.seconds = times.finished - times.decoded if job.ran else 0.0
        return None, None

    def _execute(self, worker: EngineWorker, run: Run) -> torch.Tensor:
        """Run one batch (a slice of the pool, no copy) and bring its output to the host.

        With a captured graph the output is the graph's static buffer: the
        worker's next replay overwrites it, which is safe because this
        returns only once the copy to the host is done.
        """
        with torch.inference_mode(), self.device.on(worker.stream):
            self.pool.wait_copied(run, worker.stream)
            if worker.graph is not None:
                output = worker.graph.replay(self.pool.views(run))
            else:
                output = self.model(*self.pool.views(run))
            if not self.device.is_cuda:
                return output.float()
            # Results go back on the output stream, so the next batch on this
            # worker's stream does not queue behind the copy.
            computed = self.device.record(worker.stream)
            self.device.wait(self._output_stream, computed)
            if worker.graph is None:  # a graph's output lives as long as the graph
                output.record_stream(self._output_stream)
            with self.device.on(self._output_stream):
                host = output.float().to("cpu", non_blocking=True)
                copied = self.device.record(self._output_stream)
        self.device.synchronize(copied)
        return host

    def warm_up(self) -> None:
        """One batch at each worker size on every lane (torch.compile and cuDNN pick kernels per shape)."""

        def run_batch(batch: int) -> None:
            example = tuple(buf[:batch] for buf in self.pool.storage)
            with torch.inference_mode(), self.device.on(self.workers[0].stream):
                self.model(*example)

        for tensor in self.pool.storage:
            tensor.zero_()
        warm_up_sizes(list(self.config.worker_batches), run_batch, self._lanes, self.device)
        if self.device.is_cuda and self.config.cuda_graphs:
            self._capture_workers()
        if self.costs is not None:
            self._time_sizes(run_batch)

    def _capture_workers(self) -> None:
        """One graph per worker at its batch size, each with a private memory pool.

        Workers replay at once on their own streams, so, unlike Nimble's
        buckets (one replay at a time), they may not share a pool: one
        worker's intermediates would overwrite another's.
        """
        example = tuple(buf[:1] for buf in self.pool.storage)
        started = time.perf_counter()
        for worker in self.workers:
            worker.graph = capture(self.model, example, worker.spec.batch)
        torch.cuda.synchronize(self.device.device)
        logger.info(
            "Ebird: captured a CUDA graph for each of %d workers (batches %s) in %.1f s",
            len(self.workers), list(self.config.worker_batches), time.perf_counter() - started,
        )  # fmt: skip

    def _time_sizes(self, run_batch: Callable[[int], None], runs: int = COST_RUNS) -> None:
        """Each worker size's first cost guess: timed on a lane, warm (after ``warm_up_sizes``)."""
        for size in self.costs.sizes:
            timed = functools.partial(median_seconds, functools.partial(run_batch, size), warm=0, repeats=runs)
            seconds = self._lanes.submit(timed, lane=0).result()
            with self._cond:
                self.costs.guess(size, seconds)
        with self._cond:
            self._recap(announce=True)

    def _recap(self, announce: bool = False) -> None:
        """Cap the lane rule at the sizes' current costs (under ``_cond``); log when the cap moves."""
        per_input = self.costs.per_input_ms()
        cap = lane_batch_cap(per_input)
        if announce or cap != self.policy.lane_cap:
            costs = ", ".join(f"{b}: {ms:.1f}" for b, ms in per_input.items())
            logger.info("CPU ms per input by batch size (%s): one batch per free lane, of at most %d", costs, cap)
            self.policy.set_lane_cap(cap)

    # -- shutdown ------------------------------------------------------------

    def _stop(self) -> None:
        self._stopping = True

    def close(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        self._closing = True
        with self._cond:  # the rows taken undecoded first, then the admitted tickets, within one deadline
            while (self._rows or self._row_jobs) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
        drain_then_stop(self._cond, self._outstanding, deadline, self._stop)
        with self._cond:  # stopped: no batch takes rows any more; those waiting or still running get 503
            leftover = [*self._rows, *(row for job in self._row_jobs for row in job.rows)]
            self._rows.clear()
        if leftover:  # (a running batch's late answers are dropped on the loop: each row is answered once)
            self._row_batches.fail(leftover, shut_down())
        for worker in self.workers:
            worker.jobs.put(None)
        for thread in [self._scheduler, *(w.thread for w in self.workers if w.thread is not None)]:
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        self._notify_space()
