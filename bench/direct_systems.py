"""The systems ``bench/ebird_direct.py`` compares, each served in-process in a process of its own.

A system's name says what runs (``ebird``, ``nowait``, ``waitN``, ``dvabatch``, ``reef``,
the twin and graph variants); ``make_driver`` builds its handler as TorchServe's
Python worker would (``bench/direct.py``) and a driver that feeds it requests:
one ``handle`` call per request for the async handlers, the frontend's
batching emulated for the plain handler.  ``SystemProcess`` runs one system in
a spawned child and plays arrival times to it over a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from archiver.options import ServingOptions
from bench.direct import BurstCaller, call_batch, group_load_context, load_context
from handlers.dvabatch.handler import DvaBatchHandler
from handlers.ebird.handler import EbirdHandler
from handlers.ebird.scheduler import default_worker_batches
from handlers.plain_handler import PlainModelHandler
from handlers.reef.handler import ReefHandler
from handlers.runtime.decode import BATCHED, LANE
from model_store.catalog import get_spec
from serving_harness.loadgen import LoadResult, Sample

BASELINE = "nowait"
GRAPH_BASELINE = "nowait-graphs"
# NO Wait with Ebird's batched execution: graphs replayed, and each batch's JPEGs decoded in one call (nvJPEG).
SAME_EXECUTION = "nowait-graphs-batched"
TWIN = "nowait-twin"  # NO Wait again, as a system of its own: its ratio to NO Wait is the bench's A/A band
EBIRD_EAGER = "ebird-eager"
DVABATCH = "dvabatch"
REEF = "reef"  # REEF serving the one model as its real-time member: its RT path, the host-bound measure
NOWAIT_BATCH = 32


AT = "@"  # "ebird@1baf14b": the system as the code of that commit serves it (``--base``)


def at_commit(system: str) -> tuple[str, str | None]:
    """(system, commit) of a name: ``ebird@1baf14b`` → (``ebird``, ``1baf14b``); no commit → None."""
    name, _, commit = system.partition(AT)
    return name, commit or None


def ebird_system(decode_threads: str) -> str:
    """A system's name for Ebird with a decode placement ("auto": the runtime's default)."""
    if decode_threads == "auto":
        return "ebird"
    if decode_threads in (LANE, BATCHED):
        return f"ebird-decode{decode_threads}"
    if int(decode_threads) < 0:
        raise ValueError(decode_threads)
    return f"ebird-decode{int(decode_threads)}"


def decode_setting(system: str) -> int | str | None:
    """The archive's ``decode_threads`` for an Ebird system name (None: the default)."""
    system, _ = at_commit(system)
    if system == EBIRD_EAGER:
        return None
    placement = system.removeprefix("ebird").removeprefix("-decode")
    return None if not placement else placement if placement in (LANE, BATCHED) else int(placement)


def wait_ms(system: str) -> float:
    """The frontend's ``max_batch_delay`` of a waiting baseline (``wait5`` → 5)."""
    return float(system.removeprefix("wait"))


def execution_twin(system: str, systems: list[str] | dict[str, Any]) -> str | None:
    """The NO Wait system that runs an Ebird system's execution (graphs; and batched JPEG decoding where it
    decodes so), where one is measured: Ebird ÷ it is what Ebird's scheduling alone is worth."""
    if not system.startswith("ebird") or system == EBIRD_EAGER:
        return None
    if decode_setting(system) == BATCHED and SAME_EXECUTION in systems:
        return SAME_EXECUTION
    return GRAPH_BASELINE if GRAPH_BASELINE in systems else None


def is_baseline(system: str) -> bool:
    """The stock handler under the frontend's batching (eager): the systems a handler must beat."""
    return system == BASELINE or system.startswith("wait")


def label(system: str) -> str:
    system, commit = at_commit(system)
    if commit is not None:
        return f"{label(system)} at {commit}"
    if system == BASELINE:
        return "NO Wait"
    if system == GRAPH_BASELINE:
        return "NO Wait (graphs)"
    if system == SAME_EXECUTION:
        return "NO Wait (graphs, JPEGs in batches)"
    if system == TWIN:
        return "NO Wait (twin)"
    if system == "ebird":
        return "Ebird"
    if system == DVABATCH:
        return "DVABatch"
    if system == REEF:
        return "REEF (real-time)"
    if system.startswith("wait"):
        return f"wait {wait_ms(system):g} ms"
    if system == EBIRD_EAGER:
        return "Ebird (eager)"
    placement = decode_setting(system)
    if placement == LANE:
        return "Ebird (decode on the lane)"
    if placement == BATCHED:
        return "Ebird (JPEGs decoded in batches)"
    if placement == 0:
        return "Ebird (inline decode)"
    return f"Ebird ({placement} decode thread{'' if placement == 1 else 's'})"


