"""REEF's engine: real-time requests preempt best-effort batches at segment boundaries.

One engine serves every model of a REEF archive in one worker.  It keeps
one real-time (RT) queue and one best-effort (BE) queue per model, and one
executor thread per queue:

- the **RT executor** takes the RT queue in arrival order (consecutive
  requests for one model run as one batch, up to ``rt_max_batch``), waits
  until no BE unit is in flight (the preemption, ``PreemptionGate``), and
  runs the whole model: on CPU with every core's intra-op threads, on CUDA on
  a high-priority stream (with ``rt_sms``, on a green context of SMs that
  best-effort work never uses: ``handlers/runtime/sm_partition.py``);
- each **BE executor** takes up to ``be_max_batch`` requests of its model
  and runs them through the model's segments (``SegmentedModel``), asking
  the gate before each one.  From an RT admission until the RT queue is
  empty, it stops before its next segment and keeps the state it reached;
  it restores from there, so a preempted batch neither loses nor repeats a
  unit.  On CPU the BE executors share the cores and run concurrently,
  REEF's normal mode: at most one BE batch per core at once, each starting
  with an even share of the intra-op threads among the BE batches running
  at that moment, on a thread of its own that ends with it (below); on
  CUDA each
  has a stream and keeps at most ``c`` segments queued on it (REEF-N's host
  queue), so those are what an RT batch may find in its way.

**One OpenMP team on CPU.**  GNU OpenMP (PyTorch's intra-op runtime on
Linux) keeps a thread's team alive after its parallel region, and while a
process holds more team threads than it has CPUs it stops spinning between
parallel regions: every team's threads sleep, and each region wakes them
through the kernel.  On a 2-vCPU VM one idle second team (a thread that had
once run an op on two intra-op threads) made a one-layer BERT's batch of 32
take 2.64 ms instead of 1.15 ms on the first team, and a neighbour on one
intra-op thread changed nothing (``bench/openmp_teams.py``).  So on CPU the RT executor's team
is the process's only one whenever no best-effort batch runs: the BE
executors themselves never form a team, each BE batch that takes more than
one intra-op thread runs on a thread of its own whose team ends with the
batch, and the handler's event-loop thread loads the models on one thread.
While a BE batch runs (preempted or not) its team is there too, as before.

``policy`` swaps in the paper's baselines over the same executors (the
same threads, batching and models), so a benchmark compares scheduling
alone: ``seq`` runs one batch at a time across every queue, real-time first,
each batch to its end (a best-effort batch is then one unit); ``concurrent``
runs every executor at once with no gate (no priority at all).

Reset-based preemption proper (killing kernels already on the GPU) needs
driver support PyTorch does not expose; REEF-N's bounded queue is what
closed GPUs allow, and on CPU a segment in flight is always allowed to end.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import functools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from handlers.codecs import ModelInput, collate
from handlers.errors import ServiceUnavailable, bad_request, inference_failed, shut_down
from handlers.reef.config import BEST_EFFORT, PRIORITIES, REALTIME, ReefConfig
from handlers.reef.preemption import Preemption, PreemptionGate
from handlers.runtime.device import ExecutionDevice
from handlers.runtime.engine import (
    Engine,
    RowLayout,
    Ticket,
    TicketFuture,
    drain_then_stop,
    layout_of,
    settle_batch,
)
from handlers.runtime.intra_op import use_intra_op_threads
from handlers.runtime.metrics import HandlerMetrics
from handlers.runtime.row_intake import RowBatches, TakenRow
from handlers.runtime.segments import SegmentedModel
from handlers.runtime.sm_partition import GreenPartition, RtSizing, measure_rt_sms, sm_grid, unavailable_reason
from handlers.runtime.stage_programs import StagePrograms, bucket_sizes

logger = logging.getLogger(__name__)

RECENT_PREEMPTIONS = 4096
PREEMPTION_LOG = "REEF preemption:"  # one log line per preemption (bench/reef.py reads them back)
# CUDA stream priorities: lower is more urgent; -1 is the highest on every current GPU.
RT_STREAM_PRIORITY = -1
BE_STREAM_PRIORITY = 0


class RoutedInput(ModelInput):
    """A decoded request plus where it goes: which of the archive's models, at which priority."""

    __slots__ = ("model", "priority")

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...] | None = None,
        v2: Any = None,
        *,
        rows: tuple[list[int], ...] | None = None,
        model: str = "",
        priority: str = BEST_EFFORT,
    ) -> None:
        super().__init__(tensors, v2, rows=rows)
        self.model = model
        self.priority = priority

    @classmethod
    def routing(cls, item: ModelInput, model: str, priority: str) -> RoutedInput:
        """``item`` (tensors or token rows, as decoded) bound for ``model`` at ``priority``."""
        if item.rows is not None:
            return cls(v2=item.v2, rows=item.rows, model=model, priority=priority)
        return cls(item.tensors, item.v2, model=model, priority=priority)


