"""A scheduling handler against TorchServe's own batching, side by side in one TorchServe.

The Ebird and DVABatch benchmarks ask the same question of different
handlers: at loads every system can sustain, does the handler answer faster
than TorchServe batching the plain handler with no window ("NO Wait", the
DVABatch paper's ZeroBatch) or with the best window ("OPT Wait", DelayBatch)?
This module is the part they share, so both measure the same way:

- ``sustained_throughput``: what a system sustains when closed-loop clients never let it idle;
  ``sustained_capacity``: that for several systems, taking turns, repeated;
- ``sweep_batch_delay``: the window with the lowest mean latency over a load
  shape, each candidate registered fresh under one name, run in this process
  so that its result belongs to this run;
- ``interleaved``: every system runs every load shape, the systems taking
  turns (ABC, CBA, …) so that a drift of the shared machine touches all alike;
- ``phase_stats`` / ``ratio_spread``: per-repeat numbers and the median
  (min-max) of per-repeat ratios, the form every table here reports;
- ``run_and_publish``: a benchmark's run in a scratch directory, whose
  TorchServe logs are kept when it fails or a request fails, then its
  tables, plot and JSON.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.report import provenance, publish
from handlers.runtime.metrics import DEFAULT_FLUSH_INTERVAL_S
from serving_harness.clients import ManagementClient, MetricsClient
from serving_harness.loadgen import LoadResult, Payload, closed_loop, open_loop, run

TS_MAX_BATCH = 32  # the baselines' batch_size: larger than any batch these loads form
Phases = list[tuple[float, float]]  # (seconds, requests/s) in order


def payload_cycle(payloads: Sequence[Payload]) -> Callable[[int], Payload]:
    return lambda i: payloads[i % len(payloads)]


def warm(url: str, payloads: Sequence[Payload], seconds: float, clients: int = 4) -> None:
    run(closed_loop(url, payload_cycle(payloads), clients, seconds))


def sustained_throughput(url: str, payloads: Sequence[Payload], clients: int, seconds: float) -> float:
    """Answers per second under ``clients`` closed-loop clients: the system is never idle."""
    return run(closed_loop(url, payload_cycle(payloads), clients, seconds)).throughput()


def sustained_capacity(
    urls: dict[str, str], payloads: Sequence[Payload], clients: int, seconds: float, repeats: int
) -> dict[str, list[float]]:
    """``sustained_throughput`` of every system, ``repeats`` times, the systems taking turns (AB, BA, …).

    One run per system measured one system early and the other late: on a
    2-core VM whose speed drifts within minutes, a single pair once read
    Ebird at 0.84× NO Wait where three interleaved pairs in the same
    TorchServe read 0.94-1.0×.  Callers use the median.
    """
    systems = tuple(urls)
    runs: dict[str, list[float]] = {name: [] for name in systems}
    for r in tqdm(range(repeats), desc="capacity", unit="round"):
        for name in systems if r % 2 == 0 else systems[::-1]:
            runs[name].append(sustained_throughput(urls[name], payloads, clients, seconds))
    return runs


def capacity_summary(medians: dict[str, float], runs: dict[str, list[float]] | None, labels: dict[str, str]) -> str:
    """``"A 19.5 (18.5-19.6), B …"``: each system's median req/s and, where its runs are known, their range."""
    parts = []
    for name, value in medians.items():
        seen = (runs or {}).get(name) or []
        parts.append(f"{labels[name]} {value:.1f}" + (f" ({min(seen):.1f}-{max(seen):.1f})" if len(seen) > 1 else ""))
    return ", ".join(parts)


def runs_per_system(runs: dict[str, list[float]] | None) -> int:
    """How many capacity runs each system had (1 for results from before ``sustained_capacity``)."""
    return len(next(iter(runs.values()))) if runs else 1


def run_pattern(url: str, payloads: Sequence[Payload], phases: Phases, seed: int) -> LoadResult:
    """Open-loop Poisson arrivals; the same seed gives every system the same schedule."""
    return run(open_loop(url, payload_cycle(payloads), phases, poisson=True, seed=seed))


def register_batching(mgmt: ManagementClient, archive: str, name: str, delay_ms: int) -> None:
    """The plain archive under TorchServe's batching: batch_size 32, window ``delay_ms``."""
    mgmt.register(archive, model_name=name, initial_workers=1, batch_size=TS_MAX_BATCH, max_batch_delay_ms=delay_ms)


def sweep_batch_delay(
    mgmt: ManagementClient,
    archive: str,
    url: str,
    payloads: Sequence[Payload],
    patterns: Sequence[Phases],
    delays: Sequence[int],
    warm_seconds: float,
    name: str = "sweep",
) -> tuple[int, list[dict[str, Any]]]:
    """The window with the lowest mean latency over ``patterns``, and every candidate's result.

    ``url`` serves ``name``; each candidate is registered under it, run, and
    unregistered, so the sweep leaves nothing behind.
    """
    rows = []
    for delay in tqdm(delays, desc="batch window sweep", unit="delay"):
        register_batching(mgmt, archive, name, delay)
        try:
            warm(url, payloads, warm_seconds)
            results = [run_pattern(url, payloads, shape, seed=99) for shape in patterns]
        finally:
            mgmt.unregister(name)
        samples = [s for r in results for s in r.samples]
        merged = LoadResult(samples, sum(r.wall_s for r in results))
        rows.append({"max_batch_delay_ms": delay, "mean_ms": merged.mean_latency_ms(), "failed": merged.failed})
    best = min(rows, key=lambda row: row["mean_ms"])["max_batch_delay_ms"]
    return best, rows