# -- inside a system's process ------------------------------------------------


class AsyncDriver:
    """An async handler (Ebird, DVABatch), driven as the handlers' own message pump drives it.

    Inside TorchServe the pump (``handlers/runtime/worker_pump.py``) reads
    every message waiting on the socket at once and hands them to the
    handler's ``serve_burst`` together; here the requests that arrive while
    the event loop is busy are one burst, handed over on its next turn.  As
    the pump's read gate does, no burst is handed over while every CPU lane
    runs a quiet batch: requests that arrive then wait, like messages left
    in the socket, and join the burst handed over when it ends.
    """

    def __init__(self, handler: Any, load_ctx: Any) -> None:
        self.handler, self.load_ctx = handler, load_ctx
        self.caller = BurstCaller(handler, load_ctx, self._gate, parse=False)

    async def start(self) -> None:
        self.caller = BurstCaller(self.handler, self.load_ctx, self._gate, parse=False)

    async def request(self, row: dict) -> int:
        status, _ = await self.caller.request(row)
        return status

    def _gate(self, hand_over: Callable[[], None]) -> None:
        lanes = getattr(self.handler, "lanes", None)
        if lanes is not None and lanes.all_quiet():
            gate = asyncio.get_running_loop().run_in_executor(None, lanes.wait_for_a_loud_lane)
            gate.add_done_callback(lambda _: hand_over())
        else:
            hand_over()

    async def stop(self) -> None:
        pass


class NoWaitDriver:
    """The plain handler behind a batch-aggregating frontend that never waits for a fuller batch."""

    def __init__(self, handler: Any, load_ctx: Any, batch_size: int, delay_s: float = 0.0) -> None:
        self.handler, self.load_ctx, self.batch_size, self.delay_s = handler, load_ctx, batch_size, delay_s
        # The worker runs one batch at a time, on one thread, as TorchServe's worker runs ``handle`` on its
        # main thread.  ``initialize`` runs there too: torch work on a second thread would start a second
        # OpenMP team on the same cores (measured: 74 → 86-104 ms per image on 2 cores).
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="worker")
        self.worker.submit(handler.initialize, load_ctx).result()

    async def start(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.batcher = asyncio.create_task(self._aggregate())

    async def request(self, row: dict) -> int:
        answer = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((row, answer))
        return await answer

    async def _aggregate(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            deadline = loop.time() + self.delay_s  # max_batch_delay: a fuller batch may be waited for this long
            while len(items) < self.batch_size:
                if not self.queue.empty():
                    items.append(self.queue.get_nowait())
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    items.append(await asyncio.wait_for(self.queue.get(), remaining))
                except TimeoutError:
                    break
            try:
                answers = await loop.run_in_executor(self.worker, call_batch, self.handler, self.load_ctx,
                                                     [row for row, _ in items], False)  # fmt: skip
                statuses = [status for status, _ in answers]
            except Exception:  # the worker died on this batch: its requests fail, none vanish
                statuses = [0] * len(items)
            for (_, answer), status in zip(items, statuses, strict=True):
                answer.set_result(status)

    async def stop(self) -> None:
        self.batcher.cancel()


def make_driver(
    system: str, model: str, mode: str, model_dir: str, device: str, max_batch: int | None = None
) -> tuple[Any, Any]:
    """(driver, handler) for one system, initialised as TorchServe would initialise its worker.

    ``max_batch``: every system's largest batch (Ebird's largest worker, DVABatch's ``max_batch``, REEF's
    ``rt_max_batch``, the frontend's ``batch_size`` for the plain handler); None: each one's default.
    """
    spec = get_spec(model, mode)
    gpu = 0 if device == "cuda" else None
    if system.startswith("ebird"):
        settings: tuple[tuple[str, Any], ...] = (("cuda_graphs", False),) if system == EBIRD_EAGER else ()
        if max_batch is not None:  # the paper's worker set whose largest worker takes max_batch
            settings += (("worker_batches", default_worker_batches(2 * max_batch)), ("max_inflight", 2 * max_batch))
        options = ServingOptions(handler="ebird", decode_threads=decode_setting(system), handler_settings=settings)
        ctx = load_context(spec, Path(model_dir), options, gpu=gpu)
        handler = EbirdHandler()
        handler.initialize(ctx)
        return AsyncDriver(handler, ctx), handler
    if system == DVABATCH:
        from bench.dvabatch import dvabatch_token_lengths

        settings = () if max_batch is None else (("max_batch", max_batch), ("max_inflight", max(64, 2 * max_batch)))
        options = ServingOptions(
            handler="dvabatch", token_lengths=dvabatch_token_lengths(spec, "auto"), handler_settings=settings
        )
        ctx = load_context(spec, Path(model_dir), options, gpu=gpu)
        handler = DvaBatchHandler()
        handler.initialize(ctx)
        return AsyncDriver(handler, ctx), handler
    if system == REEF:  # a one-model group archive whose model is real-time: no header needed
        settings = (("realtime", (model,)),)
        if max_batch is not None:
            settings += (("rt_max_batch", max_batch), ("max_inflight", max(64, 2 * max_batch)))
        options = ServingOptions(handler="reef", handler_settings=settings)
        ctx = group_load_context([spec], Path(model_dir) / "group", options, gpu)
        handler = ReefHandler()
        handler.initialize(ctx)
        return AsyncDriver(handler, ctx), handler
    delay_ms = wait_ms(system) if system.startswith("wait") else 0.0
    batch = max_batch or NOWAIT_BATCH
    options = ServingOptions(
        batch_size=batch,
        max_batch_delay_ms=round(delay_ms),
        cuda_graphs=system in (GRAPH_BASELINE, SAME_EXECUTION),
        decode_threads=BATCHED if system == SAME_EXECUTION else None,
    )
    ctx = load_context(spec, Path(model_dir), options, gpu=gpu)
    handler = PlainModelHandler()
    return NoWaitDriver(handler, ctx, batch, delay_ms / 1e3), handler  # initialised on the driver's worker thread


async def open_loop(driver: Any, rows: list[dict], times: list[float]) -> LoadResult:
    """Every arrival's sample; latency counts from the scheduled send time, since the event loop that
    would send late is the handler's own (Ebird decodes on it)."""
    await driver.start()
    result = await play(times, lambda i: driver.request(rows[i % len(rows)]))
    await driver.stop()
    return result


async def play(times: list[float], send: Callable[[int], Awaitable[int]]) -> LoadResult:
    """``send(i)`` at each of ``times`` (seconds from now), concurrently; each sample's latency counts from
    its scheduled time, so a send the event loop made late is charged to the system, not hidden."""
    samples: list[Sample] = []
    t0 = time.perf_counter()

    async def one(i: int, at: float) -> None:
        status = await send(i)
        samples.append(Sample(at, time.perf_counter() - t0 - at, status))

    tasks = []
    for i, at in enumerate(times):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, at)))
    await asyncio.gather(*tasks)
    return LoadResult(samples, time.perf_counter() - t0)