@dataclass(frozen=True, slots=True)
class Route:
    """Where ``route_request`` sends a request: its member and priority, read before its decode (the
    engine takes real-time requests undecoded); called on the decoded input, it binds them to it."""

    model: str
    priority: str

    def __call__(self, item: ModelInput) -> RoutedInput:
        return RoutedInput.routing(item, self.model, self.priority)


@dataclass(frozen=True)
class Member:
    """One model the engine serves: whole for real-time batches, in segments for best-effort ones."""

    name: str
    model: nn.Module
    sliced: SegmentedModel
    example: ModelInput  # one request's input layout

    @functools.cached_property
    def layout(self) -> tuple:
        """The input layout a request must have (``layout_of``)."""
        return layout_of(self.example)

    @functools.cached_property
    def row_layout(self) -> RowLayout:
        """The same, as every admission compares it (worked out once)."""
        return RowLayout(self.layout)


_Queued = tuple[Ticket, RoutedInput]


def _head_run(line: deque[Any], limit: int, model_of: Callable[[Any], str] | None = None) -> list[Any]:
    """Up to ``limit`` entries from the head of a non-empty ``line``; with ``model_of``, only the head's
    model's (a real-time batch runs one model, whole)."""
    run = [line.popleft()]
    model = None if model_of is None else model_of(run[0])
    while line and len(run) < limit and (model_of is None or model_of(line[0]) == model):
        run.append(line.popleft())
    return run


def on_a_team_of_its_own(threads: int, run: Callable[[], None]) -> None:
    """``run()`` on a new thread with ``threads`` intra-op threads, waiting for it: the OpenMP team it forms
    ends with that thread, so it does not outlive the work (the module's docstring).  Raises what ``run`` raised."""
    failed: list[BaseException] = []

    def target() -> None:
        use_intra_op_threads(threads)
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=target, name=f"{threading.current_thread().name}-batch", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


