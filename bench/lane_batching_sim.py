"""How batch-forming rules fare on one CPU lane, in a queue model fed by this machine's batch costs.

    python -m bench.lane_batching_sim [--model resnet50] [--overheads 0,5,10]

A *model*, not a measurement of serving: it asks what Ebird's rule costs or
gains on a CPU before any async-path overhead, so that a TorchServe run of
``bench/ebird.py`` can be read as rule plus overhead.

1. Measured (in this process, alone on the machine): the eager model's
   batch time at each size of ``--sizes`` on all of torch's threads, the median of
   ``--repeats`` runs after a warm-up.  A size's *per-sample* cost is its
   batch time over its size.
2. Modelled: open-loop Poisson arrivals into one FIFO queue served by one
   lane (a CPU Ebird worker has one by default), batches back to back, a
   batch of ``b`` taking the measured time (linear per-sample cost between
   measured sizes).  Decoding and the handler's own work are not modelled;
   ``--overheads`` scales every batch of one rule by (1 + x %) to show what
   a per-request cost that slows the batch does at each load.
3. Rules: **NO Wait** as TorchServe 0.12 forms it (``max_batch_delay`` 0:
   at most two queued requests per batch, see ``bench/ebird.py``);
   **Ebird**, the real ``ElasticScheduler`` with its default worker set,
   asked whenever the lane is free, whose assignments then run one after
   another; **Ebird, sizes paid for**: the same with only the worker sizes
   whose per-sample cost is below every smaller size's (``paid_for``: on a
   lane a batch's samples cost their time in full, so a size that is no
   cheaper per sample only makes its first requests wait, and one that is
   dearer also lowers throughput as the queue, and so the batch, grows);
   and **at most B** for each other measured size B (take what is queued,
   up to B).

Loads are fractions of the model's best throughput (one over the lowest
per-sample cost).  Each cell is the mean over ``--seeds`` arrival streams.

Check what it advises inside TorchServe before acting on it: on a 2-core
Intel VM it put the "paid for" set (1, 1, 2, 4) at 0.89× NO Wait at 85 %,
and A/B runs in one TorchServe measured that set at 1.43-1.74×
(``docs/benchmarks/README.md``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/lane_batching_sim.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from tqdm import tqdm

from bench.report import (
    add_output_arguments,
    markdown_table,
    new_figure,
    provenance,
    provenance_block,
    publish,
    save_figure,
)
from handlers.ebird.scheduler import ElasticScheduler, SchedulerState, WorkerSpec, default_worker_batches
from handlers.runtime.timing import median_seconds
from model_store.catalog import get_spec
from model_store.factory import build_model, example_inputs

Rule = Callable[[int], list[int]]  # queued requests → the batch sizes to run now, in order


def measure_batch_ms(model_name: str, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median batch time (ms) of the eager model at each size, on all of torch's intra-op threads."""
    spec = get_spec(model_name, "eager")
    model = build_model(spec)
    out = {}
    with torch.inference_mode():
        for size in tqdm(sizes, desc="batch costs", unit="size"):
            inputs = example_inputs(spec, size)
            out[size] = 1e3 * median_seconds(lambda inputs=inputs: model(*inputs), repeats=repeats, warm=2)
    return out


def batch_ms_at(costs: dict[int, float], size: int) -> float:
    """Batch time at ``size``: measured, or the per-sample cost interpolated between measured sizes."""
    if size in costs:
        return costs[size]
    sizes = sorted(costs)
    per = {b: costs[b] / b for b in sizes}
    if size < sizes[0]:
        return size * per[sizes[0]]
    if size > sizes[-1]:
        return size * per[sizes[-1]]
    lo = max(b for b in sizes if b < size)
    hi = min(b for b in sizes if b > size)
    f = (size - lo) / (hi - lo)
    return size * (per[lo] + f * (per[hi] - per[lo]))


def at_most(cap: int) -> Rule:
    return lambda queued: [min(queued, cap)]