def thread_role(name: str | None) -> str:
    """Which part of a system a thread of its process is: the event loop (and the load generator on
    it), the sync worker, a CPU lane, a decode thread, REEF's executors, an OpenMP team thread (not a
    Python thread), or another."""
    if name is None:
        return "OpenMP"
    if name == "MainThread":
        return "event loop"
    for prefix, role in (("worker", "worker"), ("lane", "lanes"), ("decode", "decode"), ("reef-", "executors")):
        if name.startswith(prefix):
            return role
    return "other"


def cpu_seconds_by_role() -> dict[str, float]:
    """CPU seconds (user + system) each role's threads of this process have used so far (Linux /proc)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        role = thread_role(names.get(int(tid)))
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


def python_us(cpu_us: dict[str, float]) -> float:
    """CPU µs per answer of a system's Python threads: every role's but the OpenMP team's (``thread_role``)."""
    return sum(us for role, us in cpu_us.items() if role != "OpenMP")


def cpu_us_per_answer(before: dict[str, float], after: dict[str, float], answered: int) -> dict[str, float]:
    """Each role's CPU between two ``cpu_seconds_by_role`` readings, in µs per answer (roles under 0.5 µs left out)."""
    per = {role: 1e6 * (after[role] - before.get(role, 0.0)) / max(answered, 1) for role in after}
    return {role: us for role, us in per.items() if us >= 0.5}


