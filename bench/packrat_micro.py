"""Packrat micro-benchmark: the fat instance vs the optimizer's plan, pure PyTorch.

    python -m bench.packrat_micro --model resnet50 --batches 2,4,8,16

For each batch size B, two configurations run as real pinned processes (no
TorchServe): the fat instance ⟨1, T, B⟩ (one process, all T cores) and
Packrat's plan for (T, B) from the model's profile (several processes, each
on its own cores, all running concurrently).  A plan's latency is that of its
slowest instance, because a batch of B is done when every instance is done.
The two configurations alternate in timed windows (fat, plan, plan, fat, …)
with every process loaded and warm, and the reported speedup is the median
over repeats of fat latency / plan latency, with its min-max spread.  The
expected speedup is the profile's own prediction, L[T][B] / plan latency.
This is the analogue of the Packrat paper's Figure 4.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

if __package__ in (None, ""):  # `python bench/NAME.py` from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import (
    PACKRAT_ROW_HEADER,
    markdown_table,
    packrat_row_cells,
    provenance,
    provenance_block,
    speedup_bars,
    write_outputs,
)
from packrat_plugin.allocator import allocate
from packrat_plugin.compare import fat_plan, median_and_spread
from packrat_plugin.measure import InstanceJob, InstanceProcess, WindowResult, run_concurrently
from packrat_plugin.optimizer import KnapsackOptimizer, expected_speedup
from packrat_plugin.plan_types import Plan
from packrat_plugin.profiler import PreparedModel, parse_int_list, prepare_model, profile_for_this_machine
from serving_harness.topology import CpuTopology


@dataclass
class Window:
    latency_ms: float  # slowest instance's mean iteration latency
    throughput: float  # inferences per second over the window, all instances


def summarise(results: list[WindowResult], batches: list[int]) -> Window:
    latency = max(r.mean_ms for r in results)
    throughput = sum(len(r.latencies_ms) * b / (r.finished - r.started) for r, b in zip(results, batches, strict=True))
    return Window(latency, throughput)


def start_instances(prepared: PreparedModel, plan: Plan, topology: CpuTopology, warmup: int) -> list[InstanceProcess]:
    instances = []
    for slot in allocate(plan, topology):
        job = InstanceJob(prepared.spec.to_dict(), str(prepared.artefact), slot.threads, slot.batch, slot.cores, warmup)
        instances.append(InstanceProcess(job).start())
    for inst in instances:
        inst.wait_ready()
    return instances


def bench_batch(
    prepared: PreparedModel, optimizer: KnapsackOptimizer, topology: CpuTopology, T: int, B: int, args
) -> dict:
    plan = optimizer.plan(T, B, uniform=args.uniform)
    expected = expected_speedup(optimizer, plan)
    fat = start_instances(prepared, fat_plan(T, B), topology, args.warmup)
    packrat = start_instances(prepared, plan, topology, args.warmup)
    fat_b = [inst.job.batch for inst in fat]
    pk_b = [inst.job.batch for inst in packrat]
    fat_windows, pk_windows = [], []
    try:
        for r in range(args.repeats):
            # ABBA order: neither configuration always runs first.
            order = ("fat", "pk") if r % 2 == 0 else ("pk", "fat")
            for which in order:
                if which == "fat":
                    fat_windows.append(summarise(run_concurrently(fat, args.seconds, args.min_iters), fat_b))
                else:
                    pk_windows.append(summarise(run_concurrently(packrat, args.seconds, args.min_iters), pk_b))
    finally:
        for inst in fat + packrat:
            inst.stop()
    lat_speedups = [f.latency_ms / p.latency_ms for f, p in zip(fat_windows, pk_windows, strict=True)]
    tput_speedups = [p.throughput / f.throughput for f, p in zip(fat_windows, pk_windows, strict=True)]
    med, lo, hi = median_and_spread(lat_speedups)
    return {
        "batch": B,
        "plan": [i.to_dict() for i in plan.instances],
        "fat_latency_ms": statistics.median(w.latency_ms for w in fat_windows),
        "packrat_latency_ms": statistics.median(w.latency_ms for w in pk_windows),
        "latency_speedup": med,
        "latency_speedup_min": lo,
        "latency_speedup_max": hi,
        "throughput_speedup": statistics.median(tput_speedups),
        "expected_speedup": expected,
        "repeats": args.repeats,
    }


def plot(data: dict, path: Path) -> None:
    speedup_bars(
        data["rows"],
        [("measured (median, min-max)", "latency_speedup"), ("expected (profile)", "expected_speedup")],
        "batch size B",
        "latency speedup over fat instance",
        f"Packrat vs ⟨1,{data['threads']},B⟩: {data['model']} ({data['mode']})",
        path,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="catalog name or .mar")
    parser.add_argument("--profile", type=Path, help="default: profiles/<model>.json, else profile this machine")
    parser.add_argument("--batches", default="2,4,8,16")
    parser.add_argument("--threads", type=int, help="T (default: all usable cores)")
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one timed window")
    parser.add_argument("--min-iters", type=int, default=3, help="iterations per instance per window, at least")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--uniform", action="store_true", help="restrict plans to one (t, b) class")
    parser.add_argument("--force", action="store_true", help="use a profile from other hardware")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    parser.add_argument("--json", type=Path, help="also write the JSON result here")
    args = parser.parse_args(argv)

    profile, _ = profile_for_this_machine(args.model, args.profile, args.force)
    topology = CpuTopology.from_system()
    T = args.threads or len(topology.cores)
    optimizer = KnapsackOptimizer(profile)
    prov = provenance("bench.packrat_micro")
    rows = []
    with tempfile.TemporaryDirectory(prefix="packrat-micro-") as tmp:
        prepared = prepare_model(args.model, profile.meta.get("mode", "script"), Path(tmp))
        for B in tqdm(parse_int_list(args.batches), desc=f"micro {args.model}", unit="B"):
            rows.append(bench_batch(prepared, optimizer, topology, T, B, args))
    data = {
        "model": prepared.spec.name,
        "mode": prepared.spec.mode,
        "threads": T,
        "rows": rows,
        "mean_latency_speedup": statistics.fmean(r["latency_speedup"] for r in rows),
        "provenance": prov,
    }
    stem = f"packrat_micro_{prepared.spec.name}" + (f"_T{T}" if args.threads else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    plot(data, args.out_dir / f"{stem}.png")
    table = markdown_table(PACKRAT_ROW_HEADER, [packrat_row_cells(r) for r in rows])
    markdown = (
        f"# Packrat micro-benchmark: {data['model']} ({data['mode']}), T={T}\n\n"
        f"Fat instance ⟨1,{T},B⟩ vs Packrat's plan, real pinned processes, no TorchServe; "
        f"{args.repeats} interleaved windows of {args.seconds:g} s each per configuration.\n\n"
        f"{table}\n\nMean latency speedup: **{data['mean_latency_speedup']:.2f}×**\n\n"
        f"![speedups]({stem}.png)\n\n{provenance_block(prov)}"
    )
    path = write_outputs(stem, markdown, data, args.out_dir)
    if args.json:
        args.json.write_text((args.out_dir / f"{stem}.json").read_text())
    print(markdown)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