def interleaved(
    urls: dict[str, str],
    payloads: Sequence[Payload],
    patterns: dict[str, Phases],
    repeats: int,
    desc: str,
    around_run: Callable[[str, str], Callable[[], None]] | None = None,
) -> dict[str, dict[str, list[LoadResult]]]:
    """``results[pattern][system]``: one LoadResult per repeat, systems alternating order each repeat.

    A run ends when its last answer is in, so no backlog leaks into the next.
    ``around_run(pattern, system)`` is called before each run and returns
    what to call after it (e.g. to read the server's counters either side).
    """
    systems = tuple(urls)
    orders = [systems, tuple(reversed(systems))]
    results: dict[str, dict[str, list[LoadResult]]] = {p: {n: [] for n in systems} for p in patterns}
    with tqdm(total=repeats * len(systems) * len(patterns), desc=desc, unit="run") as bar:
        for r in range(repeats):
            for pattern, shape in patterns.items():
                for name in orders[r % 2]:
                    bar.set_postfix_str(f"{pattern} {name}")
                    after = around_run(pattern, name) if around_run else None
                    results[pattern][name].append(run_pattern(urls[name], payloads, shape, seed=r))
                    if after:
                        after()
                    bar.update()
    return results


def batch_counts(metrics: MetricsClient, model: str) -> Counter:
    """Batches run so far by size, from the handlers' ``HandlerBatches`` counter (plain and async handlers alike)."""
    out: Counter = Counter()
    for labels, value in metrics.samples("HandlerBatches"):
        if labels.get("ModelName") == model:
            out[int(labels["BatchSize"])] += int(value)
    return out


Counts = dict[str, Counter]


def recording_counts(
    read: Callable[[str], Counts], into: dict[str, dict[str, list[Counts]]]
) -> Callable[[str, str], Callable[[], None]]:
    """An ``around_run`` for ``interleaved``: what ``read(system)`` counted during each run, appended to
    ``into[pattern][system]``.  After a run it waits for the handler's next metrics flush and the
    frontend's parse of it, so the run's last batches are in."""

    def around_run(pattern: str, name: str) -> Callable[[], None]:
        before = read(name)

        def after() -> None:
            time.sleep(DEFAULT_FLUSH_INTERVAL_S + 0.5)
            now = read(name)
            into[pattern][name].append({k: now[k] - before[k] for k in now})

        return after

    return around_run


def phase_stats(result: LoadResult, start: float, end: float, qos_s: float) -> dict[str, Any]:
    """Mean / p99 / counts / goodput of the requests sent in ``[start, end)`` seconds of a run."""
    phase = LoadResult([s for s in result.samples if start <= s.sent < end], end - start)
    return {
        "mean_ms": phase.mean_latency_ms(),
        "p99_ms": phase.percentile_ms(99),
        "requests": len(phase.samples),
        "failed": phase.failed,
        "throughput_rps": len(phase.ok) / (end - start),
        "goodput_rps": sum(s.latency_s <= qos_s for s in phase.ok) / (end - start),
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def repeat_ratios(per_repeat: dict[str, list[dict[str, Any]]], system: str, baselines: Sequence[str],
                  phase: str, key: str) -> list[float]:  # fmt: skip
    """Repeat by repeat, ``system``'s ``key`` ÷ the best baseline's in the same repeat."""
    return [
        run[phase][key] / min(per_repeat[b][r][phase][key] for b in baselines)
        for r, run in enumerate(per_repeat[system])
    ]


def ratio_spread(per_repeat: dict[str, list[dict[str, Any]]], system: str, baselines: Sequence[str],
                 phase: str, key: str) -> dict[str, float]:  # fmt: skip
    """Median (min-max) of ``repeat_ratios``."""
    return spread(repeat_ratios(per_repeat, system, baselines, phase, key))


def median_cell(per_repeat: list[dict[str, Any]], phase: str, key: str) -> float:
    return statistics.median(rep[phase][key] for rep in per_repeat)


def run_and_publish(
    args: argparse.Namespace,
    module: str,
    measure: Callable[[argparse.Namespace, Path], dict[str, Any]],
    failed: Callable[[dict[str, Any]], int],
    render: Callable[[dict[str, Any], str], str],
    plot: Callable[[dict[str, Any], Path], None],
) -> int:
    """Run ``measure`` in a scratch directory and publish ``<module's name>_<model>.*``.

    A failed request is a finding: the scratch directory (TorchServe's logs)
    is kept whenever the run raises or ``failed(data)`` is not 0.
    """
    name = module.rpartition(".")[2]
    prov = provenance(module)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=f"{name}-bench-"))
    try:
        data = measure(args, workdir)
    except BaseException:
        print(f"kept TorchServe's logs for diagnosis: {workdir / 'ts' / 'logs'}", file=sys.stderr)
        raise
    lost = failed(data)
    if lost:
        print(f"{lost} requests failed; TorchServe's logs are in {workdir / 'ts' / 'logs'}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    data["provenance"] = prov
    data["wall_s"] = time.monotonic() - started
    stem = f"{name}_{data['model']}"
    print(publish(stem, data, lambda d: render(d, stem), plot, args.out_dir, args.json))
    return 0