async def closed_loop(driver: Any, rows: list[dict], clients: int, seconds: float) -> dict[str, Any]:
    """Answered requests per second with ``clients`` requests always in flight, and the host CPU each
    answer cost, in µs by thread role (``cpu_seconds_by_role``): what a request costs the host, which
    on a fast GPU or with a tiny model is what limits a handler."""
    await driver.start()
    samples: list[Sample] = []
    cpu_before = cpu_seconds_by_role()
    t0 = time.perf_counter()

    async def client(k: int) -> None:
        i = k
        while (sent := time.perf_counter()) - t0 < seconds:
            status = await driver.request(rows[i % len(rows)])
            samples.append(Sample(sent - t0, time.perf_counter() - sent, status))
            i += clients

    await asyncio.gather(*(client(k) for k in range(clients)))
    result = LoadResult(samples, time.perf_counter() - t0)
    cpu_after = cpu_seconds_by_role()
    await driver.stop()
    cpu_us = cpu_us_per_answer(cpu_before, cpu_after, len(samples))
    return {"throughput": result.throughput(), "cpu_us_per_request": cpu_us}


def stage_totals(metrics: Any) -> dict[str, Any]:
    """The handler's own counters: batches run by size, and seconds and requests per stage."""
    snap = metrics.snapshot()
    return {"batches": snap["batches"], "seconds": dict(metrics.stage_seconds), "counts": dict(metrics.stage_counts)}


def counters_since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One run's share of the counters: batches by size, and mean ms per request in each stage."""
    batches = {size: n - before["batches"].get(size, 0) for size, n in after["batches"].items()}
    stages = {}
    for stage, seconds in after["seconds"].items():
        requests = after["counts"][stage] - before["counts"].get(stage, 0)
        if requests:
            stages[stage] = 1e3 * (seconds - before["seconds"].get(stage, 0.0)) / requests
    return {"batches": {size: n for size, n in batches.items() if n}, "stages_ms": stages}


def serve(
    conn: Connection, system: str, model: str, mode: str, model_dir: str, device: str, max_batch: int | None = None
) -> None:
    """A system's process: load, say ready, then run the parent's load commands one at a time."""
    from bench.dvabatch import bench_payloads
    from model_store.samples import request_body

    driver, handler = make_driver(system, model, mode, model_dir, device, max_batch)
    payloads, _ = bench_payloads(get_spec(model, mode), count=64)  # token models: mixed lengths
    rows = [{"body": request_body(p)} for p in payloads]
    conn.send(("ready", str(handler.device.device)))
    for command, kwargs in iter(conn.recv, None):
        try:
            before = stage_totals(handler.metrics)
            if command == "open":
                result: Any = asyncio.run(open_loop(driver, rows, **kwargs))
            else:
                result = asyncio.run(closed_loop(driver, rows, **kwargs))
            conn.send(("ok", (result, counters_since(before, stage_totals(handler.metrics)))))
        except Exception as exc:  # the parent reports it; the process stays up for the next command
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


# -- the parent --------------------------------------------------------------


def serve_from(tree: str, conn: Connection, *args: Any) -> None:
    """``serve`` with the repository's modules imported from ``tree`` (another commit's checkout).

    The spawned interpreter has imported this checkout's modules to reach
    this function; they are dropped and the tree's imported in their place,
    so the handler, its runtime and the driver are all that commit's.
    """
    import importlib
    import sys

    ours = {"archiver", "bench", "handlers", "model_store", "packrat_plugin", "serving_harness", "windtunnel"}
    for name in [n for n in sys.modules if n.split(".")[0] in ours]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    theirs = importlib.import_module("bench.direct_systems")
    for module in (theirs, importlib.import_module("handlers")):
        if not str(module.__file__).startswith(tree):
            conn.send(("error", f"{module.__name__} came from {module.__file__}, not {tree}"))
            return
    theirs.serve(conn, *args)


class SystemProcess:
    def __init__(
        self,
        system: str,
        model: str,
        mode: str,
        model_dir: Path,
        device: str,
        max_batch: int | None = None,
        tree: Path | None = None,
    ) -> None:
        """``system`` served in a process of its own; ``tree``: by the code checked out there (a name
        ``ebird@REV`` serves ``ebird`` so)."""
        self.system = system
        ctx = mp.get_context("spawn")  # a fresh interpreter: no torch thread state shared with the parent
        self.conn, child = ctx.Pipe()
        served, _ = at_commit(system)
        args = (child, served, model, mode, str(model_dir), device, max_batch)
        if tree is None:
            self.process = ctx.Process(target=serve, args=args)
        else:
            self.process = ctx.Process(target=serve_from, args=(str(tree), *args))
        self.process.start()
        self.device: str | None = None

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until the handler is initialised (processes start together and load side by side)."""
        self.device = self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.system}: no answer within {timeout_s:g} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"{self.system}: {value}")
        return value

    def run(self, command: str, timeout_s: float, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        self.conn.send((command, kwargs))
        return self._receive(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # the process is gone already
            self.conn.send(None)
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
