"""Pinned model instances in their own processes, timed on command.

Each ``InstanceProcess`` is a fresh interpreter (``spawn``) that pins itself
to its cores *before* importing torch, so the OpenMP pool torch creates
inherits the affinity, then sets ``torch.set_num_threads(t)``, loads the
model from a saved artefact, warms up and waits.  The parent then asks it to
run timed windows: "start at wall-clock time S, run until S + D (and at least
k iterations)".  Giving several instances the same S and D runs them truly
concurrently, which is how a Packrat plan runs; keeping processes alive
between windows lets a benchmark interleave configurations without paying
model loading each time.  The profiler uses one fresh instance per point.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from model_store.catalog import ModelSpec


@dataclass(frozen=True)
class InstanceJob:
    spec: dict[str, Any]  # ModelSpec.to_dict(), so it pickles as plain data
    artefact: str  # model.pt (TorchScript) or weights.pt (state_dict)
    threads: int
    batch: int
    cores: tuple[int, ...]
    warmup: int = 2


@dataclass(frozen=True)
class WindowResult:
    latencies_ms: list[float]
    started: float
    finished: float
    threads_seen: int = 0  # torch.get_num_threads() inside the child
    affinity: tuple[int, ...] = field(default_factory=tuple)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.latencies_ms)

    def stats(self) -> dict[str, float]:
        lat = sorted(self.latencies_ms)
        return {
            "latency_ms": statistics.fmean(lat),
            "p50_ms": lat[len(lat) // 2],
            "p99_ms": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
            "iters": len(lat),
        }


def _child(job: InstanceJob, commands: mp.Queue, results: mp.Queue) -> None:
    try:
        os.sched_setaffinity(0, job.cores)
        import torch

        torch.set_num_threads(job.threads)
        from handlers.runtime.model_loading import load_model
        from model_store.factory import example_inputs

        spec = ModelSpec.from_dict(job.spec)
        model = load_model(spec, job.artefact)
        inputs = example_inputs(spec, job.batch, seed=0)
        with torch.inference_mode():
            for _ in range(job.warmup):
                model(*inputs)
        results.put(("ready", None))
        while True:
            command = commands.get()
            if command[0] == "stop":
                return
            _, start_at, duration_s, min_iters = command
            while time.time() < start_at:
                time.sleep(min(0.001, max(0.0, start_at - time.time())))
            lat: list[float] = []
            started = time.time()
            deadline = started + duration_s
            with torch.inference_mode():
                while len(lat) < min_iters or time.time() < deadline:
                    t0 = time.perf_counter()
                    model(*inputs)
                    lat.append((time.perf_counter() - t0) * 1e3)
            window = WindowResult(
                lat, started, time.time(), torch.get_num_threads(), tuple(sorted(os.sched_getaffinity(0)))
            )
            results.put(("window", window))
    except BaseException as exc:  # report, don't hang the parent
        results.put(("error", f"{type(exc).__name__}: {exc}"))


class InstanceError(RuntimeError):
    pass


def receive(results: mp.Queue, proc: Any, timeout_s: float, what: str) -> Any:
    """The next ``(kind, payload)`` a child process put on ``results``: its payload,
    or an InstanceError if the child reported an error, died or timed out."""
    import queue

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            kind, payload = results.get(timeout=1.0)
        except queue.Empty:
            if not proc.is_alive():
                raise InstanceError(f"{what} died (exit {proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise InstanceError(f"{what} timed out") from None
            continue
        if kind == "error":
            raise InstanceError(f"{what} failed: {payload}")
        return payload


class InstanceProcess:
    """One pinned model instance; use as a context manager."""

    def __init__(self, job: InstanceJob, ready_timeout_s: float = 600.0) -> None:
        self.job = job
        self.ready_timeout_s = ready_timeout_s
        ctx = mp.get_context("spawn")
        self._commands: mp.Queue = ctx.Queue()
        self._results: mp.Queue = ctx.Queue()
        self._proc = ctx.Process(target=_child, args=(job, self._commands, self._results), daemon=True)

    def _receive(self, timeout_s: float) -> Any:
        return receive(self._results, self._proc, timeout_s, f"instance on cores {self.job.cores}")

    def start(self) -> InstanceProcess:
        self._proc.start()
        return self

    def wait_ready(self) -> None:
        self._receive(self.ready_timeout_s)

    def request(self, start_at: float, duration_s: float, min_iters: int = 1) -> None:
        self._commands.put(("run", start_at, duration_s, min_iters))

    def result(self, timeout_s: float) -> WindowResult:
        return self._receive(timeout_s)

    def stop(self) -> None:
        if self._proc.is_alive():
            self._commands.put(("stop",))
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def __enter__(self) -> InstanceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_concurrently(
    instances: list[InstanceProcess], duration_s: float, min_iters: int = 1, lead_s: float = 0.2
) -> list[WindowResult]:
    """Run every instance over the same wall-clock window; results in order."""
    start_at = time.time() + lead_s
    for inst in instances:
        inst.request(start_at, duration_s, min_iters)
    # A slow instance may need several seconds past the window for its last
    # iteration (a large batch on one core), so wait generously.
    return [inst.result(timeout_s=lead_s + duration_s + 600) for inst in instances]