def paid_for(worker_batches: list[int], costs: dict[int, float]) -> list[int]:
    """The worker sizes whose per-sample cost beats every smaller size's (both workers of size 1 stay)."""
    kept: list[int] = []
    best = float("inf")
    for size in sorted(set(worker_batches)):
        per_sample = batch_ms_at(costs, size) / size
        if per_sample < best:
            kept.append(size)
            best = per_sample
    return [b for b in worker_batches if b in kept]


def ebird_rule(worker_batches: list[int]) -> Rule:
    """The real policy, asked with every worker idle (one lane: it is asked again only when all are done)."""
    workers = [WorkerSpec(i, b) for i, b in enumerate(worker_batches)]
    scheduler = ElasticScheduler(workers, max_inflight=sum(worker_batches))

    def rule(queued: int) -> list[int]:
        plan = scheduler.next_batch(SchedulerState(ready=queued, in_flight=0, idle=workers))
        return [a.count for a in plan.assignments]

    return rule


def simulate(rule: Rule, costs: dict[int, float], rate: float, requests: int, seed: int, slowdown: float = 1.0):
    """(mean ms, p99 ms) of ``requests`` Poisson arrivals at ``rate``/s through one lane under ``rule``."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate / 1e3)
        arrivals.append(t)
    batch_ms: dict[int, float] = {}  # by size: interpolated once, not per batch
    latencies: list[float] = []
    now, head, taken = 0.0, 0, 0  # head: first request not yet taken into a batch
    while head < requests:
        if arrivals[head] > now:
            now = arrivals[head]  # idle until the next arrival
        while taken < requests and arrivals[taken] <= now:
            taken += 1
        for size in rule(taken - head):
            if size not in batch_ms:
                batch_ms[size] = batch_ms_at(costs, size) * slowdown
            now += batch_ms[size]
            latencies += [now - a for a in arrivals[head : head + size]]
            head += size
    latencies.sort()
    return statistics.fmean(latencies), latencies[int(0.99 * (len(latencies) - 1))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    costs = args.costs or measure_batch_ms(args.model, args.sizes, args.repeats)
    best_rps = 1e3 / min(ms / b for b, ms in costs.items())
    workers = default_worker_batches(32)
    paid = paid_for(workers, costs)
    rules: dict[str, Rule] = {
        "NO Wait (≤ 2)": at_most(2),
        "Ebird": ebird_rule(workers),
        f"Ebird, sizes paid for {paid}": ebird_rule(paid),
    }
    rules |= {f"at most {b}": at_most(b) for b in sorted(costs) if b != 2}
    rows = []
    cells = [(f, name, o) for f in args.loads for name in rules for o in args.overheads]
    for fraction, name, overhead in tqdm(cells, desc="queue model", unit="cell"):
        runs = [
            simulate(rules[name], costs, fraction * best_rps, args.requests, seed, 1 + overhead / 100)
            for seed in range(args.seeds)
        ]
        rows.append({"load": fraction, "rate_rps": fraction * best_rps, "rule": name, "overhead_pct": overhead,
                     "mean_ms": statistics.fmean(r[0] for r in runs),
                     "p99_ms": statistics.fmean(r[1] for r in runs)})  # fmt: skip
    return {"model": args.model, "mode": "eager", "batch_ms": {str(b): ms for b, ms in sorted(costs.items())},
            "costs_given": bool(args.costs), "best_rps": best_rps, "seeds": args.seeds, "requests": args.requests,
            "rows": rows}  # fmt: skip


def cell(data: dict[str, Any], load: float, rule: str, overhead: float) -> dict[str, Any]:
    return next(r for r in data["rows"] if (r["load"], r["rule"], r["overhead_pct"]) == (load, rule, overhead))


def mean_p99(row: dict[str, Any]) -> str:
    return f"{row['mean_ms']:.0f} / {row['p99_ms']:.0f}"


def render(data: dict[str, Any]) -> str:
    costs = {int(b): ms for b, ms in data["batch_ms"].items()}
    cost_table = markdown_table(
        ["batch", *map(str, costs)],
        [["batch ms", *(f"{ms:.1f}" for ms in costs.values())],
         ["per sample ms", *(f"{ms / b:.1f}" for b, ms in costs.items())]],
    )  # fmt: skip
    loads = sorted({r["load"] for r in data["rows"]})
    overheads = sorted({r["overhead_pct"] for r in data["rows"]})
    rules = list(dict.fromkeys(r["rule"] for r in data["rows"]))
    header = ["rule", *(f"{load:.0%} ({cell(data, load, rules[0], 0)['rate_rps']:.1f}/s)" for load in loads)]
    tables = []
    for overhead in overheads:
        rows = [[rule, *(mean_p99(cell(data, load, rule, overhead)) for load in loads)] for rule in rules]
        tables.append(f"Every batch {overhead:g} % slower (mean / p99 ms):\n\n{markdown_table(header, rows)}")
    ratio_rows = [
        [f"{o:g} % on Ebird, 0 on NO Wait",
         *(f"{cell(data, load, 'Ebird', o)['mean_ms'] / cell(data, load, 'NO Wait (≤ 2)', 0)['mean_ms']:.2f}"
           for load in loads)]
        for o in overheads
    ]  # fmt: skip
    source = "given with `--costs`" if data["costs_given"] else "measured in this process, median of the runs"
    return (
        f"# One CPU lane, batch-forming rules in a queue model: {data['model']} ({data['mode']})\n\n"
        f"A model, not a serving measurement (see the module docstring). Batch costs, {source}:\n\n{cost_table}\n\n"
        f"Loads are fractions of the best throughput, {data['best_rps']:.1f} req/s (one over the lowest per-sample "
        f"cost); Poisson arrivals, {data['requests']} requests, mean of {data['seeds']} seeds.\n\n"
        + "\n\n".join(tables)
        + f"\n\nEbird's mean ÷ NO Wait's:\n\n{markdown_table(['Ebird slowed by', *header[1:]], ratio_rows)}\n\n"
        f"![mean latency by load]({data['stem']}.png)\n\n{provenance_block(data['provenance'])}"
    )


def plot(data: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure((7.0, 3.8))
    loads = sorted({r["load"] for r in data["rows"]})
    for rule in dict.fromkeys(r["rule"] for r in data["rows"]):
        ax.plot([100 * f for f in loads], [cell(data, f, rule, 0)["mean_ms"] for f in loads], marker="o", label=rule)
    save_figure(fig, ax, path, "load (% of best throughput)", "mean latency (ms)",
                f"{data['model']}: one lane, no overhead", log_y=True)  # fmt: skip


def parse_costs(text: str) -> dict[int, float]:
    """``1:50.2,2:86.4`` → batch ms by size."""
    try:
        costs = {int(b): float(ms) for b, ms in (item.split(":") for item in text.split(",") if item.strip())}
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected size:ms pairs like 1:50,2:86, got {text!r}") from exc
    if not costs or any(b < 1 or ms <= 0 for b, ms in costs.items()):
        raise argparse.ArgumentTypeError(f"sizes must be ≥ 1 and times > 0, got {text!r}")
    return costs


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per batch size")
    parser.add_argument("--costs", type=parse_costs, help="batch ms by size (size:ms,…) instead of measuring")
    parser.add_argument("--loads", type=floats, default=floats("0.3,0.7,0.85,0.92"), help="fractions of best rps")
    parser.add_argument("--overheads", type=floats, default=floats("0,5,10"), help="%% slower batches, per row")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--stem", default=None, help="output file stem (default lane_batching_sim_MODEL)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    data = run(args)
    data["stem"] = args.stem or f"lane_batching_sim_{args.model}"
    data["provenance"] = provenance("bench.lane_batching_sim")
    print(publish(data["stem"], data, render, plot, args.out_dir, args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