class ReefEngine(Engine):
    def __init__(
        self,
        members: Iterable[Member],
        device: ExecutionDevice,
        config: ReefConfig,
        metrics: HandlerMetrics,
        cpu_threads: int = 1,
    ) -> None:
        super().__init__()
        self.members = {m.name: m for m in members}
        if not self.members:
            raise ValueError("a REEF engine needs at least one model")
        self.device = device
        self.config = config
        self.metrics = metrics
        self.gate = PreemptionGate()
        # Operations done (preempt: an RT switch that stopped BE units in flight;
        # resume: a BE unit that waited out real-time mode), also HandlerOperations.
        self.counts: Counter[str] = Counter()
        self.preemptions: collections.deque[Preemption] = collections.deque(maxlen=RECENT_PREEMPTIONS)
        self._rt: deque[_Queued] = deque()
        # CPU: real-time requests taken undecoded (``take_rows``), and the batch of them running; the RT
        # executor decodes, runs and encodes such a batch in one go (``row_intake.RowBatches``).
        self._rt_rows: deque[TakenRow] = deque()
        self._rows_running: list[TakenRow] = []
        self._rows_went_last = False  # rows and admitted RT requests take turns when both wait
        self._row_batches: RowBatches | None = None
        self._be: dict[str, deque[_Queued]] = {name: deque() for name in self.members}
        self._outstanding: set[Ticket] = set()
        # One lock, one condition per queue and one for answers: an admission wakes only the executor
        # of its queue (one notify), not every executor to find its own queue empty again, and a
        # batch's answers wake only a close waiting for them.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._rt_ready = threading.Condition(self._lock)
        self._be_ready = {name: threading.Condition(self._lock) for name in self.members}
        self._closing = False
        self._stopping = False
        # CPU: an RT batch runs alone, on every core; BE batches run side by side, the cores split among
        # the BE queues busy when each batch starts, each batch's team gone with it (the module's docstring).
        self._rt_threads = max(1, cpu_threads)
        self._be_busy = 0
        # CPU, REEF: at most one BE batch per core at once.  More would only
        # time-slice the cores, and an RT request waits for every BE segment in
        # flight: on workload C (five BE queues, two cores) unbounded BE made
        # the preemption 51 ms on average, 102 ms at worst (bench/reef.py).
        # The baselines keep the paper's behaviour: SEQ runs one batch,
        # concurrent runs them all.
        bounded = config.policy == "reef" and not device.is_cuda
        self._be_slots = threading.Semaphore(self._rt_threads) if bounded else contextlib.nullcontext()
        self.partition: GreenPartition | None = None
        self.sizing: RtSizing | None = None
        if config.rt_sms is not None and device.is_cuda:
            self._rt_stream, self._be_streams = self._partitioned_streams()
        else:
            if config.rt_sms is not None:
                logger.info("REEF: rt_sms splits a GPU's SMs; on %s it is ignored", device.device)
            self._rt_stream = device.new_stream(RT_STREAM_PRIORITY)
            self._be_streams = {name: device.new_stream(BE_STREAM_PRIORITY) for name in self.members}
        # With the SMs split (``rt_sms``) BE kernels are never on RT's SMs, so RT has nothing to wait for and BE
        # no reason to stop: space isolation replaces the preemption gate.  (The memory system is still shared.)
        self._gated = config.policy != "concurrent" and self.partition is None
        # CUDA, ``be_graphs``: each member's launch units as captured graphs per batch bucket, on its BE stream.
        self.be_programs: dict[str, StagePrograms] = {}
        if config.be_graphs and config.policy == "reef" and device.is_cuda:
            for name, member in self.members.items():
                if (programs := self._captured_units(member)) is not None:
                    self.be_programs[name] = programs
        self._padding = config.padding and config.policy == "reef" and device.is_cuda
        self._serial = threading.Lock() if config.policy == "seq" else contextlib.nullcontext()
        self._warm: list[concurrent.futures.Future] = []
        self._threads = [self._start("reef-rt", self._realtime_loop)]
        self._threads += [self._start(f"reef-be-{name}", self._best_effort_loop, name) for name in self.members]

    def _partitioned_streams(self) -> tuple[torch.cuda.Stream, dict[str, torch.cuda.Stream]]:
        """RT's stream on a green context of its own SMs, each BE queue's on one over the rest (``rt_sms``)."""
        if reason := unavailable_reason(self.device.device):
            raise RuntimeError(f"rt_sms needs CUDA green contexts, and {reason}; unset it for priority streams")
        index = self.device.device.index if self.device.device.index is not None else torch.cuda.current_device()
        rt_sms = self.config.rt_sms
        if rt_sms == "auto":
            realtime = [self.members[n] for n in self.config.realtime] or list(self.members.values())

            def rt_batch() -> None:
                with torch.inference_mode():
                    for member in realtime:
                        member.model(*self._zeros(member, self.config.rt_max_batch))

            self.sizing = measure_rt_sms(index, rt_batch)
            rt_sms = self.sizing.rt_sms
            logger.info("REEF: %s", self.sizing.describe())
        else:
            grid = sm_grid(index)
            most = grid.rt_counts()[-1] if grid.rt_counts() else 0
            if rt_sms > most:
                raise RuntimeError(f"rt_sms {rt_sms} leaves best-effort work too few of this GPU's {grid.total} SMs "
                                   f"(groups of ≥ {grid.minimum}): at most {most}")  # fmt: skip
        self.partition = GreenPartition(index, rt_sms)
        logger.info("REEF: real-time work on %d SMs, best-effort on the other %d of %d (green contexts)",
                    self.partition.rt_sms, self.partition.be_sms, self.partition.total_sms)  # fmt: skip
        be = {name: self.partition.stream("be", BE_STREAM_PRIORITY) for name in self.members}
        return self.partition.stream("rt", RT_STREAM_PRIORITY), be

    def _captured_units(self, member: Member) -> StagePrograms | None:
        """``member``'s launch units captured at every BE batch bucket; None (eager units) where capture fails."""
        started = time.perf_counter()
        buckets = bucket_sizes(self.config.be_max_batch)
        try:
            with torch.inference_mode(), self.device.on(self._be_streams[member.name]):
                programs = StagePrograms(member.sliced, self._zeros(member, 1), buckets, graphs=True)
        except Exception:  # capture is an optimisation: the eager units serve the same answers
            logger.warning("REEF: could not capture %s's launch units as CUDA graphs; running them eagerly",
                           member.name, exc_info=True)  # fmt: skip
            return None
        logger.info("REEF: %s's %d launch units captured at batches %s in %.1f s", member.name, len(member.sliced),
                    buckets, time.perf_counter() - started)  # fmt: skip
        return programs

    def _start(self, name: str, target, *args) -> threading.Thread:  # noqa: ANN001 - a loop method
        warm: concurrent.futures.Future = concurrent.futures.Future()
        self._warm.append(warm)
        thread = threading.Thread(target=target, args=(warm, *args), name=name, daemon=True)
        thread.start()
        return thread

    # -- admission (the handler's thread) --------------------------------------------

    def try_submit(self, item: ModelInput) -> TicketFuture | None:
        if self._closing:
            raise ServiceUnavailable("worker is shutting down")
        if not isinstance(item, RoutedInput) or item.model not in self.members:
            raise bad_request(f"this worker serves {', '.join(self.members)}; the request names none of them")
        if item.priority not in PRIORITIES:
            raise bad_request(f"unknown priority {item.priority!r}")
        if not self.members[item.model].row_layout.fits(item):
            raise bad_request(f"input shapes {[list(shape) for shape in item.shapes]} do not fit {item.model}")
        with self._cond:
            if len(self._outstanding) >= self.config.max_inflight:
                return None
            ticket = Ticket()
            self._outstanding.add(ticket)
            if item.priority == REALTIME:
                if self._gated:
                    self.gate.raise_realtime()  # BE stops before its next unit, from now
                self._rt.append((ticket, item))
                self._rt_ready.notify()
            else:
                self._be[item.model].append((ticket, item))
                self._be_ready[item.model].notify()
        return ticket.future

    # -- real-time requests taken undecoded (CPU; the event loop) -----------------------

    @property
    def takes_rows(self) -> bool:
        """On CPU: a real-time batch's requests are decoded, run and encoded by the RT executor, which
        runs alone, so the loop makes no ticket, future or admission per request."""
        return not self.device.is_cuda

    def takes_routed(self, bind: Any) -> bool:
        """Real-time requests (their priority is known from their headers, before the decode)."""
        return self.takes_rows and isinstance(bind, Route) and bind.priority == REALTIME and bind.model in self.members

    def fits(self, item: ModelInput) -> bool:
        member = self.members.get(getattr(item, "model", None))
        return isinstance(item, RoutedInput) and member is not None and member.row_layout.fits(item)

    def take_rows(self, rows: Sequence[TakenRow], batches: RowBatches) -> None:
        with self._cond:  # checked under the lock: ``close`` takes what is left in the line under it too
            if self._closing:
                raise ServiceUnavailable("worker is shutting down")
            self._row_batches = batches
            if self._gated:
                self.gate.raise_realtime(len(rows))  # BE stops before its next unit, from now, as on admission
            self._rt_rows.extend(rows)
            self._rt_ready.notify()

    # -- executors ---------------------------------------------------------------------

    def _next(self, queue: deque[_Queued], ready: threading.Condition, limit: int) -> list[_Queued] | None:
        """Up to ``limit`` requests from the head of a BE ``queue``, waiting on ``ready`` (the queue's
        condition) while it is empty; None: stop."""
        with self._lock:
            while not queue and not self._stopping:
                ready.wait()
            if self._stopping:
                return None
            return _head_run(queue, limit)

    def _next_realtime(self) -> tuple[list[_Queued], list[TakenRow]] | None:
        """The next RT batch: admitted requests, or requests taken undecoded (the two take turns), up to
        ``rt_max_batch`` of one model from the head of their line; None: stop."""
        with self._lock:
            while not self._rt and not self._rt_rows and not self._stopping:
                self._rt_ready.wait()
            if self._stopping:
                return None
            limit = self.config.rt_max_batch
            if not self._rt_rows or (self._rt and self._rows_went_last):
                self._rows_went_last = False
                return _head_run(self._rt, limit, lambda queued: queued[1].model), []
            self._rows_went_last = True
            self._rows_running = _head_run(self._rt_rows, limit, lambda row: row.bind.model)
            return [], self._rows_running

    def _realtime_loop(self, warm: concurrent.futures.Future) -> None:
        use_intra_op_threads(self._rt_threads)
        if not self._warm_up_here(warm, lambda: self._warm_whole()):
            return
        while (work := self._next_realtime()) is not None:
            batch, rows = work
            member = self.members[batch[0][1].model if batch else rows[0].bind.model]
            if not self._gated:
                self._realtime_batch(member, batch, rows)
                continue
            try:
                preemption = self.gate.quiesce()
                if preemption is not None and preemption.interrupted:
                    self.preemptions.append(preemption)
                    with self._cond:
                        self.counts["preempt"] += 1
                    self.metrics.preempted(preemption.latency_s)  # counts HandlerOperations{preempt} too
                    logger.info(
                        "%s %d best-effort unit(s) in flight; real-time waited %.2f ms",
                        PREEMPTION_LOG,
                        preemption.interrupted,
                        1e3 * preemption.latency_s,
                    )
                self._realtime_batch(member, batch, rows)
            finally:
                self.gate.lower_realtime(len(batch) or len(rows))

    def _realtime_batch(self, member: Member, batch: list[_Queued], rows: list[TakenRow]) -> None:
        """Run one RT batch of the whole model: admitted requests, or rows taken undecoded."""
        if batch:
            self._run(batch, lambda inputs, m=member: m.model(*inputs), self._rt_stream)
            return

        def forward(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
            with torch.inference_mode():
                output = member.model(*inputs)
            return (output[0] if isinstance(output, tuple) else output).float()

        try:
            self._row_batches.run(rows, forward)  # decoded, run, encoded here; answered in one callback
        finally:
            with self._cond:
                self._rows_running = []
                self._cond.notify_all()

    def _best_effort_loop(self, warm: concurrent.futures.Future, name: str) -> None:
        if not self.device.is_cuda:
            use_intra_op_threads(1)  # no OpenMP team on this thread, ever (the module's docstring)
        member = self.members[name]
        if not self._warm_up_here(warm, lambda: self._warm_units(member)):
            return
        stream = self._be_streams[name]
        ready = self._be_ready[name]
        while (batch := self._next(self._be[name], ready, self.config.be_max_batch)) is not None:
            with self._be_slots:
                with self._cond:
                    self._be_busy += 1
                    share = max(1, self._rt_threads // self._be_busy)

                def run(batch: list[_Queued] = batch) -> None:
                    self._run(batch, lambda inputs, m=member, s=stream: self._in_units(m, inputs, s), stream)

                try:
                    if self.device.is_cuda or share == 1:
                        run()
                    else:  # one BE queue busy: every core; two: half each, ...
                        on_a_team_of_its_own(share, run)
                finally:
                    with self._cond:
                        self._be_busy -= 1

    def _in_units(self, member: Member, inputs: tuple[torch.Tensor, ...], stream) -> torch.Tensor:  # noqa: ANN001
        """The model, one segment at a time, each only while the gate allows (the preemption points).

        On CUDA a segment is launched, not finished, inside the gate: at most
        ``c`` launched segments stay queued on the stream before this thread
        waits for the oldest, so an RT batch finds at most ``c`` in its way.
        """
        if self.config.policy == "concurrent":
            return member.model(*inputs)
        if self.config.policy == "seq":  # the whole batch is one unit, and one batch runs at a time
            with self._serial, self.gate.unit():
                return member.model(*inputs)
        state = member.sliced.start(*inputs)
        programs = self.be_programs.get(member.name)
        launched: deque = deque()
        for index, segment in enumerate(member.sliced):
            if self._padding and self.gate.realtime_mode:
                # Padding (``ReefConfig.padding``): one unit at a time beside the RT
                # stream, none queued ahead of it; RT does not wait for these.
                while launched:
                    self.device.synchronize(launched.popleft())
                state = segment(state) if programs is None else programs.run(index, state)
                self.device.synchronize(self.device.record(stream))
                self._count("pad")
                continue
            with self.gate.unit() as waited:
                state = segment(state) if programs is None else programs.run(index, state)
                event = self.device.record(stream)
            if waited:
                self._count("resume")
            if event is not None:
                launched.append(event)
                if len(launched) > self.config.c:
                    self.device.synchronize(launched.popleft())
        return member.sliced.finish(state)

    def _run(self, batch: list[_Queued], forward, stream) -> None:  # noqa: ANN001 - callables, a stream
        """Run one batch and answer each of its requests (a failure fails this batch only)."""
        tickets = [ticket for ticket, _ in batch]
        started = time.monotonic()
        for ticket in tickets:
            ticket.times.started = started
        self.metrics.batch_started(len(batch), [started - t.arrived for t in tickets])
        try:
            with torch.inference_mode(), self.device.on(stream):
                inputs = tuple(t.to(self.device.device, non_blocking=True) for t in collate([i for _, i in batch]))
                output = forward(inputs)
                if isinstance(output, tuple):
                    output = output[0]
                output = output.float().cpu()
            error = None
        except Exception as exc:  # this batch fails, the executor serves on
            logger.exception("a %d-request batch failed", len(batch))
            output, error = None, inference_failed(exc)
        finished = time.monotonic()
        self.metrics.batch_finished(finished - started)
        for ticket in tickets:
            ticket.times.finished = finished
        settle_batch(tickets, output, error)  # the batch's answers encoded in one call
        with self._cond:
            self._outstanding.difference_update(tickets)
            self._cond.notify_all()
        self._notify_space()

    def _count(self, operation: str) -> None:
        with self._cond:
            self.counts[operation] += 1
        self.metrics.operation(operation)

    # -- warm-up and shutdown --------------------------------------------------------

    def _zeros(self, member: Member, rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(
            torch.zeros((rows, *shape), dtype=dtype, device=self.device.device) for shape, dtype in member.layout
        )

    def _warm_whole(self) -> None:
        with torch.inference_mode(), self.device.on(self._rt_stream):
            for member in self.members.values():
                for rows in sorted({1, self.config.rt_max_batch}):
                    member.model(*self._zeros(member, rows))

    def _warm_units(self, member: Member) -> None:
        with torch.inference_mode(), self.device.on(self._be_streams[member.name]):
            for rows in sorted({1, self.config.be_max_batch}):
                member.sliced(*self._zeros(member, rows))

    def _warm_up_here(self, warm: concurrent.futures.Future, run) -> bool:  # noqa: ANN001
        """Warm this executor's own thread (its OpenMP team, its shapes); False: it failed and stops."""
        try:
            run()
            if self.device.is_cuda:
                torch.cuda.synchronize(self.device.device)
        except Exception as exc:
            warm.set_exception(exc)
            return False
        warm.set_result(None)
        return True

    def warm_up(self) -> None:
        """Wait until every executor has run its shapes once on its own thread (raises what failed)."""
        for warm in self._warm:
            warm.result()

    def _stop(self) -> None:
        """With the lock held (``drain_then_stop``): every executor ends at its next wait."""
        self._stopping = True
        self._rt_ready.notify_all()
        for ready in self._be_ready.values():
            ready.notify_all()

    def close(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        self._closing = True
        with self._cond:  # the rows taken undecoded first, then the admitted tickets, within one deadline
            while (self._rt_rows or self._rows_running) and time.monotonic() < deadline:
                self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
        drain_then_stop(self._cond, self._outstanding, deadline, self._stop)
        with self._cond:  # stopped: rows still in line, or in a batch not ended, get 503 (late answers drop)
            leftover = [*self._rt_rows, *self._rows_running]
            self._rt_rows.clear()
        if leftover:
            self._row_batches.fail(leftover, shut_down())
        self.gate.close()
        for thread in self._threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        self._notify_space()
        if self.partition is not None and not any(thread.is_alive() for thread in self._threads):
            torch.cuda.synchronize(self.device.device)
            self.partition.close()  # its streams die with it; an executor still running keeps them

    def __repr__(self) -> str:
        if self.partition is not None:
            return f"ReefEngine({', '.join(self.members)}; {self.partition!r})"
        return (
            f"ReefEngine({', '.join(self.members)}; RT on {self._rt_threads} thread(s), "
            "BE on an even share among the busy queues)"
        )
